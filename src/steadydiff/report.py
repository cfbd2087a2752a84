"""The health report: ``RUN_DIR/report.html``, one self-contained page per run.

Everything a run leaves behind (config.yaml, metrics.jsonl, incidents.jsonl, layers.jsonl,
eval.jsonl, summary.json, sample grids) turned into one HTML file that opens in any browser
with no network (docs/report.md). Robust to what a killed or aborted run leaves: any file may
be missing, the last JSONL line may be cut short, values may be non-finite.

This module is the public entry point; the work is in :mod:`steadydiff.inspect`: reading the
run (inspect/read.py), the verdict (inspect/verdict.py), the figures (inspect/plots.py) and
the page (inspect/html.py).
"""

from __future__ import annotations

from pathlib import Path

from .inspect.html import render
from .inspect.read import read_run
from .rundir import RunDir

__all__ = ["render", "write_report"]


def write_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the health report of a run.

    Args:
        run_dir: the run directory (what ``steadydiff train`` wrote; partial is fine).
        out: where to write; default ``RUN_DIR/report.html``.

    Returns:
        The path written (written atomically: a temporary file renamed into place).

    Raises:
        FileNotFoundError: ``run_dir`` does not exist.
        ValueError: ``run_dir`` is not a run (as for the doctor); nothing is written there.
    """
    run = RunDir(run_dir)
    # writing into the folder takes a run steadydiff made (its marker); reading one to write
    # elsewhere takes any folder with a run's files
    if run.root.is_dir() and not (run.is_run() if out is None else run.has_run_files()):
        raise ValueError(f"{run.root} is not a steadydiff run directory (no "
                         f"steadydiff-run.json{', checkpoints/, metrics.jsonl' if out else ''}"
                         f"); nothing was written")
    log = read_run(run_dir)
    out = Path(out) if out is not None else log.paths.report
    page = render(log)
    from .files import write_text_atomic

    return write_text_atomic(out, page, replace=True)  # the report is regenerated
