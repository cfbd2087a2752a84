"""The training loop, readable top to bottom.

    setup (device, data, model, EMA, optimizer, scaler) -> resume -> loop of
    {stop requested?, status, evaluation, samples, checkpoint, done?, step}

The loop order is EDM2's: each pass first reports on the state it has (metrics, evaluation,
sample grid, checkpoint, each at its interval or when the run is done), then stops if done,
then trains one step, so the last step needs no special case. A preemption signal (SIGTERM,
SIGINT, SIGUSR1: trainer/preempt.py) makes the next pass the last one, so an interrupted run
ends the same way: its final checkpoint, summary.json and report. The per-step work is
:func:`train_step`, a plain function over :class:`TrainState`, and what the guard decided is
carried out by :func:`handle_decision`; the tests call exactly these two. Progress is counted
in one unit, optimizer steps; all randomness of a step is derived from (seed, step) for the
whole global batch, so a resumed run replays the same timesteps, noise and label dropout, and
so does a run on another number of processes (torchrun: see docs/distributed.md).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal

import torch
from tqdm import tqdm

from .. import distributed, preflight, quiet, seeding, sharding
from ..adapters import AdapterRun
from ..config import Config, ConfigError, config_diff, validate
from ..data import make_loader, source_of
from ..data.buckets import bucket_layout, write_buckets
from ..diffusion import Draws, diffusion_loss, draw, make_schedule, sample
from ..diffusion.objectives import is_conditional
from ..durations import format_duration
from ..eval.during import make_evaluator
from ..eval.grid import grid_nrow, save_grid
from ..guard import Decision, Guard, GuardAbort
from ..guard.faults import make_injector
from ..guard.update import Update, plain_step
from ..lint import lint
from ..devices import resolve_device
from ..models import build_model, enable_checkpointing
from ..report import write_report
from ..rundir import JSONL_LOGS, RunDir, RunDirError
from . import budget
from . import checkpoint as ckpt
from . import precision as prec
from . import speed, telemetry, validation
from .checkpoint_io import CheckpointIO
from .compilation import compile_failure, compile_forward, training_module
from .ema import EMA
from .hooks import FULL_WEIGHTS, PIXELS
from .optim import build_optimizer, describe_lrs, lr_at, set_lr
from ..data.cache import CachingStopped
from ..integrations.sd import identity as sd_identity
from .preempt import StopSignals, TrainingInterrupted, signal_name
from .resolution import GROW_KEYS, Growth, apply_growth, grow_from_checkpoint
from .state import StepOutput, TrainState

log = logging.getLogger(__name__)

__all__ = ["RunResult", "StepOutput", "TrainState", "attach_guard", "build_state",
           "configure_runtime", "handle_decision", "resolve_device", "run", "save",
           "train_step"]

# Fields a resumed run may change without breaking exactness (bookkeeping and output only).
RESUME_SAFE = ("train.steps", "train.epochs", "train.checkpoint_every",
               "train.checkpoint_every_epochs", "train.keep_checkpoints",
               "train.sample_every", "train.num_threads", "train.device", "data.num_workers",
               "data.path", "data.cache_dir", "train.on_save_error", "train.max_time",
               # where the base lies: its identity (the files' sha256) is what is checked
               # (integrations/sd/identity.py); a moved base is the same base
               "model.pretrained", "model.single_file_config",
               "sample.", "logging.",
               "faults", "eval.",
               "train.dist_timeout", "train.watchdog_timeout", "guard.rank_check_every",
               "guard.probe_every",  # the probes read the model (no grad, no RNG draw)
               # speed only: the same math, rounded differently at most (docs/speed.md)
               "optim.fused", "train.channels_last", "train.tf32", "data.pin_memory",
               # the same math in other kernels: a resumed run matches to rounding
               "train.compile",
               # the same math over shards (another reduction order, like a new world size)
               "train.parallel", "train.fsdp_offload")


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
    interrupted: str | None = None  # the signal that stopped the run (TrainingInterrupted)
    time_budget: str | None = None  # why the time budget (train.max_time) ended it, if it did
    train_seconds: float = 0.0  # training time used, all invocations (trainer/budget.py)


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written (disk full, permission denied); exit code 4."""


class TrainingDiverged(GuardAbort):
    """The weights went non-finite and nothing recovered them (the guard is off): the run
    stops instead of writing, or training on, a NaN model. Exit code 3."""


# --------------------------------------------------------------------------- one step


