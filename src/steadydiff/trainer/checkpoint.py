"""Atomic, verified checkpoints.

A checkpoint is a directory ``checkpoints/step_00001234/``:

    model.safetensors   the unwrapped model's weights
    ema.safetensors     the EMA weights
    optimizer.pt        optimizer state (tensors, numbers, strings: loads with weights_only=True)
    rng.pt              every RNG the run uses (python, numpy, torch CPU/CUDA)
    state.json          step counters, data position, EMA/scaler state, the resolved config
    posthoc.safetensors (train.ema_posthoc only) the post-hoc EMA profiles' running averages
    manifest.json       size and sha256 of every file above; written last

A sharded run (``train.parallel=fsdp``) writes the same directory with the tensors through
``torch.distributed.checkpoint`` (DCP) instead, every rank its own shards:

    dcp/.metadata       DCP's index of every tensor's shards (rank 0 writes it last)
    dcp/__R_I.distcp    rank R's shards of the model, EMA and optimizer state
    rng.pt, state.json  as above
    manifest.json       ``"layout": "sharded"``, the world size, and the size and sha256 of
                        every file every rank wrote (each rank hashes its own)

It is written to the same kind of hidden temporary directory and renamed into place by rank 0
only after every rank has reported its files, so a rank that dies mid-write leaves a
temporary directory that is never used. DCP's ``.metadata`` is a pickle: it is read through an
allow-list unpickler that builds DCP's own records only, and non-tensor items load
``weights_only=True`` (:mod:`.safe_dcp`): a doctored folder is refused, nothing in it runs. A sharded
checkpoint loads on any number of processes (DCP reshards), and on one process without a
process group (consolidated: :func:`load_checkpoint`).

It is written to a hidden temporary directory, every file fsynced, then renamed into place,
and the ``latest`` pointer is replaced atomically (``os.replace``). A kill at any moment leaves
either the old or the new checkpoint complete, never a half-written one under a real name.
Only checkpoints whose weights and EMA were checked finite are written at all, and rotation
never deletes the last good checkpoint before a newer one is complete.

Loading verifies the manifest first: a truncated file or a flipped byte is reported and the
previous good checkpoint is used. Nothing is unpickled: tensors come from safetensors, and
``torch.load`` is always called with an explicit ``weights_only=True`` (an explicit True
survives ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1``; the default does not).
"""

from __future__ import annotations

import hashlib
import json
import pickle
import logging
import os
import random
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from ..devices import resolve_device

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
FILES = ("model.safetensors", "ema.safetensors", "optimizer.pt", "rng.pt", "state.json")
# optional tensor files a checkpoint may hold besides FILES (verified when its manifest lists
# them, and then required): the post-hoc EMA profiles
EXTRA_FILES = ("posthoc.safetensors",)
_NAME = re.compile(r"^step_(\d{8,})$")  # the one definition of a checkpoint's name
# a sharded checkpoint (train.parallel=fsdp): DCP's folder, and the files it always holds
SHARDED = "sharded"  # manifest.json's "layout"
DCP_DIR = "dcp"
SHARDED_FILES = ("rng.pt", "state.json", f"{DCP_DIR}/.metadata")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used (corrupt, incomplete, non-finite, or unsafe)."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file that would run code if loaded (a pickle payload, DCP metadata
    naming anything but DCP's own records): refused, never unpickled. Not a finding about a
    run's health: every command, ``doctor`` included, stops on it (exit 2)."""


# --------------------------------------------------------------------------- helpers


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def sha256_of(path: Path) -> str:
    """The sha256 of a file, hex (what manifests record)."""
    return _sha256(path)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    from ..files import fsync_dir  # files.py owns the rule
    fsync_dir(path)


def _follow_umask(path: Path) -> None:
    """Give ``path`` the mode a plain ``open()`` would (files.py owns the rule)."""
    from ..files import follow_umask

    follow_umask(path)


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=1, sort_keys=True))


