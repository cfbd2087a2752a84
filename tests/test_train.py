"""Tiny end-to-end runs of the real trainer: train, checkpoint, sample, resume, CLI."""

import argparse
import json
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
import yaml

import steadydiff
from steadydiff.cli import main
from steadydiff.config import ConfigError, load_config
from steadydiff.trainer import checkpoint as ckpt

from tiny import TINY_MODEL  # noqa: E402  (tests/tiny.py)

TINY = TINY_MODEL + [
    "train.steps=6", "train.checkpoint_every=3", "sample.num=10", "sample.steps=4",
    "logging.log_every=2",
]


def tiny(*extra):
    return load_config(None, TINY + list(extra))


def weights_hash(run_dir):
    c = ckpt.load_checkpoint(ckpt.latest_good(run_dir / "checkpoints"))
    return {k: v.clone() for k, v in {**c.model, **{"ema." + k: v for k, v in c.ema.items()}}.items()}, c


def test_end_to_end_outputs(tmp_path):
    res = steadydiff.train(tiny(), out_dir=tmp_path / "run")
    run = tmp_path / "run"
    assert res.steps == 6 and res.checkpoint.name == "step_00000006"
    assert (run / "config.yaml").is_file()
    rows = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 4, 6]
    for r in rows:
        assert {"step", "images_seen", "loss", "grad_norm", "lr", "sec_per_step"} <= set(r)
        assert np.isfinite(r["loss"]) and r["images_seen"] == r["step"] * 8
    assert [p.name for p in res.samples] == ["step_00000006.png"]
    assert [p.name for p in ckpt.list_checkpoints(run / "checkpoints")] == \
        ["step_00000006", "step_00000003"]


def test_resume_is_exact(tmp_path):
    # straight 6 steps vs 3 steps then a rerun of the same command to 6
    steadydiff.train(tiny(), out_dir=tmp_path / "straight")
    steadydiff.train(tiny("train.steps=3"), out_dir=tmp_path / "resumed")
    res = steadydiff.train(tiny(), out_dir=tmp_path / "resumed")
    assert res.resumed_from.name == "step_00000003"
    a, ca = weights_hash(tmp_path / "straight")
    b, cb = weights_hash(tmp_path / "resumed")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    sa, sb = ca.optimizer["state"], cb.optimizer["state"]
    for i in sa:
        assert torch.equal(sa[i]["exp_avg_sq"], sb[i]["exp_avg_sq"])


def test_resume_refuses_changed_training_config(tmp_path):
    steadydiff.train(tiny("train.steps=3"), out_dir=tmp_path / "r")
    with pytest.raises(ConfigError, match=r"optim.lr: 0.0002 -> 0.5"):
        steadydiff.train(tiny("optim.lr=0.5"), out_dir=tmp_path / "r")
    res = steadydiff.train(tiny("optim.lr=0.5", "train.steps=4"), out_dir=tmp_path / "r",
                           allow_config_change=True)
    assert res.steps == 4
    with pytest.raises(ConfigError, match="already holds checkpoints"):
        steadydiff.train(tiny(), out_dir=tmp_path / "r", resume=False)


def test_user_dataset_and_load(tmp_path):
    class Squares(torch.utils.data.Dataset):
        def __len__(self):
            return 20

        def __getitem__(self, i):
            x = -torch.ones(1, 8, 8)
            x[:, 2:6, 2:6] = 1.0
            return x

    cfg = tiny("model.num_classes=0", "train.steps=2", "train.checkpoint_every=0")
    res = steadydiff.train(cfg, dataset=Squares(), out_dir=tmp_path / "sq")
    pipe = steadydiff.load(res.run_dir)
    x, y = pipe.sample(5, sampler="ddim", steps=3, seed=1)
    assert x.shape == (5, 1, 8, 8) and y is None
    assert x.min() >= -1 and x.max() <= 1
    x2, _ = pipe.sample(5, sampler="ddim", steps=3, seed=1)
    assert torch.equal(x, x2)
    with pytest.raises(ValueError, match="unconditional"):
        pipe.sample(2, class_label=3)


