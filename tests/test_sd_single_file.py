"""Single-file checkpoints (the original LDM layout A1111/ComfyUI use), made from the tiny
components: written by our exporter, read back through diffusers' single-file loader with
a local config only (the network is cut), the same tensors as the folder, a LoRA run from
the file equal to one from the folder, a full fine-tune exported as a single file, and the
refusals (pickles are never unpickled, a missing or YAML config, a file of another kind)."""

from __future__ import annotations

import pickle
import socket
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("peft")

import steadydiff  # noqa: E402
from steadydiff.config import ConfigError  # noqa: E402
from steadydiff.integrations.sd import single_file as sf  # noqa: E402
from steadydiff.integrations.sd.folder import SDFolderError  # noqa: E402
from steadydiff.integrations.sd.source import load_parts  # noqa: E402
from steadydiff.integrations.sd.tiny import make_tiny_sd  # noqa: E402
from steadydiff.trainer import checkpoint as ckpt  # noqa: E402
from steadydiff.trainer.checkpoint import CheckpointError  # noqa: E402

from test_sd import sd_config, shapes  # noqa: E402


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """No test here may reach the network: a connection attempt fails loudly."""
    import huggingface_hub.constants as hc

    def refuse(*a, **k):
        raise OSError("network access attempted in an offline test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def sd_dir(tmp_path_factory) -> Path:
    return make_tiny_sd(tmp_path_factory.mktemp("sd") / "tiny-sd", image_size=32)


@pytest.fixture(scope="module")
def sd_file(sd_dir) -> Path:
    """The tiny folder converted to one original-layout file by our exporter."""
    p = load_parts(sd_dir)
    return sf.export_single_file(sd_dir.parent / "tiny-sd.safetensors", p.unet, p.vae,
                                 p.text_encoder)


def _state(m) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in m.state_dict().items()}


def test_file_loads_back_with_the_folders_exact_tensors(sd_dir, sd_file):
    a, b = load_parts(sd_dir), load_parts(sd_file, sd_dir)
    for part in ("unet", "vae", "text_encoder"):
        x, y = _state(getattr(a, part)), _state(getattr(b, part))
        assert x.keys() == y.keys(), part
        for k in x:
            assert torch.equal(x[k], y[k]), (part, k)
    assert b.root == sd_file and b.tokenizer("a red square").input_ids == \
        a.tokenizer("a red square").input_ids


def test_written_keys_are_the_original_layout(sd_file):
    from safetensors import safe_open

    with safe_open(str(sd_file), framework="pt") as h:
        keys = set(h.keys())
        attn_q = h.get_tensor("first_stage_model.encoder.mid.attn_1.q.weight")
    assert {k.split(".")[0] for k in keys} == {"model", "first_stage_model", "cond_stage_model"}
    assert attn_q.ndim == 4  # a 1x1 conv in the original autoencoder
    for k in ("model.diffusion_model.input_blocks.0.0.weight",
              "model.diffusion_model.input_blocks.1.1.transformer_blocks.0.attn2.to_k.weight",
              "model.diffusion_model.input_blocks.2.0.op.weight",
              "model.diffusion_model.middle_block.1.proj_in.weight",
              "model.diffusion_model.output_blocks.1.1.conv.weight",  # no attention: slot 1
              "model.diffusion_model.output_blocks.2.0.skip_connection.weight",
              "model.diffusion_model.time_embed.2.bias", "model.diffusion_model.out.2.weight",
              "first_stage_model.decoder.up.0.block.0.nin_shortcut.weight",
              "first_stage_model.decoder.up.1.upsample.conv.weight",
              "first_stage_model.encoder.down.0.downsample.conv.weight",
              "cond_stage_model.transformer.text_model.embeddings.token_embedding.weight"):
        assert k in keys, k


