"""The original layouts of the rectified-flow transformers (Stability's MMDiT for SD3, Black
Forest Labs' FLUX.1), as tables of how each original module is made of diffusers' modules.

Where diffusers splits a fused projection (the original ``qkv``, FLUX's single-block
``linear1`` = q, k, v and the MLP's input), the original module's weight is the diffusers
modules' weights concatenated along the output axis; where diffusers swapped the halves of
an adaLN modulation (``norm_out.linear``: (scale, shift) for the original's (shift,
scale)), the halves are swapped back. One table per family (``Family.original_table``)
serves the three things that need the original names:

- single files (A1111/ComfyUI checkpoints): :func:`to_original`, :func:`from_original`;
- kohya's LoRA names (``lora_unet_`` + the original module path, what sd-scripts trains
  and ComfyUI loads): a fused original module's LoRA is the diffusers modules' LoRAs
  stacked block-diagonally (:func:`fuse_lora`, :func:`split_lora`), exactly as kohya's
  ``split_qkv`` networks save theirs.

The tables are checked against diffusers' own converters (single_file_utils
``convert_flux_transformer_checkpoint_to_diffusers``, ``..._sd3_...``; lora_conversion_utils
``_convert_kohya_flux_lora_to_diffusers``) at the real models' widths.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

__all__ = ["Entry", "to_original", "from_original", "fuse_lora", "split_lora"]

How = Literal["cat", "swap", "scale", "param", "skip"]


@dataclass(frozen=True)
class Entry:
    """One original module (or parameter) and the diffusers modules it is made of.

    Attributes:
        original: the original module path (``double_blocks.3.img_attn.qkv``) or, for
            ``param``, the full key.
        parts: the diffusers module paths whose outputs it concatenates, in order (one for
            a plain rename); for ``param``, the full diffusers key.
        how: ``cat`` (a Linear/Conv: ``.weight`` and ``.bias`` concatenated on dim 0),
            ``swap`` (a Linear whose output halves are swapped), ``scale`` (a norm whose
            ``.weight`` is the original's ``.scale``), ``param`` (one tensor, renamed),
            ``skip`` (an original tensor the diffusers model has no place for: read past,
            not written; ``parts`` empty).
    """

    original: str
    parts: tuple[str, ...]
    how: How = "cat"


def _swap(t: Tensor) -> Tensor:
    a, b = t.chunk(2, dim=0)
    return torch.cat([b, a], dim=0)


def to_original(sd: dict[str, Tensor], table: list[Entry],
                prefix: str = "") -> dict[str, Tensor]:
    """A diffusers state dict ``sd`` in the original layout, keys under ``prefix``.

    Raises:
        KeyError: a tensor of ``sd`` no entry of the table takes (the table is incomplete
            for this model), named.
    """
    out: dict[str, Tensor] = {}
    used: set[str] = set()
    for e in table:
        if e.how == "skip":
            continue
        if e.how == "param":
            out[prefix + e.original] = sd[e.parts[0]]
            used.add(e.parts[0])
            continue
        if e.how == "scale":
            out[f"{prefix}{e.original}.scale"] = sd[f"{e.parts[0]}.weight"]
            used.add(f"{e.parts[0]}.weight")
            continue
        for what in ("weight", "bias"):
            keys = [f"{p}.{what}" for p in e.parts]
            if not all(k in sd for k in keys):
                continue
            t = torch.cat([sd[k] for k in keys], dim=0) if len(keys) > 1 else sd[keys[0]]
            out[f"{prefix}{e.original}.{what}"] = _swap(t) if e.how == "swap" else t
            used.update(keys)
    left = sorted(set(sd) - used)
    if left:
        raise KeyError(f"no original name for {left[:3]} ({len(left)} tensors)")
    return out


def from_original(sd: dict[str, Tensor], table: list[Entry], shapes: dict[str, torch.Size],
                  prefix: str = "") -> dict[str, Tensor]:
    """The inverse of :func:`to_original`: an original-layout state dict (keys under
    ``prefix``) as the diffusers model's, split by the diffusers tensors' ``shapes`` (its
    state dict's shapes).

    Raises:
        KeyError: a tensor the diffusers model has that the file lacks, or the other way
            round (a file of another model), named.
    """
    out: dict[str, Tensor] = {}
    used: set[str] = set()

    def take(k: str) -> Tensor:
        if k not in sd:
            raise KeyError(f"the file has no {k}")
        used.add(k)
        return sd[k]

    for e in table:
        if e.how == "skip":
            if prefix + e.original in sd:
                used.add(prefix + e.original)
            continue
        if e.how == "param":
            out[e.parts[0]] = take(prefix + e.original)
            continue
        if e.how == "scale":
            out[f"{e.parts[0]}.weight"] = take(f"{prefix}{e.original}.scale")
            continue
        for what in ("weight", "bias"):
            keys = [f"{p}.{what}" for p in e.parts]
            if keys[0] not in shapes:
                continue
            t = take(f"{prefix}{e.original}.{what}")
            t = _swap(t) if e.how == "swap" else t
            sizes = [shapes[k][0] for k in keys]
            for k, piece in zip(keys, torch.split(t, sizes, dim=0)):
                out[k] = piece.contiguous()
    missing = sorted(set(shapes) - set(out))
    extra = sorted(k for k in sd if k.startswith(prefix) and k not in used)
    if missing or extra:
        raise KeyError(f"the file does not fit this model: missing {missing[:3]}, "
                       f"unexpected {extra[:3]}")
    return out


def fuse_lora(parts: list[tuple[Tensor, Tensor, float] | None], out_dims: list[int],
              swap: bool = False) -> tuple[Tensor, Tensor, float]:
    """The LoRA of a fused original module from its parts' LoRAs ``(down (r, in), up
    (out_i, r), alpha)`` (None: a part without a LoRA, written as zeros), all of one rank
    r and alpha: down (k r, in) stacked, up (sum out_i, k r) block-diagonal, alpha k·alpha
    so that the fused delta up @ down · alpha_f / (k r) is each part's own. One part:
    itself (its up's halves swapped for ``swap``)."""
    real = [p for p in parts if p is not None]
    r, dtype = real[0][0].shape[0], real[0][0].dtype
    alpha = real[0][2]
    if len(parts) == 1:
        d, u, a = real[0]
        return d, (_swap(u) if swap else u), a
    cols = real[0][0].shape[1]
    down = torch.zeros(len(parts) * r, cols, dtype=dtype)
    up = torch.zeros(sum(out_dims), len(parts) * r, dtype=dtype)
    row = 0
    for j, (p, n) in enumerate(zip(parts, out_dims)):
        if p is not None:
            down[j * r:(j + 1) * r] = p[0]
            up[row:row + n, j * r:(j + 1) * r] = p[1]
        row += n
    return down, up, alpha * len(parts)


def split_lora(down: Tensor, up: Tensor, alpha: float, out_dims: list[int], rank: int,
               swap: bool = False) -> list[tuple[Tensor, Tensor, float] | None]:
    """A fused original module's LoRA as its parts' LoRAs of ``rank``, the inverse of
    :func:`fuse_lora`: block-diagonal (down k·rank rows: kohya's ``split_qkv`` files, and
    ours), or shared (down ``rank`` rows, up rows per part: a LoRA trained on the fused
    module). An all-zero block is None (a part the LoRA did not adapt).

    Raises:
        ValueError: the shapes fit neither form for ``rank``.
    """
    k = len(out_dims)
    if k == 1:
        return [(down, _swap(up) if swap else up, alpha)]
    if up.shape[0] != sum(out_dims):
        raise ValueError(f"lora_up has {up.shape[0]} rows; the module's parts have "
                         f"{sum(out_dims)} ({out_dims})")
    rows = torch.split(up, out_dims, dim=0)
    if down.shape[0] == k * rank:  # block-diagonal
        out: list[tuple[Tensor, Tensor, float] | None] = []
        for j, u in enumerate(rows):
            d, u = down[j * rank:(j + 1) * rank], u[:, j * rank:(j + 1) * rank]
            out.append(None if not (d.any() or u.any()) else (d.contiguous(), u.contiguous(),
                                                             alpha / k))
        return out
    if down.shape[0] == rank:  # one down shared by the parts
        return [(down.clone(), u.contiguous(), alpha) for u in rows]
    raise ValueError(f"lora_down has {down.shape[0]} rows: neither the rank {rank} nor "
                     f"{k} x {rank} (a fused module of {k} parts)")
