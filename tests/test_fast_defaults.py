"""The fast defaults on CUDA (trainer/speed.py, docs/speed.md): each key validated, each
``auto`` resolved for the device (a CUDA device faked by patching its capability check),
the fused AdamW really built, channels-last equal to NCHW on the CPU, attention that keeps
SDPA's fused kernels, TF32 set, and the lint warning when a CUDA run leaves one off."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import steadydiff
from steadydiff.config import ConfigError, OptimConfig, load_config
from steadydiff.data import DigitsDataset, make_loader
from steadydiff.lint import lint
from steadydiff.models import build_model
from steadydiff.models.layers import Attention
from steadydiff.trainer import loop, precision, speed
from steadydiff.trainer.optim import build_optimizer

from tiny import TINY_MODEL  # noqa: E402  (tests/tiny.py)

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
DIT = ["model.kind=dit", "model.dit.depth=1", "model.dit.hidden_size=32",
       "model.dit.num_heads=2", "model.dit.patch_size=2", "data.image_size=8"]


@pytest.fixture
def gpu(monkeypatch):
    """A faked CUDA device: ``gpu(bf16=True)`` is an Ampere-or-later GPU, False an older one
    (the only capability check the fast defaults make is precision.native_support)."""
    def make(bf16: bool = True) -> torch.device:
        monkeypatch.setattr(precision, "native_support",
                            lambda p, d: p != "bf16" or d.type != "cuda" or bf16)
        return CUDA
    return make


# --------------------------------------------------------------------------- config


def test_defaults_are_auto_and_documented():
    cfg = load_config(None)
    assert (cfg.train.precision, cfg.optim.fused, cfg.train.channels_last,
            cfg.data.pin_memory, cfg.train.tf32) == ("auto", "auto", "auto", "auto", True)
    for section, key in (("train", "precision"), ("optim", "fused"),
                         ("train", "channels_last"), ("data", "pin_memory"), ("train", "tf32")):
        field = type(getattr(cfg, section)).model_fields[key]
        assert "docs/speed.md" in field.description, key


@pytest.mark.parametrize("override, expected", [
    ("optim.fused=maybe", "optim.fused: expected auto, true or false, got 'maybe'"),
    ("train.channels_last=1", "train.channels_last: expected auto, true or false, got 1"),
    ("data.pin_memory=fast", "data.pin_memory: expected auto, true or false"),
    ("train.tf32=auto", "train.tf32: Input should be a valid boolean"),
    ("train.precision=fp8", "'auto', 'fp32', 'bf16' or 'fp16'"),
])
def test_bad_values_name_the_key_and_the_valid_ones(override, expected):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert expected in str(e.value)


def test_switches_take_booleans():
    cfg = load_config(None, ["optim.fused=false", "train.channels_last=true",
                             "data.pin_memory=false", "train.tf32=false"])
    assert (cfg.optim.fused, cfg.train.channels_last, cfg.data.pin_memory,
            cfg.train.tf32) == (False, True, False, False)


# --------------------------------------------------------------------------- resolution


def test_cpu_resolves_to_what_it_trained_before():
    cfg, notes = speed.resolve(load_config(None), CPU)
    assert (cfg.train.precision, cfg.optim.fused, cfg.train.channels_last,
            cfg.data.pin_memory) == ("fp32", True, False, False)
    assert notes == ["train.precision=fp32", "optim.fused=true", "train.channels_last=false",
                     "data.pin_memory=false"]
    assert speed.resolve(cfg, CPU) == (cfg, [])  # idempotent: nothing left to choose


def test_cuda_resolves_to_the_fast_settings(gpu):
    cfg, notes = speed.resolve(load_config(None), gpu(bf16=True))
    assert (cfg.train.precision, cfg.optim.fused, cfg.train.channels_last,
            cfg.data.pin_memory) == ("bf16", True, True, True)
    assert notes == ["train.precision=bf16", "optim.fused=true", "train.channels_last=true",
                     "data.pin_memory=true"]
    older, notes = speed.resolve(load_config(None), gpu(bf16=False))
    assert older.train.precision == "fp16"  # and so the run gets the grad scaler
    assert notes[0] == "train.precision=fp16 (no native bf16 on this GPU; with the grad scaler)"
    assert precision.make_scaler(older.train.precision, CPU) is not None
    dit, _ = speed.resolve(load_config(None, DIT), gpu())
    assert dit.train.channels_last is False  # one convolution: no gain


def test_explicit_settings_are_kept(gpu):
    cfg = load_config(None, ["train.precision=fp32", "optim.fused=false",
                             "train.channels_last=false", "data.pin_memory=false"])
    assert speed.resolve(cfg, gpu()) == (cfg, [])


def test_resolution_validates_the_cross_field_rules(gpu):
    # adapter.base_precision=bf16 needs bf16 autocast: auto passes validation, and resolving
    # it to fp16 on an older GPU is refused like an explicit train.precision=fp16
    raw = ["adapter.kind=lora", "adapter.base=x.safetensors", "adapter.base_precision=bf16"]
    cfg = load_config(None, raw)
    assert speed.resolve(cfg, gpu(bf16=True))[0].train.precision == "bf16"
    with pytest.raises(ConfigError, match="adapter.base_precision=bf16") as e:
        speed.resolve(cfg, gpu(bf16=False))
    assert "the `auto` settings chose train.precision=fp16" in str(e.value)


def test_a_run_prints_its_choices_and_saves_the_resolved_config(tmp_path, monkeypatch, capsys):
    seen = {}

    def spy(*a, **kw):
        seen["pin_memory"] = kw["pin_memory"]
        return make_loader(*a, **kw)

    monkeypatch.setattr(loop, "make_loader", spy)
    run = tmp_path / "run"
    steadydiff.train(load_config(None, TINY_MODEL + [
        "train.steps=1", "train.device=cpu", "train.checkpoint_every=0",
        "logging.report=false", "sample.num=2", "sample.steps=2"]), out_dir=run)
    out = capsys.readouterr().out
    assert ("speed: train.precision=fp32, optim.fused=true, train.channels_last=false, "
            "data.pin_memory=false (auto on cpu; docs/speed.md)") in out
    saved = (run / "config.yaml").read_text()
    conf = yaml.safe_load(saved)  # the `auto` speed settings are saved resolved
    assert (conf["train"]["precision"], conf["optim"]["fused"], conf["train"]["channels_last"],
            conf["data"]["pin_memory"]) == ("fp32", True, False, False)
    state = json.loads(next((run / "checkpoints").glob("step_*/state.json")).read_text())
    assert state["config"]["train"]["channels_last"] is False
    assert seen["pin_memory"] is False  # data.pin_memory reaches the loader


# --------------------------------------------------------------------------- fused AdamW


def test_fused_adamw_is_torchs_fused_kernel():
    model = torch.nn.Linear(4, 4)
    assert build_optimizer(model, OptimConfig()).defaults["fused"] is True  # auto, CPU
    assert build_optimizer(model, OptimConfig(fused=True)).defaults["fused"] is True
    assert not build_optimizer(model, OptimConfig(fused=False)).defaults["fused"]


@pytest.mark.parametrize("fused", [True, False])
def test_fused_adamw_skips_an_inf_step_on_the_device(fused):
    # fused: the scaler hands its inf flag to the kernel (optimizer.found_inf), which skips
    # the update on the device, so step() runs without a host read of the flag; unfused:
    # the scaler reads the flag on the host (a sync) and does not call step() at all
    model = torch.nn.Linear(4, 4)
    opt = build_optimizer(model, OptimConfig(fused=fused))
    calls = []
    opt.register_step_pre_hook(lambda o, a, kw: calls.append(hasattr(o, "found_inf")))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4)
    before = [p.detach().clone() for p in model.parameters()]
    scaler.scale(model(torch.ones(2, 4)).sum() * float("inf")).backward()
    scaler.step(opt)
    assert calls == ([True] if fused else [])
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    if fused:
        assert all(float(s["step"]) == 0 for s in opt.state.values())  # not counted
    scaler.update()
    assert scaler.get_scale() == 2.0 ** 3


def test_fused_and_loop_adamw_agree_to_rounding():
    torch.manual_seed(0)
    a = torch.nn.Linear(16, 16)
    b = torch.nn.Linear(16, 16)
    b.load_state_dict(a.state_dict())
    oa = build_optimizer(a, OptimConfig(fused=True, weight_decay=0.1))
    ob = build_optimizer(b, OptimConfig(fused=False, weight_decay=0.1))
    for i in range(5):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(i))
        for m, o in ((a, oa), (b, ob)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


# --------------------------------------------------------------------------- channels_last


def _steps(overrides: list[str], n: int = 2):
    cfg = load_config(None, TINY_MODEL + ["train.device=cpu", "model.qk_norm=true"]
                      + overrides)
    loop.configure_runtime(cfg, CPU)
    state = loop.build_state(cfg, 10, CPU)
    batches = iter(make_loader(DigitsDataset(8), batch_size=8, seed=0, num_classes=10))
    losses = [float(loop.train_step(state, next(batches)).loss) for _ in range(n)]
    return state, losses


def test_channels_last_trains_the_same_unet_on_the_cpu():
    nhwc, a = _steps(["train.channels_last=true"])
    nchw, b = _steps(["train.channels_last=false"])
    conv = next(m.weight for m in nhwc.model.modules()
                if isinstance(m, torch.nn.Conv2d) and m.in_channels > 1)
    assert conv.is_contiguous(memory_format=torch.channels_last) and not conv.is_contiguous()
    assert a == pytest.approx(b, rel=1e-5)
    for p, q in zip(nhwc.model.parameters(), nchw.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6)


# --------------------------------------------------------------------------- SDPA


def _attention_inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(2, 16, 32, generator=g), torch.randn(2, 5, 12, generator=g)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_attention_calls_sdpa_with_kernel_friendly_inputs(monkeypatch, qk_norm):
    calls = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, *a, **kw):
        calls.append((q, k, v, a, kw))
        return real(q, k, v, *a, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    x, ctx = _attention_inputs()
    for attn, args in ((Attention(32, 2, qk_norm=qk_norm), (x,)),
                       (Attention(32, 2, qk_norm=qk_norm, context_dim=12), (x, ctx))):
        for autocast in (False, True):
            calls.clear()
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]), \
                    torch.autocast("cpu", torch.bfloat16, enabled=autocast):
                attn(*args)  # flash alone: an ineligible call raises
            (q, k, v, a, kw), = calls
            # one dtype, head dim contiguous, no mask and no explicit scale: what the flash
            # and memory-efficient kernels require
            assert q.dtype == k.dtype == v.dtype == (torch.bfloat16 if autocast
                                                     else torch.float32)
            assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
            assert not a and not kw


@pytest.mark.parametrize("qk_norm", [False, True])
def test_models_run_on_the_flash_kernel_alone_on_the_cpu(qk_norm):
    # with every other backend disabled, an ineligible call raises "No available kernel"
    for overrides in (TINY_MODEL, DIT):
        cfg = load_config(None, overrides + [f"model.qk_norm={str(qk_norm).lower()}"])
        model = build_model(cfg.model, image_size=cfg.data.image_size, channels=1)
        x = torch.randn(2, 1, 8, 8)
        y = torch.zeros(2, dtype=torch.long) if cfg.model.num_classes else None
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            ref = model(x, torch.zeros(2), y)
            model.to(memory_format=torch.channels_last)
            out = model(x.to(memory_format=torch.channels_last), torch.zeros(2), y)
            out.square().mean().backward()
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("qk_norm", [False, True])
def test_models_keep_the_fused_kernels_on_cuda_in_bf16(qk_norm):
    for overrides in (TINY_MODEL, DIT):
        cfg = load_config(None, overrides + [f"model.qk_norm={str(qk_norm).lower()}"])
        model = build_model(cfg.model, image_size=cfg.data.image_size, channels=1).cuda()
        model.to(memory_format=torch.channels_last)
        x = torch.randn(4, 1, 8, 8, device="cuda").to(memory_format=torch.channels_last)
        y = torch.zeros(4, dtype=torch.long, device="cuda") if cfg.model.num_classes else None
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]), \
                torch.autocast("cuda", torch.bfloat16):
            out = model(x, torch.zeros(4, device="cuda"), y)
        out.float().square().mean().backward()
        assert torch.isfinite(out).all()


# --------------------------------------------------------------------------- TF32


@pytest.fixture
def restore_backends():
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
             torch.backends.cudnn.benchmark)
    yield
    (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
     torch.backends.cudnn.benchmark) = saved


@pytest.mark.parametrize("tf32", [True, False])
def test_configure_runtime_sets_tf32_on_cuda(restore_backends, tf32):
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = not tf32
    loop.configure_runtime(load_config(None, [f"train.tf32={str(tf32).lower()}"]), CUDA)
    assert torch.backends.cuda.matmul.allow_tf32 is tf32
    assert torch.backends.cudnn.allow_tf32 is tf32
    # the new API reads the same (torch 2.13 raises when the two are mixed and read)
    assert torch.backends.cuda.matmul.fp32_precision == ("tf32" if tf32 else "ieee")


def test_configure_runtime_leaves_tf32_alone_on_the_cpu(restore_backends):
    torch.backends.cuda.matmul.allow_tf32 = False
    loop.configure_runtime(load_config(None), CPU)
    assert torch.backends.cuda.matmul.allow_tf32 is False


# --------------------------------------------------------------------------- lint


def test_a_fast_cuda_run_is_clean(gpu):
    dev = gpu(bf16=True)
    for overrides in ([], DIT):
        cfg = load_config(None, overrides)
        assert lint(cfg, dev) == []
        assert lint(speed.resolve(cfg, dev)[0], dev) == []


@pytest.mark.parametrize("name, overrides, text", [
    ("speed_precision", ["train.precision=fp32"], "set train.precision=bf16"),
    ("speed_tf32", ["train.precision=fp32", "train.tf32=false"], "set train.tf32=true"),
    ("speed_fused", ["optim.fused=false"], "set optim.fused=true"),
    ("speed_channels_last", ["train.channels_last=false"], "set train.channels_last=true"),
])
def test_a_cuda_run_that_leaves_a_speed_up_off_is_warned(gpu, name, overrides, text):
    from steadydiff.lint import CHECKS

    check = next(c.fn for c in CHECKS if c.name == name)
    cfg = load_config(None, overrides)
    msg = check(cfg, gpu(bf16=True))
    assert msg is not None and text in msg and msg in lint(cfg, CUDA)
    assert check(cfg, CPU) is None and check(cfg, None) is None  # CUDA only


def test_speed_warnings_follow_the_hardware_and_the_model(gpu):
    from steadydiff.lint import CHECKS

    by = {c.name: c.fn for c in CHECKS}
    old = gpu(bf16=False)  # no bf16/TF32 tensor cores: fp32 is not a missed speed-up
    fp32 = load_config(None, ["train.precision=fp32", "train.tf32=false"])
    assert by["speed_precision"](fp32, old) is None and by["speed_tf32"](fp32, old) is None
    new = gpu(bf16=True)
    bf16 = load_config(None, ["train.precision=bf16", "train.tf32=false"])
    assert by["speed_tf32"](bf16, new) is None  # the matmuls run in bf16 anyway
    dit = load_config(None, DIT + ["train.channels_last=false"])
    assert by["speed_channels_last"](dit, new) is None  # not a convolutional model


def test_resume_takes_this_runs_adamw_kernel(tmp_path):
    # optim.fused is safe to change on resume: the resumed optimizer uses the new setting,
    # not the saved groups' (which load_state_dict would put back), and trains
    from steadydiff.trainer import checkpoint as ckpt
    from steadydiff.trainer.checkpoint_io import CheckpointIO

    base = TINY_MODEL + ["train.device=cpu", "train.checkpoint_every=0",
                         "logging.report=false", "sample.num=2", "sample.steps=2"]
    run = tmp_path / "run"
    steadydiff.train(load_config(None, base + ["train.steps=2", "optim.fused=false"]),
                     out_dir=run)
    for fused in (True, False):
        cfg = load_config(None, base + ["train.steps=4", f"optim.fused={str(fused).lower()}"])
        state = loop.build_state(cfg, 10, torch.device("cpu"))
        CheckpointIO(state).restore(ckpt.load_checkpoint(ckpt.latest_good(run / "checkpoints")))
        assert all(bool(g.get("fused")) is fused for g in state.optimizer.param_groups)
        batch = next(iter(make_loader(DigitsDataset(8), batch_size=8, seed=0)))
        loop.train_step(state, batch)
        assert state.step == 3
