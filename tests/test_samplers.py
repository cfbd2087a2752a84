"""Sampler contracts (diffusion/samplers.py): every sampler, on an exact analytic denoiser,
must reproduce the data distribution; plus timestep spacings, CFG, determinism and errors."""

import math

import pytest
import torch
from torch import nn

from steadydiff.config import DiffusionConfig
from steadydiff.diffusion import edm
from steadydiff.kinds import OBJECTIVE_SAMPLERS, PREDICTIONS
from steadydiff.diffusion import (
    SAMPLERS,
    Denoiser,
    ddim,
    ddpm,
    euler,
    make_schedule,
    sample,
    sampling_timesteps,
    to_x0_eps,
)

MU, S = 0.3, 0.4  # 1-pixel data x0 ~ N(MU, S²)
N = 4000
STEPS = {"ddim": 50, "dpmpp_2m": 20, "euler": 100, "ddpm": 250}
DDPM_SAMPLERS = OBJECTIVE_SAMPLERS["ddpm"]  # heun belongs to flow and edm


class GaussianOracle(nn.Module):
    """The exact denoiser for x0 ~ N(MU, S²): E[x0 | x_t] = MU + a·S²·(x_t - a·MU)/(a²S² + σ²),
    returned as the configured prediction (eps, x0 or v). Counts calls and rows."""

    num_classes = 0

    def __init__(self, schedule, prediction):
        super().__init__()
        self.schedule, self.prediction = schedule, prediction
        self.calls, self.ts = 0, []

    def forward(self, x, t, y=None):
        self.calls += 1
        self.ts.append(t)
        a, s = self.schedule.alpha_sigma(t)
        a, s = a.view(-1, 1, 1, 1), s.view(-1, 1, 1, 1)
        x0 = MU + a * S * S * (x - a * MU) / (a * a * S * S + s * s)
        if self.prediction == "x0":
            return x0
        eps = (x - a * x0) / s  # s > 0 at every sampled t
        return eps if self.prediction == "eps" else a * eps - s * x0


def run(name, schedule, prediction, steps=None, seed=0, **kw):
    model = GaussianOracle(schedule, prediction)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, 1, 1, 1, generator=g)
    den = Denoiser(model, schedule, prediction, clip_x0=False)
    ts = sampling_timesteps(schedule, steps or STEPS[name])
    extra = {"generator": g, **kw} if name in ("ddpm", "ddim") else kw
    return SAMPLERS[name](den, x, ts, schedule, **extra), model


@pytest.fixture(scope="module")
def schedules():
    return {z: make_schedule(DiffusionConfig(zero_terminal_snr=z)) for z in (False, True)}


@pytest.mark.parametrize("zero", [False, True], ids=["linear", "linear-ztsnr"])
@pytest.mark.parametrize("prediction", PREDICTIONS)
@pytest.mark.parametrize("name", list(STEPS))
def test_sampler_recovers_gaussian_data(schedules, name, prediction, zero):
    out, model = run(name, schedules[zero], prediction)
    assert out.shape == (N, 1, 1, 1) and out.dtype == torch.float32
    assert torch.isfinite(out).all()
    assert model.calls == STEPS[name]
    # Tolerances: the starting noise alone has mean/std error ≈ 1/√N ≈ 1.6%; first-order
    # samplers lose ≈ 5% of the std at 50 steps on this narrow (S = 0.4) data, and the final
    # x0 estimate is a posterior mean (≈ 1-2% narrower). Bugs show up as far larger errors.
    assert out.mean().item() == pytest.approx(MU, abs=0.03)
    assert out.std().item() == pytest.approx(S, rel=0.1)


@pytest.mark.parametrize("kind", ["cosine", "sigmoid", "piecewise"])
@pytest.mark.parametrize("zero", [False, True])
def test_dpmpp_2m_on_other_schedules(kind, zero):
    sched = make_schedule(DiffusionConfig(schedule=kind, zero_terminal_snr=zero))
    out, _ = run("dpmpp_2m", sched, "v")
    assert out.mean().item() == pytest.approx(MU, abs=0.03)
    assert out.std().item() == pytest.approx(S, rel=0.1)


