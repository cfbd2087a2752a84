"""ControlNets for the transformer families (SD3/SD3.5, FLUX.1) on tiny folders built from
configs: a run initialises the ControlNet from the frozen transformer
(``SD3ControlNetModel`` / ``FluxControlNetModel.from_transformer``), trains it on the
VAE-encoded conditioning image with the family's flow-matching loss, writes the diffusers
folder (``from_pretrained`` loads it) and the one .safetensors ComfyUI's loader recognises
(diffusers keys), samples what diffusers' ControlNet pipeline draws from the same noise,
resumes exactly, and is guarded (a NaN conditioning image from the user's own data, an
exploding ControlNet output layer named, never a non-finite ControlNet saved)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("cv2")

import steadydiff  # noqa: E402
from steadydiff.config import ConfigError, load_config  # noqa: E402
from steadydiff.data.conditioning import make_conditioning  # noqa: E402
from steadydiff.trainer import checkpoint as ckpt  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from test_sd import incidents, shapes  # noqa: E402

CLASSES = {"sd3": "SD3ControlNetModel", "flux": "FluxControlNetModel"}
PIPES = {"sd3": "StableDiffusion3ControlNetPipeline", "flux": "FluxControlNetPipeline"}
# which loader ComfyUI's load_controlnet_state_dict (comfy/controlnet.py) picks for a file,
# by its keys, in ComfyUI's order
COMFY_LOADER = {"sd3": "load_controlnet_mmdit", "flux": "load_controlnet_flux_instantx"}


def comfy_loader(keys: set[str]) -> str:
    if "controlnet_cond_embedding.conv_in.weight" in keys:
        return "diffusers UNet ControlNet"
    if "controlnet_blocks.0.weight" in keys:
        if "double_blocks.0.img_attn.norm.key_norm.scale" in keys:
            return "load_controlnet_flux_xlabs_mistoline"
        if "pos_embed_input.proj.weight" in keys:
            return ("load_controlnet_sd35" if "transformer_blocks.0.adaLN_modulation.1.bias"
                    in keys else "load_controlnet_mmdit")
        if "transformer_blocks.0.img_mlp.net.0.proj.weight" in keys:
            return "load_controlnet_qwen_instantx"
        if "controlnet_x_embedder.weight" in keys:
            return "load_controlnet_flux_instantx"
    return "none"
CN = ("adapter.kind=none", "controlnet.enabled=true", "data.conditioning=folder")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    from steadydiff.integrations.sd.tiny import make_tiny

    root = tmp_path_factory.mktemp("cnflow")
    return {f: make_tiny(root / f, f, image_size=32) for f in ("sd3", "flux")}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    d = shapes(tmp_path_factory.mktemp("pairs") / "images", 8)
    make_conditioning(d, None, "canny", {"low": 50, "high": 150})
    return d


def cn_config(folder: Path, data: Path, fam: str, *sets: str):
    base = [f"model.pretrained={folder}", f"data.path={data}", "data.image_size=32",
            "train.steps=3", "train.batch_size=4", "train.precision=fp32",
            "train.checkpoint_every=3", "train.sample_every=0", "train.num_threads=1",
            "train.device=cpu", "train.gradient_checkpointing=false", "sample.num=2",
            "sample.steps=2", "optim.warmup_steps=0", "logging.log_every=1",
            "guard.warmup_steps=3", "data.num_workers=0", *CN]
    return load_config(f"configs/{fam}_lora.yaml", base + list(sets))


@pytest.fixture(scope="module")
def trained(folders, data, tmp_path_factory) -> dict[str, Path]:
    """A short run per family at a high LR (the zero-initialised layers move off zero),
    with a validation prompt drawn with its conditioning image."""
    out = {}
    for fam in ("sd3", "flux"):
        run = tmp_path_factory.mktemp(f"cn-{fam}") / "run"
        res = steadydiff.train(cn_config(folders[fam], data, fam, "optim.lr=0.02",
                                         "sample.use_ema=false", "train.sample_every=3",
                                         "sample.prompts=['a red square']"), out_dir=run)
        assert res.steps == 3
        out[fam] = run
    return out


@pytest.mark.parametrize("fam", ["sd3", "flux"])
def test_the_controlnet_trains_from_the_transformer_and_is_written_for_diffusers_and_comfyui(
        trained, folders, fam):
    import diffusers
    from safetensors.torch import load_file

    from steadydiff.integrations.controlnet import load_controlnet

    run = trained[fam]
    c = ckpt.load_checkpoint(ckpt.resolve_checkpoint(run), "cpu", weights_only=True)
    assert c.model and all(k.startswith("controlnet.") for k in c.model)  # base frozen
    cls = getattr(diffusers, CLASSES[fam])
    net = cls.from_pretrained(run / "controlnet", local_files_only=True)
    assert json.loads((run / "controlnet" / "config.json").read_text())["_class_name"] \
        == CLASSES[fam]
    params = dict(net.named_parameters())
    assert params["controlnet_blocks.0.weight"].abs().max() > 0  # the zero layer learned
    for n, p in params.items():
        torch.testing.assert_close(p, c.model[f"controlnet.{n}"], rtol=0, atol=0)
    # initialised from the base transformer: its copied blocks started from the base's
    base = getattr(diffusers, {"sd3": "SD3Transformer2DModel",
                               "flux": "FluxTransformer2DModel"}[fam]).from_pretrained(
        folders[fam] / "transformer", local_files_only=True)
    # min(diffusers' trainers' default, the base's blocks; SD3: not its last)
    assert net.config.num_layers == base.config.num_layers - (fam == "sd3")
    if fam == "flux":
        assert net.config.num_single_layers == base.config.num_single_layers
    # the single file: diffusers keys, the ones ComfyUI's loader tells this layout by
    single = load_file(run / "controlnet" / "run.safetensors")
    assert set(single) == set(net.state_dict())
    assert comfy_loader(set(single)) == COMFY_LOADER[fam]
    again = load_controlnet(run / "controlnet" / "run.safetensors", CLASSES[fam])
    for n, p in again.state_dict().items():
        assert torch.equal(p, single[n]), n
    side = json.loads((run / "samples" / "step_00000003" / "prompts.json").read_text())
    assert side["prompts"][0]["finite"] and side["prompts"][0]["error"] is None
    state = json.loads((ckpt.resolve_checkpoint(run) / "state.json").read_text())
    assert state["adapter"]["kind"] == "controlnet" and state["adapter"]["family"] == fam


@pytest.fixture
def posterior_mean(monkeypatch):
    """diffusers' ControlNet pipelines encode the control image with a draw from the VAE
    posterior; steadydiff uses its mean (deterministic, as the cached training latents):
    compared with the pipeline's draw replaced by the mean."""
    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

    monkeypatch.setattr(DiagonalGaussianDistribution, "sample",
                        lambda self, generator=None: self.mean)