def test_conditional_data_mismatch_is_clear(tmp_path):
    with pytest.raises(ConfigError, match="the data has no labels"):
        steadydiff.train(tiny(), dataset=torch.zeros(4, 1, 8, 8), out_dir=tmp_path / "x")


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_tiny(tmp_path, precision, monkeypatch):
    """bf16/fp16 really run in that dtype inside the trainer's step (a forward hook sees
    the activations), not in fp32 under the name: the gradients differ from an fp32 run's
    by the rounding, and the master weights stay fp32."""
    from steadydiff.trainer import loop

    seen: list[torch.dtype] = []  # conv_in's output dtype, at every training forward pass
    build = loop.build_state

    def hooked(*a, **k):
        state = build(*a, **k)  # (the EMA copy was made before the hook: sampling is not seen)
        state.model.conv_in.register_forward_hook(lambda m, i, out: seen.append(out.dtype))
        return state

    monkeypatch.setattr(loop, "build_state", hooked)
    run = ["train.steps=2", "train.batch_size=4", "train.checkpoint_every=0",
           "sample.num=2", "sample.steps=2", "logging.log_every=1"]
    cfg = tiny(f"train.precision={precision}", "train.allow_slow_precision=true", *run)
    res = steadydiff.train(cfg, out_dir=tmp_path / precision)
    want = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    assert len(seen) >= 2 and set(seen) == {want}, seen
    assert np.isfinite(res.final_loss)
    c = ckpt.load_checkpoint(res.checkpoint)
    if precision == "fp16":
        assert c.state["scaler"]["scale"] > 0
    # master weights stay fp32
    assert all(v.dtype == torch.float32 for v in c.model.values() if v.is_floating_point())
    seen.clear()
    steadydiff.train(tiny(*run), out_dir=tmp_path / "fp32")
    assert set(seen) == {torch.float32}
    # The same steps with the same draws in fp32: the gradients are close, not identical
    # (rounding to 8 / 11 mantissa bits). The losses can be identical: at step 1 the model
    # outputs exactly 0, and at step 2 only its output layer has moved, by ~lr.
    g = {p: [json.loads(ln)["grad_norm"] for ln in (tmp_path / p / "metrics.jsonl")
             .read_text().splitlines()] for p in (precision, "fp32")}
    assert g[precision] != g["fp32"] and g[precision] == pytest.approx(g["fp32"], rel=0.01)


def test_slow_precision_is_refused_not_replaced(tmp_path, monkeypatch):
    from steadydiff.trainer import precision
    monkeypatch.setattr(precision, "native_support", lambda p, d: p == "fp32")
    with pytest.raises(ConfigError, match="train.precision=bf16 has no native support"):
        steadydiff.train(tiny("train.precision=bf16"), out_dir=tmp_path / "p")


def test_grad_accum_is_one_optimizer_step_per_global_batch(tmp_path):
    """grad_accum=2 splits each batch of 8 into two micro-batches of 4: one optimizer step and
    one batch of data per step, the loss averaged over all 8 samples."""
    from steadydiff.data import DigitsDataset, make_loader
    from steadydiff.trainer import loop

    cfg = tiny("train.grad_accum=2", "guard.enabled=false")
    state = loop.build_state(cfg, 10, torch.device("cpu"))
    batches = iter(make_loader(DigitsDataset(8), batch_size=8, seed=0))
    calls = []
    state.optimizer.register_step_post_hook(lambda *a: calls.append(1))
    for _ in range(2):
        out = loop.train_step(state, next(batches))
    assert (state.step, state.batches_consumed, len(calls)) == (2, 2, 2)
    assert out.per_sample_loss.shape == (8,)
    assert torch.allclose(out.loss, out.per_sample_loss.mean())
    res = steadydiff.train(tiny("train.grad_accum=2", "train.steps=2",
                                "train.checkpoint_every=0"), out_dir=tmp_path / "acc")
    row = json.loads((tmp_path / "acc" / "metrics.jsonl").read_text().splitlines()[-1])
    assert row["micro_batch"] == 4 and np.isfinite(res.final_loss)


