"""A1111-style hypernetworks on a Stable Diffusion UNet's cross-attention (docs/sd.md): the
context transform reaches the model through K and V only, training and exact resume, the
exported safetensors file, sampling at a scale (0 = the base model), the delta guard's
clamp naming the MLP, and the refusals."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("peft")

import steadydiff  # noqa: E402
from steadydiff.config import ConfigError  # noqa: E402
from steadydiff.trainer import checkpoint as ckpt  # noqa: E402

from test_sd import incidents, sd_config, sd_dir, shapes  # noqa: E402,F401

HYPER = ("adapter.kind=hypernetwork", 'adapter.targets=["*"]')


def hyper_config(sd, data, *sets):
    return sd_config(sd, data, *HYPER, *sets)


def test_hypernetwork_changes_only_the_key_value_context(sd_dir, tmp_path):
    from steadydiff.integrations.sd.hypernetwork import HyperKV, add_hypernetwork
    from steadydiff.integrations.sd.tiny import tiny_unet

    unet = tiny_unet(32)
    net, layers = add_hypernetwork(unet, targets=("*",), hidden_mult=2.0, activation="relu")
    assert layers and all(n.endswith("attn2") for n in layers)
    assert list(net.layers) == ["32"]  # one k/v pair per context width, shared
    m = unet.get_submodule(layers[0])
    assert isinstance(m.to_k, HyperKV) and isinstance(m.to_v, HyperKV)
    assert not isinstance(m.to_q, HyperKV)
    assert [k for k in net.a1111_tensors()][:4] == ["32.0.linear.0.weight", "32.0.linear.0.bias",
                                                   "32.0.linear.2.weight", "32.0.linear.2.bias"]
    x, t, c = torch.randn(2, 4, 16, 16), torch.tensor([10, 500]), torch.randn(2, 7, 32)
    seen: dict[str, list[torch.Tensor]] = {"q": [], "k_in": []}
    m.to_q.register_forward_hook(lambda mod, i, o: seen["q"].append(o.clone()) and None)
    m.to_k.base.register_forward_hook(lambda mod, i, o: seen["k_in"].append(i[0].clone())
                                      and None)
    with torch.no_grad():
        base = unet(x, t, encoder_hidden_states=c).sample
        for mlp in net.guarded().values():
            torch.nn.init.normal_(mlp.linears()[-1].weight, std=0.2)
        changed = unet(x, t, encoder_hidden_states=c).sample
        mlp_k = net.layers["32"][0]
        assert torch.equal(seen["k_in"][1], c + mlp_k(c))  # to_k sees c + mlp_k(c)
    assert (changed - base).abs().max() > 1e-4
    # the first cross-attention's queries (the image tokens, before any changed K/V) are
    # the same: the hypernetwork acts through the keys and values only
    assert torch.equal(seen["q"][0], seen["q"][1])
    assert torch.equal(seen["k_in"][0], c)  # untrained: the context itself, exactly
    # scale 0 on every wrapper: the base UNet exactly
    with torch.no_grad():
        for n in layers:
            unet.get_submodule(n).to_k.scale = unet.get_submodule(n).to_v.scale = 0.0
        assert torch.equal(unet(x, t, encoder_hidden_states=c).sample, base)


def test_hypernetwork_trains_resumes_exactly_exports_and_samples_at_a_scale(sd_dir, tmp_path):
    from safetensors import safe_open

    data = shapes(tmp_path / "images")
    cache = tmp_path / "cache"
    fixed = ("optim.schedule=constant", "optim.lr=0.001", f"data.cache_dir={cache}",
             "train.checkpoint_every=2", "adapter.hyper_activation=relu")
    straight = steadydiff.train(hyper_config(sd_dir, data, *fixed, "train.steps=4"),
                                out_dir=tmp_path / "straight")
    steadydiff.train(hyper_config(sd_dir, data, *fixed, "train.steps=2"),
                     out_dir=tmp_path / "resumed")
    resumed = steadydiff.train(hyper_config(sd_dir, data, *fixed, "train.steps=4"),
                               out_dir=tmp_path / "resumed")
    assert resumed.resumed_from is not None and resumed.steps == 4
    a = ckpt.load_checkpoint(straight.checkpoint, "cpu", weights_only=True)
    b = ckpt.load_checkpoint(resumed.checkpoint, "cpu", weights_only=True)
    assert a.model and all(k.startswith("hypernetwork.layers.32.") for k in a.model)
    for k in a.model:
        assert torch.equal(a.model[k], b.model[k]), k
        assert torch.equal(a.ema[k], b.ema[k]), k
    assert a.model["hypernetwork.layers.32.0.linear.2.weight"].abs().max() > 0  # it trained
    info = json.loads((straight.checkpoint / "state.json").read_text())["adapter"]
    assert info["kind"] == "hypernetwork" and info["activation"] == "relu"
    f = tmp_path / "straight" / "hypernetwork" / "hypernetwork.safetensors"
    with safe_open(str(f), "pt") as h:
        meta, keys = h.metadata(), set(h.keys())
    assert meta["layer_structure"] == "[1.0, 2.0, 1.0]" and meta["activation_func"] == "relu"
    assert meta["step"] == "4" and "32.1.linear.2.weight" in keys
    # sampling: scale 0 is the base model exactly, scale 1 differs
    z = torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(0))
    pipe = steadydiff.load(tmp_path / "straight", device="cpu")
    x1, _ = pipe.sample(prompt="a red square", sampler="ddim", steps=2, noise=z)
    pipe.set_adapter_scale(0.0)
    x0, _ = pipe.sample(prompt="a red square", sampler="ddim", steps=2, noise=z)
    from steadydiff.integrations.sd.hypernetwork import HyperKV
    plain = steadydiff.load(tmp_path / "straight", device="cpu")
    for m in list(plain.model.unet.modules()):  # the plain UNet: every wrapper removed
        for leaf in ("to_k", "to_v"):
            if isinstance(getattr(m, leaf, None), HyperKV):
                setattr(m, leaf, getattr(m, leaf).base)
    xb, _ = plain.sample(prompt="a red square", sampler="ddim", steps=2, noise=z)
    assert torch.equal(x0, xb)
    assert (x1 - x0).abs().max() > 1e-5


def test_blown_up_hypernetwork_is_clamped_with_an_incident_naming_the_mlp(sd_dir, tmp_path):
    """Fault injection as for our own models' adapters (tests/test_adapters.py): the last
    layer of the value MLP blown up; the guard after the update rescales it (model and EMA)
    to adapter.max_delta_ratio and records an incident naming it."""
    from steadydiff.integrations.sd.source import resolve_config
    from steadydiff.trainer.loop import attach_guard, build_state

    cfg, _ = resolve_config(hyper_config(sd_dir, tmp_path, "adapter.max_delta_ratio=0.5"))
    state = build_state(cfg, 0, torch.device("cpu"))
    attach_guard(state, tmp_path)
    state.weights.after_update(state)
    assert state.weights.clamps == 0
    name = "hypernetwork.32.v"
    mlp = state.model.hypernetwork.guarded()[name]
    ema = state.ema.module.hypernetwork.guarded()[name]
    with torch.no_grad():
        for m in (mlp, ema):
            m.linears()[-1].weight.normal_(0, 10.0)
    assert float(mlp.delta_ratio()) > 0.5
    state.weights.after_update(state)
    assert float(mlp.delta_ratio()) == pytest.approx(0.5, rel=1e-4)
    assert float(ema.delta_ratio()) == pytest.approx(0.5, rel=1e-4)
    assert state.weights.clamps == 1 and state.weights.max_ratio_module == name
    inc = state.guard.incidents[-1]
    assert inc.kind == "adapter_delta_clamp" and inc.evidence["module"] == name
    rows = [json.loads(ln) for ln in (tmp_path / "incidents.jsonl").read_text().splitlines()]
    assert rows[-1]["action"] == "rescale_delta"


def test_hypernetwork_refusals_name_the_problem(sd_dir, tmp_path):
    from steadydiff.adapters import merge_checkpoint
    from steadydiff.integrations.sd.hypernetwork import add_hypernetwork
    from diffusers import UNet2DConditionModel

    with pytest.raises(ConfigError, match="set adapter.text_encoder=false"):
        hyper_config(sd_dir, tmp_path, "adapter.text_encoder=true")
    with pytest.raises(ConfigError, match="adapter.hyper_activation"):
        sd_config(sd_dir, tmp_path, "adapter.hyper_activation=relu")
    plain = UNet2DConditionModel(sample_size=8, in_channels=4, out_channels=4,
                                 layers_per_block=1, block_out_channels=(32, 64),
                                 down_block_types=("DownBlock2D", "DownBlock2D"),
                                 up_block_types=("UpBlock2D", "UpBlock2D"),
                                 mid_block_type=None, cross_attention_dim=32,
                                 norm_num_groups=8)
    with pytest.raises(ValueError, match="has none .*adapter.kind=lora"):
        add_hypernetwork(plain, targets=("*",), hidden_mult=2.0, activation="linear")
    data = shapes(tmp_path / "images", n=4)
    with pytest.raises(ConfigError, match="match none of the UNet's cross-attention"):
        steadydiff.train(hyper_config(sd_dir, data, 'adapter.targets=["*.to_k"]'),
                         out_dir=tmp_path / "bad")
    steadydiff.train(hyper_config(sd_dir, data, "train.steps=1", "train.checkpoint_every=1"),
                     out_dir=tmp_path / "run")
    with pytest.raises(ValueError, match="cannot be merged into weights"):
        merge_checkpoint(tmp_path / "run", tmp_path / "merged")


def test_every_configurable_activation_has_a_module():
    """adapter.hyper_activation's values (kinds.py) are exactly the activations built."""
    from steadydiff.integrations.sd.hypernetwork import ACTIVATIONS
    from steadydiff.kinds import HYPER_ACTIVATIONS

    assert set(ACTIVATIONS) == set(HYPER_ACTIVATIONS)
