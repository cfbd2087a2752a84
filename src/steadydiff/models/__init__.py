"""Denoiser models. Every model follows one contract, ``model(x, t, y=None) -> out``:

- x: (N, C, H, W) float; t: (N,) float timesteps (integer-valued or continuous);
- y: the condition, or None for "no condition" (required for unconditional models, which
  reject a condition). Class-conditional models (``num_classes`` > 0): (N,) long labels in
  [0, num_classes], ``num_classes`` being the null class for classifier-free guidance.
  Text-conditioned models (``context_dim`` > 0): the text context (N, L, context_dim),
  a frozen text encoder's token embeddings, attended to by cross-attention; None means the
  model's ``null_context`` (the empty caption's encoding). A model is one or the other;
- out: same shape and dtype as x.

Each model also has ``num_classes``, ``context_dim`` (0: not text-conditioned),
``context_len``, ``in_channels``, ``image_size``, ``max_depth``, ``param_depth(name)``
(layer-wise LR decay: lr * decay ** (max_depth - depth)) and ``null_condition(y)`` (the
guidance null shaped like y); a text model has the persistent buffer ``null_context``
(context_len, context_dim), set by ``set_null_context(ctx)``.
"""

from __future__ import annotations

from torch import nn

from steadydiff.config import ModelConfig
from steadydiff.kinds import MODEL_KINDS
from steadydiff.models.dit import PRESETS, DiT
from steadydiff.models.layers import (
    Attention,
    Checkpointable,
    ClassEmbedder,
    TextConditioning,
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
    "TextConditioning",
    "TimestepEmbedder",
    "UNet",
    "build_model",
    "enable_checkpointing",
    "group_norm",
    "timestep_embedding",
]


def build_model(cfg: ModelConfig, *, image_size: int, channels: int, context_dim: int = 0,
                context_len: int = 77) -> nn.Module:
    """Build the denoiser described by ``cfg``.

    Args:
        cfg: the ``model`` config section (kind, num_classes, qk_norm, upcast_attention,
            unet/dit sub-sections).
        image_size: H = W of the training images (``data.image_size``).
        channels: image channels C (``data.channels``).
        context_dim: 0, or the text encoder's embedding width D for a text-conditioned
            model (cross-attention; ``cfg.num_classes`` must then be 0).
        context_len: the text encoder's token count L (the null context's length).

    Returns:
        A ``UNet`` or ``DiT`` module, weights initialised, on the current default device
        (a text model's ``null_context`` is zeros: the caller sets the empty caption's
        encoding with ``set_null_context``).

    Raises:
        ValueError: a shape that cannot work (e.g. image size vs. down-samplings or patch),
            or both class labels and a text context.
    """
    if cfg.kind == "unet":
        model: nn.Module = UNet(channels, image_size, cfg.unet, num_classes=cfg.num_classes,
                                qk_norm=cfg.qk_norm, context_dim=context_dim,
                                context_len=context_len)
    elif cfg.kind == "dit":
        model = DiT(channels, image_size, cfg.dit, num_classes=cfg.num_classes,
                    qk_norm=cfg.qk_norm, context_dim=context_dim, context_len=context_len)
    else:
        raise ValueError(f"model.kind must be one of {', '.join(MODEL_KINDS)}, "
                         f"got {cfg.kind!r}")
    for m in model.modules():  # model.upcast_attention: fp32 logits in every layer, cross too
        if isinstance(m, Attention):
            m.upcast_attention = cfg.upcast_attention
    return model


def enable_checkpointing(model: nn.Module) -> str:
    """Gradient checkpointing (``train.gradient_checkpointing``): the activations inside
    each block are recomputed in the backward pass instead of kept, trading about one more
    forward pass per step for the memory of all but the blocks' inputs. Our UNet's residual
    and attention blocks and the DiT's transformer blocks (:class:`Checkpointable`); a model
    with its own switch (a Stable Diffusion UNet: diffusers', and its trained text encoder:
    transformers') uses that. Returns what was checkpointed, for the run's log.

    Raises:
        ValueError: the model has nothing to checkpoint.
    """
    own = getattr(model, "enable_gradient_checkpointing", None)
    if callable(own):  # integrations/sd/model.py: SDDenoiser
        return own()
    blocks = [m for m in model.modules() if isinstance(m, Checkpointable)]
    if not blocks:
        raise ValueError(f"train.gradient_checkpointing: {type(model).__name__} has no blocks "
                         "to checkpoint (steadydiff's UNet and DiT and Stable Diffusion UNets "
                         "do); set it to false")
    for b in blocks:
        b.checkpointed = True
    kinds = sorted({type(b).__name__ for b in blocks})
    return f"{len(blocks)} blocks ({', '.join(kinds)}) recomputed in the backward pass"
