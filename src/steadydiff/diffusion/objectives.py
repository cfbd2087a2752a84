"""The training objective: timestep sampling, forward noising, targets, loss weights.

``diffusion.objective`` picks one of three (docs/objectives.md):
  ddpm: x_t = alpha_t·x0 + sigma_t·eps, alpha² + sigma² = 1 (Ho et al. 2020, eq. 4), on a
      discrete schedule; the target is eps (Ho et al. 2020), x0, or v = alpha·eps - sigma·x0
      (Salimans & Ho 2022, §4); loss weights uniform or min-SNR-γ.
  flow: x = (1-σ)·x0 + σ·ε, the target the velocity ε - x0 (diffusion/flow.py); σ from a
      density over [0, 1] (uniform, logit_normal, mode, sigmoid), shifted; weights uniform,
      sigma_sqrt or cosmap on the velocity error.
  edm: x = x0 + σ·ε with ln σ ~ N(P_mean, P_std²); the network F sees c_in·x and regresses
      (x0 - c_skip·x)/c_out, whose plain MSE is EDM's λ(σ)-weighted loss (diffusion/edm.py).
The schedule object (schedules.py) holds each objective's levels; this module draws, noises
and scores, and is the one place that knows which objective converts a network output how.
All randomness of one loss evaluation comes from one explicit ``torch.Generator``, in a fixed
order (t, noise, label dropout), or from :class:`Draws` made that way for a whole global batch,
so replaying a batch reproduces it bit for bit; the stability guard relies on this to re-run a
suspicious step, and distributed training on it to be independent of the world size.
"""

from __future__ import annotations

from dataclasses import dataclass
import torch
from torch import Tensor, nn

from ..config import DiffusionConfig
from ..kinds import LOSS_WEIGHTINGS, PREDICTIONS, TIMESTEP_SAMPLINGS, Prediction
from . import edm, flow
from .flow import draw_sigmas
from .schedules import AnySchedule

__all__ = ["Draws", "LossOutput", "context_dim_of", "draw", "drop_condition",
           "is_conditional", "null_condition", "sample_timesteps", "sample_levels", "q_sample",
           "training_target", "to_x0_eps", "output_to_x0_eps", "loss_weights",
           "diffusion_loss"]


def _bcast(a: Tensor, x: Tensor) -> Tensor:
    """Per-sample coefficient (N,) -> (N, 1, ..., 1) to broadcast against x; scalars pass."""
    return a.reshape(a.shape[0], *([1] * (x.ndim - 1))) if a.ndim == 1 else a


def num_classes_of(model: nn.Module) -> int:
    """``model.num_classes``, looking through a DDP wrapper (``.module``) if needed."""
    n = getattr(model, "num_classes", None)
    if n is None and hasattr(model, "module"):
        n = getattr(model.module, "num_classes", None)
    if n is None:
        raise AttributeError(f"{type(model).__name__} has no num_classes attribute; the denoiser "
                             "contract needs it (0 for unconditional models)")
    return int(n)


def _unwrap(model: nn.Module) -> nn.Module:
    return model.module if hasattr(model, "module") and not hasattr(model, "num_classes") \
        else model


def context_dim_of(model: nn.Module) -> int:
    """The width D of the text context a text-conditioned model attends to (0: none)."""
    return int(getattr(_unwrap(model), "context_dim", 0) or 0)


def is_conditional(model: nn.Module) -> bool:
    """Whether ``model`` takes a condition y: class labels (``num_classes`` > 0) or a text
    context (``context_dim`` > 0)."""
    return num_classes_of(model) > 0 or context_dim_of(model) > 0


def null_condition(model: nn.Module, y: Tensor) -> Tensor:
    """The "no condition" of classifier-free guidance, shaped like ``y``: the null class
    ``num_classes`` for class labels (N,); for a text context (N, L, D) the model's own
    ``null_condition(y)`` (the empty caption's encoding)."""
    m = _unwrap(model)
    f = getattr(m, "null_condition", None)
    if callable(f):
        return f(y)
    return torch.full_like(y, num_classes_of(model))


