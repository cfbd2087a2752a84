"""Rectified-flow primitives (steadydiff/diffusion/flow.py) against their references:
diffusers' training_utils and FlowMatch schedulers (the same inputs give the same numbers),
kohya's sigmoid sampling, and closed forms (a Gaussian data distribution whose exact velocity
field is known)."""

from __future__ import annotations

import math

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, FlowMatchHeunDiscreteScheduler
from diffusers.pipelines.flux.pipeline_flux import calculate_shift
from diffusers.training_utils import (compute_density_for_timestep_sampling,
                                      compute_loss_weighting_for_sd3)

from steadydiff.diffusion import flow


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------- training σ


def test_draw_sigmas_equal_diffusers_and_kohya():
    n = 257
    # uniform and mode: the same draws and arithmetic as diffusers, bit for bit
    for scheme, ours in (("none", "uniform"), ("mode", "mode")):
        ref = compute_density_for_timestep_sampling(scheme, n, mode_scale=1.29, generator=gen(3))
        assert torch.equal(flow.draw_sigmas(n, ours, gen(3), mode_scale=1.29), ref), scheme
    # logit_normal: diffusers' torch.normal(m, s) rounds m + s·z within an ulp
    ref = compute_density_for_timestep_sampling("logit_normal", n, logit_mean=0.3,
                                                logit_std=1.4, generator=gen(4))
    got = flow.draw_sigmas(n, "logit_normal", gen(4), logit_mean=0.3, logit_std=1.4)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-6)
    # kohya's sigmoid: torch.sigmoid(sigmoid_scale * torch.randn(bsz))
    g = gen(5)
    ref = torch.sigmoid(2.0 * torch.randn((n,), generator=g))
    assert torch.equal(flow.draw_sigmas(n, "sigmoid", gen(5), sigmoid_scale=2.0), ref)


def test_draw_sigmas_densities():
    """Each density's closed form: the logit-normal's median sigmoid(m); mode's median
    f(1/2); all inside [0, 1]; a generator replays the same values."""
    n = 20000
    for scheme in ("uniform", "logit_normal", "mode", "sigmoid"):
        s = flow.draw_sigmas(n, scheme, gen(1), logit_mean=0.5)
        assert s.shape == (n,) and s.dtype == torch.float32
        assert float(s.min()) >= 0 and float(s.max()) <= 1, scheme
        assert torch.equal(s, flow.draw_sigmas(n, scheme, gen(1), logit_mean=0.5))
    med = flow.draw_sigmas(n, "logit_normal", gen(2), logit_mean=0.5).median()
    assert abs(float(med) - 1 / (1 + math.exp(-0.5))) < 0.01
    # mode is a decreasing map of u ~ U[0, 1): the median of σ is f(1/2)
    f_half = 1 - 0.5 - 1.29 * (math.cos(math.pi / 4) ** 2 - 1 + 0.5)
    assert abs(float(flow.draw_sigmas(n, "mode", gen(2)).median()) - f_half) < 0.01
    with pytest.raises(ValueError, match="valid: uniform, logit_normal, mode, sigmoid"):
        flow.draw_sigmas(4, "beta", gen())


def test_shifts_equal_diffusers():
    """The static shift is diffusers' training table at shift=3 (SD3); FLUX's mu is the
    pipelines' calculate_shift; the exponential time shift with mu is the static shift with
    s = e^mu, and the scheduler's own time_shift."""
    sch = FlowMatchEulerDiscreteScheduler(shift=3.0)
    base = torch.linspace(1, 1000, 1000).flip(0) / 1000
    torch.testing.assert_close(flow.shift_sigmas(base, 3.0), sch.sigmas, rtol=0, atol=1e-7)
    assert flow.shift_sigmas(base, 1.0) is base
    for seq in (64, 256, 1024, 4096, 6000):
        assert flow.dynamic_shift_mu(seq) == pytest.approx(calculate_shift(seq), abs=1e-12)
    mu = flow.dynamic_shift_mu(1024)
    s = torch.rand(100, generator=gen()) * 0.98 + 0.01
    dyn = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True)
    torch.testing.assert_close(flow.time_shift(s, mu), dyn.time_shift(mu, 1.0, s))
    torch.testing.assert_close(flow.time_shift(s, mu), flow.shift_sigmas(s, math.exp(mu)))
    # the ends stay where they are, without NaN at σ = 0
    ends = torch.tensor([0.0, 1.0])
    assert flow.time_shift(ends, mu).tolist() == [0.0, 1.0]
    assert flow.shift_sigmas(ends, 3.0).tolist() == [0.0, 1.0]
    with pytest.raises(ValueError, match="shift must be > 0"):
        flow.shift_sigmas(s, 0.0)
    with pytest.raises(ValueError, match="max_seq_len"):
        flow.dynamic_shift_mu(100, base_seq_len=4096, max_seq_len=256)


