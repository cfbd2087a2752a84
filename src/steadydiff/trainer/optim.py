"""AdamW with parameter groups, and the learning-rate schedule as a pure function of the step.

The LR schedule is a function of the optimizer step, never a stateful scheduler object:
resuming at step s gives the same LR as the run that was never stopped, and there is no
hidden counter to drift (see STYLE.md, "a step counter hidden inside a scheduler object").
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..config import ConfigError, OptimConfig
from .speed import optimizer_kwargs


def _no_decay(module: nn.Module, name: str, p: nn.Parameter) -> bool:
    # Weight decay on norms, biases and embeddings only shrinks things that set scales or
    # identities, which hurts more than it regularizes (Loshchilov & Hutter 2019 practice).
    return p.ndim <= 1 or isinstance(module, nn.Embedding) or name.endswith("pos_embed")


def param_groups(model: nn.Module, cfg: OptimConfig) -> list[dict]:
    """Split the model's trainable parameters into AdamW groups.

    Each group carries ``lr_scale`` (layer-wise LR decay, BEiT-style: ``decay ** (max_depth -
    depth)`` when the model exposes ``param_depth``) and its weight decay (0 for norms, biases
    and embeddings). Returns a list of dicts for ``torch.optim.AdamW``.
    """
    owners = {f"{mn}.{pn}" if mn else pn: m
              for mn, m in model.named_modules() for pn, _ in m.named_parameters(recurse=False)}
    use_depth = cfg.layer_decay < 1.0 and hasattr(model, "param_depth")
    groups: dict[tuple[float, float], dict] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        wd = 0.0 if _no_decay(owners[name], name, p) else cfg.weight_decay
        scale = 1.0
        if use_depth:
            scale = cfg.layer_decay ** (model.max_depth - model.param_depth(name))
        g = groups.setdefault((wd, scale), {"params": [], "names": [], "weight_decay": wd,
                                            "lr_scale": scale})
        g["params"].append(p)
        g["names"].append(name)
    return list(groups.values())


class OptimizerError(ConfigError):
    """``optim.optimizer`` cannot run here (a missing package, a device it has no kernel
    for): the message says what would."""


def check_optimizer(cfg: OptimConfig, device: torch.device) -> None:
    """What ``optim.optimizer`` needs on ``device``, checked before anything is built (and
    by the dry run).

    Raises:
        OptimizerError: adamw8bit off CUDA, or without bitsandbytes.
    """
    if cfg.optimizer != "adamw8bit":
        return
    if device.type != "cuda":
        raise OptimizerError(
            f"optim.optimizer=adamw8bit is bitsandbytes' 8-bit AdamW, whose kernels run on "
            f"CUDA GPUs; this run is on {device.type}: use optim.optimizer=adamw here (and "
            "adamw8bit when training on a GPU)")
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as e:
        raise OptimizerError(
            f"optim.optimizer=adamw8bit needs bitsandbytes, which is not importable here "
            f"({e}): `pip install bitsandbytes`, or use optim.optimizer=adamw") from None


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """AdamW over :func:`param_groups` (``optim.optimizer``: torch's, or bitsandbytes'
    8-bit AdamW on CUDA). The LR is set each step by :func:`set_lr`.

    ``cfg.fused`` (``auto`` resolved on the parameters' device, trainer/speed.py) picks
    torch's fused kernel: one launch for every parameter instead of one per tensor, and
    under the grad scaler the unscale and the inf check run inside it (the optimizer's
    ``grad_scale`` / ``found_inf``), so the step itself needs no host sync.
    """
    groups = param_groups(model, cfg)
    if not groups:
        raise ValueError("the model has no trainable parameters")
    device = groups[0]["params"][0].device
    check_optimizer(cfg, device)
    if cfg.optimizer == "adamw8bit":  # bitsandbytes: 8-bit moments; the same groups and LR
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                             **optimizer_kwargs(cfg.fused, device))


def lr_at(step: int, cfg: OptimConfig, total_steps: int,
          progress: float | None = None) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warmup, then constant or
    cosine decay to ``min_lr_ratio * lr`` at ``total_steps``.

    ``progress`` (a time budget, ``train.max_time``: the fraction of it used, recorded in the
    training state, see trainer/budget.py) replaces the step-based progress of the decay,
    which then reaches the floor when the budget is used. The warmup stays in steps, and the
    decay starts at the progress where the warmup ended: after a warmup that used a fraction
    p of the budget, the LR above the floor drops by about 2.5 p^2 (0.6% at p = 0.05).
    """
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    if progress is None:
        span = max(1, total_steps - cfg.warmup_steps)
        progress = (step - cfg.warmup_steps) / span
    progress = min(1.0, max(0.0, progress))
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Write ``lr`` (times each group's ``lr_scale``) into every parameter group."""
    for g in optimizer.param_groups:
        g["lr"] = lr * g.get("lr_scale", 1.0)
