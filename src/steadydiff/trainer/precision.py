"""Mixed precision: autocast contexts, the fp16 grad scaler, and an honest device check.

A precision the device cannot run natively is reported, never silently replaced: accelerate
runs "fp16" in fp32 on a CPU without saying so, and a user then believes they tested fp16.
On CPUs without AVX512-BF16/AMX, bf16 and fp16 autocast are emulated: 13-24x slower than
fp32 for the matmuls, and ~150x for a whole fp16 UNet step at batch 64 (measured on our
2-core machines, bench/stability.py), so we refuse unless ``train.allow_slow_precision`` is
set.
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path

import torch

from ..config import ConfigError
from ..kinds import Precision

# keys: exactly kinds.PRECISIONS (tests/test_kinds.py)
DTYPES: dict[Precision, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16,
                                       "fp16": torch.float16}


@functools.lru_cache(maxsize=1)
def _cpu_flags() -> frozenset[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def native_support(precision: Precision, device: torch.device) -> bool:
    """Whether ``device`` runs ``precision`` matmuls natively (not emulated)."""
    if precision == "fp32":
        return True
    if device.type == "cuda":
        if precision == "bf16":
            # tensor-core bf16 from Ampere (sm_80) on, and on ROCm; torch's own
            # is_bf16_supported() also says yes where bf16 is only emulated (sm_75, sm_70)
            return bool(torch.version.hip) or torch.cuda.get_device_capability(device)[0] >= 8
        return True
    flags = _cpu_flags()
    if precision == "bf16":
        return bool(flags & {"avx512_bf16", "amx_bf16"})
    return bool(flags & {"avx512_fp16", "amx_fp16"})


def check_precision(precision: Precision, device: torch.device, allow_slow: bool) -> None:
    """Raise :class:`ConfigError` when ``precision`` would be emulated on ``device``."""
    if native_support(precision, device):
        return
    msg = (f"train.precision={precision} has no native support on this {device.type} device "
           f"and would run emulated (13-24x slower than fp32 for matmuls; an fp16 UNet step "
           f"at batch 64 measured ~150x slower on a 2-core CPU)")
    if not allow_slow:
        raise ConfigError(msg + "; use train.precision=fp32, or set "
                          "train.allow_slow_precision=true to run it anyway")
    # allowed: the start-up lint (lint.py, emulated_precision) prints the warning once


def autocast(precision: Precision, device: torch.device):
    """The autocast context for one forward pass (a no-op for fp32)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=DTYPES[precision])


def make_scaler(precision: Precision, device: torch.device) -> torch.amp.GradScaler | None:
    """A GradScaler for fp16 (fp32 master weights, dynamic loss scale); None otherwise."""
    if precision != "fp16":
        return None
    return torch.amp.GradScaler(device.type)
