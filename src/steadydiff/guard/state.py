"""The guard's mutable state, with one typed owner: :class:`GuardState`.

Everything the guard learns about a run lives here — the detectors' running statistics, the
recovery budgets, the LR backoff and cap, the data it will not train on again, the attention
layers it upcast, the counters the summary reads — and nothing else does. The checkpoint
stores :meth:`GuardState.state_dict`; a deferred window's mark copies :data:`WINDOW_FIELDS`
(what a healthy step changes on the host) and puts them back on a rewind.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ..config import GuardConfig
from .checks import UpdateSize
from .detectors import BucketLossSpike, Divergence, GradSpike, Overflow, RunningStats, Trend

# the fields a healthy step changes on the host (everything else only changes on an
# incident, which never happens inside a deferred window): a window's mark copies them
WINDOW_FIELDS = ("grad", "loss", "divergence", "trend", "inputs", "overflow", "updates",
                 "max_lr", "lr_factor", "backoff_until", "last_factor", "pending_skips")

COUNTS = ("skips", "rollbacks", "steps_redone", "batches_skipped", "warnings",
          "samples_dropped", "quarantined", "rewinds", "steps_discarded")


@dataclass
class GuardState:
    """What the guard knows about the run (see the module docstring)."""

    cfg: GuardConfig
    # -- the detectors' running statistics (restart with :meth:`fresh_statistics`)
    grad: GradSpike = field(init=False)
    loss: BucketLossSpike = field(init=False)
    divergence: Divergence = field(init=False)
    trend: Trend = field(init=False)
    inputs: RunningStats = field(init=False)       # log max|x| of batches
    overflow: Overflow = field(init=False)         # fp16 scaler skips in a window
    updates: UpdateSize = field(init=False)        # each parameter's usual update size
    # -- the recovery budget
    skips: deque[int] = field(default_factory=deque)      # steps of recent skips
    rollbacks: deque[int] = field(default_factory=deque)  # steps of recent rollbacks
    last_rollback: tuple[int, str] | None = None          # (restored step, reason)
    same_rollbacks: int = 0
    spike_drops: deque[int] = field(default_factory=deque)  # loss spikes pinned on samples
    # -- the learning rate
    lr_factor: float = 1.0      # the temporary backoff after a rollback
    backoff_until: int = -1
    lr_cap: float | None = None  # lr_too_high: the LR is never above this again
    last_factor: float = 1.0     # what the last step applied: backoff and cap together
    max_lr: float = 0.0          # the largest LR applied by a healthy step so far
    # -- the data
    quarantine: set[int] = field(default_factory=set)            # never drawn again
    implicated: dict[int, list[int]] = field(default_factory=dict)  # index -> its steps
    pending_skips: set[int] = field(default_factory=set)         # positions not to train on
    skipped_positions: deque[int] = field(default_factory=deque)  # skipped since snapshots
    # -- precision
    upcast: list[str] = field(default_factory=list)  # attention layers in fp32 attention
    scaler_skips: int = 0
    # -- counters (the summary, the report, doctor)
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTS, 0))
    transient: dict[str, int] = field(default_factory=dict)  # rank -> re-run was finite
    unreproduced: dict[str, int] = field(default_factory=dict)  # rank -> window-only faults
    incidents_before: int = 0    # incidents of the run before a resume
    # -- the health probes
    warned: dict[tuple[str, str], int] = field(default_factory=dict)
    last_probe: dict | None = None
    last_probe_step: int | None = None

    def __post_init__(self) -> None:
        c = self.cfg
        self.overflow = Overflow(c.overflow_limit, c.overflow_window)
        self.fresh_statistics()

    def fresh_statistics(self) -> None:
        """The detectors' running statistics, empty: each warms up again over
        ``guard.warmup_steps`` before it may fire."""
        c = self.cfg
        self.grad = GradSpike(c.momentum, c.grad_z, c.warmup_steps)
        self.loss = BucketLossSpike(c.t_buckets, c.momentum, c.loss_z, c.loss_ratio,
                                    c.warmup_steps)
        self.divergence = Divergence(c.divergence_window, c.divergence_ratio, c.warmup_steps)
        self.trend = Trend(c.trend_window, c.trend_grad_ratio, c.trend_loss_ratio,
                           c.trend_lr_rise, c.warmup_steps)
        self.inputs = RunningStats(0.99)
        self.updates = UpdateSize(c.update_ratio, c.momentum, c.warmup_steps)

    def reset_budget(self) -> None:
        """Forget the recovery budget and the temporary LR backoff (the cap, the quarantine
        and the statistics stay)."""
        self.skips.clear()
        self.rollbacks.clear()
        self.last_rollback, self.same_rollbacks = None, 0
        self.lr_factor, self.backoff_until = 1.0, -1

    def count_rank(self, table: str, rank: int | None) -> None:
        """One more fault of ``table`` (``transient`` / ``unreproduced``) on ``rank``."""
        counter = getattr(self, table)
        key = str(rank if rank is not None else 0)
        counter[key] = counter.get(key, 0) + 1

    def state_dict(self, num_incidents: int) -> dict[str, Any]:
        """What exact resume needs (the checkpoint's ``guard`` entry)."""
        return {
            "grad": self.grad.stats.state(), "loss": [s.state() for s in self.loss.stats],
            "inputs": self.inputs.state(),
            "divergence": self.divergence.state(), "overflow": list(self.overflow.events),
            "skips": list(self.skips), "rollbacks": list(self.rollbacks),
            "lr_factor": self.lr_factor, "backoff_until": self.backoff_until,
            "max_lr": self.max_lr, "lr_cap": self.lr_cap, "trend": self.trend.state(),
            "quarantine": sorted(self.quarantine),
            "implicated": {str(k): v for k, v in self.implicated.items()},
            "pending_skips": sorted(self.pending_skips),
            "skipped_positions": list(self.skipped_positions),
            "last_rollback": list(self.last_rollback) if self.last_rollback else None,
            "same_rollbacks": self.same_rollbacks, "transient": dict(self.transient),
            "unreproduced": dict(self.unreproduced),
            "spike_drops": list(self.spike_drops),
            "upcast_attention": list(self.upcast), "updates": self.updates.state(),
            "counts": dict(self.counts),
            "scaler_skips": self.scaler_skips, "incidents": num_incidents,
        }

    def load_state_dict(self, s: dict[str, Any]) -> None:
        """Load :meth:`state_dict` (keys added later fall back to their defaults). The
        upcast layers are listed in ``upcast_attention``; re-applying them to a model is the
        guard's business."""
        self.grad.stats.load(s["grad"])
        self.inputs.load(s["inputs"])
        for st, v in zip(self.loss.stats, s["loss"]):
            st.load(v)
        self.divergence.load(s["divergence"])
        self.overflow.events = deque(s["overflow"])
        self.skips, self.rollbacks = deque(s["skips"]), deque(s["rollbacks"])
        self.lr_factor, self.backoff_until = s["lr_factor"], s["backoff_until"]
        self.max_lr = float(s.get("max_lr", 0.0))
        # (absent from checkpoints written before issue 13: the defaults)
        self.lr_cap = s.get("lr_cap")
        self.trend.load(s.get("trend"))
        self.quarantine = {int(i) for i in s.get("quarantine", ())}
        self.implicated = {int(k): list(v) for k, v in s.get("implicated", {}).items()}
        self.pending_skips = {int(p) for p in s.get("pending_skips", ())}
        self.skipped_positions = deque(int(p) for p in s.get("skipped_positions", ()))
        last = s.get("last_rollback")
        self.last_rollback = (int(last[0]), str(last[1])) if last else None
        self.same_rollbacks = int(s.get("same_rollbacks", 0))
        self.transient = {str(k): int(v) for k, v in s.get("transient", {}).items()}
        self.unreproduced = {str(k): int(v) for k, v in s.get("unreproduced", {}).items()}
        self.spike_drops = deque(int(x) for x in s.get("spike_drops", ()))
        self.updates.load(s.get("updates"))
        self.counts.update(s["counts"])
        self.scaler_skips = s.get("scaler_skips", 0)
        self.incidents_before = int(s.get("incidents", 0))
