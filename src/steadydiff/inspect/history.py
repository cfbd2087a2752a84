"""Doctor: the run's record. How it ended, every incident grouped by kind with the loss and
gradient-norm trend before it, the loss at the end, the grad scaler, skipped images, and the
settings the config linter flags.

Incident rows are read as :mod:`steadydiff.guard.findings` records: their summary is the
evidence line, their recommendation the advice (the report's incident table says the same).
"""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict
from typing import Any

from ..config import Config
from ..guard.findings import Finding, RunContext, finding_from_row
from ..lint import lint
from ..values import num
from .causes import Cause, Severity
from .read import MetricSeries, RunLog, metric_series
from .verdict import abort_point_lines

# the checks this module runs (Diagnosis.checks)
CHECKS = ["run_aborted", "incidents", "loss_nonfinite", "loss_diverging", "grad_scaler",
          "config_lint"]


def trend(ser: MetricSeries, step: float, window: int) -> dict[str, Any]:
    """Loss and grad-norm trend over the logged rows in [step - window, step): the mean of
    the last third over the mean of the first third (``loss_trend``, ``grad_norm_trend``)."""
    rows = [(s, r) for s, r in zip(ser.steps, ser.rows) if step - window <= s < step]
    out: dict[str, Any] = {"rows": len(rows)}
    if len(rows) < 2:
        return out
    third = max(1, len(rows) // 3)
    for key in ("loss", "grad_norm"):
        vals = [num(r.get(key)) for _, r in rows]
        a = [v for v in vals[:third] if v is not None and math.isfinite(v)]
        b = [v for v in vals[-third:] if v is not None and math.isfinite(v)]
        if a and b and sum(a) > 0:
            out[f"{key}_trend"] = (sum(b) / len(b)) / (sum(a) / len(a))
    out["lr"] = num(rows[-1][1].get("lr"))
    out["from_step"], out["to_step"] = rows[0][0], rows[-1][0]
    return out


def _advice(group: list[Finding], t: dict[str, Any], log: RunLog) -> str:
    """The recommendation for a group of same-kind incidents, given the trend ``t``."""
    return group[0].recommendation(RunContext.from_config(log.config, t), group)


def check_history(log: RunLog, cfg: Config | None = None) -> list[Cause]:
    """Causes from the run's record: how it ended, incidents grouped by kind with the trend
    before them, the loss at the end, the grad scaler, skipped images, the config linter."""
    causes: list[Cause] = []
    ser = metric_series(log.metrics)
    s = log.summary or {}
    rows = [i for i in log.incidents if isinstance(i, dict)]
    records = [finding_from_row(i) for i in rows]
    log_every = log.cfg("logging.log_every", 1) or 1
    window = max(10, 10 * int(log_every))

    aborts = [(i, f) for i, f in zip(rows, records) if f.action == "abort"]
    if s.get("status") == "aborted" or aborts:
        last, last_f = aborts[-1] if aborts else ({}, finding_from_row({}))
        why = s.get("reason") or last_f.diagnosis.why or last.get("kind")
        before = [f for f in records if f is not last_f][-5:]
        trig = Counter(f.kind for f in before)
        kind = trig.most_common(1)[0][0] if trig else last_f.kind
        group = [f for f in records if f.kind == kind] or [last_f]
        rec = _advice(group, trend(ser, last_f.step or 0, window), log)
        at = s.get("steps", last.get("step"))
        point = s.get("abort") if isinstance(s.get("abort"), dict) else None
        resume = (f"; {'; '.join(abort_point_lines(point))}" if point else "")
        causes.append(Cause(
            "critical", "run_aborted", f"step {at}", f"the run aborted at step {at}: {why}",
            {"reason": why, "abort_incident": last, "incidents_before": dict(trig),
             **({"abort_point": point} if point else {})},
            f"the recovery budget ran out on repeated {kind}: " + rec + resume,
            score=len(rows)))
    elif s.get("status") == "interrupted":  # a stop signal: checkpointed, resumable
        planned = log.planned_steps
        causes.append(Cause(
            "info", "run_incomplete", f"step {s.get('steps')}",
            f"interrupted by {s.get('signal', 'a signal')} at step {s.get('steps')}"
            + (f" of {planned}" if planned else "") + ", with a checkpoint of that step",
            {"last_step": s.get("steps"), "planned_steps": planned, "signal": s.get("signal")},
            "rerun the same command to resume (exactly)"))
    elif not s and log.metrics:
        planned = log.planned_steps
        if planned is None or (log.last_step or 0) < planned:
            causes.append(Cause(
                "info", "run_incomplete", None,
                f"no summary.json: the run stopped at step {log.last_step}"
                + (f" of {planned}" if planned else "") + " (killed, or still running)",
                {"last_step": log.last_step, "planned_steps": planned},
                "rerun the same command to resume from the newest intact checkpoint"))

    by_kind: dict[str, list[Finding]] = defaultdict(list)
    for f in records:
        if f.action != "abort":
            by_kind[f.kind].append(f)
    for kind, group in by_kind.items():
        first = group[0]
        steps = [f.step for f in group]
        acts = Counter(str(f.action) for f in group)
        first_step = first.step or 0
        t = trend(ser, first_step, window)
        rec = _advice(group, t, log)
        rollbacks = acts.get("rollback", 0)
        sev: Severity = "warning" if (rollbacks or len(group) >= 3 or acts.get("warn")
                                      or first.warn_once) else "info"
        t_note = ""
        if "loss_trend" in t or "grad_norm_trend" in t:
            t_note = (f"; over the {t['rows']} logged steps before step "
                      f"{first_step}: loss ×{t.get('loss_trend', float('nan')):.2g}, "
                      f"grad norm ×{t.get('grad_norm_trend', float('nan')):.2g}")
        causes.append(Cause(
            sev, "incidents", first.where() or f"step {first_step}",
            f"{len(group)} × {kind} (steps "
            f"{', '.join(str(x) for x in steps[:6] if x is not None)}"
            f"{' ...' if len(steps) > 6 else ''}; "
            + ", ".join(f"{n} {a}" for a, n in acts.most_common()) + ")" + t_note,
            {"kind": kind, "count": len(group), "steps": steps, "actions": dict(acts),
             "first": first.summary(), "trend_before_first": t,
             "serious": first.serious},
            rec, score=len(group) + 10 * rollbacks))

    losses = ser.col("loss")
    if losses and not math.isfinite(losses[-1]):
        causes.append(Cause(
            "critical", "loss_nonfinite", f"step {ser.steps[-1]}",
            f"the loss is {losses[-1]} at the last logged step {ser.steps[-1]}",
            {"step": ser.steps[-1]},
            "the run diverged: turn the guard on (guard.enabled=true) to roll back instead, "
            "and lower the peak LR or lengthen warmup"))
    finite = [v for v in losses if math.isfinite(v)]
    if len(finite) >= 20:
        k = max(3, len(finite) // 10)
        end = sum(finite[-k:]) / k
        best = min(sum(finite[i:i + k]) / k for i in range(0, len(finite) - k + 1))
        if best > 0 and end / best > 2.0:
            causes.append(Cause(
                "warning", "loss_diverging", None,
                f"the loss at the end ({end:.3g}) is {end / best:.2g}x its best ({best:.3g})",
                {"end_loss": end, "best_loss": best, "ratio": end / best},
                "the run is diverging: resume from the best checkpoint and lower the peak LR "
                "or lengthen warmup", score=end / best))
    scales = [v for v in ser.col("grad_scale") if math.isfinite(v)]
    if scales and min(scales) < 1.0:
        causes.append(Cause(
            "warning", "grad_scaler", None,
            f"the fp16 grad-scaler scale fell to {min(scales):.3g} (below 1: gradients "
            "overflow even unscaled)",
            {"min_scale": min(scales), "last_scale": scales[-1]},
            "use bf16 instead of fp16 (train.precision=bf16)"))
    skipped = [num(r.get("data_skipped")) or 0 for r in ser.rows]
    if skipped and max(skipped) > 0:
        causes.append(Cause(
            "info", "data_skipped", None,
            f"{int(max(skipped))} unreadable image(s) were skipped by the data loader",
            {"data_skipped": int(max(skipped))},
            "check the data folder: the trainer logs which files it skipped"))

    if cfg is not None:
        unstable = any(f.instability or f.action == "abort" for f in records)
        for msg in lint(cfg):
            m = re.match(r"^([a-z_0-9]+(?:\.[a-z_0-9]+)+)(=\S+)?", msg)
            key = m.group(1) if m else None
            flagged = (m.group(0).rstrip(",:;") if m else msg.split(":", 1)[0])[:80]
            causes.append(Cause(
                "warning" if unstable else "info", "config_lint", key,
                f"the config linter flags {flagged}"
                + (" (the run had instability incidents)" if unstable else ""),
                {"message": msg}, msg))
    return causes
