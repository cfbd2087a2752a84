"""The report's verdict: the one-line answer at the top of the page."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Literal

from ..guard.findings import finding_from_row
from ..values import finite, fmt, num
from .read import RunLog

VerdictState = Literal["healthy", "recovered", "aborted", "diverged", "incomplete"]


@dataclass
class Verdict:
    """Healthy / recovered from N incidents / aborted (and why) / diverged / incomplete.

    Attributes:
        state: which of the five (the page colours the verdict by it).
        headline: the one line.
        details: the lines under it (actions and kinds counted, the last incident).
    """

    state: VerdictState
    headline: str
    details: list[str]


def interventions(incidents: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The incidents where the guard acted (health warnings only say something)."""
    return [i for i in incidents if i.get("action") not in ("warn", None)]


def verdict(log: RunLog) -> Verdict:
    """The verdict on a run, from its summary.json, incidents and the last logged loss."""
    s = log.summary or {}
    incs = log.incidents
    acts = Counter(str(i.get("action")) for i in interventions(incs))
    warns = sum(1 for i in incs if i.get("action") == "warn")
    kinds = Counter(str(i.get("kind")) for i in interventions(incs))
    last = log.last_step
    planned = log.planned_steps
    details: list[str] = []
    if acts:
        details.append("guard actions: " + ", ".join(f"{n} × {a}" for a, n in acts.most_common()))
        details.append("incident kinds: " + ", ".join(f"{n} × {k}" for k, n in
                                                      kinds.most_common()))
    if warns:
        details.append(f"{warns} health warning(s) from the periodic probes")

    aborts = [i for i in incs if i.get("action") == "abort"]
    if s.get("status") == "aborted" or aborts:
        step = s.get("steps", aborts[-1].get("step") if aborts else last)
        why = s.get("reason")
        if aborts:
            a = finding_from_row(aborts[-1])
            why = why or a.diagnosis.why or a.kind
            details.insert(0, f"last incident: {a.kind} at step {a.step} ({a.summary()})")
        details += abort_point_lines(s.get("abort"))
        return Verdict("aborted", f"Aborted at step {step}: {why or 'reason not recorded'}",
                       details)

    losses = [r for r in log.metrics if "loss" in r]
    if losses and not finite(losses[-1].get("loss")):
        return Verdict("diverged", f"Diverged: the loss is {losses[-1].get('loss')} at step "
                       f"{losses[-1].get('step')}", details)

    if s.get("status") != "finished":
        where = (f"last logged step {last}" + (f" of {planned}" if planned else "")
                 if last is not None else "nothing logged")
        head = ("Incomplete: no summary.json, the run was killed or is still running "
                f"({where})")
        if s.get("status") == "interrupted":  # a stop signal: checkpointed, resumable
            head = (f"Interrupted by {s.get('signal', 'a signal')} at step {s.get('steps')}"
                    + (f" of {planned}" if planned else "") + " with a checkpoint; rerun "
                    "the same command to resume")
        if acts:
            head += f"; {sum(acts.values())} incident(s) so far"
        return Verdict("incomplete", head, details)

    n = sum(acts.values())
    steps = s.get("steps", last)
    tb = log.time_budget
    if tb:
        details.append(f"time budget (train.max_time): {fmt(num(tb.get('used')))} s of "
                       f"{fmt(num(tb.get('max_time')))} s of training used")
    # a run its time budget ended: fewer steps than planned, on purpose
    at_budget = (" at its time budget (train.max_time" + (f", of {planned} planned" if planned
                                                            else "") + ")"
                 if tb and tb.get("ended") else "")
    if n:
        return Verdict("recovered", f"Recovered from {n} incident{'s' if n != 1 else ''}; "
                       f"finished {steps} steps{at_budget}", details)
    head = f"Healthy: finished {steps} steps{at_budget} with no guard intervention"
    if warns:
        head += f" ({warns} health warning{'s' if warns != 1 else ''})"
    return Verdict("healthy", head, details)


def abort_point_lines(point: dict | None) -> list[str]:
    """What an aborted run left to resume from (summary.json ``abort``), as lines."""
    if not isinstance(point, dict) or not point.get("resume"):
        return []
    at = point.get("checkpoint_step")
    if point.get("checkpoint"):
        where = f"abort point: {point['checkpoint']}, the guard's last verified state (step {at})"
    elif at is not None:
        where = (f"no abort point written: the newest checkpoint (step {at}) is newer than "
                 "the guard's last verified state")
    else:
        where = "no abort point written (no verified state)"
    return [where, f"to resume with the LR the guard found safe ({point.get('lr_why')}): "
                   f"{point['resume']}"]
