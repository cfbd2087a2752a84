"""LoRA files in the kohya/A1111 format (lora_files.py): names, bit-exact round trips,
diffusers' loader reading what we write, SDXL's sgm names, and bad files refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("peft")

from safetensors.torch import load_file, save_file  # noqa: E402

from steadydiff.integrations.sd import lora_files as lf  # noqa: E402
from steadydiff.integrations.sd.model import TEXT_ENCODER_TARGETS, add_lora, save_lora  # noqa: E402
from steadydiff.integrations.sd.tiny import make_tiny_sd, tiny_text_encoder, tiny_unet  # noqa: E402

ATTN = ("*.to_q", "*.to_k", "*.to_v", "*.to_out.0")


def lora_pair(seed: int = 0, rank: int = 4, alpha: float = 2.0, targets=ATTN):
    """A tiny UNet and text encoder with LoRAs whose B is random (not the zero init)."""
    torch.manual_seed(seed)
    unet, te = tiny_unet(), tiny_text_encoder()
    add_lora(unet, rank=rank, alpha=alpha, dropout=0.0, targets=targets)
    add_lora(te, rank=rank, alpha=alpha, dropout=0.0, targets=TEXT_ENCODER_TARGETS)
    with torch.no_grad():
        for m in (unet, te):
            for n, p in m.named_parameters():
                if "lora_" in n:
                    p.copy_(torch.randn_like(p))
    return unet, te


def fresh(rank: int = 4, alpha: float = 2.0):
    unet, te = tiny_unet(), tiny_text_encoder()
    add_lora(unet, rank=rank, alpha=alpha, dropout=0.0, targets=ATTN)
    add_lora(te, rank=rank, alpha=alpha, dropout=0.0, targets=TEXT_ENCODER_TARGETS)
    return unet, te


def test_sd1_names_are_the_diffusers_paths_and_metadata_is_written(tmp_path):
    unet, te = lora_pair()
    f = lf.save_kohya(tmp_path / "x.safetensors", unet, [te], {"ss_steps": 7})
    sd = load_file(f)
    assert "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q.lora_down.weight" in sd
    assert "lora_unet_up_blocks_1_attentions_0_transformer_blocks_0_attn2_to_out_0.alpha" in sd
    assert "lora_te_text_model_encoder_layers_0_self_attn_q_proj.lora_up.weight" in sd
    assert float(sd["lora_te_text_model_encoder_layers_1_self_attn_v_proj.alpha"]) == 2.0
    meta = lf.read_lora_file(f).metadata
    assert meta["ss_network_module"] == "networks.lora"
    assert (meta["ss_network_dim"], meta["ss_network_alpha"]) == ("4", "2")
    assert meta["ss_base_model_version"] == "sd_v1" and meta["ss_steps"] == "7"
    assert len(meta["sshs_model_hash"]) == 64
    assert not list(tmp_path.glob(".*tmp"))  # the temporary file was renamed


def test_kohya_round_trip_keeps_every_tensor_bit_exact(tmp_path):
    unet, te = lora_pair()
    a = lf.save_kohya(tmp_path / "a.safetensors", unet, [te])
    u2, t2 = fresh()
    got = lf.load_lora_file(a, u2, [t2], rank=4, alpha=2.0)
    assert got == {"loaded": len(load_file(a)) // 3, "fresh": 0}
    b = lf.save_kohya(tmp_path / "b.safetensors", u2, [t2])
    sa, sb = load_file(a), load_file(b)
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    assert lf.read_lora_file(a).metadata["sshs_model_hash"] == \
        lf.read_lora_file(b).metadata["sshs_model_hash"]


def test_diffusers_round_trip_keeps_every_tensor(tmp_path):
    """alpha (8) != rank (4) is folded into the up weights (metadata alpha = rank, what
    diffusers < 0.34 assumes); loading rescales to the run's alpha: the same delta."""
    unet, te = lora_pair(alpha=8.0)
    f = save_lora(unet, tmp_path / "d", te, format="diffusers")
    meta = json.loads(lf.read_lora_file(f).metadata["lora_adapter_metadata"])
    assert meta["unet.lora_alpha"] == meta["unet.r"] == 4
    sd = load_file(f)
    up = "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.lora.up.weight"
    ours = unet.down_blocks[0].attentions[0].transformer_blocks[0].attn1.to_q.lora_B["default"]
    assert torch.equal(sd[up], ours.weight * 2.0)
    assert any(k.startswith("text_encoder.text_model.encoder.layers.") for k in sd)
    for alpha in (8.0, 4.0, 2.0):  # the run's alpha: each loads the same delta
        u2, t2 = fresh(alpha=alpha)
        lf.load_lora_file(tmp_path / "d", u2, [t2], rank=4, alpha=alpha)  # the folder
        for a, b in ((unet, u2), (te, t2)):
            la, lb = lf._lora_layers(a), lf._lora_layers(b)
            assert la.keys() == lb.keys() and la
            for n in la:
                da = la[n].lora_B["default"].weight @ la[n].lora_A["default"].weight * 2.0
                db = lb[n].lora_B["default"].weight @ lb[n].lora_A["default"].weight * alpha / 4
                torch.testing.assert_close(da, db, rtol=1e-6, atol=1e-6)
    u2, t2 = fresh(alpha=8.0)
    lf.load_lora_file(f, u2, [t2], rank=4, alpha=8.0)
    g = save_lora(u2, tmp_path / "e", t2, format="diffusers")
    sa, sb = load_file(f), load_file(g)
    assert sa.keys() == sb.keys() and len(sa) > 0
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], rtol=1e-6, atol=0)


