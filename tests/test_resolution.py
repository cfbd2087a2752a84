"""Progressive resolution (issue 19): a run continued at a larger data.image_size with
--grow-resolution. What carries over (weights, EMA, optimizer), what is recomputed (the DiT's
position code), what restarts (the guard's statistics, as an incident row), the log-SNR
shift for the larger size against its closed form, exact resume after the change, and the
errors for what cannot grow."""

import json
import math

import pytest
import torch

import steadydiff
from steadydiff.cli import main
from steadydiff.config import ConfigError, load_config, validate
from steadydiff.data import FashionMNISTDataset
from steadydiff.diffusion import make_schedule
from steadydiff.diffusion.schedules import resolution_shift
from steadydiff.guard import findings as F
from steadydiff.models.dit import sincos_pos_embed_2d
from steadydiff.trainer import checkpoint as ckpt
from steadydiff.trainer import loop
from steadydiff.trainer.checkpoint_io import CheckpointIO
from steadydiff.trainer.resolution import apply_growth, grow_config

from test_eval import make_fashion  # noqa: E402  (tests/test_eval.py)
from tiny import TINY_MODEL  # noqa: E402  (tests/tiny.py)

TINY = TINY_MODEL + ["train.checkpoint_every=3", "sample.num=4", "sample.steps=2",
                     "logging.log_every=1", "logging.report=false", "optim.schedule=constant",
                     "optim.warmup_steps=0"]
DIT = ["model.kind=dit", "model.dit.depth=2", "model.dit.hidden_size=32",
       "model.dit.num_heads=2", "model.dit.patch_size=2"]


def tiny(*extra):
    return load_config(None, TINY + list(extra))


def small_run(tmp_path, *extra, steps=3):
    """A finished run at 8x8 (its checkpoint at ``steps``)."""
    run = tmp_path / "run"
    steadydiff.train(tiny(f"train.steps={steps}", *extra), out_dir=run)
    return run


def grown_state(run, cfg):
    """What the trainer does with --grow-resolution, step by step (loop._run's order): the
    config for the new size, the state built at it, the checkpoint restored, the guard
    attached and its statistics restored, then the change carried out."""
    path = ckpt.latest_good(run / "checkpoints")
    c = ckpt.load_checkpoint(path)
    saved = validate(c.state["config"])
    cfg, notes = grow_config(saved, cfg)
    state = loop.build_state(cfg, 10, torch.device("cpu"))
    c2, growth = loop._resume(state, path, False, lambda *_: None, grow=True)
    loop.attach_guard(state, None)
    CheckpointIO(state).restore_guard(c2)
    apply_growth(state, growth, lambda *_: None)
    return state, c, notes


def _equal_dicts(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


# --------------------------------------------------------------------------- what carries over


def test_unet_weights_ema_and_optimizer_carry_over_bit_exactly(tmp_path):
    run = small_run(tmp_path)
    state, c, notes = grown_state(run, tiny("data.image_size=16", "train.steps=6"))
    _equal_dicts(state.model.state_dict(), c.model)
    _equal_dicts(state.ema.module.state_dict(), c.ema)
    for i, s in c.optimizer["state"].items():
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state.optimizer.state_dict()["state"][i][k], s[k])
    # attention stays at the same depth: level 1 is 4x4 at 8 px and 8x8 at 16 px
    assert state.cfg.model.unet.attention_resolutions == (8,)
    assert any("attention_resolutions [4] -> [8]" in n for n in notes)
    assert [len(lv.attn) for lv in state.model.down] == [0, 1]
    assert state.model.image_size == 16 and state.ema.module.image_size == 16
    out = state.model(torch.zeros(2, 1, 16, 16), torch.tensor([3, 50]), torch.tensor([1, 2]))
    assert out.shape == (2, 1, 16, 16)
    assert state.step == 3 and state.resolution_history == [{"step": 3, "from": 8, "to": 16}]


def test_dit_position_code_is_recomputed_for_the_new_grid(tmp_path):
    run = small_run(tmp_path, *DIT)
    state, c, notes = grown_state(run, tiny(*DIT, "data.image_size=16", "train.steps=6"))
    _equal_dicts(state.model.state_dict(), c.model)  # pos_embed is a buffer, not saved
    assert "pos_embed" not in c.model
    want = sincos_pos_embed_2d(32, 8)[None]  # 16 px / patch 2 = an 8x8 grid
    for m in (state.model, state.ema.module):
        assert m.grid == 8 and torch.equal(m.pos_embed, want)
    assert any("patch grid 4x4 -> 8x8" in n for n in notes)
    out = state.model(torch.zeros(2, 1, 16, 16), torch.tensor([3, 50]), torch.tensor([1, 2]))
    assert out.shape == (2, 1, 16, 16)


