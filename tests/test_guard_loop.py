"""``steadydiff.Guard`` in loops that are not our trainer.

(a) a plain PyTorch loop: a small conv denoiser, AdamW, ``LambdaLR``, ``AveragedModel`` as
    the EMA, timesteps and noise drawn by the loop itself;
(b) an accelerate-style loop (the shape of accelerate's API, not the package): a wrapped
    optimizer, ``accelerator.backward(loss)``, a diffusers-style ``EMAModel``; in fp32 and,
    with a GradScaler, in fp16.

Each loop is run through the fault scenarios by corrupting the batch, the loss, a parameter
or a gradient by hand at a chosen step. The loops are the ones docs/guard.md shows: the
guard adds the ``Guard(...)`` line and the two lines after ``backward``.
"""

import json
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.lr_scheduler import LambdaLR
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from steadydiff import Guard

# the accelerate-style stand-ins (Accelerator, diffusers-style EMAModel) are the ones the
# accelerate-style example ships
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from guard_accelerate_style import Accelerator, EMAModel  # noqa: E402

T, B, STEPS = 100, 8, 30
ALPHA_BAR = torch.cumprod(1 - torch.linspace(1e-4, 0.02, T), 0)
# the tiny loops need the guard's clocks scaled down with them
CFG = dict(warmup_steps=5, snapshot_every=5)


def dataset(n=64):
    """Smooth 8x8 images in [-1, 1] (blurred noise): something a denoiser can learn."""
    g = torch.Generator().manual_seed(0)
    x = F.avg_pool2d(torch.randn(n, 1, 12, 12, generator=g), 5, 1)
    return (x / x.abs().amax()).clamp(-1, 1)


DATA = dataset()


def batch_at(position):
    """The batch at a data position (the loop's own data order)."""
    i = (position * B) % len(DATA)
    return DATA[i:i + B]


class Denoiser(nn.Module):
    """(x_t, t) -> predicted noise: conv, GroupNorm, SiLU, conv."""

    def __init__(self, ch=16):
        super().__init__()
        self.inp = nn.Conv2d(2, ch, 3, padding=1)
        self.norm = nn.GroupNorm(4, ch)
        self.out = nn.Conv2d(ch, 1, 3, padding=1)

    def forward(self, x, t):
        tt = (t.float() / T).view(-1, 1, 1, 1).expand_as(x)
        return self.out(F.silu(self.norm(self.inp(torch.cat([x, tt], 1)))))


class Faults:
    """Hand-made faults: ``fire(kind)`` is true once, at the kind's step (a transient event:
    a step redone after a rollback does not meet it again)."""

    def __init__(self, guard, **at):
        self.guard, self.at = guard, dict(at)

    def fire(self, kind):
        if self.at.get(kind) == self.guard.progress.step:
            del self.at[kind]
            return True
        return False

    def corrupt_batch(self, x0):
        if self.fire("nan_batch"):
            x0 = x0.clone()
            x0[0, 0, 0, 0] = float("nan")  # one NaN pixel
        return x0

    def corrupt_param(self, model):
        if self.fire("param_nan"):
            with torch.no_grad():
                model.out.weight.view(-1)[0] = float("nan")  # stays NaN until a rollback

    def corrupt_loss(self, loss):
        return loss * 1e8 if self.fire("loss_spike") else loss

    def corrupt_grad(self, model):
        if self.fire("grad_nan"):
            model.inp.weight.grad.view(-1)[0] = float("nan")


def noisy(x0):
    """The forward process q(x_t | x_0), drawn by the loop itself."""
    t = torch.randint(0, T, (x0.shape[0],))
    noise = torch.randn_like(x0)
    ab = ALPHA_BAR[t].view(-1, 1, 1, 1)
    return ab.sqrt() * x0 + (1 - ab).sqrt() * noise, t, noise


# ---------------------------------------------------------------------- (a) a plain loop


