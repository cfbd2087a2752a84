"""``steadydiff doctor``: a healthy tiny run is healthy; checkpoints broken on purpose are
diagnosed with the right layer and mechanism first (issue 5's bars).

One real tiny run (6 steps, CPU) is shared by the module. The four breakages of the issue:
NaN in one layer and attention logits grown by scaling the q/k rows go through a real
checkpoint directory (weights edited, manifest rewritten so verification passes, the CLI's
exit code); a layer scaled ×1e3 and a GroupNorm fed near-constant input go through
:func:`diagnose_model` on the in-memory model.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import steadydiff
from steadydiff.cli import main
from steadydiff.config import load_config
from steadydiff.doctor import Cause, diagnose, diagnose_model
from steadydiff.inspect.causes import rank
from steadydiff.inspect.stats import ks_distance, robust_z
from steadydiff.trainer import checkpoint as ckpt

from tiny import TINY_MODEL  # noqa: E402  (tests/tiny.py)

TINY = TINY_MODEL + [
    "train.steps=6", "train.checkpoint_every=3", "sample.num=4", "sample.steps=2",
    "logging.log_every=2",
    "train.ema_decay=0.9",
]


@pytest.fixture(scope="module")
def healthy(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    run = tmp_path_factory.mktemp("doctor") / "healthy"
    steadydiff.train(load_config(None, TINY), out_dir=run)
    return run


def _broken_checkpoint(run: Path, dst: Path, edit) -> Path:
    """Copy the run's newest checkpoint, edit its model weights with ``edit(state_dict)``,
    and rewrite the manifest entry so the checkpoint still verifies."""
    src = ckpt.latest_good(run / "checkpoints")
    shutil.copytree(src, dst)
    sd = load_file(str(dst / "model.safetensors"))
    edit(sd)
    save_file(sd, str(dst / "model.safetensors"))
    mf = json.loads((dst / "manifest.json").read_text())
    data = (dst / "model.safetensors").read_bytes()
    mf["files"]["model.safetensors"] = {"size": len(data),
                                        "sha256": hashlib.sha256(data).hexdigest()}
    (dst / "manifest.json").write_text(json.dumps(mf))
    assert ckpt.verify_checkpoint(dst) == []
    return dst


def _model(run: Path):
    pipe = steadydiff.load(run, device="cpu", use_ema=False)
    return pipe.model, pipe.config


# --------------------------------------------------------------------------- healthy


def test_healthy_run_is_healthy(healthy, capsys):
    d = diagnose(healthy)
    assert d.checkpoint is not None and d.checkpoint.name == "step_00000006"
    assert [c for c in d.causes if c.severity == "critical"] == [], d.causes
    assert d.exit_code == 0 and d.status in ("healthy", "warning")
    assert "nonfinite_weights" in d.checks and "norm_eps_dominated" in d.checks
    assert any("probe batch: " in n and "digits" in n for n in d.notes)
    assert main(["doctor", str(healthy)]) == 0
    out = capsys.readouterr().out
    assert "verdict: HEALTHY" in out or "verdict: WARNINGS" in out
    assert main(["doctor", str(healthy), "--json"]) == 0
    js = json.loads(capsys.readouterr().out)
    assert js["exit_code"] == 0 and js["counts"]["critical"] == 0
    assert set(js) >= {"path", "checkpoint", "step", "status", "causes", "checks", "notes",
                       "measurements"}
    assert "fp16_margin" in js["measurements"]["probe"]


# --------------------------------------------------------------------------- broken on purpose


def test_nan_in_one_layer_named_first(healthy, tmp_path, capsys):
    layer = "up.0.res.0.conv1"

    def edit(sd):
        sd[f"{layer}.weight"].view(-1)[3] = float("nan")

    c = _broken_checkpoint(healthy, tmp_path / "step_00000006", edit)
    d = diagnose(c)
    first = d.causes[0]
    assert (first.severity, first.check, first.where) == ("critical", "nonfinite_weights", layer)
    assert f"{layer}.weight" in first.evidence["tensors"]
    assert first.evidence["other_weights_finite"]  # the EMA is intact: say so
    assert "EMA" in first.recommendation
    assert main(["doctor", str(c)]) == 1  # critical -> exit code 1
    assert f"nonfinite_weights @ {layer}" in capsys.readouterr().out


def test_attention_logit_growth_named_first(healthy, tmp_path):
    module = "mid.attn.attn"

    def edit(sd):
        w = sd[f"{module}.qkv.weight"]  # (3D, D): rows q | k | v
        d = w.shape[0] // 3
        w[: 2 * d] *= 30.0

    c = _broken_checkpoint(healthy, tmp_path / "step_00000006", edit)
    d = diagnose(c)
    first = d.causes[0]
    assert (first.severity, first.check, first.where) == ("critical", "attention_logit_growth",
                                                          module)
    assert first.evidence["max_logit"] > 50
    assert first.evidence["q_weight_ratio_vs_init"] == pytest.approx(30, rel=0.01)
    assert "QK-norm" in first.recommendation


def test_layer_scaled_1e3_named_first(healthy):
    model, cfg = _model(healthy)
    layer = "down.1.res.0.conv1"
    with torch.no_grad():
        dict(model.named_parameters())[f"{layer}.weight"].mul_(1e3)
    d = diagnose_model(model, cfg)
    first = d.causes[0]
    assert first.check in ("weight_norm_outlier", "weight_drift"), d.causes[:3]
    assert first.where == layer and first.severity == "critical"
    assert first.evidence["norm_ratio_vs_init"] == pytest.approx(1e3, rel=0.05)


def test_groupnorm_fed_constant_input_named_first(healthy):
    model, cfg = _model(healthy)
    # the conv right before up.1.res.0.norm2, shrunk to almost nothing: its output is
    # near-constant, so the GroupNorm's input variance falls far below eps
    conv = dict(model.named_modules())["up.1.res.0.conv1"]
    with torch.no_grad():
        conv.weight.mul_(1e-6)
        conv.bias.mul_(1e-6)
    d = diagnose_model(model, cfg)
    first = d.causes[0]
    assert (first.severity, first.check, first.where) == ("critical", "norm_eps_dominated",
                                                          "up.1.res.0.norm2"), d.causes[:3]
    assert first.evidence["input_from"] == "up.1.res.0.conv1"
    assert first.evidence["median_input_var"] < 1e-2 * first.evidence["eps"]
    assert "up.1.res.0.conv1" in first.recommendation


# --------------------------------------------------------------------------- history, input


def _write_run(run: Path, summary: dict | None, incidents: list[dict], metrics: list[dict]):
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(load_config(None, TINY).to_yaml())
    (run / "incidents.jsonl").write_text("".join(json.dumps(i) + "\n" for i in incidents))
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    if summary is not None:
        (run / "summary.json").write_text(json.dumps(summary))


def test_history_aborted_run_and_bad_batch(tmp_path, capsys):
    rows = [{"step": s, "loss": 0.5 * 1.3 ** s, "grad_norm": 1.0 * 1.5 ** s, "lr": 2e-4}
            for s in range(1, 11)]
    incs = [{"step": 4, "kind": "bad_batch", "severity": "fatal", "action": "skip",
             "evidence": {"max_abs_input": 412.0}, "cost": {"batch_position": 5}},
            *[{"step": s, "kind": "grad_spike", "severity": "spike", "action": "rollback",
               "evidence": {"grad_norm": 50.0, "z": 9.0}, "cost": {}} for s in (8, 9)],
            {"step": 10, "kind": "grad_spike", "severity": "spike", "action": "abort",
             "evidence": {}, "diagnosis": {"why": "5 rollbacks within 1000 steps already"}}]
    run = tmp_path / "aborted"
    _write_run(run, {"status": "aborted", "steps": 10, "incidents": 4,
                     "reason": "5 rollbacks within 1000 steps already"}, incs, rows)
    d = diagnose(run)
    assert d.causes[0].check == "run_aborted" and d.causes[0].severity == "critical"
    assert "lower the peak LR" in d.causes[0].recommendation
    bad = next(c for c in d.causes if c.evidence.get("kind") == "bad_batch")
    assert "check the data: the batch at step 4 had values outside [-1, 1]" in \
        bad.recommendation
    spikes = next(c for c in d.causes if c.evidence.get("kind") == "grad_spike")
    assert spikes.evidence["trend_before_first"]["grad_norm_trend"] > 2  # rising before
    assert any("no intact checkpoint" in n for n in d.notes)
    assert main(["doctor", str(run), "--no-probe"]) == 1


def test_bad_input_exit_code_2(tmp_path, capsys):
    assert main(["doctor", str(tmp_path / "missing")]) == 2
    (tmp_path / "empty").mkdir()
    assert main(["doctor", str(tmp_path / "empty")]) == 2
    assert "error:" in capsys.readouterr().err


# --------------------------------------------------------------------------- pieces


def test_ks_distance_and_robust_z():
    g = torch.Generator().manual_seed(0)
    a = torch.rand(5000, generator=g) * 2 - 1
    assert ks_distance(a, a) == 0.0
    # a symmetric distribution scaled toward 0 vs itself: half its mass crosses the median
    assert ks_distance(a * 1e-6, a) == pytest.approx(0.5, abs=0.02)
    assert ks_distance(a + 10, a) == 1.0
    stats = pytest.importorskip("scipy.stats")
    b = torch.randn(3000, generator=g) * 0.5
    assert ks_distance(a, b) == pytest.approx(stats.ks_2samp(a.numpy(), b.numpy()).statistic,
                                              abs=1e-9)
    z = robust_z([0.0, 0.01, -0.01, 0.02, 3.0], floor=0.05)
    assert z[-1] > 6 and max(abs(v) for v in z[:-1]) < 1


def test_ranking_severity_then_mechanism():
    cs = [Cause("warning", "weight_drift", "a", "", {}, "", score=9),
          Cause("critical", "weight_norm_outlier", "a", "", {}, "", score=50),
          Cause("critical", "attention_logit_growth", "a", "", {}, "", score=1),
          Cause("critical", "nonfinite_weights", "b", "", {}, "", score=0)]
    assert [c.check for c in rank(cs)] == ["nonfinite_weights", "attention_logit_growth",
                                           "weight_norm_outlier", "weight_drift"]