def test_more_steps_converge(schedules):
    """Second order beats first order, and both improve with steps."""
    sched = schedules[False]
    err = {}
    for name, steps in (("ddim", 20), ("ddim", 200), ("dpmpp_2m", 20), ("dpmpp_2m", 200)):
        out, _ = run(name, sched, "v", steps=steps)
        err[name, steps] = abs(out.std().item() - S)
    assert err["ddim", 200] < err["ddim", 20]
    assert err["dpmpp_2m", 200] < err["dpmpp_2m", 20] < err["ddim", 20]


def test_euler_equals_ddim_eta0(schedules):
    """Euler in σ̃ = σ/α space is DDIM (Song et al. 2021 §4.3, Karras et al. 2022)."""
    for zero in (False, True):
        a, _ = run("euler", schedules[zero], "eps", steps=30)
        b, _ = run("ddim", schedules[zero], "eps", steps=30)
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_ddim_eta1_matches_ddpm_distribution(schedules):
    sched = schedules[False]
    out, _ = run("ddim", sched, "x0", steps=250, eta=1.0)
    g = torch.Generator().manual_seed(0)
    den = Denoiser(GaussianOracle(sched, "x0"), sched, "x0", clip_x0=False)
    x = torch.randn(N, 1, 1, 1, generator=g)
    ref = ddpm(den, x, sampling_timesteps(sched, 250), sched, g)
    assert out.mean().item() == pytest.approx(ref.mean().item(), abs=0.01)
    assert out.std().item() == pytest.approx(ref.std().item(), rel=0.03)


@pytest.mark.parametrize("name", DDPM_SAMPLERS)
def test_samplers_are_deterministic_under_a_seed(schedules, name):
    sched = schedules[True]
    kw = {"eta": 0.5} if name == "ddim" else {}
    a, _ = run(name, sched, "v", steps=10, seed=3, **kw)
    b, _ = run(name, sched, "v", steps=10, seed=3, **kw)
    c, _ = run(name, sched, "v", steps=10, seed=4, **kw)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_single_step_and_all_steps(schedules):
    for zero in (False, True):
        for name in DDPM_SAMPLERS:
            out, _ = run(name, schedules[zero], "v", steps=1)
            assert torch.isfinite(out).all()
    sched = make_schedule(DiffusionConfig(timesteps=20, zero_terminal_snr=True))
    for name in DDPM_SAMPLERS:
        out, model = run(name, sched, "eps", steps=20)
        assert torch.isfinite(out).all() and model.calls == 20


# ---------------------------------------------------------------------- timesteps


def test_sampling_timesteps_spacings(schedules):
    sched = schedules[False]
    tr = sampling_timesteps(sched, 10, "trailing")
    assert tr.tolist() == [999, 899, 799, 699, 599, 499, 399, 299, 199, 99]
    assert sampling_timesteps(sched, 10, "leading").tolist() == list(range(900, -1, -100))
    ls = sampling_timesteps(sched, 10, "linspace")
    assert ls[0] == 999 and ls[-1] == 0 and ls.dtype == torch.float32
    for spacing in ("trailing", "leading", "linspace"):
        for steps in (1, 7, 333, 1000):
            ts = sampling_timesteps(sched, steps, spacing)
            assert ts.shape == (steps,) and (ts[1:] < ts[:-1]).all()
            assert ts.min() >= 0 and ts.max() <= 999 and torch.equal(ts, ts.round())
    assert sampling_timesteps(sched, 1000).tolist() == list(range(999, -1, -1))
    with pytest.raises(ValueError, match="steps"):
        sampling_timesteps(sched, 1001)
    with pytest.raises(ValueError, match="spacing"):
        sampling_timesteps(sched, 10, "uniform")


# ---------------------------------------------------------------------- sample() and CFG


class ClassModel(nn.Module):
    """A conditional model whose output depends on x, t and y; logs every call."""

    def __init__(self, num_classes=3):
        super().__init__()
        self.num_classes = num_classes
        self.emb = nn.Parameter(torch.linspace(-0.5, 0.5, num_classes + 1))
        self.log = []

    def forward(self, x, t, y=None):
        self.log.append((x.shape[0], t.clone(), None if y is None else y.clone()))
        shift = 0 if y is None else self.emb[y].view(-1, 1, 1, 1)
        return 0.5 * x + shift + 1e-4 * t.view(-1, 1, 1, 1)


