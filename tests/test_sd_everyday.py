"""What SD fine-tuners do every day (issue 31, part B): hub ids answered with the download
command, separate learning rates per part, diffusers LoRA files older diffusers load at the
right strength, LoRA variants, textual inversion, a quiet log."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("diffusers")

import steadydiff  # noqa: E402
from steadydiff.cli import main  # noqa: E402
from steadydiff.trainer import checkpoint as ckpt  # noqa: E402
from test_sd import sd_config, shapes  # noqa: E402

HUB_ID = "stable-diffusion-v1-5/stable-diffusion-v1-5"


@pytest.fixture(scope="module")
def sd_dir(tmp_path_factory) -> Path:
    from steadydiff.integrations.sd.tiny import make_tiny_sd

    return make_tiny_sd(tmp_path_factory.mktemp("sd") / "tiny-sd", image_size=32)


# --------------------------------------------------------------------------- hub ids


def test_a_hub_id_is_answered_with_the_download_command_and_nothing_is_fetched(
        tmp_path, monkeypatch, capsys):
    import huggingface_hub

    def no_download(*a, **k):
        raise AssertionError("a download was attempted")

    for name in ("hf_hub_download", "snapshot_download"):
        monkeypatch.setattr(huggingface_hub, name, no_download)
    monkeypatch.chdir(tmp_path)  # no folder of that name here
    data = tmp_path / "images"
    data.mkdir()
    rc = main(["train", str(Path(__file__).parents[1] / "configs" / "sd_lora.yaml"),
               "--set", f"model.pretrained={HUB_ID}", "--set", f"data.path={data}",
               "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert rc == 2
    assert "hub id" in err and "never downloads" in err
    major = int(huggingface_hub.__version__.split(".")[0])
    cli = "hf" if major >= 1 else "huggingface-cli"
    assert f"{cli} download {HUB_ID} --local-dir models/stable-diffusion-v1-5" in err
    assert "model.single_file_config" in err and ".safetensors" in err
    assert not (tmp_path / "models").exists()


@pytest.mark.parametrize("path, hub", [
    (HUB_ID, True), ("runwayml/stable-diffusion-v1-5", True),
    ("models/sd15/unet", False), ("/abs/path", False), ("./sd15", False),
    ("my-model", False), ("~/models", False), ("dir/model.safetensors", False),
])
def test_what_reads_as_a_hub_id(path, hub):
    from steadydiff.integrations.sd.folder import is_hub_id

    assert is_hub_id(path) is hub


# --------------------------------------------------------------------------- older diffusers

# the Python of a venv with diffusers 0.32 (and transformers < 4.50, peft 0.14) beside this
# one's torch: docs/sd.md#lora-files-for-older-diffusers says how to make it
OLD_DIFFUSERS = os.environ.get("STEADYDIFF_OLD_DIFFUSERS_PYTHON", "/tmp/d032/bin/python")

DRAW = r"""
import sys, torch
from diffusers import StableDiffusionPipeline
from safetensors.torch import save_file
folder, lora_dir, out = sys.argv[1:4]
images = {}
for name in ("pytorch_lora_weights.safetensors", "k.safetensors", None):
    p = StableDiffusionPipeline.from_pretrained(folder, local_files_only=True,
                                                safety_checker=None)
    p.set_progress_bar_config(disable=True)
    if name:
        p.load_lora_weights(lora_dir, weight_name=name)
    z = torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(1))
    images[name or "none"] = p("a red square", num_inference_steps=2, guidance_scale=3.0,
                               latents=z, output_type="pt").images.contiguous()
