"""Numbered LoRA / hypernetwork files (integrations/sd/numbered.py): one per save in both
formats, their own keep policy, the best step protected, and ``steadydiff export --step``
for any kept checkpoint; the files load in diffusers and equal the checkpoint's adapter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("peft")

import steadydiff  # noqa: E402
from steadydiff.cli import main  # noqa: E402
from steadydiff.integrations.sd import numbered  # noqa: E402
from steadydiff.integrations.sd.tiny import make_tiny_sd  # noqa: E402
from steadydiff.trainer import checkpoint as ckpt  # noqa: E402

from test_sd import sd_config, shapes  # noqa: E402


@pytest.fixture(scope="module")
def sd_dir(tmp_path_factory) -> Path:
    return make_tiny_sd(tmp_path_factory.mktemp("sd") / "tiny-sd", image_size=32)


def _adapter_of(cfg, lora_file: Path) -> dict[str, torch.Tensor]:
    """The trainable tensors of the model built with ``lora_file`` as adapter.init_from."""
    from steadydiff.config import replace
    from steadydiff.integrations.sd.setup import build

    model, _, _ = build(replace(cfg, {"adapter.init_from": str(lora_file)}),
                        torch.device("cpu"))
    return {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}


def test_numbered_files_per_save_keep_policy_and_export_step(sd_dir, tmp_path, capsys):
    from diffusers import StableDiffusionPipeline

    data = shapes(tmp_path / "images")
    cfg = sd_config(sd_dir, data, "optim.lr=0.01", "train.steps=6", "train.checkpoint_every=2",
                    "adapter.keep_files=2", "adapter.text_encoder=true")
    run = tmp_path / "run"
    steadydiff.train(cfg, out_dir=run)
    lora = run / "lora"
    got = numbered.numbered_files(lora, ["run", "pytorch_lora_weights"])
    assert list(got) == [4, 6]  # step 2's removed (adapter.keep_files=2), both formats each
    assert sorted(p.name for p in got[6]) == ["pytorch_lora_weights-step00000006.safetensors",
                                              "run-step00000006.safetensors"]
    # the latest files are byte copies of the newest numbered ones
    assert (lora / "run.safetensors").read_bytes() == got[6][1].read_bytes()
    assert len(list((run / "checkpoints").glob("step_*"))) == 3  # train.keep_checkpoints

    # step 2's files again, from its kept checkpoint: tensor-equal to its (EMA) adapter
    assert main(["export", str(run), "--step", "2"]) == 0
    assert "run-step00000002.safetensors" in capsys.readouterr().out
    c = ckpt.load_checkpoint(run / "checkpoints" / "step_00000002", "cpu", weights_only=True)
    for f in ("run-step00000002.safetensors", "pytorch_lora_weights-step00000002.safetensors"):
        ours = _adapter_of(cfg, lora / f)
        assert ours.keys() == c.ema.keys()
        for k in ours:
            assert torch.equal(ours[k], c.ema[k]), (f, k)
    # nothing overwritten: a second export keeps them
    assert main(["export", str(run), "--step", "2"]) == 0
    assert "kept" in capsys.readouterr().out
    # --checkpoint names one the same way (files already there: kept)
    assert main(["export", str(run), "--checkpoint", "step_00000004"]) == 0
    assert "kept" in capsys.readouterr().out and (lora / "run-step00000004.safetensors").is_file()
    # a step without a kept checkpoint: exit 2, the kept steps named
    assert main(["export", str(run), "--step", "3"]) == 2
    assert "kept: [2, 4, 6]" in capsys.readouterr().err

    # diffusers loads a numbered file by its weight_name (and the kohya one as a file)
    pipe = StableDiffusionPipeline.from_pretrained(sd_dir, local_files_only=True,
                                                   safety_checker=None)
    z = torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(0))
    kw = dict(num_inference_steps=2, guidance_scale=1.0, output_type="pt")
    base = pipe(["a red square"], latents=z.clone(), **kw).images
    pipe.load_lora_weights(lora, weight_name="pytorch_lora_weights-step00000002.safetensors",
                           adapter_name="d2")
    d2 = pipe(["a red square"], latents=z.clone(), **kw).images
    pipe.delete_adapters("d2")
    pipe.load_lora_weights(lora / "run-step00000002.safetensors", adapter_name="k2")
    k2 = pipe(["a red square"], latents=z.clone(), **kw).images
    assert (d2 - base).abs().max() > 1e-4
    torch.testing.assert_close(d2, k2, atol=1e-4, rtol=0)


def test_prune_keeps_the_newest_and_the_best_and_only_our_names(tmp_path):
    f = tmp_path / "lora"
    f.mkdir()
    src = tmp_path / "w.safetensors"
    src.write_bytes(b"x")
    for s in (1, 2, 3, 4):
        numbered.publish({src: "run"}, f, s)
    (f / "mine-step00000001.safetensors").write_bytes(b"users")  # not a stem of ours
    numbered.mark_best(f, 2, [f / "run-step00000002.safetensors"], {"metric": "fd"})
    gone = numbered.prune(f, ["run"], keep=1)
    assert sorted(p.name for p in gone) == ["run-step00000001.safetensors",
                                            "run-step00000003.safetensors"]
    assert list(numbered.numbered_files(f, ["run"])) == [2, 4]
    assert (f / "mine-step00000001.safetensors").read_bytes() == b"users"
    assert json.loads((f / "best.json").read_text())["step"] == 2
    assert numbered.numbered_step("run-step00000042.safetensors", "run") == 42
    assert numbered.numbered_step("run.safetensors") is None


def test_hypernetwork_run_writes_numbered_files(sd_dir, tmp_path):
    data = shapes(tmp_path / "images")
    cfg = sd_config(sd_dir, data, "adapter.kind=hypernetwork", 'adapter.targets=["*"]',
                    "train.steps=2", "train.checkpoint_every=1")
    steadydiff.train(cfg, out_dir=tmp_path / "hn")
    got = numbered.numbered_files(tmp_path / "hn" / "hypernetwork", ["hn"])
    assert list(got) == [1, 2]
    assert (tmp_path / "hn" / "hypernetwork" / "hypernetwork.safetensors").read_bytes() == \
        got[2][0].read_bytes()
    # step 1's file again from its checkpoint: the same tensors
    from safetensors.torch import load_file

    first = load_file(got[1][0])
    got[1][0].unlink()
    assert main(["export", str(tmp_path / "hn"), "--step", "1"]) == 0
    again = load_file(got[1][0])
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)


@pytest.mark.slow
def test_sdxl_kohya_folders_write_numbered_files_equal_to_the_checkpoint(tmp_path):
    """On the tiny SDXL folder: kohya repeat folders with class images train kohya's epoch,
    and a step's numbered files (sgm names, both encoders) equal its checkpoint's LoRA."""
    from steadydiff.integrations.sd.tiny import main as tiny

    from test_kohya import kohya_tree

    xl = tmp_path / "tiny-sdxl"
    tiny([str(xl), "--family", "sdxl", "--image-size", "32"])
    train, reg = kohya_tree(tmp_path)
    cfg = sd_config(xl, train, f"data.reg_path={reg}", "train.epochs=1", "train.batch_size=4",
                    "train.checkpoint_every=3", "adapter.text_encoder=true", "optim.lr=0.01",
                    "sample.use_ema=false")
    res = steadydiff.train(cfg, out_dir=tmp_path / "run")
    assert res.steps == 6  # (11 instance + 11 class samples) / 4
    lora = tmp_path / "run" / "lora"
    assert list(numbered.numbered_files(lora, ["run", "pytorch_lora_weights"])) == [3, 6]
    c = ckpt.load_checkpoint(tmp_path / "run" / "checkpoints" / "step_00000003", "cpu",
                             weights_only=True)
    for f in ("run-step00000003.safetensors", "pytorch_lora_weights-step00000003.safetensors"):
        ours = _adapter_of(cfg, lora / f)
        assert ours.keys() == c.model.keys()
        assert all(torch.equal(ours[k], c.model[k]) for k in ours), f
