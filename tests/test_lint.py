"""Lint: every warning fires on its trigger, stays quiet just below it, and the shipped
configs are clean."""

from pathlib import Path

import pytest
import torch

from steadydiff.cli import main
from steadydiff.config import load_config
from steadydiff.lint import CHECKS, lint, lint_report

CONFIGS = sorted(Path(__file__).resolve().parents[1].glob("configs/*.yaml"))
BY_NAME = {c.name: c for c in CHECKS}

# name -> (overrides that trigger it, overrides just on the safe side, text the message has)
_TEXT = ["data.dataset=fashion_mnist", "data.captions=class_names", "model.text_encoder=/te"]
TRIGGERS = {
    "keep_tokens_unshuffled": ([*_TEXT, "data.keep_tokens=1"], _TEXT,
                               "data.keep_tokens=1 keeps tags"),
    "double_caption_dropout": ([*_TEXT, "data.caption_dropout=0.1"],
                               [*_TEXT, "data.caption_dropout=0.1", "diffusion.cfg_dropout=0"],
                               "19% of samples"),
    "lr_high": (["optim.lr=4e-3"], ["optim.lr=3e-3"], "optim.lr=0.004"),
    "grad_accum_high": (["train.grad_accum=32"], ["train.grad_accum=16"],
                        "train.grad_accum=32 is above 16"),
    "clip_high": (["optim.grad_clip=5"], ["optim.grad_clip=5", "optim.clip_mode=zclip"],
                  "optim.grad_clip=5 with clip_mode=global"),
    "clip_off": (["optim.grad_clip=0"], ["optim.grad_clip=0.5"], "disables gradient clipping"),
    "fp16_unguarded": (["train.precision=fp16", "guard.enabled=false", "model.qk_norm=true"],
                       ["train.precision=fp16", "model.qk_norm=true"],
                       "guard.enabled=false"),
    "fp16_attention": (["train.precision=fp16"], ["train.precision=fp16", "model.qk_norm=true"],
                       "model.qk_norm=false"),
    "norm_eps_low": (["train.precision=fp16", "model.qk_norm=true", "model.unet.norm_eps=1e-6"],
                     ["train.precision=fp16", "model.qk_norm=true", "model.unet.norm_eps=1e-5"],
                     "model.unet.norm_eps=1e-06 under train.precision=fp16"),
    "ema_too_slow": (["train.ema_decay=0.9999"], ["train.ema_decay=0.999"],
                     "averages over ~10000 steps"),
    "warmup_too_long": (["optim.warmup_steps=1000"], ["optim.warmup_steps=999"],
                        "never reaches optim.lr"),
    "cfg_dropout_unconditional": (["diffusion.cfg_dropout=0.2"],
                                  ["diffusion.cfg_dropout=0.2", "model.num_classes=10"],
                                  "no labels to drop"),
    "cfg_untrained": (["model.num_classes=10", "diffusion.cfg_dropout=0", "sample.cfg_scale=3"],
                      ["model.num_classes=10", "sample.cfg_scale=3"], "null class is never"),
    "flow_sigma_sqrt": (["diffusion.objective=flow", "diffusion.loss_weighting=sigma_sqrt"],
                        ["diffusion.objective=flow", "diffusion.loss_weighting=cosmap"],
                        "up to 1e+06 at the smallest trained sigma"),
    "ztsnr_eps": (["diffusion.zero_terminal_snr=true"],
                  ["diffusion.zero_terminal_snr=true", "diffusion.prediction=v"],
                  "x0 = (x_t - sigma·eps)/alpha is undefined"),
    "no_intermediate_checkpoint": (["train.checkpoint_every=1001"],
                                   ["train.checkpoint_every=1000"],
                                   "larger than train.steps=1000"),
    "single_checkpoint": (["train.keep_checkpoints=1"], ["train.keep_checkpoints=2"],
                          "no older one to fall back to"),
    "hflip_digits": (["data.hflip=true"], ["data.hflip=true", "data.dataset=folder",
                                           "data.path=x"], "mirrored digit"),
}


# the checks that need a device, tested with a (faked) one: below, and the speed_* checks in
# tests/test_fast_defaults.py
DEVICE_CHECKS = {"emulated_precision", "speed_precision", "speed_tf32", "speed_fused",
                 "speed_channels_last"}


