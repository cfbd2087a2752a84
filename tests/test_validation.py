"""Validation prompts during training (issue 16, item 5): ``sample.prompts`` as strings or
mappings with their own seed, guidance, steps (and size on an SD UNet), rendered every
``train.sample_every`` steps from the EMA weights into the grids, their side file, the
report and TensorBoard; each prompt's noise from its own seed; training bit-identical with
and without them; a non-finite prompt named, and training goes on."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("peft")

import steadydiff  # noqa: E402
from steadydiff.config import ConfigError, load_config  # noqa: E402
from steadydiff.integrations.sd.model import TextToImage  # noqa: E402
from steadydiff.integrations.sd.tiny import make_tiny_sd  # noqa: E402
from steadydiff.trainer import checkpoint as ckpt  # noqa: E402
from steadydiff.trainer import validation  # noqa: E402
from steadydiff.trainer.loop import build_state  # noqa: E402

TEXT = ["data.dataset=digits", "data.captions=class_names", "model.num_classes=0",
        "data.image_size=8", "model.unet.channels=8", "model.unet.channel_mult=[1,2]",
        "model.unet.num_res_blocks=1", "model.unet.attention_resolutions=[4]",
        "model.unet.head_channels=8", "model.unet.norm_groups=4", "diffusion.timesteps=100",
        "train.batch_size=8", "train.device=cpu", "train.num_threads=1",
        "train.checkpoint_every=0", "sample.steps=2", "sample.num=4",
        "optim.warmup_steps=0", "logging.progress=false", "guard.warmup_steps=0"]
PROMPTS = ('sample.prompts=["a photo of a seven", {prompt: "a photo of a one", seed: 7, '
           'cfg_scale: 3.0, steps: 3, negative_prompt: "a photo of a two"}, '
           '{prompt: poison, seed: 1}]')


@pytest.fixture(scope="module")
def sd_dir(tmp_path_factory) -> Path:
    return make_tiny_sd(tmp_path_factory.mktemp("sd") / "tiny-sd", image_size=32)


def text_config(sd: Path, *sets: str):
    return load_config(None, [*TEXT, f"model.text_encoder={sd}", *sets])


# --------------------------------------------------------------------------- config


def test_prompt_entries_are_strings_or_mappings_with_the_sample_defaults(sd_dir):
    cfg = text_config(sd_dir, PROMPTS, "sample.seed=5", "sample.cfg_scale=2.0",
                      "sample.negative_prompt=blurry")
    a, b, c = cfg.sample.prompts
    assert a.prompt == "a photo of a seven" and a.seed is None  # a string: the text alone
    assert (b.seed, b.cfg_scale, b.steps, b.negative_prompt) == (7, 3.0, 3, "a photo of a two")
    state = build_state(cfg, 0, torch.device("cpu"))
    p = validation.resolve(cfg, [], state.model, state.media)
    assert [(q.seed, q.cfg_scale, q.steps, q.negative_prompt) for q in p] == [
        (5, 2.0, 2, "blurry"), (7, 3.0, 3, "a photo of a two"), (1, 2.0, 2, "blurry")]
    assert (p[0].width, p[0].height) == (8, 8)
    # no list: the first captions, one plain prompt each
    cfg = text_config(sd_dir)
    p = validation.resolve(cfg, ["x", "y", "z", "w", "v"], state.model, state.media)
    assert [q.prompt for q in p] == ["x", "y", "z", "w"]
    # the resolved config (what config.yaml holds) reads back to the same prompts
    dumped = json.dumps(text_config(sd_dir, PROMPTS).to_dict()["sample"]["prompts"])
    assert text_config(sd_dir, f"sample.prompts={dumped}").sample.prompts == (a, b, c)


@pytest.mark.parametrize("entry, needle", [
    ("[{prompt: a, sed: 3}]", "sample.prompts.0.sed: unknown key; did you mean "
                              "'sample.prompts.0.seed'"),
    ("[a, {prompt: b, seed: -1}]", "sample.prompts.1.seed: Input should be greater than"),
    ("[{prompt: a, seed: 1.5}]", "sample.prompts.0.seed: Input should be a valid integer"),
    ("[{prompt: a, seed: true}]", "sample.prompts.0.seed: Input should be a valid integer"),
    ("[{prompt: a, cfg_scale: 1000}]", "sample.prompts.0.cfg_scale"),
    ("[{seed: 1}]", "sample.prompts.0.prompt: Field required"),
    ("[a, 5]", "sample.prompts: entry 1 is int 5"),
    ("a cat", "expected a list of prompts"),
    ("[{prompt: a, width: 64}]", "sample.prompts.0.width=64: steadydiff's own unet samples "
                                 "at data.image_size (8) only"),
])
def test_prompt_config_errors_name_the_key(sd_dir, entry, needle):
    with pytest.raises(ConfigError, match=None) as e:
        text_config(sd_dir, f"sample.prompts={entry}")
    assert needle in str(e.value)


def test_prompts_on_a_model_without_text_conditioning_are_refused():
    with pytest.raises(ConfigError) as e:
        load_config(None, ['sample.prompts=["a cat"]'])
    assert "sample.prompts are validation prompts for a text-conditioned model" in str(e.value)


# --------------------------------------------------------------------------- rendering


def test_a_prompt_draws_the_same_image_from_its_own_seed(sd_dir):
    """A prompt's images depend on its seed alone: the same at every render, unchanged when
    another prompt's seed or text changes, changed with its own seed; also for ddpm, whose
    per-step noise makes each prompt its own call."""
    for sampler in ("dpmpp_2m", "ddpm"):
        cfg = text_config(sd_dir, PROMPTS, f"sample.sampler={sampler}")
        state = build_state(cfg, 0, torch.device("cpu"))
        torch.manual_seed(0)
        for p in state.model.parameters():  # a model whose output depends on the prompt
            p.data.add_(0.05 * torch.randn_like(p))
        state.ema.module.load_state_dict(state.model.state_dict())
        p = validation.resolve(cfg, [], state.model, state.media)

        def images(prompts):
            with validation.sampling_model(state) as m:
                return [x for x, _ in validation.draw(state, m, prompts, [2] * len(prompts))]

        first = images(p)
        assert all(torch.equal(a, b) for a, b in zip(first, images(p)))  # every render
        other = [p[0], dataclasses.replace(p[1], seed=99), p[2]]
        again = images(other)
        assert torch.allclose(again[0], first[0], atol=1e-6)  # prompt 0: its own noise
        assert not torch.allclose(again[1], first[1], atol=1e-3)  # prompt 1: a new seed
        # prompt 0 and the poison prompt share no noise (seeds 0 and 1)...
        assert not torch.allclose(first[0][0], first[2][0], atol=1e-3)
        # ...and within one prompt each image has its own noise
        assert not torch.allclose(first[0][0], first[0][1], atol=1e-3)


def test_training_is_identical_with_and_without_validation(sd_dir, tmp_path, monkeypatch,
                                                           caplog):
    """Four steps with validation every two steps (one prompt poisoned to NaN, TensorBoard
    and the report on) end with the same weights, EMA and optimizer state, bit for bit, as
    the run without; the grids, side files, report and TensorBoard carry the prompts; the
    poisoned prompt is named and training finished."""
    encode = TextToImage.encode_prompts

    def poisoned(self, prompts):  # an injected failure: this prompt's context is NaN
        out = encode(self, prompts)
        bad = torch.tensor([p == "poison" for p in prompts], device=out.device)
        return torch.where(bad[:, None, None], torch.full_like(out, float("nan")), out)

    monkeypatch.setattr(TextToImage, "encode_prompts", poisoned)
    sets = [PROMPTS, "train.steps=4", "logging.log_every=2", "logging.layer_stats_every=0"]
    with caplog.at_level(logging.WARNING, logger="steadydiff.trainer.validation"):
        on = steadydiff.train(text_config(sd_dir, *sets, "train.sample_every=2",
                                          "logging.tensorboard=true"), out_dir=tmp_path / "on")
    warned = [r.getMessage() for r in caplog.records if "'poison'" in r.getMessage()]
    # without: the final grid only, drawn after the last step
    off = steadydiff.train(text_config(sd_dir, *sets, "train.sample_every=0",
                                       "logging.report=false"), out_dir=tmp_path / "off")
    assert on.steps == off.steps == 4
    a, b = ckpt.load_checkpoint(on.checkpoint), ckpt.load_checkpoint(off.checkpoint)
    for name in ("model", "ema"):
        da, db = getattr(a, name), getattr(b, name)
        assert da.keys() == db.keys() and all(torch.equal(da[k], db[k]) for k in da), name
    oa, ob = a.optimizer["state"], b.optimizer["state"]
    assert oa.keys() == ob.keys() and all(
        torch.equal(oa[k][m], ob[k][m]) for k in oa for m in ("exp_avg", "exp_avg_sq"))

    # the grids (steps 2 and 4) and their side files: cells, settings, finite or not
    samples = tmp_path / "on" / "samples"
    assert sorted(p.name for p in samples.glob("step_*.png")) == [
        "step_00000002.png", "step_00000004.png"]
    side = json.loads((samples / "step_00000004" / "prompts.json").read_text())
    assert side["nrow"] == 3 and side["use_ema"] is True
    rows = side["prompts"]
    assert [r["prompt"] for r in rows] == ["a photo of a seven", "a photo of a one", "poison"]
    assert [r["cells"] for r in rows] == [[0, 3], [1], [2]]  # sample.num=4 cells, cycled
    assert (rows[1]["seed"], rows[1]["cfg_scale"], rows[1]["steps"]) == (7, 3.0, 3)
    assert [r["finite"] for r in rows] == [True, True, False]
    assert all((samples / "step_00000004" / r["file"]).is_file() for r in rows)
    assert len(warned) == 2 and "non-finite" in warned[0]  # at each render; training went on

    # the report: the latest render's images with their prompts
    page = (tmp_path / "on" / "report.html").read_text()
    assert "Validation prompts (step 4)" in page
    assert "a photo of a one" in page and "seed 7" in page and "non-finite" in page

    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "on" / "tensorboard"))
    acc.Reload()
    images = acc.Tags()["images"]
    assert {"samples", "validation/prompt_00", "validation/prompt_01",
            "validation/prompt_02"} <= set(images)
    assert [e.step for e in acc.Images("validation/prompt_01")] == [2, 4]


def test_raw_weights_render_in_eval_mode_and_keep_each_modules_mode(sd_dir):
    cfg = text_config(sd_dir, PROMPTS, "sample.use_ema=false", "model.unet.dropout=0.5")
    state = build_state(cfg, 0, torch.device("cpu"))
    state.model.train()
    frozen = next(m for m in state.model.modules() if m is not state.model)
    frozen.eval()  # a part a trainer keeps in eval mode stays so
    modes = [m.training for m in state.model.modules()]
    rng = torch.get_rng_state()
    with validation.sampling_model(state) as m:
        assert m is state.model and not any(x.training for x in m.modules())
        torch.randn(3)  # the global RNG moves inside...
    assert [m.training for m in state.model.modules()] == modes
    assert torch.equal(torch.get_rng_state(), rng)  # ...and is restored after


# --------------------------------------------------------------------------- Stable Diffusion


def test_sd_lora_renders_with_the_adapter_on_and_at_its_own_size(sd_dir, tmp_path):
    data = tmp_path / "images"
    data.mkdir()
    from PIL import Image
    for i in range(2):
        Image.new("RGB", (32, 32), (40 * i, 90, 200)).save(data / f"{i}.png")
        (data / f"{i}.txt").write_text(f"a square {i}")
    sets = [f"model.pretrained={sd_dir}", f"data.path={data}", "data.image_size=32",
            "train.precision=fp32", "train.device=cpu", "sample.steps=2", "sample.num=2",
            "adapter.rank=4", "adapter.alpha=4",
            'sample.prompts=["a square", {prompt: "a wide square", width: 64, seed: 3}]']
    cfg = load_config("configs/sd_lora.yaml", sets)
    state = build_state(cfg, 0, torch.device("cpu"))
    p = validation.resolve(cfg, [], state.model, state.media)
    assert (p[1].width, p[1].height) == (64, 32)

    def images():
        with validation.sampling_model(state) as m:
            return validation.draw(state, m, p, [1, 1])

    base = images()
    assert base[0][0].shape == (1, 3, 32, 32) and base[1][0].shape == (1, 3, 32, 64)
    lora_b = [t for n, t in state.ema.module.named_parameters() if "lora_B" in n]
    assert lora_b and all(t.abs().sum() == 0 for t in lora_b)  # peft: B starts at zero
    with torch.no_grad():
        for t in lora_b:
            t.normal_(0, 0.5)
    adapted = images()
    assert not torch.allclose(adapted[0][0], base[0][0], atol=1e-4)  # the EMA's LoRA is on
    # a size the UNet cannot take is refused, naming the entry's key
    bad = load_config("configs/sd_lora.yaml", [*sets[:-1],
                                               "sample.prompts=[{prompt: a, height: 42}]"])
    with pytest.raises(ConfigError, match=r"sample.prompts.0.height=42 is not a multiple of 4"):
        validation.resolve(bad, [], state.model, state.media)