# ---------------------------------------------------------------------- CLI


def test_cli_train_dry_run(capsys):
    assert main(["train", "configs/digits_cond.yaml", "--dry-run", "--set", "train.steps=9"]) == 0
    out = capsys.readouterr().out
    assert "steps: 9" in out and "dataset: digits" not in out  # only what differs
    changed = yaml.safe_load(out)
    assert changed["train"]["steps"] == 9 and load_config(None, [  # the changed keys are
        f"{k}={json.dumps(v)}" for k, v, _ in load_config(  # the run's config
            "configs/digits_cond.yaml", ["train.steps=9"]).differences()]) == load_config(
        "configs/digits_cond.yaml", ["train.steps=9"])
    assert main(["train", "configs/digits_cond.yaml", "--dry-run", "--print-config"]) == 0
    out = capsys.readouterr().out
    assert out.index("# model.unet.channels: 32 (default 64)") < out.index("dataset: digits")


def test_set_is_repeatable_and_never_takes_the_config_path(capsys):
    assert main(["train", "--set", "train.steps=7", "data.image_size=8",
                 "configs/digits_cond.yaml", "--dry-run"]) == 0
    changed = yaml.safe_load(capsys.readouterr().out)
    assert changed["train"]["steps"] == 7 and changed["data"]["image_size"] == 8
    assert main(["train", "configs/digits_cond.yaml", "--set", "train.steps=5", "--set",
                 "optim.lr=0.001", "--dry-run"]) == 0
    changed = yaml.safe_load(capsys.readouterr().out)
    assert changed["train"]["steps"] == 5 and changed["optim"]["lr"] == 0.001


def test_cli_bad_input_exit_code(capsys, tmp_path):
    assert main(["train", "configs/digits_cond.yaml", "--dry-run", "--set", "train.stepz=1"]) == 2
    assert "did you mean 'train.steps'" in capsys.readouterr().err
    (tmp_path / "run").mkdir()
    assert main(["sample", str(tmp_path / "run"), "--out", str(tmp_path / "x.png")]) == 2
    assert "no intact checkpoint" in capsys.readouterr().err


def test_cli_sample_png_and_npz(tmp_path, capsys):
    steadydiff.train(tiny("train.steps=1", "train.checkpoint_every=0"), out_dir=tmp_path / "r")
    run = str(tmp_path / "r")
    assert main(["sample", run, "--sampler", "euler", "--steps", "3", "--num", "6",
                 "--out", str(tmp_path / "g.png")]) == 0
    from PIL import Image
    with Image.open(tmp_path / "g.png") as im:  # 6 samples of 10 classes: one row of 6
        # (6 x 8 + 7 pad) x (8 + 2 pad) pixels, upscaled 8x (nearest) for 8x8 images
        assert im.size == (55 * 8, 10 * 8) and im.mode == "L"
        px = np.asarray(im)
    assert px[8:-8, 8:-8].std() > 0  # the samples, not just the padding
    assert main(["sample", run, "--sampler", "dpmpp_2m", "--steps", "3", "--num", "4",
                 "--class-label", "7", "--cfg-scale", "2", "--seed", "3",
                 "--out", str(tmp_path / "s.npz")]) == 0
    z = np.load(tmp_path / "s.npz")
    assert z["samples"].shape == (4, 1, 8, 8) and z["samples"].dtype == np.float32
    assert z["samples"].min() >= -1 and z["samples"].max() <= 1
    assert z["labels"].tolist() == [7, 7, 7, 7]
    assert main(["sample", run, "--class-label", "12", "--out", str(tmp_path / "b.png")]) == 2
    assert "class_label must be in [0, 9]" in capsys.readouterr().err
    assert main(["sample", run, "--out", str(tmp_path / "b.jpg")]) == 2