def test_every_check_has_a_trigger_test():
    assert set(TRIGGERS) | DEVICE_CHECKS == set(BY_NAME)


def test_defaults_are_clean():
    assert lint(load_config(None)) == []
    assert lint_report(load_config(None)) == ""


@pytest.mark.parametrize("name", sorted(TRIGGERS))
def test_check_fires_on_its_trigger_only(name):
    on, off, text = TRIGGERS[name]
    cfg = load_config(None, on)
    msg = BY_NAME[name].fn(cfg, None)
    assert msg is not None and text in msg, msg
    assert msg in lint(cfg)
    # every message says what to do, not only what is wrong
    assert any(w in msg for w in ("use ", "set ", "lower it", "keep ", "raise ", "enable ",
                                  "checkpoint every")), msg
    assert BY_NAME[name].fn(load_config(None, off), None) is None


def test_fp16_attention_is_also_answered_by_upcast_attention():
    msg = BY_NAME["fp16_attention"].fn(load_config(None, ["train.precision=fp16"]), None)
    assert "model.upcast_attention=true" in msg
    assert BY_NAME["fp16_attention"].fn(load_config(None, [
        "train.precision=fp16", "model.upcast_attention=true"]), None) is None


def test_lr_ceiling_depends_on_the_family():
    dit = load_config(None, ["model.kind=dit", "optim.lr=2e-3"])
    assert any("usual ceiling for AdamW on a dit" in m for m in lint(dit))
    assert not any("optim.lr" in m for m in lint(load_config(None, ["optim.lr=2e-3"])))


def test_norm_eps_floor_depends_on_precision():
    bf16 = ["train.precision=bf16", "model.kind=dit"]
    assert BY_NAME["norm_eps_low"].fn(load_config(None, bf16), None) is None  # DiT's 1e-6
    msg = BY_NAME["norm_eps_low"].fn(load_config(None, bf16 + ["model.dit.norm_eps=1e-7"]),
                                     None)
    assert "model.dit.norm_eps=1e-07 under train.precision=bf16" in msg and "LayerNorm" in msg
    fp32 = load_config(None, ["model.unet.norm_eps=1e-12"])
    assert BY_NAME["norm_eps_low"].fn(fp32, None) is None


def test_ema_check_counts_updates_after_ema_start():
    cfg = load_config(None, ["train.ema_decay=0.99", "train.steps=150", "train.ema_start=100"])
    assert "more than the 50 EMA updates" in BY_NAME["ema_too_slow"].fn(cfg, None)


def test_long_run_without_intermediate_checkpoint():
    check = BY_NAME["no_intermediate_checkpoint"].fn
    assert "checkpoint_every=0 on a 5000-step run" in check(
        load_config(None, ["train.checkpoint_every=0", "train.steps=5000"]), None)
    # a short run checkpointed only at the end is fine (the tests do it everywhere)
    assert check(load_config(None, ["train.checkpoint_every=0", "train.steps=10"]), None) is None


def test_emulated_precision_needs_the_device(monkeypatch):
    from steadydiff.trainer import precision
    monkeypatch.setattr(precision, "native_support", lambda p, d: p == "fp32")
    cfg = load_config(None, ["train.precision=bf16", "train.allow_slow_precision=true"])
    assert not any("emulated" in m for m in lint(cfg))  # device unknown (--dry-run)
    assert any("runs emulated" in m for m in lint(cfg, torch.device("cpu")))
    strict = load_config(None, ["train.precision=bf16"])  # the trainer refuses it anyway
    assert not any("emulated" in m for m in lint(strict, torch.device("cpu")))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_configs_are_clean(path):
    assert lint(load_config(path), torch.device("cpu")) == []


def test_dry_run_prints_warnings_on_stderr(capsys):
    assert main(["train", "configs/dit.yaml", "--dry-run", "--set", "optim.lr=0.01",
                 "--set", "train.grad_accum=32", "--set", "train.batch_size=64"]) == 0
    out, err = capsys.readouterr()
    assert "lr: 0.01" in out and "warning:" not in out  # stdout stays the config (YAML)
    lines = err.splitlines()
    assert any(l.startswith("warning: optim.lr=0.01 is above 0.001") for l in lines)
    assert any(l.startswith("warning: train.grad_accum=32") for l in lines)
    assert main(["train", "configs/dit.yaml", "--dry-run"]) == 0
    assert capsys.readouterr().err == ""
