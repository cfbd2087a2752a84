"""ControlNet training on tiny components built from configs: a run trains the ControlNet
with the UNet frozen, writes a diffusers folder that ControlNetModel.from_pretrained loads
and a single file diffusers' original-layout reader loads, and samples (with a LoRA too)
the image diffusers' StableDiffusionControlNetPipeline draws from the same noise; exact
resume; the guard on this path (a NaN conditioning image from the user's own dataset, fp16
overflow in a ControlNet attention block, a mismatched pair)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

pytest.importorskip("diffusers")
pytest.importorskip("cv2")

import steadydiff  # noqa: E402
from steadydiff.data.conditioning import make_conditioning  # noqa: E402
from steadydiff.integrations.sd.tiny import make_tiny_sd  # noqa: E402
from steadydiff.trainer import checkpoint as ckpt  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from test_sd import sd_config, shapes  # noqa: E402

CN = ("adapter.kind=none", "controlnet.enabled=true", "data.conditioning=folder")
# a ControlNet attention block's attention (the first down block's transformer)
CN_ATTN = "controlnet.down_blocks.0.attentions.0.transformer_blocks.0.attn2"


@pytest.fixture(scope="module")
def sd_dir(tmp_path_factory) -> Path:
    return make_tiny_sd(tmp_path_factory.mktemp("sd") / "tiny-sd", image_size=32)


def pairs(root: Path, n: int = 8) -> Path:
    data = shapes(root, n)
    make_conditioning(data, None, "canny", {"low": 50, "high": 150})
    return data


def incidents(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "incidents.jsonl").read_text().splitlines()
            if line.strip()]


@pytest.fixture(scope="module")
def trained(sd_dir, tmp_path_factory) -> Path:
    """A short ControlNet run at a high LR (the zero convolutions move off zero)."""
    root = tmp_path_factory.mktemp("cn")
    data = pairs(root / "images")
    cfg = sd_config(sd_dir, data, *CN, "train.steps=4", "optim.lr=0.02",
                    "sample.use_ema=false", "train.sample_every=4", "sample.prompts=['a red square']")
    res = steadydiff.train(cfg, out_dir=root / "run")
    assert res.steps == 4
    return root / "run"


def test_the_controlnet_trains_and_the_unet_stays_frozen(trained, sd_dir):
    from diffusers import ControlNetModel, UNet2DConditionModel

    c = ckpt.load_checkpoint(ckpt.resolve_checkpoint(trained), "cpu", weights_only=True)
    assert c.model and all(k.startswith("controlnet.") for k in c.model)
    net = ControlNetModel.from_pretrained(trained / "controlnet", local_files_only=True)
    zero = dict(net.named_parameters())["controlnet_mid_block.weight"]
    assert zero.abs().max() > 0  # the zero convolution learned
    for n, p in net.named_parameters():
        torch.testing.assert_close(p, c.model[f"controlnet.{n}"], rtol=0, atol=0)
    # the base UNet is not in the run at all: its folder's weights are what sampling uses
    base = UNet2DConditionModel.from_pretrained(sd_dir / "unet")
    assert not any(k.startswith("base.") for k in c.ema)
    assert base is not None
    state = json.loads((ckpt.resolve_checkpoint(trained) / "state.json").read_text())
    assert state["adapter"]["kind"] == "controlnet"
    assert state["adapter"]["conditioning"]["kind"] == "canny"
    assert state["adapter"]["conditioning"]["params"]["low"] == 50
    # the validation grid drew the prompt with its conditioning image
    side = json.loads((trained / "samples" / "step_00000004" / "prompts.json").read_text())
    assert side["prompts"][0]["finite"] and side["prompts"][0]["error"] is None


def _diffusers_pipe(sd_dir: Path, controlnet_dir: Path):
    from diffusers import (ControlNetModel, DDIMScheduler,
                           StableDiffusionControlNetPipeline)

    net = ControlNetModel.from_pretrained(controlnet_dir, local_files_only=True)
    pipe = StableDiffusionControlNetPipeline.from_pretrained(
        sd_dir, controlnet=net, local_files_only=True, safety_checker=None)
    pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config,
                                               timestep_spacing="trailing",
                                               set_alpha_to_one=True, clip_sample=False)
    return pipe


@pytest.mark.parametrize("scale, start, end", [(1.0, 0.0, 1.0), (0.7, 0.2, 0.8)])
def test_sampling_equals_the_diffusers_controlnet_pipeline(trained, sd_dir, scale, start,
                                                           end):
    ours = steadydiff.load(trained, device="cpu", use_ema=False)
    control = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    z = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(3))
    kw = dict(prompt="a red square", negative_prompt=None, sampler="ddim", steps=5,
              cfg_scale=4.0, noise=z)
    x, _ = ours.sample(**kw, control_image=control, control_scale=scale, control_start=start,
                       control_end=end)
    pipe = _diffusers_pipe(sd_dir, trained / "controlnet")
    theirs = pipe(["a red square"] * 2, image=control, num_inference_steps=5,
                  guidance_scale=4.0, latents=z.clone(), output_type="pt",
                  controlnet_conditioning_scale=scale, control_guidance_start=start,
                  control_guidance_end=end).images
    torch.testing.assert_close(x * 0.5 + 0.5, theirs.float(), atol=2e-3, rtol=0)
    off, _ = ours.sample(**kw, control_image=control, control_scale=0.0)
    assert (off - x).abs().max() > 1e-3  # the control changes the image


def test_lora_and_controlnet_together_equal_diffusers(trained, sd_dir, tmp_path):
    """A LoRA trained in its own run, fused into the base of the ControlNet run's sampler
    (--lora), draws what diffusers draws with load_lora_weights + the ControlNet."""
    data = shapes(tmp_path / "images")
    steadydiff.train(sd_config(sd_dir, data, "optim.lr=0.01", "train.steps=3"),
                     out_dir=tmp_path / "lora_run")
    lora = tmp_path / "lora_run" / "lora" / "pytorch_lora_weights.safetensors"
    ours = steadydiff.load(trained, device="cpu", use_ema=False)
    control = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    z = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(4))
    kw = dict(prompt="a blue circle", negative_prompt=None, sampler="ddim", steps=4,
              cfg_scale=3.0, noise=z, control_image=control)
    plain, _ = ours.sample(**kw)
    ours.load_lora(lora, 1.0)
    x, _ = ours.sample(**kw)
    assert (x - plain).abs().max() > 1e-3  # the LoRA acts
    pipe = _diffusers_pipe(sd_dir, trained / "controlnet")
    pipe.load_lora_weights(lora.parent)
    theirs = pipe(["a blue circle"] * 2, image=control, num_inference_steps=4,
                  guidance_scale=3.0, latents=z.clone(), output_type="pt").images
    torch.testing.assert_close(x * 0.5 + 0.5, theirs.float(), atol=2e-3, rtol=0)


def test_sample_command_takes_control_and_lora(trained, tmp_path, capsys):
    from steadydiff.cli import main

    img = next((trained.parent / "images" / "conditioning").glob("*.png"))
    out = tmp_path / "s.png"
    assert main(["sample", str(trained), "--prompt", "a red square", "--control-image",
                 str(img), "--control-scale", "0.5", "--control-start", "0.1",
                 "--control-end", "0.9", "--num", "2", "--steps", "2", "--out", str(out),
                 "--device", "cpu"]) == 0
    assert out.is_file()
    new = tmp_path / "t.png"  # a new target: an existing one is refused first (--force)
    assert main(["sample", str(trained), "--prompt", "x", "--num", "1", "--out",
                 str(new), "--device", "cpu"]) == 2
    assert "--control-image" in capsys.readouterr().err
    assert main(["sample", str(trained), "--prompt", "x", "--control-image", str(img),
                 "--lora", str(tmp_path / "nope.safetensors"), "--out", str(new),
                 "--device", "cpu"]) == 2
    assert "nope.safetensors" in capsys.readouterr().err


def test_resumed_controlnet_run_equals_uninterrupted_bit_exactly(sd_dir, tmp_path):
    data = pairs(tmp_path / "images")
    cache = tmp_path / "cache"
    fixed = (*CN, f"data.cache_dir={cache}", "optim.schedule=constant",
             "data.caption_dropout=0.3", "train.checkpoint_every=3")
    straight = steadydiff.train(sd_config(sd_dir, data, *fixed, "train.steps=6"),
                                out_dir=tmp_path / "straight")
    steadydiff.train(sd_config(sd_dir, data, *fixed, "train.steps=3"),
                     out_dir=tmp_path / "resumed")
    resumed = steadydiff.train(sd_config(sd_dir, data, *fixed, "train.steps=6"),
                               out_dir=tmp_path / "resumed")
    assert resumed.resumed_from is not None
    a = ckpt.load_checkpoint(straight.checkpoint, "cpu", weights_only=True)
    b = ckpt.load_checkpoint(resumed.checkpoint, "cpu", weights_only=True)
    assert a.model.keys() == b.model.keys() and a.model
    for k in a.model:
        assert torch.equal(a.model[k], b.model[k]), k
        assert torch.equal(a.ema[k], b.ema[k]), k


def test_bucketed_controlnet_run_trains_non_square_pairs(sd_dir, tmp_path):
    data = tmp_path / "images"
    data.mkdir()
    for i, (w, h) in enumerate([(48, 32), (32, 48), (48, 32), (32, 32)]):
        a = np.full((h, w, 3), 240, np.uint8)
        a[4:20, 4 + i:20 + i] = (200, 30, 30)
        Image.fromarray(a).save(data / f"img{i}.png")
        (data / f"img{i}.txt").write_text("a red square")
    make_conditioning(data, None, "canny", {"low": 50, "high": 150})
    res = steadydiff.train(sd_config(sd_dir, data, *CN, "data.buckets=true",
                                     "data.bucket_step=16", "train.batch_size=2",
                                     "train.steps=3"), out_dir=tmp_path / "run")
    assert res.steps == 3
    assert json.loads((tmp_path / "run" / "buckets.json").read_text())["buckets"]


class NaNPairs(torch.utils.data.Dataset):
    """The user's own dataset: images, captions and conditioning images, one of them NaN
    (a depth estimator that failed on it)."""

    def __init__(self, root: Path, bad: int) -> None:
        self.paths = sorted(root.glob("img*.png"))
        self.captions = [p.with_suffix(".txt").read_text() for p in self.paths]
        self.bad = bad

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int):
        a = np.asarray(Image.open(self.paths[i]).convert("RGB"), dtype=np.float32)
        return torch.from_numpy(a).permute(2, 0, 1) / 127.5 - 1, self.captions[i]

    def path_of(self, i: int) -> Path:
        return self.paths[i]

    def conditioning_path_of(self, i: int) -> str:
        return f"depth/{self.paths[i].stem}.npy"

    def conditioning(self, i: int) -> torch.Tensor:
        c = torch.full((3, 32, 32), 0.5)
        if i == self.bad:
            c[:, 3, 3] = float("nan")
        return c


def test_a_nan_conditioning_image_drops_then_quarantines_its_pair(sd_dir, tmp_path):
    data = shapes(tmp_path / "images", n=8)
    cfg = sd_config(sd_dir, data, "adapter.kind=none", "controlnet.enabled=true",
                    "train.steps=10", "train.checkpoint_every=0", "guard.warmup_steps=0")
    res = steadydiff.train(cfg, NaNPairs(data, bad=5), out_dir=tmp_path / "run")
    assert res.steps == 10
    rows = incidents(tmp_path / "run")
    drops = [r for r in rows if r["action"] == "drop_samples"]
    assert drops, rows
    s = drops[0]["evidence"]["samples"][0]
    assert s["index"] == 5 and "img05.png" in s["source"] \
        and "conditioning depth/img05.npy" in s["source"]
    q = [r for r in rows if r["kind"] == "sample_quarantined"]
    assert q and "depth/img05.npy" in q[0]["evidence"]["source"]
    c = ckpt.load_checkpoint(res.checkpoint, "cpu", weights_only=True)
    assert all(torch.isfinite(v).all() for v in c.model.values())
    from safetensors.torch import load_file
    f = tmp_path / "run" / "controlnet" / "diffusion_pytorch_model.safetensors"
    assert all(torch.isfinite(v).all() for v in load_file(f).values())


def test_fp16_overflow_in_a_controlnet_attention_block_upcasts_that_block(sd_dir, tmp_path):
    data = pairs(tmp_path / "images")
    fault = {"kind": "fp16_overflow", "step": 1, "target": CN_ATTN}
    cfg = sd_config(sd_dir, data, *CN, "train.steps=4", "train.checkpoint_every=0",
                    "train.precision=fp16", "train.allow_slow_precision=true",
                    "model.vae_precision=fp32", f"faults={json.dumps([fault])}")
    res = steadydiff.train(cfg, out_dir=tmp_path / "run")
    assert res.steps == 4
    rows = incidents(tmp_path / "run")
    assert rows[0]["kind"] == "attention_upcast" and rows[0]["evidence"]["module"] == CN_ATTN
    state = json.loads((res.checkpoint / "state.json").read_text())
    assert state["guard"]["upcast_attention"] == [CN_ATTN]
    c = ckpt.load_checkpoint(res.checkpoint, "cpu", weights_only=True)
    assert all(torch.isfinite(v).all() for v in c.model.values())


def test_a_mismatched_pair_stops_the_run_before_it_starts(sd_dir, tmp_path, capsys):
    from steadydiff.cli import main

    data = pairs(tmp_path / "images")
    Image.new("RGB", (32, 16)).save(data / "conditioning" / "img03.png")
    cfg = sd_config(sd_dir, data, *CN)
    (tmp_path / "c.yaml").write_text(cfg.to_yaml())
    assert main(["train", str(tmp_path / "c.yaml"), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert f"{data / 'img03.png'} and {data / 'conditioning' / 'img03.png'}" in err
    assert "32x32, the conditioning image 32x16" in err


def test_single_file_loads_in_the_original_layout_reader(tmp_path):
    """SD 1.x/2.x: the single file is the original control_model.* layout; diffusers'
    from_single_file (the reader of lllyasviel's releases) gives back every tensor. An 8x
    VAE, as real SD: the reader expects the full conditioning embedding."""
    from diffusers import ControlNetModel
    from safetensors.torch import load_file

    sd = make_tiny_sd(tmp_path / "sd8", image_size=64, vae_widths=(8, 8, 16, 16))
    data = tmp_path / "images"
    data.mkdir()
    for i in range(4):
        a = np.full((64, 64, 3), 240, np.uint8)
        a[8:40, 8 + 4 * i:40 + 4 * i] = (200, 30, 30)
        Image.fromarray(a).save(data / f"img{i}.png")
        (data / f"img{i}.txt").write_text("a red square")
    make_conditioning(data, None, "canny", {"low": 50, "high": 150})
    steadydiff.train(sd_config(sd, data, *CN, "data.image_size=64", "train.steps=2",
                               "optim.lr=0.01"), out_dir=tmp_path / "run")
    folder = tmp_path / "run" / "controlnet"
    single = folder / "run.safetensors"
    keys = load_file(single)
    assert all(k.startswith("control_model.") for k in keys)
    assert "control_model.zero_convs.0.0.weight" in keys  # what ComfyUI/A1111 detect
    assert "control_model.input_hint_block.14.weight" in keys
    ref = ControlNetModel.from_pretrained(folder, local_files_only=True)
    back = ControlNetModel.from_single_file(str(single), config=str(folder),
                                            local_files_only=True)
    got = back.state_dict()
    for k, v in ref.state_dict().items():
        assert torch.equal(v, got[k]), k


def test_sdxl_controlnet_trains_exports_and_samples_like_diffusers(tmp_path):
    """SDXL: the ControlNet gets the UNet's text_time embedding (pooled text + each image's
    size/crop ids); its folder and its single file (diffusers keys, as SDXL ControlNets are
    shared) load in diffusers, and StableDiffusionXLControlNetPipeline draws our image."""
    from diffusers import (ControlNetModel, DDIMScheduler,
                           StableDiffusionXLControlNetPipeline)
    from safetensors.torch import load_file

    from steadydiff.integrations.sd.tiny import main as tiny

    xl = tmp_path / "tiny-sdxl"
    tiny([str(xl), "--family", "sdxl", "--image-size", "32"])
    data = pairs(tmp_path / "images", n=4)
    res = steadydiff.train(sd_config(xl, data, *CN, "train.steps=2", "optim.lr=0.02",
                                     "sample.use_ema=false"), out_dir=tmp_path / "run")
    assert res.steps == 2
    folder = tmp_path / "run" / "controlnet"
    net = ControlNetModel.from_pretrained(folder, local_files_only=True)
    assert net.config.addition_embed_type == "text_time"
    single = load_file(folder / "run.safetensors")
    assert "controlnet_cond_embedding.conv_in.weight" in single  # what ComfyUI detects
    for k, v in net.state_dict().items():
        assert torch.equal(v, single[k]), k

    ours = steadydiff.load(tmp_path / "run", device="cpu", use_ema=False)
    control = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(5))
    z = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(6))
    x, _ = ours.sample(prompt="a red square", negative_prompt=None, sampler="ddim", steps=4,
                       cfg_scale=4.0, noise=z, control_image=control, control_scale=0.8)
    pipe = StableDiffusionXLControlNetPipeline.from_pretrained(xl, controlnet=net,
                                                               local_files_only=True)
    pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config,
                                               timestep_spacing="trailing",
                                               set_alpha_to_one=True, clip_sample=False)
    theirs = pipe(["a red square"] * 2, image=control, num_inference_steps=4,
                  guidance_scale=4.0, latents=z.clone(), output_type="pt", height=32,
                  width=32, controlnet_conditioning_scale=0.8).images
    torch.testing.assert_close(x * 0.5 + 0.5, theirs.float(), atol=2e-3, rtol=0)


@pytest.mark.slow
def test_fp16_overflow_from_scaled_controlnet_weights_escalates_and_names_the_block(
        sd_dir, tmp_path):
    """The test's own code scales one ControlNet attention block's query weights x1e6 (a
    broken ControlNet handed to init_from): in fp16 its output overflows. The guard names the
    block and upcasts its attention; the overflow comes back (the projection itself
    overflows), so it falls back to bf16; there the gradients keep spiking and the run
    aborts with a resumable checkpoint. Nothing non-finite is ever written."""
    from diffusers import ControlNetModel, UNet2DConditionModel

    from steadydiff.guard.guard import GuardAbort

    unet = UNet2DConditionModel.from_pretrained(sd_dir / "unet")
    net = ControlNetModel.from_unet(unet, conditioning_embedding_out_channels=(16, 32))
    with torch.no_grad():
        net.down_blocks[0].attentions[0].transformer_blocks[0].attn1.to_q.weight.mul_(1e6)
    net.save_pretrained(tmp_path / "hot")
    data = pairs(tmp_path / "images")
    cfg = sd_config(sd_dir, data, *CN, f"controlnet.init_from={tmp_path / 'hot'}",
                    "train.steps=4", "train.checkpoint_every=0", "train.precision=fp16",
                    "train.allow_slow_precision=true", "model.vae_precision=fp32")
    with pytest.raises(GuardAbort):
        steadydiff.train(cfg, out_dir=tmp_path / "run")
    rows = incidents(tmp_path / "run")
    block = "controlnet.down_blocks.0.attentions.0.transformer_blocks.0.attn1"
    assert rows[0]["kind"] == "attention_upcast" and rows[0]["evidence"]["module"] == block
    assert rows[1]["action"] == "precision_fallback"
    assert any(r["evidence"].get("provenance", {}) and
               r["evidence"]["provenance"].get("first_overflow_module") == block + ".to_q"
               for r in rows)
    for c in ckpt.list_checkpoints(tmp_path / "run" / "checkpoints"):
        ckpt.load_checkpoint(c)  # refuses non-finite weights


def test_an_exploding_zero_convolution_is_named_and_rolled_back(sd_dir, tmp_path):
    """A zero convolution's weight blown up x1e4 after an update: the guard names it
    (controlnet.controlnet_mid_block.weight) and rolls back; the run ends finite."""
    data = pairs(tmp_path / "images")
    zero = "controlnet.controlnet_mid_block.weight"
    fault = {"kind": "param_huge", "step": 2, "factor": 1e4, "target": zero}
    res = steadydiff.train(sd_config(sd_dir, data, *CN, "train.steps=5", "optim.lr=0.01",
                                     "train.checkpoint_every=0", "guard.warmup_steps=1",
                                     f"faults={json.dumps([fault])}"), out_dir=tmp_path / "run")
    assert res.steps == 5
    rows = incidents(tmp_path / "run")
    assert rows and rows[0]["action"] == "rollback" and rows[0]["evidence"]["params"][0] == zero
    c = ckpt.load_checkpoint(res.checkpoint, "cpu", weights_only=True)
    assert all(torch.isfinite(v).all() for v in c.model.values())


def test_a_family_without_a_controlnet_is_refused_by_name(tmp_path):
    """SD 1.x/2.x, SDXL, SD3 and FLUX.1 train ControlNets (tests/test_controlnet_flow.py for
    the transformer families); a family steadydiff has no ControlNet class for (Z-Image) is
    refused by name, listing the ones it trains."""
    from steadydiff.config import ConfigError
    from steadydiff.integrations.sd.tiny import make_tiny

    zimage = make_tiny(tmp_path / "tiny-zimage", "zimage", image_size=32)
    data = pairs(tmp_path / "images", n=4)
    with pytest.raises(ConfigError, match=r"does not train a Z-Image ControlNet yet.*"
                                          r"Stable Diffusion 1.x/2.x, SDXL, SD3/SD3.5, FLUX.1"):
        steadydiff.train(sd_config(zimage, data, *CN, "train.steps=1",
                                   "diffusion.loss_weighting=uniform"), out_dir=tmp_path / "r")