def test_shift_is_a_log_snr_shift():
    """SD3 §5.3.2: the shift s lowers every log-SNR 2·log((1-σ)/σ) by 2·log s."""
    s = torch.linspace(0.05, 0.95, 19, dtype=torch.float64)
    snr = lambda x: 2 * torch.log((1 - x) / x)  # noqa: E731
    torch.testing.assert_close(snr(flow.shift_sigmas(s, 3.0)), snr(s) - 2 * math.log(3.0))


def test_loss_weights_equal_diffusers():
    s = torch.rand(64, generator=gen()) * 0.99 + 0.005
    for ours, theirs in (("uniform", "none"), ("sigma_sqrt", "sigma_sqrt"),
                         ("cosmap", "cosmap")):
        torch.testing.assert_close(flow.loss_weight(ours, s),
                                   compute_loss_weighting_for_sd3(theirs, s), rtol=0, atol=0)
    with pytest.raises(ValueError, match="valid: uniform, sigma_sqrt, cosmap"):
        flow.loss_weight("min_snr", s)


def test_line_and_velocity():
    x0, eps = torch.randn(3, 2, 4, 4, generator=gen(1)), torch.randn(3, 2, 4, 4, generator=gen(2))
    s = torch.tensor([0.0, 0.3, 1.0])
    x = flow.noisy(x0, eps, s)
    assert torch.equal(x[0], x0[0]) and torch.equal(x[2], eps[2])
    v = flow.velocity(x0, eps)
    torch.testing.assert_close(flow.to_x0(x, v, s), x0)
    torch.testing.assert_close(flow.to_noise(x, v, s), eps)
    # the velocity is dx/dσ along the line
    d = (flow.noisy(x0, eps, s + 1e-3) - flow.noisy(x0, eps, s)) / 1e-3
    torch.testing.assert_close(d, v, atol=1e-3, rtol=1e-3)
    assert torch.equal(flow.timesteps(s), s * 1000)


# --------------------------------------------------------------------------- sampling


def test_sampling_sigmas_equal_diffusers():
    n = 7
    # FLUX's pipeline: sigmas = linspace(1, 1/n, n) with the dynamic mu
    mu = flow.dynamic_shift_mu(1024)
    sch = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True)
    sch.set_timesteps(n, sigmas=[1 - i / n for i in range(n)], mu=mu)
    torch.testing.assert_close(flow.sampling_sigmas(n, mu=mu), sch.sigmas, rtol=0, atol=1e-6)
    # SD3's default (no sigmas passed): the grid ends at the training table's smallest σ
    sd3 = FlowMatchEulerDiscreteScheduler(shift=3.0)
    sd3.set_timesteps(n)
    end = float(flow.shift_sigmas(torch.tensor(1 / 1000), 3.0))
    torch.testing.assert_close(flow.sampling_sigmas(n, shift=3.0, end=end), sd3.sigmas,
                               rtol=0, atol=1e-6)
    g = flow.sampling_sigmas(n, shift=3.0)
    assert g.shape == (n + 1,) and g[0] == 1 and g[-1] == 0 and bool((g[1:] < g[:-1]).all())
    with pytest.raises(ValueError, match="not both"):
        flow.sampling_sigmas(n, shift=2.0, mu=0.5)


def _tiny_velocity(seed=0):
    """A smooth nonlinear stand-in for a network: v(x, σ) = tanh(W x)·(1 + σ)."""
    w = torch.randn(16, 16, generator=gen(seed)) / 4

    def v(x, s):
        return torch.tanh(x.reshape(x.shape[0], -1) @ w).reshape(x.shape) * (1 + s[:, None,
                                                                                 None, None])
    return v


