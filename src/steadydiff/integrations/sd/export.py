"""``steadydiff export SOURCE --single-file OUT``: a full Stable Diffusion fine-tune (a run
or checkpoint), or a diffusers SD folder, written as one original-layout file
(single_file.py has the layout)."""

from __future__ import annotations

from pathlib import Path

import torch

from .folder import load_folder_parts
from .single_file import export_single_file, is_single_file

__all__ = ["export"]


def export(source: str | Path, out: str | Path, *, use_ema: bool = True,
           dtype: torch.dtype | None = None, base: str | Path | None = None) -> Path:
    """``steadydiff export SOURCE --single-file OUT``: a full Stable Diffusion fine-tune, or
    a diffusers SD folder, as one original-layout ``.safetensors`` file A1111/ComfyUI read.

    Args:
        source: a run directory or checkpoint of a full fine-tune (``model.pretrained`` with
            ``adapter.kind: none``; its EMA weights unless ``use_ema`` is false), or a
            diffusers Stable Diffusion folder (e.g. ``RUN/model``).
        out: the file to write (``.safetensors``); replaced atomically if it exists.
        dtype: cast the floating-point tensors (torch.float16 halves the file).
        base: the run's base model (``model.pretrained``) when it moved since training; its
            identity must be the one the run recorded (integrations/sd/identity.py).

    Raises:
        ValueError: ``out`` is not a .safetensors path, or the run is not a full SD
            fine-tune (a LoRA run exports ``RUN/lora/pytorch_lora_weights.safetensors``).
        CheckpointError: non-finite weights (nothing written).
        BaseMismatchError: the base found is not the one the run was trained on.
    """
    out, src = Path(out).expanduser(), Path(source).expanduser()
    if out.suffix.lower() != ".safetensors":
        raise ValueError(f"--single-file must end in .safetensors, got {out}")
    if (src / "model_index.json").is_file():  # a diffusers folder
        p = load_folder_parts(src)
        return export_single_file(out, p.denoiser, p.vae, p.text_encoders, dtype=dtype)
    from ...loading import load  # loading builds through setup: above this module

    pipe = load(src, device="cpu", use_ema=use_ema, base=base)
    cfg = pipe.config
    if not cfg.model.pretrained:
        raise ValueError(f"{pipe.checkpoint} is not a Stable Diffusion fine-tune "
                         "(no model.pretrained): it has no single-file layout")
    if cfg.adapter.kind != "none":
        raise ValueError(f"{pipe.checkpoint} is a {cfg.adapter.kind} run: its export is the "
                         "LoRA file RUN/lora/pytorch_lora_weights.safetensors (diffusers' "
                         "load_lora_weights reads it); --single-file writes full fine-tunes")
    base = cfg.model.pretrained if is_single_file(cfg.model.pretrained) else None
    return export_single_file(out, pipe.model.denoiser, pipe.media.vae,
                              pipe.media.text_encoders, base_file=base, dtype=dtype)