def test_diffusers_pipeline_draws_the_same_with_the_kohya_file(tmp_path):
    """pipe.load_lora_weights reads our kohya file (through diffusers' own kohya
    conversion) and the pipeline then draws what it draws with our diffusers file; alpha
    (2) differs from the rank (4), so a lost alpha shows."""
    from diffusers import StableDiffusionPipeline

    sd = make_tiny_sd(tmp_path / "sd", image_size=32)
    pipe = StableDiffusionPipeline.from_pretrained(sd, local_files_only=True,
                                                   safety_checker=None)
    pipe.set_progress_bar_config(disable=True)
    torch.manual_seed(0)
    add_lora(pipe.unet, rank=4, alpha=2.0, dropout=0.0, targets=ATTN)
    add_lora(pipe.text_encoder, rank=4, alpha=2.0, dropout=0.0, targets=TEXT_ENCODER_TARGETS)
    with torch.no_grad():
        for m in (pipe.unet, pipe.text_encoder):
            for n, p in m.named_parameters():
                if "lora_B" in n:
                    p.copy_(torch.randn_like(p) * 0.3)
    save_lora(pipe.unet, tmp_path / "out", pipe.text_encoder, format="both", kohya_name="k")
    z = torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(1))
    images = {}
    for name in ("pytorch_lora_weights.safetensors", "k.safetensors", None):
        p = StableDiffusionPipeline.from_pretrained(sd, local_files_only=True,
                                                    safety_checker=None)
        p.set_progress_bar_config(disable=True)
        if name:
            p.load_lora_weights(tmp_path / "out", weight_name=name)
        images[name] = p("a red square", num_inference_steps=2, guidance_scale=3.0,
                         latents=z.clone(), output_type="pt").images
    assert (images["k.safetensors"] - images[None]).abs().max() > 1e-3
    torch.testing.assert_close(images["k.safetensors"],
                               images["pytorch_lora_weights.safetensors"], atol=1e-5, rtol=0)


def tiny_sdxl_unet():
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(
        sample_size=16, in_channels=4, out_channels=4, layers_per_block=2,
        block_out_channels=(16, 32, 32),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        transformer_layers_per_block=(1, 1, 2), cross_attention_dim=48, attention_head_dim=8,
        norm_num_groups=8, use_linear_projection=True, addition_embed_type="text_time",
        addition_time_embed_dim=8, projection_class_embeddings_input_dim=48 + 6 * 8)