def plain_loop(run_dir, steps=STEPS, **faults):
    torch.manual_seed(0)
    model = Denoiser()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.99))
    guard = Guard(model, opt, lr_scheduler=sched, ema=ema, run_dir=run_dir, config=CFG)
    fx, decisions = Faults(guard, **faults), []
    while guard.progress.step < steps:             # the guard's counters drive the loop
        x0 = fx.corrupt_batch(batch_at(guard.progress.batches_consumed))
        fx.corrupt_param(model)
        xt, t, noise = noisy(x0)
        loss = fx.corrupt_loss(F.mse_loss(model(xt, t), noise))
        loss.backward()
        fx.corrupt_grad(model)
        d = guard.step(loss)                        # clip, opt.step, sched.step, EMA: or not
        decisions.append(d)
        if d.action == "abort":
            break
    return model, ema, sched, guard, decisions


def finite_module(m):
    return all(bool(torch.isfinite(p).all()) for p in m.parameters())


def rows(run_dir):
    p = run_dir / "incidents.jsonl"
    return [json.loads(l) for l in p.read_text().splitlines()] if p.exists() else []


def acted(decisions):
    return [(d.step, d.action, d.incident.kind if d.incident else None)
            for d in decisions if d.action != "step"]


def test_plain_loop_clean(tmp_path):
    model, ema, sched, guard, ds = plain_loop(tmp_path)
    assert acted(ds) == [] and rows(tmp_path) == []
    assert guard.progress.step == STEPS and sched.last_epoch == STEPS
    assert ds[-1].loss < ds[0].loss  # it learns
    assert "no incidents" in guard.summary()


# fault, at step, expected (step, action, kind) decisions, first incident's evidence check
PLAIN = {
    # no inputs= given: the guard sees the NaN loss, not the batch
    "nan_batch": (12, [(12, "skip", "nonfinite_loss")],
                  lambda e: e["loss"] == "nan"),
    # no t= given: the grad-norm z-score catches what the loss did to the gradient
    "loss_spike": (12, [(12, "skip", "grad_spike")],
                   lambda e: e["z"] > 6 and e["top_grad_layers"][0]["param"]),
    "grad_nan": (12, [(12, "skip", "nonfinite_grad")],
                 lambda e: e["provenance"]["nonfinite_grad_params"] == ["inp.weight"]),
    # a weight gone NaN between two steps is seen before it is blamed on a batch: the
    # parameter is named and the guard rolls back to the step-10 snapshot at once, skipping
    # no data (the batch was innocent)
    "param_nan": (12, [(10, "rollback", "nonfinite_params")],
                  lambda e: e["params"] == ["out.weight"] and e["when"] == "before_forward"
                  and e["elements"][0]["nonfinite"] == 1),
}


@pytest.mark.parametrize("fault", list(PLAIN))
def test_plain_loop_faults(tmp_path, fault):
    at, want, check = PLAIN[fault]
    model, ema, sched, guard, ds = plain_loop(tmp_path, **{fault: at})
    assert acted(ds) == want
    assert guard.progress.step == STEPS
    assert finite_module(model) and finite_module(ema)
    assert sched.last_epoch == STEPS  # the scheduler stepped only with applied updates
    (first, *_) = rows(tmp_path)
    assert first["step"] == at and check(first["evidence"]), first
    if fault == "param_nan":
        d = ds[-1] if ds[-1].action == "rollback" else next(d for d in ds
                                                           if d.action == "rollback")
        # failure at data position 12, snapshot at 10: both batches are trained on again
        assert d.skipped_batches == () and d.data_position == 10
        assert d.incident.cost["steps_redone"] == 2
        # the weights changed between steps: not the LR's doing, so it is not backed off
        assert guard.lr_factor == 1.0 and "kept" in d.incident.diagnosis["lr"]
    assert f"{len(rows(tmp_path))} incident" in guard.summary()


def test_plain_loop_abort_when_fault_persists(tmp_path):
    """A fault the loop re-injects every step (a NaN weight set again after each rollback):
    the rollback budget runs out and the guard says abort; the loop breaks."""
    torch.manual_seed(0)
    model = Denoiser()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = Guard(model, opt, run_dir=tmp_path, config=dict(CFG, max_rollbacks=1))
    ds = []
    while guard.progress.step < STEPS:
        if guard.progress.step >= 7:
            with torch.no_grad():
                model.out.weight.view(-1)[0] = float("nan")
        xt, t, noise = noisy(batch_at(guard.progress.batches_consumed))
        loss = F.mse_loss(model(xt, t), noise)
        loss.backward()
        d = guard.step(loss)
        ds.append(d)
        if d.action == "abort":
            break
    assert ds[-1].action == "abort" and "rollbacks within" in ds[-1].incident.diagnosis["why"]
    assert [r["action"] for r in rows(tmp_path)].count("rollback") == 1
    assert rows(tmp_path)[-1]["action"] == "abort"


