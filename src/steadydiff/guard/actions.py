"""The guard's actions: what it does once :func:`steadydiff.guard.policy.decide` has chosen
— skip the step (a scaler skip, an attention upcast, a precision fallback), roll back to a
verified snapshot (skipping the implicated batches, backing the LR off or capping it), or
abort — each recorded as an :class:`~steadydiff.guard.records.Incident` with its cost.

Each function takes the :class:`~steadydiff.guard.guard.Guard` whose state it changes: its
``state`` (budgets, LR, data positions, counters), ``progress`` (step, data position,
precision, scaler), ``update`` (to discard the step's gradients) and snapshot ring.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any

from ..values import num
from . import findings, policy, provenance
from .checks import Seen
from .detectors import Finding
from .policy import Action
from .records import Decision
from .snapshots import Snapshot

if TYPE_CHECKING:
    from .guard import Guard


def act(g: "Guard", f: Finding, seen: Seen) -> Decision:
    """Carry out the policy's action for finding ``f``."""
    a = policy.decide(f, g.history(), g.cfg)
    if a.kind == "rollback":
        return rollback(g, f, a, seen)
    if a.kind == "abort":
        g.update.discard(g.progress)
        inc = g.record(f, "abort", diagnosis={"why": a.why, "reason": a.reason})
        return Decision("abort", g.progress.step, g.progress.batches_consumed,
                        seen.loss, seen.grad_norm, inc)
    return skip(g, f, a, seen)


def skip(g: "Guard", f: Finding, a: Action, seen: Seen) -> Decision:
    """No update this step; the batch is dropped (a scaler skip lowers the fp16 scale)."""
    c, prog, st = g.cfg, g.progress, g.state
    g.update.discard(prog)
    inc = None
    if a.scaler:
        st.scaler_skips += 1
        if a.upcast:
            upcast_attention(g, a.upcast)
            inc = g.record(
                findings.AttentionUpcast.new(module=a.upcast, loss=seen.loss,
                                             loss_scale=f.evidence.get("loss_scale"),
                                             provenance=f.provenance or None),
                "attention_upcast",
                cost={"steps_redone": 0, "batches_skipped": 1,
                      "batch_position": prog.batches_consumed},
                diagnosis={"reason": a.reason,
                           "note": f"q kᵀ and softmax of {a.upcast} in fp32 from now on"})
        elif f.severity == "trend" or a.precision:
            inc = g.record(f, "precision_fallback" if a.precision else "skip",
                           diagnosis={"reason": a.reason, **(
                               {"new_precision": a.precision} if a.precision else
                               {"note": "precision fallback disabled or not available"})})
            if a.precision:
                prog.precision, prog.scaler = a.precision, None
        elif a.record:
            inc = g.record(f, "skip", cost={"steps_redone": 0, "batches_skipped": 1,
                                            "batch_position": prog.batches_consumed})
    else:
        st.skips.append(prog.step)
        st.counts["skips"] += 1
        inc = g.record(f, "skip", cost={"steps_redone": 0, "batches_skipped": 1,
                                        "batch_position": prog.batches_consumed})
    st.skipped_positions.append(prog.batches_consumed)
    prog.batches_consumed += 1
    jump_skipped(g)
    trim(g)
    if a.budget_abort:
        b = findings.SkipBudget.new(skips=len(st.skips), max_skips=c.max_skips,
                                    window=c.budget_window)
        inc = g.record(b, "abort", diagnosis={"why": a.budget_abort})
        return Decision("abort", prog.step, prog.batches_consumed, seen.loss,
                        seen.grad_norm, inc)
    return Decision("skip", prog.step, prog.batches_consumed, seen.loss, seen.grad_norm,
                    incident=inc, precision=a.precision if a.scaler else None)


