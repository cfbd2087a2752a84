"""Faults from outside the library (issue 27): a user's Dataset that returns a bad sample,
a weight changed by the test's own code between steps, the optimizer's state corrupted
between steps — not steadydiff's fault injector, which re-arms when a deferred window is
redone. Through the real trainer (``steadydiff.train``) and through ``steadydiff.Guard`` in a
plain loop: the per-step check (``guard.check_every=1``) and the deferred one
(``check_every=10``) name the same causes (kind, step, sample or parameter) and the runs
end finite. A fault the deferred window saw and the re-run did not reproduce is still
recorded, with the window's evidence (``reproduced: false``)."""

from __future__ import annotations

import json
import math

import pytest
import torch

import steadydiff
from steadydiff.config import load_config
from steadydiff.trainer import checkpoint as ckpt
from steadydiff.trainer import loop

from tiny import TINY_MODEL  # noqa: E402  (tests/tiny.py)

STEPS = 24
TINY = TINY_MODEL + [
    "model.num_classes=2", f"train.steps={STEPS}", "train.checkpoint_every=0",
    "logging.log_every=100", "guard.warmup_steps=4", "guard.snapshot_every=100",
    "guard.probe_every=0", "sample.num=2", "sample.steps=2", "logging.report=false",
]
# the deferred check's windows: step 0 is read at once (it creates the optimizer state), then
# windows of 10 start at steps 1, 11, 21
WINDOW = (11, 20)


def cfg(check_every: int, *extra: str):
    return load_config(None, TINY + [f"guard.check_every={check_every}", *extra])


def incidents(run):
    p = run / "incidents.jsonl"
    return [json.loads(line) for line in p.read_text().splitlines()] if p.exists() else []


def finite_checkpoint(res) -> bool:
    c = ckpt.load_checkpoint(res.checkpoint)
    return all(bool(torch.isfinite(v).all()) for v in (*c.model.values(), *c.ema.values())
               if v.is_floating_point())


class UserData(torch.utils.data.Dataset):
    """A user's own dataset, with a ``path_of`` naming its files. ``arm()``: the next item
    read comes back with a NaN pixel (or ``value``) — once (a flaky read), or, with
    ``every_time``, that index every time it is read from then on (a corrupt file)."""

    def __init__(self, n: int = 64, value: float = math.nan, every_time: bool = False):
        g = torch.Generator().manual_seed(0)
        self.x = torch.rand(n, 1, 8, 8, generator=g) * 2 - 1
        self.y = torch.arange(n) % 2
        self.num_classes = 2
        self.value, self.every_time = value, every_time
        self.armed, self.bad = False, None

    def arm(self) -> None:
        self.armed = True

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        x = self.x[i]
        if self.armed and self.bad is None:
            self.bad, self.armed = int(i), False
            x = x.clone()
            x[0, 3, 4] = self.value
        elif self.every_time and self.bad == int(i):
            x = x.clone()
            x[0, 3, 4] = self.value
        return x, int(self.y[i])

    def path_of(self, i):
        return f"/data/mine/{i:03d}.png"


def hook_steps(monkeypatch, at: int, fn) -> None:
    """Run ``fn(state)`` once, when the trainer is about to take step ``at`` for the first
    time (the test's own code between two steps: not steadydiff's fault injector)."""
    fired = []
    real = loop.train_step

    def step(state, batch):
        if state.step == at and not fired:
            fired.append(at)
            fn(state, batch)
        return real(state, batch)

    monkeypatch.setattr(loop, "train_step", step)


def named(rows, kinds):
    """(kind, step, what it names) of the incidents of ``kinds``."""
    out = []
    for r in rows:
        if r["kind"] not in kinds:
            continue
        e = r["evidence"]
        what = ([s["index"] for s in e.get("samples", [])] or list(e.get("params", []))[:1])
        out.append((r["kind"], r["step"], what))
    return out


# --------------------------------------------------------------------------- the user's data


