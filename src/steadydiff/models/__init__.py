"""Denoiser models. Every model follows one contract, ``model(x, t, y=None) -> out``:

- x: (N, C, H, W) float; t: (N,) float timesteps (integer-valued or continuous);
- y: (N,) long labels in [0, num_classes], ``num_classes`` being the null class for
  classifier-free guidance, or None (the null class for conditional models; required for
  unconditional ones, which reject labels);
- out: same shape and dtype as x.

Each model also has ``num_classes``, ``in_channels``, ``image_size``, ``max_depth`` and
``param_depth(name)`` (layer-wise LR decay: lr * decay ** (max_depth - depth)).
"""

from __future__ import annotations

from torch import nn

from steadydiff.config import ModelConfig
from steadydiff.kinds import MODEL_KINDS
from steadydiff.models.dit import PRESETS, DiT
from steadydiff.models.layers import (
    Attention,
    ClassEmbedder,
    TimestepEmbedder,
    group_norm,
    timestep_embedding,
)
from steadydiff.models.unet import UNet

__all__ = [
    "PRESETS",
    "Attention",
    "ClassEmbedder",
    "DiT",
    "TimestepEmbedder",
    "UNet",
    "build_model",
    "group_norm",
    "timestep_embedding",
]


def build_model(cfg: ModelConfig, *, image_size: int, channels: int) -> nn.Module:
    """Build the denoiser described by ``cfg``.

    Args:
        cfg: the ``model`` config section (kind, num_classes, qk_norm, upcast_attention,
            unet/dit sub-sections).
        image_size: H = W of the training images (``data.image_size``).
        channels: image channels C (``data.channels``).

    Returns:
        A ``UNet`` or ``DiT`` module, weights initialised, on the current default device.

    Raises:
        ValueError: a shape that cannot work (e.g. image size vs. down-samplings or patch).
    """
    if cfg.kind == "unet":
        model: nn.Module = UNet(channels, image_size, cfg.unet, num_classes=cfg.num_classes,
                                qk_norm=cfg.qk_norm)
    elif cfg.kind == "dit":
        model = DiT(channels, image_size, cfg.dit, num_classes=cfg.num_classes,
                    qk_norm=cfg.qk_norm)
    else:
        raise ValueError(f"model.kind must be one of {', '.join(MODEL_KINDS)}, "
                         f"got {cfg.kind!r}")
    for m in model.modules():  # model.upcast_attention: fp32 logits in every layer
        if isinstance(m, Attention):
            m.upcast_attention = cfg.upcast_attention
    return model
