"""Doctor: the model a checkpoint holds, and a freshly initialised one to compare it with.

:func:`model_from_checkpoint` is the doctor's one way from a checkpoint directory to a model.
It reads the safetensors files directly instead of going through ``steadydiff.load`` /
``checkpoint.load_checkpoint``, which refuse non-finite weights: the doctor wants to see them,
and a checkpoint it cannot use is a finding, not a crash. It builds the model the way
:func:`steadydiff.api.load` does (plain models, and adapter checkpoints over their base);
that duplication is to go when model-from-checkpoint gets one owner in trainer/.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from ..adapters import AdapterError, build_adapted
from ..config import Config, validate
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
        state: dict[str, Any] = json.loads((path / "state.json").read_text())
        cfg = validate(state["config"], source=f"{path}/state.json config")
        step = int(state.get("step", 0))
        model_sd = load_file(str(path / "model.safetensors"), device="cpu")
        ema_sd = load_file(str(path / "ema.safetensors"), device="cpu")
    except Exception as e:
        raise UnusableCheckpoint(f"checkpoint {path.name} cannot be read",
                                 f"{type(e).__name__}: {e}", "use an earlier checkpoint",
                                 config=cfg, step=step) from None
    precision = state.get("precision") or cfg.train.precision
    if cfg.adapter.kind != "none":
        # an adapter checkpoint: examine base + adapter (the base is loaded and checked)
        c = ckpt.Checkpoint(path, model_sd, ema_sd, None, None, state)
        try:
            model = build_adapted(c, cfg, use_ema=False)
            ema_state = build_adapted(c, cfg, use_ema=True).state_dict()
        except (AdapterError, ckpt.CheckpointError) as e:
            raise UnusableCheckpoint(
                f"the adapter in {path.name} cannot be paired with its base weights",
                str(e)[:500], "point at the base it was trained on (the checkpoint's "
                "state.json records its path and sha256)", config=cfg, step=step) from None
    else:
        model = build_model(cfg.model, image_size=cfg.data.image_size,
                            channels=cfg.data.channels)
        ema_state = ema_sd
        try:
            model.load_state_dict(model_sd)  # strict
        except RuntimeError as e:
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
