"""One object saves and loads every stateful part of a training run.

:class:`CheckpointIO` is the single writer and reader of a :class:`TrainState` in a checkpoint
(the format itself, atomic and verified, is trainer/checkpoint.py's): the periodic
checkpoints, the final one and the best evaluation's (``checkpoints/best``) all come from
:meth:`CheckpointIO.save`, so they hold the same parts — an adapter run's best checkpoint holds
the adapter, exactly like its periodic ones. Adding a stateful part is one entry in
:meth:`CheckpointIO.parts` and one line in :meth:`CheckpointIO.restore`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from . import checkpoint as ckpt
from .state import TrainState, set_precision


# the optim keys that decide the learning rate at a step (trainer/optim.py lr_at, set_lr)
LR_KEYS = ("lr", "schedule", "warmup_steps", "min_lr_ratio", "layer_decay")


class CheckpointIO:
    """Save and restore every stateful part of ``state``."""

    def __init__(self, state: TrainState):
        self.state = state

    def parts(self) -> dict[str, Any]:
        """The JSON-able part of the state (``state.json``; tensors are saved apart)."""
        s = self.state
        return {
            "step": s.step, "batches_consumed": s.batches_consumed,
            "images_seen": s.step * s.cfg.train.batch_size,
            "train_seconds": s.train_seconds,  # the time budget used (trainer/budget.py)
            "ema": s.ema.state(),
            "scaler": s.scaler.state_dict() if s.scaler else None,
            "precision": s.precision, "grad_accum": s.grad_accum,
            "bad_images": sorted(s.bad_images),
            # the resolution these weights were trained at, and each change (a grown run)
            "image_size": s.cfg.data.image_size,
            "resolution_history": list(s.resolution_history),
            "guard": s.guard.state_dict() if s.guard else None,
            "eval": s.evaluator.state_dict(),
            "adapter": s.weights.info(),
            "base": s.base,  # model.pretrained's identity (integrations/sd/identity.py)
            "config": s.cfg.to_dict(), "torch": torch.__version__,
            "world_size": s.world_size,
        }

    def save(self, root: Path, *, keep: int, abort: dict[str, Any] | None = None) -> Path:
        """Write a verified checkpoint of the state under ``root`` (a run's ``checkpoints/``
        or ``checkpoints/best``), keeping the newest ``keep``; ``abort`` (``{step, reason}``)
        marks it as an aborted run's abort point in its state.json.

        Raises:
            CheckpointError: non-finite weights or EMA (nothing is written).
            OSError: the disk refused it (the previous checkpoint is intact).
            GuardAbort: the weights' own check refused it (an adapter's base changed).
        """
        s = self.state
        s.weights.verify(s)
        step = s.step
        parts = {**self.parts(), **({"abort": abort} if abort else {})}
        if s.sharded:  # FSDP: every rank writes its shards (trainer/checkpoint.py)
            return ckpt.save_sharded(root, step, model=s.model, ema=s.ema.module,
                                     optimizer=s.optimizer, state=parts, keep=keep,
                                     on_file=lambda _name: s.faults.kill(step, "in_checkpoint"))
        model, ema = s.weights.tensors(s)
        posthoc = s.ema.posthoc
        return ckpt.save_checkpoint(root, step, model=model, ema=ema, optimizer=s.optimizer,
                                    state=parts, keep=keep,
                                    on_file=lambda _name: s.faults.kill(step, "in_checkpoint"),
                                    extra={"posthoc.safetensors": posthoc.tensor_dict()}
                                    if posthoc is not None else None)

    def restore(self, c: ckpt.Checkpoint) -> None:
        """Load checkpoint ``c`` into a freshly built state (weights, optimizer, RNG,
        counters, and the parts that keep their own state)."""
        s = self.state
        # the AdamW kernel is this run's (optim.fused, a speed key safe to change on resume),
        # not the checkpoint's: load_state_dict would put the saved groups' choice back
        # so are its groups' LR scales (optim.lr_text_encoder, layer decay): this run's
        kernel = [{k: g[k] for k in ("fused", "foreach", "lr_scale") if k in g}
                  for g in s.optimizer.param_groups]
        if c.sharded is not None:  # DCP: into this run's layout, sharded or not (resharded)
            ckpt.load_sharded_into(c.sharded, model=s.model, ema=s.ema.module,
                                   optimizer=s.optimizer)
        elif s.sharded:  # a plain checkpoint continued with train.parallel=fsdp
            ckpt.load_full_into(c, model=s.model, ema=s.ema.module, optimizer=s.optimizer)
        else:
            s.weights.restore(s, c)
            saved = len((c.optimizer or {}).get("param_groups", []))
            if saved != len(s.optimizer.param_groups):  # a part given its own LR, or no more
                raise ckpt.CheckpointError(
                    f"{c.path}: its optimizer has {saved} parameter group(s), this run's "
                    f"{len(s.optimizer.param_groups)}: optim.lr_text_encoder (or another "
                    "setting that groups the parameters: optim.weight_decay, "
                    "optim.layer_decay) changed between equal and unequal to the checkpoint's;"
                    " set it as it was, or start a new run")
            s.optimizer.load_state_dict(c.optimizer)
        for g, k in zip(s.optimizer.param_groups, kernel):
            g.update(k)
            for p in g["params"] if g.get("fused") else ():  # fused: steps on the device
                st = s.optimizer.state.get(p, {})
                if isinstance(st.get("step"), torch.Tensor) and st["step"].device != p.device:
                    st["step"] = st["step"].to(p.device, torch.float32)
        s.ema.load_state(c.state["ema"])
        if s.ema.posthoc is not None and "posthoc.safetensors" in c.extra:
            s.ema.posthoc.load_tensor_dict(c.extra["posthoc.safetensors"])
        if s.scaler and c.state.get("scaler"):
            s.scaler.load_state_dict(c.state["scaler"])
        s.step = int(c.state["step"])
        s.batches_consumed = int(c.state["batches_consumed"])
        s.train_seconds = float(c.state.get("train_seconds", 0.0))  # older checkpoints: 0
        s.grad_accum = int(c.state.get("grad_accum") or s.grad_accum)
        s.bad_images = set(c.state.get("bad_images", []))
        s.resolution_history = [dict(r) for r in c.state.get("resolution_history", [])]
        precision = c.state.get("precision") or s.precision
        if precision != s.precision:  # the guard fell back before this checkpoint
            set_precision(s, precision)
        s.evaluator.load_state_dict(c.state.get("eval"))
        if c.rng is not None:
            ckpt.restore_rng(c.rng)

    def restore_guard(self, c: ckpt.Checkpoint) -> None:
        """The guard's statistics and budgets (the guard is built after the resume: its first
        snapshot is the restored state)."""
        s = self.state
        if s.guard is None or not c.state.get("guard"):
            return
        s.guard.load_state_dict(c.state["guard"])
        # only the keys that decide the LR (a kernel or optimizer choice is not one, and older
        # checkpoints lack the newer keys)
        now = s.cfg.optim.model_dump(mode="json", include=set(LR_KEYS))
        saved = {k: v for k, v in c.state["config"]["optim"].items() if k in LR_KEYS}
        if saved != now:
            s.guard.max_lr = 0.0  # an LR change the user accepted is not an lr_spike