def test_plain_loop_saves_the_verified_state_after_an_abort(tmp_path):
    """After an abort decision, ``Guard.restore_verified`` puts the newest verified snapshot
    back (weights, EMA, optimizer, scheduler, progress) so the loop can save it."""
    model, ema, sched, guard, ds = plain_loop(tmp_path, steps=STEPS)
    with torch.no_grad():  # a state past saving, as after an abort
        for p in list(model.parameters()) + list(ema.parameters()):
            p.fill_(float("nan"))
    snap = guard.ring.newest()
    assert snap.step == 30 and guard.progress.step == STEPS
    guard.progress.step, guard.progress.batches_consumed = 33, 40  # moved on since
    assert guard.restore_verified() == 30
    assert (guard.progress.step, guard.progress.batches_consumed) == (30, snap.batches_consumed)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in snap.model.items())
    assert finite_module(model) and finite_module(ema)
    assert all(torch.equal(ema.state_dict()[k], v) for k, v in snap.ema.items())
    assert sched.last_epoch == snap.scheduler["last_epoch"]
    moments = guard.optimizer.state_dict()["state"]
    assert all(torch.equal(moments[i]["exp_avg"], snap.optimizer["state"][i]["exp_avg"])
               for i in moments)
    guard.ring.ring.clear()
    assert guard.restore_verified() is None  # no snapshot: nothing changed



# ------------------------------------------------------------ (b) an accelerate-style loop


def accelerate_loop(run_dir, mixed_precision="no", steps=STEPS, **faults):
    torch.manual_seed(0)
    accelerator = Accelerator(mixed_precision)
    model = Denoiser()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    model, opt, sched = accelerator.prepare(model, opt, sched)
    ema = EMAModel(model.parameters())
    guard = Guard(model, opt, lr_scheduler=sched, ema=ema, scaler=accelerator.scaler,
                  run_dir=run_dir, config=CFG)
    fx, decisions = Faults(guard, **faults), []
    while guard.progress.step < steps:
        x0 = fx.corrupt_batch(batch_at(guard.progress.batches_consumed))
        fx.corrupt_param(model)
        xt, t, noise = noisy(x0)
        with accelerator.autocast():
            loss = fx.corrupt_loss(F.mse_loss(model(xt, t).float(), noise))
        accelerator.backward(loss)
        fx.corrupt_grad(model)
        d = guard.step(loss)
        decisions.append(d)
        if d.action == "abort":
            break
    return model, ema, guard, decisions


def finite_ema(ema):
    return all(bool(torch.isfinite(s).all()) for s in ema.shadow_params)


ACCEL = {
    "nan_batch": (12, [(12, "skip", "nonfinite_loss")]),
    "loss_spike": (12, [(12, "skip", "grad_spike")]),
    "grad_nan": (12, [(12, "skip", "nonfinite_grad")]),
    "param_nan": (12, [(10, "rollback", "nonfinite_params")]),
}


@pytest.mark.parametrize("fault", [None, *ACCEL])
def test_accelerate_style_loop_fp32(tmp_path, fault):
    model, ema, guard, ds = accelerate_loop(tmp_path, **({fault: ACCEL[fault][0]}
                                                          if fault else {}))
    assert acted(ds) == (ACCEL[fault][1] if fault else [])
    assert guard.progress.step == STEPS
    assert finite_module(model) and finite_ema(ema)
    assert len(rows(tmp_path)) == len(acted(ds))


# fp16: a gradient overflow is the GradScaler's business (skip the step, halve the scale,
# no incident); a NaN batch is an incident; a NaN weight is rolled back at once
FP16 = {
    None: (None, []),
    "grad_nan": (12, [(12, "skip", None)]),
    "nan_batch": (12, [(12, "skip", "nonfinite_loss")]),
    "param_nan": (12, [(10, "rollback", "nonfinite_params")]),
}


