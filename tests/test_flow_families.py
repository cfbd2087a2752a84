"""SD3/SD3.5 and FLUX.1 (integrations/families/sd3.py, flux.py) on tiny folders built from
configs (``python -m steadydiff.integrations.sd.tiny OUT --family sd3|flux``): the layout and
its errors, the T5 tokenizer loading offline from a tokenizer.json, conditioning equal to the
pipelines' encode_prompt + transformer call, the recipe from the folder, sampling equal to the
diffusers pipeline for the same noise (with and without the LoRA), LoRA files (diffusers and
kohya, fused qkv) loaded by diffusers and continued from, single files in the original
layouts, exact resume, and the guard's faults on this path."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("peft")

import steadydiff  # noqa: E402
from steadydiff.config import ConfigError, load_config  # noqa: E402
from steadydiff.integrations.sd.folder import SDFolderError, check_folder  # noqa: E402
from steadydiff.trainer import checkpoint as ckpt  # noqa: E402

from test_sd import incidents, shapes  # noqa: E402

PIPELINES = {"sd3": "StableDiffusion3Pipeline", "flux": "FluxPipeline",
             "schnell": "FluxPipeline", "sd35": "StableDiffusion3Pipeline"}
FAMILY = {"sd3": "sd3", "sd35": "sd3", "flux": "flux", "schnell": "flux"}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """The tiny folders, written by the command users run (the tiny CLI) or its function:
    SD3, SD3.5 (QK-norm), FLUX.1 dev, FLUX.1 schnell (no guidance embedding)."""
    from steadydiff.integrations.sd.tiny import main, make_tiny

    root = tmp_path_factory.mktemp("flowfam")
    main([str(root / "sd3"), "--family", "sd3"])
    main([str(root / "flux"), "--family", "flux"])
    make_tiny(root / "sd35", "sd3", qk_norm="rms_norm")
    make_tiny(root / "schnell", "flux", guidance_embeds=False)
    return {k: root / k for k in ("sd3", "sd35", "flux", "schnell")}


def pipeline(folder: Path, name: str):
    import diffusers

    return getattr(diffusers, PIPELINES[name]).from_pretrained(folder, local_files_only=True)


def flow_config(folder: Path, data: Path, name: str, *sets: str):
    base = [f"model.pretrained={folder}", f"data.path={data}", "data.image_size=32",
            "train.steps=4", "train.batch_size=4", "train.precision=fp32",
            "train.checkpoint_every=2", "train.sample_every=0", "train.num_threads=1",
            "train.device=cpu", "train.gradient_checkpointing=false", "sample.num=2",
            "sample.steps=3", "optim.warmup_steps=0", "logging.log_every=1",
            "guard.warmup_steps=3", "data.num_workers=0", "adapter.rank=4", "adapter.alpha=4"]
    return load_config(f"configs/{FAMILY[name]}_lora.yaml", base + list(sets))


def _build(cfg):
    from steadydiff.integrations.sd.setup import build
    from steadydiff.integrations.sd.source import resolve_config

    return build(resolve_config(cfg)[0], torch.device("cpu"))


# --------------------------------------------------------------------------- the folders


@pytest.mark.parametrize("name, classes", [
    ("sd3", {"transformer": "SD3Transformer2DModel", "text_encoder_3": "T5EncoderModel",
             "text_encoder": "CLIPTextModelWithProjection", "tokenizer_3": "T5Tokenizer"}),
    ("flux", {"transformer": "FluxTransformer2DModel", "text_encoder_2": "T5EncoderModel",
              "text_encoder": "CLIPTextModel", "tokenizer_2": "T5Tokenizer"}),
])
def test_tiny_folders_are_laid_out_like_the_real_ones(folders, name, classes):
    from steadydiff.integrations.sd.folder import family_of

    root = folders[name]
    index = json.loads((root / "model_index.json").read_text())
    assert index["_class_name"] == PIPELINES[name]
    for part, cls in classes.items():
        assert index[part][1] == cls
    t5 = root / ("tokenizer_3" if name == "sd3" else "tokenizer_2")
    assert (t5 / "tokenizer.json").is_file() and not (t5 / "spiece.model").exists()
    assert check_folder(root) == root and family_of(root).name == name
    sched = json.loads((root / "scheduler" / "scheduler_config.json").read_text())
    assert sched["_class_name"] == "FlowMatchEulerDiscreteScheduler"
    vae = json.loads((root / "vae" / "config.json").read_text())
    assert vae["shift_factor"] and vae["scaling_factor"] != 0.18215


def test_folder_errors_name_the_problem(folders, tmp_path):
    bad = tmp_path / "flux"
    shutil.copytree(folders["flux"], bad)
    for f in (bad / "tokenizer_2").iterdir():  # a T5 tokenizer saved as spiece.model only
        if f.name != "tokenizer_config.json":
            f.unlink()
    (bad / "tokenizer_2" / "spiece.model").write_bytes(b"\0")
    with pytest.raises(SDFolderError, match="spiece.model only.*sentencepiece"):
        check_folder(bad)
    sd3 = tmp_path / "sd3"
    shutil.copytree(folders["sd3"], sd3)
    index = json.loads((sd3 / "model_index.json").read_text())
    index["text_encoder_3"] = [None, None]
    (sd3 / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(SDFolderError, match="text_encoder_3 is null"):
        check_folder(sd3)
    sched = folders["flux"] / "scheduler" / "scheduler_config.json"
    odd = tmp_path / "odd"
    shutil.copytree(folders["flux"], odd)
    conf = json.loads(sched.read_text())
    conf["use_karras_sigmas"] = True
    (odd / "scheduler" / "scheduler_config.json").write_text(json.dumps(conf))
    from steadydiff.integrations.sd.folder import diffusion_settings
    with pytest.raises(SDFolderError, match="use_karras_sigmas=True"):
        diffusion_settings(odd)


# --------------------------------------------------------------------------- conditioning


@pytest.mark.parametrize("name", ["sd3", "sd35", "flux", "schnell"])
def test_conditioning_equals_the_pipelines_encode_prompt_and_transformer_call(
        folders, tmp_path, name):
    """Our packed y gives the transformer what the pipeline gives it: the same prompt
    embeds and pooled projections (T5 within its own SDPA rounding), and, through the
    family's call (FLUX: 2x2 packing, position ids, guidance 3.5; SD3: σ·1000), the same
    output as the pipeline's own transformer call."""
    from diffusers.pipelines.flux.pipeline_flux import FluxPipeline

    pipe = pipeline(folders[name], name)
    prompts = ["a red square", "a blue circle, small"]
    model, _, media = _build(flow_config(folders[name], shapes(tmp_path / "i", 2), name,
                                         "adapter.kind=none"))
    y = media.encode_prompts(prompts)
    e, p, _ = media.layout.unpack(y)
    with torch.no_grad():  # the pipeline's T5 runs without grad: the same SDPA kernel
        if FAMILY[name] == "sd3":
            pe, _, pooled, _ = pipe.encode_prompt(prompts, prompts, prompts, device="cpu",
                                                  do_classifier_free_guidance=True)
        else:
            # schnell: T5 at 256 tokens (kohya's rule; FLUX.1-schnell's documented setting)
            pe, pooled, text_ids = pipe.encode_prompt(
                prompts, prompts, device="cpu",
                max_sequence_length=256 if name == "schnell" else 512)
    torch.testing.assert_close(e, pe, rtol=0, atol=2e-5)
    torch.testing.assert_close(p, pooled, rtol=0, atol=1e-6)
    x = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(0))
    sigma = torch.tensor([0.3, 0.9])
    with torch.no_grad():
        ours = model(x, sigma * 1000, y)
        if FAMILY[name] == "sd3":
            theirs = pipe.transformer(hidden_states=x, timestep=sigma * 1000,
                                      encoder_hidden_states=pe, pooled_projections=pooled
                                      ).sample
        else:
            guidance = torch.full([2], 3.5) if name == "flux" else None
            out = pipe.transformer(hidden_states=FluxPipeline._pack_latents(x, 2, 4, 16, 16),
                                   timestep=sigma, guidance=guidance, pooled_projections=pooled,
                                   encoder_hidden_states=pe, txt_ids=text_ids,
                                   img_ids=FluxPipeline._prepare_latent_image_ids(
                                       2, 8, 8, "cpu", pe.dtype)).sample
            theirs = FluxPipeline._unpack_latents(out, 32, 32, 2)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)
    if name == "flux":  # the guidance embedding is an input of dev
        model.guidance = 1.0
        with torch.no_grad():
            assert (model(x, sigma * 1000, y) - ours).abs().max() > 1e-5


