"""The training loop, readable top to bottom.

    setup (device, data, model, EMA, optimizer, scaler) -> resume -> loop of
    {step, status/metrics, samples, checkpoint, done?}

The per-step work is :func:`train_step`, a plain function over :class:`TrainState`, so the
stability guard and the tests call exactly the code the trainer runs. Progress is counted in
one unit, optimizer steps; all randomness of a step is derived from (seed, step) for the whole
global batch, so a resumed run replays the same timesteps, noise and label dropout, and so does
a run on another number of processes (torchrun: see docs/distributed.md).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from .. import distributed, seeding
from ..config import Config, ConfigError, config_diff, validate
from ..data import as_pairs, build_dataset, make_loader
from ..diffusion import Draws, Schedule, diffusion_loss, draw, make_schedule, sample
from ..eval.during import make_evaluator
from ..eval.grid import grid_nrow, save_grid
from ..guard import Decision, Guard, GuardAbort, clipping
from ..guard.faults import FaultInjector, make_injector
from ..lint import lint
from ..models import build_model
from . import checkpoint as ckpt
from . import precision as prec
from .ema import EMA
from . import telemetry
from .optim import build_optimizer, lr_at, set_lr

log = logging.getLogger(__name__)

# Fields a resumed run may change without breaking exactness (bookkeeping and output only).
RESUME_SAFE = ("train.steps", "train.checkpoint_every", "train.keep_checkpoints",
               "train.sample_every", "train.num_threads", "train.device", "data.num_workers",
               "data.path", "train.on_save_error", "sample.", "logging.", "faults", "eval.",
               "train.dist_timeout", "train.watchdog_timeout", "guard.rank_check_every")


@dataclass
class TrainState:
    """Everything that decides the future of the run (what a checkpoint holds)."""

    cfg: Config
    model: nn.Module
    ema: EMA
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None
    schedule: Schedule
    device: torch.device
    precision: str                # the runtime precision (the guard may fall back from fp16)
    grad_accum: int               # runtime micro-batches per step (OOM backoff doubles it)
    step: int = 0                 # optimizer steps completed
    batches_consumed: int = 0     # data position: global batches drawn from the stream
    bad_images: set[int] = field(default_factory=set)  # indices found unloadable in training
    rank: int = 0
    world_size: int = 1
    ddp: nn.Module | None = None  # the DistributedDataParallel wrapper under torchrun
    guard: Guard | None = None
    faults: FaultInjector | None = None  # None unless faults are configured: zero cost
    evaluator: Any = None  # eval.during.TrainingEvaluator when eval.every > 0
    adapter: Any = None  # adapters.AdapterRun when fine-tuning (adapter.kind != none)


@dataclass
class StepOutput:
    """What one call of :func:`train_step` produced. Tensors stay on the device."""

    loss: torch.Tensor            # 0-dim, mean over the global batch
    grad_norm: torch.Tensor       # 0-dim, global norm before clipping
    per_sample_loss: torch.Tensor  # (B,)
    t: torch.Tensor               # (B,) timesteps
    lr: float
    grad_norm_clipped: torch.Tensor | None = None  # without the guard (the guard has it)
    decision: Decision | None = None  # the guard's decision (None when the guard is off)
    layer_grad_norms: torch.Tensor | None = None  # (P,) on layer-statistics steps only
    probe_forward: Any = None  # one forward pass on this batch, for the health probes

    @property
    def stepped(self) -> bool:
        return self.decision is None or self.decision.action == "step"


@dataclass
class RunResult:
    """Summary of a finished run, returned by :func:`run` (and ``steadydiff.train``)."""

    run_dir: Path
    steps: int
    final_loss: float | None
    checkpoint: Path | None
    samples: list[Path] = field(default_factory=list)
    resumed_from: Path | None = None
    seconds: float = 0.0
    incidents: int = 0
    guard_summary: str | None = None
    stopped_early: str | None = None  # why eval's early stopping ended the run, if it did


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written (disk full, permission denied); exit code 4."""


class TrainingDiverged(GuardAbort):
    """The weights went non-finite and nothing recovered them (the guard is off): the run
    stops instead of writing, or training on, a NaN model. Exit code 3."""