def test_sdxl_names_are_the_sgm_unets_and_diffusers_maps_them_back(tmp_path):
    from diffusers.loaders.lora_conversion_utils import (
        _convert_non_diffusers_lora_to_diffusers, _maybe_map_sgm_blocks_to_diffusers)

    torch.manual_seed(0)
    unet = tiny_sdxl_unet()
    te1, te2 = tiny_text_encoder(), tiny_text_encoder(seed=1)
    add_lora(unet, rank=2, alpha=1.0, dropout=0.0,
             targets=ATTN + ("*.proj_in", "*.proj_out", "*.ff.net.0.proj", "*.ff.net.2"))
    for te in (te1, te2):
        add_lora(te, rank=2, alpha=1.0, dropout=0.0, targets=TEXT_ENCODER_TARGETS)
    names = lf.kohya_names(unet, [te1, te2])
    for k in ("lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q",
              "lora_unet_input_blocks_8_1_transformer_blocks_1_attn2_to_out_0",
              "lora_unet_middle_block_1_proj_in",
              "lora_unet_output_blocks_0_1_transformer_blocks_0_ff_net_0_proj",
              "lora_unet_output_blocks_5_1_proj_out",
              "lora_te1_text_model_encoder_layers_0_self_attn_q_proj",
              "lora_te2_text_model_encoder_layers_1_self_attn_out_proj"):
        assert k in names, (k, sorted(names)[:5])
    assert not any("down_blocks" in k or "up_blocks" in k for k in names)
    f = lf.save_kohya(tmp_path / "xl.safetensors", unet, [te1, te2])
    assert lf.read_lora_file(f).metadata["ss_base_model_version"] == "sdxl_base_v1-0"
    # diffusers' own SDXL loader path: sgm blocks -> diffusers blocks -> module paths
    sd = _maybe_map_sgm_blocks_to_diffusers(load_file(f), unet.config)
    conv, _ = _convert_non_diffusers_lora_to_diffusers(sd)
    theirs = {k[len("unet."):].split(".lora")[0].split("_lora")[0].replace(".processor", "")
              for k in conv if k.startswith("unet.") and "down" in k}
    ours = {path.rsplit(".to_out.0", 1)[0] + ".to_out" if path.endswith("to_out.0") else path
            for k, (_, path) in names.items() if k.startswith("lora_unet_")}
    theirs = {p.replace("to_out.0", "to_out") for p in theirs}
    assert theirs == ours
    # and back into a fresh SDXL-shaped model, bit-exact
    u2 = tiny_sdxl_unet()
    add_lora(u2, rank=2, alpha=1.0, dropout=0.0,
             targets=ATTN + ("*.proj_in", "*.proj_out", "*.ff.net.0.proj", "*.ff.net.2"))
    t21, t22 = tiny_text_encoder(), tiny_text_encoder()
    for te in (t21, t22):
        add_lora(te, rank=2, alpha=1.0, dropout=0.0, targets=TEXT_ENCODER_TARGETS)
    lf.load_lora_file(f, u2, [t21, t22], rank=2, alpha=1.0)
    a, b = lf.kohya_state_dict(unet, [te1, te2]), lf.kohya_state_dict(u2, [t21, t22])
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_sgm_paths_of_resnets_and_samplers():
    c = tiny_sdxl_unet().config
    assert lf.sgm_path("conv_in", c) == "input_blocks.0.0"
    assert lf.sgm_path("down_blocks.0.resnets.1.conv1", c) == "input_blocks.2.0.in_layers.2"
    assert lf.sgm_path("down_blocks.0.downsamplers.0.conv", c) == "input_blocks.3.0.op"
    assert lf.sgm_path("down_blocks.1.resnets.0.conv_shortcut", c) == "input_blocks.4.0.skip_connection"
    assert lf.sgm_path("mid_block.resnets.1.time_emb_proj", c) == "middle_block.2.emb_layers.1"
    assert lf.sgm_path("up_blocks.0.upsamplers.0.conv", c) == "output_blocks.2.2.conv"
    assert lf.sgm_path("up_blocks.2.resnets.2.conv2", c) == "output_blocks.8.0.out_layers.3"
    assert lf.sgm_path("add_embedding.linear_1", c) == "label_emb.0.0"


@pytest.fixture()
def kohya_file(tmp_path):
    unet, te = lora_pair()
    return lf.save_kohya(tmp_path / "k.safetensors", unet, [te])


@pytest.mark.parametrize("case,needle", [
    ("no_alpha", "has no \\['alpha'\\]"),
    ("chain", "do not chain"),
    ("shape", "the layer takes"),
    ("unknown", "name no LoRA layer"),
    ("rank", "set adapter.rank=4"),
    ("alpha", "set adapter.alpha=2"),
    ("no_te", "set adapter.text_encoder=true"),
    ("ckpt", "pickle"),
    ("other", "neither kohya"),
])
def test_bad_files_are_refused_with_the_reason(kohya_file, tmp_path, case, needle):
    sd = load_file(kohya_file)
    q = "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q"
    path, rank, alpha, tes = tmp_path / "bad.safetensors", 4, 2.0, True
    if case == "no_alpha":
        del sd[f"{q}.alpha"]
    elif case == "chain":
        sd[f"{q}.lora_up.weight"] = torch.zeros(16, 3)
    elif case == "shape":
        sd[f"{q}.lora_down.weight"] = torch.zeros(4, 99)
    elif case == "unknown":
        sd["lora_unet_nowhere_to_q.lora_down.weight"] = sd[f"{q}.lora_down.weight"].clone()
        sd["lora_unet_nowhere_to_q.lora_up.weight"] = sd[f"{q}.lora_up.weight"].clone()
        sd["lora_unet_nowhere_to_q.alpha"] = sd[f"{q}.alpha"].clone()
    elif case == "rank":
        rank = 8
    elif case == "alpha":
        alpha = 4.0
    elif case == "no_te":
        tes = False
    elif case == "ckpt":
        path = tmp_path / "bad.ckpt"
        path.write_bytes(b"not read")
    elif case == "other":
        sd = {"model.weight": torch.zeros(2)}
    if case != "ckpt":
        save_file(sd, path)
    u, t = fresh(rank=rank, alpha=alpha) if case != "shape" else fresh()
    with pytest.raises(lf.LoraFileError, match=needle):
        lf.load_lora_file(path, u, [t] if tes else [], rank=rank, alpha=alpha)


def test_nonfinite_lora_is_not_written(tmp_path):
    from steadydiff.trainer.checkpoint import CheckpointError

    unet, te = lora_pair()
    with torch.no_grad():
        next(p for n, p in unet.named_parameters() if "lora_B" in n)[0, 0] = float("nan")
    with pytest.raises(CheckpointError, match="non-finite"):
        lf.save_kohya(tmp_path / "n.safetensors", unet, [te])
    assert not list(tmp_path.iterdir())
