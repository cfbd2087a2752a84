"""Noise schedules: the discrete ᾱ table of a variance-preserving diffusion and its SNR.

Notation (Kingma et al. 2021, "Variational Diffusion Models"): x_t = alpha_t·x0 + sigma_t·eps
with alpha = √ᾱ, sigma = √(1-ᾱ), SNR = alpha²/sigma² and log-SNR λ = log(alpha²/sigma²).
Step t runs over the integers 0..T-1 (t = T-1 is the noisiest); samplers may ask for
fractional t, which we answer by interpolating λ linearly between the two integer steps.

Everything is computed in float64 on the CPU once; per-device copies of the tables are cached
on first use so that the hot path (one lookup per training step) does not re-upload them.

The other objectives' noise levels (``diffusion.objective``) live here too: :class:`FlowSchedule`
(rectified flow, the level is σ in [0, 1]) and :class:`EDMSchedule` (σ in (0, ∞)), built by
:func:`make_schedule` from the same config section. All three keep one contract, which the
loss (objectives.py), the samplers (samplers.py) and the doctor's probe use without asking
which objective they have; a *level* is a DDPM timestep t or a σ:

    objective                      "ddpm" | "flow" | "edm"
    T                              the network's time scale and the guard's bucket range
    from_draw(d) -> level          the training draw (objectives.draw) made a level
    alpha_sigma(level) -> (α, σ)   x = α·x0 + σ·ε at that level
    model_input(x, level) -> x     what the network sees (EDM: c_in·x)
    model_time(level) -> t         its time input, float32 (DDPM: t; flow: σ·T; EDM: T·¼ln σ)
    bucket(level) -> long          the guard's t-bucket coordinate in [0, T)
    grid(steps, spacing) -> levels the sampling grid, descending, without the clean end
    levels(grid) -> (α, σ, λ)      python floats for the samplers, the clean end appended
    spread(n) -> levels            n levels across the training range (the doctor's probe)
    prior_std(level) -> float      the std of the starting noise at grid[0]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import Tensor

from ..config import DiffusionConfig
from ..kinds import OBJECTIVES, SCHEDULES, SPACINGS, FlowGridEnd, Objective, ScheduleName, Spacing
from . import edm, flow

__all__ = ["Schedule", "FlowSchedule", "EDMSchedule", "AnySchedule", "make_schedule",
           "resolution_shift", "sampling_timesteps", "flow_seq_len"]

# Piecewise log-SNR points are kept inside this range so that ᾱ = sigmoid(λ) stays strictly
# inside (0, 1) in float64 (sigmoid(37) already rounds to 1.0). SNR = 0 at the end is what
# zero_terminal_snr is for.
PIECEWISE_LOG_SNR_RANGE = 30.0


def _as_tensor(t: Tensor | float | int) -> Tensor:
    return t if isinstance(t, Tensor) else torch.tensor(t, dtype=torch.float64)


@dataclass(eq=False)
class Schedule:
    """A discrete VP noise schedule.

    Attributes:
        T: number of training steps; valid timesteps are 0..T-1.
        betas: (T,) float64, per-step variances β_t = 1 - ᾱ_t/ᾱ_{t-1}.
        alphas_cumprod: (T,) float64, ᾱ_t, non-increasing, in (0, 1]; ᾱ[T-1] may be exactly 0
            (zero terminal SNR, Lin et al. 2024).
    """

    T: int
    betas: Tensor
    alphas_cumprod: Tensor
    # device -> (ᾱ table, λ table, alpha table f32, sigma table f32); filled lazily.
    _cache: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    objective: ClassVar[Objective] = "ddpm"

    def __post_init__(self) -> None:
        self.betas = torch.as_tensor(self.betas, dtype=torch.float64).detach().cpu().contiguous()
        self.alphas_cumprod = (torch.as_tensor(self.alphas_cumprod, dtype=torch.float64)
                               .detach().cpu().contiguous())
        shapes = (tuple(self.betas.shape), tuple(self.alphas_cumprod.shape))
        if self.T < 2 or shapes != ((self.T,), (self.T,)):
            raise ValueError(f"Schedule needs T >= 2 and betas/alphas_cumprod of shape "
                             f"({self.T},), got {shapes[0]} and {shapes[1]}")

    @property
    def zero_terminal_snr(self) -> bool:
        """True when ᾱ[T-1] == 0: the last step is pure noise (alpha = 0, SNR = 0)."""
        return bool(self.alphas_cumprod[-1] == 0)

    # ------------------------------------------------------------------ tables

    def _tables(self, device: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        key = str(device)
        tabs = self._cache.get(key)
        if tabs is None:
            ab = self.alphas_cumprod
            # λ = log ᾱ - log(1-ᾱ); log1p keeps precision where ᾱ is close to 1 (small t).
            lam = torch.log(ab) - torch.log1p(-ab)
            # sigma from sigmoid(-λ) rather than 1-ᾱ: exact even when ᾱ rounds near 1.
            alpha = torch.sigmoid(lam).sqrt().float()
            sigma = torch.sigmoid(-lam).sqrt().float()
            # MPS has no float64; everywhere else the interpolation runs in float64.
            fdt = torch.float32 if torch.device(device).type == "mps" else torch.float64
            tabs = (ab.to(device, fdt), lam.to(device, fdt), alpha.to(device), sigma.to(device))
            self._cache[key] = tabs
        return tabs

    def _interp_log_snr(self, t: Tensor) -> Tensor:
        """λ(t) for float t (clamped to [0, T-1]), in the table dtype (float64 off MPS)."""
        ab, lam, _, _ = self._tables(t.device)
        tt = t.to(lam.dtype).clamp(0, self.T - 1)
        lo = tt.floor().long().clamp(max=self.T - 2)
        w = tt - lo
        lam_lo, lam_hi = lam[lo], lam[lo + 1]
        # Linear in λ between integer steps. torch.lerp returns the end point exactly at w=1.
        lam_lin = torch.lerp(lam_lo, lam_hi, w)
        # With zero terminal SNR the last interval ends at λ = -inf; interpolating λ there would
        # make every fractional t in (T-2, T-1) pure noise. Interpolate ᾱ on that interval
        # instead, which stays continuous and reaches ᾱ = 0 exactly at t = T-1.
        ab_lin = torch.lerp(ab[lo], ab[lo + 1], w)
        lam_ab = torch.log(ab_lin) - torch.log1p(-ab_lin)
        finite = torch.isfinite(lam_lo) & torch.isfinite(lam_hi)
        return torch.where(finite, lam_lin, lam_ab)

    # ------------------------------------------------------------------ public queries

    def log_snr(self, t: Tensor | float, dtype: torch.dtype = torch.float32) -> Tensor:
        """Log-SNR λ(t) = log(ᾱ/(1-ᾱ)), linear between integer steps.

        Args:
            t: timesteps in [0, T-1] (any shape; integer or float; clamped to the range).
            dtype: result dtype (float32 by default; samplers ask for float64).
        Returns:
            λ with t's shape, on t's device; -inf where ᾱ = 0.
        """
        t = _as_tensor(t)
        if not t.is_floating_point():
            return self._tables(t.device)[1][t].to(dtype)
        return self._interp_log_snr(t).to(dtype)

    def snr(self, t: Tensor | float, dtype: torch.dtype = torch.float32) -> Tensor:
        """SNR(t) = alpha²/sigma² = exp(λ(t)); 0 where ᾱ = 0, never NaN."""
        return torch.exp(self.log_snr(t, torch.float64)).to(dtype)

    def alpha_sigma(self, t: Tensor | float,
                    dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
        """alpha = √ᾱ(t) and sigma = √(1-ᾱ(t)), log-SNR interpolated between integer steps.

        Args:
            t: timesteps in [0, T-1] (any shape). Integer t is a plain table lookup (the
                training hot path); float t is interpolated. Out-of-range t is clamped.
            dtype: result dtype, float32 by default.
        Returns:
            (alpha, sigma), each with t's shape, on t's device; alpha² + sigma² = 1.
        """
        t = _as_tensor(t)
        if not t.is_floating_point():
            _, _, alpha, sigma = self._tables(t.device)
            t = t.clamp(0, self.T - 1)
            return alpha[t].to(dtype), sigma[t].to(dtype)
        lam = self._interp_log_snr(t)
        # ᾱ = sigmoid(λ), 1-ᾱ = sigmoid(-λ): both exact at λ = ±inf, and they sum to one.
        return torch.sigmoid(lam).sqrt().to(dtype), torch.sigmoid(-lam).sqrt().to(dtype)

    def t_from_log_snr(self, lam: Tensor | float, dtype: torch.dtype = torch.float32) -> Tensor:
        """Inverse of :meth:`log_snr`: the (fractional) timestep whose λ equals ``lam``.

        Args:
            lam: log-SNR values (any shape). Values above λ(0) map to 0, below λ(T-1) to T-1.
        Returns:
            t in [0, T-1] with lam's shape. On a flat stretch (piecewise schedules) the first
            step of the stretch is returned.
        """
        lam = _as_tensor(lam)
        ab, table, _, _ = self._tables(lam.device)
        x = lam.to(table.dtype)
        # -λ is non-decreasing; searchsorted finds the first step whose λ <= lam.
        hi = torch.searchsorted(-table, -x.contiguous().reshape(-1)).reshape(x.shape)
        hi = hi.clamp(1, self.T - 1)
        lo = hi - 1
        lam_lo, lam_hi = table[lo], table[hi]
        den = lam_lo - lam_hi
        w_lam = (lam_lo - x) / torch.where(den > 0, den, torch.ones_like(den))
        w_lam = torch.where(den > 0, w_lam, torch.zeros_like(w_lam))
        # The zero-SNR interval is interpolated in ᾱ (see _interp_log_snr); invert that too.
        ab_x = torch.sigmoid(x)
        w_ab = (ab[lo] - ab_x) / (ab[lo] - ab[hi]).clamp_min(torch.finfo(ab.dtype).tiny)
        finite = torch.isfinite(lam_lo) & torch.isfinite(lam_hi)
        w = torch.where(finite, w_lam, w_ab).clamp(0, 1)
        return (lo.to(w.dtype) + w).to(dtype)


    # ------------------------------------------------------------------ the level contract
    # (see the module docstring): a DDPM level is the timestep t itself.

    def from_draw(self, t: Tensor) -> Tensor:
        """The drawn timesteps (long) are the levels."""
        return t

    def model_input(self, x: Tensor, t: Tensor | float) -> Tensor:
        return x

    def model_time(self, t: Tensor) -> Tensor:
        """The network is called with t itself, as float32 (integer-valued in training)."""
        return t.to(torch.float32)

    def bucket(self, t: Tensor) -> Tensor:
        """The drawn (long) timestep is its own bucket coordinate."""
        return t if not t.is_floating_point() else t.long().clamp(0, self.T - 1)

    def grid(self, steps: int, spacing: Spacing = "trailing") -> Tensor:
        """:func:`sampling_timesteps`."""
        return sampling_timesteps(self, steps, spacing)

    def levels(self, ts: Tensor) -> tuple[list[float], list[float], list[float]]:
        """alpha, sigma, λ (float64, as python floats) at each t in ts, plus the clean level
        (alpha = 1, sigma = 0, λ = +inf) appended as the target of the final step."""
        lam = self.log_snr(ts.detach().to("cpu", torch.float64), dtype=torch.float64)
        alpha = torch.sigmoid(lam).sqrt().tolist() + [1.0]
        sigma = torch.sigmoid(-lam).sqrt().tolist() + [0.0]
        return alpha, sigma, lam.tolist() + [math.inf]

    def spread(self, n: int) -> Tensor:
        """n integer timesteps evenly over [0, T-1] (long)."""
        return torch.tensor([round(i * (self.T - 1) / max(n - 1, 1)) for i in range(n)])

    def prior_std(self, t0: float) -> float:
        """Sampling starts from N(0, I) (ᾱ ≈ 0 at the first timestep)."""
        return 1.0


def sampling_timesteps(schedule: Schedule, steps: int, spacing: Spacing = "trailing") -> Tensor:
    """The timesteps at which a sampler evaluates the model, descending, integer-valued.

    Spacings from Lin et al. 2024, Table 2 (T = 1000, steps = 10 shown):
        trailing: round(T - i·T/steps) - 1 -> 999, 899, ..., 99  (recommended: starts at T-1,
            so sampling begins at the same noise level training ends with)
        leading:  i·(T // steps), reversed -> 900, 800, ..., 0    (never visits T-1)
        linspace: round(linspace(T-1, 0, steps)) -> 999, 888, ..., 0
    Args:
        steps: number of model evaluations, 1..T.
    Returns:
        (steps,) float32 CPU tensor, strictly descending, values in [0, T-1].
    """
    T = schedule.T
    if not 1 <= steps <= T:
        raise ValueError(f"steps must be in [1, {T}] (the schedule's timesteps), got {steps}")
    i = torch.arange(steps, dtype=torch.float64)
    if spacing == "trailing":
        ts = (T - i * (T / steps)).round() - 1
    elif spacing == "leading":
        ts = (steps - 1 - i) * (T // steps)
    elif spacing == "linspace":
        ts = torch.linspace(T - 1, 0, steps, dtype=torch.float64).round()
    else:
        raise ValueError(f"unknown spacing {spacing!r}; valid: {', '.join(SPACINGS)}")
    return ts.float()


# ---------------------------------------------------------------------- flow and EDM


def _bcast(a: Tensor, x: Tensor) -> Tensor:
    return a.reshape(a.shape[0], *([1] * (x.ndim - 1))) if a.ndim == 1 else a


def _no_spacing(spacing: Spacing, objective: str) -> None:
    if spacing != "trailing":
        raise ValueError(f"spacing={spacing!r} picks integer timesteps of the ddpm objective; "
                         f"diffusion.objective={objective} samples its own σ grid")


@dataclass(eq=False)
class FlowSchedule:
    """Rectified flow's noise levels (``diffusion.objective: flow``; diffusion/flow.py): the
    level of a sample is its σ in [0, 1], x = (1-σ)·x0 + σ·ε, shifted by ``shift`` in
    training and sampling alike (:func:`flow.shift_sigmas`; FLUX's dynamic shift is the
    static one with s = e^mu, resolved by :func:`make_schedule` for the run's resolution).

    The network is called with σ·T (diffusers' timestep = σ·1000 for T = 1000) and predicts
    the velocity ε - x0.
    """

    T: int
    shift: float = 1.0
    grid_end: FlowGridEnd = "steps"
    objective: ClassVar[Objective] = "flow"

    def from_draw(self, u: Tensor) -> Tensor:
        """The drawn density value u in [0, 1] -> σ: clamped to [1/T, 1] (the support of
        diffusers' training table, which never trains at σ = 0), then shifted."""
        return flow.shift_sigmas(u.clamp(1.0 / self.T, 1.0), self.shift)

    def alpha_sigma(self, sigma: Tensor | float,
                    dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
        s = _as_tensor(sigma).to(dtype)
        return 1 - s, s

    def model_input(self, x: Tensor, sigma: Tensor | float) -> Tensor:
        return x

    def model_time(self, sigma: Tensor) -> Tensor:
        return flow.timesteps(sigma.to(torch.float32), self.T)

    def bucket(self, sigma: Tensor) -> Tensor:
        """σ in [0, 1] onto [0, T): bucket b of B holds σ in [b/B, (b+1)/B)."""
        return (sigma.to(torch.float32) * self.T).long().clamp(0, self.T - 1)

    def grid(self, steps: int, spacing: Spacing = "trailing") -> Tensor:
        """:func:`flow.sampling_sigmas` (from 1, shifted) without its final 0; it ends at
        1/steps (``grid_end="steps"``), or at the training table's smallest level,
        shift(1/T), as diffusers' scheduler does by default (``"table"``)."""
        _no_spacing(spacing, self.objective)
        end = None
        if self.grid_end == "table":
            end = float(flow.shift_sigmas(torch.tensor(1.0 / self.T), self.shift))
        return flow.sampling_sigmas(steps, shift=self.shift, end=end)[:-1]

    def levels(self, ts: Tensor) -> tuple[list[float], list[float], list[float]]:
        s = ts.detach().to("cpu", torch.float64).clamp(0, 1)
        lam = 2 * (torch.log1p(-s) - torch.log(s))  # -inf at σ = 1, +inf at σ = 0
        return (1 - s).tolist() + [1.0], s.tolist() + [0.0], lam.tolist() + [math.inf]

    def spread(self, n: int) -> Tensor:
        return torch.linspace(0.0, 1.0, n)

    def prior_std(self, t0: float) -> float:
        return 1.0

    def to_x0_eps(self, out: Tensor, x: Tensor, sigma: Tensor | float) -> tuple[Tensor, Tensor]:
        """(x0, ε) from the velocity: x0 = x - σ·v, ε = x + (1-σ)·v (affine in v)."""
        s = _as_tensor(sigma).to(x.device, torch.float32)
        return flow.to_x0(x, out, s), flow.to_noise(x, out, s)

    def target(self, x0: Tensor, noise: Tensor, x: Tensor, sigma: Tensor) -> Tensor:
        return flow.velocity(x0, noise)


@dataclass(eq=False)
class EDMSchedule:
    """EDM's noise levels (``diffusion.objective: edm``; diffusion/edm.py): the level is
    σ > 0, x = x0 + σ·ε; training draws ln σ ~ N(p_mean, p_std²), sampling walks the Karras
    grid from sigma_max. The network sees c_in·x at time T·c_noise = T·¼·ln σ (Table 1's
    c_noise, scaled like the DDPM timesteps our sinusoidal embedding resolves), and
    predicts F.
    """

    T: int
    sigma_data: float = edm.SIGMA_DATA
    p_mean: float = edm.P_MEAN
    p_std: float = edm.P_STD
    sigma_min: float = edm.SIGMA_MIN
    sigma_max: float = edm.SIGMA_MAX
    rho: float = edm.RHO
    objective: ClassVar[Objective] = "edm"

    def from_draw(self, sigma: Tensor) -> Tensor:
        return sigma

    def alpha_sigma(self, sigma: Tensor | float,
                    dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
        s = _as_tensor(sigma).to(dtype)
        return torch.ones_like(s), s

    def model_input(self, x: Tensor, sigma: Tensor | float) -> Tensor:
        s = _as_tensor(sigma).to(x.device, torch.float32)
        _, _, c_in, _ = edm.precondition(s, self.sigma_data)
        return x * _bcast(c_in, x).to(x.dtype)

    def model_time(self, sigma: Tensor) -> Tensor:
        _, _, _, c_noise = edm.precondition(sigma.to(torch.float32), self.sigma_data)
        return self.T * c_noise

    def bucket(self, sigma: Tensor) -> Tensor:
        """σ onto [0, T) by the training distribution's CDF, Φ((ln σ - p_mean)/p_std): every
        bucket holds the same share of the training draws."""
        z = (sigma.to(torch.float32).log() - self.p_mean) / self.p_std
        u = 0.5 * (1 + torch.erf(z / math.sqrt(2)))
        return (u * self.T).long().clamp(0, self.T - 1)

    def grid(self, steps: int, spacing: Spacing = "trailing") -> Tensor:
        """:func:`edm.karras_sigmas` without its final 0."""
        _no_spacing(spacing, self.objective)
        return edm.karras_sigmas(steps, self.sigma_min, self.sigma_max, self.rho)[:-1]

    def levels(self, ts: Tensor) -> tuple[list[float], list[float], list[float]]:
        s = ts.detach().to("cpu", torch.float64)
        if bool((s <= 0).any()):
            raise ValueError("EDM levels are σ > 0; the clean end is appended by the sampler")
        return [1.0] * (len(s) + 1), s.tolist() + [0.0], (-2 * s.log()).tolist() + [math.inf]

    def spread(self, n: int) -> Tensor:
        """n levels at the training distribution's quantiles (i + 1/2)/n."""
        q = (torch.arange(n, dtype=torch.float64) + 0.5) / n
        z = math.sqrt(2) * torch.erfinv(2 * q - 1)
        return (self.p_mean + self.p_std * z).exp().float()

    def prior_std(self, t0: float) -> float:
        """x(σ0) ~ N(0, σ0²·I) (the data's own spread is negligible at σ0 = 80)."""
        return float(t0)

    def to_x0_eps(self, out: Tensor, x: Tensor, sigma: Tensor | float) -> tuple[Tensor, Tensor]:
        """x0 = D = c_skip·x + c_out·F (affine in F); ε = (x - x0)/σ."""
        s = _as_tensor(sigma).to(x.device, torch.float32)
        x0 = edm.denoised(out, x, s, self.sigma_data)
        return x0, (x - x0) / _bcast(s, x)

    def target(self, x0: Tensor, noise: Tensor, x: Tensor, sigma: Tensor) -> Tensor:
        return edm.target(x0, x, sigma.to(torch.float32), self.sigma_data)


AnySchedule = Schedule | FlowSchedule | EDMSchedule


def flow_seq_len(image_size: int, token_pixels: int = 2) -> int:
    """The image token count FLUX's dynamic shift reads: (image_size/token_pixels)², the
    image in tokens of ``token_pixels`` pixels a side (steadydiff's own models: 2x2 patches
    of pixels, as FLUX packs its latents; FLUX.1 itself: 16, its VAE's x8 times the 2x2
    packing, so 1024 px is 4096 tokens)."""
    return (image_size // token_pixels) ** 2


# ---------------------------------------------------------------------- constructors


def _betas_from_alpha_bar(alpha_bar_fn, T: int, max_beta: float = 0.999) -> Tensor:
    """Discretize a continuous ᾱ(u), u in [0, 1], as β_i = 1 - ᾱ((i+1)/T)/ᾱ(i/T), clipped.

    Nichol & Dhariwal 2021, eq. 17 and §3.2: clipping β at 0.999 avoids the singularity at
    the end of the schedule where ᾱ(1) is (almost) 0.
    """
    u = torch.arange(T + 1, dtype=torch.float64) / T
    ab = alpha_bar_fn(u)
    return (1.0 - ab[1:] / ab[:-1]).clamp(min=0.0, max=max_beta)


def _cosine_alpha_bar(u: Tensor, s: float = 0.008) -> Tensor:
    # Nichol & Dhariwal 2021, eq. 17: ᾱ(u) = f(u)/f(0), f(u) = cos²((u+s)/(1+s)·π/2).
    f = torch.cos((u + s) / (1 + s) * math.pi / 2) ** 2
    return f / f[0]


def _sigmoid_alpha_bar(u: Tensor, start: float = -3.0, end: float = 3.0,
                       tau: float = 1.0) -> Tensor:
    # Chen 2023, "On the importance of noise scheduling for diffusion models", Algorithm 1
    # (sigmoid_schedule, the start=-3, end=3, tau=1 setting also used by Jabri et al. 2022):
    # γ(u) = (σ(end/τ) - σ((u·(end-start)+start)/τ)) / (σ(end/τ) - σ(start/τ)), γ(0)=1, γ(1)=0.
    v_start = torch.sigmoid(torch.tensor(start / tau, dtype=torch.float64))
    v_end = torch.sigmoid(torch.tensor(end / tau, dtype=torch.float64))
    out = torch.sigmoid((u * (end - start) + start) / tau)
    return ((v_end - out) / (v_end - v_start)).clamp(0.0, 1.0)


def _piecewise_alpha_bar(points: Sequence[Sequence[float]], T: int) -> Tensor:
    """ᾱ from a log-SNR that is piecewise linear in t/(T-1) through ``points``."""
    points = [list(p) for p in points]  # the config holds tuples; messages show YAML lists
    if len(points) < 2 or any(len(p) != 2 for p in points):
        raise ValueError("diffusion.piecewise must be a list of at least two [t_fraction, log_snr] "
                         f"pairs, got {points!r}")
    fr = [float(p[0]) for p in points]
    ls = [float(p[1]) for p in points]
    if not all(math.isfinite(v) for v in fr + ls):
        raise ValueError(f"diffusion.piecewise values must be finite, got {points!r}; "
                         "for SNR = 0 at the end set diffusion.zero_terminal_snr: true")
    if fr[0] != 0.0 or fr[-1] != 1.0:
        raise ValueError(f"diffusion.piecewise t_fractions must start at 0 and end at 1, got {fr}")
    if any(b <= a for a, b in zip(fr, fr[1:])):
        raise ValueError(f"diffusion.piecewise t_fractions must be strictly increasing, got {fr}")
    if any(b > a for a, b in zip(ls, ls[1:])):
        raise ValueError(f"diffusion.piecewise log_snr values must be non-increasing (noise grows "
                         f"with t), got {ls}")
    lim = PIECEWISE_LOG_SNR_RANGE
    if any(abs(v) > lim for v in ls):
        raise ValueError(f"diffusion.piecewise log_snr values must lie in [-{lim:g}, {lim:g}] so "
                         f"that 0 < ᾱ < 1 in float64, got {ls}; for SNR = 0 at the end set "
                         "diffusion.zero_terminal_snr: true")
    u = torch.arange(T, dtype=torch.float64) / (T - 1)
    xp, fp = torch.tensor(fr, dtype=torch.float64), torch.tensor(ls, dtype=torch.float64)
    # Linear interpolation of λ over the segments (np.interp semantics, in torch).
    seg = (torch.searchsorted(xp, u, right=True) - 1).clamp(0, len(fr) - 2)
    w = (u - xp[seg]) / (xp[seg + 1] - xp[seg])
    lam = torch.lerp(fp[seg], fp[seg + 1], w)
    return torch.sigmoid(lam)


def _rescale_zero_terminal_snr(ab: Tensor) -> Tensor:
    """Lin et al. 2024, "Common Diffusion Noise Schedules and Sample Steps are Flawed", Alg. 1.

    Shift √ᾱ so the last entry is 0 and scale it so the first entry is unchanged; the rest of
    the schedule keeps its shape. Training then sees pure noise at t = T-1, as sampling does.
    """
    s = ab.sqrt()
    s0, sT = s[0].clone(), s[-1].clone()
    if not s0 > sT:
        raise ValueError("diffusion.zero_terminal_snr needs a schedule whose ᾱ decreases from the "
                         "first to the last step; this one is flat")
    s = (s - sT) * (s0 / (s0 - sT))
    s[-1] = 0.0  # exact, whatever the rounding above did
    return s * s


def _check(ab: Tensor, T: int, zero_terminal: bool, kind: ScheduleName) -> None:
    if ab.shape != (T,) or not torch.isfinite(ab).all():
        raise ValueError(f"{kind} schedule produced a non-finite ᾱ table")
    if (ab[1:] > ab[:-1]).any():
        raise ValueError(f"{kind} schedule: ᾱ must not increase with t")
    if ab[0] > 1.0 or (ab[:-1] <= 0).any():
        raise ValueError(f"{kind} schedule: ᾱ underflows to 0 before the last step; lower "
                         "diffusion.beta_end or diffusion.timesteps")
    if zero_terminal and ab[-1] != 0:
        raise AssertionError("zero terminal SNR rescale did not reach ᾱ[T-1] = 0")
    if not zero_terminal and ab[-1] <= 0:
        raise ValueError(f"{kind} schedule: ᾱ reaches 0 at the last step; set "
                         "diffusion.zero_terminal_snr: true if that is intended")


def resolution_shift(base: int, image_size: int) -> float:
    """The log-SNR shift of "simple diffusion" (Hoogeboom et al. 2023, shifted schedules):
    a schedule tuned for ``base`` x ``base`` images, used at ``image_size``, becomes
    logsnr_shifted(t) = logsnr(t) + 2·log(base / image_size).

    Averaging an image down by a factor s in each direction keeps the signal and divides the
    noise variance by s², so the same SNR destroys less of a larger image's content: a
    larger image needs a lower SNR at the same t (the shift is negative for image_size >
    base, zero at the base, positive below it).
    """
    return 2.0 * math.log(base / image_size)


def _shift_log_snr(ab: Tensor, shift: float) -> Tensor:
    """ᾱ after adding ``shift`` to λ = log(ᾱ/(1-ᾱ)) at every step: ᾱ' = sigmoid(λ + shift).
    ᾱ = 0 (zero terminal SNR, λ = -inf) and ᾱ = 1 (λ = +inf) stay exactly where they are."""
    lam = torch.log(ab) - torch.log1p(-ab)
    return torch.sigmoid(lam + shift)


def make_schedule(cfg: DiffusionConfig, image_size: int | None = None) -> AnySchedule:
    """Build the schedule described by ``cfg`` (``diffusion`` section): a :class:`Schedule`
    for ``objective: ddpm`` (below), a :class:`FlowSchedule` (its shift resolved: the
    dynamic one from ``image_size``) or an :class:`EDMSchedule`.

    Kinds:
        linear: β linear from beta_start to beta_end (Ho et al. 2020; 1e-4..0.02 at T=1000).
        cosine: Nichol & Dhariwal 2021 (s = 0.008, β clipped at 0.999).
        sigmoid: Chen 2023, Algorithm 1 (start -3, end 3, tau 1), β clipped at 0.999.
        piecewise: λ piecewise linear in t/(T-1) through ``cfg.piecewise``.
        scaled_linear: √β linear from √beta_start to √beta_end (Stable Diffusion's
            schedule, 0.00085..0.012 at T=1000; diffusers' ``beta_schedule=scaled_linear``).
    With ``cfg.zero_terminal_snr`` the result is rescaled (Lin et al. 2024, Alg. 1) so that
    ᾱ[T-1] = 0 exactly. With ``cfg.resolution_shift_base`` the log-SNR of every step is then
    shifted by :func:`resolution_shift` for ``image_size`` (``data.image_size``).

    Args:
        cfg: the ``diffusion`` section.
        image_size: the training resolution; required when ``cfg.resolution_shift_base``
            is set (a shift silently dropped would train a different model).

    Returns:
        Schedule with float64 (T,) betas and alphas_cumprod.
    Raises:
        ValueError: invalid piecewise points, or a schedule that underflows/flattens.
    """
    T = cfg.timesteps
    if cfg.objective == "flow":
        f = cfg.flow
        shift = f.shift
        if f.dynamic_shift:
            if image_size is None:
                raise ValueError("diffusion.flow.dynamic_shift is set: make_schedule needs the "
                                 "training resolution (image_size=cfg.data.image_size)")
            shift = math.exp(flow.dynamic_shift_mu(
                flow_seq_len(image_size, f.token_pixels), base_seq_len=f.base_seq_len,
                max_seq_len=f.max_seq_len, base_shift=f.base_shift, max_shift=f.max_shift))
        return FlowSchedule(T=T, shift=shift, grid_end=f.grid_end)
    if cfg.objective == "edm":
        e = cfg.edm
        return EDMSchedule(T=T, sigma_data=e.sigma_data, p_mean=e.p_mean, p_std=e.p_std,
                           sigma_min=e.sigma_min, sigma_max=e.sigma_max, rho=e.rho)
    if cfg.objective != "ddpm":
        raise ValueError(f"unknown diffusion.objective {cfg.objective!r}; valid: "
                         f"{', '.join(OBJECTIVES)}")
    if cfg.schedule == "linear":
        betas = torch.linspace(cfg.beta_start, cfg.beta_end, T, dtype=torch.float64)
        ab = torch.cumprod(1.0 - betas, 0)
    elif cfg.schedule == "scaled_linear":
        betas = torch.linspace(cfg.beta_start ** 0.5, cfg.beta_end ** 0.5, T,
                               dtype=torch.float64) ** 2
        ab = torch.cumprod(1.0 - betas, 0)
    elif cfg.schedule == "cosine":
        ab = torch.cumprod(1.0 - _betas_from_alpha_bar(_cosine_alpha_bar, T), 0)
    elif cfg.schedule == "sigmoid":
        ab = torch.cumprod(1.0 - _betas_from_alpha_bar(_sigmoid_alpha_bar, T), 0)
    elif cfg.schedule == "piecewise":
        ab = _piecewise_alpha_bar(cfg.piecewise, T)
    else:  # the config's Literal makes this unreachable; kept for direct callers
        raise ValueError(f"unknown diffusion.schedule {cfg.schedule!r}; "
                         f"valid: {', '.join(SCHEDULES)}")
    if cfg.zero_terminal_snr:
        ab = _rescale_zero_terminal_snr(ab)
    base = cfg.resolution_shift_base
    if base is not None:
        if image_size is None:
            raise ValueError("diffusion.resolution_shift_base is set: make_schedule needs the "
                             "training resolution (image_size=cfg.data.image_size)")
        if base != image_size:  # at the base resolution the shift is 0: the table is unchanged
            ab = _shift_log_snr(ab, resolution_shift(base, image_size))
    _check(ab, T, cfg.zero_terminal_snr, cfg.schedule)
    # β_t = 1 - ᾱ_t/ᾱ_{t-1} with ᾱ_{-1} = 1 (exactly 1 at the zero-SNR end).
    prev = torch.cat([ab.new_ones(1), ab[:-1]])
    betas = 1.0 - ab / prev
    return Schedule(T=T, betas=betas, alphas_cumprod=ab)
