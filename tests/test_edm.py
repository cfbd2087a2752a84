"""EDM primitives (steadydiff/diffusion/edm.py) against Karras et al. 2022's Table 1 and
Alg. 1, diffusers' EDMEulerScheduler (same inputs, same numbers), and a Gaussian data
distribution whose exact denoiser is known."""

from __future__ import annotations

import math

import pytest
import torch
from diffusers import EDMEulerScheduler

from steadydiff.diffusion import edm


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_preconditioning_is_table_1():
    sd = 0.5
    # at σ = σd every coefficient has a closed value
    c_skip, c_out, c_in, c_noise = edm.precondition(torch.tensor(sd, dtype=torch.float64), sd)
    assert float(c_skip) == pytest.approx(0.5)
    assert float(c_out) == pytest.approx(sd / math.sqrt(2))
    assert float(c_in) == pytest.approx(1 / (sd * math.sqrt(2)))
    assert float(c_noise) == pytest.approx(math.log(sd) / 4)
    s = torch.tensor([0.002, 0.1, 1.0, 80.0], dtype=torch.float64)
    c_skip, c_out, c_in, c_noise = edm.precondition(s, sd)
    torch.testing.assert_close(c_skip, sd**2 / (s**2 + sd**2))
    torch.testing.assert_close(c_out, s * sd / (s**2 + sd**2).sqrt())
    torch.testing.assert_close(c_in, 1 / (s**2 + sd**2).sqrt())
    torch.testing.assert_close(c_noise, s.log() / 4)
    # the loss weight undoes c_out: λ·c_out² = 1 (eq. 8's effective weight)
    torch.testing.assert_close(edm.loss_weight(s, sd) * c_out**2, torch.ones_like(s))
    # the ends: D -> x as σ -> 0 (c_skip -> 1, c_out -> 0); D -> F·σd as σ -> inf
    assert float(c_skip[0]) > 0.9999 and float(c_out[0]) < 0.0021
    assert float(c_skip[-1]) < 1e-4 and abs(float(c_out[-1]) - sd) < 1e-4


def test_preconditioning_equals_diffusers():
    sch = EDMEulerScheduler(sigma_data=0.5)
    s = torch.tensor([0.01, 0.3, 2.0, 40.0])
    x = torch.randn(4, 1, 3, 3, generator=gen(1))
    f = torch.randn(4, 1, 3, 3, generator=gen(2))
    for i in range(4):
        c_skip, c_out, c_in, c_noise = edm.precondition(s[i])
        torch.testing.assert_close(x[i] * c_in, sch.precondition_inputs(x[i], s[i]))
        torch.testing.assert_close(c_noise, sch.precondition_noise(s[i]))
        torch.testing.assert_close(edm.denoised(f[i:i + 1], x[i:i + 1], s[i]),
                                   sch.precondition_outputs(x[i:i + 1], f[i:i + 1], s[i]))


def test_target_makes_the_f_loss_the_weighted_d_loss():
    """‖F - target‖² = λ(σ)·‖D(F) - x0‖² for any F (eq. 8), sample by sample."""
    x0 = torch.randn(5, 2, 4, 4, generator=gen(3), dtype=torch.float64)
    eps = torch.randn(5, 2, 4, 4, generator=gen(4), dtype=torch.float64)
    s = torch.tensor([0.01, 0.2, 0.5, 3.0, 60.0], dtype=torch.float64)
    x = edm.noisy(x0, eps, s)
    f = torch.randn(5, 2, 4, 4, generator=gen(5), dtype=torch.float64)
    lhs = (f - edm.target(x0, x, s)).square().mean((1, 2, 3))
    c_skip, c_out, _, _ = edm.precondition(s)
    d = c_skip.reshape(-1, 1, 1, 1) * x + c_out.reshape(-1, 1, 1, 1) * f
    rhs = edm.loss_weight(s) * (d - x0).square().mean((1, 2, 3))
    torch.testing.assert_close(lhs, rhs)
    # the target is what F would have to be for D to return x0 exactly
    torch.testing.assert_close(c_skip.reshape(-1, 1, 1, 1) * x + c_out.reshape(-1, 1, 1, 1)
                               * edm.target(x0, x, s), x0)


def test_training_sigmas_are_log_normal():
    s = edm.draw_sigmas(50000, gen(6), p_mean=-1.2, p_std=1.2)
    assert s.dtype == torch.float32 and float(s.min()) > 0
    assert abs(float(s.log().mean()) + 1.2) < 0.02 and abs(float(s.log().std()) - 1.2) < 0.02
    assert torch.equal(s, edm.draw_sigmas(50000, gen(6)))


