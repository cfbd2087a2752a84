"""Post-mortem diagnostics: ``steadydiff doctor RUN_DIR | CHECKPOINT``.

Reads what a run left (checkpoint weights and EMA, metrics, incidents, the config) and names
the likely causes of trouble, ranked, each with its evidence and a concrete recommendation
(docs/doctor.md).

This module is the public entry point; the work is in :mod:`steadydiff.inspect`: the checks
of the weights (inspect/weights.py), of a probe forward pass (inspect/probe.py) and of the
run's history (inspect/history.py), the model of a checkpoint (inspect/model.py), ranking
(inspect/causes.py), :func:`diagnose` (inspect/diagnose.py) and the text output
(inspect/text.py).

Exit codes (the CLI): 0 healthy or warnings only, 1 at least one critical finding, 2 bad input.
"""

from __future__ import annotations

from .inspect.causes import Cause, Diagnosis, Severity
from .inspect.diagnose import diagnose, diagnose_model
from .inspect.text import format_diagnosis

__all__ = ["Cause", "Diagnosis", "Severity", "diagnose", "diagnose_model", "format_diagnosis"]
