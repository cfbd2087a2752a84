"""Model contract tests: every denoiser (UNet, DiT; conditional or not; with or without
QK-norm; plain or wrapped in LoRA or hypernetwork adapters) passes the same suite. Tiny
widths so the file runs in seconds on one CPU thread."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import pytest
import torch
from torch import nn

from steadydiff.adapters import BaseWeights, adapter_modules, base_tensors, tensor_hash
from steadydiff.adapters.core import attach
from steadydiff.config import AdapterConfig, Config, DiTConfig, ModelConfig, UNetConfig
from steadydiff.models import (
    Attention,
    DiT,
    UNet,
    build_model,
    group_norm,
    timestep_embedding,
)

# --------------------------------------------------------------------------- fixtures

TINY_UNET = dict(channels=16, channel_mult=[1, 2], num_res_blocks=1,
                 attention_resolutions=[4], head_channels=8, norm_groups=8)


def unet(num_classes: int, qk_norm: bool, **over) -> UNet:
    return UNet(2, 8, UNetConfig(**{**TINY_UNET, **over}), num_classes=num_classes,
                qk_norm=qk_norm)


def dit(num_classes: int, qk_norm: bool, **over) -> DiT:
    return DiT(2, 8, DiTConfig(preset="tiny", patch_size=2, **over), num_classes=num_classes,
               qk_norm=qk_norm)


class Case(NamedTuple):
    id: str
    make: Callable[[], nn.Module]
    # the parameters that get a gradient at step 0: the zero-initialised output layer's (a
    # plain model), or the adapter's zero-initialised half of it (a wrapped one)
    first_grads: tuple[str, ...]
    # a wrapped model: the plain model its base tensors load into (None: it is plain)
    plain: Callable[[], nn.Module] | None = None


def adapted(make_plain: Callable[[], nn.Module], kind: str) -> nn.Module:
    """An adapter-wrapped model built the way the trainer builds it (AdapterRun.prepare ->
    adapters.attach): a fresh model, the base weights loaded into it (every key and shape
    checked), frozen, then the adapters injected. The base is a perturbed copy of the plain
    model, standing for the trained checkpoint a fine-tune starts from: a freshly initialised
    base outputs exactly 0, and no adapter on it could receive a gradient."""
    sd = {k: v.clone() for k, v in perturb(make_plain(), seed=3).state_dict().items()}
    model = make_plain()
    cfg = Config(adapter=AdapterConfig(kind=kind, base="(in memory)", rank=2))
    attach(model, cfg, BaseWeights(sd, "(in memory)", "test", tensor_hash(sd)),
           dtype=torch.float32)
    return model


UNET_OUT = ("out.conv.weight", "out.conv.bias")
DIT_OUT = ("final_layer.linear.weight", "final_layer.linear.bias")
CASES: list[Case] = [
    Case("unet-uncond", lambda: unet(0, False), UNET_OUT),
    Case("unet-uncond-qk", lambda: unet(0, True), UNET_OUT),
    Case("unet-cond", lambda: unet(5, False), UNET_OUT),
    Case("unet-cond-qk", lambda: unet(5, True), UNET_OUT),
    Case("dit-uncond", lambda: dit(0, False), DIT_OUT),
    Case("dit-cond-qk", lambda: dit(5, True), DIT_OUT),
    # adapter-wrapped: the same denoiser contract (docs/adapters.md)
    Case("unet-cond-lora", lambda: adapted(lambda: unet(5, False), "lora"),
         ("out.conv.lora_B.weight",), lambda: unet(5, False)),
    Case("dit-cond-qk-lora", lambda: adapted(lambda: dit(5, True), "lora"),
         ("final_layer.linear.lora_B.weight",), lambda: dit(5, True)),
    Case("unet-cond-hyper", lambda: adapted(lambda: unet(5, False), "hypernetwork"),
         ("mid.attn.attn.qkv.hyper_k.fc2.weight", "mid.attn.attn.qkv.hyper_v.fc2.bias"),
         lambda: unet(5, False)),
    Case("dit-uncond-hyper", lambda: adapted(lambda: dit(0, False), "hypernetwork"),
         ("blocks.3.attn.qkv.hyper_k.fc2.weight", "blocks.3.attn.qkv.hyper_v.fc2.bias"),
         lambda: dit(0, False)),
]
IDS = [c.id for c in CASES]


@pytest.fixture(params=CASES, ids=IDS)
def case(request) -> Case:
    return request.param


def inputs(model: nn.Module, n: int = 3, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, model.in_channels, model.image_size, model.image_size, generator=g)
    t = torch.rand(n, generator=g) * 999.0  # continuous timesteps
    y = (torch.randint(0, model.num_classes + 1, (n,), generator=g)
         if model.num_classes else None)
    return x, t, y


def perturb(model: nn.Module, std: float = 0.05, seed: int = 2) -> nn.Module:
    """Move every parameter off its init, so zero-initialised paths carry signal."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * std)
    return model


