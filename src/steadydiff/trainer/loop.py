"""The training loop, readable top to bottom.

    setup (device, data, model, EMA, optimizer, scaler) -> resume -> loop of
    {step, status/metrics, samples, checkpoint, done?}

The per-step work is :func:`train_step`, a plain function over :class:`TrainState`, so the
stability guard and the tests call exactly the code the trainer runs. Progress is counted in
one unit, optimizer steps; all randomness of a step is derived from (seed, step, micro-batch,
rank), so a resumed run replays the same timesteps, noise and label dropout.
"""

from __future__ import annotations

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

from .. import seeding
from ..config import Config, ConfigError, config_diff
from ..data import as_pairs, build_dataset, make_loader
from ..diffusion import Schedule, diffusion_loss, make_schedule, sample
from ..eval.grid import grid_nrow, save_grid
from ..models import build_model
from . import checkpoint as ckpt
from . import precision as prec
from .ema import EMA
from .optim import build_optimizer, lr_at, set_lr

log = logging.getLogger(__name__)

# Fields a resumed run may change without breaking exactness (bookkeeping and output only).
RESUME_SAFE = ("train.steps", "train.checkpoint_every", "train.keep_checkpoints",
               "train.sample_every", "train.num_threads", "train.device", "data.num_workers",
               "data.path", "sample.", "logging.")


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
    step: int = 0                 # optimizer steps completed
    batches_consumed: int = 0     # data position: global batches drawn from the stream
    rank: int = 0


@dataclass
class StepOutput:
    """What one optimizer step produced. Tensors stay on the device (no host sync)."""

    loss: torch.Tensor            # 0-dim, mean over the global batch
    grad_norm: torch.Tensor       # 0-dim, global norm before clipping
    per_sample_loss: torch.Tensor  # (B,)
    t: torch.Tensor               # (B,) timesteps
    lr: float


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


# --------------------------------------------------------------------------- one step


def train_step(state: TrainState, batch: tuple[torch.Tensor, ...]) -> StepOutput:
    """One optimizer step on a global batch ``(x, y, idx)``: micro-batches with gradient
    accumulation, autocast, the fp16 grad scaler, global-norm clipping, AdamW, EMA.

    Randomness (t, noise, label dropout) comes from a generator seeded by (seed, step,
    micro, rank), so replaying the same batch at the same step reproduces it exactly.
    """
    cfg, model, opt = state.cfg, state.model, state.optimizer
    x, y = batch[0].to(state.device, non_blocking=True), batch[1].to(state.device)
    y = y if model.num_classes else None
    lr = lr_at(state.step, cfg.optim, cfg.train.steps)
    set_lr(opt, lr)

    accum = cfg.train.grad_accum
    losses, ts = [], []
    for micro, (xm, ym) in enumerate(zip(x.chunk(accum), y.chunk(accum) if y is not None
                                         else [None] * accum)):
        gen = seeding.generator(state.device, cfg.train.seed, state.step, micro, state.rank)
        with prec.autocast(cfg.train.precision, state.device):
            out = diffusion_loss(model, xm, ym, state.schedule, cfg.diffusion, gen)
        loss = out.loss.float() / accum
        (state.scaler.scale(loss) if state.scaler else loss).backward()
        losses.append(out.per_sample.detach().float())
        ts.append(out.t)

    if state.scaler:
        state.scaler.unscale_(opt)
    params = [p for g in opt.param_groups for p in g["params"]]
    max_norm = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else math.inf
    grad_norm = nn.utils.clip_grad_norm_(params, max_norm, foreach=True)

    stepped = True
    if state.scaler:
        scale = state.scaler.get_scale()  # host sync, fp16 only
        state.scaler.step(opt)
        state.scaler.update()
        stepped = state.scaler.get_scale() >= scale  # a lowered scale means inf grads: skipped
    else:
        opt.step()
    opt.zero_grad(set_to_none=True)
    if stepped:
        state.ema.update(model, state.step)

    state.step += 1
    state.batches_consumed += 1
    per_sample = torch.cat(losses)
    return StepOutput(per_sample.mean(), grad_norm.detach(), per_sample, torch.cat(ts), lr)


