"""EDM: the preconditioned denoiser of Karras et al. 2022, "Elucidating the Design Space of
Diffusion-Based Generative Models" (pure functions over tensors).

The process is variance exploding, x = x0 + σ·ε with σ in (0, ∞). The network F is wrapped
into a denoiser whose inputs and outputs have unit variance at every σ (Table 1, "Ours"):

    D(x; σ) = c_skip(σ)·x + c_out(σ)·F(c_in(σ)·x; c_noise(σ))
    c_skip = σd² / (σ² + σd²)     c_out = σ·σd / √(σ² + σd²)
    c_in   = 1 / √(σ² + σd²)      c_noise = ¼·ln σ

with σd (``sigma_data``) the data's standard deviation (0.5 for images in [-1, 1]). Training
draws ln σ ~ N(P_mean, P_std²) (-1.2, 1.2) and minimises λ(σ)·‖D(x; σ) - x0‖² with
λ = (σ² + σd²)/(σ·σd)² = 1/c_out²: in F's terms, ‖F - (x0 - c_skip·x)/c_out‖² with unit weight
(eq. 8), which :func:`target` gives. Sampling walks the Karras σ grid (eq. 5, ρ = 7) with
Euler or Heun (Alg. 1).

Public functions (the objective in objectives.py and the samplers in samplers.py use these):

    precondition(sigma, sigma_data=0.5) -> (c_skip, c_out, c_in, c_noise)
    draw_sigmas(n, generator=None, *, p_mean=-1.2, p_std=1.2, device=None) -> Tensor (n,)
    loss_weight(sigma, sigma_data=0.5) -> Tensor          λ(σ)
    noisy(x0, noise, sigma) -> Tensor                     x0 + σ·ε
    target(x0, x, sigma, sigma_data=0.5) -> Tensor        F's regression target
    denoised(out, x, sigma, sigma_data=0.5) -> Tensor     D from F's output
    karras_sigmas(steps, sigma_min=0.002, sigma_max=80.0, rho=7.0, device=None) -> (steps+1,)
    sample_euler(model, x, sigmas, *, callback=None) -> Tensor
    sample_heun(model, x, sigmas, *, callback=None) -> Tensor

``model`` in the samplers is ``model(x, sigma) -> D(x; σ)``, the denoised estimate (x (N, ...)
float32; sigma (N,) float32 on x's device). ``callback`` is called after each step's first
model evaluation with ``{"x", "i", "sigma", "sigma_next", "denoised"}`` (k-diffusion's keys).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor

__all__ = ["precondition", "draw_sigmas", "loss_weight", "noisy", "target", "denoised",
           "karras_sigmas", "sample_euler", "sample_heun", "DenoiserFn", "SIGMA_DATA",
           "P_MEAN", "P_STD", "SIGMA_MIN", "SIGMA_MAX", "RHO"]

DenoiserFn = Callable[[Tensor, Tensor], Tensor]

# Table 1's values, the defaults of diffusion.edm.* (config.py repeats them as its defaults)
SIGMA_DATA, P_MEAN, P_STD = 0.5, -1.2, 1.2
SIGMA_MIN, SIGMA_MAX, RHO = 0.002, 80.0, 7.0


def _bcast(s: Tensor | float, x: Tensor) -> Tensor | float:
    if isinstance(s, Tensor) and s.ndim == 1:
        return s.reshape(s.shape[0], *([1] * (x.ndim - 1)))
    return s


def precondition(sigma: Tensor, sigma_data: float = SIGMA_DATA
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Table 1's c_skip, c_out, c_in, c_noise at ``sigma`` (any shape, > 0), computed in
    ``sigma``'s dtype."""
    s2, d2 = sigma * sigma, sigma_data * sigma_data
    c_skip = d2 / (s2 + d2)
    c_out = sigma * sigma_data / (s2 + d2).sqrt()
    c_in = 1 / (s2 + d2).sqrt()
    c_noise = sigma.log() / 4
    return c_skip, c_out, c_in, c_noise


def draw_sigmas(n: int, generator: torch.Generator | None = None, *, p_mean: float = P_MEAN,
                p_std: float = P_STD, device: torch.device | str | None = None) -> Tensor:
    """Training noise levels: ln σ ~ N(P_mean, P_std²) (§5, Table 1), one ``randn`` draw of n
    values from ``generator``. Returns (n,) float32 on ``device`` (default: the
    generator's)."""
    if device is None and generator is not None:
        device = generator.device
    z = torch.randn(n, generator=generator, device=device)
    return (p_mean + p_std * z).exp()


def loss_weight(sigma: Tensor, sigma_data: float = SIGMA_DATA) -> Tensor:
    """λ(σ) = (σ² + σd²)/(σ·σd)² (Table 1): the weight on ‖D - x0‖² that makes the effective
    weight on F's error λ·c_out² = 1 at every σ."""
    return (sigma * sigma + sigma_data * sigma_data) / (sigma * sigma_data) ** 2


def noisy(x0: Tensor, noise: Tensor, sigma: Tensor | float) -> Tensor:
    """x = x0 + σ·ε. σ: scalar or (N,)."""
    s = _bcast(sigma, x0)
    if isinstance(s, Tensor):
        s = s.to(x0.dtype)
    return x0 + s * noise


