"""Z-Image (integrations/families/zimage.py), the family added as one module, on a tiny
folder built from configs (``python -m steadydiff.integrations.sd.tiny OUT --family
zimage``): the layout and its errors, conditioning equal to ZImagePipeline's encode_prompt
+ transformer call, sampling equal to the pipeline for the same noise (with and without the
LoRA, the diffusers and the kohya file), exact resume, and the guard's faults on this path
(fp16 overflow in an attention block, a NaN in a caption's Qwen3 embedding: its images
quarantined, a NaN latent)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("peft")

import steadydiff  # noqa: E402
from steadydiff.config import load_config  # noqa: E402
from steadydiff.integrations.sd.folder import SDFolderError, check_folder  # noqa: E402
from steadydiff.trainer import checkpoint as ckpt  # noqa: E402

from test_sd import incidents, shapes  # noqa: E402


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    from steadydiff.integrations.sd.tiny import main

    root = tmp_path_factory.mktemp("zimage") / "z"
    main([str(root), "--family", "zimage"])
    return root


def pipeline(folder: Path):
    from diffusers import ZImagePipeline

    return ZImagePipeline.from_pretrained(folder, local_files_only=True)


def z_config(folder: Path, data: Path, *sets: str):
    base = [f"model.pretrained={folder}", f"data.path={data}", "data.image_size=32",
            "train.steps=4", "train.batch_size=4", "train.precision=fp32",
            "train.checkpoint_every=2", "train.sample_every=0", "train.num_threads=1",
            "train.device=cpu", "train.gradient_checkpointing=false", "sample.num=2",
            "sample.steps=3", "optim.warmup_steps=0", "logging.log_every=1",
            "guard.warmup_steps=3", "data.num_workers=0", "adapter.rank=4", "adapter.alpha=4"]
    return load_config("configs/zimage_lora.yaml", base + list(sets))


def _build(cfg):
    from steadydiff.integrations.sd.setup import build
    from steadydiff.integrations.sd.source import resolve_config

    return build(resolve_config(cfg)[0], torch.device("cpu"))


def test_tiny_folder_is_laid_out_like_the_real_one_and_errors_name_the_problem(folder,
                                                                                tmp_path):
    from steadydiff.integrations.sd.folder import diffusion_settings, family_of

    index = json.loads((folder / "model_index.json").read_text())
    assert index["_class_name"] == "ZImagePipeline"
    assert index["text_encoder"] == ["transformers", "Qwen3Model"]
    assert index["transformer"][1] == "ZImageTransformer2DModel"
    assert (folder / "tokenizer" / "tokenizer.json").is_file()
    assert check_folder(folder) == folder and family_of(folder).name == "zimage"
    s = diffusion_settings(folder)
    assert (s["diffusion.objective"], s["diffusion.flow.shift"]) == ("flow", 3.0)
    assert s["sample.cfg_scale"] == 6.0 and s["diffusion.flow.grid_end"] == "steps"

    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    for f in (bad / "tokenizer").glob("chat_template*"):
        f.unlink()
    conf = json.loads((bad / "tokenizer" / "tokenizer_config.json").read_text())
    conf.pop("chat_template", None)
    (bad / "tokenizer" / "tokenizer_config.json").write_text(json.dumps(conf))
    with pytest.raises(SDFolderError, match="no chat template"):
        check_folder(bad)
    other = tmp_path / "other"
    shutil.copytree(folder, other)
    index["text_encoder"] = ["transformers", "T5EncoderModel"]
    (other / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(SDFolderError, match="'text_encoder'.*Qwen3Model"):
        check_folder(other)


def test_conditioning_equals_the_pipelines_encode_prompt_and_transformer_call(folder,
                                                                              tmp_path):
    """Our packed y holds exactly ZImagePipeline's prompt embeds (chat template, Qwen3's
    penultimate state, each caption's own tokens), and the family's call (list of
    latents, 1 - σ, negated output) is the pipeline's transformer call."""
    from steadydiff.integrations.families.zimage import caption_tokens

    pipe = pipeline(folder)
    prompts = ["a red square", "a blue circle, small"]
    model, _, media = _build(z_config(folder, shapes(tmp_path / "i", 2), "adapter.kind=none"))
    y = media.encode_prompts(prompts)
    with torch.no_grad():
        pe, _ = pipe.encode_prompt(prompts, device="cpu", do_classifier_free_guidance=False)
    ours = caption_tokens(media.layout.unpack(y)[0])
    assert [len(e) for e in ours] == [len(e) for e in pe] and len(ours[0]) != len(ours[1])
    for a, b in zip(ours, pe):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    x = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(0))
    sigma = torch.tensor([0.3, 0.9])
    with torch.no_grad():
        out = model(x, sigma * 1000, y)
        theirs = pipe.transformer(list(x.unsqueeze(2).unbind(0)), 1 - sigma, pe,
                                  return_dict=False)[0]
    torch.testing.assert_close(out, -torch.stack(theirs).squeeze(2), rtol=0, atol=1e-5)