def drop_condition(model: nn.Module, y: Tensor, drop: Tensor) -> Tensor:
    """``y`` with the samples where ``drop`` (N,) bool is set replaced by the null
    condition (label dropout, Ho & Salimans 2022; caption dropout for text)."""
    mask = drop.reshape(-1, *([1] * (y.ndim - 1)))
    return torch.where(mask, null_condition(model, y), y)


@dataclass
class LossOutput:
    """Result of :func:`diffusion_loss`.

    loss: 0-dim mean loss (attached to the graph); per_sample: (N,) weighted per-sample losses
    (attached; detach before storing); t: (N,) long t-bucket coordinates in [0, T): the drawn
    timesteps (ddpm), the noise levels mapped by the schedule's ``bucket`` (flow, edm).
    """

    loss: Tensor
    per_sample: Tensor
    t: Tensor


def sample_timesteps(n: int, cfg: DiffusionConfig, T: int, generator: torch.Generator | None,
                     device: torch.device | str | None = None) -> Tensor:
    """Draw n training timesteps in [0, T).

    uniform: each integer step equally likely (Ho et al. 2020).
    logit_normal, mode, sigmoid: t = floor(u·T) with u in [0, 1] from that density
        (:func:`steadydiff.diffusion.flow.draw_sigmas`; Esser et al. 2024, SD3 §3.1):
        logit_normal concentrates training on intermediate noise levels (m, s =
        cfg.logit_mean/logit_std), mode (cfg.mode_scale) too with heavier tails, sigmoid is
        kohya's (cfg.sigmoid_scale).

    Returns:
        (n,) long tensor on ``device``.
    """
    if cfg.timestep_sampling == "uniform":
        return torch.randint(0, T, (n,), generator=generator, device=device)
    if cfg.timestep_sampling not in TIMESTEP_SAMPLINGS:
        raise ValueError(f"unknown diffusion.timestep_sampling {cfg.timestep_sampling!r}; "
                         f"valid: {', '.join(TIMESTEP_SAMPLINGS)}")
    u = draw_sigmas(n, cfg.timestep_sampling, generator, device=device,
                    logit_mean=cfg.logit_mean, logit_std=cfg.logit_std,
                    mode_scale=cfg.mode_scale, sigmoid_scale=cfg.sigmoid_scale)  # [0, 1]
    return (u * T).long().clamp_(0, T - 1)


def sample_levels(n: int, cfg: DiffusionConfig, T: int, generator: torch.Generator | None,
                  device: torch.device | str | None = None) -> Tensor:
    """The objective's training draw, one call on ``generator``: ddpm, timesteps (n,) long
    (:func:`sample_timesteps`); flow, the density's u (n,) float32 in [0, 1], before the
    schedule's clamp and shift (:meth:`FlowSchedule.from_draw`); edm, σ (n,) float32 with
    ln σ ~ N(p_mean, p_std²)."""
    if cfg.objective == "flow":
        return draw_sigmas(n, cfg.timestep_sampling, generator, device=device,
                           logit_mean=cfg.logit_mean, logit_std=cfg.logit_std,
                           mode_scale=cfg.mode_scale, sigmoid_scale=cfg.sigmoid_scale)
    if cfg.objective == "edm":
        return edm.draw_sigmas(n, generator, p_mean=cfg.edm.p_mean, p_std=cfg.edm.p_std,
                               device=device)
    return sample_timesteps(n, cfg, T, generator, device)


def q_sample(x0: Tensor, alpha: Tensor, sigma: Tensor, noise: Tensor) -> Tensor:
    """Sample q(x_t | x0) = N(alpha·x0, sigma²·I) with the given noise (Ho et al. 2020, eq. 4).

    Args:
        x0: (N, C, H, W) clean data. alpha, sigma: (N,) or scalars. noise: like x0.
    Returns:
        x_t, like x0 (coefficients cast to x0's dtype).
    """
    a, s = _bcast(alpha, x0).to(x0.dtype), _bcast(sigma, x0).to(x0.dtype)
    return a * x0 + s * noise


