"""The time budget (``train.max_time``): training seconds as recorded state.

A run with a budget stops at the first step boundary where the training time used reaches
``train.max_time`` (``train.steps`` stays the upper bound) and ends like a finished run:
final checkpoint, sample grid, ``summary.json`` and report. With ``optim.schedule=cosine``
the decay's progress is the fraction of the budget used instead of ``step / steps``, so a
run cut short by its budget still ends its decay (the warmup stays in steps).

The time used is **recorded state**, ``TrainState.train_seconds``, saved in every
checkpoint's ``state.json``: the LR stays a pure function of ``(step, train_seconds)``
(optim.lr_at; STYLE.md: no hidden scheduler state), and a resumed run continues the budget
(the time already used counts) and the LR from the same progress. What counts as training
time: the loop's training passes (data loading, the step, the guard's work, the status
rows). Not counted: setup and resume, evaluation, sample grids, post-hoc EMA snapshots and
checkpoint writes (so runs with other cadences compare at equal training cost), nor the
time lost between the last checkpoint and a crash (those steps are trained, and counted,
again). A guard rollback moves the step back, never the time.

The clock is the host's (:func:`now`, monotonic): no device sync is added. On a GPU the
host runs ahead of the device by at most its launch queue; a pause whose work syncs anyway
(a checkpoint copies the weights) may absorb that queue's tail, a small fraction of a step.

Under torchrun every rank records the same value: the loop's one per-step agreement
(:meth:`~steadydiff.trainer.preempt.StopSignals.agreed`, a CPU all-reduce on a gloo group:
no device sync) takes the largest of the ranks' clocks, in the same all-reduce as the stop
signals, so every rank computes the same LR and stops at the same step.
"""

from __future__ import annotations

import time

from ..durations import format_duration
from .state import TrainState


def now() -> float:
    """The budget's clock, in seconds (monotonic). Tests replace this function to drive
    the budget deterministically."""
    return time.monotonic()


class Clock:
    """This process's training seconds not yet agreed (added to ``train_seconds``).

    Runs from construction; :meth:`pause` and :meth:`resume` bracket what is not training
    time; :meth:`lap` returns the seconds counted since the previous lap and starts anew.
    """

    def __init__(self) -> None:
        self._since: float | None = now()
        self._counted = 0.0

    def pause(self) -> None:
        if self._since is not None:
            self._counted += now() - self._since
            self._since = None

    def resume(self) -> None:
        if self._since is None:
            self._since = now()

    def lap(self) -> float:
        running = self._since is not None
        self.pause()
        counted, self._counted = self._counted, 0.0
        if running:
            self.resume()
        return counted


def progress(state: TrainState) -> float | None:
    """The fraction of ``train.max_time`` used, in [0, 1]; None without a time budget."""
    budget = state.cfg.train.max_time
    return None if budget is None else min(1.0, state.train_seconds / budget)


def spent(state: TrainState) -> bool:
    """Whether the time budget is used up (False without one)."""
    budget = state.cfg.train.max_time
    return budget is not None and state.train_seconds >= budget


def ended_run(state: TrainState) -> bool:
    """Whether the time budget, not ``train.steps`` or early stopping, ended the run."""
    return (spent(state) and state.step < state.cfg.train.steps
            and not state.evaluator.stopped)


def summary(state: TrainState) -> dict | None:
    """summary.json's ``time_budget``: ``{max_time, used, ended}`` (seconds); None without
    a time budget."""
    budget = state.cfg.train.max_time
    if budget is None:
        return None
    return {"max_time": budget, "used": round(state.train_seconds, 3),
            "ended": ended_run(state)}


def reason(state: TrainState) -> str:
    """Why the run ended, for summary.json and the last line of output."""
    budget = state.cfg.train.max_time or 0.0
    return (f"time budget train.max_time={format_duration(budget)} used at step "
            f"{state.step} of {state.cfg.train.steps} "
            f"({state.train_seconds:.1f} s of training)")