save_file(images, out)
"""


def draw_with(python: str, folder: Path, lora: Path, out: Path) -> dict:
    import subprocess
    import sys

    from safetensors.torch import load_file

    script = out.with_suffix(".py")
    script.write_text(DRAW)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    r = subprocess.run([python or sys.executable, str(script), str(folder), str(lora), str(out)],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return load_file(out)


def trained_lora(tmp_path: Path, variant: str = "lora") -> tuple[Path, Path]:
    """The tiny SD folder and a LoRA (UNet and text encoder, alpha 2 != rank 4, random up
    weights; a DoRA's magnitudes moved off their start; LoCon: the ResNet convolutions
    too) written in both formats."""
    import torch
    from diffusers import StableDiffusionPipeline

    from steadydiff.integrations.sd.model import (LOCON_TARGETS, TEXT_ENCODER_TARGETS,
                                                  add_lora, save_lora)
    from steadydiff.integrations.sd.tiny import make_tiny_sd

    sd = make_tiny_sd(tmp_path / "sd", image_size=32)
    pipe = StableDiffusionPipeline.from_pretrained(sd, local_files_only=True,
                                                   safety_checker=None)
    torch.manual_seed(0)
    dora = variant == "dora"
    attn = ("*.to_q", "*.to_k", "*.to_v", "*.to_out.0")
    add_lora(pipe.unet, rank=4, alpha=2.0, dropout=0.0, dora=dora,
             targets=attn + (LOCON_TARGETS if variant == "locon" else ()))
    add_lora(pipe.text_encoder, rank=4, alpha=2.0, dropout=0.0, targets=TEXT_ENCODER_TARGETS,
             dora=dora)
    with torch.no_grad():
        for m in (pipe.unet, pipe.text_encoder):
            for n, p in m.named_parameters():
                if "lora_B" in n:
                    p.copy_(torch.randn_like(p) * 0.3)
                if "lora_magnitude_vector" in n:
                    p.mul_(1 + 0.2 * torch.rand_like(p))
    save_lora(pipe.unet, tmp_path / "out", pipe.text_encoder, format="both", kohya_name="k")
    return sd, tmp_path / "out"


def transformers4_folder(sd: Path, out: Path) -> Path:
    """A copy of the tiny folder that transformers 4 reads: the CLIP weights under their
    ``text_model.`` keys, the tokenizer's vocab.json + merges.txt beside its tokenizer.json
    (what a real SD folder from the hub has anyway)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from steadydiff.integrations.sd.ldm import clip_path

    shutil.copytree(sd, out)
    w = out / "text_encoder" / "model.safetensors"
    save_file({clip_path(k): v for k, v in load_file(w).items()}, w, metadata={"format": "pt"})
    tok = json.loads((out / "tokenizer" / "tokenizer.json").read_text())
    (out / "tokenizer" / "vocab.json").write_text(json.dumps(tok["model"]["vocab"]))
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    (out / "tokenizer" / "merges.txt").write_text("#version: 0.2\n" + "".join(
        m + "\n" for m in merges))
    return out


@pytest.mark.skipif(not Path(OLD_DIFFUSERS).is_file(),
                    reason=f"no venv with diffusers 0.32 at {OLD_DIFFUSERS}")
def test_diffusers_file_loads_at_the_trained_strength_in_diffusers_0_32(tmp_path):
    """diffusers 0.32 (no alpha metadata read, CLIP keys need ``text_model.``) draws with our
    diffusers file what it draws with our kohya file (right in every version), and what the
    installed diffusers draws: alpha (2) != rank (4), so a lost alpha shows."""
    import torch

    sd, lora = trained_lora(tmp_path)
    old = draw_with(OLD_DIFFUSERS, transformers4_folder(sd, tmp_path / "sd4"), lora,
                    tmp_path / "old.safetensors")
    new = draw_with("", sd, lora, tmp_path / "new.safetensors")
    for images in (old, new):
        assert (images["k.safetensors"] - images["none"]).abs().max() > 1e-3
        torch.testing.assert_close(images["pytorch_lora_weights.safetensors"],
                                   images["k.safetensors"], atol=1e-5, rtol=0)
    torch.testing.assert_close(old["pytorch_lora_weights.safetensors"],
                               new["pytorch_lora_weights.safetensors"], atol=1e-4, rtol=0)


# --------------------------------------------------------------------------- LRs per part