@pytest.mark.parametrize("every_time", [False, True], ids=["once", "every_time"])
def test_a_users_bad_read_is_named_by_both_checks(tmp_path, monkeypatch, every_time):
    """The user's Dataset returns a NaN pixel for the item read for step 14 (mid-window):
    once (a flaky disk or loader: clean when the window re-reads it) or every time. Both
    checks name bad_batch at step 14 with that index and its file; the flaky read is
    recorded as not reproduced by the deferred check (not lost), and the run is finite."""
    runs = {}
    for k in (1, 10):
        data = UserData(every_time=every_time)
        hook_steps(monkeypatch, 13, lambda state, batch: data.arm())  # the read for step 14
        run = tmp_path / f"k{k}"
        res = steadydiff.train(cfg(k), dataset=data, out_dir=run)
        assert res.steps == STEPS and finite_checkpoint(res)
        runs[k] = (incidents(run), data.bad, res)
    (a, bad_a, _), (b, bad_b, res_b) = runs[1], runs[10]
    assert bad_a == bad_b is not None
    assert named(a, {"bad_batch"})[0] == named(b, {"bad_batch"})[0] == (
        "bad_batch", 14, [bad_a])
    first = next(r for r in b if r["kind"] == "bad_batch")
    assert first["evidence"]["samples"][0]["source"] == f"/data/mine/{bad_a:03d}.png"
    if every_time:
        assert "reproduced" not in first["evidence"]
    else:
        assert first["evidence"]["reproduced"] is False and first["action"] == "rerun"
        assert "not reproduced" in res_b.guard_summary


# --------------------------------------------------------------------------- the weights


def conv_weight(model: torch.nn.Module) -> tuple[str, torch.nn.Parameter]:
    return next((n, p) for n, p in model.named_parameters() if p.dim() == 4)


@pytest.mark.parametrize("at", [WINDOW[0], 15, pytest.param(17, marks=pytest.mark.slow),
                                WINDOW[1]], ids=["window_start", "mid", "mid2", "window_end"])
def test_a_weight_changed_between_steps_is_named_wherever_it_lands(tmp_path, monkeypatch, at):
    """One element of a conv weight set to 4e36 by the test's own code before step ``at``
    (a memory error): at the window's first step, in its middle and at its end, the deferred
    check names weight_jump at that step and that parameter, as the per-step check does —
    localised (element and values) from the live state before the rewind overwrote it."""
    rows, names = {}, []
    for k in (1, 10):
        def flip(state, batch):
            name, p = conv_weight(state.model)
            names.append(name)
            with torch.no_grad():
                p.view(-1)[3] = 4e36
        hook_steps(monkeypatch, at, flip)
        run = tmp_path / f"k{k}"
        res = steadydiff.train(cfg(k), dataset=UserData(), out_dir=run)
        assert res.steps == STEPS and finite_checkpoint(res)
        rows[k] = incidents(run)
    name = names[0]
    assert names == [name, name]
    kinds = {"weight_jump", "nonfinite_params"}
    assert named(rows[1], kinds)[0] == named(rows[10], kinds)[0] == ("weight_jump", at, [name])
    first = next(r for r in rows[10] if r["kind"] == "weight_jump")
    if at == WINDOW[0]:  # the window's mark holds the flip: the re-run sees it too
        assert "reproduced" not in first["evidence"]
    else:
        assert first["evidence"]["reproduced"] is False
        (el,) = [e for e in first["evidence"]["elements"] if e["param"] == name]
        assert [c["index"] for c in el["changed"]] == [3]
        assert el["changed"][0]["value"] == torch.tensor(4e36).item()



# --------------------------------------------------------------------------- the optimizer


@pytest.mark.parametrize("at", [15, pytest.param(WINDOW[0], marks=pytest.mark.slow)],
                         ids=["mid", "window_start"])
