"""Findings -> actions: the guard's decision table, as one pure function.

:func:`decide` maps what a detector saw (a :class:`Finding`), the recent history of the run
(:class:`History`: past skips and rollbacks, the precision, whether a verified snapshot
exists) and the config to an :class:`Action`. It holds every rule of escalation, the recovery
budgets and the precision fallback chain; it touches no model, optimizer or file, so it is
tested on its own (tests/test_policy.py) and the guard only carries the action out.

The rules (docs/guard.md):

- a corrupt batch (``bad_batch``) is skipped, never escalated: the data is at fault (when the
  guard singled out the samples responsible, it drops only those and trains on the rest:
  that happens before the policy is asked);
- fp16 overflow is first the grad scaler's business (lower the scale, skip the step); one
  that repeats ``overflow_limit`` times within ``overflow_window`` steps is a precision
  problem: fall back fp16 -> bf16 -> fp32 (the first one the device runs natively);
- a forward overflow that began in an attention layer is first that layer's: upcast its
  attention to fp32 (skip the step); if an upcast layer overflows again, the upcast did not
  help: fall back in precision at once;
- the weights themselves went bad (``nonfinite_params``, ``weight_jump``, or an update far
  above its parameter's usual size: ``large_update``): roll back at once,
  the state is unusable. Found *before* the forward pass (the weights changed between two
  steps) no data is to blame and none is skipped; found right after an update, the batch
  that made the update is;
- sustained growth of the gradient norm and the loss while the LR rose, or spikes that keep
  coming (they would escalate) while it rose (``lr_too_high``): roll back to the newest
  snapshot from before the growth began and cap the LR at ``lr_cap_fraction`` x the LR at
  which training was last stable; the same rollback again halves the cap once more; a slow
  divergence at a steady LR (``divergence``) rolls back to before it began too, with the
  usual LR backoff. Neither skips data;
- anything else (a non-finite loss or gradient, a loss or grad-norm spike, an LR jump) is
  skipped, and rolled back once ``skips_before_rollback`` incidents arrive within
  ``skip_window`` steps (skipping only the batches that were implicated);
- a rollback needs a verified snapshot and is limited to ``max_rollbacks`` per
  ``budget_window`` steps, skips to ``max_skips`` per ``budget_window``: past a budget, abort;
  restoring the same snapshot for the same cause a third time in a row is no strategy: abort
  with the diagnosis;
- a bf16 rollback whose replay named the module that went non-finite also falls back to fp32.
"""

from __future__ import annotations

import dataclasses

from dataclasses import dataclass
from typing import Literal

from ..config import GuardConfig
from ..kinds import Precision
from .detectors import Finding

ActionKind = Literal["skip", "rollback", "abort"]
SkipData = Literal["implicated", "none"]

# kinds whose finding means the weights after the update are unusable
STATE_UNUSABLE = frozenset({"nonfinite_params", "weight_jump", "large_update"})
# precisions to try, in order, when one overflows or goes non-finite
FALLBACK_CHAIN: dict[Precision, tuple[Precision, ...]] = {"fp16": ("bf16", "fp32"), "bf16": ("fp32",)}


@dataclass(frozen=True)
class History:
    """What the policy needs to know about the run so far.

    step: the current optimizer step.
    skips: steps of earlier skips (since the last rollback).
    rollbacks: steps of earlier rollbacks.
    precision: the runtime precision.
    supported: precisions this device runs natively (the fallback candidates).
    has_snapshot: a verified snapshot exists to roll back to.
    snapshots: the steps of the verified snapshots, oldest first (empty: unknown, the newest
        is used).
    last_rollback: (restored step, reason) of the latest rollback, or None.
    same_rollbacks: how many rollbacks in a row restored that step for that reason.
    upcast: attention layers whose attention already runs in fp32 (an earlier
        ``attention_upcast``).
    """

    step: int
    skips: tuple[int, ...] = ()
    rollbacks: tuple[int, ...] = ()
    precision: Precision = "fp32"
    supported: frozenset[Precision] = frozenset({"fp32"})
    has_snapshot: bool = True
    snapshots: tuple[int, ...] = ()
    last_rollback: tuple[int, str] | None = None
    same_rollbacks: int = 0
    upcast: frozenset[str] = frozenset()

    def snapshot_before(self, step: int | None) -> int | None:
        """The step of the newest snapshot at or before ``step`` (None: the newest), or of
        the oldest one when every snapshot is newer; None when the steps are unknown."""
        if not self.snapshots:
            return None
        if step is None:
            return self.snapshots[-1]
        older = [s for s in self.snapshots if s <= step]
        return older[-1] if older else self.snapshots[0]