def test_sd15_shaped_unet_and_vae_map_to_real_v1_5_key_names():
    """Against key names of the real v1-5-pruned-emaonly.safetensors (SD 1.5's configs,
    built on the meta device: no weights)."""
    from diffusers import AutoencoderKL, UNet2DConditionModel

    with torch.device("meta"):
        unet = UNet2DConditionModel(cross_attention_dim=768, attention_head_dim=8)
        vae = AutoencoderKL(block_out_channels=(128, 256, 512, 512), layers_per_block=2,
                            latent_channels=4,
                            down_block_types=("DownEncoderBlock2D",) * 4,
                            up_block_types=("UpDecoderBlock2D",) * 4)
    u = sf._unet_keys(unet.state_dict(), unet.config)
    v = sf._rename(vae.state_dict(), sf._vae_map(dict(vae.config)), sf.VAE)
    real = ["model.diffusion_model.input_blocks.3.0.op.weight",
            "model.diffusion_model.input_blocks.4.0.skip_connection.weight",
            "model.diffusion_model.input_blocks.8.1.transformer_blocks.0.ff.net.0.proj.weight",
            "model.diffusion_model.input_blocks.11.0.out_layers.3.weight",
            "model.diffusion_model.middle_block.2.emb_layers.1.weight",
            "model.diffusion_model.output_blocks.2.1.conv.weight",
            "model.diffusion_model.output_blocks.5.2.conv.weight",
            "model.diffusion_model.output_blocks.11.1.proj_out.weight",
            "model.diffusion_model.time_embed.0.weight",
            "first_stage_model.decoder.up.3.upsample.conv.weight",
            "first_stage_model.decoder.up.1.block.0.nin_shortcut.weight",
            "first_stage_model.decoder.mid.attn_1.proj_out.weight",
            "first_stage_model.encoder.down.2.downsample.conv.weight",
            "first_stage_model.encoder.norm_out.weight", "first_stage_model.quant_conv.weight"]
    assert set(real) <= set(u) | set(v), sorted(set(real) - set(u) - set(v))
    assert len(u) == 686 and len(v) == 248  # SD 1.5's UNet and VAE key counts


def test_lora_run_from_the_file_equals_the_folders_and_loads_into_its_pipeline(
        sd_dir, sd_file, tmp_path):
    from diffusers import StableDiffusionPipeline

    data = shapes(tmp_path / "images")
    runs = {}
    for name, sets in (("folder", ()), ("file", (f"model.pretrained={sd_file}",
                                                 f"model.single_file_config={sd_dir}"))):
        res = steadydiff.train(sd_config(sd_dir, data, "train.steps=2", *sets),
                               out_dir=tmp_path / name)
        runs[name] = ckpt.load_checkpoint(res.checkpoint, "cpu", weights_only=True)
    a, b = runs["folder"], runs["file"]
    assert a.model.keys() == b.model.keys() and a.model
    for k in a.model:
        assert torch.equal(a.model[k], b.model[k]), k
    pipe = StableDiffusionPipeline.from_pretrained(sd_dir, local_files_only=True,
                                                   safety_checker=None)
    pipe.load_lora_weights(tmp_path / "file" / "lora")
    assert any("lora" in n for n, _ in pipe.unet.named_parameters())


@pytest.mark.slow
def test_full_fine_tune_from_the_file_exports_a_single_file(sd_dir, sd_file, tmp_path):
    from steadydiff.cli import main

    data = shapes(tmp_path / "images")
    res = steadydiff.train(sd_config(sd_dir, data, "adapter.kind=none", "train.steps=2",
                                     "optim.lr=0.01", f"model.pretrained={sd_file}",
                                     f"model.single_file_config={sd_dir}"),
                           out_dir=tmp_path / "run")
    out = tmp_path / "run" / "model.safetensors"
    assert out.is_file() and not (tmp_path / "run" / "model").exists()
    trained = load_parts(out, sd_dir)
    base = load_parts(sd_file, sd_dir)
    c = ckpt.load_checkpoint(res.checkpoint, "cpu", weights_only=True)
    ema = {k.removeprefix("unet."): v for k, v in c.ema.items() if k.startswith("unet.")}
    for k, v in _state(trained.unet).items():
        assert torch.equal(v, ema[k]), k
    assert any(not torch.equal(v, _state(base.unet)[k]) for k, v in ema.items())
    for part in ("vae", "text_encoder"):  # the base file's, unchanged
        x, y = _state(getattr(trained, part)), _state(getattr(base, part))
        assert all(torch.equal(x[k], y[k]) for k in x), part
    # the CLI writes the same from the run (and from a folder), fp16 with --half
    again = tmp_path / "again.safetensors"
    assert main(["export", str(tmp_path / "run"), "--single-file", str(again)]) == 0
    assert load_parts(again, sd_dir).unet.state_dict().keys() == ema.keys()
    half = tmp_path / "half.safetensors"
    assert main(["export", str(sd_dir), "--single-file", str(half), "--half"]) == 0
    from safetensors.torch import load_file

    assert {v.dtype for v in load_file(half).values()} == {torch.float16}
    assert load_parts(half, sd_dir).unet is not None


def test_export_command_writes_a_folder_based_full_fine_tune(sd_dir, tmp_path, capsys):
    from steadydiff.cli import main

    data = shapes(tmp_path / "images", n=4)
    steadydiff.train(sd_config(sd_dir, data, "adapter.kind=none", "train.steps=1",
                               "train.batch_size=2", "optim.lr=0.01"),
                     out_dir=tmp_path / "run")
    out = tmp_path / "ft.safetensors"
    assert main(["export", str(tmp_path / "run"), "--single-file", str(out)]) == 0
    assert "original single-file layout" in capsys.readouterr().out
    mine = load_parts(out, sd_dir)
    folder = load_parts(tmp_path / "run" / "model")  # the diffusers export of the same run
    for part in ("unet", "vae", "text_encoder"):
        x, y = _state(getattr(mine, part)), _state(getattr(folder, part))
        assert all(torch.equal(x[k], y[k]) for k in x), part
    assert main(["export", str(tmp_path / "run"), "--single-file",
                 str(tmp_path / "x.ckpt")]) == 2


