"""Gradient clipping modes.

- ``global``: scale all gradients so their global L2 norm is at most ``c`` (Pascanu et al. 2013).
- ``per_layer``: the same, per parameter tensor: one exploding layer cannot shrink the
  update of every other layer.
- ``agc``: adaptive gradient clipping, unit-wise (Brock et al. 2021, NFNets, eq. 3): each
  output unit's gradient norm is capped at ``c · max(|w_unit|, 1e-3)``.
- ``zclip``: clip the global norm at ``mean + c·std`` of its running statistics (Kumar et al.
  2025); the statistics are the guard's grad-norm detector's, so ZClip needs the guard.

All modes act in place on ``.grad`` and take the pre-clip global norm computed once by the
caller (one fused ``foreach`` reduction, no host sync).
"""

from __future__ import annotations

import torch

from .. import sharding
from ..kinds import CLIP_MODES, ClipMode

Mode = ClipMode  # the name this module used before kinds.py


def total_norm(params: list[torch.Tensor]) -> torch.Tensor:
    """Global L2 norm of the gradients of ``params`` (0-dim tensor, stays on device)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    if sharding.any_sharded(grads):  # FSDP: the shards' norms combined over the ranks
        return sharding.total_norm(grads)
    return torch.nn.utils.get_total_norm(grads, 2.0, foreach=True)


@torch.no_grad()
def clip(params: list[torch.Tensor], mode: Mode, threshold: float, norm: torch.Tensor,
         zclip_value: float | None = None) -> torch.Tensor:
    """Clip the gradients of ``params`` in place.

    Args:
        params: parameters (their ``.grad`` is modified).
        mode: global | per_layer | agc | zclip.
        threshold: max norm (global, per_layer), max |g|/|w| ratio per unit (agc), or
            unused for zclip (the z-threshold lives in the detector). 0 disables clipping.
        norm: the pre-clip global norm from :func:`total_norm`.
        zclip_value: zclip's current max norm (None while its statistics warm up: then the
            global ``threshold`` applies, if set).

    Returns:
        The global gradient norm after clipping (0-dim tensor on the device; for global and
        zclip it is ``min(norm, limit)`` without another reduction).
    """
    with_grad = [p for p in params if p.grad is not None]
    grads = [p.grad for p in with_grad]
    if not grads:
        return norm
    if mode in ("global", "zclip"):
        limit = (zclip_value if zclip_value is not None else threshold) if mode == "zclip" \
            else threshold
        if not limit:
            return norm
        if sharding.any_sharded(grads):  # the same scale as below, on each rank's shards
            coef = torch.clamp(limit / (norm + 1e-6), max=1.0)
            torch._foreach_mul_([sharding.local(g) for g in grads], coef.to(norm.device))
            return torch.clamp(norm, max=limit)
        # takes the parameters (it scales their .grad), with the norm computed once already
        torch.nn.utils.clip_grads_with_norm_(with_grad, limit, norm, foreach=True)
        return torch.clamp(norm, max=limit)
    if mode == "per_layer":
        if threshold:
            norms = torch._foreach_norm(grads)
            scales = [torch.clamp(threshold / (n + 1e-6), max=1.0) for n in norms]
            torch._foreach_mul_(grads, scales)
    elif mode == "agc":
        if threshold:
            for p in params:
                if p.grad is None:
                    continue
                # FSDP shards dim 0: a unit (row) is whole on one rank; a 1-D tensor's norm
                # is combined over the ranks
                w_all, g_all = sharding.local(p.detach()), sharding.local(p.grad)
                dims = tuple(range(1, p.ndim)) if p.ndim > 1 else None
                if dims:
                    w = w_all.norm(dim=dims, keepdim=True)
                    g = g_all.norm(dim=dims, keepdim=True)
                elif sharding.is_sharded(p):
                    w, g = sharding.norms([p.detach(), p.grad])
                else:
                    w, g = p.detach().norm(), p.grad.norm()
                max_g = threshold * w.clamp_min(1e-3)
                g_all.mul_(torch.where(g > max_g, max_g / g.clamp_min(1e-6), 1.0))
    else:
        raise ValueError(f"unknown clip mode {mode!r}; valid: {', '.join(CLIP_MODES)}")
    return total_norm(params) if threshold else norm
