"""Stable Diffusion-family training on tiny components built from configs (no weights exist
offline): the folder's layout and its errors, LoRA via peft saved in diffusers' format and
loaded by a diffusers pipeline to the same image, exact resume of a LoRA run, a full
fine-tune saved as a diffusers folder, and the guard's faults on the SD path."""

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
from steadydiff.config import ConfigError, load_config  # noqa: E402
from steadydiff.integrations.sd.folder import (SDFolderError, check_folder,  # noqa: E402
                                               diffusion_settings)
from steadydiff.integrations.sd.tiny import make_tiny_sd  # noqa: E402
from steadydiff.trainer import checkpoint as ckpt  # noqa: E402

COLORS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 40, 220),
          "yellow": (230, 220, 30)}


@pytest.fixture(scope="module")
def sd_dir(tmp_path_factory) -> Path:
    return make_tiny_sd(tmp_path_factory.mktemp("sd") / "tiny-sd", image_size=32)


@pytest.fixture(scope="module")
def sd_v_dir(tmp_path_factory) -> Path:
    return make_tiny_sd(tmp_path_factory.mktemp("sdv") / "tiny-sd-v",
                        prediction="v_prediction", image_size=32)


def shapes(root: Path, n: int = 8, jsonl: bool = False) -> Path:
    """``n`` 32x32 images of a colored square or circle, each with its caption."""
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        name = list(COLORS)[i % len(COLORS)]
        shape = "square" if i % 2 == 0 else "circle"
        im = np.full((32, 32, 3), 245, np.uint8)
        yy, xx = np.mgrid[:32, :32]
        c = 12 + i % 8  # each image its own (so its own file content, its own latent)
        mask = (abs(yy - c) < 9) & (abs(xx - 16) < 9) if shape == "square" else \
            (yy - c) ** 2 + (xx - 16) ** 2 < 81
        im[mask] = COLORS[name]
        Image.fromarray(im).save(root / f"img{i:02d}.png")
        caption = f"a {name} {shape}"
        if jsonl:
            rows.append(json.dumps({"file_name": f"img{i:02d}.png", "text": caption}))
        else:
            (root / f"img{i:02d}.txt").write_text(caption)
    if jsonl:
        (root / "metadata.jsonl").write_text("\n".join(rows) + "\n")
    return root


def sd_config(sd: Path, data: Path, *sets: str):
    base = [f"model.pretrained={sd}", f"data.path={data}", "data.image_size=32",
            "train.steps=4", "train.batch_size=4", "train.precision=fp32",
            "train.checkpoint_every=2", "train.sample_every=0", "train.num_threads=1",
            "train.device=cpu", "sample.num=2", "sample.steps=2", "optim.warmup_steps=0",
            "logging.log_every=1", "guard.warmup_steps=0", "data.num_workers=0",
            "adapter.rank=4", "adapter.alpha=4"]
    return load_config("configs/sd_lora.yaml", base + list(sets))


# --------------------------------------------------------------------------- the folder


def test_tiny_folder_is_laid_out_like_a_real_one(sd_dir):
    assert check_folder(sd_dir) == sd_dir
    for part in ("unet", "vae", "text_encoder", "tokenizer", "scheduler"):
        assert (sd_dir / part).is_dir()
    assert json.loads((sd_dir / "model_index.json").read_text())["_class_name"] == \
        "StableDiffusionPipeline"


def test_scheduler_config_decides_prediction_and_betas(sd_dir, sd_v_dir):
    eps, v = diffusion_settings(sd_dir), diffusion_settings(sd_v_dir)
    assert eps["diffusion.prediction"] == "eps" and v["diffusion.prediction"] == "v"
    assert eps["diffusion.schedule"] == "scaled_linear"
    assert (eps["diffusion.beta_start"], eps["diffusion.beta_end"]) == (0.00085, 0.012)