# --------------------------------------------------------------------------- one step


def _micro_loss(state: TrainState, xm: torch.Tensor, ym: torch.Tensor | None,
                draws: Draws, step: int, weight: float, local: bool = False):
    """Forward pass of one micro-batch with its slice of the step's draws, so calling it
    again replays it exactly (the guard's provenance does). ``local`` runs the unwrapped
    model: a replay or probe on one rank must not enter DDP's collectives."""
    faults = state.faults
    model = state.model if local or state.ddp is None else state.ddp
    if faults:
        faults.micro_batch(step, xm.shape[0])
    with prec.autocast(state.precision, state.device), \
            (faults.forward(step, state.model) if faults else contextlib.nullcontext()):
        out = diffusion_loss(model, xm, ym, state.schedule, state.cfg.diffusion, draws=draws)
    loss, per_sample = out.loss.float() * weight, out.per_sample.detach().float()
    if faults:
        loss, per_sample = faults.loss(step, loss), faults.loss(step, per_sample)
    return loss, per_sample, out.t


def step_draws(state: TrainState, step: int, x: torch.Tensor) -> tuple[Draws, int]:
    """This rank's slice of step ``step``'s random draws, and the global batch size.

    The draws are made for the whole global batch from a generator seeded by (seed, step)
    and each rank takes the slice of its samples, so sample i of a global batch gets the same
    timestep, noise and label dropout for any world size and gradient accumulation.
    """
    cfg = state.cfg
    world, n = state.world_size, x.shape[0]
    total = cfg.train.batch_size if world > 1 else n
    lo = total * state.rank // world
    gen = seeding.generator(state.device, cfg.train.seed, step)
    d = draw(total, tuple(x.shape[1:]), cfg.diffusion, state.schedule.T, gen, state.device)
    return d[lo:lo + n], total


