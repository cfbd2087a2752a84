"""The fast defaults on CUDA: every ``auto`` speed setting resolved once for the device.

    train.precision     auto -> bf16 on a GPU with native bf16 (compute capability >= 8.0,
                        or ROCm), fp16 with the grad scaler on an older GPU, fp32 elsewhere
    optim.fused         auto -> torch's fused AdamW wherever torch has the kernel (CUDA, CPU)
    train.channels_last auto -> on for convolutional models (UNets) on CUDA
    data.pin_memory     auto -> on for CUDA
    train.tf32          a plain switch (default true), applied by ``configure_runtime``

:func:`resolve` replaces each ``auto`` by its value before anything reads the config (the
trainer prints what it chose, and saves the resolved config), so everything downstream sees
a concrete precision and plain booleans. On the CPU the resolved config trains exactly what
it did before these keys existed, except the optimizer kernel: fused AdamW differs from the
per-parameter loop by float rounding (~1e-7 on the weights after 100 steps, measured) and
its step is 2.4-5x faster there (bench/fused_adamw.py; docs/speed.md).

The lint (lint.py, ``speed_*`` checks) warns when a CUDA run turns one of these off.
"""

from __future__ import annotations

import torch

from ..config import Config, ConfigError, replace
from ..kinds import Precision, PrecisionSetting
from . import precision as prec

# Device types whose torch build has a fused AdamW kernel (torch.optim's own list, which is
# private: torch.utils._foreach_utils._get_fused_kernels_supported_devices).
FUSED_DEVICES = ("cuda", "cpu", "mps", "xpu", "hpu")


def resolve_precision(setting: PrecisionSetting, device: torch.device) -> Precision:
    """The concrete precision of ``setting`` on ``device``: itself, or for ``auto`` bf16
    where the GPU has it natively, else fp16 (with the grad scaler) on CUDA, else fp32."""
    if setting != "auto":
        return setting
    if device.type != "cuda":
        return "fp32"  # CPU bf16/fp16 autocast is emulated on most CPUs (precision.py)
    return "bf16" if prec.native_support("bf16", device) else "fp16"


def conv_model(cfg: Config) -> bool:
    """Whether the model is convolutional (our UNet, a Stable Diffusion UNet): the models
    for which channels-last pays. A DiT has one convolution (its patch embedding)."""
    return bool(cfg.model.pretrained) or cfg.model.kind == "unet"


def resolve(cfg: Config, device: torch.device) -> tuple[Config, list[str]]:
    """``cfg`` with every ``auto`` speed setting replaced by its value on ``device``, and
    what was chosen, one ``key=value`` per setting (see :func:`describe`).

    Idempotent: a resolved config comes back unchanged with nothing chosen. The copy is
    validated again (:func:`~steadydiff.config.replace`), so the cross-field checks that
    need a concrete precision (``adapter.base_precision``) apply to the resolved one.
    """
    cuda = device.type == "cuda"
    t, o, d = cfg.train, cfg.optim, cfg.data
    chosen: dict[str, object] = {}
    if t.precision == "auto":
        chosen["train.precision"] = resolve_precision("auto", device)
        if chosen["train.precision"] == "fp16" and t.parallel == "fsdp":
            chosen["train.precision"] = "fp32"  # no sharded grad scaler (config.py)
    if o.fused == "auto":
        chosen["optim.fused"] = device.type in FUSED_DEVICES
    if t.channels_last == "auto":
        chosen["train.channels_last"] = cuda and conv_model(cfg)
    if d.pin_memory == "auto":
        chosen["data.pin_memory"] = cuda
    if not chosen:
        return cfg, []
    notes = [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in chosen.items()]
    if chosen.get("train.precision") == "fp16":
        notes[0] += " (no native bf16 on this GPU; with the grad scaler)"
    elif "train.precision" in chosen and t.parallel == "fsdp" and cuda \
            and chosen["train.precision"] == "fp32":
        notes[0] += " (no native bf16 on this GPU, and FSDP takes no fp16)"
    try:
        return replace(cfg, chosen), notes
    except ConfigError as e:  # a rule the chosen value breaks: say where the value came from
        raise ConfigError(f"{e}\n(the `auto` settings chose {', '.join(notes)} on "
                          f"{device.type}; docs/speed.md)") from None


def describe(chosen: list[str], device: torch.device) -> str:
    """The one line a run prints about what :func:`resolve` chose."""
    return f"speed: {', '.join(chosen)} (auto on {device.type}; docs/speed.md)"


def optimizer_kwargs(fused: bool | str, device: torch.device) -> dict[str, bool]:
    """The AdamW keyword for ``optim.fused`` (``auto`` resolved on ``device``): fused, or
    torch's default implementation (foreach on CUDA, the per-parameter loop on the CPU)."""
    if fused == "auto":
        fused = device.type in FUSED_DEVICES
    return {"fused": True} if fused else {}


def memory_format(cfg: Config) -> torch.memory_format:
    """The memory format of the model's convolution weights and of each input batch."""
    return torch.channels_last if cfg.train.channels_last is True else torch.preserve_format


def set_tf32(enabled: bool) -> None:
    """TF32 tensor cores for fp32 matmuls (cuBLAS) and convolutions (cuDNN), or neither.

    Through the ``allow_tf32`` flags, not ``torch.backends.*.fp32_precision``: torch 2.13
    raises when a process mixes the two APIs and something then reads the other one, and
    libraries still read ``allow_tf32``; after these, both APIs read back consistently.
    """
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled


__all__ = ["FUSED_DEVICES", "conv_model", "describe", "memory_format", "optimizer_kwargs", "resolve",
           "resolve_precision", "set_tf32"]
