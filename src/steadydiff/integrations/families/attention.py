"""The guard's per-layer fp16 remedy, as attention processors: a layer whose
``upcast_attention`` attribute is set (``Guard.upcast_attention``, or
``model.upcast_attention`` for every layer) runs its attention in fp32, every other layer
keeps the fast path. Shared by the families (``Family.prepare_attention`` picks one).

- :class:`UpcastAware` (a UNet's attention, diffusers' ``Attention``): the classic
  ``AttnProcessor`` computes q kᵀ and the softmax in fp32 when the attribute is set; the
  default processor (scaled_dot_product_attention) ignores it.
- :class:`UpcastJointAttention` (a transformer's joint attention: SD3's
  ``JointAttnProcessor2_0``, FLUX's ``FluxAttnProcessor``): the whole layer in fp32.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["UpcastAware", "UpcastJointAttention", "autocast_off"]


def autocast_off(device: torch.device):
    """A context in which modules run in their own weights' dtype, not in the fp16/bf16 of
    an enclosing autocast (the training step's)."""
    if torch.is_autocast_enabled(device.type):
        return torch.autocast(device_type=device.type, enabled=False)
    return contextlib.nullcontext()


class UpcastAware:
    """An attention processor that honours ``attn.upcast_attention`` at run time.

    diffusers' default processor (scaled_dot_product_attention) ignores the attribute; the
    classic ``AttnProcessor`` computes q kᵀ in fp32 when it is set. The guard's fp16 remedy
    sets it on the one layer that overflowed (``Guard.upcast_attention``), so that layer
    switches to the classic path and every other layer keeps the fast one."""

    def __init__(self) -> None:
        from diffusers.models.attention_processor import AttnProcessor, AttnProcessor2_0

        self.fast, self.exact = AttnProcessor2_0(), AttnProcessor()

    def __call__(self, attn, *args, **kwargs):
        use = self.exact if getattr(attn, "upcast_attention", False) else self.fast
        return use(attn, *args, **kwargs)


class UpcastJointAttention:
    """An attention processor that runs a whole attention layer in fp32 when its
    ``upcast_attention`` attribute is set (the guard's fp16 remedy for the layer that
    overflowed), and the family's own fast processor otherwise.

    The UNet's remedy (:class:`UpcastAware`) computes q kᵀ in fp32; here the layer's
    projections, its QK-norm and the attention itself run in fp32 with autocast off: in a
    QK-normed layer (FLUX.1, SD3.5) the logits are already bounded, so an fp16 overflow
    there comes from the projections or the values, which only the whole layer in fp32
    removes. The layer's weights are cast to fp32 the first time (a frozen fp16/bf16 base:
    that layer's weights only; an EMA copy sharing them follows)."""

    def __init__(self, fast: Any) -> None:
        self.fast = fast

    def __call__(self, attn: nn.Module, hidden_states: Tensor, *args: Any, **kwargs: Any):
        if not getattr(attn, "upcast_attention", False):
            return self.fast(attn, hidden_states, *args, **kwargs)
        dtype = hidden_states.dtype
        if any(p.dtype != torch.float32 for p in attn.parameters()):
            attn.float()

        def up(v: Any) -> Any:
            if isinstance(v, Tensor) and v.is_floating_point():
                return v.float()
            if isinstance(v, tuple):
                return tuple(up(x) for x in v)
            return v

        with autocast_off(hidden_states.device):
            out = self.fast(attn, up(hidden_states), *[up(a) for a in args],
                            **{k: up(v) for k, v in kwargs.items()})
        if isinstance(out, tuple):
            return tuple(o.to(dtype) if isinstance(o, Tensor) else o for o in out)
        return out.to(dtype)
