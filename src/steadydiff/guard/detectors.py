"""Cheap per-step detectors. Each one reads host-side numbers the guard already synced
(one small transfer per step) and returns findings; none of them touches the model.

- Gradient-norm spikes: z-score against an EMA of mean and variance (ZClip, Kumar et al.
  2025), silent during a warm-up while the statistics settle.
- Loss spikes per timestep bucket: diffusion loss depends strongly on t (an eps-prediction
  loss near t=0 is orders of magnitude above the loss near t=T), so a sample's loss is judged
  against the running statistics of its own t-bucket, in log space, not a global mean.
- Slow divergence: a smoothed log-loss that has risen well above its best level, with no
  single spike (the failure that looks fine step by step).
- fp16 overflow: grad-scaler skips piling up in a window (the scale collapsing).
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

from . import findings
from .findings import Finding  # the detectors' output: one typed record per kind


class RunningStats:
    """EMA of mean and variance (ZClip's estimator): m <- a·m + (1-a)·x,
    v <- a·v + (1-a)·(x-m)². ``count`` observations so far."""

    def __init__(self, momentum: float):
        self.momentum = momentum
        self.mean = 0.0
        self.var = 0.0
        self.count = 0

    def z(self, x: float, min_std: float = 0.0) -> float:
        if self.count == 0:
            return 0.0
        return (x - self.mean) / max(math.sqrt(self.var), min_std, 1e-12)

    def update(self, x: float) -> None:
        if self.count == 0:
            self.mean, self.var = x, 0.0
        else:
            a = self.momentum
            d = x - self.mean
            self.mean = a * self.mean + (1 - a) * x
            self.var = a * self.var + (1 - a) * d * d
        self.count += 1

    def state(self) -> list[float]:
        return [self.mean, self.var, self.count]

    def load(self, s: list[float]) -> None:
        self.mean, self.var, self.count = float(s[0]), float(s[1]), int(s[2])


class GradSpike:
    """Gradient-norm spike: z = (g - mean) / std of the running statistics > ``z_max``."""

    def __init__(self, momentum: float, z_max: float, warmup: int):
        self.stats = RunningStats(momentum)
        self.z_max, self.warmup = z_max, warmup

    def check(self, grad_norm: float) -> Finding | None:
        if self.stats.count < self.warmup:
            return None
        # std floor: 5% of the mean, so a near-constant norm does not make noise a "spike"
        z = self.stats.z(grad_norm, min_std=0.05 * abs(self.stats.mean))
        if z > self.z_max:
            return findings.GradSpike.new(grad_norm=grad_norm, running_mean=self.stats.mean,
                                          running_std=math.sqrt(self.stats.var), z=z,
                                          threshold=self.z_max)
        return None

    def observe(self, grad_norm: float) -> None:
        self.stats.update(grad_norm)

    def clip_value(self) -> float | None:
        """ZClip's adaptive threshold mean + z_max·std (None until warmed up)."""
        if self.stats.count < max(self.warmup, 1):
            return None
        return self.stats.mean + self.z_max * math.sqrt(self.stats.var)


class BucketLossSpike:
    """Per-timestep-bucket loss spikes, judged in log space against the bucket's own
    running mean/std; a spike also needs the loss ``ratio_min`` x above the bucket mean, so a
    bucket with tiny variance cannot fire on noise."""

    def __init__(self, buckets: int, momentum: float, z_max: float, ratio_min: float,
                 warmup: int):
        self.stats = [RunningStats(momentum) for _ in range(buckets)]
        self.z_max, self.ratio_min, self.warmup = z_max, ratio_min, warmup

    def check(self, bucket_means: list[float | None]) -> Finding | None:
        worst = None
        for b, m in enumerate(bucket_means):
            s = self.stats[b]
            if m is None or s.count < self.warmup or m <= 0:
                continue
            lm = math.log(m)
            z = s.z(lm, min_std=0.05)
            ratio = math.exp(lm - s.mean)
            if z > self.z_max and ratio >= self.ratio_min and (worst is None or z > worst[1]):
                worst = (b, z, m, ratio)
        if worst is None:
            return None
        b, z, m, ratio = worst
        n = len(self.stats)
        return findings.LossSpike.new(
            t_bucket=b, buckets=n, loss=m, bucket_mean=math.exp(self.stats[b].mean),
            ratio=ratio, z=z, threshold=self.z_max,
            buckets_over=sum(1 for bb, mm in enumerate(bucket_means)
                             if mm and self.stats[bb].count and
                             mm > self.ratio_min * math.exp(self.stats[bb].mean)))

    def observe(self, bucket_means: list[float | None]) -> None:
        for b, m in enumerate(bucket_means):
            if m is not None and m > 0:
                self.stats[b].update(math.log(m))


class Divergence:
    """Slow divergence: the smoothed log-loss (EMA with a time constant of window/10 steps)
    has risen ``log(ratio)`` above the best smoothed level, after a full window of steps."""

    def __init__(self, window: int, ratio: float, warmup: int):
        self.window, self.log_ratio, self.warmup = window, math.log(ratio), warmup
        self.alpha = 1.0 - 1.0 / max(1.0, window / 10)
        self.smooth: float | None = None
        self.best = math.inf
        self.seen = 0

    def check_and_observe(self, mean_loss: float) -> Finding | None:
        if not self.window or mean_loss <= 0:
            return None
        x = math.log(mean_loss)
        self.smooth = x if self.smooth is None else self.alpha * self.smooth + (1 - self.alpha) * x
        self.seen += 1
        if self.seen < self.warmup + self.window // 10:
            return None
        self.best = min(self.best, self.smooth)
        if self.seen >= self.warmup + self.window and self.smooth - self.best > self.log_ratio:
            return findings.Divergence.new(
                smoothed_loss=math.exp(self.smooth), best_smoothed_loss=math.exp(self.best),
                threshold_ratio=math.exp(self.log_ratio), window=self.window)
        return None

    def reset_best(self) -> None:
        """After a recovery, judge the new trajectory from where it now stands."""
        self.best = math.inf if self.smooth is None else self.smooth
        self.seen = self.warmup + self.window // 10

    def state(self) -> list[Any]:
        return [self.smooth, self.best if math.isfinite(self.best) else None, self.seen]

    def load(self, s: list[Any]) -> None:
        self.smooth = s[0]
        self.best = math.inf if s[1] is None else float(s[1])
        self.seen = int(s[2])


class Overflow:
    """fp16 overflow: scaler skips in the last ``window`` steps reaching ``limit``."""

    def __init__(self, limit: int, window: int):
        self.limit, self.window = limit, window
        self.events: deque[int] = deque()

    def record(self, step: int, scale: float) -> Finding | None:
        self.events.append(step)
        while self.events and self.events[0] <= step - self.window:
            self.events.popleft()
        if len(self.events) >= self.limit:
            return findings.Fp16Overflow.repeated(overflows_in_window=len(self.events),
                                                  window=self.window, limit=self.limit,
                                                  loss_scale=scale)
        return None

    def clear(self) -> None:
        self.events.clear()
