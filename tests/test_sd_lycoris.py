"""LoHa and LoKr (adapter.variant=loha|lokr; sd/lycoris.py) on the tiny SD folder.

The consumer is LyCORIS itself (the ``lycoris.kohya`` network module kohya's sd-scripts
load LyCORIS files with; A1111 and ComfyUI read the same keys by the same formulas): it
loads our file into a fresh pipeline and draws what our peft model draws. Our reader
(adapter.init_from) reads the file back into a fresh LoHa/LoKr with the same tensors.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import steadydiff
from steadydiff.config import ConfigError, load_config

pytest.importorskip("diffusers")
pytest.importorskip("peft")

ATTN = ("*.to_q", "*.to_k", "*.to_v", "*.to_out.0")


@pytest.fixture(scope="module")
def sd(tmp_path_factory) -> Path:
    from steadydiff.integrations.sd.tiny import make_tiny_sd

    return make_tiny_sd(tmp_path_factory.mktemp("lyco") / "sd", image_size=32)


def _pipe(sd: Path):
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(sd, local_files_only=True,
                                                   safety_checker=None)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _add(pipe, variant: str, alpha: float, factor: int = -1) -> None:
    from steadydiff.integrations.sd.model import LOCON_TARGETS, TEXT_ENCODER_TARGETS, add_lora

    add_lora(pipe.unet, rank=4, alpha=alpha, dropout=0.0, targets=ATTN + LOCON_TARGETS,
             variant=variant, factor=factor)
    add_lora(pipe.text_encoder, rank=4, alpha=alpha, dropout=0.0,
             targets=TEXT_ENCODER_TARGETS, variant=variant, factor=factor)


def _draw(pipe) -> torch.Tensor:
    z = torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(1))
    return pipe("a red square", num_inference_steps=2, guidance_scale=3.0, latents=z,
                output_type="pt").images


def _trained(pipe) -> dict[str, torch.Tensor]:
    return {f"{i}.{n}": p.detach().clone()
            for i, m in enumerate((pipe.unet, pipe.text_encoder))
            for n, p in m.named_parameters() if p.requires_grad}


class _TextModel(torch.nn.Module):
    """transformers 5's CLIPTextModel has no ``text_model.`` level in its module paths; the
    files (kohya's, A1111's, ComfyUI's, ours) name it (``lora_te_text_model_encoder_...``),
    as LyCORIS finds it under transformers 4: give it that level back."""

    def __init__(self, te: torch.nn.Module) -> None:
        super().__init__()
        self.text_model = te


@pytest.mark.parametrize("variant, alpha", [("loha", 2.0), ("lokr", 3.0)])
def test_lycoris_loads_our_file_and_draws_our_image_and_it_reads_back(sd, tmp_path, variant,
                                                                      alpha):
    import lycoris.kohya as lk
    from safetensors.torch import load_file

    from steadydiff.integrations.sd import lora_files as lf
    from steadydiff.integrations.sd.model import save_lora

    pipe = _pipe(sd)
    _add(pipe, variant, alpha)
    torch.manual_seed(0)
    with torch.no_grad():  # every factor off its start (a LoKr's w1 starts at zero)
        for m in (pipe.unet, pipe.text_encoder):
            for p in m.parameters():
                if p.requires_grad:
                    p.copy_(torch.randn_like(p) * 0.2)
    ours = _draw(pipe)
    f = save_lora(pipe.unet, tmp_path / "out", pipe.text_encoder, format="kohya",
                  kohya_name="k")
    keys = load_file(f)
    parts = {k.split(".", 1)[1] for k in keys}
    meta = lf.read_lora_file(f).metadata
    assert meta["ss_network_module"] == "lycoris.kohya"
    assert f'"algo": "{variant}"' in meta["ss_network_args"]
    if variant == "loha":
        assert parts == {"alpha", "hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b"}
    else:  # small layers keep both factors full, the convolutions' w2 is rank-decomposed
        assert {"lokr_w1", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "alpha"} <= parts
    assert any(k.startswith("lora_te_text_model_encoder_") for k in keys)
    assert any(k.startswith("lora_unet_down_blocks_0_resnets_0_conv1.") for k in keys)

    base = _draw(_pipe(sd))
    fresh = _pipe(sd)
    te = _TextModel(fresh.text_encoder)
    # LyCORIS 4.1.3 builds its training modules first and names the diffusers UNet's
    # time embedding twice (a TimestepEmbedding class and a time_embedding.linear_1
    # name); loading from weights replaces them: leave that class out of its scan
    cls = lk.LycorisNetworkKohya
    keep = cls.UNET_TARGET_REPLACE_MODULE
    cls.UNET_TARGET_REPLACE_MODULE = [m for m in keep if m != "TimestepEmbedding"]
    try:
        net, _ = lk.create_network_from_weights(1.0, str(f), fresh.vae, te, fresh.unet)
    finally:
        cls.UNET_TARGET_REPLACE_MODULE = keep
    assert len(net.text_encoder_loras) == 8 and len(net.unet_loras) > 40
    net.apply_to(te, fresh.unet, True, True)
    theirs = _draw(fresh)
    assert (ours - base).abs().max() > 1e-2
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=0)

    back = _pipe(sd)
    _add(back, variant, alpha)
    got = lf.load_lora_file(f, back.unet, [back.text_encoder], rank=4, alpha=alpha)
    assert got["fresh"] == 0
    want = _trained(pipe)
    for n, p in _trained(back).items():
        torch.testing.assert_close(p, want[n], rtol=1e-6, atol=1e-7)
    # at another alpha the same delta: the first factor rescaled
    other = _pipe(sd)
    _add(other, variant, 1.0)
    lf.load_lora_file(f, other.unet, [other.text_encoder], rank=4, alpha=1.0)
    torch.testing.assert_close(_draw(other), ours, atol=1e-5, rtol=0)


def test_files_of_another_variant_or_unread_layouts_are_refused_naming_them(sd, tmp_path):
    from safetensors.torch import save_file

    from steadydiff.integrations.sd import lora_files as lf
    from steadydiff.integrations.sd.model import add_lora, save_lora

    loha = _pipe(sd)
    _add(loha, "loha", 2.0)
    f = save_lora(loha.unet, tmp_path / "loha", loha.text_encoder, format="kohya",
                  kohya_name="k")
    plain = _pipe(sd)
    add_lora(plain.unet, rank=4, alpha=2.0, dropout=0.0, targets=ATTN)
    with pytest.raises(lf.LoraFileError, match="a LyCORIS LoHa .* set adapter.variant=loha"):
        lf.load_lora_file(f, plain.unet, [], rank=4, alpha=2.0)
    lokr = _pipe(sd)
    _add(lokr, "lokr", 2.0)
    with pytest.raises(lf.LoraFileError, match="is a LoHa layer; this run trains a LoKr: set "
                                                "adapter.variant=loha"):
        lf.load_lora_file(f, lokr.unet, [lokr.text_encoder], rank=4, alpha=2.0)
    p = save_lora(plain.unet, tmp_path / "plain", format="kohya", kohya_name="p")
    with pytest.raises(lf.LoraFileError, match="plain LoRA layers .* set adapter.variant=lora"):
        lf.load_lora_file(p, lokr.unet, [lokr.text_encoder], rank=4, alpha=2.0)
    other = _pipe(sd)
    _add(other, "lokr", 2.0, factor=2)  # another Kronecker split: other shapes, named
    with pytest.raises(lf.LoraFileError, match=r"holds .* where this run.s layer holds .*adapter.factor"):
        lokr_file = save_lora(lokr.unet, tmp_path / "lokr", format="kohya", kohya_name="r")
        lf.load_lora_file(lokr_file, other.unet, [], rank=4, alpha=2.0)

    name = "lora_unet_down_blocks_0_resnets_0_conv1"
    for keys, needle in [(("hada_w1_a", "hada_w1_b", "hada_t1", "hada_t2", "hada_w2_a",
                           "hada_w2_b", "alpha"), "Tucker-decomposed"),
                         (("hada_w1_a", "hada_w2_a", "alpha"), "a LoHa layer without"),
                         (("lokr_w1", "lokr_w2_a", "alpha"), "a LoKr layer without"),
                         (("lokr_w1", "lokr_w2", "oft_blocks", "alpha"), "mixes")]:
        bad = tmp_path / "bad.safetensors"
        save_file({f"{name}.{k}": torch.ones(()) if k == "alpha" else torch.zeros(4, 4)
                   for k in keys}, bad)
        with pytest.raises(lf.LoraFileError, match=needle):
            lf.read_lora_file(bad)


def _config(sd: Path, data: Path, *sets: str):
    return load_config("configs/sd_lora.yaml", [
        f"model.pretrained={sd}", f"data.path={data}", "data.image_size=32",
        "train.steps=4", "train.batch_size=2", "train.precision=fp32",
        "train.checkpoint_every=2", "train.sample_every=0", "train.num_threads=1",
        "train.device=cpu", "logging.log_every=1", "guard.warmup_steps=2",
        "data.num_workers=0", "optim.warmup_steps=0", "adapter.rank=4", *sets])


def test_a_loha_run_writes_numbered_lycoris_files_is_guarded_and_continues(sd, tmp_path,
                                                                         capsys):
    """A LoHa run with its text encoder: only the LyCORIS file (diffusers reads no LoHa),
    numbered per save; ‖dW‖/‖W‖ watched (a tiny adapter.max_delta_ratio clamps every
    layer, named); adapter.init_from continues from the file with its tensors."""
    from safetensors.torch import load_file

    from steadydiff.integrations.sd.lora_guard import lora_deltas
    from steadydiff.integrations.sd.tiny import captioned_digits

    data = captioned_digits(tmp_path / "data", n=8, image_size=32)
    cfg = _config(sd, data, "adapter.variant=loha", "adapter.text_encoder=true",
                  "adapter.max_delta_ratio=1e-4", "optim.lr=0.01")
    res = steadydiff.train(cfg, out_dir=tmp_path / "run")
    said = capsys.readouterr()
    assert "RUN/lora/ holds LyCORIS' file alone" in said.out + said.err
    lora = tmp_path / "run" / "lora"
    names = sorted(p.name for p in lora.glob("*.safetensors"))
    assert names == ["run-step00000002.safetensors", "run-step00000004.safetensors",
                     "run.safetensors"], names
    assert res.incidents >= 1
    rows = [r for r in map(__import__("json").loads,
                           (tmp_path / "run" / "incidents.jsonl").read_text().splitlines())]
    clamp = [r for r in rows if r["kind"] == "adapter_delta_clamp"]
    assert clamp and ".attn" in clamp[0]["evidence"]["module"]
    assert clamp[0]["evidence"]["ratio"] > 1e-4  # the LoHa's own ‖dW‖/‖W‖, read
    # the files hold the EMA (sample.use_ema), clamped with the model
    trained = steadydiff.load(tmp_path / "run", device="cpu", use_ema=True).model
    for d in lora_deltas(trained).values():  # every layer within the limit after the clamp
        assert float(d.delta_ratio()) <= 1e-4 * 1.01
    keys = load_file(lora / "run.safetensors")
    assert any(".hada_w2_b" in k for k in keys)
    from steadydiff.integrations.sd.advice import load_hints

    hints = "\n".join(load_hints(cfg, tmp_path / "run"))  # the CLI's end-of-run lines
    assert "LoHa (LyCORIS) rank 4" in hints and "ComfyUI: copy" in hints
    assert "diffusers:" not in hints

    cont = _config(sd, data, "adapter.variant=loha", "adapter.text_encoder=true",
                   f"adapter.init_from={lora / 'run.safetensors'}", "train.steps=1",
                   "optim.lr=1e-6")
    from steadydiff.integrations.sd.setup import build
    from steadydiff.integrations.sd.source import resolve_config

    model, _, _ = build(resolve_config(cont)[0], torch.device("cpu"))
    ours = dict(trained.named_parameters())
    for n, p in model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p, ours[n], rtol=1e-6, atol=1e-7)


def test_variants_a_format_cannot_hold_are_refused_before_training(sd, tmp_path):
    from steadydiff.integrations.sd.tiny import captioned_digits

    data = captioned_digits(tmp_path / "data", n=4, image_size=32)
    with pytest.raises(ConfigError, match="Stable Diffusion 1.x/2.x LoRA loader reads no "
                                          "LoHa: set adapter.lora_format=kohya"):
        steadydiff.train(_config(sd, data, "adapter.variant=loha",
                                 "adapter.lora_format=diffusers"), out_dir=tmp_path / "a")
    with pytest.raises(ConfigError, match="adapter.dropout=0.1: peft's lokr"):
        _config(sd, data, "adapter.variant=lokr", "adapter.dropout=0.1")
    with pytest.raises(ConfigError, match="adapter.factor=4 splits a LoKr"):
        _config(sd, data, "adapter.variant=loha", "adapter.factor=4")
    assert not (tmp_path / "a" / "lora").exists()
    with pytest.raises(ConfigError, match="reads no LoKr .it does for Z-Image"):
        steadydiff.train(_config(sd, data, "adapter.variant=lokr",
                                 "adapter.lora_format=diffusers"), out_dir=tmp_path / "b")


def test_a_lokr_over_a_fused_kohya_module_is_refused_before_training(tmp_path):
    """FLUX.1's kohya/LyCORIS names hold q, k and v as one qkv module: a LoKr on diffusers'
    separate to_q/to_k/to_v cannot be one LyCORIS layer; refused at start, naming it."""
    from steadydiff.integrations.sd.tiny import captioned_digits, main

    flux = tmp_path / "flux"
    main([str(flux), "--family", "flux"])
    data = captioned_digits(tmp_path / "data", n=4, image_size=32)
    cfg = load_config("configs/flux_lora.yaml", [
        f"model.pretrained={flux}", f"data.path={data}", "data.image_size=32",
        "train.steps=2", "train.batch_size=2", "train.precision=fp32", "train.device=cpu",
        "train.num_threads=1", "data.num_workers=0", "adapter.variant=lokr",
        "train.gradient_checkpointing=false"])
    with pytest.raises(ConfigError, match="adapter.variant=lokr: its LyCORIS file has one "
                                          "layer per original module, and .*qkv fuses"):
        steadydiff.train(cfg, out_dir=tmp_path / "run")


@pytest.mark.parametrize("variant", ["loha", "lokr"])
def test_sdxl_files_use_the_original_unets_names_and_read_back(tmp_path, variant):
    """SDXL: the LyCORIS file names the original (sgm) UNet's layers, as kohya's SDXL
    LoRAs do (lora_unet_input_blocks_4_1_...), and both text encoders (lora_te1_, lora_te2_);
    read back into a fresh LoHa/LoKr with the same tensors."""
    from diffusers import StableDiffusionXLPipeline
    from safetensors.torch import load_file

    from steadydiff.integrations.sd import lora_files as lf
    from steadydiff.integrations.sd.model import TEXT_ENCODER_TARGETS, add_lora, save_lora
    from steadydiff.integrations.sd.tiny import make_tiny_sdxl

    folder = make_tiny_sdxl(tmp_path / "sdxl", image_size=32)

    def fresh():
        pipe = StableDiffusionXLPipeline.from_pretrained(folder, local_files_only=True)
        add_lora(pipe.unet, rank=4, alpha=3.0, dropout=0.0, targets=ATTN, variant=variant)
        for te in (pipe.text_encoder, pipe.text_encoder_2):
            add_lora(te, rank=4, alpha=3.0, dropout=0.0, targets=TEXT_ENCODER_TARGETS,
                     variant=variant)
        return pipe

    pipe = fresh()
    torch.manual_seed(0)
    with torch.no_grad():
        for m in (pipe.unet, pipe.text_encoder, pipe.text_encoder_2):
            for p in m.parameters():
                if p.requires_grad:
                    p.copy_(torch.randn_like(p) * 0.2)
    tes = [pipe.text_encoder, pipe.text_encoder_2]
    f = save_lora(pipe.unet, tmp_path / "out", tes, format="kohya", kohya_name="k")
    keys = load_file(f)
    assert any(k.startswith("lora_unet_input_blocks_") for k in keys)
    assert any(k.startswith("lora_te1_") for k in keys) and \
        any(k.startswith("lora_te2_") for k in keys)
    back = fresh()
    got = lf.load_lora_file(f, back.unet, [back.text_encoder, back.text_encoder_2], rank=4,
                            alpha=3.0)
    assert got["fresh"] == 0
    for a, b in ((pipe.unet, back.unet), (pipe.text_encoder, back.text_encoder),
                 (pipe.text_encoder_2, back.text_encoder_2)):
        want = dict(a.named_parameters())
        for n, p in b.named_parameters():
            if p.requires_grad:
                torch.testing.assert_close(p, want[n], rtol=1e-6, atol=1e-7)