def _draw(pipe, prompt: str, z: torch.Tensor, steps: int, guidance: float):
    return pipe([prompt] * z.shape[0], height=32, width=32, num_inference_steps=steps,
                guidance_scale=guidance, latents=z.clone(), output_type="pt").images


def test_lora_run_samples_what_the_diffusers_pipeline_draws(folder, tmp_path):
    """The base through our sampler, and the trained run through ``steadydiff.load``,
    draw ZImagePipeline's image from the same noise (its guidance g is our cfg g + 1),
    after ``load_lora_weights`` of the diffusers file and of the kohya file alike."""
    from steadydiff.diffusion import make_schedule, sample
    from steadydiff.integrations.sd.setup import build
    from steadydiff.integrations.sd.source import resolve_config

    cfg = z_config(folder, shapes(tmp_path / "images"), "optim.lr=0.02",
                   "sample.use_ema=false")
    z = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(3))
    g = 2.0
    pipe = pipeline(folder)
    before = _draw(pipe, "a red square", z, 4, g)
    resolved = resolve_config(cfg)[0]
    model, _, media = build(resolved, torch.device("cpu"))
    with torch.no_grad():
        y = media.encode_prompts(["a red square"] * 2)
        x0 = sample(model.eval(), make_schedule(resolved.diffusion, 32), "eps", (2, 4, 16, 16),
                    sampler="euler", steps=4, y=y, x=z, clip_x0=False, cfg_scale=g + 1)
        base = media.decode(x0) * 0.5 + 0.5
    torch.testing.assert_close(base, before.float(), atol=2e-3, rtol=0)

    steadydiff.train(cfg, out_dir=tmp_path / "run")
    ours = steadydiff.load(tmp_path / "run", device="cpu", use_ema=False)
    x, _ = ours.sample(prompt="a red square", sampler="euler", steps=4, cfg_scale=g + 1,
                       noise=z)
    pipe.load_lora_weights(tmp_path / "run" / "lora")
    theirs = _draw(pipe, "a red square", z, 4, g)
    assert (theirs - before).abs().max() > 1e-3  # the LoRA changed the model
    torch.testing.assert_close(x * 0.5 + 0.5, theirs.float(), atol=2e-3, rtol=0)
    kohya = pipeline(folder)  # kohya's names (lora_unet_layers_0_attention_to_q)
    kohya.load_lora_weights(tmp_path / "run" / "lora", weight_name="run.safetensors")
    torch.testing.assert_close(_draw(kohya, "a red square", z, 4, g).float(), theirs.float(),
                               atol=1e-4, rtol=0)


def test_lokr_run_writes_the_diffusers_file_its_pipeline_loads_and_a_lycoris_file(folder,
                                                                                tmp_path):
    """A LoKr (adapter.variant=lokr, alpha != rank) on Z-Image: diffusers' Z-Image loader
    reads LoKr factors (peft's names), so the run writes its diffusers file beside the
    LyCORIS one; ZImagePipeline.load_lora_weights of it draws what the run samples, and the
    LyCORIS file reads back into a fresh LoKr with the run's tensors."""
    from safetensors.torch import load_file

    from steadydiff.integrations.sd import lora_files as lf

    cfg = z_config(folder, shapes(tmp_path / "images"), "optim.lr=0.02",
                   "sample.use_ema=false", "adapter.variant=lokr", "adapter.alpha=3")
    steadydiff.train(cfg, out_dir=tmp_path / "run")
    lora = tmp_path / "run" / "lora"
    diffusers_keys = load_file(lora / "pytorch_lora_weights.safetensors")
    assert diffusers_keys and all(".lokr_w" in k for k in diffusers_keys)
    lyco = load_file(lora / "run.safetensors")
    assert {k.split(".", 1)[1] for k in lyco} >= {"lokr_w1", "alpha"}
    z = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(3))
    ours = steadydiff.load(tmp_path / "run", device="cpu", use_ema=False)
    x, _ = ours.sample(prompt="a red square", sampler="euler", steps=4, cfg_scale=3.0,
                       noise=z)
    pipe = pipeline(folder)
    before = _draw(pipe, "a red square", z, 4, 2.0)
    pipe.load_lora_weights(lora)
    theirs = _draw(pipe, "a red square", z, 4, 2.0)
    assert (theirs - before).abs().max() > 1e-3  # the LoKr changed the model
    torch.testing.assert_close(x * 0.5 + 0.5, theirs.float(), atol=2e-3, rtol=0)
    model, _, _ = _build(z_config(folder, shapes(tmp_path / "images2"), "adapter.variant=lokr",
                                  "adapter.alpha=3"))
    assert lf.load_lora_file(lora / "run.safetensors", model.denoiser, [], rank=4,
                             alpha=3.0)["fresh"] == 0
    trained = dict(ours.model.denoiser.named_parameters())
    for n, p in model.denoiser.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p, trained[n], rtol=1e-6, atol=1e-7)