@pytest.mark.parametrize("fault", list(FP16))
def test_accelerate_style_loop_fp16_grad_scaler(tmp_path, fault):
    at, want = FP16[fault]
    model, ema, guard, ds = accelerate_loop(tmp_path, "fp16", steps=16,
                                            **({fault: at} if fault else {}))
    assert acted(ds) == want
    assert guard.progress.step == 16
    assert finite_module(model) and finite_ema(ema)
    if fault == "grad_nan":
        assert guard.scaler_skips == 1 and guard.scaler.get_scale() == 32768.0
        assert rows(tmp_path) == []


def test_plain_loop_drops_then_quarantines_a_bad_sample(tmp_path):
    """A loop of one's own passes the dataset indices and a ``rerun``: a sample that is NaN
    every time it is drawn is dropped from its step while the other seven train, and
    quarantined the second time; the loop's own sampler leaves out ``guard.quarantine``."""
    torch.manual_seed(0)
    bad = 13
    data = DATA.clone()
    data[bad, 0, 0, 0] = float("nan")
    model = Denoiser()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = Guard(model, opt, run_dir=tmp_path, config=CFG, num_timesteps=T)
    decisions, drawn = [], []
    while guard.progress.step < STEPS:
        pool = [i for i in range(len(data)) if i not in guard.quarantine]
        start = guard.progress.batches_consumed * B
        idx = torch.tensor([pool[(start + k) % len(pool)] for k in range(B)])
        drawn.append(idx.tolist())
        x0 = data[idx]
        xt, t, noise = noisy(x0)

        def per_sample(keep):
            return (model(xt[keep], t[keep]) - noise[keep]).square().mean((1, 2, 3))

        ps = per_sample(torch.ones(B, dtype=torch.bool))
        ps.mean().backward()

        def rerun(keep, n_kept):  # the step again, on the kept samples only
            again = per_sample(keep)
            again.mean().backward()
            return again.mean(), again.detach(), t[keep]

        d = guard.step(ps.mean(), t=t, per_sample_loss=ps.detach(), inputs=x0, indices=idx,
                       rerun=rerun)
        decisions.append(d)
    assert all(d.action == "step" for d in decisions)  # no batch was thrown away
    hit = [d for d in decisions if d.dropped]
    assert [d.dropped for d in hit] == [(bad,), (bad,)]
    assert [d.quarantined for d in hit] == [(), (bad,)] and guard.quarantine == {bad}
    when = next(i for i, d in enumerate(decisions) if d.quarantined)
    later = drawn[when + 1:]
    assert later and all(bad not in b for b in later)
    assert [(r["kind"], r["action"]) for r in rows(tmp_path)] == [
        ("bad_batch", "drop_samples"), ("bad_batch", "drop_samples"),
        ("sample_quarantined", "quarantine")]
    assert finite_module(model)
    # the quarantine is part of the guard's state (a resumed loop keeps it)
    fresh = Guard(Denoiser(), torch.optim.AdamW(model.parameters()), config=CFG)
    fresh.load_state_dict(json.loads(json.dumps(guard.state_dict())))
    assert fresh.quarantine == {bad}


def test_plain_loop_rerun_tells_a_transient_fault_from_a_persistent_one(tmp_path):
    """A NaN that appears only the first time step 12 is computed: with ``rerun=`` the guard
    computes the step again, finds it finite, applies it and records a transient fault."""
    torch.manual_seed(0)
    model = Denoiser()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = Guard(model, opt, run_dir=tmp_path, config=CFG, num_timesteps=T)
    flaky = {12}
    decisions = []
    while guard.progress.step < 16:
        x0 = batch_at(guard.progress.batches_consumed)
        xt, t, noise = noisy(x0)

        def per_sample(keep):
            out = model(xt[keep], t[keep])
            if guard.progress.step in flaky:  # the device glitches once
                flaky.discard(guard.progress.step)
                out = out * float("nan")
            return (out - noise[keep]).square().mean((1, 2, 3))

        ps = per_sample(torch.ones(B, dtype=torch.bool))
        ps.mean().backward()

        def rerun(keep, n_kept):
            again = per_sample(keep)
            again.mean().backward()
            return again.mean(), again.detach(), t[keep]

        decisions.append(guard.step(ps.mean(), t=t, per_sample_loss=ps.detach(), rerun=rerun))
    assert [d.action for d in decisions] == ["step"] * 16
    (row,) = rows(tmp_path)
    assert (row["step"], row["kind"], row["action"]) == (12, "transient_fault", "rerun")
    assert finite_module(model) and guard.transient == {"0": 1}
