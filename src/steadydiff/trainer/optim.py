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
    depth)`` when the model exposes ``param_depth``; times a text encoder's own LR over
    ``optim.lr`` where ``optim.lr_text_encoder`` sets one and the model names its text
    encoders' parameters, ``text_encoder_of``) and its weight decay (0 for norms, biases
    and embeddings). Returns a list of dicts for ``torch.optim.AdamW``.

    Raises:
        ConfigError: ``optim.lr_text_encoder`` for a model without trained text encoders,
            or a list of another length than the model's text encoders.
    """
    owners = {f"{mn}.{pn}" if mn else pn: m
              for mn, m in model.named_modules() for pn, _ in m.named_parameters(recurse=False)}
    use_depth = cfg.layer_decay < 1.0 and hasattr(model, "param_depth")
    part_scale = _text_encoder_scales(model, cfg)
    groups: dict[tuple[float, float], dict] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        wd = 0.0 if _no_decay(owners[name], name, p) else cfg.weight_decay
        scale = 1.0
        if use_depth:
            scale = cfg.layer_decay ** (model.max_depth - model.param_depth(name))
        if part_scale:
            i = model.text_encoder_of(name)
            if i is not None:
                scale *= part_scale[i]
        g = groups.setdefault((wd, scale), {"params": [], "names": [], "weight_decay": wd,
                                            "lr_scale": scale})
        g["params"].append(p)
        g["names"].append(name)
    return list(groups.values())


def _text_encoder_scales(model: nn.Module, cfg: OptimConfig) -> list[float] | None:
    """Each text encoder's LR over ``optim.lr`` (``optim.lr_text_encoder``), or None."""
    te = cfg.lr_text_encoder
    if te is None:
        return None
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    which = getattr(model, "text_encoder_of", None)
    trained = sorted({i for n in names if which and (i := which(n)) is not None})
    if not trained:
        raise ConfigError(f"optim.lr_text_encoder={te}, but no text encoder is trained in "
                          "this run: set adapter.text_encoder=true (a LoRA on the text "
                          "encoders too), or remove optim.lr_text_encoder")
    count = model.text_encoder_count
    lrs = te if isinstance(te, list) else [te] * count
    if len(lrs) != count:
        raise ConfigError(f"optim.lr_text_encoder has {len(lrs)} learning rates; this model "
                          f"has {count} text encoder(s): give one, or one per text encoder")
    return [x / cfg.lr for x in lrs]


def describe_lrs(model: nn.Module, cfg: OptimConfig) -> str | None:
    """The learning rate of each trained part, printed at start where they differ:
    ``unet 0.0001, text_encoder 5e-05``; None where every part has ``optim.lr``."""
    scales = _text_encoder_scales(model, cfg)
    if scales is None:
        return None
    parts = [f"{model.family.denoiser} {cfg.lr:g}"]
    parts += [f"{spec.part} {cfg.lr * s:g}" for spec, s in zip(model.family.text, scales)
              if any(p.requires_grad for p in (getattr(model, spec.part, None) or
                                                nn.Module()).parameters())]
    return "learning rates: " + ", ".join(parts) + " (warmup and decay scale each alike)"


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