def test_sample_shapes_range_determinism(schedules):
    sched = schedules[False]
    model = ClassModel()
    y = torch.tensor([0, 1, 2, 1])
    outs = [sample(model, sched, "v", (4, 1, 3, 3), sampler=name, steps=5, y=y, cfg_scale=2.0,
                   generator=torch.Generator().manual_seed(0)) for name in DDPM_SAMPLERS]
    for out in outs:
        assert out.shape == (4, 1, 3, 3) and out.dtype == torch.float32
        assert out.min() >= -1 and out.max() <= 1 and not out.requires_grad
    again = sample(model, sched, "v", (4, 1, 3, 3), sampler="ddpm", steps=5, y=y, cfg_scale=2.0,
                   generator=torch.Generator().manual_seed(0))
    assert torch.equal(again, outs[0])
    # what the model receives: (2N,) float32, integer-valued, trailing timesteps
    _, t, yy = model.log[-1]
    assert t.dtype == torch.float32 and t.shape == (8,)
    assert sorted({float(lg[1][0]) for lg in model.log[-5:]}, reverse=True) == \
        sampling_timesteps(sched, 5).tolist()
    assert yy.tolist() == [0, 1, 2, 1, 3, 3, 3, 3]


def test_cfg_batches_once_per_step_with_2n_rows(schedules):
    sched = schedules[False]
    model = ClassModel()
    y = torch.tensor([0, 2])
    sample(model, sched, "eps", (2, 1, 2, 2), sampler="dpmpp_2m", steps=7, y=y, cfg_scale=3.0,
           generator=torch.Generator().manual_seed(0))
    assert len(model.log) == 7 and all(rows == 4 for rows, _, _ in model.log)
    model.log.clear()
    sample(model, sched, "eps", (2, 1, 2, 2), sampler="dpmpp_2m", steps=7, y=y, cfg_scale=1.0,
           generator=torch.Generator().manual_seed(0))
    assert len(model.log) == 7 and all(rows == 2 for rows, _, _ in model.log)


@pytest.mark.parametrize("prediction", PREDICTIONS)
def test_cfg_scale_one_is_conditional_and_guidance_is_eps_space(schedules, prediction):
    sched = schedules[False]
    model = ClassModel()
    y = torch.tensor([0, 1, 2])
    x = torch.randn(3, 1, 2, 2)
    t = torch.tensor(500.0)
    a, s = sched.alpha_sigma(t)
    with torch.no_grad():
        cond = to_x0_eps(prediction, model(x, t.expand(3), y), x, a, s)
        uncond = to_x0_eps(prediction, model(x, t.expand(3), torch.full_like(y, 3)), x, a, s)
        plain = Denoiser(model, sched, prediction, cfg_scale=1.0, y=y, clip_x0=False)(x, t)
        guided = Denoiser(model, sched, prediction, cfg_scale=4.0, y=y, clip_x0=False)(x, t)
        unc = Denoiser(model, sched, prediction, cfg_scale=0.0, y=y, clip_x0=False)(x, t)
    torch.testing.assert_close(plain[0], cond[0])
    torch.testing.assert_close(plain[1], cond[1])
    torch.testing.assert_close(unc[1], uncond[1])
    # guidance in eps space (and x0 space) whatever the prediction type
    torch.testing.assert_close(guided[1], uncond[1] + 4.0 * (cond[1] - uncond[1]))
    torch.testing.assert_close(guided[0], uncond[0] + 4.0 * (cond[0] - uncond[0]))


def test_clip_x0_keeps_pair_consistent(schedules):
    sched = schedules[False]
    model = ClassModel()
    x = 5 * torch.randn(4, 1, 2, 2)
    t = torch.tensor(100.0)
    x0, eps = Denoiser(model, sched, "x0", y=None, clip_x0=True)(x, t)
    a, s = sched.alpha_sigma(t)
    assert x0.abs().max() <= 1
    torch.testing.assert_close(a * x0 + s * eps, x)