# ---------------------------------------------------------------------- (c) attention upcast


class ClassicAttention(nn.Module):
    """The shape of diffusers' ``Attention`` with its classic (unfused) processor: to_q,
    to_k, to_v, to_out, scores by a batched matmul in the compute dtype, in fp32 when its
    ``upcast_attention`` attribute is set (diffusers' name, which the guard flips)."""

    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.heads, self.scale = heads, (dim // heads) ** -0.5
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.to_out = nn.ModuleList([nn.Linear(dim, dim)])
        self.upcast_attention = False

    def forward(self, x):  # (N, L, D) -> (N, L, D)
        n, length, d = x.shape
        h = self.heads

        def split(a):  # (N, L, D) -> (N*h, L, D/h)
            return a.reshape(n, length, h, d // h).transpose(1, 2).reshape(n * h, length, -1)

        q, k, v = split(self.to_q(x)), split(self.to_k(x)), split(self.to_v(x))
        if self.upcast_attention:
            with torch.autocast(x.device.type, enabled=False):
                scores = torch.bmm(q.float(), k.float().transpose(1, 2)) * self.scale
        else:
            scores = torch.bmm(q, k.transpose(1, 2)) * self.scale  # fp16 under autocast
        probs = scores.float().softmax(-1).to(v.dtype)
        out = torch.bmm(probs, v).reshape(n, h, length, -1).transpose(1, 2).reshape(n, length, d)
        return self.to_out[0](out)


class AttnDenoiser(Denoiser):
    """The conv denoiser with a self-attention layer over its 64 positions."""

    def __init__(self, ch=16):
        super().__init__(ch)
        self.attn = ClassicAttention(ch)

    def forward(self, x, t):
        tt = (t.float() / T).view(-1, 1, 1, 1).expand_as(x)
        h = F.silu(self.norm(self.inp(torch.cat([x, tt], 1))))  # (N, C, H, W)
        n, c, hh, ww = h.shape
        tokens = h.reshape(n, c, hh * ww).transpose(1, 2)  # (N, HW, C)
        h = h + self.attn(tokens).transpose(1, 2).reshape(n, c, hh, ww)
        return self.out(h)


def test_plain_fp16_loop_upcasts_a_diffusers_style_attention(tmp_path):
    """A plain fp16 loop (autocast + GradScaler) whose attention's q and k grow 1000x from
    step 6 on (as grown W_q, W_k would make them): q kᵀ overflows fp16. With ``replay=`` the
    guard names the attention module, sets its ``upcast_attention`` and the loop trains on in
    fp16 with the growth still there; no precision fallback."""
    torch.manual_seed(0)
    model = AttnDenoiser()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    guard = Guard(model, opt, scaler=scaler, run_dir=tmp_path, config=CFG)
    for proj in (model.attn.to_q, model.attn.to_k):
        proj.register_forward_hook(lambda _m, _i, out: out * 1000.0
                                   if guard.progress.step >= 6 else out)
    decisions = []
    while guard.progress.step < 14:
        x0 = batch_at(guard.progress.batches_consumed)
        xt, t, noise = noisy(x0)

        def loss_of(_i=0):
            with torch.autocast("cpu", dtype=torch.float16):
                return F.mse_loss(model(xt, t).float(), noise)

        loss = loss_of()
        scaler.scale(loss).backward()
        d = guard.step(loss, replay=lambda i: scaler.scale(loss_of(i)))
        decisions.append(d)
    # the one incident; the growth also overflows some scaled gradients while the scale
    # recalibrates: silent scaler skips, as for any fp16 loop
    assert [a for a in acted(decisions) if a[2]] == [(6, "skip", "attention_upcast")]
    assert guard.scaler_skips == len(acted(decisions))
    (row,) = rows(tmp_path)
    assert (row["kind"], row["action"], row["evidence"]["module"]) == \
        ("attention_upcast", "attention_upcast", "attn")
    assert row["evidence"]["provenance"]["first_nonfinite_module"] == "attn.to_out.0"
    assert model.attn.upcast_attention and guard.upcast == ["attn"]
    assert guard.precision == "fp16" and guard.scaler is not None
    assert finite_module(model)