def train_step(state: TrainState, batch: tuple[torch.Tensor, ...]) -> StepOutput:
    """One optimizer step on a global batch ``(x, y, idx)``: micro-batches with gradient
    accumulation, autocast, the fp16 grad scaler, clipping, AdamW, EMA.

    With a guard, the guard inspects the step after the backward pass and applies, skips or
    rolls back the update (see :class:`Guard`); an out-of-memory error halves the micro-batch
    and retries. Randomness comes from :func:`step_draws`, so the same batch at the same step
    reproduces exactly. Under torchrun ``batch`` is this rank's slice of the global batch and
    DDP averages the gradients (one all-reduce per step, in the last micro-batch).
    """
    cfg, model, opt, faults, guard = state.cfg, state.model, state.optimizer, state.faults, \
        state.guard
    step = state.step
    if faults:
        faults.kill(step, "before_step")
    x, y = batch[0].to(state.device, non_blocking=True), batch[1].to(state.device)
    if len(batch) > 3 and batch[3].any():  # images replaced because they failed to load
        state.bad_images.update(batch[2][batch[3]].tolist())
    y = y if model.num_classes else None
    lr = lr_at(step, cfg.optim, cfg.train.steps)
    if faults:
        x, lr = faults.batch(step, x), faults.lr(step, lr)
    set_lr(opt, lr)

    draws, total = step_draws(state, step, x)
    while True:  # retried only after an out-of-memory backoff
        xs, ys = x.chunk(state.grad_accum), (y.chunk(state.grad_accum) if y is not None
                                            else [None] * state.grad_accum)
        offsets = [0]
        for xm in xs:
            offsets.append(offsets[-1] + xm.shape[0])
        ds = [draws[a:b] for a, b in zip(offsets, offsets[1:])]
        # each micro-batch's share of the global mean; DDP averages over ranks, hence x world
        weights = [xm.shape[0] * state.world_size / total for xm in xs]
        try:
            losses, ts = [], []
            for micro, (xm, ym) in enumerate(zip(xs, ys)):
                # DDP all-reduces the gradients once, in the last micro-batch's backward
                sync = (state.ddp.no_sync() if state.ddp is not None and micro < len(xs) - 1
                        else contextlib.nullcontext())
                with sync:
                    loss, per_sample, t = _micro_loss(state, xm, ym, ds[micro], step,
                                                      weights[micro])
                    (state.scaler.scale(loss) if state.scaler else loss).backward()
                losses.append(per_sample)
                ts.append(t)
            break
        except torch.OutOfMemoryError as e:
            if guard is None or state.world_size > 1:
                # under DDP the other ranks already wait in the gradient all-reduce: a local
                # backoff cannot rejoin them. The rank fails, torchrun stops the group, and
                # the rerun resumes (with a smaller train.batch_size or more grad_accum).
                raise
            new = guard.handle_oom(xs[0].shape[0], e)
            if new is None:
                raise GuardAbort(f"out of memory at step {step} with a micro-batch of "
                                 f"{xs[0].shape[0]}: {e}", guard.incidents[-1]) from None
            state.grad_accum = -(-x.shape[0] // new)
    if faults:
        faults.grads(step, model)
        faults.kill(step, "in_step")
    per_sample = torch.cat(losses)
    t_all = torch.cat(ts)
    every = cfg.logging.layer_stats_every
    layer_grads = None
    if every and (step + 1) % every == 0:  # per-layer gradient norms, before clipping
        grads = [p.grad if p.grad is not None else torch.zeros_like(p)
                 for p in model.parameters() if p.requires_grad]
        layer_grads = torch.stack(torch._foreach_norm(grads))
        if state.scaler:
            layer_grads = layer_grads / state.scaler.get_scale()

    def probe_forward():
        return _micro_loss(state, xs[0], ys[0], ds[0], step, 1.0, local=True)

    if guard is not None:
        def replay(i: int) -> torch.Tensor:
            loss_i = _micro_loss(state, xs[i], ys[i], ds[i], step, weights[i], local=True)[0]
            return state.scaler.scale(loss_i) if state.scaler else loss_i

        d = guard.step(per_sample.mean(), t=t_all, per_sample_loss=per_sample, inputs=x,
                       replay=replay, num_micro=len(xs),
                       after_backward=(lambda: faults.grads(step, model)) if faults else None,
                       after_update=(lambda: faults.params(step, model)) if faults else None,
                       probe_forward=probe_forward)
        if faults:
            faults.end_step(step)
            if d.action == "rollback":
                faults.rollback()
        return StepOutput(per_sample.mean(), torch.tensor(d.grad_norm if d.grad_norm is not None
                                                          else float("nan")),
                          per_sample, t_all, lr, decision=d, layer_grad_norms=layer_grads,
                          probe_forward=probe_forward if layer_grads is not None else None)

    # ---- no guard: what every other trainer does
    params = [p for g in opt.param_groups for p in g["params"]]
    if state.scaler:
        state.scaler.unscale_(opt)
    grad_norm = clipping.total_norm(params)
    clipped = clipping.clip(params, cfg.optim.clip_mode, cfg.optim.grad_clip, grad_norm)
    stepped = True
    if state.scaler:
        scale = state.scaler.get_scale()  # host sync, fp16 only
        state.scaler.step(opt)
        state.scaler.update()
        stepped = state.scaler.get_scale() >= scale  # a lowered scale means inf grads: skipped
    else:
        opt.step()
    if faults:
        faults.params(step, model)
        faults.end_step(step)
    opt.zero_grad(set_to_none=True)
    if stepped:
        state.ema.update(model, step)
    state.step += 1
    state.batches_consumed += 1
    return StepOutput(per_sample.mean(), grad_norm.detach(), per_sample, t_all, lr,
                      grad_norm_clipped=clipped.detach(), layer_grad_norms=layer_grads,
                      probe_forward=probe_forward if layer_grads is not None else None)


# --------------------------------------------------------------------------- setup


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda but no CUDA device is available; "
                          "use train.device=cpu or auto")
    return torch.device(name)


def configure_runtime(cfg: Config, device: torch.device,
                      ctx: distributed.DistContext = distributed.DistContext()) -> None:
    """Threads, seeds and the deterministic mode, before anything random happens."""
    if cfg.train.num_threads:
        torch.set_num_threads(cfg.train.num_threads)
    elif ctx.enabled and device.type == "cpu":
        # N ranks on one node each starting one thread per core oversubscribe it (2-10x
        # slower measured on 2 cores): share the cores out
        local = int(os.environ.get("LOCAL_WORLD_SIZE", ctx.world_size))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    if cfg.train.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    elif device.type == "cuda":
        torch.backends.cudnn.benchmark = True
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    seeding.seed_everything(cfg.train.seed)


