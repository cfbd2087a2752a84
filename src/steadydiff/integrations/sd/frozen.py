"""The frozen (base) parts of a text-to-image run, checked and repaired like trainable ones.

A LoRA, hypernetwork or ControlNet run trains a few million parameters on top of a base of
about a billion that it never changes. When one of those base weights is broken, the symptom
(a NaN loss, every latent non-finite, a NaN text condition) looks like bad data or a too-high
learning rate, and that is what the guard used to say. This module says what it is:

- :func:`check_loaded`: every tensor a run loads (the denoiser, the VAE, the text encoders, a
  ControlNet's start) is checked finite once, before training. A broken one stops the run
  (:class:`BaseModelError`, exit 2) naming the tensor and the file to download again. The
  token-embedding rows of a text encoder are the exception: a non-finite row matters only
  when a caption uses that token, and then the text path re-encodes in fp32 and quarantines
  the captions that use it (data/cache.py ``encode_texts``), naming the token.
- :class:`FrozenWatch`: during training, when the guard sees a non-finite loss or gradient,
  it asks the watch whether a frozen weight turned non-finite (one fused reduction, only on
  a failed step). If one did, that is corruption of the base model (``base_corrupt``), not
  an LR problem: the watch restores the broken tensors from the files on disk (the folder or
  single file the run loaded, read again) and the step is skipped; if the files on disk are
  broken too, the run stops with that diagnosis and the file to download again.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..families import SDFolderError

log = logging.getLogger(__name__)

__all__ = ["BaseModelError", "check_loaded", "check_module", "finite_mask", "weight_file", "FrozenWatch",
           "nonfinite_token_rows", "FP16_MAX"]

FP16_MAX = 65504.0


class BaseModelError(SDFolderError):
    """A loaded base model with a non-finite tensor (exit code 2): the file is broken."""


def weight_file(root: Path, part: str, key: str, family: Any = None) -> Path:
    """The file that holds tensor ``key`` of part ``part`` of the model at ``root`` (a
    diffusers folder, or a single file: the file itself for the parts it holds)."""
    root = Path(root)
    if root.is_file():
        return root
    sub = root / part
    for idx in sorted(sub.glob("*.safetensors.index.json")):
        try:
            where = json.loads(idx.read_text()).get("weight_map", {}).get(key)
        except (OSError, ValueError):
            where = None
        if where:
            return sub / where
    files = sorted(sub.glob("*.safetensors"))
    return files[0] if len(files) == 1 else sub


def nonfinite_token_rows(te: nn.Module) -> list[int]:
    """The token ids whose input-embedding row of text encoder ``te`` is non-finite."""
    emb = te.get_input_embeddings() if hasattr(te, "get_input_embeddings") else None
    if emb is None:
        return []
    bad = ~torch.isfinite(emb.weight.detach()).all(dim=1)
    return [int(i) for i in torch.nonzero(bad).flatten().tolist()]


def _describe(t: Tensor) -> str:
    t = t.detach()
    nan = int(torch.isnan(t).sum())
    inf = int(torch.isinf(t).sum())
    return f"{nan} NaN and {inf} inf of {t.numel():,} elements"


@torch.no_grad()
def finite_mask(tensors: list[Tensor]) -> list[bool]:
    """Whether each tensor is all finite. Each one's sum first (a NaN or inf element makes
    it non-finite; ~19x faster than ``isfinite().all()``, which writes a mask: 0.14 s against
    2.6 s for 100M fp32 parameters on one loaded CPU core); a non-finite sum (or one that
    overflowed from huge finite values) is then checked element-wise. One host read."""
    if not tensors:
        return []
    sums = torch.stack([t.sum(dtype=torch.float32) if t.is_floating_point() else
                        t.new_zeros((), dtype=torch.float32) for t in tensors])
    ok = torch.isfinite(sums).tolist()
    return [True if o else bool(torch.isfinite(t).all()) for o, t in zip(ok, tensors)]


def check_module(module: nn.Module, *, skip: tuple[str, ...] = ()) -> list[tuple[str, str]]:
    """``[(tensor name, what is wrong)]`` for every non-finite floating tensor (parameters
    and buffers) of ``module`` except those named in ``skip`` (:func:`finite_mask`:
    about 1.4 s per billion parameters on one CPU core)."""
    named = [(n, t) for n, t in list(module.named_parameters()) + list(module.named_buffers())
             if t.is_floating_point() and n not in skip and t.numel()]
    if not named:
        return []
    ok = finite_mask([t.detach() for _, t in named])
    return [(n, _describe(t)) for (n, t), o in zip(named, ok) if not o]


def check_loaded(parts: Any, *, what: str = "model.pretrained",
                 config_root: str | Path | None = None) -> list[str]:
    """Check every loaded tensor of ``parts`` (integrations/families ``Parts``) finite.

    Returns:
        Warnings (one per text encoder with non-finite token-embedding rows: tolerated here,
        handled when a caption uses them).

    Raises:
        BaseModelError: a non-finite tensor, named with its file and what to do.
    """
    fam = parts.family
    root = Path(parts.root)
    checks: list[tuple[str, nn.Module | None, tuple[str, ...]]] = [
        (fam.denoiser, parts.denoiser, ()), ("vae", parts.vae, ())]
    notes: list[str] = []
    for spec, te, tok in zip(fam.text, parts.text_encoders,
                             list(parts.tokenizers) + [None] * len(fam.text)):
        emb = te.get_input_embeddings() if hasattr(te, "get_input_embeddings") else None
        skip: tuple[str, ...] = ()
        if emb is not None:
            name = next((n for n, p in te.named_parameters() if p is emb.weight), None)
            rows = nonfinite_token_rows(te)
            if rows and name is not None:
                skip = (name,)
                shown = ", ".join(_token(tok, i) for i in rows[:5])
                notes.append(f"{spec.part}: {len(rows)} token-embedding row(s) are non-finite "
                             f"({shown}{', ...' if len(rows) > 5 else ''}) in "
                             f"{weight_file(_root_of(root, spec.part, fam, config_root), spec.part, name, fam)}: captions that use "
                             "them are re-encoded in fp32 and, if still non-finite, left out")
        checks.append((spec.part, te, skip))
    for part, module, skip in checks:
        if module is None:
            continue
        bad = check_module(module, skip=skip)
        if bad:
            name, why = bad[0]
            f = weight_file(_root_of(root, part, fam, config_root), part, name, fam)
            more = f" and {len(bad) - 1} more tensor(s)" if len(bad) > 1 else ""
            raise BaseModelError(
                f"{what}: the base model is broken: {part}.{name} has {why}{more}, as loaded "
                f"from {f}. The file is damaged (an interrupted download or copy, a disk "
                f"error): download or copy {f} again (check its sha256 against the "
                "source's). This is not a data or learning-rate problem; nothing was trained")
    return notes


def _root_of(root: Path, part: str, fam: Any, config_root: str | Path | None) -> Path:
    """Where part ``part`` was read from: the folder, or for a single file, the file for
    the parts it holds and ``model.single_file_config`` for the others."""
    if root.is_file() and config_root and part not in tuple(fam.single_file_parts or ()):
        return Path(config_root)
    return root


def _token(tok: Any, i: int) -> str:
    try:
        return f"id {i} {tok.convert_ids_to_tokens(i)!r}" if tok is not None else f"id {i}"
    except Exception:  # noqa: BLE001 - a tokenizer without that id: the id alone
        return f"id {i}"


@dataclass
class _Source:
    """Where a frozen parameter of the model came from: its part and key in the files."""

    part: str
    key: str


class FrozenWatch:
    """The frozen parameters of a run's model, known by where they came from on disk.

    Args:
        model: the trained module (an ``SDDenoiser``, or a ``ControlNetDenoiser`` over one).
        pretrained, single_file_config: ``model.pretrained`` and its config folder (how the
            parts are read again to repair).
        family: the model family.
    """

    def __init__(self, model: nn.Module, pretrained: str | Path,
                 single_file_config: str | Path | None, family: Any) -> None:
        self.pretrained, self.config = Path(pretrained), single_file_config
        self.family = family
        self.params: dict[str, Tensor] = {}
        self.sources: dict[str, _Source] = {}
        parts = {family.denoiser} | {spec.part for spec in family.text}
        for n, p in model.named_parameters():
            # plain tensors only: an 8-bit base (model.quantize_base) or FSDP shards are
            # neither checked nor restorable element-wise here
            if p.requires_grad or not p.is_floating_point() or type(p.data) is not Tensor:
                continue
            path = n.split(".")
            while path and path[0] not in parts:  # ControlNetDenoiser's "base." prefix
                path = path[1:]
            if len(path) < 2:
                continue
            # peft keeps the base layer's own tensor as <layer>.base_layer.weight
            key = ".".join(x for x in path[1:] if x != "base_layer")
            self.params[n] = p
            self.sources[n] = _Source(path[0], key)
        self.repairs = 0
        # tensors already non-finite at load (a text encoder's broken token rows, tolerated
        # by check_loaded): their count of bad elements, so only a new fault is one
        self.known = {n: _nonfinite(self.params[n]) for n in self.bad(known=False)}

    def bad(self, known: bool = True) -> list[str]:
        """The frozen parameters with a non-finite element (one reduction; a host read:
        called only after a failed step), except those non-finite since the load in as
        many elements (``known``)."""
        if not self.params:
            return []
        names = list(self.params)
        plain = [n for n in names if not _quantized(self.params[n])]
        ok = dict(zip(plain, finite_mask([self.params[n].detach() for n in plain])))
        with torch.no_grad():  # an 8-bit base's weight: its float parts (scales)
            for n in names:
                if n not in ok:
                    ok[n] = all(bool(torch.isfinite(x).all())
                                for x in _float_parts(self.params[n]))
        out = [n for n in names if not ok[n]]
        if known:
            out = [n for n in out if n not in self.known
                   or _nonfinite(self.params[n]) > self.known[n]]
        return out

    def evidence(self, bad: list[str]) -> dict[str, Any]:
        first = self.params[bad[0]]
        src = self.sources[bad[0]]
        return {"parameter": bad[0], "parameters": bad[:20], "count": len(bad),
                "part": src.part, "values": _describe(first),
                "file": str(self.file_of(bad[0]))}

    def file_of(self, name: str) -> Path:
        src = self.sources[name]
        return weight_file(_root_of(self.pretrained, src.part, self.family, self.config),
                           src.part, src.key, self.family)

    @torch.no_grad()
    def repair(self, bad: list[str]) -> str | None:
        """Copy the broken tensors from the files on disk (read again, fp32 on the CPU)
        into the live ones (and so into the EMA's copy, which shares them). Returns None
        when repaired, else why not (the files are broken too, or cannot be read)."""
        from .source import load_parts

        try:
            parts = load_parts(self.pretrained, self.config)
        except (OSError, ValueError, RuntimeError) as e:
            return f"the base could not be read again from {self.pretrained}: {e}"
        by_part: dict[str, dict[str, Tensor]] = {}
        mods = {self.family.denoiser: parts.denoiser}
        for spec, te in zip(self.family.text, parts.text_encoders):
            mods[spec.part] = te
        for n in bad:
            src = self.sources[n]
            if _quantized(self.params[n]):
                return (f"{n} is stored in 8 bits (model.quantize_base): it is not repaired "
                        "in place; resume the run from its last checkpoint (the base is "
                        "quantized again from the files)")
            if src.part not in by_part:
                by_part[src.part] = mods[src.part].state_dict()
            t = by_part[src.part].get(src.key)
            if t is None:
                return f"{n} has no tensor {src.key} in {self.file_of(n)}"
            if not bool(torch.isfinite(t).all()):
                return f"{src.key} is non-finite in {self.file_of(n)} too"
            p = self.params[n]
            p.copy_(t.to(p.device, p.dtype))
            if not bool(torch.isfinite(p).all()):
                return (f"{src.key} from {self.file_of(n)} is not finite in the run's dtype "
                        f"{p.dtype} (values beyond its range)")
        self.repairs += 1
        return None


def _quantized(t: Tensor) -> bool:
    """Whether ``t`` is a torchao quantized weight (``model.quantize_base``): integer data
    that cannot be non-finite, plus float scales that can."""
    return type(t).__module__.startswith("torchao")


def _float_parts(t: Tensor) -> list[Tensor]:
    """The plain float tensors ``t`` is stored as (itself; a quantized weight: its
    scales)."""
    if not _quantized(t):
        return [t]
    names, _ = t.__tensor_flatten__()
    return [getattr(t, n) for n in names if getattr(t, n).is_floating_point()] or \
        [torch.zeros(1, device=t.device)]


def _nonfinite(t: Tensor) -> int:
    """How many stored elements of ``t`` are non-finite."""
    return sum(int((~torch.isfinite(x)).sum()) for x in _float_parts(t))