def training_target(prediction: Prediction, x0: Tensor, noise: Tensor, alpha: Tensor,
                    sigma: Tensor) -> Tensor:
    """The regression target for ``prediction``: eps, x0, or v = alpha·eps - sigma·x0.

    Args:
        x0, noise: (N, C, H, W). alpha, sigma: (N,) or scalars.
    """
    if prediction == "eps":
        return noise
    if prediction == "x0":
        return x0
    if prediction == "v":
        # Salimans & Ho 2022, eq. after (9): v is the velocity of (alpha, sigma) on the circle.
        return _bcast(alpha, x0) * noise - _bcast(sigma, x0) * x0
    raise ValueError(f"unknown prediction {prediction!r}; valid: {', '.join(PREDICTIONS)}")


def to_x0_eps(prediction: Prediction, out: Tensor, x_t: Tensor, alpha: Tensor,
              sigma: Tensor) -> tuple[Tensor, Tensor]:
    """Convert a model output into the pair (x0_hat, eps_hat) consistent with x_t.

    Every conversion is affine in ``out`` (which is why classifier-free guidance may mix raw
    outputs, see samplers.Denoiser) and satisfies x_t = alpha·x0_hat + sigma·eps_hat.

    Zero terminal SNR: at alpha = 0 an eps prediction carries no information about x0
    (x_t is pure noise), so x0_hat is set to 0, the mean of centred data, instead of dividing
    by zero. With zero_terminal_snr, v or x0 prediction is recommended (Lin et al. 2024, §3.2);
    v gives x0_hat = -v exactly there. Likewise sigma = 0 (ᾱ = 1) with an x0 prediction
    gives eps_hat = 0.

    Args:
        prediction: what ``out`` predicts. out, x_t: (N, C, H, W). alpha, sigma: (N,) or scalars.
    Returns:
        (x0_hat, eps_hat), both like x_t.
    """
    a, s = _bcast(alpha, x_t), _bcast(sigma, x_t)
    if prediction == "eps":
        eps = out
        ok = a > 0
        # Double-where: never divides by zero, so no NaN/inf even in the discarded branch.
        x0 = torch.where(ok, (x_t - s * eps) / torch.where(ok, a, torch.ones_like(a)),
                         torch.zeros_like(x_t))
    elif prediction == "x0":
        x0 = out
        ok = s > 0
        eps = torch.where(ok, (x_t - a * x0) / torch.where(ok, s, torch.ones_like(s)),
                          torch.zeros_like(x_t))
    elif prediction == "v":
        # From v = a·eps - s·x0 and x_t = a·x0 + s·eps with a² + s² = 1 (Salimans & Ho 2022).
        x0 = a * x_t - s * out
        eps = s * x_t + a * out
    else:
        raise ValueError(f"unknown prediction {prediction!r}; valid: {', '.join(PREDICTIONS)}")
    return x0, eps


def output_to_x0_eps(schedule: AnySchedule, prediction: Prediction, out: Tensor, x: Tensor,
                     t: Tensor | float) -> tuple[Tensor, Tensor]:
    """(x0_hat, eps_hat) from a network output at level ``t``, for any objective: ddpm's
    ``prediction`` through :func:`to_x0_eps`; flow's velocity and edm's F through their
    schedule. Affine in ``out`` for every objective (guidance mixes raw outputs)."""
    if schedule.objective == "ddpm":
        alpha, sigma = schedule.alpha_sigma(t)
        return to_x0_eps(prediction, out, x, alpha, sigma)
    return schedule.to_x0_eps(out, x, t)


