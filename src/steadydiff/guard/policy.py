"""Findings -> actions: the guard's decision table, as one pure function.

:func:`decide` maps what a detector saw (a :class:`Finding`), the recent history of the run
(:class:`History`: past skips and rollbacks, the precision, whether a verified snapshot
exists) and the config to an :class:`Action`. It holds every rule of escalation, the recovery
budgets and the precision fallback chain; it touches no model, optimizer or file, so it is
tested on its own (tests/test_policy.py) and the guard only carries the action out.

The rules (docs/guard.md):

- a corrupt batch (``bad_batch``) is skipped, never escalated: the data is at fault;
- fp16 overflow is first the grad scaler's business (lower the scale, skip the step); one
  that repeats ``overflow_limit`` times within ``overflow_window`` steps is a precision
  problem: fall back fp16 -> bf16 -> fp32 (the first one the device runs natively);
- a forward overflow that began in an attention layer is first that layer's: upcast its
  attention to fp32 (skip the step); if an upcast layer overflows again, the upcast did not
  help: fall back in precision at once;
- the weights themselves went bad after an update (``nonfinite_params``, ``weight_jump``):
  roll back, the state is unusable;
- a slow divergence: roll back to the *oldest* snapshot (the newest is already on the slope);
- anything else (a non-finite loss or gradient, a loss or grad-norm spike, an LR jump) is
  skipped, and rolled back once ``skips_before_rollback`` incidents arrive within
  ``skip_window`` steps;
- a rollback needs a verified snapshot and is limited to ``max_rollbacks`` per
  ``budget_window`` steps, skips to ``max_skips`` per ``budget_window``: past a budget, abort;
- a bf16 rollback whose replay named the module that went non-finite also falls back to fp32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..config import GuardConfig
from ..kinds import Precision
from .detectors import Finding

ActionKind = Literal["skip", "rollback", "abort"]

# kinds whose finding means the weights after the update are unusable
STATE_UNUSABLE = frozenset({"nonfinite_params", "weight_jump"})
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
    upcast: attention layers whose attention already runs in fp32 (an earlier
        ``attention_upcast``).
    """

    step: int
    skips: tuple[int, ...] = ()
    rollbacks: tuple[int, ...] = ()
    precision: Precision = "fp32"
    supported: frozenset[Precision] = frozenset({"fp32"})
    has_snapshot: bool = True
    upcast: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Action:
    """What to do about a finding.

    kind: ``skip`` (no update; the batch is dropped), ``rollback`` (restore a snapshot, skip
        the data window, back the LR off) or ``abort``.
    reason: what the rollback (or the abort in place of one) answers.
    why: an abort's explanation (which budget, or no snapshot).
    snapshot: which snapshot a rollback restores.
    precision: switch to this precision (a fallback), or None.
    upcast: compute this attention layer's attention in fp32 from now on (with a scaler
        skip), or None.
    scaler: an fp16 overflow skip: the grad scaler lowers its scale.
    record: write an incident (routine fp16 calibration skips are silent).
    budget_abort: after recording the skip, abort: the skip budget is spent (the text says
        how).
    """

    kind: ActionKind
    reason: str = ""
    why: str = ""
    snapshot: Literal["newest", "oldest"] = "newest"
    precision: Precision | None = None
    upcast: str | None = None
    scaler: bool = False
    record: bool = True
    budget_abort: str | None = None


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


def _rollback(f: Finding, h: History, c: GuardConfig, reason: str,
              snapshot: Literal["newest", "oldest"] = "newest") -> Action:
    if not h.has_snapshot:
        return Action("abort", reason=reason, why="no verified snapshot to roll back to")
    if recent(h.rollbacks, h.step, c.budget_window) >= c.max_rollbacks:
        return Action("abort", reason=reason,
                      why=f"{c.max_rollbacks} rollbacks within {c.budget_window} steps already")
    prov = f.evidence.get("provenance") or {}
    new = (fallback(h.precision, h.supported, c.precision_fallback)
           if h.precision == "bf16" and prov.get("first_nonfinite_module") else None)
    return Action("rollback", reason=reason, snapshot=snapshot, precision=new)


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
        return _rollback(f, h, c, "state unusable")
    if f.kind == "divergence":
        return _rollback(f, h, c, "slow divergence", snapshot="oldest")
    if recent(h.skips, h.step, c.skip_window) + 1 >= c.skips_before_rollback:
        return _rollback(f, h, c, "repeated incidents")
    return _skip(h, c, reason=f.kind)


def decide_oom(micro_batch: int, c: GuardConfig) -> tuple[int | None, str]:
    """Out of memory at ``micro_batch``: the new micro-batch (half; gradient accumulation
    doubles so the global batch stays the same) and why, or ``(None, why)`` to abort."""
    if not c.oom_backoff:
        return None, "oom_backoff disabled"
    if micro_batch <= 1:
        return None, "out of memory at micro-batch 1"
    return micro_batch // 2, f"micro-batch {micro_batch} -> {micro_batch // 2}"