def test_t5_stays_out_of_fp16_where_it_overflows(folders, tmp_path):
    """fp16 frozen parts: the CLIP runs in fp16, T5 in bf16/fp32 (its activations overflow
    fp16); with T5's feed-forward scaled so its fp16 activations pass 65504 (a fault from
    outside: the weights), the caption embeddings stay finite and close to fp32's, where the
    same T5 in fp16 saturates (transformers clamps T5's fp16 overflow to ±65504: finite,
    and wrong)."""
    from safetensors.torch import load_file, save_file

    hot = tmp_path / "hot"
    shutil.copytree(folders["flux"], hot)
    w = hot / "text_encoder_2" / "model.safetensors"
    sd = load_file(w)
    for k in sd:
        if k.endswith("DenseReluDense.wo.weight") or k.endswith("DenseReluDense.wi_0.weight"):
            sd[k] = sd[k] * 300.0
    save_file(sd, w)
    cfg = flow_config(hot, shapes(tmp_path / "i", 2), "flux", "adapter.kind=none",
                      "train.precision=fp16", "train.allow_slow_precision=true")
    _, _, media = _build(cfg)
    assert media.text_dtypes[0] == torch.float16 and media.text_dtypes[1] != torch.float16
    y = media.encode_prompts(["a red square", "a blue circle"])
    assert torch.isfinite(y).all()
    ids = media.tokenize(["a red square"])[:, -media.layout.ids_len[1]:]
    import copy

    t5 = copy.deepcopy(media.text_encoders[1]).float()
    with torch.no_grad():
        ref = t5(ids)[0]
        ours = media.layout.unpack(media.encode_prompts(["a red square"]))[0]
        in_fp16 = t5.half()(ids)[0].float()  # the trap the family avoids
    err_ours, err_fp16 = (ours - ref).abs().max(), (in_fp16 - ref).abs().max()
    assert err_fp16 > 0.1 and err_ours < err_fp16 / 10, (err_ours, err_fp16)