def test_resumed_lora_run_equals_uninterrupted_bit_exactly(folder, tmp_path):
    data = shapes(tmp_path / "images")
    fixed = ("optim.lr=0.01", "data.caption_dropout=0.25", f"data.cache_dir={tmp_path / 'c'}")
    straight = steadydiff.train(z_config(folder, data, *fixed), out_dir=tmp_path / "straight")
    steadydiff.train(z_config(folder, data, *fixed, "train.steps=2"),
                     out_dir=tmp_path / "resumed")
    resumed = steadydiff.train(z_config(folder, data, *fixed), out_dir=tmp_path / "resumed")
    assert resumed.resumed_from is not None
    a = ckpt.load_checkpoint(straight.checkpoint, "cpu", weights_only=True)
    b = ckpt.load_checkpoint(resumed.checkpoint, "cpu", weights_only=True)
    assert a.model.keys() == b.model.keys() and a.model
    for k in a.model:
        assert torch.equal(a.model[k], b.model[k]), k
        assert torch.equal(a.ema[k], b.ema[k]), k


ATTN = "transformer.layers.0.attention"


def test_fp16_overflow_in_an_attention_block_upcasts_that_block(folder, tmp_path):
    """fp16: the first main layer's query projection scaled in the folder's weights (from
    outside) so its activations overflow fp16; the guard names the block, skips the step
    and runs that layer in fp32 from then on; the run ends finite."""
    from safetensors.torch import load_file, save_file

    hot = tmp_path / "hot"
    shutil.copytree(folder, hot)
    w = hot / "transformer" / "diffusion_pytorch_model.safetensors"
    sd = load_file(w)
    q = sd["layers.0.attention.to_q.weight"]
    sd["layers.0.attention.to_q.weight"] = q * (3e4 / q.abs().max())
    save_file(sd, w)
    cfg = z_config(hot, shapes(tmp_path / "images"), "train.steps=3",
                   "train.checkpoint_every=0", "train.precision=fp16",
                   "train.allow_slow_precision=true", "model.vae_precision=fp32")
    res = steadydiff.train(cfg, out_dir=tmp_path / "run")
    assert res.steps == 3
    rows = incidents(tmp_path / "run")
    assert rows[0]["kind"] == "attention_upcast" and rows[0]["evidence"]["module"] == ATTN
    state = json.loads((res.checkpoint / "state.json").read_text())
    assert state["guard"]["upcast_attention"] == [ATTN]
    c = ckpt.load_checkpoint(res.checkpoint, "cpu", weights_only=True)
    assert all(torch.isfinite(v).all() for v in c.model.values())


