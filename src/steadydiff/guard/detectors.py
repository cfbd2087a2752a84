"""Cheap per-step detectors. Each one reads host-side numbers the guard already synced
(one small transfer per step) and returns findings; none of them touches the model.

- Gradient-norm spikes: z-score against an EMA of mean and variance (ZClip, Kumar et al.
  2025), silent during a warm-up while the statistics settle.
- Loss spikes per timestep bucket: diffusion loss depends strongly on t (an eps-prediction
  loss near t=0 is orders of magnitude above the loss near t=T), so a sample's loss is judged
  against the running statistics of its own t-bucket, in log space, not a global mean.
- Slow divergence: a smoothed log-loss that has risen well above its best level, with no
  single spike (the failure that looks fine step by step), over a long window.
- Trend: sustained growth of the gradient norm *and* the loss over a short window (tens of
  steps), read robustly from the medians of the window's thirds, and related to the learning
  rate: ``lr_too_high`` when the LR rose across the window, ``divergence`` at a steady LR.
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
        self.best_step: int | None = None  # where the smoothed loss was at its best
        self.seen = 0

    def check_and_observe(self, mean_loss: float, step: int | None = None) -> Finding | None:
        if not self.window or mean_loss <= 0:
            return None
        x = math.log(mean_loss)
        self.smooth = x if self.smooth is None else self.alpha * self.smooth + (1 - self.alpha) * x
        self.seen += 1
        if self.seen < self.warmup + self.window // 10:
            return None
        if self.smooth < self.best:
            self.best, self.best_step = self.smooth, step
        if self.seen >= self.warmup + self.window and self.smooth - self.best > self.log_ratio:
            return findings.Divergence.new(
                smoothed_loss=math.exp(self.smooth), best_smoothed_loss=math.exp(self.best),
                threshold_ratio=math.exp(self.log_ratio), window=self.window,
                **({} if self.best_step is None else {"trend_start_step": self.best_step}))
        return None

    def reset_best(self) -> None:
        """After a recovery, judge the new trajectory from where it now stands."""
        self.best = math.inf if self.smooth is None else self.smooth
        self.seen = self.warmup + self.window // 10

    def state(self) -> list[Any]:
        return [self.smooth, self.best if math.isfinite(self.best) else None, self.seen,
                self.best_step]

    def load(self, s: list[Any]) -> None:
        self.smooth = s[0]
        self.best = math.inf if s[1] is None else float(s[1])
        self.seen = int(s[2])
        self.best_step = s[3] if len(s) > 3 else None


def _median(xs: list[float]) -> float:
    ys = sorted(xs)
    n = len(ys)
    return ys[n // 2] if n % 2 else 0.5 * (ys[n // 2 - 1] + ys[n // 2])


class Trend:
    """Sustained growth over the last ``window`` healthy steps: the medians of the window's
    three thirds (log grad norm, log loss) rise third by third, the grad norm's by at least
    ``grad_ratio`` and the loss's by at least ``loss_ratio`` from the first third to the last.
    Medians make it robust to single spikes and to the loss's noise across timesteps; the
    loss condition keeps it quiet in a healthy warm-up (the LR and often the grad norm rise,
    the loss falls). It reads nothing until ``warmup`` steps have passed.

    The finding relates the growth to the learning rate: if the LR at the end of the window
    is ``lr_rise`` x the LR at its start, ``lr_too_high`` (naming both LRs and the step where
    the growth began: the first step of the window, or the last step whose grad norm was at
    the first third's level); otherwise ``divergence`` at a steady LR.
    """

    def __init__(self, window: int, grad_ratio: float, loss_ratio: float, lr_rise: float,
                 warmup: int):
        self.window, self.warmup = window, warmup
        self.log_grad, self.log_loss = math.log(grad_ratio), math.log(loss_ratio)
        self.lr_rise = lr_rise
        self.rows: deque[tuple[int, float, float, float]] = deque(maxlen=max(window, 1))
        self.seen = 0

    def observe(self, step: int, lr: float, grad_norm: float, loss: float) -> None:
        """A healthy step: (its step, the LR applied, its grad norm and mean loss)."""
        if not self.window or not (grad_norm > 0 and loss > 0) or not (
                math.isfinite(grad_norm) and math.isfinite(loss)):
            return
        self.seen += 1
        if self.seen > self.warmup:
            self.rows.append((step, lr, math.log(grad_norm), math.log(loss)))

    def check(self) -> Finding | None:
        if not self.window or len(self.rows) < self.window:
            return None
        rows = list(self.rows)
        k = len(rows) // 3
        thirds = [rows[:k], rows[k:2 * k], rows[2 * k:]]
        g = [_median([r[2] for r in th]) for th in thirds]
        lo = [_median([r[3] for r in th]) for th in thirds]
        if not (g[0] < g[1] < g[2] and g[2] - g[0] >= self.log_grad
                and lo[2] >= lo[1] >= lo[0] - 0.02 and lo[2] - lo[0] >= self.log_loss):
            return None
        # where the growth began: the last step still at the first third's level
        start = rows[0][0]
        for r in rows[:2 * k]:
            if r[2] <= g[0]:
                start = r[0]
        lr0 = next(r[1] for r in rows if r[0] == start)
        lr1 = rows[-1][1]
        ev = dict(trend_start_step=start, grad_norm_ratio=math.exp(g[2] - g[0]),
                  loss_ratio=math.exp(lo[2] - lo[0]), window=self.window)
        if lr0 > 0 and lr1 >= self.lr_rise * lr0:
            return findings.LrTooHigh.new(lr_start=lr0, lr_end=lr1, **ev)
        return findings.Divergence.new(
            smoothed_loss=math.exp(lo[2]), best_smoothed_loss=math.exp(lo[0]),
            threshold_ratio=math.exp(self.log_loss), **ev)

    def lr_rose(self, lr_now: float, grad_norm: float, loss: float) -> Finding | None:
        """Spikes that keep coming while the LR rose: ``lr_too_high`` if the LR now is
        ``lr_rise`` x the LR at the start of the window. Training was last stable at the
        last step whose grad norm was at most the window's median: its LR is the one named
        stable, and the growth began there."""
        rows = list(self.rows)
        if len(rows) < 3 or rows[0][1] <= 0 or lr_now < self.lr_rise * rows[0][1]:
            return None
        med_g = _median([r[2] for r in rows])
        med_l = _median([r[3] for r in rows])
        stable = next(r for r in reversed(rows) if r[2] <= med_g)
        return findings.LrTooHigh.new(
            lr_start=stable[1], lr_end=lr_now, trend_start_step=stable[0],
            grad_norm_ratio=grad_norm / math.exp(med_g) if grad_norm > 0 else 0.0,
            loss_ratio=loss / math.exp(med_l) if loss > 0 else 0.0, window=len(rows))

    def reset(self) -> None:
        """After a recovery: judge the new trajectory on its own."""
        self.rows.clear()

    def state(self) -> dict[str, Any]:
        return {"rows": [list(r) for r in self.rows], "seen": self.seen}

    def load(self, s: dict[str, Any] | None) -> None:
        s = s or {}
        self.rows = deque((tuple(r) for r in s.get("rows", ())), maxlen=max(self.window, 1))
        self.seen = int(s.get("seen", 0))


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