# --------------------------------------------------------------------------- the recipe


def test_recipe_comes_from_the_folder_and_user_choices_are_kept(folders, tmp_path):
    from steadydiff.integrations.sd.source import resolve_config

    data = shapes(tmp_path / "i", 2)
    cfg, notes = resolve_config(flow_config(folders["sd3"], data, "sd3"))
    d = cfg.diffusion
    assert (d.objective, d.flow.shift, d.flow.dynamic_shift, d.timestep_sampling) == \
        ("flow", 3.0, False, "logit_normal")
    assert d.flow.grid_end == "table" and cfg.sample.cfg_scale == 7.0
    assert any("diffusion.flow.shift=3.0 (from sd3/scheduler/scheduler_config.json: shift"
               in n for n in notes)
    cfg, _ = resolve_config(flow_config(folders["flux"], data, "flux",
                                        "diffusion.timestep_sampling=sigmoid"))
    d = cfg.diffusion
    assert d.flow.dynamic_shift and d.flow.token_pixels == 4  # tiny VAE x2, then 2x2
    assert d.timestep_sampling == "sigmoid"  # the user's choice over the trainers' default
    assert cfg.diffusion.cfg_dropout == 0.0 and cfg.sample.cfg_scale == 1.0
    from steadydiff.diffusion import make_schedule
    from steadydiff.diffusion.flow import dynamic_shift_mu

    sched = make_schedule(cfg.diffusion, 32)  # (32 / 4)^2 = 64 tokens, as FluxPipeline's
    assert sched.shift == pytest.approx(np.exp(dynamic_shift_mu(64)))
    sd = load_config("configs/sd_lora.yaml", [f"model.pretrained={folders['flux']}",
                                              f"data.path={data}"])
    with pytest.raises(ConfigError, match="diffusion.loss_weighting=min_snr"):
        resolve_config(sd)  # SD's min-SNR is a ddpm weighting: named, not silently dropped