def test_text_encoder_has_its_own_learning_rate_and_resumes_exactly(sd_dir, tmp_path, capsys):
    """AdamW's first step moves each weight by about its LR (m / sqrt(v) = +-1): the UNet's
    LoRA up weights (zero at start) by optim.lr, the text encoder's by its own; a run
    resumed at step 1 equals the straight one bit for bit."""
    import torch

    data = shapes(tmp_path / "images")
    sets = ("adapter.text_encoder=true", "optim.lr=0.01", "optim.lr_text_encoder=0.0001",
            "optim.schedule=constant", "optim.grad_clip=0", "train.checkpoint_every=1",
            "data.cache_dir=" + str(tmp_path / "cache"))
    first = steadydiff.train(sd_config(sd_dir, data, *sets, "train.steps=1"),
                             out_dir=tmp_path / "a")
    assert "optim: learning rates: unet 0.01, text_encoder 0.0001" in capsys.readouterr().out
    c = ckpt.load_checkpoint(first.checkpoint, "cpu", weights_only=True)
    up = {k: v.abs().max().item() for k, v in c.model.items() if "lora_B" in k}
    unet = max(v for k, v in up.items() if k.startswith("unet."))
    te = max(v for k, v in up.items() if k.startswith("text_encoder."))
    assert unet == pytest.approx(0.01, rel=0.05) and te == pytest.approx(1e-4, rel=0.05)
    straight = steadydiff.train(sd_config(sd_dir, data, *sets, "train.steps=2"),
                                out_dir=tmp_path / "straight")
    resumed = steadydiff.train(sd_config(sd_dir, data, *sets, "train.steps=2"),
                               out_dir=tmp_path / "a")
    assert resumed.resumed_from is not None
    a = ckpt.load_checkpoint(straight.checkpoint, "cpu", weights_only=True)
    b = ckpt.load_checkpoint(resumed.checkpoint, "cpu", weights_only=True)
    for k in a.model:
        assert torch.equal(a.model[k], b.model[k]), k


@pytest.mark.parametrize("sets, needle", [
    (("optim.lr_text_encoder=0.0001",), "no text encoder is trained in this run: set "
                                        "adapter.text_encoder=true"),
    (("adapter.text_encoder=true", "optim.lr_text_encoder=[0.0001,0.0002]"),
     "has 2 learning rates; this model has 1 text encoder"),
    (("adapter.text_encoder=true", "optim.lr_text_encoder=-1"), "must be in \\(0, 10\\]"),
])
def test_bad_text_encoder_learning_rates_are_refused(sd_dir, tmp_path, capsys, sets, needle):
    import re

    import yaml

    data = shapes(tmp_path / "images")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(sd_config(sd_dir, data).model_dump(mode="json")))
    argv = ["train", str(cfg), "--out", str(tmp_path / "run")]
    for s_ in sets:
        argv += ["--set", s_]
    assert main(argv) == 2
    assert re.search(needle, capsys.readouterr().err)


# --------------------------------------------------------------------------- a quiet log


def test_noise_filter_drops_the_listed_lines_and_keeps_the_rest(tmp_path):
    """Records from the libraries' own loggers: the listed notices are dropped from the
    console handler and written to RUN/third_party.log; our warnings and a third-party
    warning not listed reach the console."""
    import io
    import logging

    from steadydiff import quiet

    console = io.StringIO()
    handler = logging.StreamHandler(console)
    loggers = [logging.getLogger(n) for n in ("transformers", "diffusers", "steadydiff")]
    for lg in loggers:
        lg.addHandler(handler)
    try:
        quiet.close()  # a run trained earlier in this process has its log: buffer again
        quiet.install()
        logging.getLogger("transformers.utils.import_utils").warning(
            "`CLIPImageProcessor` requires torchvision (not installed); falling back")
        logging.getLogger("diffusers.loaders.lora_base").warning(
            "No LoRA keys associated to CLIPTextModel found with the prefix='text_encoder'.")
        logging.getLogger("diffusers.loaders.lora_base").warning("a real diffusers problem")
        logging.getLogger("steadydiff.integrations.sd.setup").warning("our own warning")
        log = quiet.log_to(tmp_path)
        logging.getLogger("torchao").warning("Failed to load _C_mxfp8.so")  # after: direct
        handler.flush()
    finally:
        for lg in loggers:
            lg.removeHandler(handler)
        logging.captureWarnings(False)
    shown = console.getvalue()
    assert "our own warning" in shown and "a real diffusers problem" in shown
    assert "torchvision" not in shown and "No LoRA keys" not in shown
    kept = log.read_text()
    assert "requires torchvision" in kept and "No LoRA keys associated to CLIPTextModel" in kept
    assert "our own warning" not in kept