def test_adam_state_corrupted_between_steps_is_a_large_update(tmp_path, monkeypatch, at):
    """Adam's second moment of one weight set to 1e-30 by the test's own code before step
    ``at``: that step's update is many times its usual size (finite, and below the 10x
    norm jump). Both checks name large_update at that step and that parameter; the per-step
    one names the optimizer state that explains it and rolls back; the run is finite."""
    rows, names = {}, []
    for k in (1, 10):
        def corrupt(state, batch):
            name, p = conv_weight(state.model)
            names.append(name)
            with torch.no_grad():
                state.optimizer.state[p]["exp_avg_sq"].fill_(1e-30)
        hook_steps(monkeypatch, at, corrupt)
        run = tmp_path / f"k{k}"
        # (guard.update_ratio 5, not 10: 15 steps in, Adam's bias correction still divides
        # the second moment by 1 - 0.999^15, which shrinks the blow-up to ~8x; after
        # thousands of steps the same corruption is 20-40x)
        res = steadydiff.train(cfg(k, "guard.update_ratio=5"), dataset=UserData(), out_dir=run)
        assert res.steps == STEPS and finite_checkpoint(res)
        rows[k] = incidents(run)
    name = names[0]
    kinds = {"large_update", "weight_jump", "nonfinite_params"}
    assert named(rows[1], kinds)[0] == named(rows[10], kinds)[0] == ("large_update", at, [name])
    per_step = next(r for r in rows[1] if r["kind"] == "large_update")
    assert per_step["action"] == "rollback"
    (st,) = [s for s in per_step["evidence"]["optimizer_state"] if s["param"] == name]
    assert st["state"] == "exp_avg_sq" and "explains" in st
    deferred = next(r for r in rows[10] if r["kind"] == "large_update")
    assert deferred["evidence"].get("reproduced") is (None if at == WINDOW[0] else False)



# --------------------------------------------------------------------------- fp16 gradients


class FusedStyleAttention(torch.nn.Module):
    """An attention whose forward accumulates q kᵀ and the softmax in float32, as a fused
    kernel does (the logits never overflow fp16), while q and k come from fp16
    projections, so their gradients are cast back to fp16 in the backward. Its
    ``upcast_attention`` (the attribute diffusers' and steadydiff's attention layers have)
    runs the q and k projections, the logits and the softmax in float32."""

    def __init__(self, dim=16):
        super().__init__()
        self.scale = dim ** -0.5
        self.to_q, self.to_k, self.to_v = (torch.nn.Linear(dim, dim, bias=False)
                                           for _ in range(3))
        self.to_out = torch.nn.Linear(dim, dim)
        self.upcast_attention = False

    def forward(self, x):  # (N, L, D) -> (N, L, D)
        if self.upcast_attention:  # projections, logits and softmax in fp32
            with torch.autocast(x.device.type, enabled=False):
                xf = x.float()
                scores = torch.bmm(self.to_q(xf), self.to_k(xf).transpose(1, 2)) * self.scale
                probs = scores.softmax(-1)
        else:  # fp16 projections; the kernel accumulates the logits in fp32
            q, k = self.to_q(x), self.to_k(x)
            probs = (torch.bmm(q.float(), k.float().transpose(1, 2)) * self.scale).softmax(-1)
        return self.to_out(torch.bmm(probs.to(x.dtype), self.to_v(x)))


class AttnNet(torch.nn.Module):
    """A conv -> self-attention over the 64 positions -> conv denoiser (no timestep)."""

    def __init__(self, ch=16):
        super().__init__()
        self.inp = torch.nn.Conv2d(1, ch, 3, padding=1)
        self.attn = FusedStyleAttention(ch)
        self.out = torch.nn.Conv2d(ch, 1, 3, padding=1)

    def forward(self, x):
        h = torch.nn.functional.silu(self.inp(x))
        n, c, hh, ww = h.shape
        tokens = h.reshape(n, c, hh * ww).transpose(1, 2)       # (N, HW, C)
        h = h + self.attn(tokens).transpose(1, 2).reshape(n, c, hh, ww)
        return self.out(h)