# --------------------------------------------------------------------------- LoRA and sampling


def _draw(pipe, name: str, prompt: str, z: torch.Tensor, steps: int, scale: float):
    """The pipeline's image (in [0, 1]) from our latent noise ``z`` (N, 4, 16, 16)."""
    from diffusers.pipelines.flux.pipeline_flux import FluxPipeline

    n = z.shape[0]
    if FAMILY[name] == "flux":
        return pipe([prompt] * n, height=32, width=32, num_inference_steps=steps,
                    guidance_scale=3.5, latents=FluxPipeline._pack_latents(z.clone(), n, 4, 16,
                                                                           16),
                    output_type="pt").images
    return pipe([prompt] * n, height=32, width=32, num_inference_steps=steps,
                guidance_scale=scale, latents=z.clone(), output_type="pt").images


@pytest.mark.parametrize("name", ["sd3", "flux"])
def test_lora_run_samples_what_the_diffusers_pipeline_draws(folders, tmp_path, name):
    """Without the LoRA (the base, through our model and sampler) and with it (the run,
    ``steadydiff.load`` -> sample; the pipeline after ``load_lora_weights`` of RUN/lora): the
    flow-match Euler sampler with the family's shift and grid draws the pipeline's image
    from the same noise."""
    from steadydiff.diffusion import make_schedule, sample
    from steadydiff.integrations.sd.source import resolve_config
    from steadydiff.integrations.sd.setup import build

    data = shapes(tmp_path / "images")
    cfg = flow_config(folders[name], data, name, "optim.lr=0.02", "sample.use_ema=false")
    z = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(3))
    scale = 3.0
    pipe = pipeline(folders[name], name)
    before = _draw(pipe, name, "a red square", z, 4, scale)
    resolved = resolve_config(cfg)[0]
    model, _, media = build(resolved, torch.device("cpu"))
    with torch.no_grad():
        y = media.encode_prompts(["a red square"] * 2)
        x0 = sample(model.eval(), make_schedule(resolved.diffusion, 32), "eps", (2, 4, 16, 16),
                    sampler="euler", steps=4, y=y, x=z, clip_x0=False,
                    cfg_scale=scale if name == "sd3" else 1.0)
        base = media.decode(x0) * 0.5 + 0.5
    torch.testing.assert_close(base, before.float(), atol=2e-3, rtol=0)

    steadydiff.train(cfg, out_dir=tmp_path / "run")
    ours = steadydiff.load(tmp_path / "run", device="cpu", use_ema=False)
    x, _ = ours.sample(prompt="a red square", negative_prompt=None, sampler="euler", steps=4,
                       cfg_scale=scale if name == "sd3" else 1.0, noise=z)
    pipe.load_lora_weights(tmp_path / "run" / "lora")
    theirs = _draw(pipe, name, "a red square", z, 4, scale)
    assert (theirs - before).abs().max() > 1e-3  # the LoRA changed the model
    torch.testing.assert_close(x * 0.5 + 0.5, theirs.float(), atol=2e-3, rtol=0)


