"""The public Python API: ``steadydiff.train`` and ``steadydiff.load``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .config import Config, ConfigError, load_config, validate
from .loading import Pipeline, load
from .trainer.loop import RunResult, run

__all__ = ["Pipeline", "RunResult", "load", "train"]


def _as_config(config: Config | dict[str, Any] | str | Path) -> Config:
    if isinstance(config, Config):
        return config
    if isinstance(config, dict):
        return validate(config)
    if isinstance(config, (str, Path)):
        return load_config(config)
    raise ConfigError(f"config must be a Config, a dict or a YAML path, got {type(config).__name__}")


def train(config: Config | dict[str, Any] | str | Path,
          dataset: torch.utils.data.Dataset | None = None, *,
          out_dir: str | Path = "runs/train", resume: bool | str | Path = True,
          allow_config_change: bool = False, restart: bool = False,
          grow_resolution: bool = False) -> RunResult:
    """Train a diffusion model.

    Args:
        config: a resolved :class:`Config`, a dict of sections, or a YAML path.
        dataset: optional torch Dataset yielding images (C, H, W) in [-1, 1], 1-tuples
            ``(image,)`` (``TensorDataset(images)``) or ``(image, label)`` pairs; replaces
            the config's data source. Values outside [-1, 1] are refused (``DataError``
            naming the observed range) before the first step. Labels must be class ids
            0..model.num_classes-1 (id num_classes is the null class, never data): a
            ``DataError`` names the first item that is not, before the first step when the
            labels can be read without the images (``dataset.labels``, a
            ``TensorDataset(images, labels)``), else when the item is fetched.
        out_dir: the run directory: new, empty, or an earlier run's (rerunning with the
            same directory resumes). A non-empty folder that is not a run, or one another
            live process trains into, is refused (:class:`~steadydiff.rundir.RunDirError`).
        resume: True (resume from the newest checkpoint that verifies; corrupt ones are
            moved to ``checkpoints/corrupt/``; if every one is corrupt, RunDirError), a
            checkpoint path, or False (start fresh; refuses a folder with checkpoints).
        allow_config_change: accept config changes on resume that break exactness.
        restart: start over at step 0 on purpose: the run's existing files are moved to
            ``out_dir/previous-<time>/`` first (nothing is deleted).
        grow_resolution: continue the run's checkpoint, trained at a smaller
            ``data.image_size``, at the config's larger one (docs/resolution.md).

    Returns:
        A :class:`RunResult` (run directory, final step and loss, checkpoint, sample grids).

    Raises:
        GuardAbort: the guard's recovery budget ran out. The guard's last verified state
            was written as a checkpoint when newer than every checkpoint on disk, and
            ``.abort_point`` holds it with the suggested LR and the command to resume.
        DataError: unusable data, e.g. a label that is no class id (the item is named).
        TrainingInterrupted: SIGTERM, SIGINT or SIGUSR1 arrived while training; the step in
            progress finished and a verified checkpoint of it was written (``.checkpoint``,
            ``.result``). Calling ``train`` again with the same arguments resumes exactly.
            The signal handlers exist only during this call (main thread only); yours are
            restored afterwards.
    """
    return run(_as_config(config), run_dir=out_dir, dataset=dataset, resume=resume,
               allow_config_change=allow_config_change, restart=restart,
               grow_resolution=grow_resolution)
