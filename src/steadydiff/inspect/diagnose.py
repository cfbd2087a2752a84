"""Doctor: the entry points. :func:`diagnose` examines a run directory or a checkpoint;
:func:`diagnose_model` runs the weight and probe checks on a model in memory.

Three sources of evidence, one room each: the weights against a fresh initialization
(weights.py), a probe forward pass (probe.py), the run's history (history.py). The causes
are ranked and linked in causes.py; :func:`steadydiff.doctor.format_diagnosis` prints them.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..config import Config, validate
from ..devices import resolve_device
from ..guard.provenance import FP16_MAX
from ..rundir import RunDir
from ..trainer import checkpoint as ckpt
from . import history, probe as probe_checks, weights
from .causes import Cause, Diagnosis, link, rank
from .model import UnusableCheckpoint, fresh_state, model_from_checkpoint
from .read import read_run


def diagnose(path: str | Path, *, probe: bool = True,
             device: str | torch.device = "cpu") -> Diagnosis:
    """Post-mortem of a run directory or a checkpoint directory.

    Args:
        path: a run directory (its newest intact checkpoint is examined, the ``latest``
            pointer's first, plus the run's metrics, incidents and config) or a checkpoint
            directory (its weights; plus the run's history when it sits in a run's
            ``checkpoints/``).
        probe: run the forward probe (one forward pass on a small batch).
        device: where the probe runs (:func:`~steadydiff.devices.resolve_device`).

    Returns:
        A :class:`Diagnosis`, causes ranked most likely first.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: ``path`` is neither a run directory nor a checkpoint.
        DeviceError: ``device`` is unknown or not on this machine.
    """
    device = resolve_device(device, what="--device")  # a missing GPU is not a finding
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no such run directory or checkpoint: {path}")
    d = Diagnosis(path)
    if ckpt.is_checkpoint_dir(path):
        candidates = [path]
        run = RunDir.of_checkpoint(path)
        d.run_dir = run.root if run is not None else None
    elif (run := RunDir(path)).has_run_files():  # the doctor writes nothing into it
        d.run_dir = path
        candidates = run.checkpoint_candidates()
    else:
        raise ValueError(f"{path} is neither a run directory (checkpoints/, metrics.jsonl, "
                         "summary.json) nor a checkpoint directory (manifest.json)")

    # ---- the newest checkpoint that verifies; corrupt ones are findings
    chosen = None
    for c in candidates:
        problems = ckpt.verify_checkpoint(c)
        if not problems:
            chosen = c
            break
        d.causes.append(Cause(
            "critical" if c is candidates[-1] or path == c else "warning",
            "checkpoint_corrupt", c.name, f"checkpoint {c.name} fails verification",
            {"problems": problems},
            "do not load it; resuming skips it automatically (the previous intact checkpoint "
            "is used); delete it once a newer one is written", score=len(problems)))
    d.checks.append("checkpoint_corrupt")

    cfg: Config | None = None
    if chosen is not None:
        d.checkpoint = chosen
        try:
            got = model_from_checkpoint(chosen, device)
        except UnusableCheckpoint as e:
            cfg, d.step = e.config, e.step
            d.causes.append(Cause("critical", "checkpoint_corrupt", chosen.name, e.summary,
                                  {"error": e.error}, e.recommendation))
        else:
            cfg, d.step = got.config, got.step
            examine(d, got.model, cfg, got.ema_state, None, probe, got.precision)
    else:
        d.causes.append(Cause(
            "info", "no_checkpoint", None, "no intact checkpoint to examine",
            {"candidates": [c.name for c in candidates]},
            "weights and probe checks need a checkpoint (train.checkpoint_every); only the "
            "run's history was examined"))
        d.notes.append("weights and probe: skipped (no intact checkpoint)")

    if d.run_dir is not None:
        log = read_run(d.run_dir)
        d.notes += [f"run files: {p}" for p in log.problems]
        if cfg is None and log.config:
            try:
                cfg = validate(log.config, source=f"{d.run_dir}/config.yaml")
            except Exception as e:
                d.notes.append(f"config.yaml does not validate: {e}")
        d.causes += history.check_history(log, cfg)
        d.checks += history.CHECKS
        if d.step is None:
            d.step = log.last_step
    d.causes = link(rank(d.causes))
    return d


def diagnose_model(model: nn.Module, cfg: Config, *,
                   ema_state: dict[str, torch.Tensor] | None = None,
                   batch: tuple[torch.Tensor, torch.Tensor | None] | None = None,
                   probe: bool = True, precision: str | None = None) -> Diagnosis:
    """Weight and probe checks on an in-memory model (what :func:`diagnose` runs on a
    checkpoint).

    Args:
        model: the model to examine (built from ``cfg``; weights as trained).
        cfg: its :class:`~steadydiff.config.Config`.
        ema_state: the EMA weights, for the EMA checks (None skips them).
        batch: ``(x0, y)`` for the probe; default :func:`~.probe.probe_batch` of ``cfg``.
        probe: run the forward probe.
        precision: the precision the run trains in (default ``cfg.train.precision``).

    Returns:
        A :class:`Diagnosis` (``path`` is ``"<model>"``).
    """
    d = Diagnosis(Path("<model>"))
    examine(d, model, cfg, ema_state, batch, probe, precision)
    d.causes = link(rank(d.causes))
    return d


def examine(d: Diagnosis, model: nn.Module, cfg: Config,
            ema_sd: dict[str, torch.Tensor] | None,
            batch: tuple[torch.Tensor, torch.Tensor | None] | None, probe: bool,
            precision: str | None) -> None:
    """The weight checks, then (unless the weights are non-finite) the probe forward pass;
    causes, checks, notes and measurements are added to ``d``."""
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    init_sd = fresh_state(cfg)
    norm_modules = {n: m.eps for n, m in model.named_modules()
                    if isinstance(m, (nn.GroupNorm, nn.LayerNorm))}
    causes, meas = weights.check_weights(sd, init_sd, ema_sd, norm_modules,
                                         affine_limit=cfg.guard.norm_affine_limit)
    d.causes += causes
    d.measurements.update(meas)
    d.checks += weights.CHECKS + (weights.EMA_CHECKS if ema_sd is not None else [])
    if not probe:
        d.notes.append("probe forward pass: skipped (--no-probe)")
        return
    if any(c.check == "nonfinite_weights" for c in causes):
        d.notes.append("probe forward pass: skipped, the model weights are non-finite "
                       "(every activation would be NaN)")
        return
    latent = False
    try:
        if batch is None and (cfg.model.pretrained or cfg.model.text_encoder):
            # a text-to-image run: its images through its VAE, its captions through its
            # text encoders (the denoiser takes latents and a text condition)
            from ..integrations.sd.probe import text_probe_batch

            x0, y, source, latent = text_probe_batch(cfg, model)
        elif batch is None:
            x0, y, source = probe_checks.probe_batch(cfg)
        else:
            x0, y = batch
            source = f"{x0.shape[0]} given images"
        stats: dict[str, Any] = probe_checks.run_probe(model, cfg, x0, y, latent=latent)
    except Exception as e:  # a probe failure is a finding about the tool, not the run
        d.notes.append(f"probe forward pass failed: {type(e).__name__}: {e}")
        return
    d.notes.append(f"probe batch: {source}")
    d.causes += probe_checks.check_probe(stats, cfg, model, init_sd, precision)
    d.checks += probe_checks.CHECKS
    d.measurements["probe"] = {
        "activation_max_abs": stats["act"],
        "fp16_margin": {n: (FP16_MAX / a if a > 0 else None) for n, a in stats["act"].items()
                        if math.isfinite(a)},
        "attention": stats["attn"], "norm": stats["norm"], "norm_input_from":
            stats["producer"], "source": source}