@pytest.mark.parametrize("name", ["sd3", "flux"])
def test_kohya_file_has_fused_names_and_a_run_continues_from_it(folders, tmp_path, name):
    """The kohya file names the original modules (SD3: joint_blocks_N_x_block_attn_qkv;
    FLUX: double_blocks_N_img_attn_qkv, single_blocks_N_linear1), each fused layer the
    block-diagonal stack of q, k, v; ``adapter.init_from`` it (and the diffusers file)
    restores every LoRA tensor bit for bit."""
    from safetensors.torch import load_file

    data = shapes(tmp_path / "images")
    cfg = flow_config(folders[name], data, name, "optim.lr=0.02", "train.steps=2",
                      "adapter.text_encoder=true")
    res = steadydiff.train(cfg, out_dir=tmp_path / "run")
    kohya = load_file(tmp_path / "run" / "lora" / "run.safetensors")
    want = ("lora_unet_joint_blocks_0_x_block_attn_qkv" if name == "sd3"
            else "lora_unet_single_blocks_0_linear1")
    d, u = kohya[want + ".lora_down.weight"], kohya[want + ".lora_up.weight"]
    parts = 3 if name == "sd3" else 4  # FLUX's linear1: q, k, v and the MLP (not adapted)
    assert d.shape[0] == parts * 4 and float(kohya[want + ".alpha"]) == parts * 4.0
    rows = (u[:, :4] != 0).any(dim=1).nonzero().flatten()  # the first block: q's rows only
    assert len(rows) and rows.max() < u.shape[0] // 3 and rows.tolist() == list(range(len(rows)))
    assert any(k.startswith("lora_te1_") for k in kohya)
    saved = ckpt.load_checkpoint(res.checkpoint, "cpu", weights_only=True).ema  # exported
    from steadydiff.integrations.sd.setup import build
    from steadydiff.integrations.sd.source import resolve_config

    for f in ("run.safetensors", "pytorch_lora_weights.safetensors"):
        again = resolve_config(flow_config(folders[name], data, name, "adapter.text_encoder=true",
                                           f"adapter.init_from={tmp_path / 'run' / 'lora' / f}"))[0]
        model, _, _ = build(again, torch.device("cpu"))
        mine = {n: p for n, p in model.named_parameters() if p.requires_grad}
        assert mine.keys() == saved.keys()
        for k in mine:
            assert torch.equal(mine[k], saved[k]), (f, k)