@dataclass(frozen=True)
class Action:
    """What to do about a finding.

    kind: ``skip`` (no update; the batch is dropped), ``rollback`` (restore a snapshot, skip
        the implicated batches, back the LR off or cap it) or ``abort``.
    reason: what the rollback (or the abort in place of one) answers.
    why: an abort's explanation (which budget, or no snapshot).
    restore_before: a rollback restores the newest snapshot at or before this step (None:
        the newest snapshot).
    skip_data: a rollback skips the ``implicated`` batches (the failing one and the ones
        skipped since the snapshot) or ``none`` (the data is innocent: replay all of it).
    lr_cap_fraction: cap the LR at this fraction of the last stable LR (``lr_too_high``),
        instead of the temporary backoff; None: the backoff.
    precision: switch to this precision (a fallback), or None.
    upcast: compute this attention layer's attention in fp32 from now on (with a scaler
        skip), or None.
    scaler: an fp16 overflow skip: the grad scaler lowers its scale.
    record: write an incident (routine fp16 calibration skips are silent).
    budget_abort: after recording the skip, abort: the skip budget is spent (the text says
        how).
    lr_backoff: a rollback backs the LR off for a while (False: the LR is not the cause, as
        for weights changed between two steps or an optimizer state gone bad: the restored
        state trains on at the same LR).
    """

    kind: ActionKind
    reason: str = ""
    why: str = ""
    restore_before: int | None = None
    skip_data: SkipData = "implicated"
    lr_cap_fraction: float | None = None
    precision: Precision | None = None
    upcast: str | None = None
    scaler: bool = False
    record: bool = True
    budget_abort: str | None = None
    lr_backoff: bool = True


def recent(events: tuple[int, ...] | list[int], now: int, window: int) -> int:
    """How many of ``events`` (steps) lie within the last ``window`` steps before ``now``."""
    return sum(1 for e in events if e >= now - window)


def fallback(precision: Precision, supported: frozenset[Precision],
             enabled: bool = True) -> Precision | None:
    """The precision to fall back to from ``precision``: the first of the chain the device
    runs natively, or None (disabled, or nothing left)."""
    if not enabled:
        return None
    return next((p for p in FALLBACK_CHAIN.get(precision, ()) if p in supported), None)


def _skip(h: History, c: GuardConfig, **kw) -> Action:
    # this skip counts too: more than max_skips within the window ends the run
    n = recent(h.skips, h.step, c.budget_window) + 1
    over = (f"more than {c.max_skips} skipped steps within {c.budget_window}"
            if n > c.max_skips else None)
    return Action("skip", budget_abort=over, **kw)


