"""SDXL on tiny components built from configs (integrations/sd/tiny.py make_tiny_sdxl): the
folder diffusers' own StableDiffusionXLPipeline loads, our conditioning against its
encode_prompt and its UNet call, LoRA runs whose files diffusers and the kohya format load,
exact resume with aspect-ratio buckets (each batch one bucket, time ids = the crop), a full
fine-tune, and the fp16 VAE's NaN latents."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

pytest.importorskip("diffusers")
pytest.importorskip("peft")

import steadydiff  # noqa: E402
from steadydiff.config import ConfigError  # noqa: E402
from steadydiff.integrations.sd.folder import SDFolderError, check_folder  # noqa: E402
from steadydiff.trainer import checkpoint as ckpt  # noqa: E402

from test_sd import incidents, sd_config, shapes  # noqa: E402


@pytest.fixture(scope="module")
def xl_dir(tmp_path_factory) -> Path:
    """The tiny SDXL folder, written by the command users run
    (``python -m steadydiff.integrations.sd.tiny OUT --family sdxl``)."""
    from steadydiff.integrations.sd.tiny import main

    out = tmp_path_factory.mktemp("sdxl") / "tiny-sdxl"
    main([str(out), "--family", "sdxl", "--image-size", "32"])
    return out


def _pipe(root: Path):
    from diffusers import StableDiffusionXLPipeline

    return StableDiffusionXLPipeline.from_pretrained(root, local_files_only=True)


def _build(cfg):
    from steadydiff.integrations.sd.setup import build
    from steadydiff.integrations.sd.source import resolve_config

    return build(resolve_config(cfg)[0], torch.device("cpu"))


def test_tiny_sdxl_folder_is_laid_out_like_the_base(xl_dir):
    index = json.loads((xl_dir / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusionXLPipeline"
    assert index["text_encoder_2"] == ["transformers", "CLIPTextModelWithProjection"]
    assert index["force_zeros_for_empty_prompt"] is True
    unet = json.loads((xl_dir / "unet" / "config.json").read_text())
    te2 = json.loads((xl_dir / "text_encoder_2" / "config.json").read_text())
    assert unet["addition_embed_type"] == "text_time"
    assert unet["projection_class_embeddings_input_dim"] == \
        te2["projection_dim"] + 6 * unet["addition_time_embed_dim"]
    assert json.loads((xl_dir / "vae" / "config.json").read_text())["force_upcast"] is True
    assert check_folder(xl_dir) == xl_dir


def test_conditioning_equals_the_pipelines_encode_prompt_and_unet_call(xl_dir, tmp_path):
    """Our packed y gives the UNet what StableDiffusionXLPipeline gives it: the same prompt
    embeds (both encoders' penultimate states), pooled embeds, zeros for the null condition
    (force_zeros_for_empty_prompt) with the sample's time ids kept, and the same output."""
    pipe = _pipe(xl_dir)
    prompts = ["a red square", "a blue circle, small"]
    pe, npe, pooled, npooled = pipe.encode_prompt(prompts, device="cpu",
                                                  do_classifier_free_guidance=True)
    model, _, media = _build(sd_config(xl_dir, shapes(tmp_path / "i", 2), "adapter.kind=none"))
    y = media.encode_prompts(prompts)
    e, p, t = media.layout.unpack(y)
    torch.testing.assert_close(e, pe, rtol=0, atol=1e-6)
    torch.testing.assert_close(p, pooled, rtol=0, atol=1e-6)
    assert not t.any()  # the zero slot: the drawn size
    null = model.null_condition(y)
    ne, npool, _ = media.layout.unpack(null)
    assert torch.equal(ne, npe) and torch.equal(npool, npooled)  # zeros
    # the UNet call, with a crop's time ids, against diffusers' own add_time_ids
    ids = pipe._get_add_time_ids((40, 56), (4, 8), (32, 32), dtype=torch.float32,
                                 text_encoder_projection_dim=pooled.shape[1]).repeat(2, 1)
    y = media.layout.pack(e, p, ids)
    assert torch.equal(model.null_condition(y)[:, -1], y[:, -1])  # time ids kept
    x, ts = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(0)), \
        torch.tensor([10, 700])
    with torch.no_grad():
        ours = model(x, ts, y)
        theirs = pipe.unet(x, ts, encoder_hidden_states=pe,
                           added_cond_kwargs={"text_embeds": pooled, "time_ids": ids}).sample
        default = model(x, ts, media.encode_prompts(prompts))
        square = pipe.unet(x, ts, encoder_hidden_states=pe, added_cond_kwargs={
            "text_embeds": pooled, "time_ids": torch.tensor([[32.0, 32, 0, 0, 32, 32]] * 2)}
        ).sample
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    torch.testing.assert_close(default, square, rtol=0, atol=1e-5)
    assert (ours - default).abs().max() > 1e-4  # the time ids matter