def build_state(cfg: Config, num_classes_in_data: int, device: torch.device,
                ctx: distributed.DistContext = distributed.DistContext()) -> TrainState:
    """Model, EMA, optimizer, scaler and schedule for ``cfg`` (fresh, not resumed; not yet
    wrapped in DDP)."""
    if cfg.model.num_classes and num_classes_in_data > cfg.model.num_classes:
        raise ConfigError(
            f"the data has {num_classes_in_data} classes but model.num_classes is "
            f"{cfg.model.num_classes}; set model.num_classes={num_classes_in_data}")
    if cfg.model.num_classes and num_classes_in_data == 0:
        raise ConfigError(
            f"model.num_classes={cfg.model.num_classes} (class-conditional) but the data has no "
            "labels; set data.class_labels=true for a folder with one sub-folder per class, "
            "or model.num_classes=0 for an unconditional model")
    model = build_model(cfg.model, image_size=cfg.data.image_size,
                        channels=cfg.data.channels).to(device)
    adapter = None
    if cfg.adapter.kind != "none":  # frozen base + trainable adapter (docs/adapters.md)
        from ..adapters import AdapterRun
        adapter = AdapterRun.prepare(cfg, model)
    return TrainState(
        cfg=cfg, model=model, ema=EMA.from_config(model, cfg.train), adapter=adapter,
        optimizer=build_optimizer(model, cfg.optim),
        scaler=prec.make_scaler(cfg.train.precision, device),
        schedule=make_schedule(cfg.diffusion), device=device,
        precision=cfg.train.precision, grad_accum=cfg.train.grad_accum,
        rank=ctx.rank, world_size=ctx.world_size, faults=make_injector(cfg.faults, ctx.rank))


def attach_guard(state: TrainState, run_dir: Path | None) -> Guard | None:
    """Build the guard over ``state`` (after any resume: its first snapshot is this state)."""
    cfg = state.cfg
    if not cfg.guard.enabled:
        return None
    state.guard = Guard(state.model, state.optimizer, scaler=state.scaler, ema=state.ema,
                        config=cfg.guard, run_dir=run_dir, clip_mode=cfg.optim.clip_mode,
                        clip=cfg.optim.grad_clip, num_timesteps=cfg.diffusion.timesteps,
                        precision=state.precision, progress=state, device=state.device)
    return state.guard


def set_precision(state: TrainState, precision: str) -> None:
    """Switch the runtime precision (a guard fallback, or a resumed run that had fallen back):
    fp16 keeps a scaler, the others have none."""
    state.precision = precision
    if precision != "fp16":
        state.scaler = None
    if state.guard is not None:
        state.guard.scaler = state.scaler
        state.guard.precision = precision


def state_dict(state: TrainState) -> dict[str, Any]:
    """The JSON-able part of the training state (tensors are saved separately)."""
    return {
        "step": state.step, "batches_consumed": state.batches_consumed,
        "images_seen": state.step * state.cfg.train.batch_size,
        "ema": state.ema.state(),
        "scaler": state.scaler.state_dict() if state.scaler else None,
        "precision": state.precision, "grad_accum": state.grad_accum,
        "bad_images": sorted(state.bad_images),
        "guard": state.guard.state_dict() if state.guard else None,
        "eval": state.evaluator.state_dict() if state.evaluator else None,
        "adapter": state.adapter.info() if state.adapter else None,
        "config": state.cfg.to_dict(), "torch": torch.__version__,
        "world_size": state.world_size,
    }


def save(state: TrainState, run_dir: Path) -> Path | None:
    """Write a checkpoint. On disk full / permission denied the previous checkpoint stays
    intact; ``train.on_save_error`` decides between retrying at the next checkpoint
    (returns None) and stopping (raises :class:`CheckpointSaveError`).

    Under torchrun rank 0 writes (the replicas are identical) and tells every rank the
    outcome, so all of them go on, or all raise the same error, together."""
    if state.world_size == 1:
        return _save(state, run_dir)
    outcome: tuple[str, Any] | None = None
    if state.rank == 0:
        try:
            outcome = ("ok", _save(state, run_dir))
        except (GuardAbort, CheckpointSaveError) as e:  # diverged, base modified, disk
            outcome = ("error", e)
    kind, value = distributed.broadcast_object(outcome)
    if kind == "error":
        raise value
    return value