def test_kohya_flux_layout_is_what_diffusers_reads_at_flux_width():
    """At FLUX.1's real width (3072, the MLP 12288: diffusers' kohya converter assumes
    them), the LoRA of every double and single block, fused into kohya's layers by our
    table, comes back through diffusers' ``_convert_kohya_flux_lora_to_diffusers`` as the
    same per-module delta (B A alpha / r)."""
    from diffusers import FluxTransformer2DModel
    from diffusers.loaders.lora_conversion_utils import _convert_kohya_flux_lora_to_diffusers

    from steadydiff.integrations.families.flux import original_table
    from steadydiff.integrations.sd.original import fuse_lora

    with torch.device("meta"):
        m = FluxTransformer2DModel(num_layers=1, num_single_layers=1, guidance_embeds=True)
    mods = dict(m.named_modules())
    g = torch.Generator().manual_seed(0)
    r, alpha = 2, 3.0
    ours: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    kohya: dict[str, torch.Tensor] = {}
    for e in original_table(m.config):
        if e.how != "cat" or not e.original.split(".")[0] in ("double_blocks", "single_blocks"):
            continue
        parts = []
        for p in e.parts:
            lin = mods[p]
            d = torch.randn(r, lin.in_features, generator=g) * 0.1
            u = torch.randn(lin.out_features, r, generator=g) * 0.1
            ours[p] = (d, u)
            parts.append((d, u, alpha))
        d, u, a = fuse_lora(parts, [mods[p].out_features for p in e.parts])
        name = "lora_unet_" + e.original.replace(".", "_")
        kohya.update({f"{name}.lora_down.weight": d, f"{name}.lora_up.weight": u,
                      f"{name}.alpha": torch.tensor(a)})
    back = _convert_kohya_flux_lora_to_diffusers(dict(kohya))
    assert len(back) == 2 * len(ours)
    for p, (d, u) in ours.items():
        a_, b_ = back[f"transformer.{p}.lora_A.weight"], back[f"transformer.{p}.lora_B.weight"]
        torch.testing.assert_close(b_ @ a_, u @ d * (alpha / r), rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- single files


@pytest.mark.parametrize("name", ["sd35", "flux"])
def test_single_file_round_trips_in_the_original_layout(folders, tmp_path, name):
    """The transformer written as one original-layout file (SD3: model.diffusion_model.
    joint_blocks, fused qkv, diffusers' SD3 loader reads it back exactly; FLUX: Black Forest
    Labs' double_blocks/single_blocks) loads with the folder as model.single_file_config;
    a full fine-tune from the file is written back as one file of that layout."""
    from safetensors import safe_open

    from steadydiff.integrations.sd.single_file import export_single_file
    from steadydiff.integrations.sd.source import load_parts

    folder = folders[name]
    p = load_parts(folder)
    f = export_single_file(tmp_path / f"{name}.safetensors", p.denoiser, p.vae, p.text_encoders)
    with safe_open(str(f), "pt") as h:
        keys = list(h.keys())
    if name == "sd35":
        assert "model.diffusion_model.joint_blocks.0.x_block.attn.qkv.weight" in keys
        assert "model.diffusion_model.joint_blocks.0.x_block.attn.ln_q.weight" in keys
        from diffusers import SD3Transformer2DModel

        theirs = SD3Transformer2DModel.from_single_file(
            str(f), config=str(folder), subfolder="transformer", local_files_only=True)
        for k, v in p.denoiser.state_dict().items():
            assert torch.equal(theirs.state_dict()[k], v), k
    else:
        assert "double_blocks.0.img_attn.qkv.weight" in keys and \
            "single_blocks.1.linear1.weight" in keys and not any(k.startswith("vae") for k in keys)
    mine = load_parts(f, folder)
    for k, v in p.denoiser.state_dict().items():
        assert torch.equal(mine.denoiser.state_dict()[k], v), k
    assert mine.root == f
    res = steadydiff.train(flow_config(f, shapes(tmp_path / "images"), name, "train.steps=1",
                                       "adapter.kind=none", "optim.lr=0.01",
                                       f"model.single_file_config={folder}"),
                           out_dir=tmp_path / "run")
    assert np.isfinite(res.final_loss)
    out = load_parts(tmp_path / "run" / "model.safetensors", folder)
    with safe_open(str(tmp_path / "run" / "model.safetensors"), "pt") as h:
        assert sorted(h.keys()) == sorted(keys)  # the same layout
    after = out.denoiser.state_dict()
    assert any(not torch.equal(after[k], v) for k, v in p.denoiser.state_dict().items())


# --------------------------------------------------------------------------- resume, guard


@pytest.mark.parametrize("name", ["flux"])
def test_resumed_lora_run_equals_uninterrupted_bit_exactly(folders, tmp_path, name):
    data = shapes(tmp_path / "images")
    fixed = ("optim.lr=0.01", "data.caption_dropout=0.25", f"data.cache_dir={tmp_path / 'c'}")
    straight = steadydiff.train(flow_config(folders[name], data, name, *fixed),
                                out_dir=tmp_path / "straight")
    steadydiff.train(flow_config(folders[name], data, name, *fixed, "train.steps=2"),
                     out_dir=tmp_path / "resumed")
    resumed = steadydiff.train(flow_config(folders[name], data, name, *fixed),
                               out_dir=tmp_path / "resumed")
    assert resumed.resumed_from is not None
    a = ckpt.load_checkpoint(straight.checkpoint, "cpu", weights_only=True)
    b = ckpt.load_checkpoint(resumed.checkpoint, "cpu", weights_only=True)
    assert a.model.keys() == b.model.keys() and a.model
    for k in a.model:
        assert torch.equal(a.model[k], b.model[k]), k
        assert torch.equal(a.ema[k], b.ema[k]), k


JOINT_ATTN = "transformer.transformer_blocks.0.attn"


@pytest.mark.parametrize("name", ["sd35", "flux"])
def test_fp16_overflow_in_a_joint_attention_block_upcasts_that_block(folders, tmp_path, name):
    """fp16: the first joint-attention block's query projection scaled in the folder's
    weights (from outside: a checkpoint whose weights fit fp16, its largest at 3e4, but
    whose activations do not), so its output overflows fp16; the guard names the block (``transformer.transformer_blocks.0
    .attn``), skips the step and runs that whole layer in fp32 from then on (its QK-norm
    then bounds the logits: SD3.5 and FLUX.1 have one); the run ends finite."""
    from safetensors.torch import load_file, save_file

    hot = tmp_path / "hot"
    shutil.copytree(folders[name], hot)
    w = hot / "transformer" / "diffusion_pytorch_model.safetensors"
    sd = load_file(w)
    q = sd["transformer_blocks.0.attn.to_q.weight"]
    sd["transformer_blocks.0.attn.to_q.weight"] = q * (3e4 / q.abs().max())
    save_file(sd, w)
    data = shapes(tmp_path / "images")
    cfg = flow_config(hot, data, name, "train.steps=3", "train.checkpoint_every=0",
                      "train.precision=fp16", "train.allow_slow_precision=true",
                      "model.vae_precision=fp32")
    res = steadydiff.train(cfg, out_dir=tmp_path / "run")
    assert res.steps == 3
    rows = incidents(tmp_path / "run")
    assert rows[0]["kind"] == "attention_upcast" and rows[0]["evidence"]["module"] == JOINT_ATTN
    state = json.loads((res.checkpoint / "state.json").read_text())
    assert state["guard"]["upcast_attention"] == [JOINT_ATTN]
    c = ckpt.load_checkpoint(res.checkpoint, "cpu", weights_only=True)
    assert all(torch.isfinite(v).all() for v in c.model.values())


@pytest.mark.parametrize("fault, kind, check", [
    ({"kind": "nan_batch", "step": 2}, "bad_batch",
     lambda inc: inc["action"] == "drop_samples" and len(inc["evidence"]["samples"]) == 1
     and inc["evidence"]["samples"][0]["source"].endswith(".png")),
    ({"kind": "loss_scale", "step": 5, "factor": 1e8}, "loss_spike",
     lambda inc: inc["action"] in ("skip", "drop_samples") and inc["evidence"]["ratio"] > 1e6),
])
def test_guard_catches_faults_on_the_flux_path(folders, tmp_path, fault, kind, check):
    data = shapes(tmp_path / "images")
    cfg = flow_config(folders["flux"], data, "flux", "train.steps=7", "train.checkpoint_every=0",
                      f"faults={json.dumps([fault])}")
    res = steadydiff.train(cfg, out_dir=tmp_path / "run")
    assert res.steps == 7
    rows = [r for r in incidents(tmp_path / "run") if r["kind"] == kind]
    assert rows and check(rows[0]), incidents(tmp_path / "run")
    from safetensors.torch import load_file

    lora = tmp_path / "run" / "lora" / "pytorch_lora_weights.safetensors"
    assert all(torch.isfinite(v).all() for v in load_file(lora).values())


def test_nan_in_a_captions_t5_embedding_is_named_before_training(folders, tmp_path):
    """A T5 token embedding row set to NaN in the folder's weights (a broken file, from
    outside): the captions holding that token encode to NaN, again in fp32, so before the
    first step their images are quarantined, each naming its file and the token to blame,
    and the run trains on the rest; never on a NaN embedding."""
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(folders["flux"], bad)
    w = bad / "text_encoder_2" / "model.safetensors"
    sd = load_file(w)
    from steadydiff.integrations.sd.tiny_parts import tiny_t5_tokenizer

    tok = tiny_t5_tokenizer().convert_tokens_to_ids("\u2581r")  # "red" starts with it
    for k in sd:
        if k.endswith("shared.weight") or k.endswith("embed_tokens.weight"):
            sd[k][tok] = float("nan")
    save_file(sd, w)
    res = steadydiff.train(flow_config(bad, shapes(tmp_path / "images"), "flux"),
                           out_dir=tmp_path / "run")
    assert res.steps == 4
    rows = [r for r in incidents(tmp_path / "run") if r["kind"] == "sample_quarantined"]
    captions = {p.stem: p.read_text() for p in (tmp_path / "images").glob("*.txt")}
    reds = sorted(k for k, c in captions.items() if "red" in c)
    assert reds and sorted(Path(r["evidence"]["source"]).stem for r in rows) == reds
    assert all("\u2581r" in r["evidence"]["why"] or "token" in r["evidence"]["why"]
               for r in rows)
    from safetensors.torch import load_file as load
    lora = load(tmp_path / "run" / "lora" / "pytorch_lora_weights.safetensors")
    assert all(torch.isfinite(v).all() for v in lora.values())


# --------------------------------------------------------------------------- memory savers, full


def test_transformer_checkpointing_gives_the_same_lora_gradients(folders, tmp_path):
    """train.gradient_checkpointing on FLUX.1: diffusers' own switch on the transformer's
    blocks; the LoRA's gradients are the plain model's."""
    from steadydiff.models import enable_checkpointing

    model, _, media = _build(flow_config(folders["flux"], shapes(tmp_path / "i", 2), "flux"))
    model.train()
    torch.manual_seed(0)
    for p in model.parameters():
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.1)
    x, t = torch.randn(2, 4, 16, 16), torch.tensor([300.0, 800.0])
    y = media.encode_prompts(["a red square", "a circle"])

    def grads():
        model.zero_grad()
        model(x, t, y).pow(2).mean().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    plain = grads()
    assert "transformer" in enable_checkpointing(model)
    assert model.transformer.is_gradient_checkpointing
    ckpt_ = grads()
    for n in plain:
        torch.testing.assert_close(ckpt_[n], plain[n], rtol=1e-4, atol=1e-6, msg=n)