def test_the_refiner_is_refused_by_name(xl_dir, tmp_path):
    ref = tmp_path / "refiner"
    shutil.copytree(xl_dir, ref)
    index = json.loads((ref / "model_index.json").read_text())
    index.update(_class_name="StableDiffusionXLImg2ImgPipeline", text_encoder=[None, None],
                 tokenizer=[None, None], requires_aesthetics_score=True)
    (ref / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(SDFolderError, match="without text_encoder, tokenizer.*refiner"):
        check_folder(ref)


@pytest.fixture
def offline(monkeypatch):
    """A connection attempt fails loudly: the single-file loader must use the local
    config folder only."""
    import socket

    def refuse(*a, **k):
        raise OSError("network access attempted in an offline test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_sdxl_single_file_round_trips_through_diffusers_loader_exactly(xl_dir, tmp_path,
                                                                       offline):
    """The folder written as one original-layout SDXL file (conditioner.embedders.0 =
    CLIP, .1 = OpenCLIP with fused qkv) loads through StableDiffusionXLPipeline's
    from_single_file with the folder as config to the same tensors, every part."""
    from safetensors import safe_open

    from steadydiff.integrations.sd.export import export
    from steadydiff.integrations.sd.source import load_parts

    f = export(xl_dir, tmp_path / "xl.safetensors")
    with safe_open(f, "pt") as h:
        keys = list(h.keys())
    assert any(k.startswith("conditioner.embedders.1.model.transformer.resblocks.0.attn."
                            "in_proj_weight") for k in keys)
    a, b = load_parts(xl_dir), load_parts(f, xl_dir)
    for part in ("unet", "vae", "text_encoder", "text_encoder_2"):
        sa, sb = getattr(a, part).state_dict(), getattr(b, part).state_dict()
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa), part
    assert b.force_zeros and b.tokenizer_2.pad_token == "!"


@pytest.mark.slow
def test_sdxl_full_fine_tune_from_a_single_file_is_exported_as_one(xl_dir, tmp_path,
                                                                   offline):
    from steadydiff.integrations.sd.export import export
    from steadydiff.integrations.sd.source import load_parts

    f = export(xl_dir, tmp_path / "xl.safetensors")
    res = steadydiff.train(sd_config(f, shapes(tmp_path / "images"), "adapter.kind=none",
                                     "train.steps=1", "optim.lr=0.01",
                                     f"model.single_file_config={xl_dir}"),
                           out_dir=tmp_path / "run")
    assert np.isfinite(res.final_loss)
    base, out = load_parts(f, xl_dir), load_parts(tmp_path / "run" / "model.safetensors", xl_dir)
    trained = dict(out.unet.named_parameters())
    assert any(not torch.equal(p, trained[n]) for n, p in base.unet.named_parameters())
    te2 = dict(out.text_encoder_2.named_parameters())
    assert all(torch.equal(p, te2[n]) for n, p in base.text_encoder_2.named_parameters())