def test_sample_errors(schedules):
    sched = schedules[False]
    model = ClassModel()
    with pytest.raises(ValueError, match="ddpm, ddim, dpmpp_2m, euler"):
        sample(model, sched, "eps", (1, 1, 2, 2), sampler="heun")
    with pytest.raises(ValueError, match=r"\[1, 1000\]"):
        sample(model, sched, "eps", (1, 1, 2, 2), steps=1001)
    with pytest.raises(ValueError, match="unconditional"):
        Denoiser(GaussianOracle(sched, "eps"), sched, "eps", y=torch.zeros(1, dtype=torch.long))
    with pytest.raises(ValueError, match="descending"):
        ddim(Denoiser(model, sched, "eps"), torch.zeros(1, 1, 2, 2), torch.tensor([1.0, 5.0]),
             sched)
    # cfg_scale without labels: nothing to guide, no error
    sample(model, sched, "eps", (1, 1, 2, 2), steps=2, cfg_scale=3.0)


def test_zero_terminal_snr_first_step_is_pure_noise(schedules):
    """With ᾱ[T-1] = 0 the first model call sees alpha = 0; every sampler must stay finite
    even for an eps model (where x0 is undetermined) and a model that is not exact."""
    sched = schedules[True]
    assert sampling_timesteps(sched, 10)[0] == 999 and sched.alpha_sigma(999.0)[0] == 0
    model = ClassModel()
    for name in DDPM_SAMPLERS:
        for pred in PREDICTIONS:
            out = sample(model, sched, pred, (2, 1, 2, 2), sampler=name, steps=10,
                         y=torch.tensor([0, 1]), cfg_scale=2.0, clip_x0=False,
                         generator=torch.Generator().manual_seed(0))
            assert torch.isfinite(out).all()
    euler(Denoiser(model, sched, "eps"), torch.randn(2, 1, 2, 2), sampling_timesteps(sched, 3),
          sched)


# ---------------------------------------------------------------------- flow and edm
# The same contract for the other objectives: every sampler the objective takes, on the
# exact denoiser of Gaussian data written in that objective's own output (flow: the velocity
# ε - x0 of the network called at σ·T; edm: F of the network called with c_in·x at T·¼ln σ),
# reproduces the data distribution through sample(): the grid, the starting noise (σmax for
# edm), the output conversion and the sampler all take part.

OBJ_STEPS = {"ddpm": 250, "ddim": 50, "dpmpp_2m": 20, "euler": 100, "heun": 20}


class ObjectiveOracle(nn.Module):
    """E[x0 | x] for x0 ~ N(MU, S²), answered as the objective's network would: it recovers
    the level from its time input and x from its (preconditioned) input."""

    num_classes = 0

    def __init__(self, schedule):
        super().__init__()
        self.s = schedule
        self.calls, self.ts = 0, []

    def forward(self, xin, t, y=None):
        self.calls += 1
        self.ts.append(t)
        sch, obj = self.s, self.s.objective
        sig = t / sch.T if obj == "flow" else torch.exp(4 * t / sch.T)  # (N,)
        sg = sig.view(-1, 1, 1, 1).double()
        x = xin.double()
        if obj == "edm":
            x = x * (sg * sg + sch.sigma_data ** 2).sqrt()  # undo c_in
        a, s = (1 - sg, sg) if obj == "flow" else (torch.ones_like(sg), sg)
        x0 = MU + a * S * S * (x - a * MU) / (a * a * S * S + s * s)
        if obj == "flow":
            eps = (x - a * x0) / s
            return (eps - x0).float()
        c_skip, c_out, _, _ = edm.precondition(sg, sch.sigma_data)
        return ((x0 - c_skip * x) / c_out).float()


@pytest.fixture(scope="module")
def objective_schedules():
    return {"flow": make_schedule(DiffusionConfig(objective="flow")),
            "flow-shift3": make_schedule(DiffusionConfig(objective="flow",
                                                         flow={"shift": 3.0})),
            "edm": make_schedule(DiffusionConfig(objective="edm"))}


