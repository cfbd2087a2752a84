"""The one optimizer update: unscale, clip, (scaler) step, LR scheduler, EMA, advance.

Every update steadydiff makes goes through :class:`Update`, with the guard on (the guard
inspects between :meth:`Update.norm` and :meth:`Update.apply`, and checks the weights between
:meth:`Update.apply` and :meth:`Update.commit`) and with it off (:func:`plain_step`: the same
calls, no detection). The counters (``step``, ``batches_consumed``), the precision and the grad
scaler belong to the *progress* object the caller passes: the trainer's ``TrainState``, or the
guard's own :class:`Progress` in somebody else's loop. Nothing here keeps a copy of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch
from torch import nn

from .. import sharding
from ..kinds import ClipMode, Precision
from . import clipping


class ProgressLike(Protocol):
    """What the update reads and advances: our ``TrainState`` or :class:`Progress`."""

    step: int
    batches_consumed: int
    precision: Precision
    scaler: torch.amp.GradScaler | None


@dataclass
class Progress:
    """The counters, precision and scaler of a loop that is not steadydiff's trainer (the
    trainer passes its own state, which has the same fields)."""

    step: int = 0
    batches_consumed: int = 0
    precision: Precision = "fp32"
    scaler: torch.amp.GradScaler | None = None


class EMAHandle:
    """One interface over the EMA kinds people use: ours (``update(model, step)``,
    ``.module``), torch's ``AveragedModel`` (``update_parameters``) and diffusers'
    ``EMAModel`` (``step(parameters)``, ``shadow_params``)."""

    def __init__(self, ema: Any):
        self.ema = ema

    def update(self, model: nn.Module, step: int, gate: torch.Tensor | None = None) -> None:
        """Average ``model`` in. ``gate`` (0-dim bool, on the device): steadydiff's EMA moves
        only where it is True, without a host read (the other kinds take no gate: they are
        only updated after a step the guard read)."""
        e = self.ema
        if hasattr(e, "update") and hasattr(e, "module") and hasattr(e, "num_updates"):
            e.update(model, step, gate=gate)
        elif hasattr(e, "update_parameters"):
            e.update_parameters(model)
        elif hasattr(e, "step") and hasattr(e, "shadow_params"):
            e.step(model.parameters())
        else:
            raise TypeError(f"unsupported EMA object {type(e).__name__}: expected steadydiff's "
                            "EMA, torch.optim.swa_utils.AveragedModel or diffusers' EMAModel")

    def module(self) -> nn.Module | None:
        """The EMA's copy of the model (ours and ``AveragedModel`` keep one; diffusers'
        ``EMAModel`` keeps only tensors: None)."""
        m = getattr(self.ema, "module", None)
        return m if isinstance(m, nn.Module) else None

    def tensors(self) -> list[torch.Tensor]:
        """Every averaged tensor (checked finite before a snapshot; rank fingerprints),
        steadydiff's post-hoc EMA profiles included."""
        e = self.ema
        if hasattr(e, "shadow_params"):
            return list(e.shadow_params)
        module = e.module if hasattr(e, "num_updates") else e
        posthoc = getattr(e, "posthoc", None)
        # an adapter run's frozen base is shared with the model, not averaged (EMA.shared):
        # not the EMA's to check (and an 8-bit base has no float norm)
        shared = getattr(e, "shared", ())
        return [p for n, p in module.named_parameters() if n not in shared] + \
            (posthoc.tensors() if posthoc else [])

    def mutable_tensors(self) -> list[torch.Tensor]:
        """The tensors an update changes (a speculative window's mark copies these): the
        averaged ones, not the frozen parameters steadydiff's EMA shares with the model."""
        e = self.ema
        if hasattr(e, "num_updates") and hasattr(e, "module") and hasattr(e, "shared"):
            shared = e.shared
            posthoc = getattr(e, "posthoc", None)
            return ([p for n, p in e.module.named_parameters() if n not in shared]
                    + (posthoc.tensors() if posthoc else []))
        return self.tensors()

    def state(self) -> dict[str, Any]:
        e = self.ema
        if hasattr(e, "num_updates") and hasattr(e, "module"):
            shared = getattr(e, "shared", ())  # frozen parameters shared with the model
            out = {"module": {k: v for k, v in e.module.state_dict().items()
                              if k not in shared}, "num_updates": e.num_updates}
            if getattr(e, "posthoc", None) is not None:  # a rollback restores the profiles
                out["posthoc"] = e.posthoc.state()
            return out
        return e.state_dict()

    def load(self, state: dict[str, Any]) -> None:
        e = self.ema
        if hasattr(e, "num_updates") and hasattr(e, "module"):
            if sharding.any_sharded(e.module.parameters()):  # FSDP: a snapshot's own shards
                sharding.load_local(e.module, state["module"])
            else:
                e.module.load_state_dict(state["module"], strict=not getattr(e, "shared", ()))
            e.num_updates = state["num_updates"]
            if getattr(e, "posthoc", None) is not None and "posthoc" in state:
                e.posthoc.load_state(state["posthoc"])
        else:
            e.load_state_dict(state)