# --------------------------------------------------------------------------- setup


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda but no CUDA device is available; "
                          "use train.device=cpu or auto")
    return torch.device(name)


def configure_runtime(cfg: Config, device: torch.device) -> None:
    """Threads, seeds and the deterministic mode, before anything random happens."""
    if cfg.train.num_threads:
        torch.set_num_threads(cfg.train.num_threads)
    if cfg.train.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    elif device.type == "cuda":
        torch.backends.cudnn.benchmark = True
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    seeding.seed_everything(cfg.train.seed)


def build_state(cfg: Config, num_classes_in_data: int, device: torch.device) -> TrainState:
    """Model, EMA, optimizer, scaler and schedule for ``cfg`` (fresh, not resumed)."""
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
    return TrainState(
        cfg=cfg, model=model, ema=EMA.from_config(model, cfg.train),
        optimizer=build_optimizer(model, cfg.optim),
        scaler=prec.make_scaler(cfg.train.precision, device),
        schedule=make_schedule(cfg.diffusion), device=device)


def state_dict(state: TrainState) -> dict[str, Any]:
    """The JSON-able part of the training state (tensors are saved separately)."""
    return {
        "step": state.step, "batches_consumed": state.batches_consumed,
        "images_seen": state.step * state.cfg.train.batch_size,
        "ema": state.ema.state(),
        "scaler": state.scaler.state_dict() if state.scaler else None,
        "config": state.cfg.to_dict(), "torch": torch.__version__,
    }


def save(state: TrainState, run_dir: Path) -> Path:
    return ckpt.save_checkpoint(
        run_dir / "checkpoints", state.step, model=state.model, ema=state.ema.module,
        optimizer=state.optimizer, state=state_dict(state),
        keep=state.cfg.train.keep_checkpoints)


def restore(state: TrainState, c: ckpt.Checkpoint) -> None:
    """Load a checkpoint into a freshly built state (weights, optimizer, RNG, counters)."""
    state.model.load_state_dict(c.model)
    state.ema.module.load_state_dict(c.ema)
    state.optimizer.load_state_dict(c.optimizer)
    state.ema.load_state(c.state["ema"])
    if state.scaler and c.state.get("scaler"):
        state.scaler.load_state_dict(c.state["scaler"])
    state.step = int(c.state["step"])
    state.batches_consumed = int(c.state["batches_consumed"])
    if c.rng is not None:
        ckpt.restore_rng(c.rng)


def check_resume_config(saved: Config, cfg: Config, allow_change: bool) -> list[str]:
    """Report config changes on resume; refuse those that break exactness unless allowed."""
    changes = config_diff(saved, cfg)
    lines = [f"  {k}: {a!r} -> {b!r}" for k, a, b in changes]
    unsafe = [k for k, _, _ in changes if not k.startswith(RESUME_SAFE)]
    if unsafe and not allow_change:
        raise ConfigError(
            "the config differs from the checkpoint's in fields that change the training "
            "itself:\n" + "\n".join(lines) + "\nresume with the original config, use a new "
            "--out directory, or pass --allow-config-change to accept the changes")
    return lines


# --------------------------------------------------------------------------- the loop


