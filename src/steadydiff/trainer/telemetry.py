"""What a run writes while it trains: metrics.jsonl rows, per-layer statistics, TensorBoard
scalars, and summary.json at the end.

One progress unit (optimizer steps), one metrics row per logging interval with fixed keys
(:data:`METRIC_KEYS`), host syncs only at the logging tick (the guard already synced its own
numbers each step, so with the guard on the row costs nothing extra).
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from .. import distributed, hostsync, sharding
from ..config import ConfigError
from ..guard import probes
from ..rundir import RunDir
from .state import StepOutput, TrainState

METRIC_KEYS = ("step", "images_seen", "loss", "grad_norm", "grad_norm_clipped", "lr",
               "lr_factor", "sec_per_step", "ema_decay", "grad_scale", "precision",
               "micro_batch", "incidents", "skipped_steps", "rollbacks", "data_skipped",
               "memory_mb", "loss_t")


def memory_mb(device: torch.device) -> float:
    """Peak memory: CUDA allocator peak on a GPU, process max RSS on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 1024  # bytes on macOS, KiB else


def _bucket_means(window: list[StepOutput], buckets: int, T: int) -> list[float | None]:
    sums, counts = [0.0] * buckets, [0] * buckets
    if all(o.decision.loss_t is not None for o in window):
        for o in window:  # the guard's per-step bucket means (already on the host)
            for b, m in enumerate(o.decision.loss_t):
                if m is not None:
                    sums[b] += m
                    counts[b] += 1
    else:  # host reads here, at the logging tick
        ps = hostsync.read(torch.cat([o.per_sample_loss for o in window]).float())
        t = hostsync.read(torch.cat([o.t for o in window]))
        b = (t.long() * buckets // T).clamp(0, buckets - 1)
        s = torch.zeros(buckets).index_add_(0, b, ps)
        n = torch.bincount(b, minlength=buckets)
        sums, counts = s.tolist(), n.tolist()
    return [s / n if n else None for s, n in zip(sums, counts)]


def metrics_row(state: TrainState, window: list[StepOutput], sec_per_step: float,
                data_skipped: int) -> dict[str, Any]:
    """One metrics.jsonl row with the fixed keys :data:`METRIC_KEYS`."""
    if all(o.decision.loss is not None for o in window):  # the guard already synced these
        loss = sum(o.decision.loss for o in window) / len(window)
        gnorm = sum(o.decision.grad_norm for o in window) / len(window)
        clipped = sum(o.decision.grad_norm_clipped for o in window) / len(window)
    else:
        stats = torch.stack([torch.stack([o.loss.float(), o.grad_norm.float().to(o.loss.device),
                                          o.grad_norm_clipped.float().to(o.loss.device)])
                             for o in window])
        stats = stats.mean(0)
        if distributed.active():  # without the guard, each rank only has its own share
            torch.distributed.all_reduce(stats)
            stats /= torch.distributed.get_world_size()
        loss, gnorm, clipped = hostsync.values(stats)
    g, cfg = state.guard, state.cfg
    row = {
        "step": state.step, "images_seen": state.step * cfg.train.batch_size,
        "loss": loss, "grad_norm": gnorm, "grad_norm_clipped": clipped, "lr": window[-1].lr,
        "lr_factor": g.last_factor if g else 1.0, "sec_per_step": sec_per_step,
        "ema_decay": state.ema.current_decay(),
        "grad_scale": state.scaler.get_scale() if state.scaler else None,
        "precision": state.precision,
        "micro_batch": -(-cfg.train.batch_size // state.grad_accum),
        "incidents": g.num_incidents if g else 0,
        "skipped_steps": g.counts["skips"] + g.scaler_skips if g else 0,
        "rollbacks": g.counts["rollbacks"] if g else 0, "data_skipped": data_skipped,
        "memory_mb": memory_mb(state.device),
        "loss_t": _bucket_means(window, cfg.guard.t_buckets, cfg.diffusion.timesteps),
    }
    return {k: (v if not isinstance(v, float) or math.isfinite(v) else str(v))
            for k, v in row.items()}


def truncate_jsonl(path: Path, step: int) -> None:
    """On resume at ``step``, drop rows the resumed run will write again (and a row cut
    short by a kill)."""
    if not path.exists():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= step:
                keep.append(line)
        except (ValueError, KeyError, TypeError):
            continue
    path.write_text("".join(k + "\n" for k in keep))


@torch.no_grad()
def layer_stats(state: TrainState, out: StepOutput) -> dict[str, Any]:
    """Per-layer statistics for layers.jsonl: gradient norms (before clipping, captured in
    the step), weight norms, and the attention/normalization probes (one extra forward)."""
    names = [n for n, p in state.model.named_parameters() if p.requires_grad]
    params = [p for p in state.model.parameters() if p.requires_grad]
    weights = hostsync.values(sharding.norms(params))  # FSDP: over every rank's shards
    row: dict[str, Any] = {"step": state.step,
                           "weight_norm": dict(zip(names, weights))}
    if out.layer_grad_norms is not None:
        row["grad_norm"] = dict(zip(names, hostsync.values(out.layer_grad_norms.float())))
    if out.probe_forward is not None:
        g = state.guard
        if g is not None and g.last_probe_step == state.step and g.last_probe is not None:
            stats = g.last_probe  # the guard's own probe (guard.probe_every) ran this step
        else:
            stats = (g.probe_now(out.probe_forward) if g is not None
                     else probes.probe(state.model, out.probe_forward))
        row["attn"], row["norm"] = stats["attn"], stats["norm"]
    return row


class TensorBoard:
    """The same scalars as metrics.jsonl (and sample grids) as TensorBoard event files."""

    def __init__(self, run_dir: Path):
        try:  # deferred: tensorboard is an optional extra
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError("logging.tensorboard=true needs the tensorboard package: "
                              "pip install 'steadydiff[tensorboard]'") from None
        self.writer = SummaryWriter(str(run_dir / "tensorboard"))

    def scalars(self, row: dict[str, Any]) -> None:
        step = row["step"]
        for k, v in row.items():
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                self.writer.add_scalar(f"train/{k}", v, step)
        for b, v in enumerate(row.get("loss_t") or []):
            if v is not None:
                self.writer.add_scalar(f"loss_t/bucket_{b}", v, step)

    def image(self, path: Path, step: int) -> None:
        img = np.asarray(Image.open(path).convert("RGB"))
        self.writer.add_image("samples", img, step, dataformats="HWC")

    def close(self) -> None:
        self.writer.close()


def held_bytes(state: TrainState) -> dict[str, Any]:
    """The bytes this rank holds of the trainable weights, the AdamW state, the EMA and the
    guard's rollback snapshots (under FSDP each rank keeps its own shards of them): a
    sharded run's summary.json, and bench/fsdp_memory.py for both layouts."""
    opt = [v for st in state.optimizer.state.values() for v in st.values()]
    ring = list(state.guard.ring.ring) if state.guard is not None else []
    return {"world_size": state.world_size, "rank": state.rank,
            "weights_bytes": sharding.local_bytes(state.update.params),
            "optimizer_bytes": sharding.nested_bytes(opt),
            "ema_bytes": sharding.local_bytes(state.ema.module.parameters()),
            "snapshots_bytes": sharding.nested_bytes(ring), "snapshots_kept": len(ring)}


def write_summary(run_dir: Path, status: str, steps: int, incidents: int,
                  guard_summary: str | None, reason: str | None = None,
                  signal: str | None = None, abort: dict[str, Any] | None = None,
                  time_budget: dict[str, Any] | None = None,
                  memory: dict[str, Any] | None = None) -> None:
    """summary.json: how the run ended (``finished``, ``interrupted`` by ``signal``, or
    ``aborted``, with ``abort``: the abort point's checkpoint and the command to resume from
    it, see ``loop.abort_point``; read by the report and the doctor); ``time_budget``
    (``train.max_time`` set): ``{max_time, used, ended}`` in seconds, ``ended`` when the
    budget ended the run; ``memory``: a sharded run's :func:`held_bytes`. Written to a
    temporary file and renamed, so a second signal (an immediate exit) never leaves half a
    summary."""
    summary: dict[str, Any] = {"status": status, "steps": steps, "incidents": incidents,
                               "guard_summary": guard_summary}
    if reason:
        summary["reason"] = reason
    if signal:
        summary["signal"] = signal
    if abort:
        summary["abort"] = abort
    if time_budget:
        summary["time_budget"] = time_budget
    if memory:
        summary["sharded_memory"] = memory
    path = RunDir(run_dir).summary
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(summary, indent=1))
    os.replace(tmp, path)