def _save(state: TrainState, run_dir: Path) -> Path | None:
    faults = state.faults
    on_file = (lambda _name: faults.kill(state.step, "in_checkpoint")) if faults else None
    model, ema = state.model, state.ema.module
    if state.adapter is not None:  # adapter tensors only, after checking the base is intact
        state.adapter.verify_base(state)
        model, ema = state.adapter.tensors(state)
    try:
        return ckpt.save_checkpoint(
            run_dir / "checkpoints", state.step, model=model, ema=ema,
            optimizer=state.optimizer, state=state_dict(state),
            keep=state.cfg.train.keep_checkpoints, on_file=on_file)
    except ckpt.CheckpointError as e:  # the only cause: non-finite weights or EMA
        prev = ckpt.latest_good(run_dir / "checkpoints")
        raise TrainingDiverged(
            f"{e}; the model diverged and the guard is "
            f"{'on but could not recover it' if state.guard else 'off (guard.enabled=false)'}"
            f"; the last good checkpoint is {prev or 'none'}") from None
    except OSError as e:
        prev = ckpt.latest_good(run_dir / "checkpoints")
        msg = (f"could not write checkpoint at step {state.step}: {e}; the previous "
               f"checkpoint ({prev or 'none'}) is intact")
        if state.cfg.train.on_save_error == "stop":
            raise CheckpointSaveError(msg + " (train.on_save_error=stop)") from None
        log.error("%s; training continues and retries at the next checkpoint "
                  "(train.on_save_error=retry)", msg)
        print(f"warning: {msg}; retrying at the next checkpoint")
        return None


def restore(state: TrainState, c: ckpt.Checkpoint) -> None:
    """Load a checkpoint into a freshly built state (weights, optimizer, RNG, counters)."""
    if state.adapter is not None:  # the adapter (+ EMA), after checking the base
        state.adapter.restore(state, c)
    else:
        state.model.load_state_dict(c.model)
        state.ema.module.load_state_dict(c.ema)
    state.optimizer.load_state_dict(c.optimizer)
    state.ema.load_state(c.state["ema"])
    if state.scaler and c.state.get("scaler"):
        state.scaler.load_state_dict(c.state["scaler"])
    state.step = int(c.state["step"])
    state.batches_consumed = int(c.state["batches_consumed"])
    state.grad_accum = int(c.state.get("grad_accum") or state.grad_accum)
    state.bad_images = set(c.state.get("bad_images", []))
    precision = c.state.get("precision") or state.precision
    if precision != state.precision:  # the guard fell back before this checkpoint
        set_precision(state, precision)
    if state.evaluator is not None:
        state.evaluator.load_state_dict(c.state.get("eval"))
    if c.rng is not None:
        ckpt.restore_rng(c.rng)


def check_resume_config(saved: Config, cfg: Config, allow_change: bool) -> list[str]:
    """Report config changes on resume; refuse those that break exactness unless allowed."""
    changes = config_diff(saved, cfg)
    lines = [f"  {k}: {a!r} -> {b!r}" for k, a, b in changes]
    unsafe = [k for k, _, _ in changes if not k.startswith(RESUME_SAFE)]
    # the cosine schedule (and an unfinished warmup) is a function of train.steps
    if any(k == "train.steps" for k, _, _ in changes) and (
            cfg.optim.schedule != "constant" or cfg.optim.warmup_steps > min(saved.train.steps,
                                                                           cfg.train.steps)):
        unsafe.append("train.steps")
        lines = [ln + ("  (changes the LR schedule of the remaining steps)"
                       if ln.strip().startswith("train.steps:") else "") for ln in lines]
    if unsafe and not allow_change:
        raise ConfigError(
            "the config differs from the checkpoint's in fields that change the training "
            "itself:\n" + "\n".join(lines) + "\nresume with the original config, use a new "
            "--out directory, or pass --allow-config-change to accept the changes")
    return lines