def _rollback(f: Finding, h: History, c: GuardConfig, reason: str, *,
              restore_before: int | None = None, skip_data: SkipData = "implicated",
              lr_cap_fraction: float | None = None) -> Action:
    if not h.has_snapshot:
        return Action("abort", reason=reason, why="no verified snapshot to roll back to")
    if recent(h.rollbacks, h.step, c.budget_window) >= c.max_rollbacks:
        return Action("abort", reason=reason,
                      why=f"{c.max_rollbacks} rollbacks within {c.budget_window} steps already")
    target = h.snapshot_before(restore_before)
    again = target is not None and h.last_rollback == (target, reason)
    if again and h.same_rollbacks >= 2:
        return Action("abort", reason=reason,
                      why=f"restored step {target} for {reason} {h.same_rollbacks} times in a "
                          "row and it came back: the cause persists from that state")
    if again and lr_cap_fraction is not None:
        lr_cap_fraction *= lr_cap_fraction  # the cap did not hold: a stricter one
    prov = f.evidence.get("provenance") or {}
    new = (fallback(h.precision, h.supported, c.precision_fallback)
           if h.precision == "bf16" and prov.get("first_nonfinite_module") else None)
    return Action("rollback", reason=reason, restore_before=restore_before,
                  skip_data=skip_data, lr_cap_fraction=lr_cap_fraction, precision=new)


def decide(f: Finding, h: History, c: GuardConfig) -> Action:
    """The action for finding ``f`` given the history ``h`` (pure; see the module doc)."""
    if f.kind == "fp16_overflow":
        attn = f.evidence.get("attention_module")
        if attn and attn not in h.upcast:  # the first remedy: this layer's attention in fp32
            return Action("skip", scaler=True, upcast=attn,
                          reason=f"fp16 overflow in the attention of {attn}")
        if attn or f.severity == "trend":  # repeated, or upcast did not help: precision
            new = fallback(h.precision, h.supported, c.precision_fallback)
            n = recent(h.skips, h.step, c.budget_window)
            over = (f"more than {c.max_skips} skipped steps within {c.budget_window}"
                    if n > c.max_skips else None)
            return Action("skip", scaler=True, precision=new, budget_abort=over,
                          reason=(f"fp16 overflow in {attn} persists after its attention "
                                  "upcast") if attn else "repeated fp16 overflow")
        # one overflow: the scaler calibrates; an overflow in the forward pass is recorded
        return Action("skip", scaler=True, record=f.severity != "routine",
                      reason="fp16 overflow")
    if f.kind == "bad_batch":
        return _skip(h, c, reason="corrupt batch")
    if f.kind in STATE_UNUSABLE:
        # changed between two steps: the batch of this step is innocent
        # (an update far above its usual size: the optimizer state, not the batch)
        between = f.evidence.get("when") == "before_forward" or f.kind == "large_update"
        a = _rollback(f, h, c, "state unusable", skip_data="none" if between else "implicated")
        # nor is the LR to blame for a state changed between steps: no backoff
        return dataclasses.replace(a, lr_backoff=False) if between else a
    if f.kind == "lr_too_high":
        return _rollback(f, h, c, "learning rate too high",
                         restore_before=_int(f.evidence.get("trend_start_step")),
                         skip_data="none", lr_cap_fraction=c.lr_cap_fraction)
    if f.kind == "divergence":
        return _rollback(f, h, c, "slow divergence",
                         restore_before=_int(f.evidence.get("trend_start_step")),
                         skip_data="none")
    if escalates(h, c):
        return _rollback(f, h, c, "repeated incidents")
    return _skip(h, c, reason=f.kind)


def escalates(h: History, c: GuardConfig) -> bool:
    """Whether one more skippable incident now turns into a rollback (the guard asks too:
    spikes that escalate while the LR rose are named ``lr_too_high``)."""
    return recent(h.skips, h.step, c.skip_window) + 1 >= c.skips_before_rollback


def _int(v: object) -> int | None:
    return int(v) if isinstance(v, (int, float)) else None


def decide_oom(micro_batch: int, c: GuardConfig) -> tuple[int | None, str]:
    """Out of memory at ``micro_batch``: the new micro-batch (half; gradient accumulation
    doubles so the global batch stays the same) and why, or ``(None, why)`` to abort."""
    if not c.oom_backoff:
        return None, "oom_backoff disabled"
    if micro_batch <= 1:
        return None, "out of memory at micro-batch 1"
    return micro_batch // 2, f"micro-batch {micro_batch} -> {micro_batch // 2}"
