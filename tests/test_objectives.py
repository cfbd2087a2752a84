"""The flow and EDM objectives through the real trainer and the commands a user runs on a
run: exact resume, sample (every sampler the objective takes), eval, doctor, the guard's
per-t-bucket statistics and a user's broken data."""

from __future__ import annotations

import json

import pytest
import torch

import steadydiff
from steadydiff.cli import main
from steadydiff.config import load_config
from steadydiff.doctor import diagnose
from steadydiff.kinds import OBJECTIVE_SAMPLERS
from steadydiff.trainer import checkpoint as ckpt

from tiny import TINY_MODEL  # noqa: E402  (tests/tiny.py)

TINY = TINY_MODEL + ["train.steps=6", "train.checkpoint_every=3", "sample.num=10",
                     "sample.steps=4", "logging.log_every=1", "logging.report=false"]
OBJ = {"flow": ["diffusion.objective=flow", "diffusion.flow.shift=2.0",
                "diffusion.timestep_sampling=logit_normal", "sample.sampler=euler"],
       "edm": ["diffusion.objective=edm", "sample.sampler=heun"]}
DIT = ["model.kind=dit", "model.dit.depth=2", "model.dit.hidden_size=32",
       "model.dit.num_heads=2", "model.dit.patch_size=2"]


def tiny(*extra):
    return load_config(None, TINY + list(extra))


def _weights(run):
    c = ckpt.load_checkpoint(ckpt.latest_good(run / "checkpoints"))
    return {**c.model, **{"ema." + k: v for k, v in c.ema.items()}}, c


@pytest.mark.parametrize("case", ["flow-unet", "edm-dit"])
def test_resume_is_exact(tmp_path, case):
    """3 steps, then the same command to 6, equals 6 straight: the objective's draws come
    from the (seed, step) generator like ddpm's."""
    obj, kind = case.split("-")
    extra = OBJ[obj] + (DIT if kind == "dit" else [])
    steadydiff.train(tiny(*extra), out_dir=tmp_path / "straight")
    steadydiff.train(tiny(*extra, "train.steps=3"), out_dir=tmp_path / "resumed")
    res = steadydiff.train(tiny(*extra), out_dir=tmp_path / "resumed")
    assert res.resumed_from.name == "step_00000003"
    a, ca = _weights(tmp_path / "straight")
    b, cb = _weights(tmp_path / "resumed")
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert torch.isfinite(torch.tensor(res.final_loss))


@pytest.fixture(scope="module", params=["flow", "edm"])
def run(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param) / "run"
    steadydiff.train(tiny(*OBJ[request.param]), out_dir=out)
    return request.param, out


def test_metrics_fill_the_guard_buckets(run):
    """The per-sample losses land in t-buckets (flow: σ in [b/B, (b+1)/B); edm: the training
    distribution's quantiles), so the guard's per-bucket spike statistics see them."""
    obj, out = run
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    seen = [any(r["loss_t"][b] is not None for r in rows) for b in range(len(rows[0]["loss_t"]))]
    assert sum(seen) >= 3, (obj, [r["loss_t"] for r in rows])
    assert all(v is None or v > 0 for r in rows for v in r["loss_t"])


def test_sample_with_every_sampler_the_objective_takes(run, tmp_path, capsys):
    obj, out = run
    pipe = steadydiff.load(out, device="cpu")
    for name in OBJECTIVE_SAMPLERS[obj]:
        x, y = pipe.sample(4, sampler=name, steps=3, seed=1)
        assert x.shape == (4, 1, 8, 8) and torch.isfinite(x).all(), name
        assert float(x.abs().max()) <= 1
    a, _ = pipe.sample(4, steps=3, seed=1)
    b, _ = pipe.sample(4, steps=3, seed=1)
    assert torch.equal(a, b)
    png = tmp_path / "s.png"
    assert main(["sample", str(out), "--sampler", "heun", "--steps", "3", "--num", "4",
                 "--out", str(png)]) == 0 and png.is_file()


def test_a_ddpm_run_refuses_heun_by_name(tmp_path, capsys):
    out = tmp_path / "ddpm"
    steadydiff.train(tiny("train.steps=1", "train.checkpoint_every=0"), out_dir=out)
    with pytest.raises(ValueError, match="--sampler heun does not apply to this model's "
                       "diffusion.objective=ddpm; valid: ddpm, ddim, dpmpp_2m, euler"):
        steadydiff.load(out, device="cpu").sample(2, sampler="heun")
    assert main(["sample", str(out), "--sampler", "heun", "--out",
                 str(tmp_path / "x.png")]) == 2
    assert "does not apply" in capsys.readouterr().err


def test_eval_and_doctor(run, tmp_path, capsys):
    obj, out = run
    js = tmp_path / "e.json"
    assert main(["eval", str(out), "--num", "20", "--steps", "3", "--out", str(js)]) == 0
    res = json.loads(js.read_text())
    assert res["metric"] == "FD-digits" and res["fd"] > 0 and res["num"] == 20
    d = diagnose(out)
    assert d.exit_code == 0 and [c for c in d.causes if c.severity == "critical"] == []
    assert "fp16_overflow" in d.checks
    assert main(["doctor", str(out)]) == 0


class _BrokenDigits(torch.utils.data.Dataset):
    """A user's own dataset whose item 4 comes back NaN (a corrupt file they decode; 4 is
    not among the items steadydiff's range check reads before the first step)."""

    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.x = torch.rand(48, 1, 8, 8, generator=g) * 2 - 1
        self.num_classes = 10

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        x = self.x[i].clone()
        if i == 4:
            x[0, 2, 3] = float("nan")
        return x, i % 10


@pytest.mark.parametrize("obj", ["flow", "edm"])
def test_a_users_nan_image_is_dropped_and_quarantined(tmp_path, obj):
    """The guard on a flow/EDM run: the NaN image is dropped from its batch, then
    quarantined; the model and EMA stay finite and every step trains."""
    out = tmp_path / "run"
    res = steadydiff.train(tiny(*OBJ[obj], "train.steps=14", "train.checkpoint_every=0"),
                           out_dir=out, dataset=_BrokenDigits())
    assert res.steps == 14
    rows = [json.loads(ln) for ln in (out / "incidents.jsonl").read_text().splitlines()]
    kinds = [(r["kind"], r["action"]) for r in rows]
    assert ("sample_quarantined", "quarantine") in kinds, kinds
    assert any(r["evidence"].get("index") == 4 for r in rows)
    c = ckpt.load_checkpoint(res.checkpoint)
    assert all(torch.isfinite(v).all() for v in [*c.model.values(), *c.ema.values()])
