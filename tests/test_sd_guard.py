"""The guard on the Stable Diffusion path, against faults the test's own code puts into the
model folder's weights (never steadydiff's fault injector): a broken base named before
training, a frozen weight corrupted mid-run named and restored from disk, a non-finite text
embedding re-encoded in fp32 before any caption is quarantined, the VAE's fp32 fallback read
from disk, a precision fallback that moves the frozen parts, the peft LoRA's |dW|/|W| guard,
and doctor on an SD run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("peft")

from safetensors.torch import load_file, save_file  # noqa: E402

import steadydiff  # noqa: E402
from steadydiff.config import ConfigError  # noqa: E402
from steadydiff.integrations.sd.tiny import make_tiny_sd  # noqa: E402

from test_sd import incidents, sd_config, shapes  # noqa: E402


@pytest.fixture(scope="module")
def clean_sd(tmp_path_factory) -> Path:
    return make_tiny_sd(tmp_path_factory.mktemp("sdg") / "tiny-sd", image_size=32)


def broken(clean: Path, tmp: Path, part: str, edit) -> Path:
    """A copy of the folder ``clean`` whose ``part`` weights file ``edit(tensors)`` changed
    (the test's own code, as a damaged download would)."""
    out = tmp / f"sd-{part}"
    shutil.copytree(clean, out)
    f = next((out / part).glob("*.safetensors"))
    sd = load_file(f)
    edit(sd)
    save_file(sd, f)
    return out


def first(sd: dict, *words: str) -> str:
    return next(k for k in sorted(sd) if all(w in k for w in words) and sd[k].ndim >= 2)


# --------------------------------------------------------------------------- a broken base


@pytest.mark.parametrize("part, words", [("unet", ("conv_in",)), ("vae", ("encoder",)),
                                         ("text_encoder", ("q_proj",))])
def test_a_broken_base_is_named_before_training(clean_sd, tmp_path, part, words):
    """A NaN in the UNet, the VAE or the text encoder: exit 2 before any step, naming the
    tensor and the file to download again (not the data, not the LR)."""
    def nan(sd):
        sd[first(sd, *words)][0].view(-1)[0] = float("nan")

    root = broken(clean_sd, tmp_path, part, nan)
    data = shapes(tmp_path / "images")
    with pytest.raises(ConfigError) as e:
        steadydiff.train(sd_config(root, data), out_dir=tmp_path / "run")
    msg = str(e.value)
    assert "base model is broken" in msg and f"{root / part}" in msg and ".safetensors" in msg
    assert "NaN" in msg and "learning-rate" in msg
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_broken_controlnet_to_continue_is_named_before_training(clean_sd, tmp_path):
    """controlnet.init_from with a NaN weight: exit 2 naming the tensor, before training."""
    from diffusers import ControlNetModel, UNet2DConditionModel

    from test_controlnet import CN, pairs

    unet = UNet2DConditionModel.from_pretrained(clean_sd / "unet")
    net = ControlNetModel.from_unet(unet, conditioning_embedding_out_channels=(16, 32))
    with torch.no_grad():
        net.controlnet_mid_block.weight.view(-1)[0] = float("nan")
    net.save_pretrained(tmp_path / "cn")
    data = pairs(tmp_path / "images")
    with pytest.raises(ConfigError, match="controlnet.init_from.*controlnet_mid_block.weight"):
        steadydiff.train(sd_config(clean_sd, data, *CN, f"controlnet.init_from={tmp_path / 'cn'}"),
                         out_dir=tmp_path / "run")


# --------------------------------------------------------------------------- a base corrupted mid-run


def corrupt_at(monkeypatch, step: int, name: str, also=None):
    """Wrap the trainer's step: before step ``step`` the test's own code writes a NaN into
    the frozen parameter ``name`` of the live model (a memory fault, a stray in-place
    edit), once; ``also()`` runs then too."""
    from steadydiff.trainer import loop

    real, done = loop.train_step, []

    def step_with_fault(state, batch, *a, **kw):
        if state.step == step and not done:
            done.append(True)
            with torch.no_grad():
                dict(state.model.named_parameters())[name].view(-1)[3] = float("nan")
            if also is not None:
                also()
        return real(state, batch, *a, **kw)

    monkeypatch.setattr(loop, "train_step", step_with_fault)


FROZEN = "unet.conv_in.weight"


TE_FROZEN = "text_encoder.encoder.layers.0.mlp.fc1.weight"


@pytest.mark.parametrize("every, name, file, extra", [
    (1, FROZEN, "unet/diffusion_pytorch_model.safetensors", ()),
    (10, FROZEN, "unet/diffusion_pytorch_model.safetensors", ()),
    # the frozen text encoder that runs in the step (shuffled captions)
    (10, TE_FROZEN, "text_encoder/model.safetensors", ("data.caption_shuffle=true",))])
def test_a_frozen_weight_turned_nan_mid_run_is_restored_from_disk(clean_sd, tmp_path,
                                                                   monkeypatch, every, name,
                                                                   file, extra):
    """A LoRA run whose frozen UNet (or in-step text encoder) weight turns NaN at step 3:
    named as base corruption (never an LR problem), restored from the folder's file, the
    step redone; no rollback, no precision fallback; the run ends finite. Same named cause
    per-step and deferred."""
    corrupt_at(monkeypatch, 3, name)
    data = shapes(tmp_path / "images")
    cfg = sd_config(clean_sd, data, "train.steps=6", "train.checkpoint_every=0",
                    f"guard.check_every={every}", *extra)
    res = steadydiff.train(cfg, out_dir=tmp_path / "run")
    assert res.steps == 6
    rows = incidents(tmp_path / "run")
    kinds = [r["kind"] for r in rows]
    assert "base_corrupt" in kinds, rows
    inc = next(r for r in rows if r["kind"] == "base_corrupt")
    assert inc["action"] == "restore_base" and inc["evidence"]["parameter"] == name
    assert inc["evidence"]["file"].endswith(file)
    assert inc["evidence"]["values"].startswith("1 NaN")  # as seen, before the repair
    assert not {"rollback", "precision_fallback", "abort"} & {r["action"] for r in rows}
    lora = load_file(tmp_path / "run" / "lora" / "pytorch_lora_weights.safetensors")
    assert all(torch.isfinite(v).all() for v in lora.values())


def test_a_base_broken_on_disk_too_stops_naming_the_file(clean_sd, tmp_path, monkeypatch):
    """The same fault, with the folder's file damaged as well: the run stops with the
    diagnosis and the file to download again; the resume advice keeps optim.lr."""
    root = tmp_path / "sd"
    shutil.copytree(clean_sd, root)
    f = root / "unet" / "diffusion_pytorch_model.safetensors"

    def damage():
        sd = load_file(f)
        sd["conv_in.weight"].view(-1)[3] = float("nan")
        save_file(sd, f)

    corrupt_at(monkeypatch, 2, FROZEN, also=damage)
    data = shapes(tmp_path / "images")
    cfg = sd_config(root, data, "train.steps=5", "train.checkpoint_every=0",
                    "optim.lr=0.001")
    with pytest.raises(steadydiff.GuardAbort) as e:
        steadydiff.train(cfg, out_dir=tmp_path / "run")
    assert "base model is corrupt" in str(e.value) and str(f) in str(e.value)
    rows = incidents(tmp_path / "run")
    assert [r["kind"] for r in rows] == ["base_corrupt"] and rows[0]["action"] == "abort"
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["abort"]["lr"] == 0.001  # not lowered: the LR is not the cause


# --------------------------------------------------------------------------- precision fallback


@pytest.mark.parametrize("shuffle", [False, True])
def test_precision_fallback_moves_every_frozen_part_renders_work(clean_sd, tmp_path, shuffle):
    """fp16 -> bf16 (the guard's fallback, as a resumed run applies it too): the frozen
    text encoder (and an fp16 VAE) move with the UNet, so a validation render after it does
    not fail with mixed dtypes (cached captions: the encoder outside the model; shuffled
    captions: inside it)."""
    from steadydiff.trainer import validation
    from steadydiff.trainer.loop import build_state
    from steadydiff.trainer.state import set_precision

    data = shapes(tmp_path / "images")
    cfg = sd_config(clean_sd, data, "train.precision=fp16", "train.allow_slow_precision=true",
                    *(["data.caption_shuffle=true"] if shuffle else []))
    state = build_state(cfg, 0, torch.device("cpu"))
    assert state.media.text_encoder.dtype == torch.float16
    set_precision(state, "bf16")
    assert state.media.text_encoder.dtype == torch.bfloat16
    assert state.media.vae_dtype != torch.float16
    p = validation.Prompt(index=0, prompt="a red square", negative_prompt="a circle", seed=1,
                          cfg_scale=3.0, steps=2, width=32, height=32)
    with validation.sampling_model(state) as model:
        (x, err), = validation.draw(state, model, [p], [1])
    assert err is None and x is not None and torch.isfinite(x).all()


# --------------------------------------------------------------------------- the text path

Y = 123  # the tiny tokenizer's 'y': only in "a yellow ..." captions (2 of the 8 images)


def token_row(value: float):
    def edit(sd):
        k = next(k for k in sd if k.endswith("token_embedding.weight"))
        sd[k][Y] = value
    return edit


def test_a_nan_token_row_quarantines_the_captions_that_use_it(clean_sd, tmp_path):
    """Cached captions, a NaN token-embedding row: tolerated at load (it matters only where
    a caption uses it); those captions are non-finite in fp32 too, so their files are
    quarantined by name with the token to blame; the run trains on the rest."""
    root = broken(clean_sd, tmp_path, "text_encoder", token_row(float("nan")))
    data = shapes(tmp_path / "images")
    res = steadydiff.train(sd_config(root, data, "train.checkpoint_every=0"),
                           out_dir=tmp_path / "run")
    assert res.steps == 4
    rows = incidents(tmp_path / "run")
    fb = [r for r in rows if r["kind"] == "encoder_fallback"]
    assert len(fb) == 1 and fb[0]["evidence"]["part"] == "text_encoder"
    assert fb[0]["evidence"]["quarantined"] == 2 and "'y'" in fb[0]["evidence"]["tokens"][0]
    q = sorted(r["evidence"]["source"] for r in rows if r["kind"] == "sample_quarantined")
    assert [Path(s).name for s in q] == ["img03.png", "img07.png"]  # the yellow ones


@pytest.mark.parametrize("value", [1e5, float("nan")])
def test_an_fp16_text_encoder_falls_back_to_fp32_from_disk(clean_sd, tmp_path, value):
    """model.text_encoder_precision=fp16 with a token row of 1e5 (beyond fp16's range: inf
    when cast): the embedding is non-finite in fp16, finite in fp32 read from the folder,
    so nothing is quarantined; said aloud and recorded as encoder_fallback naming the key
    to set. A NaN row stays non-finite in fp32: quarantined."""
    root = broken(clean_sd, tmp_path, "text_encoder", token_row(value))
    data = shapes(tmp_path / "images")
    res = steadydiff.train(sd_config(root, data, "train.checkpoint_every=0",
                                     "model.text_encoder_precision=fp16"),
                           out_dir=tmp_path / "run")
    assert res.steps == 4
    rows = incidents(tmp_path / "run")
    fb = next(r for r in rows if r["kind"] == "encoder_fallback")
    assert fb["evidence"]["key"] == "model.text_encoder_precision"
    assert fb["evidence"]["dtype"] == "float16" and fb["action"] == "reencode"
    quarantined = [r for r in rows if r["kind"] == "sample_quarantined"]
    if value == 1e5:
        assert fb["evidence"]["quarantined"] == 0 and not quarantined
    else:
        assert fb["evidence"]["quarantined"] == 2 and len(quarantined) == 2


@pytest.mark.parametrize("every", [1, 10])
def test_a_nan_token_row_with_in_step_encoding_drops_the_files(clean_sd, tmp_path, every):
    """Shuffled captions (the frozen encoder runs in the step): the yellow items' loss is
    non-finite; the guard names their files and drops them; the run ends finite. Same
    named cause per-step and deferred."""
    root = broken(clean_sd, tmp_path, "text_encoder", token_row(float("nan")))
    data = shapes(tmp_path / "images")
    res = steadydiff.train(sd_config(root, data, "train.checkpoint_every=0", "train.steps=4",
                                     "data.caption_shuffle=true",
                                     f"guard.check_every={every}"),
                           out_dir=tmp_path / "run")
    assert res.steps == 4
    rows = incidents(tmp_path / "run")
    named = {Path(s["source"]).name for r in rows
             for s in r["evidence"].get("samples", []) if s.get("source")}
    named |= {Path(r["evidence"]["source"]).name for r in rows
              if r["kind"] == "sample_quarantined"}
    assert named and named <= {"img03.png", "img07.png"}, rows
    assert not {"rollback", "precision_fallback", "abort"} & {r["action"] for r in rows}
    lora = load_file(tmp_path / "run" / "lora" / "pytorch_lora_weights.safetensors")
    assert all(torch.isfinite(v).all() for v in lora.values())


# --------------------------------------------------------------------------- the VAE's fallback


def vae_edit(key_words: tuple[str, ...], value: float, everywhere: bool):
    def edit(sd):
        k = next(k for k in sorted(sd) if all(w in k for w in key_words) and k.endswith("weight"))
        if everywhere:
            sd[k].fill_(value)
        else:
            sd[k].view(-1)[0] = value
    return edit


def test_vae_weights_beyond_fp16_train_through_a_true_fp32_encode(clean_sd, tmp_path):
    """A VAE weight of 1e6 (beyond fp16's range: inf in an fp16 VAE, so every fp16 latent is
    NaN): the fallback reads the VAE again from disk in fp32, so every image trains (a cast
    of the fp16 module would be inf too and quarantine them all); said aloud and recorded as
    encoder_fallback with the key to set."""
    root = broken(clean_sd, tmp_path, "vae", vae_edit(("encoder", "conv_in"), 1e6, False))
    data = shapes(tmp_path / "images")
    res = steadydiff.train(sd_config(root, data, "train.checkpoint_every=0",
                                     "model.vae_precision=fp16"), out_dir=tmp_path / "run")
    assert res.steps == 4
    rows = incidents(tmp_path / "run")
    fb = [r for r in rows if r["kind"] == "encoder_fallback"]
    assert len(fb) == 1 and fb[0]["evidence"]["part"] == "vae"
    assert fb[0]["evidence"]["count"] == 8 and fb[0]["evidence"]["key"] == "model.vae_precision"
    assert not [r for r in rows if r["kind"] == "sample_quarantined"]


def test_vae_fp16_overflow_reencodes_exactly_as_fp32(clean_sd, tmp_path):
    """A VAE whose fp16 encode overflows (its encoder.conv_out weights 6e4: representable in fp16,
    the outputs are not): the fallback latents are those of the VAE loaded in fp32 from the
    folder, bit for bit (not the fp16 weights cast up)."""
    from diffusers import AutoencoderKL

    from steadydiff.integrations.sd import setup as sd_setup

    root = broken(clean_sd, tmp_path, "vae", vae_edit(("encoder", "conv_out"), 6e4, True))
    data = shapes(tmp_path / "images")
    cfg = sd_config(root, data, "model.vae_precision=fp16")
    model, weights, media = sd_setup.build(cfg, torch.device("cpu"))
    x = torch.rand(1, 3, 32, 32) * 2 - 1
    assert not torch.isfinite(media.encode_images(x)).all()  # fp16 overflows
    z = media.encode_images(x, torch.float32)
    ref = AutoencoderKL.from_pretrained(root / "vae").eval()
    with torch.no_grad():
        want = ref.encode(x).latent_dist.mean * ref.config.scaling_factor
    assert torch.isfinite(z).all()
    torch.testing.assert_close(z, want, rtol=0, atol=0)


# --------------------------------------------------------------------------- the LoRA's |dW|/|W|


def test_lora_delta_ratio_is_the_true_ratio(clean_sd):
    """The ratio without forming dW equals ‖scaling · B A‖ / ‖W‖ formed explicitly, for a
    Linear and a Conv2d LoRA layer."""
    from diffusers import UNet2DConditionModel

    from steadydiff.integrations.sd.lora_guard import lora_deltas
    from steadydiff.integrations.sd.model import add_lora

    unet = UNet2DConditionModel.from_pretrained(clean_sd / "unet")
    add_lora(unet, rank=4, alpha=8, dropout=0.0, targets=("*.to_q", "*conv1"))
    deltas = lora_deltas(unet)
    assert any("conv1" in n for n in deltas) and any("to_q" in n for n in deltas)
    for name, d in deltas.items():
        layer = d.layer
        with torch.no_grad():
            layer.lora_B["default"].weight.normal_()
            a = layer.lora_A["default"].weight.flatten(1)
            b = layer.lora_B["default"].weight.flatten(1)
            want = (layer.scaling["default"] * b @ a).norm() / layer.base_layer.weight.norm()
        torch.testing.assert_close(d.delta_ratio(), want, rtol=1e-4, atol=0)


@pytest.mark.parametrize("lr, every", [(1.0, 1), (10.0, 10), (1e-4, 1)])
def test_a_lora_at_an_absurd_lr_is_caught(clean_sd, tmp_path, lr, every):
    """lr 1 and 10: the LoRA's |dW|/|W| passes adapter.max_delta_ratio; the layers are
    rescaled and named (adapter_delta_clamp), never a silent "healthy run"; the exported
    LoRA stays within the limit. lr 1e-4 (the documented range): never triggered."""
    from steadydiff.trainer import checkpoint as ckpt

    data = shapes(tmp_path / "images")
    # the spike detectors' warm-up past the run: the delta guard alone is under test
    res = steadydiff.train(sd_config(clean_sd, data, f"optim.lr={lr}", "train.steps=5",
                                     "train.checkpoint_every=0", f"guard.check_every={every}",
                                     "guard.warmup_steps=10"),
                           out_dir=tmp_path / "run")
    rows = [r for r in incidents(tmp_path / "run") if r["kind"] == "adapter_delta_clamp"]
    state = json.loads((res.checkpoint / "state.json").read_text())
    if lr < 1e-3:
        assert not rows and state["adapter"]["max_delta_ratio_seen"] < 0.1
        return
    assert rows and rows[0]["action"] == "rescale_delta" and rows[0]["evidence"]["ratio"] > 1
    assert state["adapter"]["clamps"] >= 1
    c = ckpt.load_checkpoint(res.checkpoint, "cpu", weights_only=True)
    assert all(torch.isfinite(v).all() for v in c.model.values())
    from steadydiff.integrations.sd.lora_guard import lora_deltas  # noqa: F401
    assert "adapter_delta_clamp" in (tmp_path / "run" / "summary.json").read_text()


# --------------------------------------------------------------------------- the hypernetwork's clamp


def test_hypernetwork_clamp_measures_the_real_change_at_a1111_init():
    """At A1111's initialisation (every Linear N(0, 0.01), 768 wide, 1-2-1) the old bound
    (a product of Frobenius norms) was ~10.9 against a limit of 1; the change the MLP
    really makes to the keys' and values' input, ‖mlp(c)‖/‖c‖, is ~0.08."""
    from steadydiff.integrations.sd.hypernetwork import HypernetworkModule

    torch.manual_seed(0)
    m = HypernetworkModule(768, (1.0, 2.0, 1.0), "linear")
    torch.nn.init.normal_(m.linears()[-1].weight, std=0.01)  # A1111's last layer
    assert float(m.gain_bound()) > 10
    c = torch.randn(2, 77, 768) * 5  # CLIP-like scale
    r = float(m.change_ratio(c))
    with torch.no_grad():
        want = float(m(c).norm() / c.norm())
    assert r == pytest.approx(want, rel=1e-5) and 0.03 < r < 0.2
    m.train()
    with torch.no_grad():
        m(c)
    assert float(m.delta_ratio()) == pytest.approx(float(m.change_ratio(c[:1])), rel=1e-5)


def test_hypernetwork_at_the_documented_lr_never_triggers_the_clamp(clean_sd, tmp_path):
    """A healthy hypernetwork run at lr 1e-3 (the tests' and docs' LR; A1111's are lower):
    no adapter_delta_clamp (the old bound rescaled both MLPs at steps 1 and 2)."""
    from test_sd_hypernetwork import HYPER

    data = shapes(tmp_path / "images")
    res = steadydiff.train(sd_config(clean_sd, data, *HYPER, "optim.lr=0.001", "train.steps=6",
                                     "train.checkpoint_every=0", "guard.warmup_steps=10"),
                           out_dir=tmp_path / "run")
    assert res.steps == 6
    assert not [r for r in incidents(tmp_path / "run") if r["kind"] == "adapter_delta_clamp"]
    state = json.loads((res.checkpoint / "state.json").read_text())
    assert 0 < state["adapter"]["max_delta_ratio_seen"] < 0.5


# --------------------------------------------------------------------------- doctor


@pytest.mark.parametrize("family", ["sd", "sdxl"])
def test_doctor_probes_an_sd_run_through_its_vae(tmp_path, family):
    """doctor on an SD / SDXL LoRA run: the probe encodes the run's images through its VAE
    and its captions through its text encoders (4-channel latents and a text condition),
    instead of failing on 3-channel pixels; the activation checks run."""
    from steadydiff.inspect.diagnose import diagnose
    from steadydiff.integrations.sd.tiny import make_tiny

    root = make_tiny(tmp_path / family, family, image_size=32)
    data = shapes(tmp_path / "images")
    steadydiff.train(sd_config(root, data, "train.steps=2"), out_dir=tmp_path / "run")
    d = diagnose(tmp_path / "run")
    assert not [n for n in d.notes if "probe forward pass failed" in n], d.notes
    assert any("encoded by the run's VAE" in n for n in d.notes), d.notes
    assert "fp16_overflow" in d.checks and d.measurements["probe"]["activation_max_abs"]
    assert not [c for c in d.causes if c.check == "data_range"]  # latents are not pixels


# --------------------------------------------------------------------------- rollbacks and checkpoints


@pytest.mark.parametrize("every", [1, 10])
def test_a_rollback_never_goes_behind_a_verified_checkpoint(clean_sd, tmp_path, every):
    """Checkpoints every 2 steps, snapshots every 50: a trainable LoRA weight NaN after the
    update at step 5 rolls back to the step-4 checkpoint's state (the guard learns which
    checkpoints were written), not to step 0."""
    data = shapes(tmp_path / "images")
    lora = "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.lora_B.default.weight"
    fault = {"kind": "param_nan", "step": 5, "target": lora}
    res = steadydiff.train(sd_config(clean_sd, data, "train.steps=7", "guard.snapshot_every=50",
                                     f"guard.check_every={every}", "guard.warmup_steps=10",
                                     f"faults={json.dumps([fault])}"),
                           out_dir=tmp_path / "run")
    assert res.steps == 7
    rows = [r for r in incidents(tmp_path / "run") if r["action"] == "rollback"]
    assert rows and all(r["cost"]["restored_step"] >= 4 for r in rows), rows


def test_the_lr_an_abort_suggests_was_shown_safe(tmp_path):
    """An abort during a long warm-up: the suggested optim.lr is the LR of the last healthy
    (verified) window, not optim.lr x 0.5, which no step ever ran at."""
    from steadydiff.config import load_config
    from steadydiff.guard.guard import GuardAbort

    import test_guard as tg

    cfg = load_config(None, tg.TINY + ["guard.max_rollbacks=1", "train.checkpoint_every=100",
                                       "optim.lr=1e-3", "optim.warmup_steps=100",
                                       f"faults={json.dumps(tg.ABORT_FAULTS)}"])
    with pytest.raises(GuardAbort):
        steadydiff.train(cfg, out_dir=tmp_path / "run")
    point = json.loads((tmp_path / "run" / "summary.json").read_text())["abort"]
    assert point["lr"] < 1e-4 and "last healthy window" in point["lr_why"]
    c = json.loads((Path(point["checkpoint"]) / "state.json").read_text())
    assert point["lr"] == pytest.approx(1e-3 * (c["step"] + 1) / 100, rel=0.2)


@pytest.mark.parametrize("value", [1e5, float("nan")])
def test_in_step_encoding_runs_in_fp32_or_leaves_out_by_token(clean_sd, tmp_path, value):
    """Shuffled captions (the encoder runs in the step), an fp16 text encoder: a token row of
    1e5 (inf in fp16, finite on disk) makes that encoder run in fp32, nothing is left out; a
    NaN row (broken on disk too) leaves out the items whose captions use it, before any
    step, naming the token. Both recorded as encoder_fallback."""
    root = broken(clean_sd, tmp_path, "text_encoder", token_row(value))
    data = shapes(tmp_path / "images")
    res = steadydiff.train(sd_config(root, data, "train.checkpoint_every=0",
                                     "data.caption_shuffle=true",
                                     "model.text_encoder_precision=fp16"),
                           out_dir=tmp_path / "run")
    assert res.steps == 4
    rows = incidents(tmp_path / "run")
    fb = next(r for r in rows if r["kind"] == "encoder_fallback")
    q = sorted(Path(r["evidence"]["source"]).name for r in rows
               if r["kind"] == "sample_quarantined")
    if value == 1e5:
        assert fb["evidence"]["quarantined"] == 0 and not q
    else:
        assert q == ["img03.png", "img07.png"] and "'y'" in fb["evidence"]["tokens"][0]
    assert not {"rollback", "precision_fallback", "abort"} & {r["action"] for r in rows}


def test_finite_mask_names_nan_and_inf_not_huge_finite():
    """The load check's fast path (sums) never misses a NaN/inf and never flags huge finite
    values whose sum overflows."""
    from steadydiff.integrations.sd.frozen import finite_mask

    a, b, c, d = torch.zeros(10), torch.zeros(10), torch.zeros(10), torch.ones(3)
    a[3], b[1], c[:2] = float("nan"), float("-inf"), 3e38
    assert finite_mask([a, b, c, d]) == [False, False, True, True]
