"""doctor's probe batch for a text-to-image run (SD, SDXL, the transformer families, or
steadydiff's own model in a VAE's latent space): what the denoiser really trains on.

The denoiser of a latent-space run takes latents (SD: 4 channels, 1/8 the side) and a text
condition, not the 3-channel pixels of the run's dataset. :func:`text_probe_batch` encodes a
few of the run's images through the run's own VAE and their captions through its text
encoders (the frozen parts read from ``model.pretrained``'s folder or file, in fp32 on the
CPU), so the probe forward pass sees the inputs training sees; when the data cannot be read
it probes in latent space with N(0, 1) latents (the VAE's latents are scaled to about unit
variance) and the empty caption's condition.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["text_probe_batch"]


def _media(cfg: Any, device: torch.device):
    """The run's frozen parts (VAE, text encoders), fp32, without its denoiser."""
    from ..families import Family
    from .folder import load_text_parts, load_vae
    from .model import TextToImage
    from .source import load_parts

    m = cfg.model
    if m.pretrained:
        root = Path(m.pretrained).expanduser()
        if root.is_dir():
            from .folder import family_of

            parts = family_of(root).load(root, denoiser=False)
        else:
            parts = load_parts(m.pretrained, m.single_file_config)
        fam = parts.family
        return TextToImage(fam, parts.tokenizers, parts.text_encoders, parts.vae, device,
                           force_zeros=parts.force_zeros,
                           max_sequence_length=m.max_sequence_length)
    tok, te = load_text_parts(m.text_encoder)
    vae = load_vae(m.vae) if m.vae else None
    return TextToImage(Family(), [tok], [te], vae, device)


@torch.no_grad()
def text_probe_batch(cfg: Any, model: nn.Module, n: int = 8
                     ) -> tuple[torch.Tensor, torch.Tensor, str, bool]:
    """``(x0, y, source, latent)`` for doctor's probe of a text-conditioned ``model``:
    ``n`` of the run's images through its VAE (latents, or pixels without a VAE) and their
    captions' conditions; else N(0, 1) latents of the model's input shape and the empty
    caption's condition. ``latent``: x0 is latents (not bounded to [-1, 1])."""
    from ...preflight import _text_data

    device = next(model.parameters()).device
    media = _media(cfg, device)
    try:
        data = _text_data(cfg, None)
        if len(data) == 0:
            raise ValueError("empty dataset")
        idx = [round(i * (len(data) - 1) / max(n - 1, 1)) for i in range(min(n, len(data)))]
        items = [data[i] for i in idx]
        x = torch.stack([it[0] if isinstance(it, (tuple, list)) else it for it in items])
        caps = [data.captions[i] for i in idx]
        x0 = media.encode_images(x.float()) if media.latent else x.float()  # x in [-1, 1]
        what = f"{len(idx)} images of {cfg.data.dataset}" + (
            " encoded by the run's VAE" if media.latent else "") + ", with their captions"
    except Exception as e:  # noqa: BLE001 - the probe goes on in latent space
        c = int(getattr(model, "in_channels", 4))
        side = int(getattr(model, "image_size", cfg.data.image_size // max(
            getattr(media, "down", 1), 1)))
        g = torch.Generator().manual_seed(0)
        x0 = torch.randn(n, c, side, side, generator=g)
        caps = [""] * n
        what = f"N(0, 1) latents and the empty caption ({type(e).__name__}: {e})"
    y = media.text_part(media.encode_prompts(caps)).float()
    y = _with_ids(model, y)
    return x0.to(device), y.to(device), what, media.latent


def _with_ids(model: nn.Module, y: torch.Tensor) -> torch.Tensor:
    """The condition with the per-sample ids' rows the model's layout adds (SDXL's size and
    crop: zeros, as an unconditioned size), when it reads more rows than the text has."""
    layout = getattr(model, "layout", None) or getattr(getattr(model, "base", None),
                                                       "layout", None)
    if layout is None or not getattr(layout, "extra_ids", 0):
        return y
    return layout.empty(y) if hasattr(layout, "empty") else y