# --------------------------------------------------------------------------- the loop


def run(cfg: Config, *, run_dir: str | Path, dataset: torch.utils.data.Dataset | None = None,
        resume: str | Path | bool = True, allow_config_change: bool = False) -> RunResult:
    """Train ``cfg`` into ``run_dir``; under torchrun, one rank of a DDP group.

    Args:
        cfg: a resolved config.
        run_dir: output directory (config.yaml, metrics.jsonl, samples/, checkpoints/).
        dataset: optional torch Dataset of images or (image, label) pairs, replacing
            ``cfg.data``'s dataset.
        resume: True resumes from the newest intact checkpoint in ``run_dir`` if there is
            one (rerunning the same command continues the run); a path resumes from that
            checkpoint; False starts fresh (refusing to overwrite existing checkpoints).
        allow_config_change: accept config changes on resume that break exactness.

    Returns:
        A :class:`RunResult` (on every rank; only rank 0 wrote files).

    Raises:
        distributed.DistributedError: a collective failed (another rank died or hung).
    """
    owned = not (torch.distributed.is_available() and torch.distributed.is_initialized())
    ctx, device = distributed.setup(cfg.train.device, cfg.train.dist_timeout)
    try:
        with distributed.Watchdog(cfg.train.watchdog_timeout if ctx.enabled else 0,
                                  ctx.rank) as watchdog:
            return _run(cfg, ctx, device, watchdog, Path(run_dir), dataset, resume,
                        allow_config_change)
    except torch.distributed.DistError as e:
        raise distributed.DistributedError(distributed.describe_failure(e, ctx)) from e
    except RuntimeError as e:
        if ctx.enabled and _is_collective_failure(e):
            raise distributed.DistributedError(distributed.describe_failure(e, ctx)) from e
        raise
    finally:
        if owned:
            distributed.teardown()


def _is_collective_failure(e: RuntimeError) -> bool:
    """gloo reports a timed-out or broken peer as a plain RuntimeError."""
    text = str(e).lower()
    return any(k in text for k in ("gloo", "nccl", "connection closed by peer",
                                   "timed out", "connection reset"))


