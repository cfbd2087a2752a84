"""The optional parts of a run plug into the trainer here, with no-op defaults.

Four small protocols, each a base class whose methods do nothing, so the loop and the step
call them unconditionally (no ``if faults:`` branches) and an absent part costs a method call:

- :class:`StepHooks`: the points inside one step where fault injection acts
  (guard/faults.py ``FaultInjector``; docs/faults.md);
- :class:`Weights`: which tensors the run trains and saves — the whole model by default, the
  adapter's tensors over a frozen base for LoRA/hypernetworks (adapters/core.py ``AdapterRun``);
- :class:`Media`: what the model sees (pixels; latents and text contexts for text-to-image,
  integrations/sd ``TextToImage``);
- :class:`Evaluation`: periodic evaluation, the best checkpoint and early stopping
  (eval/during.py ``TrainingEvaluator``).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable, ContextManager

import torch
from torch import nn

from .checkpoint import Checkpoint

# the trainer's TrainState (trainer/state.py, which builds on these defaults: named, not
# imported, so the two modules do not import each other)
TrainState = Any


class StepHooks:
    """Fault-injection points of one step, in the order the step calls them."""

    def kill(self, step: int, where: str) -> None:
        """``where``: before_step | in_step | in_checkpoint."""

    def before_step(self, step: int, model: nn.Module) -> None:
        """At the start of the step, before the forward pass (weights corrupted between
        steps)."""

    def batch(self, step: int, x: torch.Tensor, idx: torch.Tensor | None = None
              ) -> torch.Tensor:
        """The batch ``x`` of dataset indices ``idx``."""
        return x

    def lr(self, step: int, lr: float) -> float:
        return lr

    def micro_batch(self, step: int, size: int) -> None:
        """Before a micro-batch's forward pass (a simulated memory limit raises here)."""

    def forward(self, step: int, model: nn.Module) -> ContextManager[bool | None]:
        """Around the forward pass; entered, it gives True when it hooked modules of
        ``model`` (the forward must then run ``model`` itself, not a compiled copy)."""
        return contextlib.nullcontext()

    def loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def grads(self, step: int, model: nn.Module) -> None:
        """After the backward pass (and after each replayed backward)."""

    def params(self, step: int, model: nn.Module) -> None:
        """Right after the optimizer step."""

    def end_step(self, step: int) -> None:
        """The step is over, whatever was decided."""

    def rollback(self) -> None:
        """The guard rolled back."""

    def mark(self) -> Any:
        """This object's state at the start of a speculative window (``guard.check_every``):
        a rewind restores it, so the window's steps happen again as they did."""
        return None

    def restore(self, mark: Any) -> None:
        """Back to a :meth:`mark` (a rewind)."""


NO_FAULTS = StepHooks()


class Weights:
    """The full model: every parameter is trained, saved and restored."""

    def tensors(self, state: TrainState) -> tuple[nn.Module | dict[str, torch.Tensor],
                                                    nn.Module | dict[str, torch.Tensor]]:
        """What a checkpoint holds as (model, EMA) weights."""
        return state.model, state.ema.module

    def restore(self, state: TrainState, c: Checkpoint) -> None:
        """Load a checkpoint's weights into ``state``."""
        state.model.load_state_dict(c.model)
        state.ema.module.load_state_dict(c.ema)

    def verify(self, state: TrainState) -> None:
        """Before a checkpoint is written (raise to refuse it)."""

    def reads_at(self, step: int) -> bool:
        """Whether :meth:`after_update` reads the state after step ``step`` (the speculative
        guard judges the steps before, so it reads a verified state)."""
        return False

    def after_update(self, state: TrainState) -> None:
        """After every applied update."""

    def sampling_context(self, state: TrainState) -> ContextManager[None]:
        """Around in-training sampling (sample grids, evaluation)."""
        return contextlib.nullcontext()

    def info(self) -> dict[str, Any] | None:
        """What state.json records about the weights (None: nothing)."""
        return None

    def on_precision(self, state: TrainState) -> None:
        """The runtime precision changed to ``state.precision`` (the guard's fallback, or a
        resumed run that had fallen back): frozen low-precision parts follow it."""

    def export(self, state: TrainState, root: Path, final: bool) -> Path | None:
        """After a verified checkpoint: write the weights in the format other tools load
        (a Stable Diffusion LoRA as diffusers' file; None: nothing to write)."""
        return None

    def mark_best(self, state: TrainState, root: Path, info: dict[str, Any]) -> Path | None:
        """After the best evaluation's checkpoint: mark the exported files of this step as
        the best (an SD adapter's numbered files; None: nothing to mark)."""
        return None


FULL_WEIGHTS = Weights()


class Media:
    """What the model sees, against what a person sees: by default the images themselves
    (pixel space, class labels or none). A text-to-image run's media (integrations/sd
    ``TextToImage``) encodes prompts into text contexts and decodes latents into images."""

    text: bool = False
    latent: bool = False

    def encode_prompts(self, prompts: list[str]) -> torch.Tensor:
        raise TypeError("this model is not conditioned on text")

    def decode(self, x: torch.Tensor) -> torch.Tensor:
        """Images in [-1, 1] from what the model samples."""
        return x


PIXELS = Media()


class Evaluation:
    """No evaluation during training (``eval.every: 0``)."""

    stopped: bool = False

    def due(self, step: int) -> bool:
        return False

    def run(self, state: TrainState, tb: Any = None,
            save_best: Callable[[], Path | None] | None = None) -> dict[str, Any]:
        raise RuntimeError("evaluation is off (eval.every=0)")

    def stop_reason(self) -> str | None:
        return None

    def state_dict(self) -> dict[str, Any] | None:
        return None

    def load_state_dict(self, d: dict[str, Any] | None) -> None:
        pass


NO_EVALUATION = Evaluation()
