"""Values as a run's JSON files hold them, read and printed one way everywhere.

The trainer and the guard write non-finite floats as the strings ``"nan"``, ``"inf"`` and
``"-inf"`` (strict JSON has no NaN), so every reader of metrics.jsonl, incidents.jsonl or
layers.jsonl goes through :func:`num`; every short human form of a number (the report, the
doctor, the guard's summary, incident summaries) goes through :func:`fmt`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch


def num(v: Any) -> float | None:
    """A logged value as a float (NaN/Inf included), or None when absent or not a number."""
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str):
        try:
            return float(v)  # "nan", "inf", "-inf"
        except ValueError:
            return None
    return None


def finite(v: Any) -> bool:
    """Whether ``v`` is a finite number (as :func:`num` reads it)."""
    x = num(v)
    return x is not None and math.isfinite(x)


def fmt(v: Any) -> str:
    """Short human form of a value: numbers to 4 significant digits (ints whole, non-finite
    as ``nan``/``inf``), lists as their first six items, None as ""; anything else as str."""
    x = num(v) if not isinstance(v, (str, bool)) or num(v) is not None else None
    if x is None:
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(fmt(e) for e in v[:6]) + (", …" if len(v) > 6 else "") + "]"
        return "" if v is None else str(v)
    if isinstance(v, int) and not isinstance(v, bool):
        return str(v)
    if not math.isfinite(x):
        return str(x)
    return f"{x:.4g}"


def jsonable(obj: Any) -> Any:
    """``obj`` as strict JSON can hold it: non-finite floats as strings, tensors as lists,
    paths as strings, tuples and ranges as lists, keys as strings."""
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, range)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else str(obj)
    if isinstance(obj, torch.Tensor):
        return jsonable(obj.tolist())
    if isinstance(obj, Path):
        return str(obj)
    return obj


def module_of(param: str) -> str:
    """The module a parameter belongs to (``down.0.conv.weight`` -> ``down.0.conv``)."""
    return param.rsplit(".", 1)[0] if "." in param else param
