"""Contracts and closed forms for schedules (diffusion/schedules.py) and the training
objective (diffusion/objectives.py)."""

import math

import pytest
import torch
from torch import nn

from steadydiff.config import DiffusionConfig
from steadydiff.kinds import PREDICTIONS, SCHEDULES
from steadydiff.diffusion import edm, flow
from steadydiff.diffusion import (
    LossOutput,
    Schedule,
    diffusion_loss,
    loss_weights,
    make_schedule,
    q_sample,
    sample_timesteps,
    to_x0_eps,
    training_target,
)

KINDS = list(SCHEDULES)  # the contract suite covers every schedule the config accepts
PIECEWISE = [[0.0, 12.0], [0.3, 2.0], [0.7, -3.0], [1.0, -9.0]]


def cfg_for(kind: str, zero: bool = False, **kw) -> DiffusionConfig:
    extra = {"piecewise": PIECEWISE} if kind == "piecewise" else {}
    return DiffusionConfig(schedule=kind, zero_terminal_snr=zero, **extra, **kw)


# ---------------------------------------------------------------------- schedules


@pytest.mark.parametrize("zero", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_schedule_contract(kind, zero):
    T = 200
    s = make_schedule(cfg_for(kind, zero, timesteps=T))
    ab = s.alphas_cumprod
    assert isinstance(s, Schedule) and s.T == T
    assert ab.shape == (T,) and s.betas.shape == (T,) and ab.dtype == torch.float64
    assert s.betas.dtype == torch.float64
    # strictly decreasing (every kind here has a strictly decreasing λ), in (0, 1]
    assert (ab[1:] < ab[:-1]).all()
    assert (ab[:-1] > 0).all() and (ab <= 1).all()
    assert s.zero_terminal_snr == zero
    if zero:
        assert ab[-1].item() == 0.0 and s.betas[-1].item() == 1.0
    else:
        assert ab[-1] > 0
    # betas reproduce ᾱ
    torch.testing.assert_close(torch.cumprod(1 - s.betas, 0), ab, rtol=1e-12, atol=1e-15)

    # integer and float t agree with the table; alpha² + sigma² = 1
    t_int = torch.arange(T)
    a, sg = s.alpha_sigma(t_int)
    assert a.dtype == torch.float32 and a.shape == (T,)
    torch.testing.assert_close(a.double() ** 2, ab, rtol=1e-5, atol=1e-7)
    a2, sg2 = s.alpha_sigma(t_int.float())
    torch.testing.assert_close(a2, a, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(sg2, sg, rtol=1e-6, atol=1e-7)
    tf = torch.linspace(0, T - 1, 997)
    a, sg = s.alpha_sigma(tf)
    torch.testing.assert_close(a ** 2 + sg ** 2, torch.ones_like(a), rtol=0, atol=1e-6)
    assert (a[1:] <= a[:-1]).all() and (sg[1:] >= sg[:-1]).all()

    # λ at integer t matches log(ᾱ/(1-ᾱ)); -inf (never NaN) at zero terminal SNR
    lam = s.log_snr(t_int.double(), dtype=torch.float64)
    ref = torch.log(ab) - torch.log1p(-ab)
    fin = torch.isfinite(ref)
    torch.testing.assert_close(lam[fin], ref[fin], rtol=1e-9, atol=1e-9)
    assert not torch.isnan(lam).any()
    if zero:
        assert lam[-1] == -math.inf and s.snr(torch.tensor(T - 1)).item() == 0.0


@pytest.mark.parametrize("kind", KINDS)
def test_log_snr_is_linear_between_steps_and_invertible(kind):
    s = make_schedule(cfg_for(kind, timesteps=100))
    i = torch.arange(99, dtype=torch.float64)
    lo, hi = s.log_snr(i, torch.float64), s.log_snr(i + 1, torch.float64)
    for w in (0.25, 0.5, 0.9):
        mid = s.log_snr(i + w, torch.float64)
        torch.testing.assert_close(mid, lo + w * (hi - lo), rtol=1e-9, atol=1e-9)
    t = torch.linspace(0, 99, 301, dtype=torch.float64)
    back = s.t_from_log_snr(s.log_snr(t, torch.float64), torch.float64)
    torch.testing.assert_close(back, t, rtol=0, atol=1e-6)
    # out-of-range log-SNR clamps to the ends
    assert s.t_from_log_snr(torch.tensor(1e3)).item() == 0.0
    assert s.t_from_log_snr(torch.tensor(-1e3)).item() == 99.0


def test_zero_terminal_snr_last_interval_is_continuous():
    s = make_schedule(cfg_for("linear", True, timesteps=100))
    a, _ = s.alpha_sigma(torch.tensor([97.0, 98.0, 98.5, 98.99, 99.0]))
    assert (a[:-1] > 0).all() and a[-1] == 0 and (a[1:] < a[:-1]).all()
    assert s.t_from_log_snr(torch.tensor(-math.inf)).item() == 99.0
    torch.testing.assert_close(s.t_from_log_snr(s.log_snr(torch.tensor(98.5))),
                               torch.tensor(98.5))


def test_linear_matches_ho_et_al_and_cosine_matches_closed_form():
    s = make_schedule(DiffusionConfig(schedule="linear", timesteps=1000))
    torch.testing.assert_close(s.betas, torch.linspace(1e-4, 0.02, 1000, dtype=torch.float64))
    c = make_schedule(DiffusionConfig(schedule="cosine", timesteps=1000))
    f = lambda u: math.cos((u + 0.008) / 1.008 * math.pi / 2) ** 2  # noqa: E731
    for t in (0, 100, 500, 900):
        assert c.alphas_cumprod[t].item() == pytest.approx(f((t + 1) / 1000) / f(0), rel=1e-9)
    assert c.betas.max().item() <= 0.999 + 1e-12


def test_piecewise_hits_its_points():
    s = make_schedule(cfg_for("piecewise", timesteps=11))  # t_fraction = t/10
    lam = s.log_snr(torch.arange(11), torch.float64)
    assert lam[0].item() == pytest.approx(12.0) and lam[10].item() == pytest.approx(-9.0)
    assert lam[3].item() == pytest.approx(2.0) and lam[7].item() == pytest.approx(-3.0)
    # a flat stretch is allowed (non-increasing)
    flat = make_schedule(DiffusionConfig(schedule="piecewise", timesteps=50,
                                         piecewise=[[0, 5], [0.5, 0], [0.6, 0], [1, -5]]))
    assert (flat.alphas_cumprod[1:] <= flat.alphas_cumprod[:-1]).all()


@pytest.mark.parametrize("points, msg", [
    ([[0.1, 5.0], [1.0, -5.0]], "start at 0"),
    ([[0.0, 5.0], [0.9, -5.0]], "end at 1"),
    ([[0.0, 5.0], [0.5, 0.0], [0.5, -1.0], [1.0, -5.0]], "strictly increasing"),
    ([[0.0, 5.0], [0.5, 6.0], [1.0, -5.0]], "non-increasing"),
    ([[0.0, 5.0]], "at least two"),
    ([[0.0, 5.0], [1.0, -math.inf]], "finite"),
    ([[0.0, 50.0], [1.0, -5.0]], r"\[-30, 30\]"),
])
def test_piecewise_validation(points, msg):
    with pytest.raises(ValueError, match=msg):
        make_schedule(DiffusionConfig(schedule="piecewise", piecewise=points))
    with pytest.raises(ValueError, match="flat"):
        make_schedule(DiffusionConfig(schedule="piecewise", piecewise=[[0, 1], [1, 1]],
                                      zero_terminal_snr=True))


# ---------------------------------------------------------------------- objective algebra


def _rand_coeffs(n):
    """(alpha, sigma) float64 over log-SNR -8..8, with alpha² + sigma² = 1 to rounding."""
    lam = torch.linspace(-8, 8, n, dtype=torch.float64)
    return torch.sigmoid(lam).sqrt(), torch.sigmoid(-lam).sqrt()


@pytest.mark.parametrize("prediction", PREDICTIONS)
def test_targets_invert_exactly(prediction):
    g = torch.Generator().manual_seed(1)
    x0 = torch.randn(16, 3, 4, 4, generator=g, dtype=torch.float64)
    noise = torch.randn(x0.shape, generator=g, dtype=torch.float64)
    a, s = _rand_coeffs(16)
    x_t = q_sample(x0, a, s, noise)
    target = training_target(prediction, x0, noise, a, s)
    x0_hat, eps_hat = to_x0_eps(prediction, target, x_t, a, s)
    # eps at tiny alpha amplifies rounding by sigma/alpha (≈ 50 here): looser there
    tol = 1e-9 if prediction != "eps" else 1e-7
    torch.testing.assert_close(x0_hat, x0, rtol=0, atol=tol)
    torch.testing.assert_close(eps_hat, noise, rtol=0, atol=1e-9)


def test_v_algebra_closed_form():
    a, s = torch.tensor(0.6, dtype=torch.float64), torch.tensor(0.8, dtype=torch.float64)
    x0 = torch.tensor([[0.3]], dtype=torch.float64)
    eps = torch.tensor([[-1.2]], dtype=torch.float64)
    v = training_target("v", x0, eps, a, s)
    assert v.item() == pytest.approx(0.6 * -1.2 - 0.8 * 0.3)
    x_t = q_sample(x0, a, s, eps)
    x0_hat, eps_hat = to_x0_eps("v", v, x_t, a, s)
    assert x0_hat.item() == pytest.approx(0.3) and eps_hat.item() == pytest.approx(-1.2)


def test_zero_alpha_conversions_have_no_nan():
    a, s = torch.zeros(2), torch.ones(2)
    x_t = torch.randn(2, 1, 2, 2)
    for pred in PREDICTIONS:
        x0, eps = to_x0_eps(pred, torch.randn_like(x_t), x_t, a, s)
        assert torch.isfinite(x0).all() and torch.isfinite(eps).all()
    x0, eps = to_x0_eps("eps", x_t, x_t, a, s)  # the exact eps at SNR 0 is x_t itself
    assert (x0 == 0).all() and torch.equal(eps, x_t)
    v = torch.randn_like(x_t)
    x0, _ = to_x0_eps("v", v, x_t, a, s)
    assert torch.equal(x0, -v)


def test_q_sample_moments():
    g = torch.Generator().manual_seed(2)
    n = 200_000
    x0 = torch.full((n, 1, 1, 1), 0.7)
    a, s = torch.tensor(0.8), torch.tensor(0.6)
    x_t = q_sample(x0, a, s, torch.randn(x0.shape, generator=g))
    assert x_t.mean().item() == pytest.approx(0.8 * 0.7, abs=0.01)
    assert x_t.var().item() == pytest.approx(0.36, rel=0.02)


# ---------------------------------------------------------------------- weighting


@pytest.mark.parametrize("prediction", PREDICTIONS)
def test_min_snr_weights_closed_form(prediction):
    gamma = 5.0
    cfg = DiffusionConfig(prediction=prediction, loss_weighting="min_snr", min_snr_gamma=gamma)
    snr = torch.tensor([0.0, 1e-3, 0.5, 5.0, 7.0, 1e4, math.inf], dtype=torch.float64)
    w = loss_weights(cfg, snr)
    assert torch.isfinite(w).all()
    m = torch.minimum(snr, torch.tensor(gamma, dtype=torch.float64))
    fin = (snr > 0) & torch.isfinite(snr)
    ref = {"eps": m / snr, "x0": m, "v": m / (snr + 1)}[prediction]
    torch.testing.assert_close(w[fin], ref[fin])
    # limits: snr = 0 and snr = inf
    lim0 = {"eps": 1.0, "x0": 0.0, "v": 0.0}[prediction]
    liminf = {"eps": 0.0, "x0": gamma, "v": 0.0}[prediction]
    assert w[0].item() == lim0 and w[-1].item() == liminf
    uni = loss_weights(DiffusionConfig(prediction=prediction), snr)
    assert torch.equal(uni, torch.ones_like(snr))


@pytest.mark.parametrize("prediction", PREDICTIONS)
def test_weighted_loss_equals_min_snr_times_x0_error(prediction):
    """Derivation: with x_t fixed, x0 = (x_t - sigma·eps)/alpha gives ‖eps err‖² =
    snr·‖x0 err‖²; x0 = alpha·x_t - sigma·v gives ‖v err‖² = ‖x0 err‖²/sigma² = (snr+1)·‖x0 err‖².
    So w·‖pred err‖² = min(snr, γ)·‖x0 err‖² for the min-SNR weights."""
    gamma = 5.0
    cfg = DiffusionConfig(prediction=prediction, loss_weighting="min_snr", min_snr_gamma=gamma)
    g = torch.Generator().manual_seed(3)
    n = 8
    a, s = _rand_coeffs(n)
    snr = a ** 2 / s ** 2
    x0 = torch.randn(n, 2, 3, 3, generator=g, dtype=torch.float64)
    eps = torch.randn(x0.shape, generator=g, dtype=torch.float64)
    x_t = q_sample(x0, a, s, eps)
    target = training_target(prediction, x0, eps, a, s)
    pred = target + 0.1 * torch.randn(x0.shape, generator=g, dtype=torch.float64)  # an error
    x0_hat, _ = to_x0_eps(prediction, pred, x_t, a, s)
    lhs = loss_weights(cfg, snr) * (pred - target).square().mean((1, 2, 3))
    rhs = snr.clamp(max=gamma) * (x0_hat - x0).square().mean((1, 2, 3))
    torch.testing.assert_close(lhs, rhs, rtol=1e-9, atol=1e-12)


# ---------------------------------------------------------------------- timesteps


def test_sample_timesteps_uniform_and_logit_normal():
    g = torch.Generator().manual_seed(0)
    t = sample_timesteps(100_000, DiffusionConfig(), 1000, g)
    assert t.dtype == torch.long and t.shape == (100_000,)
    assert t.min().item() == 0 and t.max().item() == 999
    assert t.float().mean().item() == pytest.approx(499.5, abs=5)
    cfg = DiffusionConfig(timestep_sampling="logit_normal", logit_mean=0.0, logit_std=1.0)
    t = sample_timesteps(100_000, cfg, 1000, g)
    assert t.min().item() >= 0 and t.max().item() <= 999
    assert t.float().median().item() == pytest.approx(500, abs=10)
    # more mass in the middle than uniform
    mid = ((t > 250) & (t < 750)).float().mean().item()
    assert mid > 0.6
    shifted = sample_timesteps(100_000, cfg.model_copy(update={"logit_mean": 1.0}), 1000, g)
    assert shifted.float().mean().item() > t.float().mean().item() + 100


# ---------------------------------------------------------------------- diffusion_loss


class Recorder(nn.Module):
    """A tiny conditional denoiser that remembers what it was called with."""

    def __init__(self, num_classes: int = 0):
        super().__init__()
        self.num_classes = num_classes
        self.conv = nn.Conv2d(1, 1, 1)
        self.calls = []

    def forward(self, x, t, y=None):
        self.calls.append((x.detach().clone(), t.detach().clone(),
                           None if y is None else y.clone()))
        return self.conv(x)


@pytest.mark.parametrize("prediction", PREDICTIONS)
@pytest.mark.parametrize("weighting", ["uniform", "min_snr"])
def test_diffusion_loss_reproducible_from_generator(prediction, weighting):
    cfg = DiffusionConfig(timesteps=100, prediction=prediction, loss_weighting=weighting,
                          cfg_dropout=0.5)
    sched = make_schedule(cfg)
    model = Recorder(num_classes=10)
    x0 = torch.rand(16, 1, 4, 4) * 2 - 1
    y = torch.arange(16) % 10

    outs = []
    for seed in (7, 7, 8):
        torch.manual_seed(seed + 100)  # the global RNG must not matter
        outs.append(diffusion_loss(model, x0, y, sched, cfg, torch.Generator().manual_seed(seed)))
    (o1, o2, o3), calls = outs, model.calls
    assert isinstance(o1, LossOutput)
    assert o1.loss.ndim == 0 and o1.per_sample.shape == (16,) and o1.t.dtype == torch.long
    assert torch.equal(o1.t, o2.t) and torch.equal(o1.loss, o2.loss)
    assert torch.equal(calls[0][0], calls[1][0]) and torch.equal(calls[0][2], calls[1][2])
    assert not torch.equal(o1.t, o3.t) and not torch.equal(calls[0][0], calls[2][0])
    # the model sees float t equal to the drawn integer steps
    assert calls[0][1].dtype == torch.float32 and torch.equal(calls[0][1], o1.t.float())
    # label dropout happened for some, but not all, samples, with the null class
    ys = calls[0][2]
    dropped = ys == 10
    assert 0 < dropped.sum() < 16 and torch.equal(ys[~dropped], y[~dropped])
    torch.testing.assert_close(o1.loss, o1.per_sample.mean())
    o1.loss.backward()
    g = model.conv.weight.grad
    assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0


def test_diffusion_loss_matches_manual_computation():
    cfg = DiffusionConfig(timesteps=50, prediction="v", loss_weighting="min_snr", cfg_dropout=0.0)
    sched = make_schedule(cfg)
    model = Recorder()
    x0 = torch.rand(6, 1, 3, 3) * 2 - 1
    out = diffusion_loss(model, x0, None, sched, cfg, torch.Generator().manual_seed(0))
    # replay the draws by hand: t, then noise
    g = torch.Generator().manual_seed(0)
    t = torch.randint(0, 50, (6,), generator=g)
    noise = torch.randn(x0.shape, generator=g)
    assert torch.equal(t, out.t)
    a, s = sched.alpha_sigma(t)
    x_t = q_sample(x0, a, s, noise)
    with torch.no_grad():
        pred = model.conv(x_t)
    mse = (pred - training_target("v", x0, noise, a, s)).square().mean((1, 2, 3))
    ref = mse * loss_weights(cfg, sched.snr(t))
    torch.testing.assert_close(out.per_sample.detach(), ref)
    assert model.calls[0][2] is None


def test_diffusion_loss_zero_terminal_snr_is_finite():
    for pred in PREDICTIONS:
        cfg = DiffusionConfig(timesteps=10, prediction=pred, zero_terminal_snr=True,
                              loss_weighting="min_snr")
        sched = make_schedule(cfg)
        x0 = torch.rand(64, 1, 2, 2) * 2 - 1
        out = diffusion_loss(Recorder(), x0, None, sched, cfg, torch.Generator().manual_seed(0))
        assert (out.t == 9).any() and torch.isfinite(out.per_sample).all()


def test_diffusion_loss_rejects_labels_for_unconditional_model():
    cfg = DiffusionConfig(timesteps=10)
    with pytest.raises(ValueError, match="unconditional"):
        diffusion_loss(Recorder(0), torch.zeros(2, 1, 2, 2), torch.zeros(2, dtype=torch.long),
                       make_schedule(cfg), cfg, torch.Generator().manual_seed(0))


# ---------------------------------------------------------------------- flow and edm


def test_flow_loss_matches_manual_computation():
    """objective=flow: σ from the density (here logit-normal), clamped to [1/T, 1] and
    shifted; x = (1-σ)·x0 + σ·ε; the network at σ·T; the velocity target ε - x0, weighted
    by diffusers' cosmap; buckets floor(σ·T)."""
    cfg = DiffusionConfig(objective="flow", timesteps=1000, timestep_sampling="logit_normal",
                          logit_mean=0.2, loss_weighting="cosmap", cfg_dropout=0.0,
                          flow={"shift": 3.0})
    sched = make_schedule(cfg)
    model = Recorder()
    x0 = torch.rand(6, 1, 3, 3) * 2 - 1
    out = diffusion_loss(model, x0, None, sched, cfg, torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(0)
    u = flow.draw_sigmas(6, "logit_normal", g, logit_mean=0.2)
    noise = torch.randn(x0.shape, generator=g)
    sig = flow.shift_sigmas(u.clamp(1e-3, 1.0), 3.0)
    x = flow.noisy(x0, noise, sig)
    torch.testing.assert_close(model.calls[0][0], x)
    torch.testing.assert_close(model.calls[0][1], sig * 1000)
    with torch.no_grad():
        pred = model.conv(x)
    mse = (pred - (noise - x0)).square().mean((1, 2, 3))
    torch.testing.assert_close(out.per_sample.detach(), mse * flow.loss_weight("cosmap", sig))
    assert torch.equal(out.t, (sig * 1000).long())


def test_edm_loss_matches_manual_computation_and_is_the_weighted_denoiser_loss():
    """objective=edm: ln σ ~ N(P_mean, P_std²); the network sees c_in·x at T·¼ln σ and
    regresses (x0 - c_skip·x)/c_out, whose MSE is λ(σ)·‖D - x0‖² (Karras et al. eq. 8)."""
    cfg = DiffusionConfig(objective="edm", cfg_dropout=0.0, edm={"sigma_data": 0.6})
    sched = make_schedule(cfg)
    model = Recorder()
    x0 = torch.rand(8, 1, 3, 3) * 2 - 1
    out = diffusion_loss(model, x0, None, sched, cfg, torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(1)
    sig = edm.draw_sigmas(8, g)
    noise = torch.randn(x0.shape, generator=g)
    x = x0 + sig.view(-1, 1, 1, 1) * noise
    c_skip, c_out, c_in, c_noise = (c.view(-1, 1, 1, 1) for c in edm.precondition(sig, 0.6))
    torch.testing.assert_close(model.calls[0][0], c_in * x)
    torch.testing.assert_close(model.calls[0][1], 1000 * c_noise.flatten())
    with torch.no_grad():
        F = model.conv(c_in * x)
    d = c_skip * x + c_out * F
    ref = edm.loss_weight(sig, 0.6) * (d - x0).square().mean((1, 2, 3))
    torch.testing.assert_close(out.per_sample.detach(), ref, rtol=1e-4, atol=1e-5)
    # buckets: the training distribution's CDF, so each of B buckets gets ~1/B of the draws
    many = diffusion_loss(model, torch.zeros(4000, 1, 1, 1), None, sched, cfg,
                          torch.Generator().manual_seed(2))
    counts = torch.bincount(many.t * 10 // 1000, minlength=10).float()
    assert float(counts.min()) > 300 and float(counts.max()) < 500


def test_flow_and_edm_losses_replay_and_take_labels():
    for obj in ("flow", "edm"):
        cfg = DiffusionConfig(objective=obj, cfg_dropout=0.5)
        sched = make_schedule(cfg)
        model = Recorder(num_classes=10)
        x0 = torch.rand(16, 1, 4, 4) * 2 - 1
        y = torch.arange(16) % 10
        a = diffusion_loss(model, x0, y, sched, cfg, torch.Generator().manual_seed(3))
        b = diffusion_loss(model, x0, y, sched, cfg, torch.Generator().manual_seed(3))
        assert torch.equal(a.per_sample, b.per_sample) and torch.equal(a.t, b.t)
        assert a.t.dtype == torch.long and 0 <= int(a.t.min()) and int(a.t.max()) < 1000
        ys = model.calls[0][2]
        assert 0 < int((ys == 10).sum()) < 16  # label dropout to the null class
        a.loss.backward()
        assert torch.isfinite(model.conv.weight.grad).all()


def test_flow_draws_never_reach_sigma_zero():
    """The clamp to [1/T, 1] keeps sigma_sqrt's σ^-2 finite whatever the density draws."""
    sched = make_schedule(DiffusionConfig(objective="flow"))
    s = sched.from_draw(torch.tensor([0.0, 1e-9, 0.5, 1.0]))
    assert s.tolist() == pytest.approx([1e-3, 1e-3, 0.5, 1.0])
    assert torch.isfinite(flow.loss_weight("sigma_sqrt", s)).all()


def test_make_schedule_resolves_the_flow_shift():
    """FLUX's dynamic shift for a 32x32 run: 16² = 256 tokens in 2x2 patches -> mu =
    base_shift -> s = e^0.5; a static shift is taken as it is; 16x16 extrapolates below."""
    dyn = DiffusionConfig(objective="flow", flow={"dynamic_shift": True})
    assert make_schedule(dyn, 32).shift == pytest.approx(math.exp(0.5))
    assert make_schedule(dyn, 16).shift < math.exp(0.5)
    with pytest.raises(ValueError, match="needs the training resolution"):
        make_schedule(dyn)
    st = make_schedule(DiffusionConfig(objective="flow", flow={"shift": 3.0}))
    assert st.shift == 3.0 and st.grid(4).tolist() == pytest.approx([1.0, 0.9, 0.75, 0.5])
    e = make_schedule(DiffusionConfig(objective="edm", edm={"sigma_max": 10.0}))
    assert float(e.grid(5)[0]) == pytest.approx(10.0) and e.prior_std(10.0) == 10.0


@pytest.mark.parametrize("obj", ["flow", "edm"])
def test_objective_levels_contract(obj):
    """What the samplers and the probe read from a flow/edm schedule: α, σ (and λ) at the
    grid, the clean end appended, spread levels ascending over the training range, buckets
    inside [0, T)."""
    sched = make_schedule(DiffusionConfig(objective=obj))
    grid = sched.grid(8)
    a, s, lam = sched.levels(grid)
    assert len(a) == len(s) == len(lam) == 9 and (a[-1], s[-1], lam[-1]) == (1.0, 0.0, math.inf)
    aa, ss = sched.alpha_sigma(grid, torch.float64)
    assert a[:-1] == pytest.approx(aa.tolist()) and s[:-1] == pytest.approx(ss.tolist())
    finite = [v for v in lam if math.isfinite(v)]
    assert finite == sorted(finite)  # λ increases towards clean data
    sp = sched.spread(5)
    assert (sp[1:] > sp[:-1]).all()
    b = sched.bucket(sp)
    assert b.dtype == torch.long and (b[1:] >= b[:-1]).all() and int(b.max()) < 1000
