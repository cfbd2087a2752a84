"""The one way from a device name to a ``torch.device``: :func:`resolve_device`.

Every command (``train``, ``sample``, ``eval``, ``doctor``) and the Python API resolve the
device here, before they touch a file: a missing accelerator or a typo in its name is a
:class:`DeviceError` (a :class:`~steadydiff.config.ConfigError`, exit code 2) that says what
was asked for and what this machine has, not a traceback deep in torch or a checkpoint
"that cannot be loaded safely".
"""

from __future__ import annotations

import torch

from .config import ConfigError

# The device types steadydiff runs on; ``auto`` picks CUDA when present, else the CPU.
VALID_NAMES = ("auto", "cpu", "cuda", "cuda:N", "mps")


class DeviceError(ConfigError):
    """A device that is unknown, or not present on this machine."""


def available_devices() -> list[str]:
    """The devices this machine has, by name: ``['cpu', 'cuda:0', ...]``."""
    names = ["cpu"]
    if torch.cuda.is_available():
        names += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    if torch.backends.mps.is_available():
        names.append("mps")
    return names


def resolve_device(name: str | torch.device | None = "auto", *,
                   what: str = "device") -> torch.device:
    """The ``torch.device`` for ``name``, checked against this machine.

    Args:
        name: ``auto`` (or None: CUDA when available, else the CPU), ``cpu``, ``cuda``,
            ``cuda:N``, ``mps``, or a ``torch.device``.
        what: how the caller names the setting in messages (``--device``,
            ``train.device``).

    Returns:
        The device; ``cuda`` stays the current CUDA device (no index).

    Raises:
        DeviceError: an unknown name (the message lists the valid ones) or a device this
            machine does not have (the message lists the ones it has).
    """
    if name is None or name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    here = ", ".join(available_devices())
    try:
        dev = name if isinstance(name, torch.device) else torch.device(str(name).strip())
    except (RuntimeError, ValueError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda", "mps"):
        raise DeviceError(f"{what}: unknown device {str(name)!r}; valid device names: "
                          f"{', '.join(VALID_NAMES)} (available here: {here})")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"{what}: {dev} requested but not available here (no CUDA "
                              f"device, or torch built without CUDA); available: {here}")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise DeviceError(f"{what}: {dev} requested but this machine has "
                              f"{torch.cuda.device_count()} CUDA device(s); available: {here}")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise DeviceError(f"{what}: mps requested but not available here; available: {here}")
    return dev