@pytest.mark.parametrize("name", list(OBJ_STEPS))
@pytest.mark.parametrize("which", ["flow", "flow-shift3", "edm"])
def test_objective_samplers_recover_gaussian_data(objective_schedules, which, name):
    sched = objective_schedules[which]
    model = ObjectiveOracle(sched)
    steps = OBJ_STEPS[name]
    out = sample(model, sched, "eps", (N, 1, 1, 1), sampler=name, steps=steps,
                 generator=torch.Generator().manual_seed(0), clip_x0=False)
    assert out.shape == (N, 1, 1, 1) and torch.isfinite(out).all()
    assert model.calls == (2 * steps - 1 if name == "heun" else steps)
    # the network saw the objective's time input: flow σ·T from 1000 down; edm T·¼ln σ
    first = float(model.ts[0][0])
    if sched.objective == "flow":
        assert first == pytest.approx(1000.0)
    else:
        assert first == pytest.approx(1000 * math.log(80.0) / 4, rel=1e-5)
    assert out.mean().item() == pytest.approx(MU, abs=0.03)
    assert out.std().item() == pytest.approx(S, rel=0.1)


def test_objective_euler_is_ddim():
    """On flow and on edm, Euler in the objective's ODE and DDIM (eta = 0) over its
    (alpha, sigma) are the same first-order step (flow's line: Euler is exact DDIM)."""
    for cfg in (DiffusionConfig(objective="flow", flow={"shift": 2.0}),
                DiffusionConfig(objective="edm")):
        sched = make_schedule(cfg)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(64, 1, 1, 1, generator=g)
        outs = [sample(ObjectiveOracle(sched), sched, "eps", x.shape, sampler=s, steps=12,
                       x=x, clip_x0=False) for s in ("euler", "ddim")]
        torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-4)


def test_objective_heun_beats_euler_at_equal_calls():
    """Second order: Heun with 20 levels (39 calls) lands closer to the data's std than
    Euler with 39 levels (on edm's Karras grid Heun needs about 20 levels to reach its
    asymptotic regime: with 10 it overshoots)."""
    for which in ("flow", "edm"):
        sched = make_schedule(DiffusionConfig(objective=which))
        err = {}
        for name, steps in (("euler", 39), ("heun", 20)):
            out = sample(ObjectiveOracle(sched), sched, "eps", (N, 1, 1, 1), sampler=name,
                         steps=steps, generator=torch.Generator().manual_seed(2), clip_x0=False)
            err[name] = abs(out.std().item() - S)
        assert err["heun"] < err["euler"], (which, err)


def test_objective_sample_errors_and_guidance(objective_schedules):
    sched = objective_schedules["edm"]
    model = ClassModel()
    with pytest.raises(ValueError, match="spacing='leading'.*own σ grid"):
        sample(model, sched, "eps", (1, 1, 2, 2), steps=3, spacing="leading")
    with pytest.raises(ValueError, match="heun integrates the ODE of diffusion.objective flow"):
        from steadydiff.diffusion import heun
        heun(Denoiser(model, make_schedule(DiffusionConfig()), "eps"), torch.zeros(1, 1, 2, 2),
             torch.tensor([999.0, 500.0]), make_schedule(DiffusionConfig()))
    # guidance mixes raw outputs: in eps and x0 space for flow's velocity and edm's F too
    y = torch.tensor([0, 1, 2])
    for sched in objective_schedules.values():
        x = torch.randn(3, 1, 2, 2)
        s = sched.grid(10)[4]
        with torch.no_grad():
            cond = Denoiser(model, sched, "eps", cfg_scale=1.0, y=y, clip_x0=False)(x, s)
            unc = Denoiser(model, sched, "eps", cfg_scale=0.0, y=y, clip_x0=False)(x, s)
            guided = Denoiser(model, sched, "eps", cfg_scale=3.0, y=y, clip_x0=False)(x, s)
        for k in (0, 1):
            torch.testing.assert_close(guided[k], unc[k] + 3.0 * (cond[k] - unc[k]))
        a, sg = sched.alpha_sigma(s)
        torch.testing.assert_close(a * cond[0] + sg * cond[1], x)  # the pair stays on x