def test_karras_sigmas_are_eq_5_and_diffusers():
    n = 18
    s = edm.karras_sigmas(n)
    assert s.shape == (n + 1,) and s[-1] == 0
    assert float(s[0]) == pytest.approx(80.0) and float(s[-2]) == pytest.approx(0.002)
    i = torch.arange(n, dtype=torch.float64)
    ref = (80 ** (1 / 7) + i / (n - 1) * (0.002 ** (1 / 7) - 80 ** (1 / 7))) ** 7
    torch.testing.assert_close(s[:-1].double(), ref, rtol=1e-6, atol=0)
    sch = EDMEulerScheduler()
    sch.set_timesteps(n)
    torch.testing.assert_close(s, sch.sigmas)
    assert edm.karras_sigmas(1).tolist() == [80.0, 0.0]
    with pytest.raises(ValueError, match="sigma_min < sigma_max"):
        edm.karras_sigmas(4, sigma_min=1.0, sigma_max=0.5)


def test_euler_equals_edm_euler_scheduler():
    """The same network F and noise through diffusers' EDMEulerScheduler loop
    (precondition_inputs/noise/outputs, step) and through our Euler over D."""
    w = torch.randn(9, 9, generator=gen(7)) / 3

    def F(xin, c_noise):  # a smooth stand-in for a network
        return torch.tanh(xin.reshape(xin.shape[0], -1) @ w).reshape(xin.shape) + c_noise

    n = 8
    sch = EDMEulerScheduler()
    sch.set_timesteps(n)
    x = torch.randn(2, 1, 3, 3, generator=gen(8)) * sch.init_noise_sigma
    ref = x.clone()
    for t in sch.timesteps:
        xin = sch.scale_model_input(ref, t)
        ref = sch.step(F(xin, t), t, ref).prev_sample

    def D(a, sig):
        _, _, c_in, c_noise = edm.precondition(sig)
        return edm.denoised(F(a * c_in.reshape(-1, 1, 1, 1), c_noise.reshape(-1, 1, 1, 1)),
                            a, sig)

    got = edm.sample_euler(D, x, edm.karras_sigmas(n))
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def gaussian_denoiser(mu: float, s: float):
    """The exact D(x; σ) = E[x0 | x] for x0 ~ N(mu, s²) per dimension, x = x0 + σ·ε."""
    def D(x, sig):
        sg = sig.reshape(-1, *([1] * (x.ndim - 1))).double()
        return (mu + s * s / (s * s + sg * sg) * (x.double() - mu)).to(x.dtype)
    return D


def test_samplers_recover_a_gaussian_at_their_order():
    """With the exact denoiser of N(mu, s²) data the ODE maps x(σmax) = mu + √(s²+σmax²)·z
    onto mu + s·z; Euler's error halves with twice the steps, Heun's quarters (Alg. 1 is
    second order), and Heun with 64 steps returns the data's moments."""
    mu, s = -0.4, 0.5
    z = torch.randn(2000, 1, 1, 1, generator=gen(9), dtype=torch.float64)
    D = gaussian_denoiser(mu, s)

    def run(sampler, steps):
        x = mu + math.sqrt(s * s + 80.0 ** 2) * z
        return getattr(edm, f"sample_{sampler}")(D, x, edm.karras_sigmas(steps)).double()

    def err(sampler, steps):
        return float((run(sampler, steps) - (mu + s * z)).abs().max())

    e64, e128 = err("euler", 64), err("euler", 128)
    h16, h32 = err("heun", 16), err("heun", 32)
    assert 1.7 < e64 / e128 < 2.3, (e64, e128)
    assert 3.4 < h16 / h32 < 4.8, (h16, h32)
    out = run("heun", 64)
    assert abs(float(out.mean()) - float(mu + s * z.mean())) < 1e-3
    assert abs(float(out.std()) / float(z.std()) - s) < 4e-3


def test_heun_evaluates_2n_minus_1_times_and_calls_back():
    calls, seen = [], []

    def D(x, sig):
        calls.append(float(sig[0]))
        return torch.zeros_like(x)

    edm.sample_heun(D, torch.ones(1, 1, 2, 2), edm.karras_sigmas(5), callback=seen.append)
    assert len(calls) == 9 and [c["i"] for c in seen] == list(range(5))
    # the second evaluation of step i is at σ_{i+1}; none at σ = 0
    assert calls[1] == pytest.approx(calls[2]) and min(calls) > 0
    with pytest.raises(ValueError, match="descending"):
        edm.sample_euler(D, torch.ones(1, 1, 2, 2), torch.tensor([1.0, 2.0, 0.0]))