def _micro_loss(state: TrainState, xm: torch.Tensor, ym: torch.Tensor | None,
                draws: Draws, step: int, weight: float, local: bool = False):
    """Forward pass of one micro-batch with its slice of the step's draws, so calling it
    again replays it exactly (the guard's provenance does). ``local`` runs the plain
    model: a replay or probe on one rank must not enter DDP's collectives, and its hooks
    must fire (not a compiled graph's: trainer/compilation.py)."""
    faults = state.faults
    faults.micro_batch(step, xm.shape[0])
    with prec.autocast(state.precision, state.device), \
            faults.forward(step, state.model) as hooked:
        model = training_module(state, local=local, hooked=bool(hooked))
        out = diffusion_loss(model, xm, ym, state.schedule, state.cfg.diffusion, draws=draws)
    loss, per_sample = out.loss.float() * weight, out.per_sample.detach().float()
    return faults.loss(step, loss), faults.loss(step, per_sample), out.t


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
    accumulation, autocast, the fp16 grad scaler, then the update (clipping, AdamW, EMA).

    With a guard, the guard inspects the step after the backward pass and applies, skips or
    rolls back the update (see :class:`Guard`); an out-of-memory error halves the micro-batch
    and retries. Without one, the same :class:`~steadydiff.guard.update.Update` applies it
    unchecked. Randomness comes from :func:`step_draws`, so the same batch at the same step
    reproduces exactly. Under torchrun ``batch`` is this rank's slice of the global batch and
    DDP averages the gradients (one all-reduce per step, in the last micro-batch).
    """
    cfg, model, faults, guard = state.cfg, state.model, state.faults, state.guard
    step = state.step
    faults.kill(step, "before_step")
    faults.before_step(step, model)
    x = batch[0].to(state.device, non_blocking=True, memory_format=speed.memory_format(cfg))
    y = batch[1].to(state.device, non_blocking=True)  # pinned (data.pin_memory): async
    idx = batch[2] if len(batch) > 2 else None  # dataset indices (CPU)
    if len(batch) > 3 and batch[3].any():  # images replaced because they failed to load (CPU)
        state.bad_images.update(batch[2][batch[3]].tolist())
    y = y if is_conditional(model) else None  # class labels, or text contexts (N, L, D)
    if guard is not None:  # a window opens: the injector's state is part of its mark
        guard.begin_step(mark=faults.mark)
    x = faults.batch(step, x, idx)
    lr = faults.lr(step, lr_at(step, cfg.optim, cfg.train.steps, budget.progress(state)))
    set_lr(state.optimizer, lr)

    draws, total = step_draws(state, step, x)
    if state.sample_weights is not None and idx is not None:  # prior preservation
        draws.weight = state.sample_weights[idx].to(state.device)
    while True:  # retried only after an out-of-memory backoff
        try:
            xs, ys, ds, weights, per_sample, t_all = _forward_backward(state, x, y, draws,
                                                                       total, step)
            break
        except torch.OutOfMemoryError as e:
            if guard is None or state.world_size > 1:
                # under DDP the other ranks already wait in the gradient all-reduce: a local
                # backoff cannot rejoin them. The rank fails, torchrun stops the group, and
                # the rerun resumes (with a smaller train.batch_size or more grad_accum).
                raise
            micro = -(-x.shape[0] // state.grad_accum)  # torch.chunk's micro-batch size
            new = guard.handle_oom(micro, e)
            if new is None:
                raise GuardAbort(f"out of memory at step {step} with a micro-batch of "
                                 f"{micro}: {e}", guard.incidents[-1]) from None
            state.grad_accum = -(-x.shape[0] // new)
    faults.grads(step, model)
    faults.kill(step, "in_step")
    every = cfg.logging.layer_stats_every
    layer_grads = None
    if every and (step + 1) % every == 0:  # per-layer gradient norms, before clipping
        grads = [p.grad if p.grad is not None else torch.zeros_like(p)
                 for p in model.parameters() if p.requires_grad]
        layer_grads = sharding.norms(grads)  # FSDP: over every rank's shards
        if state.scaler:
            layer_grads = layer_grads / state.scaler.get_scale()

    def probe_forward():
        return _micro_loss(state, xs[0], ys[0], ds[0], step, 1.0, local=True)

    def after_update() -> None:
        faults.params(step, model)

    if guard is not None:
        def replay(i: int) -> torch.Tensor:
            loss_i = _micro_loss(state, xs[i], ys[i], ds[i], step, weights[i], local=True)[0]
            return state.scaler.scale(loss_i) if state.scaler else loss_i

        def rerun(keep: torch.Tensor, n_kept: int):
            """The step again (same data, t and noise), on the samples ``keep`` selects."""
            nonlocal per_sample, t_all
            ym = y[keep] if y is not None else None
            *_, per_sample, t_all = _forward_backward(state, x[keep], ym, draws[keep],
                                                      n_kept, step)
            faults.grads(step, model)  # as after the first backward: the same step again
            return per_sample.mean(), per_sample, t_all

        d = guard.step(per_sample.mean(), t=t_all, per_sample_loss=per_sample, inputs=x,
                       indices=idx, replay=replay, num_micro=len(xs), rerun=rerun,
                       after_backward=lambda: faults.grads(step, model),
                       after_update=after_update, probe_forward=probe_forward)
        nan = float("nan")
        gnorm = torch.tensor(nan if d.grad_norm is None else d.grad_norm)
        clipped = torch.tensor(nan if d.grad_norm_clipped is None else d.grad_norm_clipped)
    else:  # the same update, no detection: what every other trainer does
        gnorm, clipped = plain_step(state.update, state, after_update=after_update)
        d = Decision("step", state.step, state.batches_consumed)
    faults.end_step(step)
    if d.action == "rollback":
        faults.rollback()
    return StepOutput(per_sample.mean(), gnorm, clipped, per_sample, t_all, lr, d,
                      layer_grad_norms=layer_grads,
                      probe_forward=probe_forward if layer_grads is not None else None)


def _forward_backward(state: TrainState, x: torch.Tensor, y: torch.Tensor | None, draws: Draws,
                      total: int, step: int):
    """The micro-batches' forward and backward passes (gradient accumulation; DDP
    all-reduces once, in the last one). ``total``: the samples of the global batch, each
    micro-batch's loss weighted by its share. Returns the micro-batches, their draws and
    weights, and the (B,) per-sample losses and timesteps."""
    n = state.grad_accum
    xs, ys = x.chunk(n), (y.chunk(n) if y is not None else [None] * len(x.chunk(n)))
    offsets = [0]
    for xm in xs:
        offsets.append(offsets[-1] + xm.shape[0])
    ds = [draws[a:b] for a, b in zip(offsets, offsets[1:])]
    # each micro-batch's share of the global mean; DDP averages over ranks, hence x world
    weights = [xm.shape[0] * state.world_size / total for xm in xs]
    losses, ts = [], []
    for micro, (xm, ym) in enumerate(zip(xs, ys)):
        sync = (state.ddp.no_sync() if state.ddp is not None and micro < len(xs) - 1
                else contextlib.nullcontext())
        with sync:
            loss, per_sample, t = _micro_loss(state, xm, ym, ds[micro], step, weights[micro])
            (state.scaler.scale(loss) if state.scaler else loss).backward()
        losses.append(per_sample)
        ts.append(t)
    return xs, ys, ds, weights, torch.cat(losses), torch.cat(ts)


Handled = Literal["stepped", "skipped", "rolled_back"]


def handle_decision(state: TrainState, d: Decision,
                    say: Callable[[str], None] = print) -> Handled:
    """Carry out what the loop must after the guard's decision ``d`` (the guard already
    changed the state: counters, weights, precision).

    Returns ``stepped`` (an update was applied: the weights' after-update check ran),
    ``skipped``, or ``rolled_back`` (the data stream must reopen at
    ``state.batches_consumed``).

    Raises:
        GuardAbort: the guard gave up.
    """
    if d.precision:
        say(f"guard: precision fallback -> {d.precision}")
        state.weights.on_precision(state)  # a frozen fp16 base follows
    if d.action == "abort":
        inc = d.incident
        raise GuardAbort(f"aborted at step {state.step}: "
                         f"{inc.diagnosis.get('why', inc.kind) if inc else 'unknown'}", inc)
    if d.action == "rollback":
        say(f"guard: rolled back to step {state.step} ({d.incident.kind}); "
            f"data continues at batch {state.batches_consumed}")
        return "rolled_back"
    if d.action == "skip":
        return "skipped"
    if not d.pending:  # a speculative step's: after the guard judged it (see _run)
        state.weights.after_update(state)  # an adapter's |dW|/|W| clamp
    return "stepped"


# --------------------------------------------------------------------------- setup


def configure_runtime(cfg: Config, device: torch.device,
                      ctx: distributed.DistContext = distributed.DistContext()) -> None:
    """Threads, seeds, the deterministic mode and TF32 (``train.tf32``, CUDA), before
    anything random happens."""
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
    if device.type == "cuda":
        speed.set_tf32(cfg.train.tf32)
    seeding.seed_everything(cfg.train.seed)


def build_state(cfg: Config, num_classes_in_data: int, device: torch.device,
                ctx: distributed.DistContext = distributed.DistContext()) -> TrainState:
    """Model, EMA, optimizer, scaler and schedule for ``cfg`` (fresh, not resumed; not yet
    wrapped in DDP). ``cfg``'s ``auto`` speed settings are resolved on ``device`` first
    (silently: :func:`run` has already resolved and printed them)."""
    cfg, _ = speed.resolve(cfg, device)
    preflight.check_classes(cfg, num_classes_in_data)
    media = PIXELS
    if preflight.text_model(cfg):
        # a Stable Diffusion folder (LoRA or full), or ours over a text encoder: the [sd]
        # extra, imported only here (docs/sd.md)
        from ..integrations.sd import setup as sd_setup

        model, weights, media = sd_setup.build(cfg, device)
    else:
        model = build_model(cfg.model, image_size=cfg.data.image_size,
                            channels=cfg.data.channels).to(device)
        # frozen base + trainable adapter (docs/adapters.md), or the whole model
        weights = AdapterRun.prepare(cfg, model) if cfg.adapter.kind != "none" \
            else FULL_WEIGHTS
    checkpointing = None
    if cfg.train.gradient_checkpointing:  # before the EMA copy: its blocks are set too
        checkpointing = enable_checkpointing(model)
    if cfg.train.channels_last:  # conv weights NHWC (4-D tensors only), before EMA copies
        model = model.to(memory_format=torch.channels_last)
    fsdp = cfg.train.parallel == "fsdp"
    meta = sharding.on_meta(model)  # built without storage: read shard by shard below
    if fsdp and ctx.enabled and not meta:  # every rank shards rank 0's weights
        distributed.broadcast_tensors(list(model.parameters()) + list(model.buffers()))
    ema = EMA.from_config(model, cfg.train)
    sharded = None
    if fsdp:  # before the optimizer: it holds the sharded parameters
        t = cfg.train
        units = sharding.shard(model, device, precision=t.precision, offload=t.fsdp_offload)
        sharding.shard(ema.module, device, precision=t.precision, offload=t.fsdp_offload)
        sharded = (f"FSDP2 over {ctx.world_size} rank(s), {units} blocks + the root"
                   + (f", {t.precision} gathered weights" if t.precision == "bf16" else "")
                   + (", shards offloaded to CPU memory" if t.fsdp_offload else ""))
        if meta:  # each rank reads its own shards (no rank held the whole model)
            whole = sum(p.numel() * 4 for p in model.parameters())
            read = weights.materialize(model, device)
            weights.materialize(ema.module, device)
            sharded += (f", built on the meta device: this rank read {read / 2**20:.2f} of "
                        f"the {whole / 2**20:.2f} MiB of weights (and as much for the EMA)")
    elif meta:
        raise RuntimeError("a model built on the meta device is materialized by FSDP "
                           "sharding (train.parallel=fsdp)")
    optimizer = build_optimizer(model, cfg.optim)
    return TrainState(
        cfg=cfg, model=model, ema=ema, weights=weights, optimizer=optimizer,
        scaler=prec.make_scaler(cfg.train.precision, device),
        schedule=make_schedule(cfg.diffusion, cfg.data.image_size), device=device,
        precision=cfg.train.precision, grad_accum=cfg.train.grad_accum,
        update=Update(model, optimizer, clip_mode=cfg.optim.clip_mode,
                      clip=cfg.optim.grad_clip, ema=ema),
        rank=ctx.rank, world_size=ctx.world_size,
        faults=make_injector(cfg.faults, ctx.rank), media=media, checkpointing=checkpointing,
        sharded=sharded)


def attach_guard(state: TrainState, run_dir: Path | None,
                 data: torch.utils.data.Dataset | None = None, *,
                 defer: bool = False) -> Guard | None:
    """Build the guard over ``state`` (after any resume: its first snapshot is this state).
    The guard reads and advances ``state``'s counters, precision and scaler, and applies the
    state's own update; ``data`` names the files of the samples it implicates. ``defer``:
    the caller flushes the guard when it is due and redoes a window after a rewind, as
    :func:`run` does (``guard.check_every``); a caller of :func:`train_step` that does not
    gets a per-step check."""
    cfg = state.cfg
    if not cfg.guard.enabled:
        return None
    state.guard = Guard(state.model, state.optimizer, config=cfg.guard, run_dir=run_dir,
                        num_timesteps=cfg.diffusion.timesteps, progress=state,
                        device=state.device, update=state.update,
                        sample_source=(lambda i: source_of(data, i)) if data is not None
                        else None, defer=defer)
    state.guard.frozen = getattr(state.weights, "frozen", None)  # a frozen base, watched
    return state.guard


# --------------------------------------------------------------------------- checkpoints


def save(state: TrainState, run: RunDir | Path) -> Path | None:
    """Write a checkpoint into the run directory ``run``. On disk full / permission denied the previous checkpoint stays
    intact; ``train.on_save_error`` decides between retrying at the next checkpoint
    (returns None) and stopping (raises :class:`CheckpointSaveError`).

    Under torchrun rank 0 writes (the replicas are identical) and tells every rank the
    outcome, so all of them go on, or all raise the same error, together; under FSDP every
    rank writes its own shards and the outcome is agreed in the writer."""
    run = run if isinstance(run, RunDir) else RunDir(run)
    if state.world_size == 1 or state.sharded:  # FSDP: every rank writes its shards, and
        return _guard_knows(state, _save(state, run))  # every rank gets the same outcome
    outcome: tuple[str, Any] | None = None
    if state.rank == 0:
        try:
            outcome = ("ok", _save(state, run))
        except (GuardAbort, CheckpointSaveError) as e:  # diverged, base modified, disk
            outcome = ("error", e)
    kind, value = distributed.broadcast_object(outcome)
    if kind == "error":
        raise value
    return _guard_knows(state, value)


def _guard_knows(state: TrainState, path: Path | None) -> Path | None:
    """A verified checkpoint was written at this step (every rank calls this): the guard's
    ring gets a snapshot of it, so a later rollback restores this state, or a newer one,
    and never throws away the checkpoint's progress for an older snapshot."""
    guard = state.guard
    if path is not None and guard is not None:
        newest = guard.ring.newest()
        if newest is None or newest.step < state.step:
            guard.snapshot()
    return path


def _save(state: TrainState, run: RunDir) -> Path | None:
    try:
        path = CheckpointIO(state).save(run.checkpoints, keep=state.cfg.train.keep_checkpoints)
        # verified finite: now the formats other tools load (a LoRA for diffusers); the
        # final one (a full fine-tune's multi-GB folder) at the last step
        state.weights.export(state, run.root,
                             state.step >= state.cfg.train.steps or budget.spent(state))
        return path
    except ckpt.CheckpointError as e:  # the only cause: non-finite weights or EMA
        prev = run.latest_good()
        raise TrainingDiverged(
            f"{e}; the model diverged and the guard is "
            f"{'on but could not recover it' if state.guard else 'off (guard.enabled=false)'}"
            f"; the last good checkpoint is {prev or 'none'}") from None
    except Exception as e:  # noqa: BLE001 - only storage failures are handled here
        from ..files import failure_reason, write_failure

        # a full disk reaches us as OSError, as safetensors' SafetensorError ("IoError")
        # or as torch's "[enforce fail ...] file write failed" RuntimeError
        if write_failure(e) is None:
            raise
        prev = run.latest_good()
        msg = (f"could not write checkpoint at step {state.step}: "
               f"{failure_reason(run.checkpoints, e)} ({type(e).__name__}: "
               f"{str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}); "
               f"the previous checkpoint ({prev or 'none'}) is intact")
        if state.cfg.train.on_save_error == "stop":
            raise CheckpointSaveError(msg + " (train.on_save_error=stop)") from None
        log.error("%s; training continues and retries at the next checkpoint "
                  "(train.on_save_error=retry)", msg)
        print(f"warning: {msg}; retrying at the next checkpoint")
        return None


def _cause_not_lr(inc: Any) -> bool:
    """An abort whose cause the guard named and that no LR change fixes (a corrupt or
    modified frozen base): its resume advice keeps optim.lr."""
    return inc is not None and (inc.kind in ("base_corrupt", "adapter_base_modified")
                                or (inc.diagnosis or {}).get("cause") == "base")


def _healthy_lr(state: TrainState) -> tuple[float, int] | None:
    """(the LR applied in the last verified window, its step): the peak LR of the
    optimizer's groups in the guard's newest verified snapshot; None without one."""
    guard = state.guard
    snap = guard.ring.newest() if guard is not None else None
    if snap is None:
        return None
    lrs = [g.get("lr") for g in snap.optimizer.get("param_groups", [])
           if isinstance(g.get("lr"), (int, float))]
    return (float(max(lrs)), snap.step) if lrs else None


def abort_point(state: TrainState, run: RunDir, reason: str,
                say: Callable[[str], None] = print, write: bool = True,
                lr_cause: bool = True) -> dict[str, Any]:
    """What an aborted run leaves to resume from (rank 0; the run is over).

    The guard's newest verified snapshot (weights and EMA checked finite when it was taken)
    is restored into ``state`` (model, EMA, optimizer, scaler, step, data position) and
    written through :class:`CheckpointIO` as a normal, verified checkpoint marked
    ``"abort": {step, reason}`` in its state.json, when it is newer than every checkpoint
    already on disk: nothing is overwritten, and none rotated away. Its guard state starts a
    fresh recovery budget (no skips or rollbacks counted, LR factor 1): the suggested
    ``optim.lr`` already carries the backoff.

    The suggestion: ``optim.lr`` times the guard's LR factor at the abort when it was backing
    off, else half of it; at most the LR cap an ``lr_too_high`` rollback set. Rerunning the
    command resumes from the newest intact checkpoint
    (this one when written, else the newest already there).

    Args:
        write: False only suggests (the weights' own check refused the state).
        lr_cause: False when the guard named a cause that is not the LR (a corrupt base):
            the suggestion keeps ``optim.lr``.

    Returns:
        ``{step, reason, checkpoint (None when none was written), checkpoint_step,
        lr, lr_factor, lr_why, resume}`` (``resume``: the command), for summary.json.
    """
    cfg, guard = state.cfg, state.guard
    base = cfg.optim.lr
    backoff = guard is not None and guard.lr_factor < 1.0
    cap = guard.lr_cap if guard is not None else None
    factor = guard.lr_factor if backoff else (1.0 if cap is not None else 0.5)
    lr, why = base * factor, (f"optim.lr {base:g} x {factor:g}, the guard's LR backoff at the "
                              "abort" if backoff else f"optim.lr {base:g} x 0.5 (the guard "
                              "was not backing the LR off: half)")
    if cap is not None and cap < lr:  # lr_too_high capped the LR for good
        lr, factor, why = cap, cap / base, f"the guard's LR cap {cap:.3g} (lr_too_high)"
    healthy = _healthy_lr(state)
    if lr_cause and healthy is not None and healthy[0] < lr * 0.999:
        # the LR was rising (warm-up, a restart) when it broke: the LR of the last verified
        # (healthy) window has been shown safe, the failing one times a factor has not
        why = (f"the LR of the last healthy window (step {healthy[1]}, verified), "
               f"{healthy[0]:.3g}, below the backoff's {lr:.3g}")
        lr, factor = healthy[0], healthy[0] / base
    if not lr_cause:  # the guard named a cause no LR change fixes: keep optim.lr
        lr, factor, why = base, 1.0, "optim.lr unchanged: the cause is not the LR"
    lr = float(f"{lr:.3g}")
    info: dict[str, Any] = {
        "step": state.step, "reason": reason, "checkpoint": None, "checkpoint_step": None,
        "lr": lr, "lr_factor": factor, "lr_why": why,
        "resume": " ".join(["steadydiff", "train", shlex.quote(str(run.config)), "--out",
                            shlex.quote(str(run.root)), "--set", f"optim.lr={lr:g}",
                            "--allow-config-change"])}
    on_disk = run.list_checkpoints()  # newest first, verified or not: never overwritten
    newest = ckpt.step_of(on_disk[0]) if on_disk else None
    snap = guard.ring.newest() if guard is not None and write else None
    if snap is not None and (newest is None or snap.step > newest):
        guard.restore_verified()
        guard.reset_budget()  # the suggested optim.lr carries the backoff
        store_posthoc(state, run)  # as after a rollback: the restored step's snapshot
        complete = [c for c in on_disk if (c / "manifest.json").is_file()]
        try:
            path = CheckpointIO(state).save(run.checkpoints, keep=len(complete) + 1,
                                            abort={"step": info["step"], "reason": reason})
            info["checkpoint"], info["checkpoint_step"] = str(path), snap.step
            say(f"abort point: wrote {path}, the guard's last verified state (step "
                f"{snap.step}); rerunning resumes from it")
        except (ckpt.CheckpointError, OSError, GuardAbort) as err:
            say(f"warning: could not write the abort point (step {snap.step}): {err}")
    elif snap is not None:
        say(f"abort point: the newest checkpoint ({on_disk[0].name}) is newer than the "
            f"guard's last verified state (step {snap.step}); nothing new written")
        info["checkpoint_step"] = newest
    elif newest is not None:  # no verified state to write: the newest on disk resumes
        info["checkpoint_step"] = newest
    return info


def store_posthoc(state: TrainState, run: RunDir, force: bool = False) -> Path | None:
    """Store the post-hoc EMA profiles' snapshot of this step in ``RUN/posthoc/`` when one is
    due (every ``train.ema_posthoc_every`` steps, or ``force``: the run's last step), listing
    it in the profiles' state (rank 0). A disk error is reported; the snapshot is then not
    listed, so never used, and training goes on."""
    ph, every = state.ema.posthoc, state.cfg.train.ema_posthoc_every
    if ph is None or state.step == 0 or not (force or state.step % every == 0):
        return None
    try:
        return ph.store(run.posthoc, state.step)
    except OSError as err:
        log.error("could not store the post-hoc EMA snapshot at step %d: %s", state.step, err)
        print(f"warning: could not store the post-hoc EMA snapshot at step {state.step}: {err}")
        return None


def save_best(state: TrainState, run: RunDir) -> Path | None:
    """The best evaluation's checkpoint (``checkpoints/best``, one kept): the same writer as
    every other checkpoint. A failure is reported and never takes the run down."""
    try:
        path = CheckpointIO(state).save(run.best, keep=1)
        ev = state.evaluator  # eval/during.py's: its config and early-stopping record
        state.weights.mark_best(state, run.root, {
            "metric": getattr(getattr(ev, "ecfg", None), "metric", None),
            "value": getattr(getattr(ev, "stop", None), "best", None)})
        return path
    except (ckpt.CheckpointError, OSError) as err:
        log.warning("could not write the best checkpoint at step %d: %s", state.step, err)
        print(f"warning: could not write the best checkpoint at step {state.step}: {err}")
        return None


def check_resume_config(saved: Config, cfg: Config, allow_change: bool,
                        grow: bool = False) -> list[str]:
    """Report config changes on resume; refuse those that break exactness unless allowed.

    Returns the report's lines: the changes that alter training first, then the
    bookkeeping ones (logging, sample cadence, ...: :data:`RESUME_SAFE`), each group
    under its own heading so the refusal names only what is really at stake. With ``grow``
    (``--grow-resolution``) a larger ``data.image_size`` and the fields that go with it
    (:data:`~steadydiff.trainer.resolution.GROW_KEYS`) are accepted, under a heading of
    their own; without it a changed ``data.image_size`` is refused like any other change,
    and the message names the flag.
    """
    changes = config_diff(saved, cfg)
    notes = {k: "" for k, _, _ in changes}
    grown = grow and saved.data.image_size != cfg.data.image_size
    growth = {k for k in notes if grown and k in GROW_KEYS}
    unsafe = {k for k in notes if not k.startswith(RESUME_SAFE) and k not in growth}
    # the cosine schedule (and an unfinished warmup) is a function of train.steps, or of
    # train.max_time when both runs have a time budget (trainer/budget.py)
    timed = saved.train.max_time is not None and cfg.train.max_time is not None
    if "train.steps" in notes and (
            cfg.optim.schedule != "constant" and not timed
            or cfg.optim.warmup_steps > min(saved.train.steps, cfg.train.steps)):
        unsafe.add("train.steps")
        notes["train.steps"] = "  (changes the LR schedule of the remaining steps)"
    if "train.max_time" in notes and cfg.optim.schedule != "constant":
        unsafe.add("train.max_time")
        notes["train.max_time"] = "  (changes the LR schedule of the remaining time)"
    alter = [f"    {k}: {a!r} -> {b!r}{notes[k]}" for k, a, b in changes if k in unsafe]
    grew = [f"    {k}: {a!r} -> {b!r}" for k, a, b in changes if k in growth]
    keep = [f"    {k}: {a!r} -> {b!r}" for k, a, b in changes
            if k not in unsafe and k not in growth]
    lines = ((["  alter training:"] + alter if alter else [])
             + (["  resolution (--grow-resolution):"] + grew if grew else [])
             + (["  bookkeeping (safe to change):"] + keep if keep else []))
    if alter and not allow_change:
        size = ("data.image_size" in unsafe and not grow
                and cfg.data.image_size > saved.data.image_size)
        raise ConfigError(
            "the config differs from the checkpoint's in fields that change the training "
            "itself:\n" + "\n".join(alter) + "\nresume with the original config, use a new "
            "--out directory, or pass --allow-config-change to accept the changes"
            + ("\nto continue this run at the larger data.image_size on purpose, pass "
               "--grow-resolution (weights carry over, the guard's statistics restart; "
               "docs/resolution.md)" if size else "")
            + ("\n(also changed, safe on resume:\n" + "\n".join(keep) + ")" if keep else ""))
    return lines



# --------------------------------------------------------------------------- the loop


def run(cfg: Config, *, run_dir: str | Path, dataset: torch.utils.data.Dataset | None = None,
        resume: str | Path | bool = True, allow_config_change: bool = False,
        restart: bool = False, grow_resolution: bool = False) -> RunResult:
    """Train ``cfg`` into ``run_dir``; under torchrun, one rank of a DDP group.

    Args:
        cfg: a resolved config.
        run_dir: output directory (config.yaml, metrics.jsonl, samples/, checkpoints/).
        dataset: optional torch Dataset of images or (image, label) pairs, replacing
            ``cfg.data``'s dataset.
        resume: True resumes from the newest intact checkpoint in ``run_dir`` if there is
            one (rerunning the same command continues the run; corrupt checkpoints are
            moved to ``checkpoints/corrupt/``, and if none verifies the run refuses); a path
            resumes from that checkpoint; False starts fresh (refusing to overwrite existing
            checkpoints).
        allow_config_change: accept config changes on resume that break exactness.
        restart: start over deliberately: the run's existing files are moved to
            ``run_dir/previous-<time>/`` (nothing is deleted) and training starts at step 0.
        grow_resolution: continue a checkpoint trained at a smaller ``data.image_size`` at
            ``cfg.data.image_size`` (progressive resolution, docs/resolution.md): weights,
            EMA and optimizer carry over, the guard's statistics restart. Rerunning with it
            after the change resumes normally.

    The run directory is checked and locked for the life of the run (rank 0 holds the lock):
    a non-empty folder that is not a run, or a run another live process trains into, is a
    :class:`~steadydiff.rundir.RunDirError` (docs/RELIABILITY.md, "Run-directory safety").

    Returns:
        A :class:`RunResult` (on every rank; only rank 0 wrote files).

    Raises:
        RunDirError: the run directory cannot be trained into (see above).
        distributed.DistributedError: a collective failed (another rank died or hung).
        TrainingInterrupted: SIGTERM, SIGINT or SIGUSR1 arrived; the run stopped after the
            current step with a verified checkpoint (every rank at the same step). The
            handlers are installed only while this runs (main thread only), then restored.
    """
    if restart and resume not in (True, False):
        raise ConfigError("restart (--restart) starts over and resume (--resume PATH) "
                          "continues a checkpoint: choose one")
    if grow_resolution and (restart or resume is False):
        raise ConfigError("--grow-resolution continues a checkpoint at a larger size; "
                          f"{'--restart' if restart else '--no-resume'} starts over: choose one")
    if dataset is None:  # the folder of data.path is what is read
        check_out_outside_data(cfg, run_dir)
    owned = not (torch.distributed.is_available() and torch.distributed.is_initialized())
    ctx, device = distributed.setup(cfg.train.device, cfg.train.dist_timeout,
                                    group_of_one=cfg.train.parallel == "fsdp")
    try:
        with distributed.Watchdog(cfg.train.watchdog_timeout if ctx.enabled else 0,
                                  ctx.rank) as watchdog, \
                StopSignals(ctx.rank if ctx.enabled else None) as signals, \
                _claim(RunDir(run_dir), ctx.is_main):
            return _run(cfg, ctx, device, watchdog, signals, Path(run_dir), dataset, resume,
                        allow_config_change, restart, grow_resolution)
    except torch.distributed.DistError as e:
        raise distributed.DistributedError(distributed.describe_failure(e, ctx)) from e
    except RuntimeError as e:
        if ctx.enabled and _is_collective_failure(e):
            raise distributed.DistributedError(distributed.describe_failure(e, ctx)) from e
        if (failed := compile_failure(e, cfg.train)) is not None:  # say so, and the way out
            raise failed from e
        raise
    finally:
        quiet.close()  # this run's third_party.log: a later run in the process opens its own
        if owned:
            distributed.teardown()


def _is_collective_failure(e: RuntimeError) -> bool:
    """gloo reports a timed-out or broken peer as a plain RuntimeError."""
    text = str(e).lower()
    return any(k in text for k in ("gloo", "nccl", "connection closed by peer",
                                   "timed out", "connection reset"))


def check_out_outside_data(cfg: Config, run_dir: str | Path) -> None:
    """Refuse a run directory inside the image folder it trains on: its sample grids and
    report images would be read as training data by the next run (or a rescan). A hidden
    folder inside it (``DATA/.runs/x``) is fine: the folder's scan skips hidden entries.

    Raises:
        ConfigError: naming both paths and what would be valid.
    """
    if cfg.data.dataset != "folder" or not cfg.data.path:
        return
    data = os.path.realpath(Path(cfg.data.path).expanduser())
    out = os.path.realpath(Path(run_dir).expanduser())
    if out != data and not out.startswith(data.rstrip(os.sep) + os.sep):
        return
    rel = Path(os.path.relpath(out, data)).parts
    if any(part.startswith(".") and part not in (".", "..") for part in rel):
        return
    raise ConfigError(f"--out {run_dir} is inside data.path {cfg.data.path} (the image "
                      f"folder trained on): the run's sample images would become training "
                      f"data. Choose an --out outside {data} (or a hidden folder in it, "
                      f"e.g. {Path(data) / '.runs' / Path(out).name})")


@contextlib.contextmanager
def _claim(run: RunDir, main: bool):
    """Hold the run directory for the life of the run: rank 0 checks that it may be trained
    into and locks it; every rank gets the outcome, so all go on or all raise the same
    error."""
    lock, outcome = None, None
    if main:
        try:
            run.check_target()
            lock, outcome = run.lock()
            run.mark()  # a run from now on: only a marked folder is ever written into
        except RunDirError as e:
            outcome = e
        except OSError as e:  # e.g. a read-only parent: every rank must hear it, not hang
            outcome = RunDirError(f"cannot create or lock {run.lock_file}: {e}")
    outcome = distributed.broadcast_object(outcome)
    if isinstance(outcome, Exception):
        raise outcome
    if outcome and main:
        print(outcome)  # a dead process's lock was taken over
    try:
        yield
    finally:
        if lock is not None:
            lock.release()


def _resume_source(run: RunDir, resume: str | Path | bool, main: bool,
                   restart: bool = False) -> Path | None:
    """The checkpoint to resume from (rank 0 picks it, every rank reads that one): the
    newest intact one for ``resume=True`` (corrupt ones moved aside; none intact refuses),
    the given one, or none for a fresh run (which refuses a directory that already holds
    checkpoints) or a ``restart`` (the old run's files moved aside first)."""
    source: Path | Exception | None = None
    if main:
        try:
            if restart:
                if (old := run.restart()) is not None:
                    print(f"restart: the earlier run's files were moved to {old}")
            elif resume is True:
                source = run.resume_point()
            elif resume:
                source = ckpt.resolve_checkpoint(resume)
            elif run.list_checkpoints():
                source = ConfigError(f"{run.root} already holds checkpoints; resume it, "
                                     "start over with --restart (its files are kept in "
                                     "previous-<time>/), or choose a new --out directory")
        except (RunDirError, ckpt.CheckpointError) as e:
            source = e
    source = distributed.broadcast_object(source)
    if isinstance(source, Exception):
        raise source
    return source


def _resume(state: TrainState, source: Path, allow_config_change: bool,
            say: Callable[[str], None],
            grow: bool = False) -> tuple[ckpt.Checkpoint, Growth | None]:
    """Restore ``state`` from the checkpoint at ``source``; say what changed. Returns the
    checkpoint and, with ``grow`` and a larger ``data.image_size``, the resolution change
    still to carry out (:func:`~steadydiff.trainer.resolution.apply_growth`)."""
    cfg, world = state.cfg, state.world_size
    # a sharded checkpoint's tensors go straight into this run's state (CheckpointIO)
    c = ckpt.load_checkpoint(source, state.device, consolidate=False)
    if "posthoc_ema" in c.state:  # its EMA is a reconstruction: resuming would average on it
        raise ckpt.CheckpointError(
            f"{source} is a post-hoc EMA checkpoint (`steadydiff ema`), for sampling and "
            "evaluation; resume from the run's checkpoints/step_* (rerun without --resume)")
    saved_cfg = validate(c.state["config"], f"{source}/state.json config")
    # a finished run trains no further step: its config changes cannot break anything
    budget_s = cfg.train.max_time
    done = c.step >= cfg.train.steps or (
        budget_s is not None and float(c.state.get("train_seconds", 0.0)) >= budget_s)
    changes = check_resume_config(saved_cfg, cfg, allow_config_change or done, grow=grow)
    old = int(c.state.get("image_size") or saved_cfg.data.image_size)
    growth = Growth(old, cfg.data.image_size, c.step) if grow and old != cfg.data.image_size \
        else None
    CheckpointIO(state).restore(c)
    say(f"resumed from {source} at step {state.step}"
        + (f", {format_duration(state.train_seconds)} of the time budget "
           f"{format_duration(budget_s)} used" if budget_s is not None else "")
        + (" (the run is already complete)" if done else "")
        + ("; config changes:\n" + "\n".join(changes) if changes else ""))
    saved_world = int(c.state.get("world_size", 1))
    if saved_world != world:
        say(f"note: the checkpoint was written by {saved_world} process(es), this run has "
            f"{world}: the global batch, the sample order and the noise are the same (batches "
            "are split by position), but the gradient reduction order differs, so the result "
            "matches an uninterrupted run to rounding, not bit for bit")
    return c, growth


def _run(cfg: Config, ctx: distributed.DistContext, device: torch.device,
         watchdog: distributed.Watchdog, signals: StopSignals, run_dir: Path, dataset, resume,
         allow_config_change: bool, restart: bool = False, grow: bool = False) -> RunResult:
    t_start = time.perf_counter()
    main = ctx.is_main
    say = print if main else (lambda *a, **k: None)  # rank 0 speaks and writes
    run = RunDir(run_dir)
    if main:  # the third-party lines kept off the console go to RUN/third_party.log
        quiet.log_to(run.root)
    if cfg.model.pretrained:  # recorded absolute: a later command from elsewhere finds it
        cfg = sd_identity.absolute(cfg)
    cfg, notes = preflight.resolve(cfg)  # a model family's folder decides its recipe
    for note in notes:
        say(f"model: {note}")
    cfg, notes = preflight.resolve_data(cfg)  # a kohya dataset TOML's resolution, batch
    for note in notes:
        say(f"data: {note}")
    if cfg.model.pretrained:  # once: defaults unlike kohya's, a size below the native one
        from ..integrations.sd.advice import start_notes

        for note in start_notes(cfg):
            say(note)
    cfg, chosen = speed.resolve(cfg, device)  # every `auto` speed setting, once, for device
    if chosen:
        say(speed.describe(chosen, device))
    # the checkpoint to resume, before the checks: a grown run's model is built at the new
    # size (attention by depth), and a size changed without --grow-resolution is refused
    # here, naming the flag, rather than by the model check (a restart moves files first:
    # it looks later)
    source = _resume_source(run, resume, main) if not restart else None
    if grow and source is None:
        raise ConfigError(f"--grow-resolution continues a run at a larger data.image_size, "
                          f"but {run.root} has no checkpoint to continue: train at the "
                          "smaller size first, or drop --grow-resolution")
    if source is not None:
        state_json = json.loads((source / "state.json").read_text())
        saved = validate(state_json["config"], f"{source}/state.json config")
        if grow:
            cfg, notes = grow_from_checkpoint(cfg, source)
            for note in notes:
                say(f"grow resolution: {note}")
        elif saved.data.image_size != cfg.data.image_size:
            check_resume_config(saved, cfg, allow_config_change
                                or int(state_json["step"]) >= cfg.train.steps)
    base_id = None
    if cfg.model.pretrained:  # the base's identity: recorded at the first start, then checked
        recorded = state_json.get("base") if source is not None else None
        base_id = sd_identity.check_base(recorded, cfg, f"the checkpoint {source}")
        say(f"base model {base_id['path']}: identity sha256 {base_id['sha256'][:16]}... "
            f"({len(base_id['files'])} files)"
            + (", the one the checkpoint was trained on" if recorded else ""))
    for warning in lint(cfg, device):  # dangerous but legal settings: say why, at start
        say(f"warning: {warning}")
    configure_runtime(cfg, device, ctx)

    # ---- setup: the dry run's checks (precision, the model on the meta device, the data),
    # then the real thing
    if cfg.data.num_class_images and dataset is None:  # DreamBooth: before the data is read
        from ..integrations.sd.dreambooth import ensure_class_images

        if main:
            ensure_class_images(cfg, device, say)
        if ctx.enabled:
            distributed.barrier()
    pre = preflight.check(cfg, dataset, device=device)
    data = pre.data
    cfg, notes = preflight.resolve_epochs(cfg, data)  # train.epochs -> train.steps
    for note in notes:
        say(note)
    for line in pre.header(cfg, run.root):  # the full config goes to RUN/config.yaml
        say(line)
    if cfg.model.pretrained:  # small images blown up to the training size: said once
        from ..integrations.sd.advice import upscale_warning

        line = upscale_warning(data, cfg.data.image_size)
        if line:
            say(line)
    skipped_at_scan = getattr(data, "skipped", 0)  # files dropped before training began
    state = build_state(cfg, pre.num_classes_in_data, device, ctx)
    state.base = base_id
    if state.checkpointing:
        say(f"gradient checkpointing: {state.checkpointing}")
    lrs = describe_lrs(state.model, cfg.optim)  # optim.lr_text_encoder: each part's LR
    if lrs:
        say(f"optim: {lrs}")
    state.evaluator = make_evaluator(cfg, run_dir)
    encoded = None
    if state.media.text:  # latents and text contexts, cached and checked finite
        from ..integrations.sd import setup as sd_setup

        state.prompts = validation.resolve(cfg, data.captions, state.model, state.media)
        if cfg.controlnet.enabled:  # each prompt's conditioning image
            from ..integrations.controlnet import validation_images

            state.control = validation_images(cfg, data, state.prompts)
            state.weights.recipe = getattr(data, "recipe", None)  # state.json records it
        cache = Path(cfg.data.cache_dir).expanduser() if cfg.data.cache_dir \
            else run.root / "cache"
        try:  # a stop signal ends the caching at the next item (the cache stays valid)
            data = encoded = sd_setup.encode_data(state.media, data, cfg, cache, say,
                                                  stop=lambda: signals.requested is not None)
        except CachingStopped as e:
            say(str(e))
            raise TrainingInterrupted(signal_name(signals.requested or 15), state.step,
                                      None) from None
        state.sample_weights = getattr(data, "loss_weights", None)  # kohya's is_reg images
    # data.buckets: the histogram (printed in the header above) for the report
    layout = bucket_layout(data)

    # ---- resume: the same command again continues the run
    if restart:
        source = _resume_source(run, resume, main, restart)
    c, growth = (_resume(state, source, allow_config_change, say, grow) if source is not None
                 else (None, None))
    if state.sharded:
        say(f"sharding: {state.sharded}")
    elif ctx.enabled:
        state.ddp = distributed.wrap(state.model, device)  # broadcasts rank 0's weights
    compile_forward(state)  # train.compile: lazy, the first step compiles
    guard = attach_guard(state, run_dir if main else None, data, defer=True)
    if c is not None:
        CheckpointIO(state).restore_guard(c)
    if encoded is not None and c is None:  # samples left out at encoding: named, once
        sd_setup.record_quarantine(guard, encoded)

    if main:
        run.root.mkdir(parents=True, exist_ok=True)
        run.config.write_text(cfg.to_yaml())
        for name in JSONL_LOGS:
            telemetry.truncate_jsonl(run.root / name, state.step)
        # tools expect the file: a healthy run leaves it empty (never truncated: rows of a
        # resumed run were cut to its step just above)
        run.incidents.touch()
        if layout is not None:
            write_buckets(run.buckets, layout, cfg.train.batch_size)
    if growth is not None:  # after the truncation: its incident row is this run's
        apply_growth(state, growth, say)

    def batches_from(position: int):
        """The data stream from batch ``position`` on, without the quarantined samples (with
        all their repeats: kohya data, data/kohya.py)."""
        quarantine = guard.quarantine if guard else set()
        if quarantine and hasattr(data, "copies"):
            quarantine = data.copies(quarantine)
        return iter(make_loader(data, batch_size=cfg.train.batch_size, seed=cfg.train.seed,
                                start_batch=position, hflip=cfg.data.hflip,
                                num_workers=cfg.data.num_workers, rank=ctx.rank,
                                world_size=ctx.world_size, pin_memory=cfg.data.pin_memory,
                                exclude=quarantine, num_classes=cfg.model.num_classes))

    # ---- the loop: {stop?, report, done?, step}
    batches, next_pos = batches_from(state.batches_consumed), state.batches_consumed
    out = _Outputs(state, run, main, watchdog, skipped_at_scan, source)
    try:
        with out:
            stepped = False  # a step was trained since the last pass: something to report
            while True:
                # a signal on any rank stops every rank here, and every rank records the same
                # training seconds (the time budget and its LR): under torchrun one tiny
                # all-reduce per step, on the CPU (a gloo group: no device sync)
                stop, state.train_seconds = signals.agreed(
                    device, state.train_seconds + out.clock.lap())
                done = (state.step >= cfg.train.steps or state.evaluator.stopped
                        or budget.spent(state))
                stop = None if done else stop
                if guard is not None and guard.pending and (
                        done or stop is not None or guard.due() or out.due()):
                    # the speculative steps are judged before anything reads the state
                    flushed = guard.flush()
                    if flushed.rewind is not None:  # a step failed: back to the window's start
                        state.faults.restore(flushed.rewind.extra)
                        out.rewound()
                        batches = batches_from(state.batches_consumed)
                        next_pos, stepped = state.batches_consumed, False
                        continue
                    out.verified(flushed.values)
                    if state.weights.reads_at(state.step):
                        state.weights.after_update(state)  # an adapter's |dW|/|W| clamp
                if stepped:
                    done = out.report(done or stop is not None, interrupted=stop is not None)
                if done or stop:
                    break
                watchdog.beat(f"step {state.step}")
                step_out = train_step(state, next(batches))
                next_pos += 1
                how = handle_decision(state, step_out.decision, say)
                stepped = how == "stepped"
                if stepped:
                    out.add(step_out)
                elif how == "rolled_back":
                    out.rolled_back()
                if state.batches_consumed != next_pos or step_out.decision.quarantined:
                    # a rollback, a batch the guard skips, a sample it quarantined: the
                    # stream reopens where the guard says, without the quarantined samples
                    batches = batches_from(state.batches_consumed)
                    next_pos = state.batches_consumed
            out.final_checkpoint()
    except GuardAbort as e:
        if main or state.sharded:  # FSDP: the abort point's checkpoint is every rank's
            # a changed adapter base is refused by every save: no abort point to write
            keep = e.incident is None or e.incident.kind != "adapter_base_modified"
            e.abort_point = abort_point(state, run, str(e), say, write=keep,
                                        lr_cause=not _cause_not_lr(e.incident))
        if main:
            _finish(state, run, "aborted", reason=str(e), tb=out.tb, abort=e.abort_point)
        # torchrun ends the group as soon as one worker exits non-zero: every rank waits
        # until rank 0 has written the abort point, summary.json and the report
        distributed.barrier()
        raise
    stopped = state.evaluator.stop_reason() if state.evaluator.stopped else None
    timed_out = budget.reason(state) if budget.ended_run(state) else None
    if stopped or timed_out:
        say(stopped or timed_out)
    signame = signal_name(stop) if stop else None
    status = "interrupted" if stop else "finished"
    reason = f"{signame} at step {state.step}" if stop else stopped or timed_out
    summary = _finish(state, run, status, reason=reason, tb=out.tb, signal=signame) \
        if main else None
    result = RunResult(run_dir, state.step, out.last_loss, out.last_ckpt, out.samples,
                       c.path if c else None, time.perf_counter() - t_start,
                       incidents=guard.num_incidents if guard else 0, guard_summary=summary,
                       stopped_early=stopped, interrupted=signame, time_budget=timed_out,
                       train_seconds=state.train_seconds)
    if stop:
        # torchrun ends the other workers as soon as one exits non-zero: every rank waits
        # here until rank 0 has written summary.json and the report
        distributed.barrier()
        raise TrainingInterrupted(signame, state.step, out.last_ckpt, result)
    return result


class _Outputs:
    """What the loop writes while it trains, at each interval or when the run is done: the
    progress bar, layer statistics, metrics rows (and TensorBoard), evaluation, sample grids
    and checkpoints. Rank 0 writes; every rank takes part in the collectives (evaluation
    state, checkpoint outcome)."""

    def __init__(self, state: TrainState, run: RunDir, main: bool,
                 watchdog: distributed.Watchdog, skipped_at_scan: int, source: Path | None):
        cfg = state.cfg
        self.state, self.run, self.main, self.watchdog = state, run, main, watchdog
        self.skipped_at_scan = skipped_at_scan
        self.tb = telemetry.TensorBoard(run.root) if cfg.logging.tensorboard and main else None
        # a bar on a terminal; in a log (CI, SLURM, a pipe, a terminal with no size, where
        # tqdm's carriage returns make one endless line) the status as a line per row instead
        show, bar = cfg.logging.progress and main, _bar_fits(sys.stderr)
        self.lines = show and not bar
        self.bar = tqdm(total=cfg.train.steps, initial=state.step, disable=not (show and bar),
                        dynamic_ncols=True, desc="train")
        self.window: list[StepOutput] = []
        self.tick = time.perf_counter()
        self.last_loss: float | None = None
        self.samples: list[Path] = []
        self.last_ckpt, self.saved = source, state.step
        self._files = contextlib.ExitStack()
        self.clock = budget.Clock()  # training time not yet recorded (train.max_time)

    def __enter__(self) -> "_Outputs":
        if self.main:
            self.metrics = self._files.enter_context(open(self.run.metrics, "a"))
            self.layers = self._files.enter_context(open(self.run.layers, "a"))
        return self

    def __exit__(self, *exc) -> None:
        self._files.close()
        self.bar.close()

    def add(self, out: StepOutput) -> None:
        """A step was applied."""
        self.window.append(out)
        self.bar.update(1)

    def due(self) -> bool:
        """Whether the training state is read at this step (a metrics row, the layer
        statistics, an evaluation, a sample grid, a post-hoc EMA snapshot, a checkpoint, an
        adapter's |dW|/|W| check): the guard's speculative steps are judged first."""
        state, tcfg = self.state, self.state.cfg.train
        step, every = state.step, state.cfg.logging.layer_stats_every
        ph = state.ema.posthoc is not None and step % tcfg.ema_posthoc_every == 0
        return (step % state.cfg.logging.log_every == 0 or bool(every and step % every == 0)
                or state.weights.reads_at(step)
                or state.evaluator.due(step) or ph
                or bool(tcfg.sample_every and step % tcfg.sample_every == 0)
                or bool(tcfg.checkpoint_every and step % tcfg.checkpoint_every == 0))

    def verified(self, values: list) -> None:
        """The guard judged the window's steps healthy: their host numbers."""
        fill_verified(self.window, values)

    def rewound(self) -> None:
        """The guard sent the run back to a window's start: its steps are redone."""
        state = self.state
        self.window = [o for o in self.window if o.decision.step <= state.step]
        self.bar.n = state.step
        self.bar.refresh()

    def rolled_back(self) -> None:
        """The guard moved the run back: the window's steps are undone."""
        self.bar.n = self.state.step
        self.window, self.saved = [], min(self.saved, self.state.step)
        if self.main:
            # the ring's state was taken before that step's post-hoc snapshot was listed;
            # the restored profiles are that state again: list it again (same bytes)
            store_posthoc(self.state, self.run)

    def report(self, done: bool, interrupted: bool = False) -> bool:
        """Everything due at this step (``done``: the run ends here, so all of it). Returns
        ``done``, which evaluation's early stopping may have set. An ``interrupted`` run
        (a stop signal) ends here too, but skips the final sample grid: a preempted job has
        seconds of grace, and the checkpoint comes first; the grid of a finished run is
        written when the resumed run finishes."""
        state, main, tcfg = self.state, self.main, self.state.cfg.train
        step, out = state.step, self.window[-1]
        if out.layer_grad_norms is not None and (main or state.sharded):  # layer statistics
            row = telemetry.layer_stats(state, out)  # FSDP: collectives, on every rank
            if main:
                self.layers.write(json.dumps(row) + "\n")
                self.layers.flush()
        if step % state.cfg.logging.log_every == 0 or done:
            now = time.perf_counter()
            row = telemetry.metrics_row(state, self.window, (now - self.tick) / len(self.window),
                                        self.skipped_at_scan + len(state.bad_images))
            self.tick, self.window, self.last_loss = now, [], row["loss"]
            if main:
                self.metrics.write(json.dumps(row) + "\n")
                self.metrics.flush()
                if self.tb:
                    self.tb.scalars(row)
                if self.lines:
                    print(f"train step {step}/{tcfg.steps} | {_status(row)} | "
                          f"{row['sec_per_step']:.3g} s/step", file=sys.stderr, flush=True)
                else:
                    self.bar.set_postfix_str(_status(row), refresh=False)
        self.clock.pause()  # evaluation, grids, snapshots, checkpoints: not training time
        if state.evaluator.due(step):
            # before the checkpoint, which holds the result; rank 0 measures, every rank
            # takes its best/patience state, so all stop early together
            if main:
                self.watchdog.beat(f"evaluation at step {step}")
                state.evaluator.run(state, self.tb, lambda: save_best(state, self.run))
            state.evaluator.load_state_dict(
                distributed.broadcast_object(state.evaluator.state_dict()))
            done = done or state.evaluator.stopped
        if (tcfg.sample_every and step % tcfg.sample_every == 0 or done and not interrupted) \
                and (main or state.sharded):  # FSDP: the sharded EMA samples on every rank
            self.watchdog.beat(f"sample grid at step {step}")
            path = write_sample_grid(state, self.run.sample_grid(step), self.tb, write=main)
            if main:
                self.samples.append(path)
        if main:
            # before the checkpoint, whose state lists it; not at an interrupt (the run that
            # was never interrupted has none there: resume gives the same snapshots)
            store_posthoc(state, self.run, force=done and not interrupted)
        if (tcfg.checkpoint_every and step % tcfg.checkpoint_every == 0 or done) \
                and step != self.saved:
            self.watchdog.beat(f"checkpoint at step {step}")
            written = save(state, self.run)
            if written is not None:
                self.last_ckpt, self.saved = written, step
        self.clock.resume()
        return done

    def final_checkpoint(self) -> None:
        """The final checkpoint failed (train.on_save_error=retry): one more try, then stop."""
        if self.saved == self.state.step:
            return
        self.last_ckpt = save(self.state, self.run)
        if self.last_ckpt is None:
            raise CheckpointSaveError(f"could not write the final checkpoint at step "
                                      f"{self.state.step}; see the errors above")


def fill_verified(window: list[StepOutput], values: list) -> None:
    """The guard's :meth:`~steadydiff.guard.Guard.flush` judged the last ``len(values)``
    steps of ``window`` healthy: write their host numbers into them (the metrics row reads
    these, with no read of its own)."""
    if not values:
        return
    for out, (loss, gnorm, clipped, loss_t) in zip(window[-len(values):], values):
        d = out.decision
        d.loss, d.grad_norm, d.grad_norm_clipped, d.loss_t = loss, gnorm, clipped, loss_t
        out.grad_norm, out.grad_norm_clipped = torch.tensor(gnorm), torch.tensor(clipped)


def _bar_fits(stream) -> bool:
    """Whether ``stream`` is a terminal with a width, where a redrawn bar reads well."""
    try:
        return stream.isatty() and os.get_terminal_size(stream.fileno()).columns > 0
    except (AttributeError, OSError, ValueError):  # no fileno (a captured stream), or closed
        return False


def _status(row: dict) -> str:
    """The status line: the progress bar's postfix on a terminal (tqdm adds step, speed and
    ETA), and in a log a plain line that adds them itself. Non-finite values arrive as
    strings ("nan"): a run without the guard keeps going, and so must its status."""
    def f(v, spec):
        return format(v, spec) if isinstance(v, (int, float)) else str(v)
    s = (f"loss {f(row['loss'], '.4f')} | gnorm {f(row['grad_norm'], '.3g')}"
         f"->{f(row['grad_norm_clipped'], '.3g')} | lr {row['lr'] * row['lr_factor']:.2e}")
    if row["incidents"]:
        s += (f" | guard {row['incidents']} incident(s), {row['skipped_steps']} skip(s), "
              f"{row['rollbacks']} rollback(s)")
    return s


def _finish(state: TrainState, run: RunDir, status: str, reason: str | None = None,
            tb: telemetry.TensorBoard | None = None, signal: str | None = None,
            abort: dict[str, Any] | None = None) -> str | None:
    """End of a run (finished, interrupted by ``signal``, or aborted at ``abort``):
    summary.json, the guard's one-screen summary, the health report."""
    summary = state.guard.summary() if state.guard is not None else None
    steps = abort["step"] if abort else state.step  # the abort point moved the state back
    telemetry.write_summary(run.root, status, steps,
                            state.guard.num_incidents if state.guard else 0, summary, reason,
                            signal=signal, abort=abort, time_budget=budget.summary(state),
                            memory=telemetry.held_bytes(state) if state.sharded else None)
    if summary:
        print(summary)
    if tb:
        tb.close()
    if state.cfg.logging.report:
        try:
            print(f"report: {write_report(run.root)}")
        except Exception as e:  # the report must never take a finished run down
            log.warning("could not write report.html: %s: %s", type(e).__name__, e)
    return summary


@torch.no_grad()
def write_sample_grid(state: TrainState, path: Path, tb: telemetry.TensorBoard | None = None,
                      write: bool = True) -> Path:
    """Sample with the config's sampler and save a PNG grid (and add it to ``tb``): a text
    run's validation prompts (trainer/validation.py), else one column per class or
    unconditional samples, from the EMA weights (``sample.use_ema``). ``write=False``
    samples without saving (an FSDP rank other than 0: its forward passes are collectives
    the saving rank needs)."""
    s = state.cfg.sample
    if state.media.text:
        validation.safe_render(state, path, tb, write)
    else:
        with validation.sampling_model(state) as model:  # an fp16/bf16 base: its autocast
            y = (torch.arange(s.num, device=state.device) % model.num_classes
                 if model.num_classes else None)
            x = sample(model, state.schedule, state.cfg.diffusion.prediction,
                       (s.num, model.in_channels, model.image_size, model.image_size),
                       sampler=s.sampler, steps=s.steps, y=y, cfg_scale=s.cfg_scale,
                       eta=s.eta, generator=seeding.generator(state.device, s.seed),
                       device=state.device)
        if write:
            save_grid(x, path, nrow=grid_nrow(s.num, model.num_classes))
    if tb is not None and path.is_file():
        tb.image(path, state.step)
    return path