def test_sdxl_lora_loads_in_diffusers_in_both_formats_and_draws_the_same_image(xl_dir,
                                                                               tmp_path):
    """A LoRA run over both text encoders and the UNet: the diffusers file loads with
    StableDiffusionXLPipeline.load_lora_weights and draws the image we draw; the kohya file
    (lora_unet_input_blocks_*, lora_te1_*, lora_te2_*) does too, and continuing from it keeps
    every tensor. Validation prompts render during the run."""
    from diffusers import DDIMScheduler
    from safetensors import safe_open
    from safetensors.torch import load_file

    from steadydiff.integrations.sd.lora_files import kohya_state_dict

    data = shapes(tmp_path / "images")
    cfg = sd_config(xl_dir, data, "optim.lr=0.01", "sample.use_ema=false", "train.steps=2",
                    "adapter.text_encoder=true", "train.sample_every=2",
                    'sample.prompts=["a red square"]')
    res = steadydiff.train(cfg, out_dir=tmp_path / "run")
    assert res.steps == 2 and np.isfinite(res.final_loss)
    assert (tmp_path / "run" / "samples" / "step_00000002.png").is_file()
    lora = tmp_path / "run" / "lora"
    keys = load_file(lora / "pytorch_lora_weights.safetensors")
    assert {k.split(".")[0] for k in keys} == {"unet", "text_encoder", "text_encoder_2"}
    kohya = lora / "run.safetensors"
    with safe_open(kohya, "pt") as f:
        meta, kkeys = f.metadata(), list(f.keys())
    assert meta["ss_base_model_version"] == "sdxl_base_v1-0"
    assert {k.split("_")[1] for k in kkeys} == {"unet", "te1", "te2"}
    assert any(k.startswith("lora_unet_input_blocks_") for k in kkeys)

    from steadydiff.cli import main

    png = tmp_path / "s.png"
    assert main(["sample", str(tmp_path / "run"), "--prompt", "a blue circle", "--num", "2",
                 "--steps", "2", "--out", str(png), "--device", "cpu"]) == 0
    assert Image.open(png).size[0] >= 32
    ours = steadydiff.load(tmp_path / "run", device="cpu", use_ema=False)
    z = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(3))
    x, _ = ours.sample(prompt="a red square", negative_prompt=None, sampler="ddim", steps=4,
                       cfg_scale=4.0, noise=z)
    pipe = _pipe(xl_dir)
    pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config,
                                               timestep_spacing="trailing",
                                               set_alpha_to_one=True, clip_sample=False)

    def draw():
        return pipe(["a red square"] * 2, num_inference_steps=4, guidance_scale=4.0,
                    latents=z.clone(), output_type="pt", height=32, width=32).images

    before = draw()
    pipe.load_lora_weights(lora)
    theirs = draw()
    assert (theirs - before).abs().max() > 1e-3  # the LoRA changed the model
    torch.testing.assert_close(x * 0.5 + 0.5, theirs.float(), atol=2e-3, rtol=0)
    pipe.unload_lora_weights()
    pipe.load_lora_weights(kohya)  # diffusers' converter maps the sgm names back
    torch.testing.assert_close(draw(), theirs, atol=1e-5, rtol=0)

    model, _, _ = _build(sd_config(xl_dir, data, f"adapter.init_from={kohya}",
                                   "adapter.text_encoder=true"))
    again = kohya_state_dict(model.unet, [model.text_encoder, model.text_encoder_2])
    theirs_k = load_file(kohya)
    assert again.keys() == theirs_k.keys()
    assert all(torch.equal(again[k], theirs_k[k]) for k in again)
    model, _, _ = _build(sd_config(xl_dir, data, f"adapter.init_from={lora}",
                                   "adapter.text_encoder=true"))  # the diffusers file too
    again = kohya_state_dict(model.unet, [model.text_encoder, model.text_encoder_2])
    assert all(torch.equal(again[k], theirs_k[k]) for k in again)


