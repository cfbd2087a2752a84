"""The one way a value travels from the device to the host on the training path.

On a GPU every read of a device value on the host (``.item()``, ``.cpu()``, ``.tolist()``,
``float(t)``, ``bool(t)``) waits for every kernel queued before it: the launch queue drains
and the GPU idles while Python catches up. The guard (its per-step or windowed check, its
snapshots, its incident evidence), the adapter's |ΔW| check and the loop's telemetry (the
metrics row, layer statistics) make those reads through :func:`read` (and :func:`values`,
:func:`value`), so that

- the reads per step can be counted (:func:`reads`): a CPU test proves the guarded path makes
  none in steady state, where a CPU cannot tell a sync from any other call;
- a CUDA run can be checked with ``torch.cuda.set_sync_debug_mode("error")``: the reads it
  does make are the deliberate ones, every ``guard.check_every`` steps.

The counter counts calls, on every device (a CPU read costs nothing, but it is where a GPU
would stall). Reads that happen inside PyTorch stay outside it: ``GradScaler.get_scale()`` in
an fp16 run's metrics row, and ``GradScaler.step`` with a non-fused optimizer.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

_reads = 0


def read(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the host (a CPU tensor): one counted device-to-host read."""
    global _reads
    _reads += 1
    if t.device.type == "cpu":
        return t.detach()
    with allowed():
        return t.detach().cpu()


def values(t: torch.Tensor) -> list:
    """``t``'s values as (nested) Python numbers: one counted read."""
    return read(t).tolist()


def value(t: torch.Tensor) -> float:
    """A one-element tensor's value as a Python float: one counted read."""
    return float(read(t).reshape(()).item())


def reads() -> int:
    """Device-to-host reads made through this module since the process started."""
    return _reads


@contextmanager
def allowed() -> Iterator[None]:
    """A deliberate synchronisation: ``torch.cuda.set_sync_debug_mode`` is lifted for it (a
    run checked under ``"error"`` fails on every sync but the ones made here)."""
    if not torch.cuda.is_available():
        yield
        return
    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(0)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(mode)