def help_entries(text: str) -> dict[str, str]:
    """argparse --help text -> {option string: its whole entry, whitespace collapsed}."""
    entries: dict[str, list[str]] = {}
    cur: list[str] | None = None
    for line in text.splitlines():
        if re.match(r"^  -", line):  # an option's first line; its help may wrap below it
            invocation = re.split(r"\s{2,}", line.strip(), maxsplit=1)[0]
            cur = [line]
            for part in invocation.split(", "):  # "-h, --help", "--num NUM"
                entries[part.split()[0]] = cur
        elif cur is not None and line.startswith("   "):
            cur.append(line)
        else:
            cur = None
    return {k: " ".join(" ".join(v).split()) for k, v in entries.items()}


def subparsers() -> dict[str, argparse.ArgumentParser]:
    """{command: its argparse parser}, from the CLI's own parser."""
    from steadydiff.cli import _parser

    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


# the defaults --help must show, by command and option. train --out, sample --device and
# report --out state theirs in the help text (the parser's default is None and the command
# resolves it); the others are the parser's defaults, which the formatter appends
DEFAULTS = {
    "train": {"--out": "runs/<config file name>"},
    "sample": {"--device": "auto"},
    "eval": {"--num": "500", "--seed": "0", "-k": "3"},
    "report": {"--out": "RUN_DIR/report.html"},
    "doctor": {"--device": "cpu"},
    "merge": {"--scale": "1.0"},
    "export": {},
    "ema": {"--out": "RUN/checkpoints/posthoc_<sigma_rel>", "--num": "500", "--seed": "0"},
}

# how many options of each command have a value as their default (a new one is checked too)
NUM_VALUED = {"train": 1, "sample": 0, "eval": 3, "report": 0, "doctor": 1, "merge": 1,
              "ema": 2, "export": 0}


def test_help_top_level():
    r = subprocess.run([sys.executable, "-m", "steadydiff.cli", "--help"],
                       capture_output=True, text=True)
    assert r.returncode == 0 and "usage: steadydiff" in r.stdout
    for cmd in DEFAULTS:  # every command is listed
        assert re.search(rf"^    {cmd} ", r.stdout, re.M), cmd