def loss_weights(cfg: DiffusionConfig, snr: Tensor) -> Tensor:
    """Per-sample weights on the prediction-space MSE.

    uniform: 1. min_snr: min-SNR-γ (Hang et al. 2023, eq. 9-10): the weight that makes the
    loss equal min(snr, γ)·‖x0 - x0_hat‖², given ‖eps err‖² = snr·‖x0 err‖² and
    ‖v err‖² = (snr+1)·‖x0 err‖²:
        eps: min(snr, γ)/snr = min(1, γ/snr)      (1 at snr = 0, 0 at snr = inf)
        x0:  min(snr, γ)
        v:   min(snr, γ)/(snr + 1)                (0 at snr = inf)
    Args:
        snr: (N,) float SNR values, may contain 0 and inf.
    Returns:
        (N,) weights, finite everywhere.
    """
    if cfg.loss_weighting == "uniform":
        return torch.ones_like(snr)
    if cfg.loss_weighting != "min_snr":
        raise ValueError(f"unknown diffusion.loss_weighting {cfg.loss_weighting!r}; "
                         f"valid: {', '.join(LOSS_WEIGHTINGS)}")
    g = cfg.min_snr_gamma
    if cfg.prediction == "eps":
        # γ/0 = inf -> clamped to 1; γ/inf = 0. No 0/0.
        return (g / snr).clamp(max=1.0)
    if cfg.prediction == "x0":
        return snr.clamp(max=g)
    if cfg.prediction == "v":
        return snr.clamp(max=g) / (snr + 1.0)  # inf: γ/inf = 0
    raise ValueError(f"unknown prediction {cfg.prediction!r}; valid: {', '.join(PREDICTIONS)}")


@dataclass
class Draws:
    """The random draws of one loss evaluation: the levels t (N,) as :func:`sample_levels`
    draws them (ddpm: long timesteps; flow, edm: float32), noise like x0, uniforms u (N,) for
    label dropout (dropped where u < cfg_dropout), and with ``diffusion.noise_offset`` the
    offsets (N, C, 1, 1) added to the noise. ``weight`` (N,), not a draw: each sample's
    data weight (a DreamBooth regularization image's ``data.prior_loss_weight``; None: 1),
    riding with the draws so every micro-batch, replay and rerun slices it alike."""

    t: Tensor
    noise: Tensor
    u: Tensor
    offset: Tensor | None = None
    weight: Tensor | None = None

    def __getitem__(self, s: slice) -> "Draws":
        return Draws(self.t[s], self.noise[s], self.u[s],
                     None if self.offset is None else self.offset[s],
                     None if self.weight is None else self.weight[s])


def draw(n: int, shape: tuple[int, ...], cfg: DiffusionConfig, T: int,
         generator: torch.Generator, device: torch.device | str | None = None,
         dtype: torch.dtype = torch.float32) -> Draws:
    """Draw, in this order and all from ``generator``, t (n,) (:func:`sample_levels`),
    noise (n, *shape), u (n,),
    and with ``cfg.noise_offset`` > 0 the offsets (n, C, 1, 1) (drawn last, so runs without
    it replay as before).

    The trainer draws once per step for the *global* batch and gives each rank and
    micro-batch its slice, so the randomness of sample i of global batch b does not depend
    on how the batch is split (world size, gradient accumulation).
    """
    t = sample_levels(n, cfg, T, generator, device)
    noise = torch.randn((n, *shape), generator=generator, device=device, dtype=dtype)
    u = torch.rand(n, generator=generator, device=device)
    offset = None
    if cfg.noise_offset > 0:
        offset = torch.randn((n, shape[0], *([1] * (len(shape) - 1))), generator=generator,
                             device=device, dtype=dtype)
    return Draws(t, noise, u, offset)