@pytest.mark.parametrize("fam, scale, start, end", [("sd3", 1.0, 0.0, 1.0),
                                                     ("sd3", 0.7, 0.25, 0.75),
                                                     ("flux", 1.0, 0.0, 1.0),
                                                     ("flux", 0.6, 0.0, 0.5)])
def test_sampling_equals_the_diffusers_controlnet_pipeline(trained, folders, posterior_mean,
                                                           fam, scale, start, end):
    import diffusers
    from diffusers.pipelines.flux.pipeline_flux import FluxPipeline

    from PIL import Image

    ours = steadydiff.load(trained[fam], device="cpu", use_ema=False)
    # the control image as users hand it over: an 8-bit picture (the pipeline normalises a
    # PIL image to [-1, 1]; steadydiff takes [0, 1])
    pixels = torch.randint(0, 256, (32, 32, 3), generator=torch.Generator().manual_seed(1),
                           dtype=torch.uint8)
    picture = Image.fromarray(pixels.numpy())
    control = (pixels.permute(2, 0, 1)[None].float() / 255)
    z = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(3))
    cfg = 3.0 if fam == "sd3" else 1.0
    kw = dict(prompt="a red square", negative_prompt=None, sampler="euler", steps=4,
              cfg_scale=cfg, noise=z)
    x, _ = ours.sample(**kw, control_image=control, control_scale=scale, control_start=start,
                       control_end=end)
    net = getattr(diffusers, CLASSES[fam]).from_pretrained(trained[fam] / "controlnet",
                                                           local_files_only=True)
    pipe = getattr(diffusers, PIPES[fam]).from_pretrained(folders[fam], controlnet=net,
                                                          local_files_only=True)
    common = dict(height=32, width=32, num_inference_steps=4, control_image=picture,
                  controlnet_conditioning_scale=scale, control_guidance_start=start,
                  control_guidance_end=end, output_type="pt")
    if fam == "flux":
        theirs = pipe(["a red square"] * 2, guidance_scale=3.5,
                      latents=FluxPipeline._pack_latents(z.clone(), 2, 4, 16, 16),
                      **common).images
    else:
        theirs = pipe(["a red square"] * 2, guidance_scale=cfg, latents=z.clone(),
                      **common).images
    torch.testing.assert_close(x * 0.5 + 0.5, theirs.float(), atol=2e-3, rtol=0)
    off, _ = ours.sample(**kw, control_image=control, control_scale=0.0)
    assert (off - x).abs().max() > 1e-3  # the control changes the image