@pytest.mark.parametrize("cmd", list(DEFAULTS))
def test_help_shows_the_real_defaults(cmd, capsys, monkeypatch):
    """Every option whose default is a value (not None/False) shows that very value, and
    the options listed in DEFAULTS show theirs. (In-process: the same parser and exit as
    the console script, without a subprocess's import time per command.)"""
    monkeypatch.setenv("COLUMNS", "100")  # argparse wraps to the terminal width
    with pytest.raises(SystemExit) as e:
        main([cmd, "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and f"usage: steadydiff {cmd}" in out
    entries = help_entries(out)
    for opt, value in DEFAULTS[cmd].items():
        assert f"(default: {value})" in entries[opt], (opt, entries[opt])
    valued = [a for a in subparsers()[cmd]._actions if a.option_strings and a.default is not
              None and a.default is not False and argparse.SUPPRESS not in (a.default, a.help)]
    assert len(valued) == NUM_VALUED[cmd], [a.option_strings for a in valued]
    for a in valued:
        entry = entries[a.option_strings[-1]]
        assert f"(default: {a.default})" in entry, (a.option_strings, a.default, entry)


def test_resume_with_more_steps_refused_under_cosine(tmp_path):
    steadydiff.train(tiny("train.steps=3", "optim.schedule=cosine"), out_dir=tmp_path / "c")
    with pytest.raises(ConfigError, match="changes the LR schedule of the remaining steps"):
        steadydiff.train(tiny("optim.schedule=cosine"), out_dir=tmp_path / "c")


def test_cli_eval_digits(tmp_path, capsys):
    steadydiff.train(tiny("train.steps=1", "train.checkpoint_every=0"), out_dir=tmp_path / "r")
    out = tmp_path / "e.json"
    assert main(["eval", str(tmp_path / "r"), "--num", "20", "--steps", "3",
                 "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["num"] == 20 and res["metric"] == "FD-digits"
    # one training step: samples far from the digits, far above real-vs-real at the same N
    assert res["fd"] > 2 * res["real_floor"]["fd"] > 0
    assert 0 <= res["precision"] <= 1 and 0 <= res["class_accuracy"] <= 1
    assert res["feature_net"]["test_accuracy"] > 0.9
    assert "FD-digits" in capsys.readouterr().out
    assert main(["eval", str(tmp_path / "r"), "--num", "0"]) == 2


def test_tensorboard_event_files(tmp_path):
    pytest.importorskip("tensorboard", reason="the tensorboard extra (installed by make test)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    steadydiff.train(tiny("logging.tensorboard=true", "train.sample_every=3",
                          "train.checkpoint_every=0"), out_dir=tmp_path / "tb")
    acc = EventAccumulator(str(tmp_path / "tb" / "tensorboard"))
    acc.Reload()
    tags = acc.Tags()
    assert {"train/loss", "train/grad_norm", "train/lr", "train/grad_norm_clipped"} <= set(
        tags["scalars"])
    assert [e.step for e in acc.Scalars("train/loss")] == [2, 4, 6]
    assert any(t.startswith("loss_t/bucket_") for t in tags["scalars"])
    assert "samples" in tags["images"]


def test_dit_trains_samples_and_resumes_by_path(tmp_path, capsys):
    dit = ["model.kind=dit", "model.qk_norm=true", "model.dit.preset=tiny", "model.dit.depth=2",
           "model.dit.hidden_size=32", "model.dit.num_heads=2", "model.dit.patch_size=2"]
    steadydiff.train(tiny(*dit, "train.steps=2", "train.checkpoint_every=2"),
                     out_dir=tmp_path / "a")
    # --resume PATH continues another run's checkpoint into a new directory
    assert main(["train", "configs/dit.yaml", "--out", str(tmp_path / "b"),
                 "--resume", str(tmp_path / "a"), "--allow-config-change",
                 *sum((["--set", o] for o in TINY + dit + ["train.steps=3"]), [])]) == 0
    assert "resumed from" in capsys.readouterr().out
    pipe = steadydiff.load(tmp_path / "b")
    assert pipe.step == 3 and type(pipe.model).__name__ == "DiT"
    x, y = pipe.sample(4, steps=2)
    assert x.shape == (4, 1, 8, 8) and y.tolist() == [0, 1, 2, 3]


def test_unguarded_nan_run_stops_at_its_checkpoint(tmp_path):
    """Without the guard a NaN run trains on until its next checkpoint (the progress bar and
    metrics rows must not crash on the non-finite values), then stops: steadydiff never
    writes a non-finite checkpoint, and the CLI says so with exit code 3."""
    from steadydiff.trainer.loop import TrainingDiverged

    cfg = tiny("guard.enabled=false", "logging.progress=true", "logging.report=false",
               'faults=[{"kind": "param_nan", "step": 4}]')
    with pytest.raises(TrainingDiverged, match="guard is off") as e:
        steadydiff.train(cfg, out_dir=tmp_path / "nan")
    assert "last good checkpoint is" in str(e.value) and "step_00000003" in str(e.value)
    rows = [json.loads(l) for l in (tmp_path / "nan" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 6 and rows[-1]["loss"] == "nan"
    assert [p.name for p in ckpt.list_checkpoints(tmp_path / "nan" / "checkpoints")] == \
        ["step_00000003"]
    assert json.loads((tmp_path / "nan" / "summary.json").read_text())["status"] == "aborted"


def test_rerunning_a_finished_run_is_harmless(tmp_path, capsys):
    """`make quickstart` twice: the second run resumes at the end, trains nothing, and does
    not refuse config changes (there is no step left for them to change)."""
    steadydiff.train(tiny("train.steps=2", "train.checkpoint_every=0"), out_dir=tmp_path / "r")
    res = steadydiff.train(tiny("train.steps=2", "train.checkpoint_every=0", "guard.loss_z=9"),
                           out_dir=tmp_path / "r")
    assert res.steps == 2 and res.resumed_from.name == "step_00000002"
    assert "already complete" in capsys.readouterr().out
