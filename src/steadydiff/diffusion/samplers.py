"""Samplers: plain functions over an explicit, descending array of noise levels.

Every sampler has the shape ``sampler(denoise, x, ts, schedule, ...) -> x0``:
``denoise(x, t) -> (x0_hat, eps_hat)`` is the model wrapped by :class:`Denoiser` (the
objective's output conversion, classifier-free guidance and clipping handled there, once),
``ts`` holds the levels at which the model is evaluated (ddpm: timesteps descending from about
T-1; flow, edm: σ from the schedule's ``grid``), and after the last entry every sampler takes
one final step to clean data (alpha = 1, sigma = 0), so the result is the x0 estimate of the
last model call. Multistep memory lives in locals; there is no step counter anywhere, and the
only randomness is the explicit generator (ddpm, ddim with eta > 0).

ddpm, ddim and dpmpp_2m are written over the pair (alpha, sigma) of x = alpha·x0 + sigma·eps
and hold for any such process (Kingma et al. 2021, App. A; Lu et al. 2022), so they sample the
flow and edm objectives too. euler and heun belong to their objective's ODE: for flow the
flow-match Euler/Heun of diffusion/flow.py (diffusers' FlowMatch schedulers), for edm Karras
et al. 2022's Euler/Heun (Alg. 1, diffusion/edm.py), for ddpm Euler in σ̃ = sigma/alpha
(heun is not offered there: kinds.OBJECTIVE_SAMPLERS).

The step coefficients are computed once per call in float64 on the CPU (python floats), so the
loop adds no host syncs. Zero terminal SNR (alpha = 0 at ts[0], also flow's σ = 1) is handled
by writing every step in a form that never divides by alpha_t: see the comments in each
sampler.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor, nn

from ..kinds import OBJECTIVE_SAMPLERS, PREDICTIONS, Prediction, SamplerName, Spacing
from . import edm, flow
from .objectives import is_conditional, null_condition, output_to_x0_eps
from .schedules import AnySchedule, sampling_timesteps

__all__ = ["Denoiser", "sampling_timesteps", "ddpm", "ddim", "dpmpp_2m", "euler", "heun",
           "SAMPLERS", "USES_ETA", "sample"]

DenoiseFn = Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]


class Denoiser:
    """Wrap ``model(x, t, y)`` into ``denoise(x, t) -> (x0_hat, eps_hat)``.

    The network is called as the objective trained it: ``model(schedule.model_input(x, t),
    schedule.model_time(t), y)`` (ddpm: x and the timestep; flow: x and σ·T; edm: c_in·x and
    T·¼ln σ), and its output converted by :func:`output_to_x0_eps`.

    Classifier-free guidance (Ho & Salimans 2022, eq. 6): when ``y`` is given and
    ``cfg_scale != 1``, one forward of the batch [x; x] with labels [y; null] and
    out = uncond + s·(cond - uncond). Mixing raw outputs is exactly guidance in eps space (and
    in x0 space) for every prediction and objective: the conversion is affine in the output
    for fixed (x_t, t) and the mixing weights (1-s, s) sum to one, so the mix commutes with it.
    ``cfg_scale`` is ignored when ``y`` is None (an unconditional model has nothing to guide).

    With ``clip_x0`` the x0 estimate is clamped to [-1, 1] and eps recomputed from it, so the
    pair stays consistent with x_t = alpha·x0 + sigma·eps (as in DDPM/DDIM reference samplers).

    Args:
        model: denoiser ``model(x, t, y)`` with attribute ``num_classes``.
        schedule: the training schedule (any objective's). prediction: what a ddpm model
            predicts (flow and edm models predict their own quantity; it is ignored there).
        cfg_scale: guidance scale s (1: plain conditional, 0: unconditional).
        y: (N,) long labels, (N, L, D) text context, or None. clip_x0: clamp x0_hat to
            [-1, 1] (pixel models; latents are not bounded: pass False).
        uncond: what guidance steers away from, shaped like y (a negative prompt's
            encoding); None: the null condition.
    """

    def __init__(self, model: nn.Module, schedule: AnySchedule, prediction: Prediction,
                 cfg_scale: float = 1.0, y: Tensor | None = None, clip_x0: bool = True,
                 uncond: Tensor | None = None) -> None:
        if prediction not in PREDICTIONS:
            raise ValueError(f"unknown prediction {prediction!r}; valid: {', '.join(PREDICTIONS)}")
        self.model, self.schedule, self.prediction = model, schedule, prediction
        self.cfg_scale, self.y, self.clip_x0 = float(cfg_scale), y, clip_x0
        self.null: Tensor | None = None
        if y is not None:
            if not is_conditional(model):
                raise ValueError("labels y were given but the model is unconditional "
                                 "(model.num_classes == 0); pass y=None")
            # the null class, or the empty caption; a negative prompt's encoding replaces it
            self.null = null_condition(model, y) if uncond is None else uncond
            if self.null.shape != y.shape:
                raise ValueError(f"the unconditional input has shape {tuple(self.null.shape)}"
                                 f", the condition {tuple(y.shape)}: they must match")
        self.guided = y is not None and self.cfg_scale != 1.0

    def __call__(self, x: Tensor, t: Tensor | float) -> tuple[Tensor, Tensor]:
        """Args: x (N, C, H, W); t a scalar or (N,) level (ddpm: a timestep in [0, T-1];
        flow, edm: σ). Returns: (x0_hat, eps_hat), each (N, C, H, W)."""
        n = x.shape[0]
        sch = self.schedule
        t = torch.as_tensor(t, dtype=torch.float32, device=x.device)
        tn = t.expand(n) if t.ndim == 0 else t  # (N,)
        alpha, sigma = sch.alpha_sigma(t)  # scalar or (N,)
        y = self.y
        if y is not None and y.shape[0] != n:
            raise ValueError(f"y has {y.shape[0]} labels for a batch of {n}")
        xin, tm = sch.model_input(x, tn), sch.model_time(tn)
        if not self.guided:
            out = self.model(xin, tm, y)
        elif self.cfg_scale == 0.0:  # pure unconditional: half the work
            out = self.model(xin, tm, self.null)
        else:
            null_y = self.null
            both = self.model(torch.cat([xin, xin]), torch.cat([tm, tm]), torch.cat([y, null_y]))
            cond, uncond = both.float().chunk(2)  # (N, C, H, W) each
            out = uncond + self.cfg_scale * (cond - uncond)
        x0, eps = output_to_x0_eps(sch, self.prediction, out.float(), x, t)
        if self.clip_x0:
            x0 = x0.clamp(-1.0, 1.0)
            s = sigma.reshape(-1, *([1] * (x.ndim - 1))) if sigma.ndim == 1 else sigma
            a = alpha.reshape(-1, *([1] * (x.ndim - 1))) if alpha.ndim == 1 else alpha
            eps = torch.where(s > 0, (x - a * x0) / torch.where(s > 0, s, torch.ones_like(s)),
                              eps)
        return x0, eps


# ---------------------------------------------------------------------- shared plumbing


def _levels(schedule: AnySchedule, ts: Tensor) -> tuple[list[float], list[float], list[float]]:
    """alpha, sigma, λ = log(alpha²/sigma²) (float64, as python floats) at each level in ts,
    plus the clean level (alpha = 1, sigma = 0, λ = +inf) appended as the final target."""
    if ts.ndim != 1 or ts.numel() == 0:
        raise ValueError(f"ts must be a non-empty 1-D tensor of timesteps, got shape "
                         f"{tuple(ts.shape)}")
    tc = ts.detach().to("cpu", torch.float64)
    if (tc[1:] > tc[:-1]).any():
        raise ValueError("ts must be descending (from noisy to clean)")
    return schedule.levels(tc)


def _randn(x: Tensor, generator: torch.Generator | None) -> Tensor:
    return torch.randn(x.shape, generator=generator, device=x.device, dtype=x.dtype)


# ---------------------------------------------------------------------- samplers


def ddpm(denoise: DenoiseFn, x: Tensor, ts: Tensor, schedule: AnySchedule,
         generator: torch.Generator | None = None) -> Tensor:
    """Ancestral sampling from the DDPM posterior q(x_s | x_t, x0_hat) (Ho et al. 2020, eq. 6-7),
    generalised to any pair of steps t > s as in Kingma et al. 2021, App. A:
        mean = (alpha_t·sigma_s²)/(alpha_s·sigma_t²)·x_t + alpha_s·(1 - e^{λ_t-λ_s})·x0_hat
        var  = sigma_s²·(1 - e^{λ_t-λ_s})                    (= β̃, the posterior variance)
    Neither divides by alpha_t, so alpha_t = 0 (zero terminal SNR) is fine; the final step to
    clean data has var = 0 and mean = x0_hat.

    Args:
        denoise: (x, t) -> (x0_hat, eps_hat). x: (N, C, H, W) noise at ts[0].
        ts: (S,) descending timesteps. generator: source of the per-step noise.
    Returns:
        (N, C, H, W) the final x0 estimate.
    """
    a, s, lam = _levels(schedule, ts)
    tdev = ts.to(x.device, torch.float32)
    for i in range(len(tdev)):
        x0, _ = denoise(x, tdev[i])  # (N, C, H, W)
        # r = 1 - SNR_t/SNR_s in [0, 1]: the share of sigma_s² the posterior still has to add.
        # expm1 keeps it accurate when adjacent steps are close (r ~ 1e-4 at T steps).
        r = -math.expm1(lam[i] - lam[i + 1])
        c_x = a[i] * s[i + 1] ** 2 / (a[i + 1] * s[i] ** 2)
        x = c_x * x + a[i + 1] * r * x0
        var = s[i + 1] ** 2 * r
        if var > 0:  # the last step (to sigma = 0) draws nothing
            x = x + math.sqrt(var) * _randn(x, generator)
    return x


def ddim(denoise: DenoiseFn, x: Tensor, ts: Tensor, schedule: AnySchedule,
         generator: torch.Generator | None = None, eta: float = 0.0) -> Tensor:
    """DDIM (Song et al. 2021, eq. 12): x_s = alpha_s·x0_hat + √(sigma_s² - c²)·eps_hat + c·z,
    c = eta·√β̃ (eta = 0: deterministic; eta = 1: the DDPM posterior). No division by alpha_t.

    Args:
        denoise, x, ts: as in :func:`ddpm`. generator: noise source when eta > 0.
        eta: stochasticity in [0, 1].
    Returns:
        (N, C, H, W) the final x0 estimate.
    """
    a, s, lam = _levels(schedule, ts)
    tdev = ts.to(x.device, torch.float32)
    for i in range(len(tdev)):
        x0, eps = denoise(x, tdev[i])  # (N, C, H, W) each
        # c = eta·√β̃, the fresh-noise std; the rest of sigma_s is carried by eps_hat.
        c = eta * s[i + 1] * math.sqrt(-math.expm1(lam[i] - lam[i + 1]))
        x = a[i + 1] * x0 + math.sqrt(max(s[i + 1] ** 2 - c * c, 0.0)) * eps
        if c > 0:
            x = x + c * _randn(x, generator)
    return x


def _with_end(ts: Tensor, x: Tensor) -> Tensor:
    """flow/edm grids as their samplers take them: the levels, then 0 (clean data)."""
    t = ts.detach().to(x.device, torch.float32)
    return torch.cat([t, t.new_zeros(1)])


def _velocity(denoise: DenoiseFn) -> flow.VelocityFn:
    # flow: x = (1-σ)·x0 + σ·ε, so v = ε - x0 (with CFG and clipping applied by the Denoiser)
    def v(x: Tensor, s: Tensor) -> Tensor:
        x0, eps = denoise(x, s)
        return eps - x0
    return v


def _x0(denoise: DenoiseFn) -> edm.DenoiserFn:
    return lambda x, s: denoise(x, s)[0]


def euler(denoise: DenoiseFn, x: Tensor, ts: Tensor, schedule: AnySchedule) -> Tensor:
    """Euler in the objective's own ODE: flow's x over σ (:func:`flow.sample_euler`, equal to
    diffusers' FlowMatchEulerDiscreteScheduler), edm's VE ODE (:func:`edm.sample_euler`),
    and for ddpm the form below.

    ddpm: Euler on the probability-flow ODE in Karras et al. 2022 form (Alg. 1, deterministic):
    with x̃ = x/alpha and σ̃ = sigma/alpha, dx̃/dσ̃ = d = (x̃ - x0_hat)/σ̃, and
    x̃_s = x̃_t + (σ̃_s - σ̃_t)·d. In this parameterisation Euler coincides with DDIM (eta = 0)
    (Song et al. 2021, §4.3; Karras et al. 2022, §3): both are first order.

    At alpha_t = 0 (σ̃_t = inf) the step is taken in its limit form x_s = alpha_s·x0_hat +
    sigma_s·d, which is the same update written without x̃_t.

    Returns:
        (N, C, H, W) the final x0 estimate (flow, edm: the sample at σ = 0).
    """
    a, s, _ = _levels(schedule, ts)
    if schedule.objective == "flow":
        return flow.sample_euler(_velocity(denoise), x, _with_end(ts, x))
    if schedule.objective == "edm":
        return edm.sample_euler(_x0(denoise), x, _with_end(ts, x))
    tdev = ts.to(x.device, torch.float32)
    for i in range(len(tdev)):
        x0, _ = denoise(x, tdev[i])
        d = (x - a[i] * x0) / s[i]  # = (x̃ - x0_hat)/σ̃, the ODE slope (k-diffusion's to_d)
        if a[i] > 0:  # σ̃ grows like 1/alpha: ~156 at t = 999 of the linear schedule
            sig_t, sig_s = s[i] / a[i], s[i + 1] / a[i + 1]
            x = a[i + 1] * (x / a[i] + (sig_s - sig_t) * d)
        else:
            x = a[i + 1] * x0 + s[i + 1] * d
    return x


def dpmpp_2m(denoise: DenoiseFn, x: Tensor, ts: Tensor, schedule: AnySchedule) -> Tensor:
    """DPM-Solver++(2M) (Lu et al. 2022, Algorithm 2), data prediction, in λ = log(alpha/sigma)
    (half the log-SNR of the schedule).

    With h = λ_s - λ_t:  x_s = (sigma_s/sigma_t)·x_t - alpha_s·(e^{-h} - 1)·D, where
    D = x0_hat on the first step (no history) and, later, the multistep correction
    D = (1 + 1/(2r))·x0_hat - 1/(2r)·x0_hat_prev with r = h_prev/h.
    First step from zero terminal SNR: λ_t = -inf, so h = inf, e^{-h} = 0 and the update is
    sigma_s·x_t + alpha_s·x0_hat (sigma_t = 1): finite. The step after it has h_prev = inf and
    falls back to first order, as the formula does in that limit. Last step (to clean data,
    h = inf): first order, x = x0_hat; the 2M correction would be inf·0 there.

    Returns:
        (N, C, H, W) the final x0 estimate.
    """
    a, s, lam = _levels(schedule, ts)
    tdev = ts.to(x.device, torch.float32)
    x0_prev, h_prev = None, math.inf
    for i in range(len(tdev)):
        x0, _ = denoise(x, tdev[i])
        # DPM-Solver's λ is log(alpha/sigma), half the schedule's log-SNR.
        h = 0.5 * (lam[i + 1] - lam[i])
        if math.isinf(lam[i + 1]):  # final step to clean data
            x = x0
            break
        d = x0
        # Second order only with a usable history: not on the first step, not right after
        # a zero-SNR start (h_prev = inf), not across a flat stretch (h or h_prev = 0).
        if x0_prev is not None and 0 < h_prev < math.inf and h > 0:
            k = h / (2 * h_prev)  # 1/(2r)
            d = (1 + k) * x0 - k * x0_prev
        x = (s[i + 1] / s[i]) * x - a[i + 1] * math.expm1(-h) * d
        x0_prev, h_prev = x0, h
    return x


def heun(denoise: DenoiseFn, x: Tensor, ts: Tensor, schedule: AnySchedule) -> Tensor:
    """Heun's second-order method in the objective's ODE, with an Euler step into σ = 0:
    flow's (:func:`flow.sample_heun`, diffusers' FlowMatchHeunDiscreteScheduler) and edm's
    (:func:`edm.sample_heun`, Karras et al. 2022 Alg. 1). 2S - 1 model calls for S levels.
    Not offered for ddpm (kinds.OBJECTIVE_SAMPLERS).

    Returns:
        (N, C, H, W) the sample at σ = 0.
    """
    _levels(schedule, ts)  # the grid's checks
    if schedule.objective == "flow":
        return flow.sample_heun(_velocity(denoise), x, _with_end(ts, x))
    if schedule.objective == "edm":
        return edm.sample_heun(_x0(denoise), x, _with_end(ts, x))
    raise ValueError(f"heun integrates the ODE of diffusion.objective flow or edm; for "
                     f"{schedule.objective} use {', '.join(OBJECTIVE_SAMPLERS['ddpm'])}")


# The sampler registry: its keys are exactly kinds.SAMPLER_NAMES (tests/test_kinds.py).
SAMPLERS: dict[SamplerName, Callable[..., Tensor]] = {
    "ddpm": ddpm,
    "ddim": ddim,
    "dpmpp_2m": dpmpp_2m,
    "euler": euler,
    "heun": heun,
}
# The samplers that read ``eta``; the others ignore it (so an explicit eta there is refused).
USES_ETA: tuple[SamplerName, ...] = ("ddim",)


def _default_device(model: nn.Module, generator: torch.Generator | None) -> torch.device:
    if generator is not None:
        return generator.device
    p = next(iter(model.parameters()), None)
    return p.device if p is not None else torch.device("cpu")


def sample(model: nn.Module, schedule: AnySchedule, prediction: Prediction,
           shape: tuple[int, ...], *, sampler: SamplerName = "dpmpp_2m", steps: int = 50,
           y: Tensor | None = None, cfg_scale: float = 1.0, eta: float = 0.0,
           generator: torch.Generator | None = None, device: torch.device | str | None = None,
           clip_x0: bool = True, spacing: Spacing = "trailing", uncond: Tensor | None = None,
           x: Tensor | None = None, ts: Tensor | None = None) -> Tensor:
    """Draw samples from ``model`` with a named sampler, under ``torch.no_grad()``.

    The starting noise x ~ N(0, I) of ``shape`` is drawn from ``generator`` (then the per-step
    noise of ddpm/ddim, in order), so a fixed generator state gives identical samples; edm
    scales it to its first level's std (σmax). The model visits the schedule's ``grid``:
    ddpm's integer-valued timesteps from :func:`sampling_timesteps` (``spacing``, trailing by
    default), flow's shifted σ from 1, edm's Karras σ. The model's train/eval mode is left as
    the caller set it.

    Args:
        model: ``model(x, t, y)`` with ``num_classes``. schedule: the training schedule.
        prediction: eps, x0 or v (the ddpm objective's; ignored by flow and edm).
        shape: (N, C, H, W).
        sampler: one of SAMPLERS that the objective takes (kinds.OBJECTIVE_SAMPLERS).
        steps: levels, 1..T (model evaluations; heun 2·steps - 1; 2N rows each with CFG).
        y: (N,) labels or None. cfg_scale: guidance scale (ignored without y).
        eta: DDIM stochasticity. generator: RNG (its device is the default device).
        device: where to sample (default: the generator's, else the model's).
        clip_x0: clamp the x0 estimate to [-1, 1] at every step (pixel models; latents
            are unbounded: False, and the result is not clamped either).
        uncond: the negative condition for guidance, shaped like y (None: the null one).
        x: the starting noise (N, C, H, W), unit variance, instead of a draw from
            ``generator`` (edm scales it like the draw).
        ts: the levels to visit instead of the schedule's ``grid(steps, spacing)``.
    Returns:
        (N, C, H, W) float32 samples (clamped to [-1, 1] with ``clip_x0``).
    Raises:
        ValueError: unknown sampler or one the objective does not take, steps outside
            [1, T], mismatched y.
    """
    valid = OBJECTIVE_SAMPLERS[schedule.objective]
    if sampler not in valid:
        raise ValueError(f"unknown sampler {sampler!r} for diffusion.objective="
                         f"{schedule.objective}; valid: {', '.join(valid)}")
    if not 1 <= steps <= schedule.T:
        raise ValueError(f"steps must be in [1, {schedule.T}] (the schedule's timesteps), "
                         f"got {steps}")
    device = torch.device(device) if device is not None else _default_device(model, generator)
    ts = schedule.grid(steps, spacing) if ts is None else ts
    with torch.no_grad():
        x = (torch.randn(shape, generator=generator, device=device) if x is None
             else x.to(device, torch.float32))  # (N, C, H, W)
        std = schedule.prior_std(float(ts[0]))
        if std != 1.0:
            x = x * std
        if y is not None:
            y = y.to(device)
        if uncond is not None:
            uncond = uncond.to(device)
        den = Denoiser(model, schedule, prediction, cfg_scale=cfg_scale, y=y, clip_x0=clip_x0,
                       uncond=uncond)
        if sampler == "ddpm":
            x = ddpm(den, x, ts, schedule, generator)
        elif sampler == "ddim":
            x = ddim(den, x, ts, schedule, generator, eta=eta)
        else:
            x = SAMPLERS[sampler](den, x, ts, schedule)
    return x.clamp(-1.0, 1.0) if clip_x0 else x