def within_delta_limit(model: nn.Module, limit: float = 1.0) -> nn.Module:
    """Shrink each adapter whose |dW|/|W| exceeds ``limit`` back to it, as the adapter guard
    does in training (adapter.max_delta_ratio, default 1). A perturbation of std 0.2 gives
    a hypernetwork's MLPs a gain bound of 1e2 (UNet) to 1.5e3 (DiT, width 128): keys that
    far from their base, an attention no trained adapter reaches (the guard rescales it
    after the first such update), and the SDPA and probe paths then differ by 1.1e-4
    relative, past this test's 1e-4. A plain model passes through unchanged."""
    for m in adapter_modules(model).values():
        r = float(m.delta_ratio())
        if r > limit:
            m.shrink(limit / r)
    return model


def attention_modules(model: nn.Module) -> list[Attention]:
    return [m for m in model.modules() if isinstance(m, Attention)]


# --------------------------------------------------------------------------- contract


def test_shape_dtype_and_zero_output_at_init(case):
    model = case.make()
    x, t, y = inputs(model)
    out = model(x, t, y)
    assert out.shape == x.shape and out.dtype == x.dtype
    if case.plain is None:
        # Zero-initialised output layer: the untrained model predicts exactly 0.
        assert torch.count_nonzero(out) == 0
    else:
        # Zero-initialised adapter: the untrained wrapped model is its base, bit for bit.
        assert adapter_modules(model)
        plain = case.plain()
        plain.load_state_dict(base_tensors(model))
        assert torch.count_nonzero(out) > 0 and torch.equal(out, plain(x, t, y))
    for attr in ("num_classes", "in_channels", "image_size", "max_depth"):
        assert hasattr(model, attr)


def test_deterministic_under_seed(case):
    make = case.make
    torch.manual_seed(123)
    a = perturb(make())
    torch.manual_seed(123)
    b = perturb(make())
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb and torch.equal(pa, pb), na
    x, t, y = inputs(a)
    assert torch.equal(a(x, t, y), b(x, t, y))
    assert torch.equal(a(x, t, y), a(x, t, y))


def test_gradients_reach_every_parameter(case):
    """Every trainable parameter gets a gradient; a wrapped model's frozen base gets none."""
    model = case.make()
    x, t, y = inputs(model, n=4)
    target = torch.randn_like(x)
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    assert bool(frozen) == (case.plain is not None)  # a plain model trains everything

    # Step 0: only the zero-initialised output layer (a wrapped model: the zero half of
    # each adapter, B / the MLPs' last layer) can receive gradient.
    loss = (model(x, t, y) - target).square().mean()
    loss.backward()
    for name in case.first_grads:
        assert params[name].grad is not None and params[name].grad.abs().sum() > 0, name

    # A few plain SGD steps move the zero-initialised layers (output, then residual
    # branches / adaLN gates / the adapters' other half), after which every trainable
    # parameter must get a gradient.
    opt = torch.optim.SGD(params.values(), lr=0.5)
    for _ in range(3):
        opt.step()
        opt.zero_grad()
        (model(x, t, y) - target).square().mean().backward()
    dead = [n for n, p in params.items() if p.grad is None or p.grad.abs().sum() == 0]
    assert not dead, f"parameters without gradient: {dead}"
    assert all(torch.isfinite(p.grad).all() for p in params.values())
    for n, p in model.named_parameters():
        if n in frozen:
            assert p.grad is None and torch.equal(p, frozen[n]), n


