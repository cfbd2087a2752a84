"""The run directory: the one place that knows its layout.

    RUN/
      config.yaml         the resolved config (written at every start)
      metrics.jsonl       one row per log_every steps (trainer/telemetry.py owns the keys)
      layers.jsonl        per-layer statistics (logging.layer_stats_every)
      incidents.jsonl     one row per guard intervention (created empty at the start)
      eval.jsonl          one row per evaluation during training
      summary.json        how the run ended (finished / aborted)
      report.html         the health report
      samples/step_00001234.png
      checkpoints/step_00001234/ ... latest    (trainer/checkpoint.py owns the format)
      checkpoints/best/step_00001234/          the best evaluation's checkpoint

Writers (the trainer, the guard, evaluation) and readers (report, doctor, the API) name files
through :class:`RunDir`, so the layout is written down once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from .trainer import checkpoint as ckpt

# the append-only logs of a run, truncated to the resumed step on resume
JSONL_LOGS = ("metrics.jsonl", "layers.jsonl", "incidents.jsonl", "eval.jsonl")
_GRID = re.compile(r"^step_(\d+)\.png$")


@dataclass(frozen=True)
class RunDir:
    """Paths of one run directory (nothing is created until a writer needs it)."""

    root: Path

    def __init__(self, root: str | Path) -> None:
        object.__setattr__(self, "root", Path(root))

    # ---- files
    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def layers(self) -> Path:
        return self.root / "layers.jsonl"

    @property
    def incidents(self) -> Path:
        return self.root / "incidents.jsonl"

    @property
    def evals(self) -> Path:
        return self.root / "eval.jsonl"

    @property
    def summary(self) -> Path:
        return self.root / "summary.json"

    @property
    def report(self) -> Path:
        return self.root / "report.html"

    # ---- folders
    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def best(self) -> Path:
        """The best evaluation's checkpoint root (one checkpoint; rotation never touches it)."""
        return self.checkpoints / "best"

    @property
    def samples(self) -> Path:
        return self.root / "samples"

    def sample_grid(self, step: int) -> Path:
        return self.samples / f"{ckpt.checkpoint_name(step)}.png"

    def sample_grids(self) -> list[tuple[int, Path]]:
        """``(step, path)`` of every sample grid, oldest first."""
        if not self.samples.is_dir():
            return []
        return sorted((int(m.group(1)), p) for p in self.samples.iterdir()
                      if (m := _GRID.match(p.name)) and p.is_file())

    # ---- checkpoints
    def list_checkpoints(self) -> list[Path]:
        """Checkpoint directories, newest step first."""
        return ckpt.list_checkpoints(self.checkpoints)

    def checkpoint_candidates(self) -> list[Path]:
        """Checkpoints in the order to try them (the ``latest`` pointer's first)."""
        return ckpt.candidates(self.checkpoints)

    def latest_good(self) -> Path | None:
        """The newest checkpoint that passes verification, or None."""
        return ckpt.latest_good(self.checkpoints)

    # ---- what kind of folder this is
    def is_run(self) -> bool:
        """Whether the folder holds a steadydiff run (any of its files)."""
        return self.root.is_dir() and any(
            p.exists() for p in (self.checkpoints, self.metrics, self.config, self.incidents))

    @staticmethod
    def of_checkpoint(path: str | Path) -> "RunDir | None":
        """The run a checkpoint directory belongs to (``RUN/checkpoints/step_*``), if any."""
        p = Path(path)
        if p.parent.name != "checkpoints":
            return None
        run = RunDir(p.parent.parent)
        return run if run.metrics.is_file() or run.config.is_file() else None