def test_fp16_gradient_overflow_is_located_and_upcast_before_any_fallback(tmp_path):
    """q scaled by 1/3e4 and k by 3e4 from the start (the same logits: the forward stays
    finite and unsaturated), in fp16 with a GradScaler at 2^17 (a scale a long run grows
    to): only the gradient of q overflows, in the backward; every other gradient fits. With
    guard.overflow_limit=1 the first overflow would fall back to bf16 at once; instead the
    guard replays the step with gradient hooks, finds the first non-finite gradient in the
    attention's q projection, and upcasts that attention layer; the loop then trains on in
    fp16 at the same scale, finite."""
    torch.manual_seed(0)
    model = AttnNet()
    model.attn.to_q.register_forward_hook(lambda _m, _i, out: out / 3e4)
    model.attn.to_k.register_forward_hook(lambda _m, _i, out: out * 3e4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # a loss scale a long run has grown to (GradScaler doubles it every 2000 clean steps)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 17)
    guard = steadydiff.Guard(model, opt, scaler=scaler, run_dir=tmp_path,
                             config={"warmup_steps": 5, "snapshot_every": 5,
                                     "overflow_limit": 1})
    data = UserData(n=32).x
    actions = []
    for i in range(14):
        x0 = data[(i * 8) % 32:(i * 8) % 32 + 8]
        noise = torch.randn_like(x0)

        def loss_of(_i=0):
            with torch.autocast("cpu", dtype=torch.float16):
                return torch.nn.functional.mse_loss(model(x0 + noise).float(), noise)

        loss = loss_of()
        scaler.scale(loss).backward()
        d = guard.step(loss, replay=lambda _i: scaler.scale(loss_of()))
        actions.append((d.action, d.incident.kind if d.incident else None))
    rows = incidents(tmp_path)
    assert [(r["kind"], r["action"]) for r in rows] == [("attention_upcast",
                                                         "attention_upcast")]
    prov = rows[0]["evidence"]["provenance"]
    assert rows[0]["evidence"]["module"] == "attn"
    assert prov["first_nonfinite_grad"] == "attn.to_q.weight"
    assert model.attn.upcast_attention and guard.upcast == ["attn"]
    assert guard.precision == "fp16"  # no global fallback
    assert actions[-3:] == [("step", None)] * 3  # training on, finite
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


# --------------------------------------------------------------------------- the record


def test_unreproduced_faults_are_summarised_and_advised_per_rank():
    """Rows of faults the deferred check saw and the re-run did not: the summary line says
    so, one is a one-off, two on a rank advise a hardware / storage / loader check and name
    the files; a reproduced row of the same kind keeps its own advice too."""
    from steadydiff.guard.findings import finding_from_row

    def row(step, rank, reproduced=False):
        ev = {"max_abs_input": "nan", "rank": rank,
              "samples": [{"index": 7, "source": "/data/007.png", "position": 2}]}
        if reproduced is False:
            ev["reproduced"] = False
        return finding_from_row({"step": step, "kind": "bad_batch", "severity": "error",
                                 "evidence": ev, "action": "rerun"})

    one = row(14, 1)
    assert "not reproduced when the step ran again" in one.summary()
    assert one.recommendation().startswith("a one-off")
    two = [row(14, 1), row(90, 1)]
    advice = two[0].recommendation(group=two)
    assert "2 bad_batch faults (rank 1: 2)" in advice
    assert all(w in advice for w in ("hardware", "storage", "data loader", "/data/007.png"))
    mixed = [row(14, 0), row(30, 0, reproduced=True)]
    advice = mixed[0].recommendation(group=mixed)
    assert "one-off" in advice and "check the data" in advice


def test_a_few_number_parameter_swinging_its_adam_step_is_not_a_large_update():
    """A healthy eps run of the digits quick start aborted at step 110: its one-channel
    output bias (one number) took an Adam step 11x its running mean, as a lone scalar's
    step does when its gradient's sign settles. Parameters of fewer than 64 values are not
    counted; the same 50x step on a layer still is."""
    from steadydiff.guard.checks import UpdateSize, Weights

    torch.manual_seed(0)
    layers = [torch.nn.Parameter(torch.randn(32, 32)) for _ in range(4)]
    bias = torch.nn.Parameter(torch.zeros(1))
    params = [*layers, bias]
    w = Weights(torch.nn.Module(), [f"p{i}" for i in range(5)], params, False)
    sizes = UpdateSize(10.0, 0.97, 5)
    lr = 1e-3

    def step(first_scale: float, bias_step: float):
        w.begin_update()
        with torch.no_grad():
            for i, p in enumerate(layers):
                p.add_(torch.randn_like(p) * lr * (first_scale if i == 0 else 1.0))
            bias.add_(bias_step * lr)
        norms = torch.stack([p.detach().norm() for p in params])
        return [float(r) for r in w.update_ratios(norms)]

    for k in range(20):  # the bias barely moves: its gradient's sign keeps flipping
        sizes.observe(step(1.0, 0.05 if k % 2 else -0.05), lr)
    assert sizes.check(step(1.0, 1.0), lr) is None  # 20x its usual: one number, not counted
    big = sizes.check(step(50.0, 0.05), lr)
    assert big and [b[0] for b in big] == [0]  # the layer's 50x step is a large update
