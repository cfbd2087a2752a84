"""The training state: everything that decides the future of a run, with one owner per fact.

:class:`TrainState` owns the counters (``step``, ``batches_consumed``), the runtime precision
and the grad scaler; the guard and the update read and advance them through it and keep no
copies. :class:`~steadydiff.trainer.checkpoint_io.CheckpointIO` saves and restores all of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from ..config import Config
from ..diffusion import AnySchedule
from ..guard import Decision, Guard
from ..guard.update import Update
from ..kinds import Precision
from .ema import EMA
from .hooks import (FULL_WEIGHTS, NO_EVALUATION, NO_FAULTS, PIXELS, Evaluation, Media,
                    StepHooks, Weights)


@dataclass
class TrainState:
    """Everything that decides the future of the run (what a checkpoint holds)."""

    cfg: Config
    model: nn.Module
    ema: EMA
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None
    schedule: AnySchedule  # the objective's (diffusion.objective)
    device: torch.device
    precision: Precision          # the runtime precision (the guard may fall back from fp16)
    grad_accum: int               # runtime micro-batches per step (OOM backoff doubles it)
    update: Update                # the one optimizer update (guard on or off)
    step: int = 0                 # optimizer steps completed
    batches_consumed: int = 0     # data position: global batches drawn from the stream
    # training seconds used, every rank's same value: the time budget's clock and the LR's
    # progress under train.max_time (trainer/budget.py); a rollback does not move it back
    train_seconds: float = 0.0
    bad_images: set[int] = field(default_factory=set)  # indices found unloadable in training
    # every --grow-resolution change of this run: [{step, from, to}] (trainer/resolution.py)
    resolution_history: list[dict[str, int]] = field(default_factory=list)
    rank: int = 0
    world_size: int = 1
    ddp: nn.Module | None = None  # the DistributedDataParallel wrapper under torchrun
    # train.parallel=fsdp: how the model and EMA are sharded (for the log); None: not sharded
    sharded: str | None = None
    # torch.compile of the training forward (train.compile; trainer/compilation.py): shares
    # the model's parameters, is never saved
    compiled: nn.Module | None = None
    guard: Guard | None = None
    faults: StepHooks = NO_FAULTS            # fault injection (docs/faults.md)
    weights: Weights = FULL_WEIGHTS          # the full model, or an adapter over a base
    evaluator: Evaluation = NO_EVALUATION    # evaluation during training (eval.every)
    media: Media = PIXELS                    # pixels; or latents and text (text-to-image)
    prompts: list[Any] = field(default_factory=list)  # validation prompts (validation.Prompt)
    control: list[Any] | None = None  # a ControlNet run: each prompt's conditioning image
    # (N,) per-sample loss weight by dataset index (data/kohya.py: regularization images
    # weigh data.prior_loss_weight); None: every sample 1
    sample_weights: torch.Tensor | None = None
    # train.gradient_checkpointing: what is recomputed in the backward (for the log); None off
    checkpointing: str | None = None
    # model.pretrained's identity (integrations/sd/identity.py), recorded in state.json
    base: dict[str, Any] | None = None


@dataclass
class StepOutput:
    """What one call of :func:`~steadydiff.trainer.loop.train_step` produced. Tensors stay
    on the device; ``decision`` holds host floats only when the guard inspected the step."""

    loss: torch.Tensor            # 0-dim, mean over the global batch
    grad_norm: torch.Tensor       # 0-dim, global norm before clipping
    grad_norm_clipped: torch.Tensor  # 0-dim, after clipping
    per_sample_loss: torch.Tensor  # (B,)
    t: torch.Tensor               # (B,) timesteps
    lr: float
    decision: Decision
    layer_grad_norms: torch.Tensor | None = None  # (P,) on layer-statistics steps only
    probe_forward: Callable[[], Any] | None = None  # one forward pass, for the health probes

    @property
    def stepped(self) -> bool:
        return self.decision.action == "step"


def set_precision(state: TrainState, precision: Precision) -> None:
    """Switch the runtime precision (a resumed run that had fallen back): fp16 keeps a
    scaler, the others have none. The guard reads both from ``state``."""
    state.precision = precision
    if precision != "fp16":
        state.scaler = None
    state.weights.on_precision(state)
