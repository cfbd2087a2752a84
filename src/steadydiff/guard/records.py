"""What the guard hands back and writes down: the :class:`Decision` of each step, the
:class:`Incident` of each intervention and the :class:`IncidentLog` that keeps them (in
memory and in ``RUN_DIR/incidents.jsonl``), a deferred window's :class:`Flush` and
:class:`Rewind`, and :class:`GuardAbort`."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from .. import distributed
from ..kinds import Precision
from ..values import jsonable
from .findings import Finding, FindingSeverity, IncidentAction, IncidentKind

DecisionKind = Literal["step", "skip", "rollback", "abort"]


class GuardAbort(RuntimeError):
    """Instability persisted past the recovery budget (CLI exit code 3).

    Attributes:
        incident: the abort incident, when there is one.
        abort_point: set by steadydiff's trainer (rank 0): what the run left to resume from
            and the suggested command, as in summary.json's ``abort`` (see docs/guard.md).
    """

    def __init__(self, message: str, incident: "Incident | None" = None):
        super().__init__(message)
        self.incident = incident
        self.abort_point: dict[str, Any] | None = None


@dataclass
class Incident:
    """One intervention: what was seen, what was done, what it cost."""

    step: int
    kind: IncidentKind
    severity: FindingSeverity
    evidence: dict[str, Any]
    action: IncidentAction
    cost: dict[str, Any] = field(default_factory=dict)
    diagnosis: dict[str, Any] = field(default_factory=dict)
    time: float = field(default_factory=time.time)

    def row(self) -> dict[str, Any]:
        return jsonable(asdict(self))


@dataclass
class Decision:
    """What the guard decided for one step.

    action: ``step`` (the update was applied), ``skip`` (no update; the batch is dropped),
        ``rollback`` (state restored to a verified snapshot), ``abort`` (give up).
    step: the step counter after the decision (it moves back on a rollback).
    data_position: batches consumed: the position of the next batch to train on (after a
        rollback the data continues from here; positions the guard skips are jumped over).
    skipped_batches: after a rollback, the batch positions that will not be trained on (the
        implicated ones; none when the data was innocent).
    dropped: the dataset indices left out of this step (the rest of the batch trained, or,
        without ``rerun``, the samples the caller should drop).
    quarantined: dataset indices quarantined by this step: never draw them again
        (:attr:`Guard.quarantine` holds them all).
    steps_back: a rollback: how many steps the state went back (``step`` is the step it
        continues from; a loop's own counter must follow: ``my_step = decision.step``).
    precision: set when the guard changed the precision (fp16 -> bf16 -> fp32); the progress
        object already holds it, a loop of one's own switches its autocast.
    loss, grad_norm, grad_norm_clipped: host floats when the guard inspected the step;
        ``loss_t``: the mean loss per timestep bucket (this step).
    """

    action: DecisionKind
    step: int
    data_position: int
    loss: float | None = None
    grad_norm: float | None = None
    incident: Incident | None = None
    skipped_batches: tuple[int, ...] | None = None
    precision: Precision | None = None
    grad_norm_clipped: float | None = None
    loss_t: list[float | None] | None = None
    dropped: tuple[int, ...] = ()
    quarantined: tuple[int, ...] = ()
    pending: bool = False  # a speculative step: judged at the next :meth:`Guard.flush`
    steps_back: int = 0

    # In a loop of one's own (docs/guard.md, examples/guard_dataloader.py): the step counter
    # is ``step`` — set yours to it after every decision (a rollback moves it back by
    # ``steps_back``; a skip leaves it); the data: a loop that reads by position continues
    # at ``data_position`` (the positions in ``skipped_batches`` are jumped over for you); a
    # plain ``for batch in loader`` loop just draws its next batch (the steps redone after a
    # rollback train on new batches).


@dataclass
class Rewind:
    """A window's step failed its check: the state is back at the window's start (``step``,
    data position ``batches_consumed``); the steps up to ``at`` run again and step ``at``
    is judged on its own. ``why``: what the window's check saw there."""

    step: int
    batches_consumed: int
    at: int
    why: str
    extra: Any = None  # what begin_step's ``mark`` returned at the window's start


@dataclass
class Flush:
    """What :meth:`Guard.flush` found: the host values of the window's steps (``loss``,
    ``grad_norm``, ``grad_norm_clipped``, ``loss_t`` per step, in order), or a ``rewind``
    (then ``values`` is empty: the steps will be redone)."""

    values: list[tuple[float, float, float, list[float | None] | None]]
    rewind: Rewind | None = None
    incident: Incident | None = None


def row_severity(finding: str, action: str) -> str:
    """An incident row's severity: ``fatal`` only when the run stopped (action ``abort``);
    a finding that made the step, batch or state unusable and was recovered from (skipped,
    rolled back, re-run) is an ``error``; the others keep their own (spike, trend, warn,
    info)."""
    if action == "abort":
        return "fatal"
    return "error" if finding == "fatal" else finding


class IncidentLog:
    """This process's incidents, in order, and their rows in ``run_dir/incidents.jsonl``
    (written by the main rank only; None: kept in memory only)."""

    def __init__(self, run_dir: str | Path | None):
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.incidents: list[Incident] = []

    def record(self, f: Finding, action: str, step: int, cost: dict | None = None,
               diagnosis: dict | None = None) -> Incident:
        inc = Incident(step=step, kind=f.kind, severity=row_severity(f.severity, action),
                       evidence=f.evidence,
                       action=action, cost=cost or {}, diagnosis=diagnosis or {})
        self.incidents.append(inc)
        if self.run_dir is not None and distributed.is_main():
            self.run_dir.mkdir(parents=True, exist_ok=True)
            with open(self.run_dir / "incidents.jsonl", "a") as fh:
                fh.write(json.dumps(inc.row()) + "\n")
        return inc