def run(cfg: Config, *, run_dir: str | Path, dataset: torch.utils.data.Dataset | None = None,
        resume: str | Path | bool = True, allow_config_change: bool = False) -> RunResult:
    """Train ``cfg`` into ``run_dir``.

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
        A :class:`RunResult`.
    """
    t_start = time.perf_counter()
    run_dir = Path(run_dir)
    device = resolve_device(cfg.train.device)
    prec.check_precision(cfg.train.precision, device, cfg.train.allow_slow_precision)
    configure_runtime(cfg, device)

    data = as_pairs(dataset) if dataset is not None else build_dataset(cfg.data)
    state = build_state(cfg, getattr(data, "num_classes", 0), device)

    # ---- resume: the same command again continues the run
    resumed_from: Path | None = None
    source: Path | None = None
    if resume is True:
        source = ckpt.latest_good(run_dir / "checkpoints")
    elif resume:
        source = ckpt.resolve_checkpoint(resume)
    elif ckpt.list_checkpoints(run_dir / "checkpoints"):
        raise ConfigError(f"{run_dir} already holds checkpoints; resume it, or choose a new "
                          "--out directory (nothing there is overwritten)")
    if source is not None:
        c = ckpt.load_checkpoint(source, device)
        changes = check_resume_config(Config.model_validate(c.state["config"]), cfg,
                                      allow_config_change)
        restore(state, c)
        resumed_from = source
        print(f"resumed from {source} at step {state.step}"
              + ("; config changes:\n" + "\n".join(changes) if changes else ""))

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(cfg.to_yaml())
    metrics_path = run_dir / "metrics.jsonl"
    _truncate_metrics(metrics_path, state.step)

    loader = make_loader(data, batch_size=cfg.train.batch_size, seed=cfg.train.seed,
                         start_batch=state.batches_consumed, hflip=cfg.data.hflip,
                         num_workers=cfg.data.num_workers,
                         pin_memory=device.type == "cuda")
    batches = iter(loader)

    samples: list[Path] = []
    last_ckpt: Path | None = source
    total = cfg.train.steps
    bar = tqdm(total=total, initial=state.step, disable=not cfg.logging.progress,
               dynamic_ncols=True, desc="train")
    window: list[StepOutput] = []
    tick = time.perf_counter()
    last_loss: float | None = None
    with open(metrics_path, "a") as metrics:
        while state.step < total:
            out = train_step(state, next(batches))
            window.append(out)
            step = state.step

            if step % cfg.logging.log_every == 0 or step == total:
                # host sync here, once per logging interval, not per step
                now = time.perf_counter()
                row = _metrics_row(state, window, (now - tick) / len(window))
                tick, window = now, []
                last_loss = row["loss"]
                metrics.write(json.dumps(row) + "\n")
                metrics.flush()
                bar.set_postfix(loss=f"{row['loss']:.4f}", gnorm=f"{row['grad_norm']:.3f}",
                                lr=f"{row['lr']:.2e}", refresh=False)
            bar.update(1)

            if (cfg.train.sample_every and step % cfg.train.sample_every == 0) or step == total:
                samples.append(write_sample_grid(state, run_dir / "samples" / f"step_{step:08d}.png"))
            if (cfg.train.checkpoint_every and step % cfg.train.checkpoint_every == 0) \
                    or step == total:
                last_ckpt = save(state, run_dir)
    bar.close()
    return RunResult(run_dir, state.step, last_loss, last_ckpt, samples, resumed_from,
                     time.perf_counter() - t_start)


def _metrics_row(state: TrainState, window: list[StepOutput], sec_per_step: float) -> dict:
    stats = torch.stack([torch.stack([o.loss.float(), o.grad_norm.float()]) for o in window])
    loss, gnorm = stats.mean(0).tolist()
    return {
        "step": state.step, "images_seen": state.step * state.cfg.train.batch_size,
        "loss": loss, "grad_norm": gnorm, "lr": window[-1].lr,
        "sec_per_step": sec_per_step, "ema_decay": state.ema.current_decay(),
        "grad_scale": state.scaler.get_scale() if state.scaler else None,
    }


def _truncate_metrics(path: Path, step: int) -> None:
    """On resume at ``step``, drop rows the resumed run will write again."""
    if not path.exists():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= step:
                keep.append(line)
        except (ValueError, KeyError, TypeError):
            continue  # a row cut short by a kill
    path.write_text("".join(k + "\n" for k in keep))


@torch.no_grad()
def write_sample_grid(state: TrainState, path: Path) -> Path:
    """Sample from the EMA model with the config's sampler and save a PNG grid."""
    s = state.cfg.sample
    model = state.ema.module
    y = None
    if model.num_classes:
        y = torch.arange(s.num, device=state.device) % model.num_classes
    gen = seeding.generator(state.device, s.seed)
    x = sample(model, state.schedule, state.cfg.diffusion.prediction,
               (s.num, model.in_channels, model.image_size, model.image_size),
               sampler=s.sampler, steps=s.steps, y=y, cfg_scale=s.cfg_scale, eta=s.eta,
               generator=gen, device=state.device)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_grid(x, path, nrow=grid_nrow(s.num, model.num_classes))
    return path