def test_a_run_continues_from_a_local_controlnet_folder_and_single_file(trained, folders,
                                                                        data, tmp_path):
    """controlnet.init_from: the run's folder (and the single file beside its config)
    starts where the first run ended; a ControlNet of the other family is refused by
    class."""
    from steadydiff.integrations.sd.setup import build
    from steadydiff.integrations.sd.source import resolve_config

    src = trained["sd3"] / "controlnet"
    for init in (src, src / "run.safetensors"):
        cfg = cn_config(folders["sd3"], data, "sd3", f"controlnet.init_from={init}")
        model, _, _ = build(resolve_config(cfg)[0], torch.device("cpu"))
        saved = ckpt.load_checkpoint(ckpt.resolve_checkpoint(trained["sd3"]), "cpu",
                                     weights_only=True).model
        for n, p in model.controlnet.named_parameters():
            assert torch.equal(p.detach(), saved[f"controlnet.{n}"]), n
    with pytest.raises(ConfigError, match="SD3ControlNetModel.*FluxControlNetModel"):
        build(resolve_config(cn_config(folders["flux"], data, "flux",
                                       f"controlnet.init_from={src}"))[0],
              torch.device("cpu"))


def test_layer_counts_and_channels_are_checked(folders, data):
    from steadydiff.integrations.sd.setup import build
    from steadydiff.integrations.sd.source import resolve_config

    cfg = cn_config(folders["flux"], data, "flux", "controlnet.num_layers=1",
                    "controlnet.num_single_layers=1")
    model, _, _ = build(resolve_config(cfg)[0], torch.device("cpu"))
    assert len(model.controlnet.transformer_blocks) == 1 \
        and len(model.controlnet.single_transformer_blocks) == 1
    with pytest.raises(ConfigError, match="num_single_layers applies to FLUX"):
        build(resolve_config(cn_config(folders["sd3"], data, "sd3",
                                       "controlnet.num_single_layers=1"))[0],
              torch.device("cpu"))
    with pytest.raises(ConfigError, match="through the VAE.*conditioning_channels=3"):
        build(resolve_config(cn_config(folders["sd3"], data, "sd3",
                                       "controlnet.conditioning_channels=1"))[0],
              torch.device("cpu"))


@pytest.mark.parametrize("fam", ["flux"])
def test_resumed_controlnet_run_equals_uninterrupted_bit_exactly(folders, data, tmp_path, fam):
    fixed = ("optim.schedule=constant", "data.caption_dropout=0.3",
             f"data.cache_dir={tmp_path / 'cache'}", "train.checkpoint_every=2")
    straight = steadydiff.train(cn_config(folders[fam], data, fam, *fixed, "train.steps=4"),
                                out_dir=tmp_path / "straight")
    steadydiff.train(cn_config(folders[fam], data, fam, *fixed, "train.steps=2"),
                     out_dir=tmp_path / "resumed")
    resumed = steadydiff.train(cn_config(folders[fam], data, fam, *fixed, "train.steps=4"),
                               out_dir=tmp_path / "resumed")
    assert resumed.resumed_from is not None
    a = ckpt.load_checkpoint(straight.checkpoint, "cpu", weights_only=True)
    b = ckpt.load_checkpoint(resumed.checkpoint, "cpu", weights_only=True)
    assert a.model.keys() == b.model.keys() and a.model
    for k in a.model:
        assert torch.equal(a.model[k], b.model[k]), k
        assert torch.equal(a.ema[k], b.ema[k]), k