def test_guard_statistics_restart_and_the_change_is_an_incident(tmp_path):
    run = small_run(tmp_path)
    c = ckpt.load_checkpoint(ckpt.latest_good(run / "checkpoints"))
    assert c.state["guard"]["grad"][2] == 3  # the small run warmed its statistics up
    state, _, _ = grown_state(run, tiny("data.image_size=16", "train.steps=6"))
    g = state.guard
    assert g.grad.stats.count == 0 and g.inputs.count == 0
    assert all(s.count == 0 for s in g.loss.stats)
    assert g.divergence.seen == 0 and g.divergence.smooth is None
    assert [s.step for s in g.ring.ring] == [3]  # the ring restarts from the grown state
    inc = g.incidents[-1]
    assert inc.kind == "resolution_change" and inc.action == "restart_statistics"
    assert inc.severity == "info" and inc.step == 3
    assert inc.evidence["old_size"] == 8 and inc.evidence["new_size"] == 16
    f = F.finding_from_row(inc.row())
    assert type(f) is F.ResolutionChange
    assert "image size 8 -> 16 at step 3" in f.summary() and f.recommendation()
    # the budgets and counts of the run before stay
    assert g.num_incidents == 1 and g.grad.check(1e9) is None  # warming up: never fires


# --------------------------------------------------------------------------- the schedule shift


@pytest.mark.parametrize("kind", ["linear", "cosine", "sigmoid"])
def test_schedule_shift_matches_the_closed_form(kind):
    base = load_config(None, [f"diffusion.schedule={kind}", "diffusion.timesteps=200"])
    shifted = load_config(None, [f"diffusion.schedule={kind}", "diffusion.timesteps=200",
                                 "diffusion.resolution_shift_base=16"])
    t = torch.arange(200)
    lam0 = make_schedule(base.diffusion).log_snr(t, torch.float64)
    for size in (16, 32, 64):
        lam = make_schedule(shifted.diffusion, size).log_snr(t, torch.float64)
        # simple diffusion: logsnr_shifted(t) = logsnr(t) + 2 log(base / size)
        assert torch.allclose(lam, lam0 + 2 * math.log(16 / size), atol=1e-9, rtol=0)
    assert resolution_shift(16, 32) == pytest.approx(-2 * math.log(2))  # lower SNR: more noise
    assert torch.equal(make_schedule(shifted.diffusion, 16).alphas_cumprod,
                       make_schedule(base.diffusion).alphas_cumprod)  # no shift at the base
    with pytest.raises(ValueError, match="needs the training resolution"):
        make_schedule(shifted.diffusion)


def test_schedule_shift_keeps_zero_terminal_snr():
    cfg = load_config(None, ["diffusion.schedule=cosine", "diffusion.timesteps=100",
                             "diffusion.zero_terminal_snr=true",
                             "diffusion.resolution_shift_base=16"])
    s = make_schedule(cfg.diffusion, 64)
    assert s.alphas_cumprod[-1] == 0 and s.zero_terminal_snr
    assert (s.alphas_cumprod[:-1] > 0).all() and (s.betas[:-1] > 0).all()


# --------------------------------------------------------------------------- the run, end to end


def _cli(run, *overrides, grow=True, steps=6):
    args = ["train", "configs/digits_cond.yaml", "--out", str(run)]
    for o in TINY + list(overrides) + [f"train.steps={steps}"]:
        args += ["--set", o]
    return main(args + (["--grow-resolution"] if grow else []))


