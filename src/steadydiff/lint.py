"""Warnings for dangerous-but-legal configs, printed at start-up and by ``train --dry-run``.

``config.py`` rejects what cannot work (unknown keys, out-of-range values). This module flags
what works but is likely to hurt: a learning rate far above what the model family is trained
with, fp16 attention without QK-norm, an EMA that cannot warm up within the run. Each warning
names the key and its value, says why it is dangerous, and what to do instead.

Checks are small functions in :data:`CHECKS` (presets are data): a check takes the config and
the device (None when unknown, e.g. ``--dry-run``) and returns a message or None. The
thresholds live in the tables below, next to their sources; docs/RELIABILITY.md lists them.

Nothing here imports torch at module load, so ``steadydiff train --dry-run`` stays light.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from .config import Config
from .kinds import ModelKind, Precision

if TYPE_CHECKING:
    import torch

# AdamW learning-rate ceilings per model family (optim.lr above this warns). Published
# recipes: ADM/DDPM UNets 1e-4..2e-4 (Dhariwal & Nichol 2021, Ho et al. 2020), DiT 1e-4
# (Peebles & Xie 2023); tiny CPU models tolerate ~10x more (configs/digits_*.yaml use 2e-3).
# The ceilings are ~15x (UNet) and ~10x (DiT, which diverges sooner: attention logit growth)
# the published values.
LR_CEILING: dict[ModelKind, float] = {"unet": 3e-3, "dit": 1e-3}

# Smallest norm epsilon each autocast precision resolves (model.*.norm_eps below warns).
# fp16: the smallest normal number is 6.1e-5 and below it values are subnormal with a fixed
#   spacing of 6e-8, so 1e-5 already carries 0.6% rounding, 1e-6 6%, and anything under 3e-8
#   is exactly 0 (a constant channel then divides by zero). Wherever a norm runs in fp16 (a
#   fused kernel, a custom norm, a model cast with .half()) eps must stay >= 1e-5.
# bf16: fp32's exponent range, so eps is representable, but only 8 significant bits: var + eps
#   rounds to var once var > 256·eps, so an eps under 1e-6 protects nothing but dead channels.
#   1e-6 is the smallest eps of published bf16 recipes (DiT, SD3).
NORM_EPS_FLOOR: dict[Precision, float] = {"fp16": 1e-5, "bf16": 1e-6}

MAX_GRAD_ACCUM = 16          # above: few optimizer steps per image seen, stale statistics
MAX_CLIP_NORM = 2.0          # global / per-layer max norm above which clipping rarely acts
LONG_RUN_STEPS = 1000        # a run this long without an intermediate checkpoint warns

Check = Callable[[Config, "torch.device | None"], "str | None"]


@dataclass(frozen=True)
class LintCheck:
    """One row of the lint table: a name, the keys it reads, and the check itself."""

    name: str
    keys: str
    fn: Check


# --------------------------------------------------------------------------- the checks


def _precision(cfg: Config, dev: "torch.device | None") -> str:
    """``train.precision``, with ``auto`` resolved when the device is known (the trainer
    lints the resolved config; a caller may pass an unresolved one)."""
    p = cfg.train.precision
    if p != "auto" or dev is None:
        return p
    from .trainer.speed import resolve_precision  # deferred: --dry-run stays torch-free

    return resolve_precision(p, dev)


def _lr_high(cfg: Config, _dev) -> str | None:
    kind, lr = cfg.model.kind, cfg.optim.lr
    if cfg.adapter.kind == "embedding":  # textual inversion trains a few rows at 5e-4..1e-2
        return None
    limit = LR_CEILING[kind]
    if lr <= limit:
        return None
    return (f"optim.lr={lr:g} is above {limit:g}, the usual ceiling for AdamW on a {kind} "
            f"(published recipes use 1e-4 to 2e-4): a learning rate this high is the most "
            f"common cause of loss spikes and divergence; lower it (e.g. optim.lr={limit / 10:g})"
            f" or lengthen optim.warmup_steps")


def _grad_accum_high(cfg: Config, _dev) -> str | None:
    n = cfg.train.grad_accum
    if n <= MAX_GRAD_ACCUM:
        return None
    return (f"train.grad_accum={n} is above {MAX_GRAD_ACCUM}: each optimizer step then "
            f"costs {n} forward/backward passes, so the run makes few updates per image seen "
            f"and a single bad micro-batch is averaged in silently; raise the micro-batch "
            f"(train.batch_size / train.grad_accum) instead, or accept fewer, larger steps "
            f"knowingly")


def _clip_high(cfg: Config, _dev) -> str | None:
    o = cfg.optim
    if o.clip_mode not in ("global", "per_layer") or o.grad_clip <= MAX_CLIP_NORM:
        return None
    return (f"optim.grad_clip={o.grad_clip:g} with clip_mode={o.clip_mode}: a max norm above "
            f"{MAX_CLIP_NORM:g} rarely acts (diffusion grad norms are typically well under 1 "
            f"after warmup), so a spike passes unclipped; use 1.0 (the ADM/DiT value)")


def _clip_off(cfg: Config, _dev) -> str | None:
    if cfg.optim.grad_clip > 0:
        return None
    return ("optim.grad_clip=0 disables gradient clipping: one outlier batch can take a "
            "full-size step and undo hours of training; use 1.0 unless you have measured "
            "that clipping hurts")


def _fp16_unguarded(cfg: Config, dev) -> str | None:
    if _precision(cfg, dev) != "fp16" or cfg.guard.enabled:
        return None
    return ("train.precision=fp16 with guard.enabled=false: fp16 overflows at 65504, and "
            "without the guard a persistent overflow is skipped step after step by the grad "
            "scaler with no precision fallback and no report; enable the guard or use bf16")


def _fp16_attention(cfg: Config, dev) -> str | None:
    if _precision(cfg, dev) != "fp16" or cfg.model.qk_norm or cfg.model.upcast_attention:
        return None
    if cfg.model.kind == "unet" and not cfg.model.unet.attention_resolutions:
        return None  # no attention layers
    return ("train.precision=fp16 with model.qk_norm=false: attention logits grow during "
            "training and q·k overflows fp16's range of 65504 (Dehghani et al. 2023, sec. "
            "3.1); set model.qk_norm=true or model.upcast_attention=true (q·k and softmax "
            "in fp32; the guard does it per layer after an overflow), or use bf16")


def _norm_eps_low(cfg: Config, dev) -> str | None:
    p = _precision(cfg, dev)
    floor = NORM_EPS_FLOOR.get(p)
    if floor is None:
        return None
    key = f"model.{cfg.model.kind}.norm_eps"
    eps = cfg.model.unet.norm_eps if cfg.model.kind == "unet" else cfg.model.dit.norm_eps
    if eps >= floor:
        return None
    norm = "GroupNorm" if cfg.model.kind == "unet" else "LayerNorm"
    why = ("under fp16's smallest normal number, 6.1e-5, an epsilon is mostly rounding, and "
           "under 3e-8 it is exactly 0" if p == "fp16" else
           "bf16 keeps 8 significant bits, so var + eps rounds to var for any live channel")
    return (f"{key}={eps:g} under train.precision={p} is below {floor:g}, the smallest {norm} "
            f"epsilon {p} resolves: {why}; a near-constant channel is then divided by ~0 and "
            f"blows up; set {key}={floor:g} or higher")


def _ema_too_slow(cfg: Config, _dev) -> str | None:
    t = cfg.train
    if t.ema_decay == 0:
        return None
    horizon = 1.0 / (1.0 - t.ema_decay)  # steps the average effectively spans
    updates = t.steps - t.ema_start
    if horizon <= updates:
        return None
    return (f"train.ema_decay={t.ema_decay:g} averages over ~{horizon:.0f} steps (1/(1-decay)), "
            f"more than the {max(updates, 0)} EMA updates this run makes (train.steps - "
            f"train.ema_start): the EMA weights, which are what gets sampled, will still be "
            f"mostly early weights at the end; use ema_decay <= {1 - 1 / max(updates, 2):.4g} "
            f"or train longer"
            + ("" if t.ema_posthoc else ", or set train.ema_posthoc=true and choose the EMA "
               "length after training (`steadydiff ema`, docs/ema.md)"))


def _warmup_too_long(cfg: Config, _dev) -> str | None:
    w, n = cfg.optim.warmup_steps, cfg.train.steps
    if w < n:
        return None
    return (f"optim.warmup_steps={w} is not shorter than train.steps={n}: the learning rate "
            f"never reaches optim.lr={cfg.optim.lr:g} (and the cosine decay never starts); "
            f"use a warmup of a few percent of the run")


def _cfg_dropout_unconditional(cfg: Config, _dev) -> str | None:
    # The default (0.1) is harmless on an unconditional model; only an explicit setting, or
    # a guidance scale at sampling, says the user expects classifier-free guidance.
    d, m = cfg.diffusion, cfg.model
    if m.num_classes or m.pretrained or m.text_encoder or not d.cfg_dropout:
        return None  # labels, or captions, to drop
    if "cfg_dropout" not in d.model_fields_set and cfg.sample.cfg_scale == 1.0:
        return None
    return (f"diffusion.cfg_dropout={d.cfg_dropout:g} (or sample.cfg_scale="
            f"{cfg.sample.cfg_scale:g}) on an unconditional model (model.num_classes=0): there "
            f"are no labels to drop, so it has no effect and classifier-free guidance is not "
            f"trained; set model.num_classes (and data.class_labels) for a conditional model")


def _cfg_untrained(cfg: Config, _dev) -> str | None:
    # a pretrained SD UNet learned the empty caption already; a model from scratch has not
    if not (cfg.model.num_classes or cfg.model.text_encoder) or cfg.diffusion.cfg_dropout > 0 \
            or cfg.sample.cfg_scale == 1:
        return None
    return (f"sample.cfg_scale={cfg.sample.cfg_scale:g} with diffusion.cfg_dropout=0: the "
            f"null class is never trained, so guidance extrapolates from an untrained "
            f"embedding; set diffusion.cfg_dropout=0.1 (Ho & Salimans 2022) or "
            f"sample.cfg_scale=1")


def _keep_tokens_unshuffled(cfg: Config, _dev) -> str | None:
    # kohya accepts keep_tokens without shuffle_caption (it then does nothing): say so
    d = cfg.data
    if not d.keep_tokens or d.caption_shuffle:
        return None
    return (f"data.keep_tokens={d.keep_tokens} keeps tags in place under data.caption_shuffle, "
            f"which is off: it has no effect; set data.caption_shuffle=true or remove it")


def _double_caption_dropout(cfg: Config, _dev) -> str | None:
    a, b = cfg.data.caption_dropout, cfg.diffusion.cfg_dropout
    if not (a and b):
        return None
    return (f"data.caption_dropout={a:g} and diffusion.cfg_dropout={b:g} both drop captions: "
            f"{1 - (1 - a) * (1 - b):.0%} of samples train unconditionally; set "
            f"diffusion.cfg_dropout=0 to get kohya's caption_dropout_rate alone")


def _ztsnr_eps(cfg: Config, _dev) -> str | None:
    d = cfg.diffusion
    if not d.zero_terminal_snr or d.prediction != "eps":
        return None
    return ("diffusion.zero_terminal_snr=true with prediction=eps: at the last timestep "
            "alpha = 0, x_t is pure noise and x0 = (x_t - sigma·eps)/alpha is undefined, so "
            "the model learns nothing about x0 there (x0_hat is set to 0); use "
            "diffusion.prediction=v (Lin et al. 2024, sec. 3.2)")


def _flow_sigma_sqrt(cfg: Config, _dev) -> str | None:
    d = cfg.diffusion
    if d.objective != "flow" or d.loss_weighting != "sigma_sqrt":
        return None
    return (f"diffusion.loss_weighting=sigma_sqrt multiplies the velocity loss by 1/sigma^2, "
            f"up to {d.timesteps ** 2:.0e} at the smallest trained sigma (1/diffusion.timesteps)"
            ": the least noisy samples dominate the loss and its spikes. diffusers' SD3 "
            "script and kohya apply it to the x0 error sigma^2*|v error|^2, where it gives back "
            "the plain velocity loss: for that, set diffusion.loss_weighting=uniform")


def _no_intermediate_checkpoint(cfg: Config, _dev) -> str | None:
    t = cfg.train
    if t.checkpoint_every > t.steps:
        why = f"train.checkpoint_every={t.checkpoint_every} is larger than train.steps={t.steps}"
    elif t.checkpoint_every == 0 and t.steps >= LONG_RUN_STEPS:
        why = f"train.checkpoint_every=0 on a {t.steps}-step run"
    else:
        return None
    return (f"{why}: the only checkpoint is written at the end, so a crash or kill loses the "
            f"whole run; checkpoint every few percent of the run")


def _single_checkpoint(cfg: Config, _dev) -> str | None:
    if cfg.train.keep_checkpoints > 1:
        return None
    return ("train.keep_checkpoints=1: a checkpoint damaged after it was written (disk "
            "error, a partial copy) leaves no older one to fall back to; keep at least 2")


def _hflip_digits(cfg: Config, _dev) -> str | None:
    if not (cfg.data.hflip and cfg.data.dataset == "digits"):
        return None
    return ("data.hflip=true on digits: a mirrored digit is not a digit (2, 3, 4, 5, 7, 9 "
            "change meaning), so the model learns a mixture; set data.hflip=false")


def _emulated_precision(cfg: Config, dev: "torch.device | None") -> str | None:
    p = _precision(cfg, dev)
    if dev is None or p == "fp32" or not cfg.train.allow_slow_precision:
        return None  # unknown device, or the trainer refuses outright (a clear error)
    from .trainer.precision import native_support  # deferred: --dry-run stays torch-free

    if native_support(p, dev):
        return None
    return (f"train.precision={p} on this {dev.type} device runs emulated (13-24x slower "
            f"than fp32 for matmuls, ~150x for a whole fp16 UNet step measured on a 2-core CPU) "
            f"and is allowed only by "
            f"train.allow_slow_precision=true; use fp32 here, or a device with native {p}")


# ---- speed on CUDA: a big speed-up left off (docs/speed.md). Each needs the device, so
# --dry-run on a machine without the GPU stays quiet; torch is imported only then.
# Rates of one A100 (NVIDIA's A100 datasheet, dense): fp32 19.5 TFLOPS, TF32 156, bf16 312.


def _cuda_tensor_cores(dev: "torch.device | None") -> bool:
    """A CUDA device with bf16/TF32 tensor cores (Ampere or later, or ROCm)."""
    if dev is None or dev.type != "cuda":
        return False
    from .trainer.precision import native_support  # deferred: --dry-run stays torch-free

    return native_support("bf16", dev)


def _speed_precision(cfg: Config, dev: "torch.device | None") -> str | None:
    if not _cuda_tensor_cores(dev) or _precision(cfg, dev) != "fp32":
        return None
    return ("train.precision=fp32 on a GPU with native bf16: bf16 autocast runs the matmuls "
            "and convolutions at twice the TF32 tensor-core rate (16x plain fp32 on an "
            "A100) and halves activation memory, with fp32's exponent range (weights and "
            "optimizer stay fp32); set train.precision=bf16 (or auto)")


def _speed_tf32(cfg: Config, dev: "torch.device | None") -> str | None:
    if cfg.train.tf32 or not _cuda_tensor_cores(dev) or _precision(cfg, dev) != "fp32":
        return None
    return ("train.tf32=false with fp32 on a GPU with tensor cores: fp32 matmuls and "
            "convolutions then skip the tensor cores (19.5 vs 156 TFLOPS on an A100); set "
            "train.tf32=true (10-bit mantissa inputs, fp32 accumulation), or use bf16")


def _speed_fused(cfg: Config, dev: "torch.device | None") -> str | None:
    if dev is None or dev.type != "cuda" or cfg.optim.fused is not False:
        return None
    return ("optim.fused=false on CUDA: torch's default (foreach) AdamW makes about ten "
            "passes over the parameters and their optimizer state each step, the fused kernel "
            "one; set optim.fused=true (or auto)")


def _speed_channels_last(cfg: Config, dev: "torch.device | None") -> str | None:
    if dev is None or dev.type != "cuda" or cfg.train.channels_last is not False:
        return None
    from .trainer.speed import conv_model

    if not conv_model(cfg):
        return None
    return ("train.channels_last=false for a convolutional model on CUDA: cuDNN's "
            "tensor-core convolutions work in NHWC, so NCHW activations are transposed "
            "around every convolution; set train.channels_last=true (or auto)")


CHECKS: tuple[LintCheck, ...] = (
    LintCheck("lr_high", "optim.lr, model.kind", _lr_high),
    LintCheck("grad_accum_high", "train.grad_accum", _grad_accum_high),
    LintCheck("clip_high", "optim.grad_clip, optim.clip_mode", _clip_high),
    LintCheck("clip_off", "optim.grad_clip", _clip_off),
    LintCheck("fp16_unguarded", "train.precision, guard.enabled", _fp16_unguarded),
    LintCheck("fp16_attention", "train.precision, model.qk_norm, model.upcast_attention",
              _fp16_attention),
    LintCheck("norm_eps_low", "model.unet.norm_eps / model.dit.norm_eps, train.precision",
              _norm_eps_low),
    LintCheck("ema_too_slow", "train.ema_decay, train.steps, train.ema_start", _ema_too_slow),
    LintCheck("warmup_too_long", "optim.warmup_steps, train.steps", _warmup_too_long),
    LintCheck("cfg_dropout_unconditional", "diffusion.cfg_dropout, sample.cfg_scale, "
              "model.num_classes", _cfg_dropout_unconditional),
    LintCheck("cfg_untrained", "sample.cfg_scale, diffusion.cfg_dropout", _cfg_untrained),
    LintCheck("keep_tokens_unshuffled", "data.keep_tokens, data.caption_shuffle",
              _keep_tokens_unshuffled),
    LintCheck("double_caption_dropout", "data.caption_dropout, diffusion.cfg_dropout",
              _double_caption_dropout),
    LintCheck("ztsnr_eps", "diffusion.zero_terminal_snr, diffusion.prediction", _ztsnr_eps),
    LintCheck("flow_sigma_sqrt", "diffusion.objective, diffusion.loss_weighting",
              _flow_sigma_sqrt),
    LintCheck("no_intermediate_checkpoint", "train.checkpoint_every, train.steps",
              _no_intermediate_checkpoint),
    LintCheck("single_checkpoint", "train.keep_checkpoints", _single_checkpoint),
    LintCheck("hflip_digits", "data.hflip, data.dataset", _hflip_digits),
    LintCheck("emulated_precision", "train.precision, train.allow_slow_precision, device",
              _emulated_precision),
    LintCheck("speed_precision", "train.precision, device", _speed_precision),
    LintCheck("speed_tf32", "train.tf32, train.precision, device", _speed_tf32),
    LintCheck("speed_fused", "optim.fused, device", _speed_fused),
    LintCheck("speed_channels_last", "train.channels_last, model.kind, device",
              _speed_channels_last),
)


# --------------------------------------------------------------------------- public


def lint(cfg: Config, device: "torch.device | None" = None) -> list[str]:
    """Warnings for dangerous-but-legal settings in ``cfg``.

    Args:
        cfg: a validated config.
        device: the device the run will use; None skips the device-dependent checks.

    Returns:
        One message per triggered check, in :data:`CHECKS` order (empty when all is well).
        Each names the key and value, why it is dangerous, and what to do.
    """
    return [msg for c in CHECKS if (msg := c.fn(cfg, device)) is not None]


def lint_report(cfg: Config, device: "torch.device | None" = None) -> str:
    """The warnings of :func:`lint` as text, one ``warning: ...`` line each ('' when none)."""
    return "".join(f"warning: {m}\n" for m in lint(cfg, device))


__all__ = ["CHECKS", "LR_CEILING", "NORM_EPS_FLOOR", "LintCheck", "lint", "lint_report"]