def test_alphas_cumprod_match_diffusers(sd_dir):
    from diffusers import DDPMScheduler

    from steadydiff.diffusion import make_schedule
    from steadydiff.integrations.sd.source import resolve_config

    cfg, notes = resolve_config(sd_config(sd_dir, sd_dir))
    assert any("diffusion.schedule=scaled_linear" in n for n in notes)
    ours = make_schedule(cfg.diffusion).alphas_cumprod
    theirs = DDPMScheduler.from_pretrained(sd_dir, subfolder="scheduler").alphas_cumprod
    torch.testing.assert_close(ours.float(), theirs.float(), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("case, needle", [
    ("missing", "does not exist"),
    ("single_file", "is a file"),
    ("no_index", "model_index.json is missing"),
    ("bad_index", "not valid JSON"),
    ("wrong_class", "_class_name is 'KandinskyV22Pipeline'; expected one of .*FluxPipeline"),
    ("sdxl", "SDXL"),
    ("no_unet", "unet/ is missing"),
    ("pickled", "pickled weights"),
    ("no_tokenizer_files", "neither tokenizer.json nor vocab.json"),
])
def test_folder_errors_name_the_problem(sd_dir, tmp_path, case, needle):
    bad = tmp_path / "model"
    if case != "missing":
        shutil.copytree(sd_dir, bad)
    index = bad / "model_index.json"
    if case == "single_file":
        bad = tmp_path / "v1-5-pruned.safetensors"
        bad.write_bytes(b"\0" * 16)
    elif case == "no_index":
        index.unlink()
    elif case == "bad_index":
        index.write_text("{not json")
    elif case in ("wrong_class", "sdxl"):
        d = json.loads(index.read_text())
        d["_class_name"] = "KandinskyV22Pipeline" if case == "wrong_class" else \
            "StableDiffusionXLPipeline"
        index.write_text(json.dumps(d))
    elif case == "no_unet":
        shutil.rmtree(bad / "unet")
    elif case == "pickled":
        w = bad / "unet" / "diffusion_pytorch_model.safetensors"
        w.rename(w.with_suffix(".bin"))
    elif case == "no_tokenizer_files":
        for f in (bad / "tokenizer").iterdir():
            if f.name != "tokenizer_config.json":
                f.unlink()
    with pytest.raises(SDFolderError, match=needle):
        check_folder(bad)


def test_config_refuses_inconsistent_text_settings(sd_dir, tmp_path):
    with pytest.raises(ConfigError, match="needs captions"):
        load_config(None, [f"model.pretrained={sd_dir}", "data.dataset=folder",
                           f"data.path={tmp_path}"])
    with pytest.raises(ConfigError, match="model.num_classes=0"):
        sd_config(sd_dir, tmp_path, "model.num_classes=10")
    with pytest.raises(ConfigError, match="data.hflip"):
        sd_config(sd_dir, tmp_path, "data.hflip=true")
    with pytest.raises(ConfigError, match="remove adapter.base"):
        sd_config(sd_dir, tmp_path, "adapter.base=runs/x")


def test_image_size_must_fit_the_vae_and_unet(sd_dir, tmp_path):
    from steadydiff import preflight

    with pytest.raises(ConfigError, match="multiple of the VAE"):
        preflight.check_model(sd_config(sd_dir, tmp_path, "data.image_size=33"))
    with pytest.raises(ConfigError, match="UNet's downsampling"):
        preflight.check_model(sd_config(sd_dir, tmp_path, "data.image_size=34"))


# --------------------------------------------------------------------------- training


def lora_tensors(c: ckpt.Checkpoint) -> dict[str, torch.Tensor]:
    return {k: v for k, v in c.model.items() if "lora" in k}


def test_lora_run_writes_a_diffusers_lora(sd_dir, tmp_path):
    data = shapes(tmp_path / "images")
    res = steadydiff.train(sd_config(sd_dir, data), out_dir=tmp_path / "run")
    assert res.steps == 4 and res.final_loss is not None and np.isfinite(res.final_loss)
    lora = tmp_path / "run" / "lora" / "pytorch_lora_weights.safetensors"
    assert lora.is_file()
    c = ckpt.load_checkpoint(res.checkpoint, "cpu", weights_only=True)
    assert c.model and all("lora" in k for k in c.model)  # the LoRA alone, not the base
    assert json.loads((res.checkpoint / "state.json").read_text())["adapter"]["via"] == "peft"
    # the cache: one latent per image, one text embedding per distinct caption (+ "")
    cache = tmp_path / "run" / "cache"
    assert len(list((cache / "latents").rglob("*.safetensors"))) == 8
    assert len(list((cache / "text").rglob("*.safetensors"))) == 4 + 1  # 4 captions, ""
    # a second run over the same data and VAE reads the cache
    res2 = steadydiff.train(sd_config(sd_dir, data, f"data.cache_dir={cache}",
                                      "train.steps=1"), out_dir=tmp_path / "run2")
    assert res2.steps == 1


def test_lora_run_writes_a_kohya_file_that_a_run_continues_from(sd_dir, tmp_path):
    """adapter.lora_format=both (the default) writes RUN/lora/<run>.safetensors too, with
    the ss_* metadata; adapter.init_from starts a LoRA from it, bit-exactly."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    from steadydiff.integrations.sd.lora_files import kohya_state_dict
    from steadydiff.integrations.sd.setup import build

    data = shapes(tmp_path / "images")
    steadydiff.train(sd_config(sd_dir, data, "optim.lr=0.01"), out_dir=tmp_path / "run")
    kohya = tmp_path / "run" / "lora" / "run.safetensors"
    with safe_open(kohya, "pt") as f:
        meta = f.metadata()
    assert meta["ss_steps"] == "4" and meta["ss_network_dim"] == "4"
    assert meta["ss_output_name"] == "run" and len(meta["ss_new_sd_model_hash"]) == 64
    cfg = sd_config(sd_dir, data, f"adapter.init_from={kohya}")
    model, _, _ = build(cfg, torch.device("cpu"))
    theirs, ours = load_file(kohya), kohya_state_dict(model.unet)
    assert theirs.keys() == ours.keys()
    assert all(torch.equal(theirs[k], ours[k]) for k in ours)
    with pytest.raises(ConfigError, match="adapter.init_from: .*set adapter.rank=4"):
        build(sd_config(sd_dir, data, f"adapter.init_from={kohya}", "adapter.rank=2"),
              torch.device("cpu"))
    with pytest.raises(ConfigError, match="adapter.init_from starts .*needs model.pretrained"):
        load_config("configs/digits_uncond.yaml", ["adapter.init_from=x.safetensors"])


@pytest.mark.parametrize("text_encoder", [False, True])
def test_diffusers_pipeline_loads_the_lora_and_draws_the_same_image(sd_dir, tmp_path,
                                                                    text_encoder):
    """The written LoRA (the UNet's, and the text encoder's with adapter.text_encoder) loads
    into a diffusers pipeline built from the same folder, which then draws the image our
    sampler draws from the same latents."""
    from diffusers import DDIMScheduler, StableDiffusionPipeline
    from safetensors.torch import load_file

    data = shapes(tmp_path / "images", jsonl=True)
    cfg = sd_config(sd_dir, data, "optim.lr=0.01", "sample.use_ema=false",
                    f"adapter.text_encoder={str(text_encoder).lower()}")
    res = steadydiff.train(cfg, out_dir=tmp_path / "run")
    ours = steadydiff.load(tmp_path / "run", device="cpu", use_ema=False)
    gen = torch.Generator().manual_seed(3)
    z = torch.randn(2, 4, 16, 16, generator=gen)
    x, _ = ours.sample(prompt="a red square", negative_prompt=None, sampler="ddim", steps=5,
                       cfg_scale=4.0, noise=z)

    pipe = StableDiffusionPipeline.from_pretrained(sd_dir, local_files_only=True,
                                                   safety_checker=None)
    pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config,
                                               timestep_spacing="trailing",
                                               set_alpha_to_one=True, clip_sample=False)
    before = pipe(["a red square"] * 2, num_inference_steps=5, guidance_scale=4.0,
                  latents=z.clone(), output_type="pt").images
    pipe.load_lora_weights(tmp_path / "run" / "lora")
    theirs = pipe(["a red square"] * 2, num_inference_steps=5, guidance_scale=4.0,
                  latents=z.clone(), output_type="pt").images
    ours01 = x * 0.5 + 0.5
    keys = load_file(tmp_path / "run" / "lora" / "pytorch_lora_weights.safetensors")
    assert any(k.startswith("text_encoder.") for k in keys) == text_encoder
    assert (theirs - before).abs().max() > 1e-3  # the LoRA changed the model
    torch.testing.assert_close(ours01, theirs.float(), atol=2e-3, rtol=0)
    assert res.steps == 4


@pytest.mark.parametrize("text_encoder", ["false", "true"])
def test_resumed_lora_run_equals_uninterrupted_bit_exactly(sd_dir, tmp_path, text_encoder):
    """The #12689 trap: a resumed LoRA run (the UNet's; and the text encoder's) must
    restore the LoRA, its EMA, the optimizer, the data position and the RNG."""
    data = shapes(tmp_path / "images")
    cache = tmp_path / "cache"
    # a cosine LR depends on train.steps
    fixed = ("optim.schedule=constant", f"adapter.text_encoder={text_encoder}")
    straight = steadydiff.train(sd_config(sd_dir, data, f"data.cache_dir={cache}", *fixed,
                                          "train.steps=6", "train.checkpoint_every=3"),
                                out_dir=tmp_path / "straight")
    steadydiff.train(sd_config(sd_dir, data, f"data.cache_dir={cache}", *fixed, "train.steps=3",
                               "train.checkpoint_every=3"), out_dir=tmp_path / "resumed")
    resumed = steadydiff.train(sd_config(sd_dir, data, f"data.cache_dir={cache}", *fixed,
                                         "train.steps=6", "train.checkpoint_every=3"),
                               out_dir=tmp_path / "resumed")
    assert resumed.resumed_from is not None and resumed.steps == 6
    a = ckpt.load_checkpoint(straight.checkpoint, "cpu", weights_only=True)
    b = ckpt.load_checkpoint(resumed.checkpoint, "cpu", weights_only=True)
    assert a.model.keys() == b.model.keys() and a.model
    assert any(k.startswith("text_encoder.") for k in a.model) == (text_encoder == "true")
    for k in a.model:
        assert torch.equal(a.model[k], b.model[k]), k
        assert torch.equal(a.ema[k], b.ema[k]), k
    assert (tmp_path / "resumed" / "lora" / "pytorch_lora_weights.safetensors").is_file()


def test_v_prediction_folder_trains_v_with_min_snr(sd_v_dir, tmp_path):
    data = shapes(tmp_path / "images")
    res = steadydiff.train(sd_config(sd_v_dir, data, "train.steps=2"),
                           out_dir=tmp_path / "run")
    saved = json.loads((res.checkpoint / "state.json").read_text())["config"]
    assert saved["diffusion"]["prediction"] == "v"
    assert saved["diffusion"]["loss_weighting"] == "min_snr"


def test_full_fine_tune_is_saved_as_a_diffusers_folder(sd_dir, tmp_path):
    from diffusers import StableDiffusionPipeline

    data = shapes(tmp_path / "images")
    res = steadydiff.train(sd_config(sd_dir, data, "adapter.kind=none", "train.steps=2",
                                     "optim.lr=0.01"), out_dir=tmp_path / "run")
    out = tmp_path / "run" / "model"
    pipe = StableDiffusionPipeline.from_pretrained(out, local_files_only=True,
                                                   safety_checker=None)
    base = StableDiffusionPipeline.from_pretrained(sd_dir, local_files_only=True,
                                                   safety_checker=None)
    trained = dict(pipe.unet.named_parameters())
    changed = [n for n, p in base.unet.named_parameters()
               if not torch.equal(p, trained[n])]
    assert changed  # the UNet trained; the text encoder and VAE are the base's
    assert res.steps == 2


def test_sample_command_takes_a_prompt(sd_dir, tmp_path, capsys):
    from steadydiff.cli import main

    data = shapes(tmp_path / "images")
    steadydiff.train(sd_config(sd_dir, data, "train.steps=2"), out_dir=tmp_path / "run")
    out = tmp_path / "s.png"
    rc = main(["sample", str(tmp_path / "run"), "--prompt", "a blue circle",
               "--negative-prompt", "a red square", "--cfg-scale", "3", "--num", "2",
               "--steps", "2", "--out", str(out), "--device", "cpu"])
    assert rc == 0 and out.is_file()
    assert Image.open(out).size[0] >= 32
    assert main(["sample", str(tmp_path / "run"), "--class-label", "1", "--out",
                 str(tmp_path / "s2.png"), "--device", "cpu"]) == 2
    assert "conditioned on text" in capsys.readouterr().err


@pytest.mark.parametrize("prediction, folder", [("eps", "sd_dir"), ("v", "sd_v_dir")])
def test_min_snr_weights_match_the_closed_form_for_the_folders_prediction(prediction, folder,
                                                                            request):
    """min-SNR-γ (Hang et al. 2023): min(snr, γ)/snr for eps, min(snr, γ)/(snr+1) for v (the
    form diffusers' scripts use since #9451), on the folder's own schedule."""
    from diffusers import DDPMScheduler
    from diffusers.training_utils import compute_snr

    from steadydiff.diffusion import make_schedule
    from steadydiff.diffusion.objectives import loss_weights
    from steadydiff.integrations.sd.source import resolve_config

    sd = request.getfixturevalue(folder)
    cfg, _ = resolve_config(sd_config(sd, sd, "diffusion.min_snr_gamma=5"))
    assert cfg.diffusion.prediction == prediction
    t = torch.tensor([0, 10, 100, 400, 700, 999])
    snr_ours = make_schedule(cfg.diffusion).snr(t)
    sched = DDPMScheduler.from_pretrained(sd, subfolder="scheduler")
    snr = compute_snr(sched, t)
    torch.testing.assert_close(snr_ours.float(), snr.float(), rtol=1e-4, atol=0)
    closed = torch.minimum(snr, torch.full_like(snr, 5.0))
    closed = closed / snr if prediction == "eps" else closed / (snr + 1)
    torch.testing.assert_close(loss_weights(cfg.diffusion, snr_ours).float(), closed.float(),
                               rtol=1e-4, atol=0)


# --------------------------------------------------------------------------- the guard


def incidents(run: Path) -> list[dict]:
    p = run / "incidents.jsonl"
    return [json.loads(line) for line in p.read_text().splitlines()] if p.exists() else []


CROSS_ATTN = "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn2"


@pytest.mark.parametrize("fault, kind, check", [
    # a NaN in one sample of a caption batch's latents: that sample is named and dropped
    ({"kind": "nan_batch", "step": 2}, "bad_batch",
     lambda inc: inc["action"] == "drop_samples" and len(inc["evidence"]["samples"]) == 1
     and inc["evidence"]["samples"][0]["source"].endswith(".png")),
    # the loss of one step x 1e8: a per-timestep-bucket spike, skipped
    ({"kind": "loss_scale", "step": 5, "factor": 1e8}, "loss_spike",
     lambda inc: inc["action"] in ("skip", "drop_samples") and inc["evidence"]["ratio"] > 1e6),
])
def test_guard_catches_faults_on_the_sd_path(sd_dir, tmp_path, fault, kind, check):
    data = shapes(tmp_path / "images")
    cfg = sd_config(sd_dir, data, "train.steps=7", "train.checkpoint_every=0",
                    "guard.warmup_steps=3", f"faults={json.dumps([fault])}")
    res = steadydiff.train(cfg, out_dir=tmp_path / "run")
    assert res.steps == 7
    rows = [r for r in incidents(tmp_path / "run") if r["kind"] == kind]
    assert rows and check(rows[0]), incidents(tmp_path / "run")
    c = ckpt.load_checkpoint(res.checkpoint, "cpu", weights_only=True)
    assert all(torch.isfinite(v).all() for v in c.model.values())
    lora = tmp_path / "run" / "lora" / "pytorch_lora_weights.safetensors"
    from safetensors.torch import load_file
    assert all(torch.isfinite(v).all() for v in load_file(lora).values())


def test_fp16_overflow_in_a_cross_attention_layer_upcasts_that_layer(sd_dir, tmp_path):
    """fp16: the cross-attention of the first transformer block overflows; the guard names
    it, skips the step and computes that layer's attention in fp32 from then on (diffusers'
    classic processor, through the upcast-aware one); the run ends finite."""
    data = shapes(tmp_path / "images")
    cfg = sd_config(sd_dir, data, "train.steps=4", "train.checkpoint_every=0",
                    "train.precision=fp16", "train.allow_slow_precision=true",
                    "model.vae_precision=fp32",
                    f"faults={json.dumps([{'kind': 'fp16_overflow', 'step': 1, 'target': CROSS_ATTN}])}")
    res = steadydiff.train(cfg, out_dir=tmp_path / "run")
    assert res.steps == 4
    rows = incidents(tmp_path / "run")
    assert rows[0]["kind"] == "attention_upcast" and rows[0]["evidence"]["module"] == CROSS_ATTN
    state = json.loads((res.checkpoint / "state.json").read_text())
    assert state["guard"]["upcast_attention"] == [CROSS_ATTN]
    c = ckpt.load_checkpoint(res.checkpoint, "cpu", weights_only=True)
    assert all(torch.isfinite(v).all() for v in c.model.values())


def test_upcast_aware_processor_follows_the_attribute(sd_dir):
    from diffusers import UNet2DConditionModel
    from diffusers.models.attention_processor import AttnProcessor

    from steadydiff.integrations.sd.model import upcast_aware_attention

    unet = UNet2DConditionModel.from_pretrained(sd_dir / "unet", local_files_only=True)
    upcast_aware_attention(unet)
    attn = dict(unet.named_modules())[CROSS_ATTN.removeprefix("unet.")]
    calls = []
    real = AttnProcessor.__call__

    def spy(self, *a, **k):
        calls.append(1)
        return real(self, *a, **k)

    x = torch.randn(1, 4, 16, 16)
    ctx = torch.randn(1, 77, 32)
    AttnProcessor.__call__ = spy
    try:
        unet(x, torch.tensor([10]), encoder_hidden_states=ctx)
        assert not calls  # the fast path everywhere
        attn.upcast_attention = True
        unet(x, torch.tensor([10]), encoder_hidden_states=ctx)
        assert len(calls) == 1  # that layer only
    finally:
        AttnProcessor.__call__ = real


def test_precision_fallback_casts_the_frozen_fp16_base(sd_dir, tmp_path):
    """When the runtime precision leaves fp16 (the guard's fallback, or a resumed run that
    had fallen back), the frozen fp16 UNet base follows, in the model and the EMA's shared
    copy, else every later step would mix fp32 inputs with fp16 weights; the LoRA and its
    EMA stay fp32, and a step runs."""
    from steadydiff.integrations.sd.source import resolve_config
    from steadydiff.trainer.loop import build_state, train_step
    from steadydiff.trainer.state import set_precision

    cfg, _ = resolve_config(sd_config(sd_dir, tmp_path, "train.precision=fp16",
                                      "train.allow_slow_precision=true"))
    state = build_state(cfg, 0, torch.device("cpu"))
    frozen = [p for p in state.model.parameters() if not p.requires_grad]
    lora = [p for p in state.model.parameters() if p.requires_grad]
    assert {p.dtype for p in frozen} == {torch.float16}
    set_precision(state, "fp32")
    assert {p.dtype for p in frozen} == {torch.float32}
    assert {p.dtype for p in lora} == {torch.float32}
    assert {p.dtype for p in state.ema.module.parameters()} == {torch.float32}
    x = torch.randn(4, 4, 16, 16)
    ctx = torch.randn(4, 77, 32)
    out = train_step(state, (x, ctx, torch.arange(4)))
    assert torch.isfinite(out.loss)


@pytest.mark.parametrize("poison", ["fp16_only", "both"])
def test_nonfinite_latent_is_reencoded_in_fp32_or_quarantined(sd_dir, tmp_path, monkeypatch,
                                                              poison):
    """An image whose latent comes out non-finite from the fp16 VAE (sd-scripts #653) is
    encoded again in fp32; if that is non-finite too the sample is left out, named in a
    sample_quarantined incident, and the run trains on the rest: never a crash, never a NaN
    latent in training."""
    from steadydiff.integrations.sd.model import TextToImage

    data = shapes(tmp_path / "images")
    real = TextToImage.encode_images

    def encode(self, x, dtype=None):
        z = real(self, x, dtype)
        dtype = dtype or self.vae_dtype
        # the image with the square lowest in the frame (img07) breaks the encoder
        bad = (x[:, 2, 27, 16] < 0.5).to(z.device)  # a yellow pixel where others are white
        if poison == "both" or dtype == torch.float16:
            z[bad] = float("nan")
        return z

    monkeypatch.setattr(TextToImage, "encode_images", encode)
    cfg = sd_config(sd_dir, data, "train.steps=2", "model.vae_precision=fp16",
                    "train.checkpoint_every=0")
    res = steadydiff.train(cfg, out_dir=tmp_path / "run")
    assert res.steps == 2
    rows = [r for r in incidents(tmp_path / "run") if r["kind"] == "sample_quarantined"]
    n_latents = len(list((tmp_path / "run" / "cache" / "latents").rglob("*.safetensors")))
    if poison == "both":
        assert len(rows) == 1 and rows[0]["evidence"]["source"].endswith("img07.png")
        assert n_latents == 7  # a non-finite latent is never cached
    else:
        assert not rows and n_latents == 8


@pytest.mark.parametrize("space", ["pixel", "latent"])
@pytest.mark.parametrize("kind", ["unet", "dit"])
def test_own_text_conditioned_model_trains_and_samples_a_prompt(sd_dir, tmp_path, space, kind):
    """steadydiff's own UNet/DiT with cross-attention over a text encoder's tokens, on the
    bundled digits captioned from their class names, in pixel space or in the latent space
    of a diffusers AutoencoderKL folder; `sample --prompt` draws from it."""
    sets = ["data.dataset=digits", "data.captions=class_names", "model.num_classes=0",
            f"model.kind={kind}", f"model.text_encoder={sd_dir}", "data.image_size=8",
            "model.unet.channels=16", "model.unet.channel_mult=[1,2]",
            "model.unet.attention_resolutions=[4]", "model.unet.head_channels=8",
            "model.unet.norm_groups=4", "model.dit.patch_size=2", "train.steps=3",
            "train.batch_size=8", "train.sample_every=0", "train.checkpoint_every=0",
            "train.device=cpu", "sample.num=2", "sample.steps=2", "optim.warmup_steps=0",
            "logging.progress=false"]
    if space == "latent":
        sets += [f"model.vae={sd_dir}", "data.image_size=16", "data.channels=3",
                 "model.unet.attention_resolutions=[8]"]
    res = steadydiff.train(load_config(None, sets), out_dir=tmp_path / "run")
    assert res.steps == 3
    pipe = steadydiff.load(tmp_path / "run", device="cpu")
    assert pipe.model.context_dim == 32
    x, _ = pipe.sample(2, prompt="a photo of a seven", steps=2, cfg_scale=2.0)
    assert x.shape == (2, 1 if space == "pixel" else 3, 8 if space == "pixel" else 16,
                       8 if space == "pixel" else 16)
    assert torch.isfinite(x).all()
    # the checkpoint carries its null condition: the empty caption's encoding
    assert pipe.model.null_context.abs().sum() > 0


def test_a_prompt_is_refused_by_a_class_model():
    pipe = steadydiff.load(Path(__file__).parent / "fixtures" / "v1_unet_run", device="cpu")
    with pytest.raises(ValueError, match="not conditioned on text"):
        pipe.sample(2, prompt="a photo of a seven", steps=2)


# --------------------------------------------------------------------------- captions


def tagged(root: Path, n: int = 8) -> Path:
    """``shapes`` with comma-separated tag captions (shuffle has something to permute), one
    caption far over CLIP's 77 tokens."""
    shapes(root, n)
    for i in range(n):
        (root / f"img{i:02d}.txt").write_text(
            f"{list(COLORS)[i % 4]}, {'square' if i % 2 == 0 else 'circle'}, small, centered, "
            "white background, flat")
    (root / "img03.txt").write_text(", ".join(f"tag{k}" for k in range(60)))
    return root


def test_shuffled_captions_with_dropout_train_and_resume_bit_exactly(sd_dir, tmp_path, capsys):
    """Tag shuffle (encoded in the step) + caption dropout + a trigger: a resumed run equals an
    uninterrupted one; the over-long caption is a warning naming its file."""
    data = tagged(tmp_path / "images")
    fixed = ("optim.schedule=constant", "data.caption_shuffle=true", "data.keep_tokens=1",
             "data.caption_dropout=0.3", "data.trigger=sks", f"data.cache_dir={tmp_path / 'c'}",
             "train.checkpoint_every=3")
    straight = steadydiff.train(sd_config(sd_dir, data, *fixed, "train.steps=6"),
                                out_dir=tmp_path / "straight")
    out = capsys.readouterr().out  # the start-of-run warning, printed once
    assert "img03.png" in out and out.count("1 of 8 captions") == 1
    steadydiff.train(sd_config(sd_dir, data, *fixed, "train.steps=3"),
                     out_dir=tmp_path / "resumed")
    resumed = steadydiff.train(sd_config(sd_dir, data, *fixed, "train.steps=6"),
                               out_dir=tmp_path / "resumed")
    assert resumed.resumed_from is not None and resumed.steps == 6
    a = ckpt.load_checkpoint(straight.checkpoint, "cpu", weights_only=True)
    b = ckpt.load_checkpoint(resumed.checkpoint, "cpu", weights_only=True)
    assert a.model.keys() == b.model.keys() and a.model
    assert not any(k.startswith("text_encoder.") for k in a.model)  # frozen: not saved
    for k in a.model:
        assert torch.equal(a.model[k], b.model[k]), k
        assert torch.equal(a.ema[k], b.ema[k]), k


def test_encoded_dataset_varies_captions_per_epoch(sd_dir, tmp_path):
    """The items the loader sees: shuffled token ids that change with the epoch and keep the
    trigger first; with dropout alone, the cached null embedding."""
    from steadydiff.data.captions import CaptionVariants
    from steadydiff.data.cache import EncodedDataset, TextResult
    from steadydiff.integrations.sd.source import load_parts
    from steadydiff.integrations.sd.setup import Tokenize

    tok = load_parts(sd_dir).tokenizer
    t = Tokenize(tok, 77)
    caps = ["sks, a, b, c, d, e, f", "sks, g, h, i, j, k, l"]

    class Two(torch.utils.data.Dataset):
        def __len__(self):
            return 2

        def __getitem__(self, i):
            return torch.zeros(3, 8, 8), caps[i]

    texts = TextResult(contexts=t(caps), captions=caps, caption_index=torch.tensor([0, 1]),
                       null=t([""])[0])
    ds = EncodedDataset(Two(), None, texts, tokenize=t, variants=CaptionVariants(
        0, shuffle=True, keep_tokens=0, trigger="sks"))
    from steadydiff.data import SeededView

    view = SeededView(ds, seed=0)  # what the loader indexes: (item, epoch) keys
    ids = [view[(0, e)][1] for e in range(4)]
    assert len({tuple(x.tolist()) for x in ids}) > 1
    for x in ids:
        text = tok.decode(x, skip_special_tokens=True)
        assert text.startswith("sks") and sorted(text.replace(" ", "").split(",")[1:]) == \
            list("abcdef")
    ctx = TextResult(contexts=torch.randn(2, 4, 3), captions=caps,
                     caption_index=torch.tensor([0, 1]), null=torch.zeros(4, 3))
    ds = EncodedDataset(Two(), None, ctx, variants=CaptionVariants(0, dropout=0.5))
    view = SeededView(ds, seed=0)
    got = [bool((view[(1, e)][1] == 0).all()) for e in range(40)]
    assert 5 < sum(got) < 35
    assert not any(bool((ds[1][1] == 0).all()) for _ in range(3))  # plain indexing: no dropout


def test_full_fine_tune_with_shuffle_keeps_the_frozen_text_encoder_out_of_checkpoints(
        sd_dir, tmp_path):
    from steadydiff.integrations.sd.setup import load_trained

    data = tagged(tmp_path / "images")
    sets = ("adapter.kind=none", "data.caption_shuffle=true", "train.steps=2",
            "train.checkpoint_every=2")
    res = steadydiff.train(sd_config(sd_dir, data, *sets), out_dir=tmp_path / "run")
    c = ckpt.load_checkpoint(res.checkpoint, "cpu", weights_only=True)
    assert c.model and not any(k.startswith("text_encoder.") for k in c.model)
    assert any(k.startswith("unet.") for k in c.model)
    model, _ = load_trained(c, sd_config(sd_dir, data, *sets))
    assert model.text_encoder is not None  # from the base folder: encodes the step's ids
    torch.testing.assert_close(model.state_dict()["unet.conv_in.weight"],
                               c.ema["unet.conv_in.weight"])