def mixed(root: Path, n: int = 8) -> Path:
    """``n`` captioned images of three aspect ratios (landscape, portrait, square)."""
    root.mkdir(parents=True, exist_ok=True)
    sizes = [(64, 32), (32, 64), (48, 48)]
    for i in range(n):
        w, h = sizes[i % 3]
        a = np.full((h, w, 3), 40 + 20 * i, np.uint8)
        a[: h // 2, : w // 3] = (200, 30, 30) if i % 2 else (30, 30, 200)
        Image.fromarray(a).save(root / f"img{i:02d}.png")
        (root / f"img{i:02d}.txt").write_text(f"a {'red' if i % 2 else 'blue'} block")
    return root


@pytest.mark.slow
def test_sdxl_lora_with_buckets_resumes_bit_exactly_and_conditions_on_each_crop(
        xl_dir, tmp_path, monkeypatch):
    """Mixed aspect ratios in buckets, the LoRA on the UNet and both text encoders: every
    step's batch is one bucket, the UNet gets each image's crop as its time ids, and a run
    resumed mid-epoch equals an uninterrupted one bit for bit."""
    from diffusers import UNet2DConditionModel

    from steadydiff.data.buckets import bucket_layout

    seen: list[tuple[tuple[int, ...], torch.Tensor]] = []
    real = UNet2DConditionModel.forward

    def forward(self, sample, timestep, encoder_hidden_states, *a, **kw):
        if torch.is_grad_enabled():  # training steps (not the final sample grid)
            seen.append((tuple(sample.shape[-2:]),
                         kw["added_cond_kwargs"]["time_ids"].clone()))
        return real(self, sample, timestep, encoder_hidden_states, *a, **kw)

    monkeypatch.setattr(UNet2DConditionModel, "forward", forward)
    data = mixed(tmp_path / "images")
    fixed = ("optim.schedule=constant", "data.buckets=true", "data.bucket_step=16",
             "data.bucket_min_side=16", "data.bucket_max_side=64", "data.bucket_crop=random",
             f"data.cache_dir={tmp_path / 'cache'}", "train.checkpoint_every=3",
             "optim.lr=0.01", "adapter.text_encoder=true")  # token ids + time ids in y
    straight = steadydiff.train(sd_config(xl_dir, data, *fixed, "train.steps=6"),
                                out_dir=tmp_path / "straight")
    assert np.isfinite(straight.final_loss)
    # every batch is one bucket; its time ids are its images' crops, target = the bucket
    from steadydiff.data import build_dataset
    from steadydiff.data.captions import build_captioned

    cfg = sd_config(xl_dir, data, *fixed)
    ds = build_captioned(cfg.data, build_dataset(cfg.data, seed=cfg.train.seed),
                         seed=cfg.train.seed)
    crops = {tuple(c.time_ids()) for c in bucket_layout(ds).crops}
    assert len(seen) == 6
    for (h, w), ids in seen:
        assert all(tuple(int(v) for v in r) in crops for r in ids)
        assert (ids[:, 4] == h * 2).all() and (ids[:, 5] == w * 2).all()
    assert len({hw for hw, _ in seen}) > 1  # more than one bucket was trained
    steadydiff.train(sd_config(xl_dir, data, *fixed, "train.steps=3"),
                     out_dir=tmp_path / "resumed")
    resumed = steadydiff.train(sd_config(xl_dir, data, *fixed, "train.steps=6"),
                               out_dir=tmp_path / "resumed")
    assert resumed.resumed_from is not None and resumed.steps == 6
    a = ckpt.load_checkpoint(straight.checkpoint, "cpu", weights_only=True)
    b = ckpt.load_checkpoint(resumed.checkpoint, "cpu", weights_only=True)
    assert a.model.keys() == b.model.keys() and a.model
    assert {k.split(".")[0] for k in a.model} == {"unet", "text_encoder", "text_encoder_2"}
    ups = [k for k in a.model if "lora_B" in k]
    assert ups and any(a.model[k].abs().max() > 0 for k in ups)  # the LoRA trained
    for k in a.model:
        assert torch.equal(a.model[k], b.model[k]), k
        assert torch.equal(a.ema[k], b.ema[k]), k


@pytest.mark.slow
def test_sdxl_shuffled_captions_train_through_both_frozen_encoders_and_resume(xl_dir,
                                                                               tmp_path):
    """Shuffle encodes in the step through both (frozen) encoders from both tokenizers'
    ids; dropout to the zeros of force_zeros; a resumed run equals an uninterrupted one."""
    data = shapes(tmp_path / "images")
    for i in range(8):
        (data / f"img{i:02d}.txt").write_text(f"tag{i % 3}, shape, small, flat")
    fixed = ("optim.schedule=constant", "data.caption_shuffle=true", "data.keep_tokens=1",
             "data.caption_dropout=0.3", f"data.cache_dir={tmp_path / 'c'}",
             "train.checkpoint_every=2")
    straight = steadydiff.train(sd_config(xl_dir, data, *fixed, "train.steps=4"),
                                out_dir=tmp_path / "straight")
    steadydiff.train(sd_config(xl_dir, data, *fixed, "train.steps=2"),
                     out_dir=tmp_path / "resumed")
    resumed = steadydiff.train(sd_config(xl_dir, data, *fixed, "train.steps=4"),
                               out_dir=tmp_path / "resumed")
    a = ckpt.load_checkpoint(straight.checkpoint, "cpu", weights_only=True)
    b = ckpt.load_checkpoint(resumed.checkpoint, "cpu", weights_only=True)
    assert not any(k.startswith("text_encoder") for k in a.model)  # frozen: not saved
    for k in a.model:
        assert torch.equal(a.model[k], b.model[k]), k


@pytest.mark.slow
def test_sdxl_full_fine_tune_is_saved_as_an_sdxl_folder(xl_dir, tmp_path):
    data = shapes(tmp_path / "images")
    res = steadydiff.train(sd_config(xl_dir, data, "adapter.kind=none", "train.steps=1",
                                     "optim.lr=0.01"), out_dir=tmp_path / "run")
    assert np.isfinite(res.final_loss)
    pipe, base = _pipe(tmp_path / "run" / "model"), _pipe(xl_dir)
    trained = dict(pipe.unet.named_parameters())
    assert any(not torch.equal(p, trained[n]) for n, p in base.unet.named_parameters())
    assert all(torch.equal(p, dict(pipe.text_encoder_2.named_parameters())[n])
               for n, p in base.text_encoder_2.named_parameters())


def test_sdxl_vae_honours_force_upcast_and_nonfinite_fp16_latents_are_handled(
        xl_dir, tmp_path, monkeypatch):
    """fp16 frozen parts: the SDXL VAE (force_upcast) runs in fp32 unless
    model.vae_precision says otherwise; with an fp16 VAE forced, a latent that overflows
    is re-encoded in fp32, and one non-finite in fp32 too is quarantined, named."""
    from steadydiff.integrations.sd.model import TextToImage

    data = shapes(tmp_path / "images")
    fp16 = ("train.precision=fp16", "train.allow_slow_precision=true")
    _, _, media = _build(sd_config(xl_dir, data, *fp16, "model.vae_precision=null"))
    assert media.vae_dtype == torch.float32 and media.text_dtype == torch.float16
    _, _, media = _build(sd_config(xl_dir, data, *fp16, "model.vae_precision=fp16"))
    assert media.vae_dtype == torch.float16

    real = TextToImage.encode_images

    def encode(self, x, dtype=None):
        z = real(self, x, dtype)
        dtype = dtype or self.vae_dtype
        z[(x[:, 2, 27, 16] < 0.5).to(z.device)] = float("nan")  # img07, in any dtype
        if dtype == torch.float16:  # and img06 only in fp16 (an overflow)
            z[(x[:, 0, 26, 16] < 0.5).to(z.device)] = float("inf")
        return z

    monkeypatch.setattr(TextToImage, "encode_images", encode)
    res = steadydiff.train(sd_config(xl_dir, data, "train.steps=1", "model.vae_precision=fp16",
                                     "train.checkpoint_every=0"), out_dir=tmp_path / "run")
    assert res.steps == 1 and np.isfinite(res.final_loss)
    rows = [r for r in incidents(tmp_path / "run") if r["kind"] == "sample_quarantined"]
    assert len(rows) == 1 and rows[0]["evidence"]["source"].endswith("img07.png")
    assert len(list((tmp_path / "run" / "cache" / "latents").rglob("*.safetensors"))) == 7


def test_time_ids_without_buckets_follow_the_folders_crop(tmp_path):
    """Without buckets each item's time ids are its original size and the centre crop the
    folder makes (shorter side to S, centre square), or (h, w, 0, 0, S, S) when it squashes."""
    from steadydiff.config import load_config
    from steadydiff.data import build_dataset
    from steadydiff.data.captions import build_captioned
    from steadydiff.integrations.families.sdxl import item_time_ids

    data = mixed(tmp_path / "images", 3)  # 64x32, 32x64, 48x48 (w x h)
    cfg = load_config("configs/sd_lora.yaml", [f"data.path={data}", "data.image_size=32"])
    ds = build_captioned(cfg.data, build_dataset(cfg.data, seed=0), seed=0)
    assert item_time_ids(ds, 32, True).tolist() == [
        [32, 64, 0, 16, 32, 32], [64, 32, 16, 0, 32, 32], [48, 48, 0, 0, 32, 32]]
    assert item_time_ids(ds, 32, False)[:, 2:4].eq(0).all()