def save_tensors_atomic(path: Path, tensors: dict[str, torch.Tensor],
                        metadata: dict[str, str] | None = None) -> Path:
    """Write ``tensors`` to the safetensors file ``path`` atomically: a temporary file in the
    same folder, fsynced, renamed over ``path``, the folder fsynced. A kill leaves the old file
    or the new one, never half of one. Returns ``path``."""
    from ..files import atomic_output

    with atomic_output(path) as tmp:
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp),
                  metadata=metadata)
    return path


def nonfinite_tensors(state_dict: dict[str, torch.Tensor]) -> list[str]:
    """Names of floating tensors in ``state_dict`` holding NaN or Inf (one host sync)."""
    names = [k for k, v in state_dict.items() if v.is_floating_point()]
    if not names:
        return []
    flags = torch.stack([torch.isfinite(state_dict[k]).all() for k in names]).cpu()
    return [k for k, ok in zip(names, flags.tolist()) if not ok]


def _tensor_dict(module: torch.nn.Module | dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    sd = module if isinstance(module, dict) else module.state_dict()  # a dict: adapter only
    return {k: v.detach().contiguous() for k, v in sd.items()}


# --------------------------------------------------------------------------- RNG


def capture_rng() -> dict[str, Any]:
    """Every global RNG the run touches, in a form ``torch.load(weights_only=True)`` accepts."""
    py = random.getstate()
    np_state = np.random.get_state()
    out: dict[str, Any] = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), int(np_state[2]),
                  int(np_state[3]), float(np_state[4])],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def restore_rng(state: dict[str, Any]) -> None:
    v, internal, gauss = state["python"]
    random.setstate((v, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# --------------------------------------------------------------------------- save


@dataclass
class Checkpoint:
    """A loaded checkpoint: tensors on the requested device, state as plain data."""

    path: Path
    model: dict[str, torch.Tensor]
    ema: dict[str, torch.Tensor]
    optimizer: dict[str, Any] | None
    rng: dict[str, Any] | None
    state: dict[str, Any]
    nonfinite: list[str] = field(default_factory=list)  # loaded with allow_nonfinite only
    extra: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  # EXTRA_FILES
    # a sharded checkpoint loaded without consolidating: its DCP folder (tensors not read)
    sharded: Path | None = None

    @property
    def step(self) -> int:
        return int(self.state["step"])


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def step_of(path: Path) -> int | None:
    """The step a checkpoint directory's name says (``step_00001234`` -> 1234), else None."""
    m = _NAME.match(Path(path).name)
    return int(m.group(1)) if m else None


def is_checkpoint_dir(path: Path) -> bool:
    """Whether ``path`` looks like one checkpoint (named like one, or holding its files)."""
    p = Path(path)
    return p.is_dir() and ((p / "manifest.json").is_file() or (p / "model.safetensors").is_file()
                           or step_of(p) is not None)


def save_checkpoint(root: Path, step: int, *, model: torch.nn.Module | dict[str, torch.Tensor],
                    ema: torch.nn.Module | dict[str, torch.Tensor],
                    optimizer: torch.optim.Optimizer, state: dict[str, Any],
                    keep: int = 3, on_file: Callable[[str], None] | None = None,
                    extra: dict[str, dict[str, torch.Tensor]] | None = None) -> Path:
    """Write a verified checkpoint for ``step`` under ``root`` and point ``latest`` at it.

    Raises :class:`CheckpointError` (and writes nothing) if the model or EMA holds a
    non-finite value: a diverged state must never replace the last good checkpoint.
    ``on_file(name)`` is called once the model weights are written, mid-save (fault
    injection kills the process there). ``extra`` maps a name of :data:`EXTRA_FILES` to
    more tensors (checked finite, listed in the manifest). Returns the checkpoint directory.
    """
    root.mkdir(parents=True, exist_ok=True)
    name = checkpoint_name(step)
    final = write_checkpoint_dir(root / name, step, model=model, ema=ema, optimizer=optimizer,
                                 state=state, on_file=on_file, extra=extra)
    _set_latest(root, name)
    _rotate(root, keep, protect=name)
    return final


def write_checkpoint_dir(final: Path, step: int, *,
                         model: torch.nn.Module | dict[str, torch.Tensor],
                         ema: torch.nn.Module | dict[str, torch.Tensor],
                         optimizer: torch.optim.Optimizer | dict[str, Any],
                         state: dict[str, Any], on_file: Callable[[str], None] | None = None,
                         extra: dict[str, dict[str, torch.Tensor]] | None = None) -> Path:
    """Write one verified checkpoint directory at ``final`` (any name: ``steadydiff ema``
    writes ``checkpoints/posthoc_best``), atomically, replacing one already there; no
    ``latest`` pointer, no rotation (:func:`save_checkpoint` adds them). ``optimizer`` may be
    its state dict. Raises :class:`CheckpointError` on non-finite tensors (nothing written)."""
    model_sd, ema_sd = _tensor_dict(model), _tensor_dict(ema)
    extra = {k: _tensor_dict(v) for k, v in (extra or {}).items()}
    unknown = sorted(set(extra) - set(EXTRA_FILES))
    if unknown:
        raise ValueError(f"unknown checkpoint files {unknown}; known: {list(EXTRA_FILES)}")
    bad = nonfinite_tensors(model_sd) + [f"ema:{k}" for k in nonfinite_tensors(ema_sd)]
    for f, sd in extra.items():
        bad += [f"{f.split('.')[0]}:{k}" for k in nonfinite_tensors(sd)]
    if bad:
        raise CheckpointError(
            f"refusing to write checkpoint at step {step}: non-finite values in "
            f"{', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}")

    root, name = final.parent, final.name
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        save_file({k: v.cpu() for k, v in model_sd.items()}, str(tmp / "model.safetensors"))
        if on_file:
            on_file("model.safetensors")
        save_file({k: v.cpu() for k, v in ema_sd.items()}, str(tmp / "ema.safetensors"))
        for f, sd in extra.items():
            save_file({k: v.cpu() for k, v in sd.items()}, str(tmp / f))
        opt_sd = optimizer if isinstance(optimizer, dict) else optimizer.state_dict()
        torch.save(opt_sd, tmp / "optimizer.pt")
        torch.save(capture_rng(), tmp / "rng.pt")
        _write_json(tmp / "state.json", {**state, "step": step, "format": FORMAT_VERSION})
        manifest = {"format": FORMAT_VERSION, "step": step, "finite": True, "files": {}}
        for f in FILES + tuple(extra):
            _follow_umask(tmp / f)  # the run's other files' permissions, not 0600
            _fsync_file(tmp / f)
            manifest["files"][f] = {"size": (tmp / f).stat().st_size, "sha256": _sha256(tmp / f)}
        _write_json(tmp / "manifest.json", manifest)
        _fsync_file(tmp / "manifest.json")
        _fsync_dir(tmp)
        _replace_dir(tmp, final)  # the same step saved again (e.g. a rerun): swapped
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _set_latest(root: Path, name: str) -> None:
    tmp = root / f".latest-{os.getpid()}"
    tmp.write_text(name + "\n")
    _fsync_file(tmp)
    os.replace(tmp, root / "latest")
    _fsync_dir(root)


def list_checkpoints(root: Path) -> list[Path]:
    """Checkpoint directories under ``root``, newest step first (temporaries excluded)."""
    if not root.is_dir():
        return []
    found = [(step, p) for p in root.iterdir() if p.is_dir() and (step := step_of(p)) is not None]
    return [p for _, p in sorted(found, reverse=True)]


def candidates(root: Path) -> list[Path]:
    """Checkpoints under ``root`` in the order to try them: the one the ``latest`` pointer
    names first, then the others newest first (verification is the caller's)."""
    found = list_checkpoints(root)
    pointer = root / "latest"
    if pointer.is_file():
        named = root / pointer.read_text().strip()
        if named in found:
            found.remove(named)
            found.insert(0, named)
    return found


# what this module's writers name their temporaries (a checkpoint, ``latest``): rotation
# sweeps these and nothing else a user may have put under checkpoints/
_TEMPORARY = re.compile(r"^\.(tmp-step_\d{8,}|old-step_\d{8,}|latest)-\d+$")


def _rotate(root: Path, keep: int, protect: str) -> None:
    # Only complete (manifest-bearing) checkpoints count toward `keep`; the one just written
    # is always among them, so the last good checkpoint is never deleted first.
    complete = [p for p in list_checkpoints(root) if (p / "manifest.json").is_file()]
    for p in complete[keep:]:
        if p.name != protect:
            shutil.rmtree(p, ignore_errors=True)
    for p in root.iterdir():  # temporaries left by a killed writer, named as we name them
        if _TEMPORARY.match(p.name) and not p.name.endswith(f"-{os.getpid()}"):
            shutil.rmtree(p, ignore_errors=True)


# --------------------------------------------------------------------------- verify / load


def verify_checkpoint(path: Path) -> list[str]:
    """Problems found in the checkpoint at ``path`` (empty when it is intact)."""
    mf = path / "manifest.json"
    if not mf.is_file():
        return [f"{path}: no manifest.json (incomplete or not a steadydiff checkpoint)"]
    try:
        manifest = json.loads(mf.read_text())
        files = manifest["files"]
    except (ValueError, KeyError, TypeError) as e:
        return [f"{mf}: unreadable manifest ({e})"]
    problems = []
    if manifest.get("layout") == SHARDED:  # every rank's DCP files, as listed
        required = SHARDED_FILES + tuple(sorted(set(files) - set(SHARDED_FILES)))
    else:
        required = FILES + tuple(f for f in EXTRA_FILES if f in files)
    for f in required:
        entry = files.get(f)
        p = path / f
        if entry is None:
            problems.append(f"{path}: manifest does not list {f}")
        elif not p.is_file():
            problems.append(f"{p}: missing")
        elif p.stat().st_size != entry.get("size"):
            problems.append(f"{p}: size {p.stat().st_size} bytes, manifest says {entry.get('size')}"
                            " (truncated or replaced)")
        elif _sha256(p) != entry.get("sha256"):
            problems.append(f"{p}: sha256 does not match the manifest (corrupted)")
    if not problems:
        problems += _step_mismatch(path, manifest)
    return problems


def _step_mismatch(path: Path, manifest: dict[str, Any]) -> list[str]:
    """A checkpoint whose name says one step and whose records say another (a renamed or
    re-linked directory) would resume at the wrong place: a verification problem."""
    named = step_of(path)
    if named is None:
        return []
    try:
        in_state = json.loads((path / "state.json").read_text()).get("step")
    except (OSError, ValueError, AttributeError):
        in_state = None  # unreadable state.json: load_checkpoint says why
    recorded = {"manifest.json": manifest.get("step"), "state.json": in_state}
    return [f"{path}: named step {named} but its {name} records step {step} (renamed, "
            "copied or linked under the wrong name)"
            for name, step in recorded.items() if step is not None and step != named]


def resolve_checkpoint(path: str | Path) -> Path:
    """Turn a run directory, a ``checkpoints/`` directory or a checkpoint into the newest
    intact checkpoint directory; corrupt ones are reported and skipped."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"no such checkpoint or run directory: {p}")
    if (p / "manifest.json").exists() or step_of(p) is not None:
        problems = verify_checkpoint(p)
        if problems:
            raise CheckpointError("checkpoint failed verification:\n  " + "\n  ".join(problems))
        return p
    root = p / "checkpoints" if (p / "checkpoints").is_dir() else p
    found = latest_good(root)
    if found is None:
        raise CheckpointError(f"no intact checkpoint found under {root}")
    return found


def latest_good(root: Path) -> Path | None:
    """The newest checkpoint under ``root`` that passes verification, or None.

    The ``latest`` pointer is tried first; a checkpoint that fails verification is logged
    with the reason and the next older one is tried.
    """
    for c in candidates(root):
        problems = verify_checkpoint(c)
        if not problems:
            return c
        log.warning("skipping corrupt checkpoint %s: %s", c, "; ".join(problems))
    return None


def load_checkpoint(path: Path, device: torch.device | str = "cpu", *,
                    weights_only: bool = False, allow_nonfinite: bool = False,
                    consolidate: bool = True) -> Checkpoint:
    """Load a verified checkpoint directory. ``weights_only`` skips optimizer and RNG;
    ``allow_nonfinite`` returns weights holding NaN/Inf (named in ``Checkpoint.nonfinite``)
    instead of refusing them: for looking at a diverged model, never for training it.

    A sharded checkpoint is read whole into one process (``consolidate``: full tensors in
    ``model``/``ema``, the optimizer keyed by parameter name); ``consolidate=False`` leaves
    its tensors on disk (``Checkpoint.sharded`` is their DCP folder): a training run loads
    them straight into its own, possibly sharded, state (:func:`load_sharded_into`)."""
    # first: an absent accelerator is a DeviceError, not a file that "cannot be loaded safely"
    dev = str(resolve_device(device))
    problems = verify_checkpoint(path)
    if problems:
        raise CheckpointError("checkpoint failed verification:\n  " + "\n  ".join(problems))

    def safely(name: str, load):
        try:
            return load(path / name)
        except Exception as e:  # a doctored file: refuse it, say which and why
            # torch's own advice ("re-run with weights_only=False") is exactly wrong for a
            # hostile file: keep only what was refused
            from .safe_dcp import UnsafeCheckpoint, why_refused

            why = why_refused(e)

            kind = (UnsafeCheckpointError if isinstance(e, (pickle.UnpicklingError,
                                                            UnsafeCheckpoint))
                    else CheckpointError)
            raise kind(f"{path / name}: cannot be loaded safely ({type(e).__name__}: {why}); "
                       f"it was not unpickled. Load it only through steadydiff, or not at "
                       f"all, unless you made it yourself.") from None

    state = safely("state.json", lambda p: json.loads(p.read_text()))
    if is_sharded_checkpoint(path):
        return _load_sharded(path, dev, state, safely, weights_only=weights_only,
                             consolidate=consolidate, allow_nonfinite=allow_nonfinite)
    model = safely("model.safetensors", lambda p: load_file(str(p), device=dev))
    ema = safely("ema.safetensors", lambda p: load_file(str(p), device=dev))
    listed = json.loads((path / "manifest.json").read_text())["files"]
    extra = {f: safely(f, lambda p: load_file(str(p), device=dev))
             for f in EXTRA_FILES if f in listed}
    opt = rng = None
    if not weights_only:
        opt = safely("optimizer.pt", lambda p: torch.load(p, map_location=dev, weights_only=True))
        rng = safely("rng.pt", lambda p: torch.load(p, map_location="cpu", weights_only=True))
    # safetensors loads NaN/Inf without complaint; a checkpoint is only usable if finite.
    bad = nonfinite_tensors(model) + [f"ema:{k}" for k in nonfinite_tensors(ema)]
    if bad and not allow_nonfinite:
        raise CheckpointError(f"{path}: {nonfinite_message(bad)}")
    return Checkpoint(path, model, ema, opt, rng, state, nonfinite=bad, extra=extra)


def nonfinite_message(names: list[str]) -> str:
    """How a checkpoint's non-finite tensors are named in errors."""
    return f"non-finite weights in {', '.join(names[:5])}"



# --------------------------------------------------------------------------- sharded (DCP)


def is_sharded_checkpoint(path: Path) -> bool:
    """Whether the checkpoint at ``path`` is a sharded (DCP) one (its manifest says so)."""
    try:
        return json.loads((Path(path) / "manifest.json").read_text()).get("layout") == SHARDED
    except (OSError, ValueError, AttributeError):
        return (Path(path) / DCP_DIR).is_dir()


def _dcp_state(model: torch.nn.Module, ema: torch.nn.Module,
               optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """What a sharded checkpoint holds, keyed by name: DCP's own state-dict views of the
    model, the EMA and the optimizer (sharded DTensors under FSDP, plain tensors otherwise)."""
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                         get_optimizer_state_dict)

    out: dict[str, Any] = {"model": get_model_state_dict(model),
                           "ema": get_model_state_dict(ema)}
    if optimizer is not None:
        out["optimizer"] = get_optimizer_state_dict(model, optimizer)
    return out


def _files_of(tmp: Path, prefix: str) -> dict[str, dict[str, Any]]:
    """Size and sha256 of the files under ``tmp/DCP_DIR`` whose names start with ``prefix``
    (fsynced first), keyed by their path in the checkpoint."""
    out = {}
    for p in sorted((tmp / DCP_DIR).iterdir()):
        if p.name.startswith(prefix) and p.is_file():
            _follow_umask(p)
            _fsync_file(p)
            out[f"{DCP_DIR}/{p.name}"] = {"size": p.stat().st_size, "sha256": _sha256(p)}
    return out


def save_sharded(root: Path, step: int, *, model: torch.nn.Module, ema: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, state: dict[str, Any], keep: int = 3,
                 on_file: Callable[[str], None] | None = None) -> Path:
    """Write a verified sharded checkpoint for ``step`` under ``root`` (every rank calls
    this: it is a collective) and point ``latest`` at it.

    Every rank checks its shards finite (one all-gather: a non-finite value on any rank
    refuses the checkpoint on all of them, nothing written), writes its shards through DCP
    into the temporary directory and hashes them; rank 0 writes ``rng.pt``, ``state.json``
    and, once every rank has reported, the manifest; then renames the directory into place,
    moves ``latest`` and rotates. ``on_file("dcp")`` runs on each rank after its shards are
    written (fault injection kills a rank there). Every rank returns the same path or raises
    the same :class:`CheckpointError`/``OSError``."""
    import torch.distributed.checkpoint as dcp

    from .. import distributed
    from ..sharding import local

    rank = distributed.rank()
    tensors = _dcp_state(model, ema, optimizer)
    mine = [f"ema:{k}" if part == "ema" else k
            for part in ("model", "ema")
            for k in nonfinite_tensors({n: local(v) for n, v in tensors[part].items()})]
    bad = sorted({b for r in distributed.gather_objects(mine) for b in r})
    if bad:
        raise CheckpointError(
            f"refusing to write checkpoint at step {step}: non-finite values in "
            f"{', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}")
    name = checkpoint_name(step)
    final = root / name
    tmp = root / distributed.broadcast_object(f".tmp-{name}-{os.getpid()}")
    problem: BaseException | None = None
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            (tmp / DCP_DIR).mkdir(parents=True)
        except OSError as e:
            problem = e
    _agree(problem)
    try:
        dcp.save(tensors, checkpoint_id=str(tmp / DCP_DIR))
        if on_file:
            on_file(DCP_DIR)
        problem, files = None, {}
        try:
            files = _files_of(tmp, f"__{rank}_")
            if rank == 0:
                torch.save(capture_rng(), tmp / "rng.pt")
                _write_json(tmp / "state.json", {**state, "step": step,
                                                 "format": FORMAT_VERSION})
                files.update(_files_of(tmp, ".metadata"))
                for f in ("rng.pt", "state.json"):
                    _follow_umask(tmp / f)
                    _fsync_file(tmp / f)
                    files[f] = {"size": (tmp / f).stat().st_size, "sha256": _sha256(tmp / f)}
        except OSError as e:
            problem = e
        reports = distributed.gather_objects((files, problem))
        _agree(next((p for _, p in reports if p is not None), None))
        if rank == 0:
            try:
                listed: dict[str, Any] = {}
                for f, _ in reports:
                    listed.update(f)
                manifest = {"format": FORMAT_VERSION, "layout": SHARDED, "step": step,
                            "world_size": len(reports), "finite": True, "files": listed}
                _write_json(tmp / "manifest.json", manifest)
                _fsync_file(tmp / "manifest.json")
                _fsync_dir(tmp / DCP_DIR)
                _fsync_dir(tmp)
                _replace_dir(tmp, final)
                _set_latest(root, name)
                _rotate(root, keep, protect=name)
            except OSError as e:
                problem = e
        _agree(problem)
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _agree(problem: BaseException | None) -> None:
    """Raise on every rank what went wrong on the first rank where something did."""
    from .. import distributed

    problems = distributed.gather_objects(problem)
    first = next((p for p in problems if p is not None), None)
    if first is not None:
        raise first


def _replace_dir(tmp: Path, final: Path) -> None:
    """Rename ``tmp`` to ``final``; one already there (the same step saved again) is swapped
    out first and dropped after."""
    root = final.parent
    if final.exists():
        old = root / f".old-{final.name}-{os.getpid()}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _fsync_dir(root)


def _load_sharded(path: Path, dev: str, state: dict[str, Any], safely, *, weights_only: bool,
                  consolidate: bool, allow_nonfinite: bool) -> Checkpoint:
    rng = None if weights_only else safely(
        "rng.pt", lambda p: torch.load(p, map_location="cpu", weights_only=True))
    if not consolidate:
        return Checkpoint(path, {}, {}, None, rng, state, sharded=path / DCP_DIR)
    full = safely(DCP_DIR, read_sharded)
    model = {k: v.to(dev) for k, v in full["model"].items()}
    ema = {k: v.to(dev) for k, v in full["ema"].items()}
    opt = None if weights_only else full.get("optimizer")
    bad = nonfinite_tensors(model) + [f"ema:{k}" for k in nonfinite_tensors(ema)]
    if bad and not allow_nonfinite:
        raise CheckpointError(f"{path}: {nonfinite_message(bad)}")
    return Checkpoint(path, model, ema, opt, rng, state, nonfinite=bad)


def read_sharded(folder: Path) -> dict[str, Any]:
    """Every tensor of a DCP folder, whole, in this process (no process group needed): the
    consolidated ``{"model", "ema", "optimizer"}`` of a sharded checkpoint, on the CPU.
    DCP's ``.metadata`` and non-tensor items go through :mod:`.safe_dcp` (an allow-list
    unpickler, ``weights_only=True``): a doctored folder is refused, nothing in it runs."""
    # DCP's own consolidation (what its dcp_to_torch_save does, without the extra file):
    # the empty-state planner reads every tensor in the metadata, whole
    from . import safe_dcp

    out: dict[str, Any] = {}
    safe_dcp.load(out, folder, consolidate=True, no_dist=True)
    return out


def load_sharded_into(folder: Path, *, model: torch.nn.Module, ema: torch.nn.Module,
                      optimizer: torch.optim.Optimizer) -> None:
    """Load a sharded checkpoint's DCP folder into a live run's model, EMA and optimizer,
    whatever their layout: FSDP over any number of ranks (DCP reads each rank's part,
    resharding), or a plain model in one process or under DDP (full tensors). Every rank
    of the run calls it."""
    from torch.distributed.checkpoint.state_dict import (set_model_state_dict,
                                                         set_optimizer_state_dict)

    from .. import distributed

    from . import safe_dcp

    want = _dcp_state(model, ema, optimizer)
    try:
        safe_dcp.load(want, folder, consolidate=False, no_dist=not distributed.group_exists())
    except safe_dcp.UnsafeCheckpoint as e:
        raise UnsafeCheckpointError(f"{folder}: cannot be loaded safely: {e}") from None
    set_model_state_dict(model, want["model"])
    set_model_state_dict(ema, want["ema"])
    set_optimizer_state_dict(model, optimizer, want["optimizer"])


def load_full_into(c: Checkpoint, *, model: torch.nn.Module, ema: torch.nn.Module,
                   optimizer: torch.optim.Optimizer) -> None:
    """Load a plain (one-file-per-part) checkpoint ``c`` into a sharded run: each rank takes
    its shards of the full tensors (a DDP run continued with train.parallel=fsdp). The
    optimizer's state is matched to the parameters by position, as it was saved."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                         set_model_state_dict,
                                                         set_optimizer_state_dict)

    full = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, c.model, options=full)
    set_model_state_dict(ema, c.ema, options=full)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    saved = c.optimizer or {"state": {}, "param_groups": []}
    by_name = {"state": {names[int(i)]: v for i, v in saved["state"].items()},
               "param_groups": [{**g, "params": [names[int(i)] for i in g["params"]]}
                                for g in saved["param_groups"]]}
    set_optimizer_state_dict(model, optimizer, by_name, options=full)