def _run(cfg: Config, ctx: distributed.DistContext, device: torch.device,
         watchdog: distributed.Watchdog, run_dir: Path, dataset, resume,
         allow_config_change: bool) -> RunResult:
    t_start = time.perf_counter()
    main = ctx.is_main
    say = print if main else (lambda *a, **k: None)  # rank 0 speaks and writes
    prec.check_precision(cfg.train.precision, device, cfg.train.allow_slow_precision)
    for warning in lint(cfg, device):  # dangerous but legal settings: say why, at start
        say(f"warning: {warning}")
    configure_runtime(cfg, device, ctx)

    data = as_pairs(dataset) if dataset is not None else build_dataset(cfg.data)
    skipped_at_scan = getattr(data, "skipped", 0)  # files dropped before training began
    state = build_state(cfg, getattr(data, "num_classes", 0), device, ctx)
    state.evaluator = make_evaluator(cfg, run_dir)

    # ---- resume: the same command again continues the run; rank 0 picks the checkpoint
    # and every rank reads that one
    resumed_from: Path | None = None
    source: Path | None = None
    if main:
        if resume is True:
            source = ckpt.latest_good(run_dir / "checkpoints")
        elif resume:
            source = ckpt.resolve_checkpoint(resume)
        elif ckpt.list_checkpoints(run_dir / "checkpoints"):
            source = ConfigError(f"{run_dir} already holds checkpoints; resume it, or choose "
                                 "a new --out directory (nothing there is overwritten)")
    source = distributed.broadcast_object(source)
    if isinstance(source, Exception):
        raise source
    if source is not None:
        c = ckpt.load_checkpoint(source, device)
        saved_cfg = validate(c.state["config"], f"{source}/state.json config")
        # a finished run trains no further step: its config changes cannot break anything
        done = c.step >= cfg.train.steps
        changes = check_resume_config(saved_cfg, cfg, allow_config_change or done)
        restore(state, c)
        resumed_from = source
        say(f"resumed from {source} at step {state.step}"
            + (" (the run is already complete)" if done else "")
            + ("; config changes:\n" + "\n".join(changes) if changes else ""))
        saved_world = int(c.state.get("world_size", 1))
        if saved_world != ctx.world_size:
            say(f"note: the checkpoint was written by {saved_world} process(es), this run has "
                f"{ctx.world_size}: the global batch, the sample order and the noise are the "
                "same (batches are split by position), but the gradient reduction order "
                "differs, so the result matches an uninterrupted run to rounding, not "
                "bit for bit")
    if ctx.enabled:
        state.ddp = distributed.wrap(state.model, device)  # broadcasts rank 0's weights

    guard = attach_guard(state, run_dir if main else None)
    if guard is not None and source is not None and c.state.get("guard"):
        guard.load_state_dict(c.state["guard"])
        if c.state["config"]["optim"] != cfg.optim.model_dump(mode="json"):
            guard.max_lr = 0.0  # an LR change the user accepted is not an lr_spike

    tb = None
    if main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(cfg.to_yaml())
        for name in ("metrics.jsonl", "layers.jsonl", "incidents.jsonl", "eval.jsonl"):
            telemetry.truncate_jsonl(run_dir / name, state.step)
        tb = telemetry.TensorBoard(run_dir) if cfg.logging.tensorboard else None

    def batches_from(position: int):
        return iter(make_loader(data, batch_size=cfg.train.batch_size, seed=cfg.train.seed,
                                start_batch=position, hflip=cfg.data.hflip,
                                num_workers=cfg.data.num_workers, rank=ctx.rank,
                                world_size=ctx.world_size, pin_memory=device.type == "cuda"))

    batches = batches_from(state.batches_consumed)
    samples: list[Path] = []
    last_ckpt: Path | None = source
    total = cfg.train.steps
    bar = tqdm(total=total, initial=state.step, disable=not (cfg.logging.progress and main),
               dynamic_ncols=True, desc="train")
    window: list[StepOutput] = []
    tick = time.perf_counter()
    last_loss: float | None = None
    saved = state.step
    try:
        with (open(run_dir / "metrics.jsonl", "a") if main else contextlib.nullcontext()) \
                as metrics, \
                (open(run_dir / "layers.jsonl", "a") if main else contextlib.nullcontext()) \
                as layers:
            while state.step < total and not (state.evaluator and state.evaluator.stopped):
                watchdog.beat(f"step {state.step}")
                out = train_step(state, next(batches))
                d = out.decision
                if d is not None and d.action != "step":
                    if d.precision:
                        say(f"guard: precision fallback {state.precision} -> {d.precision}")
                        set_precision(state, d.precision)
                    if d.action == "abort":
                        raise GuardAbort(f"aborted at step {state.step}: "
                                         f"{d.incident.diagnosis.get('why', d.incident.kind)}",
                                         d.incident)
                    if d.action == "rollback":
                        bar.n = state.step
                        say(f"guard: rolled back to step {state.step} ({d.incident.kind}); "
                            f"data continues at batch {state.batches_consumed}")
                        batches = batches_from(state.batches_consumed)
                        window, saved = [], min(saved, state.step)
                    continue
                if state.adapter is not None:  # |dW|/|W| per module, clamp past the limit
                    state.adapter.after_step(state)
                window.append(out)
                step = state.step
                bar.update(1)

                if out.layer_grad_norms is not None and main:  # a layer-statistics step
                    layers.write(json.dumps(telemetry.layer_stats(state, out)) + "\n")
                    layers.flush()
                if step % cfg.logging.log_every == 0 or step == total:
                    now = time.perf_counter()
                    row = telemetry.metrics_row(state, window, (now - tick) / len(window),
                                                skipped_at_scan + len(state.bad_images))
                    tick, window = now, []
                    last_loss = row["loss"]
                    if main:
                        metrics.write(json.dumps(row) + "\n")
                        metrics.flush()
                        if tb:
                            tb.scalars(row)
                        bar.set_postfix_str(_status(row), refresh=False)

                if state.evaluator is not None and state.evaluator.due(step):
                    # before the checkpoint, which holds the result; rank 0 measures, every
                    # rank takes its best/patience state, so all stop early together
                    if main:
                        watchdog.beat(f"evaluation at step {step}")
                        state.evaluator.run(state, tb)
                    state.evaluator.load_state_dict(
                        distributed.broadcast_object(state.evaluator.state_dict()))
                if ((cfg.train.sample_every and step % cfg.train.sample_every == 0)
                        or step == total) and main:
                    watchdog.beat(f"sample grid at step {step}")
                    samples.append(write_sample_grid(
                        state, run_dir / "samples" / f"step_{step:08d}.png"))
                    if tb:
                        tb.image(samples[-1], step)
                if ((cfg.train.checkpoint_every and step % cfg.train.checkpoint_every == 0)
                        or step == total) and step != saved:
                    watchdog.beat(f"checkpoint at step {step}")
                    written = save(state, run_dir)
                    if written is not None:
                        last_ckpt, saved = written, step
            if saved != state.step:  # the final checkpoint failed: one more try, then stop
                last_ckpt = save(state, run_dir)
                if last_ckpt is None:
                    raise CheckpointSaveError(f"could not write the final checkpoint at step "
                                              f"{state.step}; see the errors above")
    except GuardAbort as e:
        bar.close()
        if main:
            _finish(state, run_dir, "aborted", reason=str(e), tb=tb)
        raise
    bar.close()
    stopped = state.evaluator.stop_reason() if state.evaluator and state.evaluator.stopped \
        else None
    if stopped:
        say(stopped)
    summary = _finish(state, run_dir, "finished", reason=stopped, tb=tb) if main else None
    return RunResult(run_dir, state.step, last_loss, last_ckpt, samples, resumed_from,
                     time.perf_counter() - t_start,
                     incidents=guard.num_incidents if guard else 0, guard_summary=summary,
                     stopped_early=stopped)


