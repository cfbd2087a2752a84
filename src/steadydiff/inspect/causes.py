"""The doctor's vocabulary: a :class:`Cause` (one likely cause of trouble), the
:class:`Diagnosis` that collects them, and how they are ranked and linked.

Ranking: severity first (critical > warning > info), then the mechanism (:data:`PRIORITY`):
non-finite state and corrupt checkpoints first (nothing else can be trusted), then mechanisms
seen in the forward pass (the proximate cause), then weight statistics (where the weights are
odd), then the history, then the config; within one mechanism the larger deviation first. A
weight outlier inside a module whose forward-pass mechanism is flagged is cited as that
mechanism's evidence (:func:`link`).

A new check adds its name to :data:`PRIORITY` (and to the table in docs/doctor.md).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from ..values import jsonable

Severity = Literal["critical", "warning", "info"]
SEVERITIES: tuple[Severity, ...] = ("critical", "warning", "info")

# Mechanism order within one severity (see the module docstring).
PRIORITY = {
    "nonfinite_weights": 0, "nonfinite_ema": 0, "checkpoint_corrupt": 0,
    "nonfinite_activation": 1, "attention_logit_growth": 1, "attention_entropy_collapse": 1,
    "norm_eps_dominated": 1, "fp16_overflow": 1, "norm_affine_exploded": 1,
    "data_range": 1,
    "weight_norm_outlier": 2, "weight_maxabs_outlier": 2, "weight_drift": 2,
    "activation_outlier": 2, "ema_divergence": 2,
    "run_aborted": 3, "loss_nonfinite": 3, "loss_diverging": 3, "incidents": 3,
    "grad_scaler": 3, "run_incomplete": 4, "data_skipped": 4,
    "config_lint": 5, "no_checkpoint": 6,
}


@dataclass
class Cause:
    """One likely cause of trouble.

    Attributes:
        severity: ``critical`` (the state is broken or will break training), ``warning``
            (a risk or a recovered problem worth acting on), ``info``.
        check: the mechanism (``nonfinite_weights``, ``attention_logit_growth``, ...; the
            table in docs/doctor.md).
        where: the layer, module or step it concerns (None when run-wide).
        summary: one line, what was found.
        evidence: the numbers behind it (JSON-able).
        recommendation: what to do, concretely.
        score: strength within its severity and mechanism (ranking only).
    """

    severity: Severity
    check: str
    where: str | None
    summary: str
    evidence: dict[str, Any]
    recommendation: str
    score: float = 0.0

    def rank_key(self) -> tuple:
        return (SEVERITIES.index(self.severity), PRIORITY.get(self.check, 9), -self.score)


@dataclass
class Diagnosis:
    """What :func:`~steadydiff.doctor.diagnose` found, causes ranked most likely first."""

    path: Path
    run_dir: Path | None = None
    checkpoint: Path | None = None
    step: int | None = None
    causes: list[Cause] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)       # checks skipped, and why
    checks: list[str] = field(default_factory=list)      # checks that ran
    measurements: dict[str, Any] = field(default_factory=dict)

    @property
    def status(self) -> Literal["healthy", "warning", "critical"]:
        sev = {c.severity for c in self.causes}
        return "critical" if "critical" in sev else "warning" if "warning" in sev else "healthy"

    @property
    def exit_code(self) -> int:
        """1 with a critical finding, else 0."""
        return 1 if self.status == "critical" else 0

    def counts(self) -> dict[str, int]:
        c = Counter(x.severity for x in self.causes)
        return {s: c.get(s, 0) for s in SEVERITIES}

    def to_dict(self) -> dict[str, Any]:
        """The ``--json`` output (schema in docs/doctor.md)."""
        return jsonable({
            "path": str(self.path), "run_dir": str(self.run_dir) if self.run_dir else None,
            "checkpoint": str(self.checkpoint) if self.checkpoint else None,
            "step": self.step, "status": self.status, "exit_code": self.exit_code,
            "counts": self.counts(),
            "causes": [{"rank": i + 1, **asdict(c)} for i, c in enumerate(self.causes)],
            "checks": self.checks, "notes": self.notes, "measurements": self.measurements,
        })


def rank(causes: list[Cause]) -> list[Cause]:
    """Causes sorted most likely first (see the module docstring)."""
    return sorted(causes, key=Cause.rank_key)


def link(causes: list[Cause]) -> list[Cause]:
    """Cite a weight finding inside a module whose forward-pass mechanism is flagged as that
    mechanism's evidence (it stays in the list, ranked after it)."""
    mech = [c for c in causes if PRIORITY.get(c.check, 9) == 1 and c.where]
    for c in causes:
        if PRIORITY.get(c.check) != 2 or not c.where:
            continue
        for m in mech:
            if c.where == m.where or c.where.startswith(m.where + ".") or \
                    m.evidence.get("input_from") == c.where:
                m.evidence.setdefault("related", []).append(f"{c.check}: {c.summary}")
                c.evidence["explains"] = f"{m.check} in {m.where}"
                break
    return causes