@pytest.mark.parametrize("fam", ["sd3"])
def test_a_nan_conditioning_image_is_dropped_and_nothing_non_finite_is_saved(
        folders, data, tmp_path, fam):
    from safetensors.torch import load_file

    from steadydiff.integrations.controlnet import save_controlnet
    from steadydiff.trainer.checkpoint import CheckpointError

    from test_controlnet import NaNPairs

    cfg = cn_config(folders[fam], data, fam, "train.steps=8", "train.checkpoint_every=0",
                    "guard.warmup_steps=0", "data.conditioning=none")
    res = steadydiff.train(cfg, NaNPairs(data, bad=5), out_dir=tmp_path / "run")
    assert res.steps == 8
    rows = incidents(tmp_path / "run")
    drops = [r for r in rows if r["action"] == "drop_samples"]
    assert drops, rows  # the VAE-encoded NaN reached the loss; its pair is named
    s = drops[0]["evidence"]["samples"][0]
    assert s["index"] == 5 and "img05.png" in s["source"] \
        and "conditioning depth/img05.npy" in s["source"]
    c = ckpt.load_checkpoint(res.checkpoint, "cpu", weights_only=True)
    # a ControlNet whose weight went non-finite (from outside) is refused whole
    import diffusers

    net = getattr(diffusers, CLASSES[fam]).from_pretrained(tmp_path / "run" / "controlnet",
                                                           local_files_only=True)
    with torch.no_grad():
        net.controlnet_blocks[0].weight[0, 0] = float("inf")
    with pytest.raises(CheckpointError, match="non-finite.*controlnet_blocks.0.weight"):
        save_controlnet(net, tmp_path / "bad", single_file="x.safetensors", original=False)
    assert not (tmp_path / "bad" / "diffusion_pytorch_model.safetensors").exists()
    assert all(torch.isfinite(v).all() for v in c.model.values())
    f = tmp_path / "run" / "controlnet" / "diffusion_pytorch_model.safetensors"
    assert all(torch.isfinite(v).all() for v in load_file(f).values())


@pytest.mark.parametrize("fam, zero", [("flux", "controlnet.controlnet_single_blocks.0.weight"),
                                       ("sd3", "controlnet.controlnet_blocks.0.weight")])
def test_an_exploding_controlnet_output_layer_is_named_and_rolled_back(folders, data, tmp_path,
                                                                      fam, zero):
    """A zero-initialised output linear of the transformer ControlNet blown up x1e4 after an
    update: the guard names it and rolls back; the run ends finite."""
    fault = {"kind": "param_huge", "step": 2, "factor": 1e4, "target": zero}
    res = steadydiff.train(cn_config(folders[fam], data, fam, "train.steps=5", "optim.lr=0.01",
                                     "train.checkpoint_every=0", "guard.warmup_steps=1",
                                     f"faults={json.dumps([fault])}"), out_dir=tmp_path / "run")
    assert res.steps == 5
    rows = incidents(tmp_path / "run")
    assert rows and rows[0]["action"] == "rollback" and rows[0]["evidence"]["params"][0] == zero
    c = ckpt.load_checkpoint(res.checkpoint, "cpu", weights_only=True)
    assert all(torch.isfinite(v).all() for v in c.model.values())


