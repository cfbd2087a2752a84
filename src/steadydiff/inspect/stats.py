"""Small robust statistics for the doctor's checks: one layer is judged against the others."""

from __future__ import annotations

import math

import torch

KS_SAMPLE = 20_000   # values of each tensor the KS distance looks at


def median(sorted_values: list[float]) -> float:
    """The median of an already sorted list (NaN when empty)."""
    n = len(sorted_values)
    if n == 0:
        return float("nan")
    m = n // 2
    return sorted_values[m] if n % 2 else 0.5 * (sorted_values[m - 1] + sorted_values[m])


def robust_z(values: list[float], floor: float) -> list[float]:
    """(x - median) / max(1.4826·MAD, floor) for each value (the MAD-based z-score: one
    outlier cannot hide itself by inflating the spread; the floor keeps layers that all moved
    alike from calling a small difference a many-sigma event)."""
    if not values:
        return []
    med = median(sorted(values))
    mad = median(sorted(abs(v - med) for v in values))
    scale = max(1.4826 * mad, floor)
    return [(v - med) / scale for v in values]


def ks_distance(a: torch.Tensor, b: torch.Tensor, sample: int = KS_SAMPLE) -> float:
    """Two-sample Kolmogorov–Smirnov statistic sup_x |F_a(x) - F_b(x)| (what
    ``scipy.stats.ks_2samp`` reports), on at most ``sample`` values of each (a fixed,
    evenly strided subsample: deterministic, and plenty for a distance, not a p-value)."""
    a, b = a.detach().flatten().double(), b.detach().flatten().double()
    if a.numel() > sample:
        a = a[torch.linspace(0, a.numel() - 1, sample).long()]
    if b.numel() > sample:
        b = b[torch.linspace(0, b.numel() - 1, sample).long()]
    a, b = a.sort().values, b.sort().values
    grid = torch.cat([a, b])
    fa = torch.searchsorted(a, grid, right=True).double() / a.numel()
    fb = torch.searchsorted(b, grid, right=True).double() / b.numel()
    return float((fa - fb).abs().max())


def rms(t: torch.Tensor) -> float:
    """Root mean square of a tensor (0 for an empty one)."""
    return float(t.detach().double().pow(2).mean().sqrt()) if t.numel() else 0.0


def ratio_words(r: float) -> str:
    """A ratio for a sentence: ``×30``, ``×1.0e-06``."""
    if not math.isfinite(r):
        return f"×{r}"
    return f"×{r:.3g}" if r >= 0.01 else f"×{r:.1e}"