def test_text_encoders_leave_the_device_after_caching(folders, tmp_path, capsys):
    """model.offload_text_encoders: once the captions are cached the encoders sit on the
    CPU; the validation prompts still render (encoded there); refused where the encoders
    run in every step."""
    data = shapes(tmp_path / "images")
    res = steadydiff.train(flow_config(folders["flux"], data, "flux", "train.steps=2",
                                       "model.offload_text_encoders=true",
                                       "train.sample_every=2"), out_dir=tmp_path / "run")
    assert "text encoders moved to the CPU" in capsys.readouterr().out
    assert res.samples and res.samples[-1].is_file()
    with pytest.raises(ConfigError, match="offload_text_encoders"):
        flow_config(folders["flux"], data, "flux", "model.offload_text_encoders=true",
                    "data.caption_shuffle=true")


def test_full_fine_tune_is_written_as_a_diffusers_folder_and_samples(folders, tmp_path,
                                                                      capsys):
    """adapter.kind=none on FLUX.1: the whole transformer trains (EMA too) and the run is
    written as RUN/model, a folder FluxPipeline loads, holding the trained transformer and
    the base's other parts; ``steadydiff sample RUN --prompt`` draws from the run."""
    from steadydiff.cli import main

    data = shapes(tmp_path / "images")
    res = steadydiff.train(flow_config(folders["flux"], data, "flux", "adapter.kind=none",
                                       "train.steps=1", "optim.lr=0.01"),
                           out_dir=tmp_path / "run")
    assert np.isfinite(res.final_loss)
    pipe, base = pipeline(tmp_path / "run" / "model", "flux"), pipeline(folders["flux"], "flux")
    trained = dict(pipe.transformer.named_parameters())
    assert any(not torch.equal(p, trained[n]) for n, p in base.transformer.named_parameters())
    assert all(torch.equal(p, dict(pipe.text_encoder_2.named_parameters())[n])
               for n, p in base.text_encoder_2.named_parameters())
    out = tmp_path / "s.png"
    assert main(["sample", str(tmp_path / "run"), "--prompt", "a red square", "--num", "1",
                 "--steps", "2", "--out", str(out)]) == 0
    assert out.is_file()
