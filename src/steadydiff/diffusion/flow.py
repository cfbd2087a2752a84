"""Rectified flow: the one owner of flow-matching math (pure functions over tensors).

Rectified flow (Liu et al. 2022, "Flow straight and fast"; Esser et al. 2024, the SD3 paper,
§2-3) joins data and noise by a straight line,

    x_σ = (1 - σ)·x0 + σ·ε,        σ in [0, 1]  (σ = 1: pure noise),

and trains a network v(x_σ, σ) on the constant velocity of that line, the target ε - x0.
Sampling integrates dx/dσ = v from σ = 1 down to 0. Our own UNet/DiT (``diffusion.objective:
flow``) and the diffusers model families (SD3, FLUX.1) use these functions; nothing here reads
the config or knows a model.

Conventions shared with diffusers/kohya (so a family's recipe reads the same):
  * the network's timestep is ``σ · num_train_timesteps`` (1000): :func:`timesteps`;
  * the training σ is drawn in [0, 1] by a density (:func:`draw_sigmas`), then shifted
    (:func:`shift_sigmas` or :func:`time_shift`), as kohya's ``shift``/``flux_shift`` do;
  * the sampling σ grid descends from 1 and ends with an appended 0 (:func:`sampling_sigmas`),
    shifted the same way; the samplers take it whole (k-diffusion style).

Every draw comes from an explicit ``torch.Generator``, in a fixed order, so a step replays bit
for bit (the guard re-runs suspicious steps).

Public functions and their signatures (a stable interface; other modules import these):

    draw_sigmas(n, sampling="uniform", generator=None, *, device=None, logit_mean=0.0,
                logit_std=1.0, mode_scale=1.29, sigmoid_scale=1.0) -> Tensor (n,) in [0, 1]
    shift_sigmas(sigmas, shift) -> Tensor                   static shift (SD3 eq. 23)
    dynamic_shift_mu(seq_len, *, base_seq_len=256, max_seq_len=4096, base_shift=0.5,
                     max_shift=1.15) -> float                FLUX's mu from the token count
    time_shift(sigmas, mu, power=1.0) -> Tensor             exponential time shift (FLUX)
    noisy(x0, noise, sigmas) -> Tensor                      x_σ = (1-σ)·x0 + σ·ε
    velocity(x0, noise) -> Tensor                           the target ε - x0
    to_x0(x, v, sigmas) -> Tensor / to_noise(x, v, sigmas)  the line's ends from (x_σ, v)
    loss_weight(scheme, sigmas) -> Tensor                   uniform | sigma_sqrt | cosmap
    timesteps(sigmas, num_train_timesteps=1000) -> Tensor   what the network is called with
    sampling_sigmas(steps, *, shift=1.0, mu=None, end=None, device=None) -> Tensor (steps+1,)
    sample_euler(model, x, sigmas, *, callback=None) -> Tensor
    sample_heun(model, x, sigmas, *, callback=None) -> Tensor

``model`` in the samplers is ``model(x, sigma) -> v``: x (N, ...) float32, sigma (N,) float32
on x's device; it returns the velocity like x (any float dtype; the update runs in float32).
``callback`` (k-diffusion's) is called after every model evaluation of a step with
``{"x", "i", "sigma", "sigma_next", "v", "denoised"}`` (x before the step).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import Tensor

from ..kinds import FLOW_WEIGHTINGS, TIMESTEP_SAMPLINGS, FlowWeighting, TimestepSampling

__all__ = ["draw_sigmas", "shift_sigmas", "dynamic_shift_mu", "time_shift", "noisy",
           "velocity", "to_x0", "to_noise", "loss_weight", "timesteps", "sampling_sigmas",
           "sample_euler", "sample_heun", "VelocityFn"]

VelocityFn = Callable[[Tensor, Tensor], Tensor]


def _bcast(s: Tensor | float, x: Tensor) -> Tensor | float:
    """Per-sample σ (N,) -> (N, 1, ..., 1) against x; scalars and 0-dim tensors pass."""
    if isinstance(s, Tensor) and s.ndim == 1:
        return s.reshape(s.shape[0], *([1] * (x.ndim - 1)))
    return s


# --------------------------------------------------------------------------- training σ


def draw_sigmas(n: int, sampling: TimestepSampling = "uniform",
                generator: torch.Generator | None = None, *,
                device: torch.device | str | None = None, logit_mean: float = 0.0,
                logit_std: float = 1.0, mode_scale: float = 1.29,
                sigmoid_scale: float = 1.0) -> Tensor:
    """Draw n training noise levels σ in [0, 1] (before any shift).

    Densities (SD3 paper §3.1; diffusers' ``compute_density_for_timestep_sampling``; kohya's
    ``--timestep_sampling``):
        uniform: σ ~ U[0, 1) (Liu et al. 2022; diffusers' "none", kohya's "uniform").
        logit_normal: σ = sigmoid(m + s·z), z ~ N(0, 1) (SD3 eq. 19, "rf/lognorm(m, s)"):
            most training at intermediate noise.
        mode: σ = 1 - u - s_mode·(cos²(π/2·u) - 1 + u), u ~ U[0, 1) (SD3 eq. 20, "mode
            with heavy tails"; s_mode = ``mode_scale``, 1.29 in diffusers; -1 <= s <= 2/(π-2)
            keeps it monotone).
        sigmoid: σ = sigmoid(c·z), z ~ N(0, 1), c = ``sigmoid_scale`` (kohya's and x-flux's
            ``sigmoid``: logit_normal with mean 0, std c).

    One draw of ``n`` values from ``generator`` (randn for logit_normal/sigmoid, rand for the
    others), so the result depends only on the generator's state. logit_normal computes
    m + s·z from ``randn`` as kohya does (diffusers' ``torch.normal(m, s)`` rounds the same
    product within one float32 ulp).

    Returns:
        (n,) float32 on ``device`` (the generator's by default), in [0, 1].
    """
    if device is None and generator is not None:
        device = generator.device
    if sampling == "uniform":
        return torch.rand(n, generator=generator, device=device)
    if sampling == "logit_normal":
        z = torch.randn(n, generator=generator, device=device)
        return torch.sigmoid(logit_mean + logit_std * z)
    if sampling == "sigmoid":
        z = torch.randn(n, generator=generator, device=device)
        return torch.sigmoid(sigmoid_scale * z)
    if sampling == "mode":
        u = torch.rand(n, generator=generator, device=device)
        return 1 - u - mode_scale * (torch.cos(math.pi * u / 2) ** 2 - 1 + u)
    raise ValueError(f"unknown timestep sampling {sampling!r}; valid: "
                     f"{', '.join(TIMESTEP_SAMPLINGS)}")


def shift_sigmas(sigmas: Tensor, shift: float) -> Tensor:
    """The static shift σ' = s·σ / (1 + (s - 1)·σ) (SD3 paper eq. 23, §5.3.2; diffusers'
    ``FlowMatchEulerDiscreteScheduler(shift=s)``, kohya's ``discrete_flow_shift``).

    In log-SNR terms (SNR = ((1-σ)/σ)²) it subtracts 2·log s at every level: s > 1 spends
    more of training and sampling at high noise, which larger images need (SD3 uses s = 3 at
    1024², and s = sqrt(m/n) for a resolution of m pixels against a base of n). 0 and 1 stay.
    """
    if shift <= 0:
        raise ValueError(f"the flow shift must be > 0, got {shift}")
    if shift == 1.0:
        return sigmas
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def dynamic_shift_mu(seq_len: int | float, *, base_seq_len: int = 256,
                     max_seq_len: int = 4096, base_shift: float = 0.5,
                     max_shift: float = 1.15) -> float:
    """FLUX's resolution-dependent shift: mu linear in the image token count, through
    (base_seq_len, base_shift) and (max_seq_len, max_shift) (extrapolated beyond them), as
    the FLUX pipelines' ``calculate_shift`` and kohya's ``flux_shift`` compute it.

    ``seq_len`` is the number of image tokens the transformer sees: for FLUX's packed
    latents (H/16)·(W/16) of an H x W image. The shift is then :func:`time_shift` with this
    mu, i.e. the static shift with s = e^mu.
    """
    if max_seq_len <= base_seq_len:
        raise ValueError(f"max_seq_len ({max_seq_len}) must be greater than base_seq_len "
                         f"({base_seq_len})")
    m = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    return float(base_shift + m * (seq_len - base_seq_len))


def time_shift(sigmas: Tensor, mu: float, power: float = 1.0) -> Tensor:
    """The exponential time shift σ' = e^mu / (e^mu + (1/σ - 1)^power) (FLUX; diffusers'
    ``time_shift_type="exponential"``). With power 1 it is :func:`shift_sigmas` with s = e^mu;
    σ = 0 maps to 0 and σ = 1 to 1."""
    e = math.exp(mu)
    # 1/σ - 1 at σ = 0 is inf and e/(e + inf) = 0: the right limit, without a NaN.
    return e / (e + (1 / sigmas - 1) ** power)


# --------------------------------------------------------------------------- the line


def noisy(x0: Tensor, noise: Tensor, sigmas: Tensor | float) -> Tensor:
    """x_σ = (1 - σ)·x0 + σ·ε (SD3 eq. 2 with a_t = 1 - t, b_t = t). σ: scalar or (N,)."""
    s = _bcast(sigmas, x0)
    if isinstance(s, Tensor):
        s = s.to(x0.dtype)
    return (1 - s) * x0 + s * noise


def velocity(x0: Tensor, noise: Tensor) -> Tensor:
    """The regression target: dx_σ/dσ = ε - x0 (constant along each line)."""
    return noise - x0


def to_x0(x: Tensor, v: Tensor, sigmas: Tensor | float) -> Tensor:
    """The clean end of the line through x at σ with velocity v: x0 = x - σ·v."""
    return x - _bcast(sigmas, x) * v


def to_noise(x: Tensor, v: Tensor, sigmas: Tensor | float) -> Tensor:
    """The noise end of the line: ε = x + (1 - σ)·v."""
    return x + (1 - _bcast(sigmas, x)) * v


def loss_weight(scheme: FlowWeighting, sigmas: Tensor) -> Tensor:
    """Per-sample loss weights, as diffusers' ``compute_loss_weighting_for_sd3`` and kohya
    define them (SD3 paper §3.1):
        uniform: 1 (diffusers' "none", the plain rectified-flow loss).
        sigma_sqrt: σ^-2. diffusers' SD3 script and kohya's ``sigma_scaled`` apply it to the
            x0-space error ‖x0_hat - x0‖² = σ²·‖v_hat - v‖², where it gives back the
            velocity loss; on the velocity error it weights low noise by up to 1e6 at
            σ = 1e-3.
        cosmap: 2 / (π·(1 - 2σ + 2σ²)), the density of SD3's CosMap (eq. 21) as a weight on
            uniformly drawn σ.

    Returns:
        float32 weights like ``sigmas``; sigma_sqrt is inf at σ = 0 (draw σ > 0 for it).
    """
    if scheme == "uniform":
        return torch.ones_like(sigmas, dtype=torch.float32)
    if scheme == "sigma_sqrt":
        return (sigmas ** -2.0).float()
    if scheme == "cosmap":
        return (2 / (math.pi * (1 - 2 * sigmas + 2 * sigmas ** 2))).float()
    raise ValueError(f"unknown flow loss weighting {scheme!r}; valid: {', '.join(FLOW_WEIGHTINGS)}")


def timesteps(sigmas: Tensor, num_train_timesteps: int = 1000) -> Tensor:
    """The timestep a flow network is called with: σ·num_train_timesteps (diffusers' SD3 and
    FLUX transformers; FLUX divides it by 1000 again inside its pipeline call)."""
    return sigmas * num_train_timesteps


# --------------------------------------------------------------------------- sampling


def sampling_sigmas(steps: int, *, shift: float = 1.0, mu: float | None = None,
                    end: float | None = None,
                    device: torch.device | str | None = None) -> Tensor:
    """The σ grid a flow sampler walks: ``steps`` levels from 1 down to ``end``, shifted,
    then 0 appended (k-diffusion's convention: the samplers take it whole).

    The base grid is linspace(1, end, steps) in float64, rounded to float32 before the shift
    as diffusers does. ``end`` defaults to 1/steps, the grid of the FLUX pipelines
    (``np.linspace(1.0, 1/steps, steps)``), which is also the uniform grid of ``steps``
    Euler steps from 1 to 0. diffusers' scheduler default (SD3's pipeline, no ``sigmas``
    passed) ends at its training table's smallest σ: ``end = shift_sigmas(1/1000, shift)``.

    Args:
        steps: model evaluations of the Euler sampler, >= 1.
        shift: the static shift (:func:`shift_sigmas`); 1: none.
        mu: FLUX's dynamic shift (:func:`time_shift`) instead of ``shift``.
        end: the last level before 0, in (0, 1].
    Returns:
        (steps + 1,) float32, descending, last entry 0.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if mu is not None and shift != 1.0:
        raise ValueError("give the static shift or the dynamic mu, not both")
    end = 1.0 / steps if end is None else end
    if not 0 < end <= 1:
        raise ValueError(f"end must be in (0, 1], got {end}")
    base = torch.linspace(1.0, end, steps, dtype=torch.float64).to(torch.float32)
    s = time_shift(base, mu) if mu is not None else shift_sigmas(base, shift)
    return torch.cat([s, s.new_zeros(1)]).to(device)


def _check_sigmas(sigmas: Tensor) -> None:
    if sigmas.ndim != 1 or sigmas.numel() < 2:
        raise ValueError(f"sigmas must be a 1-D grid of at least two levels ending at the "
                         f"target (0 for clean data), got shape {tuple(sigmas.shape)}")
    if bool((sigmas[1:] > sigmas[:-1]).any()):
        raise ValueError("sigmas must be descending (from noise to data)")


@torch.no_grad()
def sample_euler(model: VelocityFn, x: Tensor, sigmas: Tensor, *,
                 callback: Callable[[dict[str, Any]], None] | None = None) -> Tensor:
    """The flow-match Euler sampler: x <- x + (σ_{i+1} - σ_i)·v(x, σ_i) over the grid
    (diffusers' ``FlowMatchEulerDiscreteScheduler.step``, deterministic). Written over x0 and
    ε it is DDIM (η = 0) on the straight line, so it is exact for a single data point.

    Args:
        model: (x, sigma (N,)) -> velocity. x: (N, ...) the start, noise at sigmas[0] (for
            sigmas[0] = 1: N(0, I)). sigmas: (S+1,) descending, as :func:`sampling_sigmas`.
        callback: see the module docstring.
    Returns:
        float32 like x: the sample at sigmas[-1].
    """
    _check_sigmas(sigmas)
    sig = sigmas.to(x.device, torch.float32)
    x = x.to(torch.float32)
    n = x.shape[0]
    for i in range(sig.numel() - 1):
        s, s_next = sig[i], sig[i + 1]
        v = model(x, s.expand(n)).to(torch.float32)
        if callback is not None:
            callback({"x": x, "i": i, "sigma": s, "sigma_next": s_next, "v": v,
                      "denoised": to_x0(x, v, s)})
        x = x + (s_next - s) * v
    return x


@torch.no_grad()
def sample_heun(model: VelocityFn, x: Tensor, sigmas: Tensor, *,
                callback: Callable[[dict[str, Any]], None] | None = None) -> Tensor:
    """Heun's second-order method on the flow ODE (Karras et al. 2022, Alg. 1 in flow
    coordinates; diffusers' ``FlowMatchHeunDiscreteScheduler``, deterministic):
        x' = x + dt·v(x, σ_i);  x <- x + dt·(v(x, σ_i) + v(x', σ_{i+1}))/2,
    with a plain Euler step into σ = 0 (no evaluation at the end of the line). 2S - 1 model
    evaluations for S steps to 0.

    Args and returns: as :func:`sample_euler`.
    """
    _check_sigmas(sigmas)
    sig = sigmas.to(x.device, torch.float32)
    last = [float(v) for v in sigmas.detach().cpu().tolist()]  # host values decide the order
    x = x.to(torch.float32)
    n = x.shape[0]
    for i in range(sig.numel() - 1):
        s, s_next = sig[i], sig[i + 1]
        dt = s_next - s
        v = model(x, s.expand(n)).to(torch.float32)
        if callback is not None:
            callback({"x": x, "i": i, "sigma": s, "sigma_next": s_next, "v": v,
                      "denoised": to_x0(x, v, s)})
        if last[i + 1] == 0.0:  # into the data end: Euler (Karras Alg. 1, line 8)
            x = x + dt * v
            continue
        x_e = x + dt * v
        v2 = model(x_e, s_next.expand(n)).to(torch.float32)
        x = x + dt * (0.5 * (v + v2))
    return x