def test_lora_run_export_is_refused(sd_dir, tmp_path, capsys):
    from steadydiff.cli import main

    data = shapes(tmp_path / "images", n=4)
    steadydiff.train(sd_config(sd_dir, data, "train.steps=1", "train.batch_size=2"),
                     out_dir=tmp_path / "run")
    assert main(["export", str(tmp_path / "run"), "--single-file",
                 str(tmp_path / "x.safetensors")]) == 2
    assert "pytorch_lora_weights" in capsys.readouterr().err


def test_non_finite_weights_are_never_written(tmp_path):
    out = tmp_path / "m.safetensors"
    good = {"model.diffusion_model.out.2.weight": torch.ones(2)}
    sf.write_single_file(out, good)
    before = out.read_bytes()
    with pytest.raises(CheckpointError, match="non-finite"):
        sf.write_single_file(out, {**good, "first_stage_model.x": torch.tensor([float("nan")])})
    assert out.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == \
        ["m.safetensors"]  # the old file whole, no temporary left


class _Payload:
    """A pickle that, if ever unpickled, writes a marker file (what a malicious .ckpt does
    with os.system)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "unpickled"))


@pytest.mark.parametrize("suffix", [".ckpt", ".pt", ".bin"])
def test_pickles_are_refused_unopened_with_how_to_convert(sd_dir, tmp_path, suffix):
    marker = tmp_path / "ran"
    f = tmp_path / f"v1-5-pruned-emaonly{suffix}"
    f.write_bytes(pickle.dumps({"state_dict": _Payload(marker)}))
    with pytest.raises(SDFolderError) as e:
        load_parts(f, sd_dir)
    msg = str(e.value)
    assert "pickle" in msg and "weights_only=True" in msg and "safetensors" in msg
    assert "isolated" in msg and "never" in msg
    assert not marker.exists()


def test_single_file_refusals_name_what_to_pass(sd_dir, sd_file, tmp_path):
    with pytest.raises(SDFolderError, match="set model.single_file_config"):
        load_parts(sd_file, None)
    yaml = tmp_path / "v1-inference.yaml"
    yaml.write_text("model:\n  target: ldm.models.diffusion.ddpm.LatentDiffusion\n")
    with pytest.raises(SDFolderError, match="original LDM YAML.*clip-vit-large-patch14"):
        load_parts(sd_file, yaml)
    with pytest.raises(SDFolderError, match="single_file_config: .*does not exist"):
        load_parts(sd_file, tmp_path / "nowhere")
    unet = sd_dir / "unet" / "diffusion_pytorch_model.safetensors"
    with pytest.raises(SDFolderError, match="looks like a diffusers UNet"):
        load_parts(unet, sd_dir)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x01" * 64)
    with pytest.raises(SDFolderError, match="not a readable safetensors"):
        load_parts(junk, sd_dir)
    other = tmp_path / "model.gguf"
    other.write_bytes(b"GGUF")
    with pytest.raises(SDFolderError, match="not a .safetensors checkpoint"):
        load_parts(other, sd_dir)


def test_config_keys_are_checked_together(sd_dir, sd_file, tmp_path):
    from steadydiff.config import load_config
    from steadydiff.integrations.sd.source import model_root, resolve_config

    with pytest.raises(ConfigError, match="single_file_config is the config"):
        load_config("configs/sd_lora.yaml", ["model.pretrained=null",
                                             f"model.single_file_config={sd_dir}",
                                             f"data.path={tmp_path}"])
    cfg = sd_config(sd_dir, tmp_path, f"model.single_file_config={sd_dir}")
    with pytest.raises(SDFolderError, match="not a single-file checkpoint: remove it"):
        model_root(cfg.model)
    cfg = sd_config(sd_dir, tmp_path, f"model.pretrained={sd_file}",
                    f"model.single_file_config={sd_dir}")
    from steadydiff import preflight
    from steadydiff.integrations.sd.setup import unet_parameters

    # --dry-run's model check reads the config folder (no weights)
    assert preflight.check_model(cfg) == unet_parameters(sd_dir)
    resolved, _ = resolve_config(cfg)  # the diffusion settings from the config folder
    assert resolved.diffusion.schedule == "scaled_linear"
    assert (resolved.diffusion.beta_start, resolved.diffusion.beta_end) == (0.00085, 0.012)
