"""The identity of a run's base model (``model.pretrained``): what a LoRA, a hypernetwork, a
ControlNet or a fine-tuned denoiser was trained on, so that nothing later pairs it with
another model by accident.

A run trained over a base folder (or single file) holds only what it trained; sampling,
exporting, merging and resuming load the rest from ``model.pretrained`` again. A path can
come to mean another model: a relative path read from another working directory, a folder
replaced by a newer download, a symlink moved. So a run records, at its first start, the
base's **identity**: the sha256 of every file that makes the model (weights, configs,
tokenizer files) under the base folder (and ``model.single_file_config``'s folder), and one
sha256 over those (relative name, file sha256) pairs. The combined hash does not depend on
where the folder lies, so a moved or copied base is the same base; one changed byte is not.

Hashing reads every weight file once (~1 s per GB). The record keeps each file's size,
modification time and inode-change time (``st_ctime``, which no tool can set back) next to its
sha256: a later check of the same path re-hashes only the files whose size or times changed,
so a file rewritten in place, even with its modification time restored, is hashed again; a
moved or copied base is always hashed again.

``model.pretrained`` and ``model.single_file_config`` are made absolute when a run starts
(:func:`absolute`), so the saved config names the folder trained on, whatever the working
directory of a later command.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from ...config import Config, replace

__all__ = ["BaseMismatchError", "IDENTITY_SUFFIXES", "absolute", "base_identity",
           "check_base", "with_base"]

# The files that make a model: weights, configs, tokenizer vocabularies. Anything else in the
# folder (a README, preview images, notes) may change without changing the model.
IDENTITY_SUFFIXES: tuple[str, ...] = (".safetensors", ".bin", ".ckpt", ".pt", ".pth",
                                      ".json", ".txt", ".model", ".yaml", ".yml")
_CHUNK = 1 << 20


class BaseMismatchError(ValueError):
    """The base model found is not the one a run was trained on (exit 2)."""


def absolute(cfg: Config) -> Config:
    """``cfg`` with ``model.pretrained`` and ``model.single_file_config`` absolute (``~``
    expanded), as the run records them; unchanged when they already are, are unset, or name
    nothing on disk (a typo or a hub id keeps its own words for the error that follows)."""
    m = cfg.model
    changes: dict[str, Any] = {}
    for key in ("pretrained", "single_file_config"):
        v = getattr(m, key, None)
        if v and key == "pretrained" and not Path(v).expanduser().exists():
            from .folder import SDFolderError, hub_id_message, is_hub_id

            if is_hub_id(v):  # before it becomes a path: a hub id is answered, not looked up
                raise SDFolderError(hub_id_message(v))
        if v and Path(v).expanduser().exists():
            a = str(Path(v).expanduser().absolute())
            if a != v:
                changes[f"model.{key}"] = a
    return replace(cfg, changes) if changes else cfg


def with_base(cfg: Config, base: str | os.PathLike[str] | None) -> Config:
    """``cfg`` with its base model at ``base`` (``--base PATH``: the moved original), made
    absolute; ``cfg`` itself for None."""
    if base is None:
        return cfg
    return absolute(replace(cfg, {"model.pretrained": str(base)}))


def _files(root: Path) -> list[tuple[str, Path]]:
    """The identity files of ``root`` (a folder: recursively, hidden ones left out; a file:
    itself) as ``(name relative to root, path)``, sorted."""
    if root.is_file():
        return [(root.name, root)]
    out = []
    for d, dirs, names in os.walk(root):
        dirs[:] = sorted(x for x in dirs if not x.startswith("."))
        for n in names:
            if n.startswith(".") or not n.lower().endswith(IDENTITY_SUFFIXES):
                continue
            p = Path(d) / n
            if p.is_file():
                out.append((p.relative_to(root).as_posix(), p))
    return sorted(out)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def base_identity(pretrained: str | os.PathLike[str], single_file_config: str | None = None,
                  known: dict[str, Any] | None = None) -> dict[str, Any]:
    """The identity of the base at ``pretrained`` (a folder or a single file, with its
    config folder).

    Args:
        pretrained, single_file_config: ``model.pretrained`` and
            ``model.single_file_config``.
        known: an earlier identity of the same paths: a file whose size and modification
            time are those recorded there keeps its recorded sha256 (not read again).

    Returns:
        ``{"path", "config", "sha256", "files": {name: [size, mtime_ns, ctime_ns, sha256]}}``;
        names are relative to the base (``config/...`` for the single file's config folder).

    Raises:
        BaseMismatchError: the base does not exist or cannot be read (the message names it).
    """
    root = Path(pretrained).expanduser().absolute()
    conf = Path(single_file_config).expanduser().absolute() if single_file_config else None
    same_place = (known is not None and known.get("path") == str(root)
                  and known.get("config") == (str(conf) if conf else None))
    before = (known or {}).get("files", {}) if same_place else {}
    files: dict[str, list[Any]] = {}
    for top, prefix in ((root, ""), (conf, "config/")):
        if top is None:
            continue
        if not top.exists():
            raise BaseMismatchError(f"the base model {top} does not exist")
        try:
            for name, p in _files(top):
                st = p.stat()
                key = prefix + name
                stamp = [st.st_size, st.st_mtime_ns, st.st_ctime_ns]
                old = before.get(key)
                digest = old[3] if old and old[:3] == stamp else _sha256(p)
                files[key] = [*stamp, digest]
        except OSError as e:
            raise BaseMismatchError(f"the base model {top} cannot be read "
                                    f"({e.strerror or e}: {e.filename})") from None
    if not files:
        raise BaseMismatchError(f"the base model {root} holds no model files "
                                f"({', '.join(IDENTITY_SUFFIXES)})")
    combined = hashlib.sha256(json.dumps(sorted((k, v[3]) for k, v in files.items()))
                              .encode()).hexdigest()
    return {"path": str(root), "config": str(conf) if conf else None, "sha256": combined,
            "files": files}


def _differences(a: dict[str, Any], b: dict[str, Any]) -> str:
    """The files that differ between two identities, for the message (a few named)."""
    fa, fb = a.get("files", {}), b.get("files", {})
    only_a = sorted(set(fa) - set(fb))
    only_b = sorted(set(fb) - set(fa))
    changed = sorted(k for k in set(fa) & set(fb) if fa[k][-1] != fb[k][-1])
    parts = []
    for what, names in (("changed", changed), ("only in the recorded base", only_a),
                        ("only in this one", only_b)):
        if names:
            more = f" and {len(names) - 3} more" if len(names) > 3 else ""
            parts.append(f"{what}: {', '.join(names[:3])}{more}")
    return "; ".join(parts) or "the same files, other contents"


def check_base(recorded: dict[str, Any] | None, cfg: Config, what: str) -> dict[str, Any]:
    """The identity of ``cfg``'s base, refused unless it is the ``recorded`` one.

    Args:
        recorded: the identity the run recorded (state.json ``base``); None (a run of an
            earlier version): nothing to compare, the current identity is returned.
        cfg: the config naming the base now (``--base`` already applied: :func:`with_base`).
        what: the run or checkpoint, for the message.

    Raises:
        BaseMismatchError: another base (both identities, the differing files, and how to
            point at the original), or a base that cannot be read.
    """
    m = cfg.model
    try:
        now = base_identity(m.pretrained, m.single_file_config, known=recorded)
    except BaseMismatchError as e:
        if recorded is None:
            raise
        raise BaseMismatchError(f"{what} was trained on the base {recorded['path']} "
                                f"(sha256 {recorded['sha256'][:16]}...), but {e}; pass the "
                                f"base's new location with --base PATH") from None
    if recorded is not None and now["sha256"] != recorded.get("sha256"):
        raise BaseMismatchError(
            f"{what} was trained on another base model: it records {recorded['path']} with "
            f"identity sha256 {str(recorded.get('sha256'))[:16]}..., but {now['path']} has "
            f"{now['sha256'][:16]}... ({_differences(recorded, now)}). Pairing them would "
            f"draw from a model it was not trained on: pass the original's location with "
            f"--base PATH (for train: --set model.pretrained=PATH)")
    return now