def target(x0: Tensor, x: Tensor, sigma: Tensor, sigma_data: float = SIGMA_DATA) -> Tensor:
    """F's regression target (x0 - c_skip·x)/c_out (eq. 8): with it, ‖F - target‖² equals
    λ(σ)·‖D - x0‖²."""
    c_skip, c_out, _, _ = precondition(sigma, sigma_data)
    return (x0 - _bcast(c_skip, x) * x) / _bcast(c_out, x)


def denoised(out: Tensor, x: Tensor, sigma: Tensor | float,
             sigma_data: float = SIGMA_DATA) -> Tensor:
    """D(x; σ) = c_skip·x + c_out·F from the network's output F (affine in F, so guidance may
    mix raw outputs)."""
    sigma = torch.as_tensor(sigma, dtype=torch.float32, device=x.device)
    c_skip, c_out, _, _ = precondition(sigma, sigma_data)
    return _bcast(c_skip, x) * x + _bcast(c_out, x) * out


def karras_sigmas(steps: int, sigma_min: float = SIGMA_MIN, sigma_max: float = SIGMA_MAX,
                  rho: float = RHO, device: torch.device | str | None = None) -> Tensor:
    """The sampling grid of eq. 5: σ_i = (σmax^(1/ρ) + i/(N-1)·(σmin^(1/ρ) - σmax^(1/ρ)))^ρ
    for i < N, then σ_N = 0. ρ = 7 shortens the steps near σmin, where the trajectory bends.

    Returns:
        (steps + 1,) float32 (computed in float64), descending from sigma_max, last entry 0.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if not 0 < sigma_min < sigma_max:
        raise ValueError(f"need 0 < sigma_min < sigma_max, got {sigma_min}, {sigma_max}")
    ramp = torch.linspace(0, 1, steps, dtype=torch.float64) if steps > 1 else \
        torch.zeros(1, dtype=torch.float64)
    lo, hi = sigma_min ** (1 / rho), sigma_max ** (1 / rho)
    s = (hi + ramp * (lo - hi)) ** rho
    return torch.cat([s, s.new_zeros(1)]).to(device=device, dtype=torch.float32)


def _check_sigmas(sigmas: Tensor) -> list[float]:
    if sigmas.ndim != 1 or sigmas.numel() < 2:
        raise ValueError(f"sigmas must be a 1-D grid of at least two levels ending at the "
                         f"target (0 for clean data), got shape {tuple(sigmas.shape)}")
    host = [float(v) for v in sigmas.detach().cpu().tolist()]
    if any(b > a for a, b in zip(host, host[1:])) or min(host) < 0:
        raise ValueError("sigmas must be descending and >= 0 (from noise to data)")
    if host[0] == 0:
        raise ValueError("sigmas must start above 0")
    return host


@torch.no_grad()
def sample_euler(model: DenoiserFn, x: Tensor, sigmas: Tensor, *,
                 callback: Callable[[dict[str, Any]], None] | None = None) -> Tensor:
    """Euler on the probability-flow ODE dx/dσ = (x - D(x; σ))/σ (Alg. 1 without the
    second-order correction; k-diffusion's ``sample_euler``).

    Args:
        model: (x, sigma (N,)) -> D(x; σ). x: (N, ...) the start at sigmas[0]: N(0, σ0²·I).
        sigmas: (S+1,) descending, as :func:`karras_sigmas`.
    Returns:
        float32 like x: the sample at sigmas[-1].
    """
    host = _check_sigmas(sigmas)
    sig = sigmas.to(x.device, torch.float32)
    x = x.to(torch.float32)
    n = x.shape[0]
    for i in range(len(host) - 1):
        den = model(x, sig[i].expand(n)).to(torch.float32)
        if callback is not None:
            callback({"x": x, "i": i, "sigma": sig[i], "sigma_next": sig[i + 1],
                      "denoised": den})
        d = (x - den) / sig[i]
        x = x + (sig[i + 1] - sig[i]) * d
    return x


@torch.no_grad()
def sample_heun(model: DenoiserFn, x: Tensor, sigmas: Tensor, *,
                callback: Callable[[dict[str, Any]], None] | None = None) -> Tensor:
    """Heun's second-order method, Karras et al. 2022 Alg. 1 (deterministic):
        d = (x - D(x; σ_i))/σ_i;  x' = x + (σ_{i+1} - σ_i)·d
        if σ_{i+1} > 0:  d' = (x' - D(x'; σ_{i+1}))/σ_{i+1};  x' = x + (σ_{i+1} - σ_i)·(d + d')/2
    2S - 1 model evaluations for S steps into σ = 0.

    Args and returns: as :func:`sample_euler`.
    """
    host = _check_sigmas(sigmas)
    sig = sigmas.to(x.device, torch.float32)
    x = x.to(torch.float32)
    n = x.shape[0]
    for i in range(len(host) - 1):
        s, s_next = sig[i], sig[i + 1]
        den = model(x, s.expand(n)).to(torch.float32)
        if callback is not None:
            callback({"x": x, "i": i, "sigma": s, "sigma_next": s_next, "denoised": den})
        d = (x - den) / s
        x_e = x + (s_next - s) * d
        if host[i + 1] == 0.0:  # the last step: Euler (Alg. 1, line 8)
            x = x_e
            continue
        d2 = (x_e - model(x_e, s_next.expand(n)).to(torch.float32)) / s_next
        x = x + (s_next - s) * (0.5 * (d + d2))
    return x
