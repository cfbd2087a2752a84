"""Parameter groups, the LR schedule as a pure function, layer-wise decay, and the EMA."""

import math

import pytest
import torch
from torch import nn

from steadydiff.config import OptimConfig, TrainConfig, load_config
from steadydiff.models import build_model
from steadydiff.trainer.ema import EMA
from steadydiff.trainer.optim import build_optimizer, lr_at, param_groups, set_lr


def small_unet():
    cfg = load_config(None, ["model.unet.channels=8", "model.unet.channel_mult=[1,2]",
                             "model.unet.num_res_blocks=1", "model.unet.attention_resolutions=[4]",
                             "model.unet.head_channels=8", "model.unet.norm_groups=4",
                             "model.num_classes=10"])
    return build_model(cfg.model, image_size=8, channels=1)


def test_no_weight_decay_on_norms_biases_embeddings():
    model = small_unet()
    groups = param_groups(model, OptimConfig(weight_decay=0.1))
    decayed = {n for g in groups if g["weight_decay"] > 0 for n in g["names"]}
    plain = {n for g in groups if g["weight_decay"] == 0 for n in g["names"]}
    assert all(not n.endswith(".bias") and "norm" not in n for n in decayed)
    assert any("norm" in n for n in plain) and any(n.endswith(".bias") for n in plain)
    assert "class_embed.table.weight" in plain
    assert any(n.endswith("conv1.weight") for n in decayed)
    assert decayed | plain == {n for n, _ in model.named_parameters()}


def test_layer_decay_scales_lr_by_depth():
    model = small_unet()
    opt = build_optimizer(model, OptimConfig(lr=1e-3, layer_decay=0.9))
    set_lr(opt, 1e-3)
    by_name = {n: g["lr"] for g in opt.param_groups for n in g["names"]}
    out_lr = by_name["out.conv.weight"]
    stem_lr = by_name["conv_in.weight"]
    assert out_lr == pytest.approx(1e-3)
    assert stem_lr == pytest.approx(1e-3 * 0.9 ** model.max_depth)
    for n, lr in by_name.items():
        assert lr == pytest.approx(1e-3 * 0.9 ** (model.max_depth - model.param_depth(n)))


def test_lr_schedule_is_a_pure_function_of_the_step():
    c = OptimConfig(lr=1.0, warmup_steps=10, schedule="cosine", min_lr_ratio=0.1)
    assert lr_at(0, c, 110) == pytest.approx(0.1)
    assert lr_at(9, c, 110) == pytest.approx(1.0)
    assert lr_at(10, c, 110) == pytest.approx(1.0)
    assert lr_at(60, c, 110) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_at(110, c, 110) == pytest.approx(0.1)
    lrs = [lr_at(s, c, 110) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))  # monotone after warmup
    const = OptimConfig(lr=0.5)
    assert {lr_at(s, const, 100) for s in range(100)} == {0.5}


def test_ema_closed_form_and_warmup():
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    ema = EMA(model, decay=0.9, warmup=False)
    start = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.add_(1.0)
    ema.update(model, step=0)
    # ema = 0.9 * old + 0.1 * new
    assert torch.allclose(ema.module.weight, 0.9 * start + 0.1 * model.weight)
    warm = EMA(model, decay=0.999, warmup=True)
    assert warm.current_decay() == pytest.approx(1 / 10)
    warm.num_updates = 90
    assert warm.current_decay() == pytest.approx(91 / 100)
    assert EMA(model, 0.999, warmup=False).current_decay() == 0.999


def test_ema_copies_before_start_and_is_frozen():
    model = nn.Linear(3, 1)
    ema = EMA(model, decay=0.99, warmup=False, start=5)
    with torch.no_grad():
        model.weight.mul_(3)
    ema.update(model, step=2)
    assert torch.equal(ema.module.weight, model.weight) and ema.num_updates == 0
    assert not any(p.requires_grad for p in ema.module.parameters())
    assert not ema.module.training


def test_ema_not_updated_on_fp16_overflow_skip(tmp_path):
    """With the guard off, a step the grad scaler skips (inf gradients) must not move the EMA."""
    import steadydiff
    from steadydiff.trainer import loop
    from steadydiff.data import DigitsDataset, make_loader

    cfg = load_config(None, [
        "data.image_size=8", "model.unet.channels=8", "model.unet.channel_mult=[1,2]",
        "model.unet.num_res_blocks=1", "model.unet.attention_resolutions=[4]",
        "model.unet.head_channels=8", "model.unet.norm_groups=4", "diffusion.timesteps=100",
        "train.batch_size=4", "train.precision=fp16", "train.allow_slow_precision=true",
        "guard.enabled=false", 'faults=[{"kind": "grad_nan", "step": 1}]'])
    state = loop.build_state(cfg, 0, torch.device("cpu"))
    batches = iter(make_loader(DigitsDataset(8), batch_size=4, seed=0))
    loop.train_step(state, next(batches))
    before = [p.clone() for p in state.ema.module.parameters()]
    n = state.ema.num_updates
    loop.train_step(state, next(batches))  # NaN gradient: the scaler skips the step
    assert state.ema.num_updates == n
    assert all(torch.equal(a, b) for a, b in zip(before, state.ema.module.parameters()))