def test_euler_equals_flow_match_euler_scheduler():
    n = 6
    v = _tiny_velocity()
    x = torch.randn(2, 1, 4, 4, generator=gen(7))
    sch = FlowMatchEulerDiscreteScheduler(shift=3.0)
    sch.set_timesteps(n)
    ref = x.clone()
    for t in sch.timesteps:
        ref = sch.step(v(ref, (t / 1000).expand(2)), t, ref).prev_sample
    seen = []
    got = flow.sample_euler(v, x, sch.sigmas, callback=seen.append)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-6)
    assert [d["i"] for d in seen] == list(range(n))
    assert torch.equal(seen[0]["x"], x) and seen[0]["sigma"] == sch.sigmas[0]


def test_heun_equals_flow_match_heun_scheduler():
    n = 5
    v = _tiny_velocity(1)
    x = torch.randn(2, 1, 4, 4, generator=gen(8))
    sch = FlowMatchHeunDiscreteScheduler(shift=2.0)
    sch.set_timesteps(n)
    ref, calls = x.clone(), 0
    for t in sch.timesteps:
        ref = sch.step(v(ref, (t / 1000).expand(2)), t, ref).prev_sample
        calls += 1
    end = float(flow.shift_sigmas(torch.tensor(1 / 1000), 2.0))
    counted = []
    got = flow.sample_heun(lambda a, s: counted.append(1) or v(a, s), x,
                           flow.sampling_sigmas(n, shift=2.0, end=end))
    # diffusers divides (x - (x - σ·v)) by σ again: float32 rounding, a few ulps
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert len(counted) == calls == 2 * n - 1


def gaussian_velocity(mu: float, s: float):
    """The exact velocity E[ε - x0 | x_σ] for data x0 ~ N(mu, s²) per dimension:
    x_σ ~ N((1-σ)mu, (1-σ)²s² + σ²), and (x0, ε) given x_σ are Gaussian regressions."""
    def v(x, sig):
        sg = sig.reshape(-1, *([1] * (x.ndim - 1))).double()
        var = (1 - sg) ** 2 * s * s + sg * sg
        r = x.double() - (1 - sg) * mu
        e_x0 = mu + (1 - sg) * s * s / var * r
        e_eps = sg / var * r
        return (e_eps - e_x0).to(x.dtype)
    return v


def test_samplers_recover_a_gaussian_at_their_order():
    """With the exact velocity of N(mu, s²) data the ODE maps each noise z onto mu + s·z
    (the flow map is affine here); Euler's error halves with twice the steps (first order),
    Heun's quarters (second order)."""
    mu, s = 0.7, 0.3
    z = torch.randn(2000, 1, 1, 1, generator=gen(11), dtype=torch.float64)
    v = gaussian_velocity(mu, s)

    def err(sampler, steps):
        out = getattr(flow, f"sample_{sampler}")(v, z, flow.sampling_sigmas(steps))
        return float((out.double() - (mu + s * z)).abs().max())

    e32, e64 = err("euler", 32), err("euler", 64)
    h16, h32 = err("heun", 16), err("heun", 32)
    assert 1.7 < e32 / e64 < 2.3, (e32, e64)
    assert 3.4 < h16 / h32 < 4.8, (h16, h32)
    assert h32 < 0.01
    out = flow.sample_heun(v, z, flow.sampling_sigmas(32))
    assert abs(float(out.std()) / float(z.std()) - s) < 0.003


def test_euler_is_exact_for_one_data_point():
    """s = 0: every line ends at mu, so one Euler step from σ = 1 lands exactly there."""
    x = torch.randn(5, 1, 2, 2, generator=gen(3))
    out = flow.sample_euler(gaussian_velocity(0.25, 0.0), x, flow.sampling_sigmas(1))
    torch.testing.assert_close(out, torch.full_like(x, 0.25), atol=1e-6, rtol=0)


def test_sampler_arguments_are_checked():
    v = _tiny_velocity()
    x = torch.zeros(1, 1, 4, 4)
    with pytest.raises(ValueError, match="descending"):
        flow.sample_euler(v, x, torch.tensor([0.2, 0.5, 0.0]))
    with pytest.raises(ValueError, match="at least two levels"):
        flow.sample_heun(v, x, torch.tensor([1.0]))