def test_cli_refuses_without_the_flag_and_grows_with_it(tmp_path, capsys):
    run = tmp_path / "run"
    assert _cli(run, grow=False, steps=3) == 0
    capsys.readouterr()
    assert _cli(run, "data.image_size=16", grow=False) == 2  # a config error
    err = capsys.readouterr().err
    assert "data.image_size: 8 -> 16" in err and "pass --grow-resolution" in err
    # --dry-run checks the grown config (attention by depth) without training
    args = ["train", "configs/digits_cond.yaml", "--out", str(run), "--dry-run", "--print-config",
            "--grow-resolution"]
    assert main(args + sum((["--set", o] for o in TINY + ["data.image_size=16"]), [])) == 0
    dry = capsys.readouterr()
    assert "attention_resolutions:\n    - 8" in dry.out and "[4] -> [8]" in dry.err
    assert _cli(run, "data.image_size=16", "logging.report=true") == 0
    out = capsys.readouterr().out
    assert "grow resolution: 8x8 -> 16x16 at step 3" in out
    assert "resolution (--grow-resolution):" in out and "data.image_size: 8 -> 16" in out
    rows = [json.loads(line) for line in (run / "incidents.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["step"], r["action"]) for r in rows] == \
        [("resolution_change", 3, "restart_statistics")]
    assert rows[0]["evidence"]["old_size"] == 8 and rows[0]["evidence"]["new_size"] == 16
    assert "resolution_change" in (run / "report.html").read_text()
    c = ckpt.load_checkpoint(ckpt.latest_good(run / "checkpoints"))
    assert c.step == 6 and c.state["image_size"] == 16
    assert c.state["resolution_history"] == [{"step": 3, "from": 8, "to": 16}]
    assert c.state["config"]["model"]["unet"]["attention_resolutions"] == [8]
    x, _ = steadydiff.load(run).sample(2, steps=2)
    assert x.shape == (2, 1, 16, 16)


def test_resume_after_the_change_is_exact(tmp_path):
    """Grown at step 3, stopped at 4 and resumed by the same command == grown straight."""
    for name in ("straight", "stopped"):
        assert _cli(tmp_path / name, grow=False, steps=3) == 0
    assert _cli(tmp_path / "straight", "data.image_size=16", steps=6) == 0
    assert _cli(tmp_path / "stopped", "data.image_size=16", steps=4) == 0
    assert _cli(tmp_path / "stopped", "data.image_size=16", steps=6) == 0  # same command
    a = ckpt.load_checkpoint(ckpt.latest_good(tmp_path / "straight" / "checkpoints"))
    b = ckpt.load_checkpoint(ckpt.latest_good(tmp_path / "stopped" / "checkpoints"))
    assert a.step == b.step == 6
    _equal_dicts(a.model, b.model)
    _equal_dicts(a.ema, b.ema)
    for i, s in a.optimizer["state"].items():
        assert torch.equal(s["exp_avg_sq"], b.optimizer["state"][i]["exp_avg_sq"])
    assert a.state["guard"]["loss"] == b.state["guard"]["loss"]
    assert a.state["resolution_history"] == b.state["resolution_history"]
    kinds = [json.loads(line)["kind"] for line in
             (tmp_path / "stopped" / "incidents.jsonl").read_text().splitlines()]
    assert kinds == ["resolution_change"]  # the resume did not grow (or record) again


# --------------------------------------------------------------------------- bad input


def test_what_cannot_grow_is_refused_with_what_would_be_valid(tmp_path):
    saved = tiny("train.steps=3")
    with pytest.raises(ConfigError, match="image_size 8 is smaller than the checkpoint's 16.*above 16"):
        grow_config(tiny("data.image_size=16"), saved)  # 16 -> 8
    with pytest.raises(ConfigError, match=r"not divisible by 2 = 2\*\*1.*above 8: 10, 12"):
        grow_config(saved, tiny("data.image_size=11"))
    with pytest.raises(ConfigError, match=r"model.unet.attention_resolutions=\[16\].*use \[8\]"):
        grow_config(saved, tiny("data.image_size=16", "model.unet.attention_resolutions=[16]"))
    dit = tiny(*DIT, "model.dit.patch_size=4")
    with pytest.raises(ConfigError, match="not a multiple of the DiT's model.dit.patch_size 4"
                                          ".*above 8: 12, 16, 20, 24"):
        grow_config(dit, tiny(*DIT, "model.dit.patch_size=4", "data.image_size=14"))
    with pytest.raises(ConfigError, match="model.kind unet -> dit"):
        grow_config(saved, tiny(*DIT, "data.image_size=16"))
    lora = ["adapter.kind=lora", "adapter.base=/a/base/run"]
    with pytest.raises(ConfigError, match="adapter run .*frozen base built at "
                                          "data.image_size=8; its size cannot change"):
        grow_config(tiny(*lora), tiny(*lora, "data.image_size=16"))
    assert grow_config(saved, saved) == (saved, [])  # the same size: a plain resume
    # no checkpoint to grow from
    with pytest.raises(ConfigError, match="no checkpoint to continue"):
        steadydiff.train(tiny("data.image_size=16"), out_dir=tmp_path / "new",
                         grow_resolution=True)


# --------------------------------------------------------------------------- data at the new size


def test_fashion_mnist_padded_28_to_32(tmp_path):
    root = make_fashion(tmp_path / "fm")
    native = FashionMNISTDataset(28, root=root).images_at(slice(0, 3))
    padded = FashionMNISTDataset(32, root=root, pad_to=32).images_at(slice(0, 3))
    assert padded.shape == (3, 1, 32, 32)
    assert torch.equal(padded[..., 2:30, 2:30], native)  # the picture, unscaled
    border = torch.ones(3, 1, 32, 32, dtype=torch.bool)
    border[..., 2:30, 2:30] = False
    assert (padded[border] == -1).all()  # background
    small = FashionMNISTDataset(16, root=root, pad_to=32).images_at(slice(0, 3))
    assert small.shape == (3, 1, 16, 16)  # the same framing, averaged down
    with pytest.raises(ConfigError, match="data.pad_to pads Fashion-MNIST"):
        load_config(None, ["data.dataset=digits", "data.pad_to=32"])
