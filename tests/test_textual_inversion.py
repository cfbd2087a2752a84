"""Textual inversion (adapter.kind=embedding) on the tiny SD 1.x and SDXL folders: only the
new token's rows train, the files load in diffusers, A1111's keys, exact resume, sampling
with the token (docs/sd.md#textual-inversion)."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("diffusers")

import steadydiff  # noqa: E402
from steadydiff.config import ConfigError, load_config  # noqa: E402
from steadydiff.trainer import checkpoint as ckpt  # noqa: E402

from test_sd import sd_dir, shapes  # noqa: E402,F401

ROWS = "embeddings.token_embedding.ti_rows"


def ti_config(sd, data, *sets: str):
    base = [f"model.pretrained={sd}", f"data.path={data}", "data.image_size=32",
            "train.steps=4", "train.batch_size=4", "train.precision=fp32",
            "train.checkpoint_every=2", "train.sample_every=0", "train.num_threads=1",
            "train.device=cpu", "sample.num=2", "sample.steps=2", "optim.warmup_steps=0",
            "optim.lr=0.05", "optim.schedule=constant", "logging.log_every=1",
            "guard.warmup_steps=0", "data.num_workers=0", "data.trigger=<sks>",
            "adapter.kind=textual_inversion", "adapter.token=<sks>", "adapter.init_token=a"]
    return load_config("configs/sd_textual_inversion.yaml", base + list(sets))


@pytest.fixture(scope="module")
def ti_run(sd_dir, tmp_path_factory):  # noqa: F811
    tmp = tmp_path_factory.mktemp("ti")
    data = shapes(tmp / "images")
    res = steadydiff.train(ti_config(sd_dir, data, "adapter.num_vectors=2",
                                     f"data.cache_dir={tmp / 'cache'}"), out_dir=tmp / "run")
    return tmp, data, res


def test_only_the_new_rows_change(ti_run, sd_dir):  # noqa: F811
    from diffusers import UNet2DConditionModel
    from transformers import CLIPTextModel

    tmp, _, res = ti_run
    c = ckpt.load_checkpoint(res.checkpoint, "cpu", weights_only=True)
    (name,) = c.model  # the checkpoint holds the rows alone
    assert name.startswith("text_encoder.") and name.endswith(ROWS)
    rows = c.model[name]
    assert rows.shape == (2, 32)
    te = CLIPTextModel.from_pretrained(sd_dir / "text_encoder")
    # the trained model: every frozen tensor bit-identical to the folder's
    pipe = steadydiff.load(tmp / "run", device="cpu")
    model = pipe.model
    unet = UNet2DConditionModel.from_pretrained(sd_dir / "unet")
    for n, p in unet.state_dict().items():
        assert torch.equal(model.unet.state_dict()[n], p), n
    mine = model.text_encoder.state_dict()
    for n, p in te.state_dict().items():
        assert torch.equal(mine[n], p), n
    (extra,) = set(mine) - set(te.state_dict())
    assert extra.endswith(ROWS)
    # the rows moved away from the init token's embedding
    from transformers import CLIPTokenizer
    tok = CLIPTokenizer.from_pretrained(sd_dir / "tokenizer")
    a = te.get_input_embeddings().weight[tok("a", add_special_tokens=False).input_ids[0]]
    assert (rows - a).abs().max() > 1e-4
    from steadydiff.integrations.sd.advice import load_hints

    hints = "\n".join(load_hints(pipe.config, tmp / "run"))  # the end-of-run lines
    assert "models/embeddings/" in hints and "load_textual_inversion" in hints
    info = json.loads((res.checkpoint / "state.json").read_text())["adapter"]
    assert info["kind"] == "embedding" and info["num_vectors"] == 2


def test_files_load_in_diffusers_and_a1111_keys(ti_run, sd_dir):  # noqa: F811
    from diffusers import StableDiffusionPipeline
    from safetensors.torch import load_file

    tmp, _, res = ti_run
    folder = tmp / "run" / "embeddings"
    c = ckpt.load_checkpoint(res.checkpoint, "cpu", weights_only=True)
    (rows,) = c.ema.values()  # sample.use_ema: the files hold the EMA's rows
    a1111 = load_file(str(folder / "<sks>.safetensors"))
    assert set(a1111) == {"emb_params"} and a1111["emb_params"].shape == (2, 32)
    assert torch.equal(a1111["emb_params"], rows)
    learned = load_file(str(folder / "learned_embeds.safetensors"))
    assert set(learned) == {"<sks>"} and torch.equal(learned["<sks>"], rows)
    assert (folder / "<sks>-step00000002.safetensors").is_file()  # numbered per save
    # diffusers' own loader reads it; its prompt encoding equals ours
    pipe = StableDiffusionPipeline.from_pretrained(sd_dir, local_files_only=True,
                                                   safety_checker=None)
    prompt = "a photo of <sks>"
    before = pipe.encode_prompt(prompt, "cpu", 1, False)[0]
    pipe.load_textual_inversion(str(folder / "learned_embeds.safetensors"))
    after = pipe.encode_prompt(prompt, "cpu", 1, False)[0]
    assert (after - before).abs().max() > 1e-4  # the token changes the condition
    ours = steadydiff.load(tmp / "run", device="cpu")
    with torch.no_grad():
        mine = ours.model.encode(ours.media.tokenize([prompt]))
    torch.testing.assert_close(mine, after, rtol=1e-5, atol=1e-5)
    # the A1111 file too, through diffusers' reader of single-tensor files
    pipe.unload_textual_inversion()
    pipe.load_textual_inversion(str(folder / "<sks>.safetensors"), token="<sks>")
    torch.testing.assert_close(pipe.encode_prompt(prompt, "cpu", 1, False)[0], after)
    # and the image: diffusers with the file vs diffusers without it
    z = torch.randn(1, 4, 4, 4, generator=torch.Generator().manual_seed(0))
    kw = dict(num_inference_steps=2, latents=z, output_type="pt", height=32, width=32,
              guidance_scale=1.0)
    with_ti = pipe(prompt, **kw).images
    pipe.unload_textual_inversion()
    plain = pipe(prompt, **kw).images
    assert (with_ti - plain).abs().max() > 1e-5


def test_resume_is_exact_and_sampling_uses_the_token(sd_dir, tmp_path):  # noqa: F811
    data = shapes(tmp_path / "images")
    fixed = (f"data.cache_dir={tmp_path / 'cache'}",)
    straight = steadydiff.train(ti_config(sd_dir, data, *fixed), out_dir=tmp_path / "a")
    steadydiff.train(ti_config(sd_dir, data, *fixed, "train.steps=2"), out_dir=tmp_path / "b")
    resumed = steadydiff.train(ti_config(sd_dir, data, *fixed), out_dir=tmp_path / "b")
    assert resumed.resumed_from is not None and resumed.steps == 4
    a = ckpt.load_checkpoint(straight.checkpoint, "cpu", weights_only=True)
    b = ckpt.load_checkpoint(resumed.checkpoint, "cpu", weights_only=True)
    assert set(a.model) == set(b.model)
    for k in a.model:
        assert torch.equal(a.model[k], b.model[k]) and torch.equal(a.ema[k], b.ema[k]), k
    # the CLI samples with the token: its prompt differs from one without it
    pipe = steadydiff.load(tmp_path / "a", device="cpu")
    z = torch.randn(1, 4, 4, 4, generator=torch.Generator().manual_seed(0))
    x1, _ = pipe.sample(prompt="a photo of <sks>", sampler="ddim", steps=2, noise=z)
    x0, _ = pipe.sample(prompt="a photo of", sampler="ddim", steps=2, noise=z)
    assert (x1 - x0).abs().max() > 1e-5
    from steadydiff.cli import main

    out = tmp_path / "s.png"
    assert main(["sample", str(tmp_path / "a"), "--prompt", "a photo of <sks>", "--steps",
                 "2", "--num", "1", "--out", str(out), "--device", "cpu"]) == 0
    assert out.is_file()
    # export --step of a kept checkpoint: its numbered embedding files, removed first
    from safetensors.torch import load_file

    emb = tmp_path / "a" / "embeddings"
    for f in emb.glob("*-step00000002.safetensors"):
        f.unlink()
    assert main(["export", str(tmp_path / "a"), "--step", "2"]) == 0
    two = ckpt.load_checkpoint(tmp_path / "a" / "checkpoints" / "step_00000002", "cpu",
                               weights_only=True)
    got = load_file(str(emb / "<sks>-step00000002.safetensors"))["emb_params"]
    assert torch.equal(got, next(iter(two.ema.values())))
    assert (emb / "learned_embeds-step00000002.safetensors").is_file()


def test_refusals_name_the_problem(sd_dir, tmp_path):  # noqa: F811
    data = shapes(tmp_path / "images")
    with pytest.raises(ConfigError, match="needs adapter.token"):
        load_config("configs/sd_textual_inversion.yaml",
                    [f"model.pretrained={sd_dir}", "adapter.token=null"])
    with pytest.raises(ConfigError, match="set adapter.kind=embedding"):
        load_config("configs/sd_lora.yaml", [f"model.pretrained={sd_dir}",
                                             "adapter.token=<x>"])
    with pytest.raises(ConfigError, match="none of the 8 captions"):
        steadydiff.train(ti_config(sd_dir, data, "data.trigger=null"), out_dir=tmp_path / "r")
    with pytest.raises(ConfigError, match="must be one token"):
        steadydiff.train(ti_config(sd_dir, data, "adapter.init_token=two words"),
                         out_dir=tmp_path / "r2")
    with pytest.raises(ConfigError, match="already a token"):
        steadydiff.train(ti_config(sd_dir, data, "adapter.token=a", "data.trigger=a"),
                         out_dir=tmp_path / "r3")


def test_a_nan_in_the_rows_rolls_back_and_no_file_holds_it(sd_dir, tmp_path):  # noqa: F811
    from safetensors.torch import load_file

    from test_sd import incidents

    data = shapes(tmp_path / "images")
    fault = {"kind": "param_nan", "step": 3, "target": "text_encoder." + ROWS}
    res = steadydiff.train(ti_config(sd_dir, data, "train.steps=5", "guard.warmup_steps=10",
                                     f"faults={json.dumps([fault])}"), out_dir=tmp_path / "run")
    assert res.steps == 5
    rows = [r for r in incidents(tmp_path / "run") if r["action"] == "rollback"]
    assert rows, incidents(tmp_path / "run")
    for f in (tmp_path / "run" / "embeddings").glob("*.safetensors"):
        for v in load_file(str(f)).values():
            assert torch.isfinite(v).all(), f


def test_sdxl_writes_clip_l_and_clip_g_and_diffusers_loads_both(tmp_path):
    from diffusers import StableDiffusionXLPipeline
    from safetensors.torch import load_file

    from steadydiff.integrations.sd.tiny import make_tiny

    xl = make_tiny(tmp_path / "xl", "sdxl", image_size=32)
    data = shapes(tmp_path / "images")
    res = steadydiff.train(ti_config(xl, data, "train.steps=2"), out_dir=tmp_path / "run")
    c = ckpt.load_checkpoint(res.checkpoint, "cpu", weights_only=True)
    assert sorted(n.split(".")[0] for n in c.model) == ["text_encoder", "text_encoder_2"]
    folder = tmp_path / "run" / "embeddings"
    a1111 = load_file(str(folder / "<sks>.safetensors"))
    pipe = StableDiffusionXLPipeline.from_pretrained(xl, local_files_only=True)
    widths = (pipe.text_encoder.config.hidden_size, pipe.text_encoder_2.config.hidden_size)
    assert set(a1111) == {"clip_l", "clip_g"}
    assert a1111["clip_l"].shape == (1, widths[0]) and a1111["clip_g"].shape == (1, widths[1])
    one = load_file(str(folder / "learned_embeds.safetensors"))["<sks>"]
    two = load_file(str(folder / "learned_embeds_2.safetensors"))["<sks>"]
    assert torch.equal(one, a1111["clip_l"]) and torch.equal(two, a1111["clip_g"])
    prompt = "a photo of <sks>"
    before = pipe.encode_prompt(prompt, device="cpu", do_classifier_free_guidance=False)[0]
    pipe.load_textual_inversion(str(folder / "learned_embeds.safetensors"),
                                text_encoder=pipe.text_encoder, tokenizer=pipe.tokenizer)
    pipe.load_textual_inversion(str(folder / "learned_embeds_2.safetensors"),
                                text_encoder=pipe.text_encoder_2, tokenizer=pipe.tokenizer_2)
    after = pipe.encode_prompt(prompt, device="cpu", do_classifier_free_guidance=False)[0]
    assert (after - before).abs().max() > 1e-4
    ours = steadydiff.load(tmp_path / "run", device="cpu")
    with torch.no_grad():
        y = ours.model.encode(ours.media.tokenize([prompt]))
    torch.testing.assert_close(y[:, :after.shape[1]], after, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("every", [1, 10])
def test_rows_written_nan_by_outside_code_between_steps_are_named_and_undone(
        sd_dir, tmp_path, monkeypatch, every):  # noqa: F811
    """The test's own code (not steadydiff's injector) writes NaN into the trained embedding
    rows between steps 3 and 4: both checks name the parameter, the run ends finite, and no
    written embedding file holds the NaN."""
    from safetensors.torch import load_file

    from test_outside_faults import hook_steps
    from test_sd import incidents

    def corrupt(state, batch):
        with torch.no_grad():
            p = dict(state.model.named_parameters())
            name = next(n for n in p if n.endswith(ROWS))
            p[name][0, 0] = float("nan")

    hook_steps(monkeypatch, 4, corrupt)
    data = shapes(tmp_path / "images")
    res = steadydiff.train(ti_config(sd_dir, data, "train.steps=6", "guard.warmup_steps=10",
                                     f"guard.check_every={every}"), out_dir=tmp_path / "run")
    assert res.steps == 6
    rows = incidents(tmp_path / "run")
    assert any(ROWS in json.dumps(r["evidence"]) for r in rows), rows
    for f in (tmp_path / "run" / "embeddings").glob("*.safetensors"):
        for v in load_file(str(f)).values():
            assert torch.isfinite(v).all(), f
