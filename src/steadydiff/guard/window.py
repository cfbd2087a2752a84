"""Speculative windows: the guard's check without a host read per step.

With ``guard.check_every = K > 1`` the guard judges the steps of a *window* (up to K steps)
together. Each step of the window keeps its numbers on the device (loss, grad norm, input
range, the weights' checks, per-timestep loss sums), gates the update there (the fused
AdamW's ``found_inf``, the EMA's weight), and advances as if healthy. At the window's end the
host reads every step's numbers at once (:func:`steadydiff.hostsync.read`) and runs the
per-step host logic over them in order, exactly as it would have run step by step. When every
step passes, nothing else happens. When step *i* does not, the state goes back to the
window's start (:class:`Mark`), steps 0..i-1 run again (speculatively, and pass), and step
*i* runs with the per-step check: whatever the guard does there (skip, re-run, drop samples,
roll back, change precision) happens at the same step, from the same state, on the same data
as with ``check_every = 1``. The cost of an incident: up to K steps computed twice.

A :class:`Mark` holds the window start's device state as copies on the same device (weights,
optimizer moments, EMA, the fp16 scaler; one ``_foreach_copy_`` into buffers kept between
windows), the guard's host state (detector statistics, LR factors) and the progress counters.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

from .. import distributed, hostsync, sharding

# the guard's attributes a healthy step changes on the host (everything else only changes
# on an incident, which never happens inside a window)
HOST_FIELDS = ("grad", "loss", "divergence", "trend", "inputs", "overflow", "max_lr",
               "lr_factor", "backoff_until", "last_factor", "pending_skips")


def _ema_host(ema: Any) -> dict[str, Any]:
    """An EMA's counters (its tensors are in the device state)."""
    e = ema.ema if ema is not None else None
    out: dict[str, Any] = {}
    if e is not None and hasattr(e, "num_updates"):
        out["num_updates"] = e.num_updates
        if getattr(e, "posthoc", None) is not None:
            out["posthoc_updates"] = e.posthoc.num_updates
    return out


def _load_ema_host(ema: Any, host: dict[str, Any]) -> None:
    if not host:
        return
    e = ema.ema
    e.num_updates = host["num_updates"]
    if "posthoc_updates" in host:
        e.posthoc.num_updates = host["posthoc_updates"]


def device_tensors(params: list[torch.Tensor], optimizer: torch.optim.Optimizer, ema: Any,
                   scaler: torch.amp.GradScaler | None) -> list[torch.Tensor]:
    """Every tensor a healthy step changes: the trainable weights, their optimizer state, the
    EMA's averaged tensors, the scaler's scale and growth tracker."""
    out = list(params)
    for p in params:
        out += [v for v in optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor)]
    if ema is not None:
        out += ema.mutable_tensors()
    if scaler is not None:
        out += [t for t in (getattr(scaler, "_scale", None),
                            getattr(scaler, "_growth_tracker", None)) if t is not None]
    return [sharding.local(t) for t in out]  # FSDP: this rank's shards (views: copied into)


@dataclass
class Mark:
    """The state at a window's start."""

    step: int
    batches_consumed: int
    host: dict[str, Any]
    ema_host: dict[str, Any]
    tensors: list[torch.Tensor]       # the live tensors, in order
    copies: list[torch.Tensor]        # their values at the mark
    prev_norms: torch.Tensor | None
    rng: torch.Tensor
    cuda_rng: list[torch.Tensor] | None
    extra: Any = None  # the caller's own state (Guard.begin_step's mark)


def fits(tensors: list[torch.Tensor], fraction: float = 0.5) -> bool:
    """Whether copies of ``tensors`` take at most ``fraction`` of the free memory of each
    CUDA device they are on (always True on the CPU)."""
    need: dict[torch.device, int] = {}
    for t in tensors:
        if t.device.type == "cuda":
            need[t.device] = need.get(t.device, 0) + t.numel() * t.element_size()
    ok = all(n <= fraction * torch.cuda.mem_get_info(d)[0] for d, n in need.items())
    if distributed.active():  # every rank speculates, or none (they redo steps together)
        flag = torch.tensor([float(ok)], device=tensors[0].device if tensors else "cpu")
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
        ok = hostsync.value(flag) > 0
    return ok


def rng_states() -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    """The CPU and CUDA RNG states (host-side: no device read)."""
    return (torch.get_rng_state(),
            torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)


class Marks:
    """Takes and restores :class:`Mark` s, reusing the copy buffers between windows."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []

    def take(self, guard: Any, rng: tuple[torch.Tensor, list[torch.Tensor] | None]
             ) -> Mark | None:
        """The guard's state now; ``rng``: the RNG states from before the step's forward
        (dropout draws from them: the step must draw the same again). None when the copy
        does not fit in the accelerator's free memory (a full fine-tune of a model near the
        memory limit): the caller checks every step instead."""
        g = guard
        live = device_tensors(g._params, g.optimizer, g.ema, g.progress.scaler)
        bufs = self._buffers
        same = len(bufs) == len(live) and all(
            b.shape == t.shape and b.dtype == t.dtype and b.device == t.device
            for b, t in zip(bufs, live))
        if not same and not fits(live):
            return None
        if not same:
            bufs = self._buffers = [torch.empty_like(t) for t in live]
        with torch.no_grad():
            torch._foreach_copy_(bufs, live)
        return Mark(step=g.progress.step, batches_consumed=g.progress.batches_consumed,
                    host=copy.deepcopy({k: getattr(g, k) for k in HOST_FIELDS}),
                    ema_host=_ema_host(g.ema), tensors=live, copies=bufs,
                    prev_norms=g._prev_norms.clone() if g._prev_norms is not None else None,
                    rng=rng[0], cuda_rng=rng[1])

    @staticmethod
    def restore(guard: Any, mark: Mark) -> None:
        """Put the guard, the model, its optimizer, EMA, scaler and the progress back to
        ``mark`` (the copies stay valid: the same mark can be restored again)."""
        g = guard
        with torch.no_grad():
            torch._foreach_copy_(mark.tensors, mark.copies)
        for k, v in copy.deepcopy(mark.host).items():
            setattr(g, k, v)
        _load_ema_host(g.ema, mark.ema_host)
        g._prev_norms = mark.prev_norms.clone() if mark.prev_norms is not None else None
        g.optimizer.zero_grad(set_to_none=True)
        g.progress.step, g.progress.batches_consumed = mark.step, mark.batches_consumed
        torch.set_rng_state(mark.rng)
        if mark.cuda_rng is not None:
            torch.cuda.set_rng_state_all(mark.cuda_rng)