def test_null_class_and_label_errors(case):
    model = perturb(case.make())
    x, t, _ = inputs(model)
    if model.num_classes == 0:
        with pytest.raises(ValueError, match="unconditional"):
            model(x, t, torch.zeros(x.shape[0], dtype=torch.long))
        return
    null = torch.full((x.shape[0],), model.num_classes, dtype=torch.long)
    assert torch.equal(model(x, t), model(x, t, null))  # y=None means the null class
    # The label must matter once the model is off its init.
    assert not torch.allclose(model(x, t, torch.zeros_like(null)), model(x, t, null))


def test_forward_shape_errors(case):
    model = case.make()
    c, s = model.in_channels, model.image_size
    with pytest.raises(ValueError, match=rf"\(N, {c}, {s}, {s}\), got \(2, {c + 1}, {s}, {s}\)"):
        model(torch.randn(2, c + 1, s, s), torch.zeros(2))
    with pytest.raises(ValueError, match=rf"got \(2, {c}, {s * 2}, {s * 2}\)"):
        model(torch.randn(2, c, 2 * s, 2 * s), torch.zeros(2))
    with pytest.raises(ValueError, match=r"t of shape \(2,\)"):
        model(torch.randn(2, c, s, s), torch.zeros(3))


def test_param_depth_covers_every_parameter(case):
    model = case.make()
    depths = {n: model.param_depth(n) for n, _ in model.named_parameters()}
    assert all(0 <= d <= model.max_depth for d in depths.values())
    if case.plain is None:
        assert {depths[n] for n in case.first_grads} == {model.max_depth}
    else:
        # an adapter's parameters (and its frozen base layer's) sit at the depth of the
        # layer it adapts, so layer-wise LR decay treats a fine-tune like its base
        plain = case.plain()
        assert model.max_depth == plain.max_depth
        for n, d in depths.items():
            assert d == plain.param_depth(plain_name(n)), n
    assert min(depths.values()) == 0
    # Every depth in between is used (no gaps in the decay ladder).
    assert set(depths.values()) == set(range(model.max_depth + 1))
    # Wrapper prefixes (DDP, torch.compile) are understood; unknown names are errors.
    name = next(n for n, d in depths.items() if d == model.max_depth)
    assert model.param_depth("module._orig_mod." + name) == model.max_depth
    with pytest.raises(KeyError):
        model.param_depth("no.such.param")


def plain_name(name: str) -> str:
    """A wrapped model's parameter -> the plain model's parameter of the layer it adapts:
    ``m.base.bias`` -> ``m.bias``; ``m.lora_A.weight``, ``m.hyper_k.fc1.bias`` -> ``m.weight``."""
    if ".base." in name:
        return name.replace(".base.", ".", 1)
    for tag in (".lora_", ".hyper_"):
        if tag in name:
            return name.split(tag)[0] + ".weight"
    return name


def test_param_depth_order():
    u = unet(5, False)
    assert u.param_depth("conv_in.weight") == u.param_depth("time_embed.mlp.0.weight") == 0
    assert u.param_depth("class_embed.table.weight") == 0
    order = ["down.0.res.0.conv1.weight", "down.0.downsample.conv.weight",
             "down.1.res.0.conv1.weight", "mid.res.0.conv1.weight", "mid.res.1.conv1.weight",
             "up.1.res.0.conv1.weight", "up.1.upsample.conv.weight", "up.0.res.0.conv1.weight",
             "up.0.res.1.conv1.weight", "out.conv.weight"]
    ds = [u.param_depth(n) for n in order]
    assert ds == sorted(ds) and len(set(ds)) == len(ds)
    assert u.param_depth("down.1.attn.0.attn.qkv.weight") == u.param_depth(
        "down.1.res.0.conv1.weight")
    d = dit(5, False)
    assert d.max_depth == 5
    assert [d.param_depth(f"blocks.{i}.attn.qkv.weight") for i in range(4)] == [1, 2, 3, 4]
    assert d.param_depth("y_embedder.table.weight") == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast(case, dtype):
    model = perturb(case.make())
    x, t, y = inputs(model)
    ref = model(x, t, y)
    with torch.autocast("cpu", dtype=dtype):
        out = model(x, t, y)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    assert (out - ref).abs().max() < 0.1 * ref.abs().max() + 1e-3