def test_sample_command_takes_control_and_a_flux_lora(trained, folders, data, tmp_path):
    """`steadydiff sample RUN --control-image F --lora L`: a FLUX.1 LoRA trained in its own
    run, fused into the ControlNet run's base, changes the controlled image."""
    from steadydiff.cli import main

    lora_cfg = load_config("configs/flux_lora.yaml", [
        f"model.pretrained={folders['flux']}", f"data.path={shapes(tmp_path / 'plain', 4)}",
        "data.image_size=32",
        "train.steps=2", "train.batch_size=4", "train.precision=fp32", "train.device=cpu",
        "train.checkpoint_every=2", "train.sample_every=0", "train.num_threads=1",
        "optim.lr=0.02", "optim.warmup_steps=0", "data.num_workers=0", "adapter.rank=4",
        "adapter.alpha=4", "train.gradient_checkpointing=false"])
    steadydiff.train(lora_cfg, out_dir=tmp_path / "lora_run")
    lora = tmp_path / "lora_run" / "lora"
    img = next((data / "conditioning").glob("*.png"))
    ours = steadydiff.load(trained["flux"], device="cpu", use_ema=False)
    z = torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(5))
    kw = dict(prompt="a red square", negative_prompt=None, sampler="euler", steps=3,
              cfg_scale=1.0, noise=z, control_image=str(img), control_scale=0.8)
    plain, _ = ours.sample(**kw)
    ours.load_lora(lora, 1.0)
    both, _ = ours.sample(**kw)
    assert torch.isfinite(both).all() and (both - plain).abs().max() > 1e-3
    out = tmp_path / "s.png"
    assert main(["sample", str(trained["flux"]), "--prompt", "a red square", "--control-image",
                 str(img), "--lora", f"{lora}:0.7", "--control-scale", "0.5", "--control-end",
                 "0.9", "--num", "1", "--steps", "2", "--out", str(out), "--device",
                 "cpu"]) == 0
    assert out.is_file()


def test_fp16_overflow_in_a_controlnet_joint_attention_block_upcasts_that_block(
        folders, data, tmp_path):
    """fp16 on FLUX.1, continuing a user's ControlNet whose first joint-attention block's
    query projection is scaled (from outside: weights that fit fp16, the largest at 3e4,
    activations that do not): the guard names that block
    (``controlnet.transformer_blocks.0.attn``), skips the step and runs it in fp32 from then
    on; the run and its ControlNet end finite."""
    from diffusers import FluxControlNetModel, FluxTransformer2DModel

    base = FluxTransformer2DModel.from_pretrained(folders["flux"] / "transformer",
                                                  local_files_only=True)
    net = FluxControlNetModel.from_transformer(base, num_layers=1, num_single_layers=1,
                                               attention_head_dim=8, num_attention_heads=2)
    with torch.no_grad():
        q = net.transformer_blocks[0].attn.to_q.weight
        q.mul_(3e4 / q.abs().max())
    net.save_pretrained(tmp_path / "hot_controlnet")
    block = "controlnet.transformer_blocks.0.attn"
    cfg = cn_config(folders["flux"], data, "flux", "train.steps=3", "train.checkpoint_every=0",
                    "train.precision=fp16", "train.allow_slow_precision=true",
                    "model.vae_precision=fp32",
                    f"controlnet.init_from={tmp_path / 'hot_controlnet'}")
    res = steadydiff.train(cfg, out_dir=tmp_path / "run")
    assert res.steps == 3
    rows = incidents(tmp_path / "run")
    assert rows[0]["kind"] == "attention_upcast" and rows[0]["evidence"]["module"] == block
    state = json.loads((res.checkpoint / "state.json").read_text())
    assert state["guard"]["upcast_attention"] == [block]
    c = ckpt.load_checkpoint(res.checkpoint, "cpu", weights_only=True)
    assert all(torch.isfinite(v).all() for v in c.model.values())


@pytest.mark.parametrize("fam", ["flux"])
def test_bucketed_run_trains_non_square_pairs(folders, tmp_path, fam):
    """Non-square buckets: the conditioning image is VAE-encoded (and, FLUX, packed 2x2) at
    its bucket's size, like the latents."""
    import numpy as np
    from PIL import Image

    d = tmp_path / "images"
    d.mkdir()
    for i, (w, h) in enumerate([(48, 32), (32, 48), (48, 32), (32, 32)]):
        a = np.full((h, w, 3), 240, np.uint8)
        a[4:20, 4 + i:20 + i] = (200, 30, 30)
        Image.fromarray(a).save(d / f"img{i}.png")
        (d / f"img{i}.txt").write_text("a red square")
    make_conditioning(d, None, "canny", {"low": 50, "high": 150})
    res = steadydiff.train(cn_config(folders[fam], d, fam, "data.buckets=true",
                                     "data.bucket_step=16", "train.batch_size=2"),
                           out_dir=tmp_path / "run")
    assert res.steps == 3
    assert json.loads((tmp_path / "run" / "buckets.json").read_text())["buckets"]
    c = ckpt.load_checkpoint(res.checkpoint, "cpu", weights_only=True)
    assert all(torch.isfinite(v).all() for v in c.model.values())