def rollback(g: "Guard", f: Finding, a: Action, seen: Seen) -> Decision:
    """Restore a verified snapshot (the newest, or the newest from before a trend began),
    skip the implicated batches only, back the LR off or cap it."""
    c, prog, st = g.cfg, g.progress, g.state
    g.update.discard(prog)
    snap = snapshot_before(g, a.restore_before)
    failure_pos, failure_step = prog.batches_consumed, prog.step
    g.restore(snap)
    g.weights.forget()
    start = snap.batches_consumed
    skipping = set(range(start, start + c.skip_batches))
    if a.skip_data == "implicated":  # the failing batch, and the ones skipped since
        skipping |= {failure_pos} | {p for p in st.skipped_positions if p >= start}
    st.pending_skips = {p for p in st.pending_skips | skipping if p >= start}
    skipped = tuple(sorted(st.pending_skips))
    redone = prog.step - snap.step
    prog.step, prog.batches_consumed = snap.step, start
    jump_skipped(g)
    st.skipped_positions = deque(p for p in st.skipped_positions if p < start)
    g.ring.drop_after(snap.step)
    st.last_probe_step = None  # that step is redone; its probe is stale
    diagnosis: dict[str, Any] = {"reason": a.reason}
    if a.lr_cap_fraction is not None:  # the cause is the LR: cap it for good
        stable = num(f.evidence.get("lr_start")) or max(
            pg["lr"] for pg in g.optimizer.param_groups)
        cap = a.lr_cap_fraction * stable
        st.lr_cap = cap if st.lr_cap is None else min(st.lr_cap, cap)
        diagnosis["lr_cap"] = st.lr_cap
    elif a.lr_backoff:
        st.lr_factor = max(st.lr_factor * c.lr_backoff, 1e-4)
        st.backoff_until = prog.step + c.lr_backoff_steps
        diagnosis.update(lr_factor=st.lr_factor, lr_restored_at_step=st.backoff_until)
    else:
        diagnosis["lr"] = ("kept: the state changed between steps (or the optimizer's state "
                           "went bad), not through the learning rate")
    if (snap.step, a.reason) == st.last_rollback:
        st.same_rollbacks += 1
    else:
        st.last_rollback, st.same_rollbacks = (snap.step, a.reason), 1
    st.rollbacks.append(prog.step)
    st.skips.clear()
    st.divergence.reset_best()
    st.trend.reset()
    st.counts["rollbacks"] += 1
    st.counts["steps_redone"] += redone
    st.counts["batches_skipped"] += len(skipped)
    if a.precision:
        prog.precision = a.precision
        diagnosis["new_precision"] = a.precision
    inc = g.record(f, "rollback", step=failure_step, cost={
        "steps_redone": redone, "batches_skipped": len(skipped),
        "skipped_positions": list(skipped), "restored_step": snap.step},
        diagnosis=diagnosis)
    trim(g)
    return Decision("rollback", prog.step, prog.batches_consumed, seen.loss,
                    seen.grad_norm, inc, skipped_batches=skipped, precision=a.precision,
                    steps_back=redone)


def snapshot_before(g: "Guard", step: int | None) -> Snapshot:
    """The newest snapshot at or before ``step`` (None: the newest); the oldest when every
    snapshot is newer."""
    ring = list(g.ring.ring)
    if step is None:
        return ring[-1]
    older = [sn for sn in ring if sn.step <= step]
    return older[-1] if older else ring[0]


def trim(g: "Guard") -> None:
    """Forget skips and rollbacks older than every window that counts them."""
    c, st, now = g.cfg, g.state, g.progress.step
    horizon = now - max(c.skip_window, c.budget_window)
    for events in (st.skips, st.rollbacks, st.spike_drops):
        while events and events[0] < horizon:
            events.popleft()
    oldest = g.ring.oldest()  # a skipped batch matters while a rollback can reach it
    keep_from = (oldest.batches_consumed if oldest is not None
                 else g.progress.batches_consumed)
    while st.skipped_positions and st.skipped_positions[0] < keep_from:
        st.skipped_positions.popleft()


def jump_skipped(g: "Guard") -> None:
    """Move the data position past the batches a rollback decided not to train on."""
    prog, pending = g.progress, g.state.pending_skips
    while prog.batches_consumed in pending:
        pending.discard(prog.batches_consumed)
        prog.batches_consumed += 1


def upcast_attention(g: "Guard", name: str) -> None:
    """Compute attention layer ``name``'s q kᵀ and softmax in fp32 from now on (its
    ``upcast_attention`` attribute), in the model and in the EMA's copy of it, and remember
    it in the state (it survives rollbacks and resumes)."""
    module = dict(g.net.named_modules()).get(name)
    if module is None or not provenance.is_attention(module):
        raise ValueError(f"no attention module {name!r} with an upcast_attention attribute")
    module.upcast_attention = True
    copy = g.ema.module() if g.ema is not None else None
    twin = dict(copy.named_modules()).get(name) if copy is not None else None
    if twin is not None and provenance.is_attention(twin):
        twin.upcast_attention = True
    if name not in g.state.upcast:
        g.state.upcast.append(name)
