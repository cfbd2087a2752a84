"""Golden-number helpers shared by the pinned tests (test_golden.py, test_compat.py).

A pinned value is what today's code computes on CPU, fp32, one thread. ``pin`` compares
with a relative tolerance (1e-5 by default: far above run-to-run noise, which is zero on one
thread, and far below what a change to the math moves) and its message shows the new value,
so a deliberate change can be re-pinned from the failure output.
"""

from __future__ import annotations

import pytest
import torch


def checksum(x: torch.Tensor | dict[str, torch.Tensor]) -> tuple[float, float]:
    """(sum, sum of |.|) in float64 of a tensor or of every floating tensor of a dict."""
    ts = [x] if isinstance(x, torch.Tensor) else [v for v in x.values() if v.is_floating_point()]
    return (sum(float(t.double().sum()) for t in ts),
            sum(float(t.double().abs().sum()) for t in ts))


def pin(what: str, got, want, rel: float = 1e-5, abs_: float = 1e-6) -> None:
    """Assert ``got`` (a number or a tuple/list of numbers) matches the pinned ``want``."""
    g = tuple(got) if isinstance(got, (tuple, list)) else (got,)
    w = tuple(want) if isinstance(want, (tuple, list)) else (want,)
    assert len(g) == len(w) and all(a == pytest.approx(b, rel=rel, abs=abs_)
                                    for a, b in zip(g, w)), \
        f"{what} = {got!r}, pinned {want!r}"