def diffusion_loss(model: nn.Module, x0: Tensor, y: Tensor | None, schedule: AnySchedule,
                   cfg: DiffusionConfig, generator: torch.Generator | None = None, *,
                   draws: Draws | None = None) -> LossOutput:
    """One evaluation of the denoising loss on a batch, for ``cfg.objective``.

    Randomness: either ``draws`` (pre-drawn, see :func:`draw`), or :func:`draw` from
    ``generator``: the levels (N,), noise like x0, and the label-dropout uniforms (N,); where
    u < cfg.cfg_dropout (and y is given) y is replaced by the null condition (the null class
    ``model.num_classes``, or a text model's empty caption: :func:`null_condition`; Ho &
    Salimans 2022). The per-sample loss is the weighted MSE in the network's output space
    (ddpm: the prediction's; flow: the velocity's; edm: F's, which is EDM's λ(σ)-weighted
    denoiser loss), averaged over C, H, W; it is computed in float32 whatever the autocast
    dtype of the model output. No host syncs.

    Args:
        model: denoiser ``model(x, t, y) -> out``, t (N,) float32 (the schedule's
            ``model_time``: ddpm timesteps, flow σ·T, edm T·¼ln σ).
        x0: (N, C, H, W) clean data in [-1, 1] (or latents). y: (N,) long labels, (N, L, D)
            text context, or None.
        schedule: the objective's schedule (:func:`make_schedule`). cfg: the diffusion section.
        generator: torch.Generator on x0's device (when ``draws`` is None).
        draws: the draws for exactly these N samples.
    Returns:
        LossOutput(loss 0-dim, per_sample (N,), t (N,) long t-bucket coordinates).
    """
    n, device = x0.shape[0], x0.device
    if draws is None:
        if generator is None:
            raise ValueError("diffusion_loss needs a generator or pre-drawn draws")
        draws = draw(n, tuple(x0.shape[1:]), cfg, schedule.T, generator, device, x0.dtype)
    if draws.t.shape[0] != n or draws.noise.shape != x0.shape:
        raise ValueError(f"draws for {draws.t.shape[0]} samples of {tuple(draws.noise.shape)} "
                         f"do not match the batch {tuple(x0.shape)}")
    noise = draws.noise.to(x0.dtype)
    if cfg.noise_offset > 0 and draws.offset is not None:
        # offset noise (Guttenberg 2023): a per-channel constant added to the noise lets the
        # model change an image's mean brightness, which plain noise barely teaches
        noise = noise + cfg.noise_offset * draws.offset.to(x0.dtype)
    lv = schedule.from_draw(draws.t)  # ddpm: t (N,) long; flow, edm: σ (N,) float32
    alpha, sigma = schedule.alpha_sigma(lv)  # (N,) float32
    x_t = q_sample(x0, alpha, sigma, noise)  # (N, C, H, W)

    if y is not None:
        if not is_conditional(model):
            raise ValueError("labels y were given but the model is unconditional "
                             "(model.num_classes == 0); pass y=None")
        if cfg.cfg_dropout > 0:
            y = drop_condition(model, y, draws.u < cfg.cfg_dropout)

    out = model(schedule.model_input(x_t, lv), schedule.model_time(lv), y)
    if schedule.objective == "ddpm":
        target = training_target(cfg.prediction, x0, noise, alpha, sigma)
    else:
        target = schedule.target(x0, noise, x_t, lv)
    # MSE in float32: under bf16/fp16 autocast the output is low precision, the loss must not be.
    err = (out.float() - target.float()).square()
    per_sample = err.mean(dim=tuple(range(1, err.ndim)))  # (N,)
    if cfg.loss_weighting != "uniform":
        if schedule.objective == "flow":
            per_sample = per_sample * flow.loss_weight(cfg.loss_weighting, lv)
        else:
            per_sample = per_sample * loss_weights(cfg, schedule.snr(lv))
    if draws.weight is not None:  # prior preservation: mean_i(w_i loss_i), kohya's form
        per_sample = per_sample * draws.weight.to(per_sample.device, per_sample.dtype)
    return LossOutput(loss=per_sample.mean(), per_sample=per_sample, t=schedule.bucket(lv))
