"""A run directory as data: what the trainer, the guard and evaluation left, read tolerantly.

Missing files are empty, not errors; a last JSONL line cut short by a kill is skipped and
counted; non-finite values stay the strings the trainer wrote (read them with
:func:`steadydiff.values.num`). Paths come from :class:`steadydiff.rundir.RunDir`, checkpoint
names from :mod:`steadydiff.trainer.checkpoint`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..rundir import RunDir
from ..values import num


@dataclass
class RunLog:
    """What a run directory holds.

    Attributes:
        run_dir: the directory read.
        config: the resolved config as a plain dict ({} when config.yaml is missing).
        metrics: metrics.jsonl rows in file order (rollbacks make steps repeat).
        incidents: incidents.jsonl rows.
        layers: layers.jsonl rows.
        evals: eval.jsonl rows (``eval.every``).
        summary: summary.json, or None (the run was killed, or is still running).
        buckets: buckets.json (``data.buckets``: the bucket histogram), or None.
        samples: (step, path) of every sample grid, by step.
        validation: the newest render's validation prompts (its prompts.json, with
            ``folder``: where its images are), or None (not a text run).
        checkpoints: checkpoint directories, newest first.
        problems: human-readable notes on missing or damaged files.
    """

    run_dir: Path
    config: dict[str, Any] = field(default_factory=dict)
    metrics: list[dict[str, Any]] = field(default_factory=list)
    incidents: list[dict[str, Any]] = field(default_factory=list)
    layers: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] | None = None
    buckets: dict[str, Any] | None = None
    samples: list[tuple[int, Path]] = field(default_factory=list)
    validation: dict[str, Any] | None = None
    checkpoints: list[Path] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def paths(self) -> RunDir:
        """The run directory's file names."""
        return RunDir(self.run_dir)

    def cfg(self, dotted: str, default: Any = None) -> Any:
        """A config value by dotted key (``"optim.grad_clip"``), or ``default``."""
        node: Any = self.config
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        return node

    @property
    def planned_steps(self) -> int | None:
        v = self.cfg("train.steps")
        return int(v) if isinstance(v, (int, float)) else None

    @property
    def time_budget(self) -> dict[str, Any] | None:
        """summary.json's ``time_budget`` (``train.max_time`` set): ``{max_time, used,
        ended}``, seconds; ``ended`` when the budget ended the run."""
        tb = (self.summary or {}).get("time_budget")
        return tb if isinstance(tb, dict) else None

    @property
    def last_step(self) -> int | None:
        steps = [r["step"] for r in self.metrics if isinstance(r.get("step"), int)]
        if self.summary and isinstance(self.summary.get("steps"), int):
            steps.append(self.summary["steps"])
        return max(steps) if steps else None


def read_jsonl(path: Path) -> tuple[list[dict[str, Any]], int]:
    """Rows of a JSONL file, skipping lines that do not parse (a row cut short by a kill).

    Returns:
        ``(rows, bad)``: the dict rows, and how many lines were skipped. A missing file
        gives ``([], 0)``.
    """
    if not path.is_file():
        return [], 0
    rows, bad = [], 0
    with open(path, "rb") as f:
        for raw in f:
            line = raw.decode("utf-8", errors="replace").strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except ValueError:
                bad += 1
                continue
            if isinstance(row, dict):
                rows.append(row)
            else:
                bad += 1
    return rows, bad


def _json_object(path: Path, problems: list[str]) -> dict | None:
    """The JSON object in ``path``; None when it is absent or not an object, and a problem
    noted when it cannot be read."""
    if not path.is_file():
        return None
    try:
        v = json.loads(path.read_text())
    except ValueError as e:
        problems.append(f"{path.name}: unreadable ({e})")
        return None
    return v if isinstance(v, dict) else None


def read_run(run_dir: str | Path) -> RunLog:
    """Read everything a run directory holds; never raises for missing or partial files.

    Raises:
        FileNotFoundError: ``run_dir`` does not exist or is not a directory.
    """
    rd = RunDir(run_dir)
    if not rd.root.is_dir():
        raise FileNotFoundError(f"no such run directory: {rd.root}")
    log = RunLog(rd.root)
    if rd.config.is_file():
        try:
            loaded = yaml.safe_load(rd.config.read_text())
            log.config = loaded if isinstance(loaded, dict) else {}
        except Exception as e:  # a damaged config must not hide the rest of the run
            log.problems.append(f"config.yaml: unreadable ({type(e).__name__}: {e})")
    else:
        log.problems.append("config.yaml: missing")
    for path, attr in ((rd.metrics, "metrics"), (rd.incidents, "incidents"),
                       (rd.layers, "layers"), (rd.evals, "evals")):
        rows, bad = read_jsonl(path)
        setattr(log, attr, rows)
        if bad:
            log.problems.append(f"{path.name}: {bad} unreadable line(s) skipped (a row cut "
                                "short by a kill?)")
    if not rd.metrics.is_file():
        log.problems.append("metrics.jsonl: missing")
    log.summary = _json_object(rd.summary, log.problems)
    log.buckets = _json_object(rd.buckets, log.problems)
    log.samples = rd.sample_grids()
    latest = rd.latest_validation()
    if latest is not None:
        try:
            v = json.loads((latest[1] / "prompts.json").read_text())
            log.validation = {**v, "folder": latest[1]} if isinstance(v, dict) else None
        except ValueError as e:
            log.problems.append(f"{latest[1].name}/prompts.json: unreadable ({e})")
    log.checkpoints = rd.list_checkpoints()
    return log


# --------------------------------------------------------------------------- metric series


@dataclass
class MetricSeries:
    """The metrics rows as plot-ready columns: the kept rows (last write of each step) and the
    rows a rollback discarded."""

    steps: list[int]
    rows: list[dict[str, Any]]
    discarded: list[dict[str, Any]]

    def col(self, key: str) -> list[float]:
        """One key per kept row as floats (NaN where absent or not a number)."""
        return [v if (v := num(r.get(key))) is not None else float("nan") for r in self.rows]


def metric_series(metrics: list[dict[str, Any]]) -> MetricSeries:
    """After a rollback the trainer logs the redone steps again: keep the last row of each
    step on the curve, the superseded ones as 'discarded by rollback'."""
    good = [r for r in metrics if isinstance(r.get("step"), int)]
    last_idx = {r["step"]: i for i, r in enumerate(good)}
    kept = sorted((r for i, r in enumerate(good) if last_idx[r["step"]] == i),
                  key=lambda r: r["step"])
    discarded = [r for i, r in enumerate(good) if last_idx[r["step"]] != i]
    return MetricSeries([r["step"] for r in kept], kept, discarded)