def unwrap(model: nn.Module) -> nn.Module:
    """The module under DDP/DataParallel (not any model that has a ``.module`` attribute)."""
    wrapped = isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel))
    return model.module if wrapped else model


class Update:
    """The optimizer update over ``optimizer``'s trainable parameters.

    Args:
        model: the trained module (DDP-wrapped is fine); the EMA follows its parameters.
        optimizer: its optimizer.
        clip_mode, clip: gradient clipping (see :mod:`steadydiff.guard.clipping`).
        scheduler: optional LR scheduler, stepped after each applied update.
        ema: optional EMA (any kind :class:`EMAHandle` accepts).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *,
                 clip_mode: ClipMode = "global", clip: float = 1.0, scheduler: Any = None,
                 ema: Any = None):
        self.net = unwrap(model)
        self.optimizer = optimizer
        self.clip_mode, self.clip = clip_mode, clip
        self.scheduler = scheduler
        self.ema = EMAHandle(ema) if ema is not None else None
        named = [(n, p) for n, p in self.net.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        # FSDP (train.parallel=fsdp): DTensor shards, whose checks are reduced over ranks
        self.sharded = sharding.any_sharded(self.params)

    def norm(self, prog: ProgressLike) -> torch.Tensor:
        """Unscale the fp16 gradients (if a scaler is in use) and return their global norm
        (0-dim, on the device: no host sync)."""
        if prog.scaler is not None:
            prog.scaler.unscale_(self.optimizer)
        return clipping.total_norm(self.params)

    @property
    def fused(self) -> bool:
        """A fused AdamW/Adam: it skips an update on the device when told ``found_inf``."""
        groups = self.optimizer.param_groups
        return bool(groups) and all(g.get("fused") for g in groups)

    def apply(self, prog: ProgressLike, grad_norm: torch.Tensor, *, lr_factor: float = 1.0,
              zclip: float | None = None, gate: torch.Tensor | None = None) -> torch.Tensor:
        """Clip and step the optimizer (through the scaler under fp16) with the learning rate
        times ``lr_factor``; then step the scheduler. Returns the clipped norm (0-dim).

        ``gate`` (0-dim bool on the device, no host read): with a fused optimizer and no
        scaler, the update happens only where it is True (the scaler gates its own
        overflows); a speculative window is judged later and undone if it was not."""
        clipped = clipping.clip(self.params, self.clip_mode, self.clip, grad_norm,
                                zclip_value=zclip)
        groups = self.optimizer.param_groups
        saved = [g["lr"] for g in groups]
        if lr_factor != 1.0:
            for g in groups:
                g["lr"] = g["lr"] * lr_factor
        if prog.scaler is not None:
            prog.scaler.step(self.optimizer)
            prog.scaler.update()
        elif gate is not None and self.fused:
            # 0-dim, read by the fused kernel on the parameters' device (FSDP's CPU
            # offload steps on the CPU: then a device-to-host copy, which that step needs
            # anyway)
            self.optimizer.found_inf = (~gate).float().to(sharding.local(self.params[0]).device)
            try:
                self.optimizer.step()
            finally:
                del self.optimizer.found_inf
        else:
            self.optimizer.step()
        if lr_factor != 1.0:
            for g, lr in zip(groups, saved):
                g["lr"] = lr
        if self.scheduler is not None:
            self.scheduler.step()
        return clipped

    def commit(self, prog: ProgressLike, *, ema: bool = True,
               gate: torch.Tensor | None = None) -> None:
        """The step is done: update the EMA (unless told the update did not happen; ``gate``:
        where the device flag says so), clear the gradients, advance the counters by one
        step and one batch."""
        if ema and self.ema is not None:
            self.ema.update(self.net, prog.step, gate=gate)
        self.optimizer.zero_grad(set_to_none=True)
        prog.step += 1
        prog.batches_consumed += 1

    def discard(self, prog: ProgressLike) -> None:
        """No update this step: clear the gradients and close the scaler's iteration (it
        lowers the scale when ``unscale_`` saw an inf)."""
        self.optimizer.zero_grad(set_to_none=True)
        if prog.scaler is not None:
            try:
                prog.scaler.update()
            except (AssertionError, RuntimeError):
                pass  # the scaler already stepped this iteration (a post-update rollback)


def plain_step(update: Update, prog: ProgressLike, *,
               after_update: Callable[[], None] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The update with no detection at all (``guard.enabled=false``): what every other
    trainer does. Under fp16 a step the scaler skipped (inf gradients) leaves the EMA alone.
    ``after_update`` runs right after the optimizer step (fault injection). Returns
    ``(grad_norm, clipped_norm)``, both 0-dim on the device."""
    gnorm = update.norm(prog)
    scale = prog.scaler.get_scale() if prog.scaler is not None else None  # host sync, fp16
    clipped = update.apply(prog, gnorm)
    if after_update is not None:
        after_update()
    stepped = scale is None or prog.scaler.get_scale() >= scale  # lowered scale: skipped
    update.commit(prog, ema=stepped)
    return gnorm.detach(), clipped.detach()
