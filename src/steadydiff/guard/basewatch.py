"""The frozen base under the guard: a non-finite step whose cause is a corrupted frozen weight.

An adapter run (a LoRA, a hypernetwork, a ControlNet) trains on top of a base it never
changes, so the guard's own checks (the trainable weights, their update, the rollback ring)
do not cover it. When the base's weights turn non-finite mid-run (a memory fault, code that
writes into them), every step's loss is NaN, and the guard's usual answers (rerun, skip,
precision fallback, rollback with a lower LR) are all wrong: none of them touches the base.

:func:`check` is asked on a step whose loss or gradients are non-finite, before any of those
answers, when the guard has a ``frozen`` watch (``Guard.frozen``: an object with ``bad()``,
``evidence(bad)``, ``repair(bad)``, e.g. integrations/sd/frozen.py ``FrozenWatch``; the
trainer sets it on SD-path adapter runs; a loop of one's own may too). One reduction over
the frozen weights, only on a failed step. A corrupt base is a ``base_corrupt`` incident:
repaired from disk, the step is redone on the same batch (the data was innocent; the
trainable weights were not updated); not repairable, the run stops naming the file.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .findings import BaseCorrupt

if TYPE_CHECKING:
    from .guard import Decision, Guard

__all__ = ["SYMPTOMS", "MAX_REPAIRS", "check"]

# the findings a broken frozen weight shows up as
SYMPTOMS = ("nonfinite_loss", "nonfinite_grad", "fp16_overflow")
# repairs in one run before the guard stops: a base that keeps breaking is a hardware fault
MAX_REPAIRS = 3


def _any(flag: bool, world: int, device: Any) -> bool:
    """``flag`` OR-reduced over the ranks (one tiny all-reduce; only on a failed step)."""
    if world <= 1:
        return flag
    import torch
    import torch.distributed as dist

    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def check(guard: "Guard", seen: Any) -> "Decision | None":
    """A :class:`Decision` when a frozen weight of ``guard.frozen`` is non-finite (repaired
    and the step to be redone: ``skip`` without moving the data position; or ``abort``),
    else None (the guard goes on with its own diagnosis)."""
    from .guard import Decision

    watch = guard.frozen
    bad = watch.bad()
    world = getattr(seen, "world", 1)
    if not _any(bool(bad), world, guard.device):  # every rank decides the same
        return None
    prog = guard.progress
    guard.update.discard(prog)
    why, ev = None, (watch.evidence(bad) if bad else {})  # before the repair changes them
    if bad:
        why = watch.repair(bad) if getattr(watch, "repairs", 0) < MAX_REPAIRS else (
            f"the base was already repaired {MAX_REPAIRS} times in this run and broke "
            "again: a hardware (memory) fault or code that writes into the base's weights")
    failed = _any(why is not None, world, guard.device)  # any rank's repair failed
    if not bad:  # another rank's base broke: this one redoes the step (or stops) with it
        if failed:
            why = "another rank's frozen base could not be restored from disk"
            return Decision("abort", prog.step, prog.batches_consumed, seen.loss,
                            seen.grad_norm, guard.record(
                                BaseCorrupt.new(parameter="(another rank)", parameters=[],
                                                count=0, part="?", values="?", file="?",
                                                repaired=False, why=why),
                                "abort", diagnosis={"why": why, "cause": "base"}))
        return Decision("skip", prog.step, prog.batches_consumed, seen.loss, seen.grad_norm)
    if why is None and failed:
        why = "another rank's frozen base could not be restored from disk"
    f = BaseCorrupt.new(**ev, repaired=why is None, why=why)
    if why is None:
        inc = guard.record(f, "restore_base",
                           cost={"steps_redone": 1, "batches_skipped": 0},
                           diagnosis={"reason": "a frozen base weight turned non-finite: "
                                      "restored from the files on disk; the step is redone "
                                      "on the same batch (not the LR, not the data)"})
        return Decision("skip", prog.step, prog.batches_consumed, seen.loss, seen.grad_norm,
                        incident=inc)
    inc = guard.record(f, "abort", diagnosis={
        "why": f"the base model is corrupt: {ev['parameter']} is non-finite ({ev['values']}) "
               f"and could not be restored ({why}); download or copy {ev['file']} again and "
               "rerun the same command (the LR is not the cause)",
        "cause": "base"})
    return Decision("abort", prog.step, prog.batches_consumed, seen.loss, seen.grad_norm, inc)