# --------------------------------------------------------------------------- attention probe


def explicit_stats(attn: Attention, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Attention statistics written out independently of the module's probe path."""
    n, length, d = x.shape
    h, dh = attn.num_heads, attn.head_dim
    q, k, _ = attn.qkv(x).split(d, dim=-1)
    q = attn.q_norm(q.reshape(n, length, h, dh)).transpose(1, 2)
    k = attn.k_norm(k.reshape(n, length, h, dh)).transpose(1, 2)
    logits = torch.einsum("nhqd,nhkd->nhqk", q, k) / math.sqrt(dh)
    p = torch.softmax(logits, dim=-1)
    ent = -(p * torch.log(p.clamp_min(1e-30))).sum(-1).mean()
    return {"max_logit": logits.max(), "entropy": ent}


def test_probe_matches_explicit_and_sdpa(case):
    model = within_delta_limit(perturb(case.make(), std=0.2))
    x, t, y = inputs(model)
    attns = attention_modules(model)
    assert attns, "every model here has attention"
    seen: dict[Attention, torch.Tensor] = {}
    hooks = [a.register_forward_pre_hook(lambda m, args: seen.__setitem__(m, args[0]))
             for a in attns]
    with torch.no_grad():
        fast = model(x, t, y)
        for a in attns:
            a.probe = True
        probed = model(x, t, y)
    for hk in hooks:
        hk.remove()
    torch.testing.assert_close(probed, fast, atol=1e-5, rtol=1e-4)
    for a in attns:
        want = explicit_stats(a, seen[a])
        got = a.last_stats
        assert got is not None and set(got) == {"max_logit", "entropy"}
        for key in got:
            assert got[key].ndim == 0 and not got[key].requires_grad
            torch.testing.assert_close(got[key], want[key], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_attention_probe_standalone(qk_norm):
    attn = Attention(32, 4, qk_norm=qk_norm, eps=1e-6)
    x = torch.randn(2, 10, 32, requires_grad=True)
    fast = attn(x)
    attn.probe = True
    probed = attn(x)
    torch.testing.assert_close(probed, fast, atol=1e-5, rtol=1e-4)
    probed.sum().backward()  # the probe path is differentiable too
    want = explicit_stats(attn, x.detach())
    torch.testing.assert_close(attn.last_stats["entropy"], want["entropy"])
    torch.testing.assert_close(attn.last_stats["max_logit"], want["max_logit"])
    # Entropy is bounded by that of a uniform row, log(L).
    assert 0 <= attn.last_stats["entropy"] <= math.log(10) + 1e-5
    # Probe under autocast: stats stay float32.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        attn(x)
    assert attn.last_stats["max_logit"].dtype == torch.float32


def test_qk_norm_bounds_logits():
    # Scaling the inputs blows up logits without QK-norm; with it they stay put.
    torch.manual_seed(0)
    x = torch.randn(1, 16, 32)
    for qk_norm, grows in ((False, True), (True, False)):
        attn = Attention(32, 4, qk_norm=qk_norm)
        attn.probe = True
        attn(x)
        small = attn.last_stats["max_logit"]
        attn(100 * x)
        big = attn.last_stats["max_logit"]
        assert (big > 100 * small) == grows


# --------------------------------------------------------------------------- layers


def test_timestep_embedding():
    t = torch.tensor([0.0, 437.0, 437.25, 999.0])
    e = timestep_embedding(t, 64)
    assert e.shape == (4, 64) and e.dtype == torch.float32
    torch.testing.assert_close(e[0], torch.cat([torch.ones(32), torch.zeros(32)]))
    assert not torch.allclose(e[1], e[2])  # fractional timesteps resolve
    assert timestep_embedding(t.to(torch.bfloat16), 64).dtype == torch.float32
    odd = timestep_embedding(t, 7)
    assert odd.shape == (4, 7) and torch.all(odd[:, -1] == 0)
    # cos/sin halves: each frequency pair lies on the unit circle.
    torch.testing.assert_close(e[:, :32] ** 2 + e[:, 32:] ** 2, torch.ones(4, 32))


def test_group_norm_message():
    assert isinstance(group_norm(48, 16, 1e-5, "x"), nn.GroupNorm)
    with pytest.raises(ValueError) as err:
        group_norm(48, 32, 1e-5, "down.1.res.0.norm1")
    msg = str(err.value)
    assert msg.startswith("down.1.res.0.norm1: 48 channels are not divisible by norm_groups=32")
    assert "choose norm_groups dividing 48" in msg and "24" in msg


# --------------------------------------------------------------------------- build-time errors


def test_unet_build_errors():
    with pytest.raises(ValueError, match=r"image_size 18 is not divisible by 4 = 2\*\*2 "
                                         r"down-samplings \(channel_mult has 3 levels\); "
                                         r"use a multiple of 4"):
        UNet(1, 18, UNetConfig(**{**TINY_UNET, "channel_mult": [1, 2, 2]}))
    with pytest.raises(ValueError, match=r"attention_resolutions \[3\] never occur.*\[8, 4\]"):
        unet(0, False, attention_resolutions=[4, 3])
    with pytest.raises(ValueError, match=r"32 channels are not divisible by head_channels=12"):
        unet(0, False, head_channels=12)
    with pytest.raises(ValueError,
                       match=r"down\.0\.res\.0\.norm1: 24 channels are not divisible by "
                             r"norm_groups=16"):
        unet(0, False, channels=24, norm_groups=16, head_channels=8)


def test_dit_build_errors():
    with pytest.raises(ValueError, match="image_size 10 is not divisible by patch_size 4"):
        DiT(1, 10, DiTConfig(preset="tiny", patch_size=4))
    with pytest.raises(ValueError, match="hidden_size 128 is not divisible by num_heads 3"):
        DiT(1, 8, DiTConfig(preset="tiny", num_heads=3))


def test_dit_presets_and_overrides():
    m = dit(0, False, depth=2, hidden_size=64, num_heads=2)
    assert (m.depth, m.hidden_size, m.num_heads) == (2, 64, 2)
    assert m.pos_embed.shape == (1, 16, 64) and not m.pos_embed.requires_grad
    assert "pos_embed" not in m.state_dict()  # fixed, recomputed from the shape


@pytest.mark.parametrize("preset,paper", [("S", 33e6), ("B", 130e6)])
def test_dit_param_count_matches_paper(preset, paper):
    # Peebles & Xie 2023, table 1 (256px latents = 32x32x4, patch 2, 1000 classes).
    with torch.device("meta"):
        m = DiT(4, 32, DiTConfig(preset=preset, patch_size=2), num_classes=1000)
    count = sum(p.numel() for p in m.parameters())
    assert abs(count - paper) / paper < 0.05, count


def test_build_model_dispatch():
    cfg = ModelConfig(kind="unet", num_classes=3, unet=UNetConfig(**TINY_UNET))
    m = build_model(cfg, image_size=8, channels=1)
    assert isinstance(m, UNet) and m.num_classes == 3 and m.in_channels == 1
    cfg = ModelConfig(kind="dit", qk_norm=True, dit=DiTConfig(preset="tiny", depth=1))
    m = build_model(cfg, image_size=8, channels=3)
    assert isinstance(m, DiT) and m.image_size == 8 and m.num_classes == 0
    assert isinstance(m.blocks[0].attn.q_norm, nn.LayerNorm)