def _status(row: dict) -> str:
    """The progress bar's status line (tqdm adds step, speed and ETA). Non-finite values
    arrive as strings ("nan"): a run without the guard keeps going, and so must its bar."""
    def f(v, spec):
        return format(v, spec) if isinstance(v, (int, float)) else str(v)
    s = (f"loss {f(row['loss'], '.4f')} | gnorm {f(row['grad_norm'], '.3g')}"
         f"->{f(row['grad_norm_clipped'], '.3g')} | lr {row['lr'] * row['lr_factor']:.2e}")
    if row["incidents"]:
        s += (f" | guard {row['incidents']} incident(s), {row['skipped_steps']} skip(s), "
              f"{row['rollbacks']} rollback(s)")
    return s


def _finish(state: TrainState, run_dir: Path, status: str, reason: str | None = None,
            tb: telemetry.TensorBoard | None = None) -> str | None:
    """End of a run (finished or aborted): summary.json, the guard's one-screen summary,
    the health report."""
    summary = state.guard.summary() if state.guard is not None else None
    telemetry.write_summary(run_dir, status, state.step,
                            state.guard.num_incidents if state.guard else 0, summary, reason)
    if summary:
        print(summary)
    if tb:
        tb.close()
    if state.cfg.logging.report:
        try:
            from ..report import write_report
            print(f"report: {write_report(run_dir)}")
        except Exception as e:  # the report must never take a finished run down
            log.warning("could not write report.html: %s: %s", type(e).__name__, e)
    return summary


@torch.no_grad()
def write_sample_grid(state: TrainState, path: Path) -> Path:
    """Sample from the EMA model with the config's sampler and save a PNG grid."""
    s = state.cfg.sample
    model = state.ema.module
    y = None
    if model.num_classes:
        y = torch.arange(s.num, device=state.device) % model.num_classes
    gen = seeding.generator(state.device, s.seed)
    with (state.adapter.sampling_context(state) if state.adapter is not None
          else contextlib.nullcontext()):  # an fp16/bf16 base runs under its autocast
        x = sample(model, state.schedule, state.cfg.diffusion.prediction,
                   (s.num, model.in_channels, model.image_size, model.image_size),
                   sampler=s.sampler, steps=s.steps, y=y, cfg_scale=s.cfg_scale, eta=s.eta,
                   generator=gen, device=state.device)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_grid(x, path, nrow=grid_nrow(s.num, model.num_classes))
    return path