def test_nan_in_a_captions_qwen3_embedding_quarantines_its_images(folder, tmp_path):
    """A Qwen3 token embedding row set to NaN in the folder's weights (a broken file, from
    outside): the captions holding that byte encode to NaN even in fp32, so their images
    are quarantined before the first step, the token named; the run trains on the rest and
    its LoRA is finite."""
    from safetensors.torch import load_file, save_file

    from steadydiff.integrations.sd.tiny_parts import tiny_qwen2_tokenizer

    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    w = bad / "text_encoder" / "model.safetensors"
    sd = load_file(w)
    tok = tiny_qwen2_tokenizer().convert_tokens_to_ids("q")  # only "a ... square" has a q
    for k in sd:
        if k.endswith("embed_tokens.weight"):
            sd[k][tok] = float("nan")
    save_file(sd, w)
    res = steadydiff.train(z_config(bad, shapes(tmp_path / "images")), out_dir=tmp_path / "run")
    assert res.steps == 4
    rows = [r for r in incidents(tmp_path / "run") if r["kind"] == "sample_quarantined"]
    captions = {p.stem: p.read_text() for p in (tmp_path / "images").glob("*.txt")}
    squares = sorted(k for k, c in captions.items() if "square" in c)
    assert sorted(Path(r["evidence"]["source"]).stem for r in rows) == squares
    assert all("token 'q'" in r["evidence"]["why"] for r in rows)
    from safetensors.torch import load_file as load

    lora = load(tmp_path / "run" / "lora" / "pytorch_lora_weights.safetensors")
    assert all(torch.isfinite(v).all() for v in lora.values())


def test_a_nan_latent_is_dropped_and_named(folder, tmp_path):
    """A NaN in one sample's latents (the fault injector's nan_batch): that sample is
    named by its file and dropped; the LoRA written stays finite."""
    from safetensors.torch import load_file

    cfg = z_config(folder, shapes(tmp_path / "images"), "train.steps=5",
                   "train.checkpoint_every=0", 'faults=[{"kind": "nan_batch", "step": 2}]')
    res = steadydiff.train(cfg, out_dir=tmp_path / "run")
    assert res.steps == 5
    rows = [r for r in incidents(tmp_path / "run") if r["kind"] == "bad_batch"]
    assert rows and rows[0]["action"] == "drop_samples"
    assert rows[0]["evidence"]["samples"][0]["source"].endswith(".png")
    lora = tmp_path / "run" / "lora" / "pytorch_lora_weights.safetensors"
    assert all(torch.isfinite(v).all() for v in load_file(lora).values())


def test_single_file_in_tongyis_layout_loads_in_diffusers_and_trains_back(folder, tmp_path):
    """The transformer as one file in Tongyi-MAI's layout (fused qkv, out, q_norm, final_layer;
    the released files' norm_final.weight read past): diffusers' from_single_file reads it
    back exactly, steadydiff loads it with the folder as model.single_file_config, and a
    full fine-tune from it is written back as one file of the same layout."""
    from diffusers import ZImageTransformer2DModel
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from steadydiff.integrations.sd.single_file import export_single_file
    from steadydiff.integrations.sd.source import load_parts

    p = load_parts(folder)
    f = export_single_file(tmp_path / "z.safetensors", p.denoiser, p.vae, p.text_encoders)
    with safe_open(str(f), "pt") as h:
        keys = list(h.keys())
    assert "layers.0.attention.qkv.weight" in keys and "final_layer.linear.weight" in keys \
        and "layers.0.attention.q_norm.weight" in keys and "x_embedder.weight" in keys
    assert not any("to_q" in k or "2-1" in k for k in keys)
    theirs = ZImageTransformer2DModel.from_single_file(
        str(f), config=str(folder), subfolder="transformer", local_files_only=True)
    for k, v in p.denoiser.state_dict().items():
        assert torch.equal(theirs.state_dict()[k], v), k
    released = load_file(f)  # as Tongyi-MAI's files are: with norm_final.weight
    released["norm_final.weight"] = torch.ones(p.denoiser.config.dim)
    save_file(released, tmp_path / "released.safetensors")
    mine = load_parts(tmp_path / "released.safetensors", folder)
    for k, v in p.denoiser.state_dict().items():
        assert torch.equal(mine.denoiser.state_dict()[k], v), k
    res = steadydiff.train(z_config(tmp_path / "released.safetensors",
                                    shapes(tmp_path / "images"), "train.steps=1",
                                    "adapter.kind=none", "optim.lr=0.01",
                                    f"model.single_file_config={folder}"),
                           out_dir=tmp_path / "run")
    assert res.final_loss == res.final_loss
    with safe_open(str(tmp_path / "run" / "model.safetensors"), "pt") as h:
        assert sorted(h.keys()) == sorted(keys)  # the same layout
    after = load_parts(tmp_path / "run" / "model.safetensors", folder).denoiser.state_dict()
    assert any(not torch.equal(after[k], v) for k, v in p.denoiser.state_dict().items())