@pytest.mark.slow  # three fresh processes (about 3 CPU-minutes on a loaded machine)
def test_a_run_says_what_matters_and_keeps_the_rest_in_its_log(sd_dir, tmp_path):
    """The CLI in a fresh process, where the libraries are imported after the filter: the
    console has no listed notice and no progress bar; the run states its kohya-unlike
    defaults once, ends with what to load where; `sample --width/--height` sizes the
    image."""
    import subprocess
    import sys

    from PIL import Image

    data = shapes(tmp_path / "images")
    run = tmp_path / "myrun"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src"),
           "OMP_NUM_THREADS": "1"}
    env.pop("HF_HUB_DISABLE_PROGRESS_BARS", None)
    argv = [sys.executable, "-m", "steadydiff", "train",
            str(Path(__file__).parents[1] / "configs" / "sd_lora.yaml")]
    for s_ in (f"model.pretrained={sd_dir}", f"data.path={data}", "data.image_size=32",
               "train.steps=1", "train.batch_size=2", "train.device=cpu",
               "train.precision=fp32", "sample.num=1", "sample.steps=2",
               "data.trigger=sks", "data.num_workers=0", "optim.warmup_steps=0"):
        argv += ["--set", s_]
    r = subprocess.run(argv + ["--out", str(run)], capture_output=True, text=True, env=env,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    from steadydiff.quiet import NOISE

    import re
    for _, pat, _ in NOISE:
        if pat:
            assert not re.search(pat, r.stderr), pat
    assert "Loading weights" not in r.stderr and "it/s]" not in r.stderr
    assert r.stdout.count("note: defaults unlike a kohya sd-scripts recipe") == 1
    assert "diffusion.cfg_dropout=0.1" in r.stdout and "min_snr" in r.stdout
    assert f"copy {run / 'lora' / 'myrun.safetensors'} to models/loras/" in r.stdout
    assert "<lora:myrun:1>" in r.stdout and "LoRA rank 16, alpha 16" in r.stdout
    assert f"base: {sd_dir}" in r.stdout and 'trigger: put "sks"' in r.stdout
    assert (run / "third_party.log").is_file()
    out = tmp_path / "wide.png"
    r = subprocess.run([sys.executable, "-m", "steadydiff", "sample", str(run), "--prompt",
                        "sks", "--width", "64", "--height", "32", "--num", "1", "--steps", "2",
                        "--out", str(out)], capture_output=True, text=True, env=env,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    w, h = Image.open(out).size  # one sample, the grid's padding around it
    assert w - h == 32 and h >= 32
    r = subprocess.run([sys.executable, "-m", "steadydiff", "sample", str(run), "--prompt",
                        "sks", "--width", "61", "--out", str(tmp_path / "x.png")],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 2 and "--width 61 must be a positive multiple of" in r.stderr


def test_start_notes_name_kohya_unlike_defaults_and_a_size_below_native(sd_dir, tmp_path):
    from steadydiff.integrations.sd.advice import native_side, start_notes

    data = shapes(tmp_path / "images")
    cfg = sd_config(sd_dir, data)
    assert native_side(cfg) == 32  # the tiny UNet's sample_size x the VAE's downsampling
    notes = start_notes(cfg)
    assert len(notes) == 1 and "diffusion.cfg_dropout=0.1" in notes[0]
    small = start_notes(sd_config(sd_dir, data, "data.image_size=16"))
    assert any(n.startswith("warning: data.image_size=16 is below") and "native 32 px" in n
               for n in small)
    kohya_like = start_notes(sd_config(sd_dir, data, "diffusion.cfg_dropout=0",
                                       "diffusion.loss_weighting=uniform",
                                       "sample.use_ema=false"))
    assert kohya_like == []


# --------------------------------------------------------------------------- LoRA variants


def comfyui_dora_weight(w, down, up, alpha, dora_scale):
    """ComfyUI's merge of a LoRA layer with LyCORIS' ``dora_scale`` (comfy/weight_adapter:
    ``weight_decompose``): W + delta, each output row rescaled to the magnitude when
    dora_scale has one value per output row."""
    import torch

    r = down.shape[0]
    delta = (up.flatten(1) @ down.flatten(1)).reshape(w.shape) * (alpha / r)
    wc = w + delta
    assert dora_scale.shape[0] == wc.shape[0]  # the norm is per output row
    norm = wc.reshape(wc.shape[0], -1).norm(dim=1).reshape(wc.shape[0], *[1] * (wc.dim() - 1))
    return wc * (dora_scale / (norm + torch.finfo(torch.float32).eps))


@pytest.mark.parametrize("variant", ["dora", "locon"])
def test_variant_files_load_where_the_ecosystem_loads_them_and_round_trip(tmp_path, variant):
    """A LoCon (conv layers in kohya's names): diffusers draws the same image from our kohya
    file and our diffusers file, not the base's. A DoRA: diffusers loads our diffusers file
    (it drops a kohya file's dora_scale, so the kohya file is for ComfyUI/A1111) and draws
    what the model read back from it draws; the kohya file's dora_scale merges, by
    ComfyUI's formula, to the weight peft's DoRA merges to. Both files read back
    (adapter.init_from's reader) into a fresh model with the same tensors."""
    import copy

    import torch
    from diffusers import StableDiffusionPipeline
    from safetensors.torch import load_file

    from steadydiff.integrations.sd import lora_files as lf
    from steadydiff.integrations.sd.model import (LOCON_TARGETS, TEXT_ENCODER_TARGETS,
                                                  add_lora)
    from steadydiff.integrations.sd.tiny_parts import tiny_text_encoder, tiny_unet

    sd, lora = trained_lora(tmp_path, variant)
    kohya = load_file(lora / "k.safetensors")
    meta = lf.read_lora_file(lora / "k.safetensors").metadata
    attn = ("*.to_q", "*.to_k", "*.to_v", "*.to_out.0")
    targets = attn + (LOCON_TARGETS if variant == "locon" else ())
    dora = variant == "dora"
    if dora:
        assert any(k.endswith(".dora_scale") for k in kohya)
        assert meta["ss_network_module"] == "lycoris.kohya"
    else:
        assert kohya["lora_unet_down_blocks_0_resnets_0_conv1.lora_down.weight"].ndim == 4
        assert '"conv_dim": "4"' in meta["ss_network_args"]
    images = draw_with("", sd, lora, tmp_path / "new.safetensors")
    assert (images["pytorch_lora_weights.safetensors"] - images["none"]).abs().max() > 1e-3
    if not dora:
        torch.testing.assert_close(images["pytorch_lora_weights.safetensors"],
                                   images["k.safetensors"], atol=1e-5, rtol=0)
    else:  # our reader's model in the same pipeline draws what diffusers' loader draws
        pipe = StableDiffusionPipeline.from_pretrained(sd, local_files_only=True,
                                                       safety_checker=None)
        pipe.set_progress_bar_config(disable=True)
        add_lora(pipe.unet, rank=4, alpha=2.0, dropout=0.0, dora=True, targets=targets)
        add_lora(pipe.text_encoder, rank=4, alpha=2.0, dropout=0.0, dora=True,
                 targets=TEXT_ENCODER_TARGETS)
        lf.load_lora_file(lora / "k.safetensors", pipe.unet, [pipe.text_encoder], rank=4,
                          alpha=2.0)
        z = torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(1))
        ours = pipe("a red square", num_inference_steps=2, guidance_scale=3.0, latents=z,
                    output_type="pt").images
        torch.testing.assert_close(ours, images["pytorch_lora_weights.safetensors"],
                                   atol=1e-5, rtol=0)
        layers = lf.kohya_names(pipe.unet, [pipe.text_encoder])
        for name in list(layers)[::7]:  # ComfyUI's merge of the kohya file = peft's
            m = copy.deepcopy(layers[name][0])
            w = m.base_layer.weight.detach().clone()
            m.merge()
            theirs = comfyui_dora_weight(w, kohya[f"{name}.lora_down.weight"],
                                         kohya[f"{name}.lora_up.weight"],
                                         float(kohya[f"{name}.alpha"]),
                                         kohya[f"{name}.dora_scale"])
            torch.testing.assert_close(m.base_layer.weight.detach(), theirs, rtol=1e-5,
                                       atol=1e-6)
    for name in ("k.safetensors", "pytorch_lora_weights.safetensors"):
        unet, te = tiny_unet(), tiny_text_encoder()
        add_lora(unet, rank=4, alpha=2.0, dropout=0.0, dora=dora, targets=targets)
        add_lora(te, rank=4, alpha=2.0, dropout=0.0, dora=dora, targets=TEXT_ENCODER_TARGETS)
        assert lf.load_lora_file(lora / name, unet, [te], rank=4, alpha=2.0)["fresh"] == 0
        again = lf.kohya_state_dict(unet, [te])
        assert again.keys() == kohya.keys()
        for k in kohya:
            torch.testing.assert_close(again[k], kohya[k], rtol=1e-6, atol=1e-7)
    unet, te = tiny_unet(), tiny_text_encoder()
    add_lora(unet, rank=4, alpha=2.0, dropout=0.0, targets=attn)
    add_lora(te, rank=4, alpha=2.0, dropout=0.0, targets=TEXT_ENCODER_TARGETS)
    with pytest.raises(lf.LoraFileError, match="set adapter.variant=dora" if dora
                       else "name no LoRA layer"):  # a plain attention-only LoRA run
        lf.load_lora_file(lora / "k.safetensors", unet, [te], rank=4, alpha=2.0)


def test_a_dora_run_trains_its_magnitudes_and_continues_from_its_file(sd_dir, tmp_path):
    import torch
    from safetensors.torch import load_file

    from steadydiff.integrations.sd.lora_files import kohya_state_dict
    from steadydiff.integrations.sd.setup import build

    data = shapes(tmp_path / "images")
    sets = ("adapter.variant=dora", "optim.lr=0.01", "optim.warmup_steps=0",
            "train.steps=2", "sample.use_ema=false")
    res = steadydiff.train(sd_config(sd_dir, data, *sets), out_dir=tmp_path / "run")
    c = ckpt.load_checkpoint(res.checkpoint, "cpu", weights_only=True)
    mags = [k for k in c.model if "lora_magnitude_vector" in k]
    assert mags  # trained and checkpointed beside A and B
    kohya = tmp_path / "run" / "lora" / "run.safetensors"
    theirs = load_file(kohya)
    assert any(k.endswith(".dora_scale") for k in theirs)
    model, _, _ = build(sd_config(sd_dir, data, *sets, f"adapter.init_from={kohya}"),
                        torch.device("cpu"))
    ours = kohya_state_dict(model.unet)
    assert theirs.keys() == ours.keys()
    assert all(torch.equal(theirs[k], ours[k]) for k in ours)


def test_large_upscales_are_warned_naming_the_smallest_image(tmp_path):
    from PIL import Image

    from steadydiff.data import ImageFolderDataset
    from steadydiff.integrations.sd.advice import upscale_warning

    root = tmp_path / "imgs"
    root.mkdir()
    for i, side in enumerate((512, 600, 100, 128)):
        Image.new("RGB", (side, side + 10), (i * 40, 0, 0)).save(root / f"{i}.png")
    data = ImageFolderDataset(root, image_size=512)
    msg = upscale_warning(data, 512)
    assert msg.startswith("warning: 2 of 4 images are upscaled 4x or more")
    assert "2.png, 100x110, 5x" in msg
    assert upscale_warning(data, 256) is None
    for i in range(4):
        (root / f"{i}.txt").write_text("a red thing")
    from steadydiff.data.captions import CaptionedImageFolder

    captioned = CaptionedImageFolder(data, source="txt")
    assert upscale_warning(captioned, 512).startswith("warning: 2 of 4 images")
