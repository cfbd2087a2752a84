"""Doctor: the model a checkpoint holds, and a freshly initialised one to compare it with.

:func:`model_from_checkpoint` is the doctor's way from a checkpoint directory to a model,
through the one loader (:mod:`steadydiff.loading`): the checkpoint is read with
``allow_nonfinite`` (the doctor wants to see diverged weights), and a checkpoint it cannot
use is a finding (:class:`UnusableCheckpoint`), not a crash.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..adapters import AdapterError
from ..config import Config
from ..loading import build_from_checkpoint, checkpoint_config
from ..models import build_model
from ..trainer import checkpoint as ckpt


@dataclass
class CheckpointModel:
    """What :func:`model_from_checkpoint` read: the model (trained weights, on the device),
    its EMA weights, the checkpoint's config, step, and the precision it trained in."""

    model: nn.Module
    ema_state: dict[str, torch.Tensor]
    config: Config
    step: int
    precision: str


class UnusableCheckpoint(Exception):
    """A checkpoint the doctor cannot examine, with the finding to report about it and
    whatever was read before it failed (``config``, ``step``: still useful to the history
    checks)."""

    def __init__(self, summary: str, error: str, recommendation: str, *,
                 config: Config | None = None, step: int | None = None):
        super().__init__(summary)
        self.summary, self.error, self.recommendation = summary, error, recommendation
        self.config, self.step = config, step


def model_from_checkpoint(path: Path, device: str | torch.device = "cpu") -> CheckpointModel:
    """The model of a verified checkpoint directory, non-finite weights and all.

    Raises:
        UnusableCheckpoint: unreadable files or config, weights that do not fit the model
            the config describes, an adapter that cannot be paired with its base.
    """
    cfg: Config | None = None
    step: int | None = None
    try:
        c = ckpt.load_checkpoint(path, "cpu", weights_only=True, allow_nonfinite=True)
        step = c.step
        cfg = checkpoint_config(c)
    except ckpt.UnsafeCheckpointError:
        raise  # a file that would run code is refused input, not a diagnosis (exit 2)
    except Exception as e:
        raise UnusableCheckpoint(f"checkpoint {path.name} cannot be read",
                                 f"{type(e).__name__}: {e}", "use an earlier checkpoint",
                                 config=cfg, step=step) from None
    precision = c.state.get("precision") or cfg.train.precision
    try:
        model = build_from_checkpoint(c, cfg, use_ema=False)
        ema_state = (build_from_checkpoint(c, cfg, use_ema=True).state_dict()
                     if cfg.adapter.kind != "none" else c.ema)
    except AdapterError as e:
        raise UnusableCheckpoint(
            f"the adapter in {path.name} cannot be paired with its base weights",
            str(e)[:500], "point at the base it was trained on (the checkpoint's "
            "state.json records its path and sha256)", config=cfg, step=step) from None
    except ckpt.CheckpointError as e:
        raise UnusableCheckpoint(
            f"the weights in {path.name} do not match the model its config describes",
            str(e)[:500], "use a checkpoint written by this config",
            config=cfg, step=step) from None
    return CheckpointModel(model.to(device), ema_state, cfg, step, precision)


def fresh_state(cfg: Config) -> dict[str, torch.Tensor]:
    """A freshly initialised model of ``cfg`` (fixed seed; the global RNG is left as found)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        m = build_model(cfg.model, image_size=cfg.data.image_size, channels=cfg.data.channels)
    return {k: v.detach() for k, v in m.state_dict().items()}
