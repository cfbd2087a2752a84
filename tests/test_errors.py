"""Honest errors (issue 14): a mistake is an error that names the field, the value and what
would be valid; nothing is approved that fails once started, nothing is reported as fine
that is not. Each test runs the real CLI (``cli.main(argv)`` in-process) or the public API,
without mocks; docs/RELIABILITY.md ("Honest errors") lists them.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from steadydiff.cli import main

from tiny import TINY_MODEL  # tests/tiny.py

CONFIGS = Path(__file__).parents[1] / "configs"
FIXTURE = Path(__file__).parent / "fixtures" / "v1_unet_run"
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


# --------------------------------------------------------------------------- 6. devices


@NO_CUDA
@pytest.mark.parametrize("command", [
    ["sample", FIXTURE, "--device", "cuda", "--out", "{tmp}/x.png"],
    ["eval", FIXTURE, "--device", "cuda", "--num", "8"],
    ["doctor", FIXTURE, "--device", "cuda"],
    ["train", CONFIGS / "digits_uncond.yaml", "--set", "train.device=cuda", "--out", "{tmp}/r"],
], ids=["sample", "eval", "doctor", "train"])
def test_missing_accelerator_is_bad_input_not_a_security_alarm(command, tmp_path, capsys):
    rc, out, err = run_cli([str(a).format(tmp=tmp_path) for a in command], capsys)
    assert rc == 2, (out, err)  # bad input; for doctor 1 would mean "critical finding"
    assert "cuda requested but not available here; available: cpu" in err.replace(
        " (no CUDA device, or torch built without CUDA)", "")
    assert "loaded safely" not in err and "unpickled" not in err
    assert not (tmp_path / "x.png").exists() and not (tmp_path / "r").exists()


@pytest.mark.parametrize("command", [
    ["sample", FIXTURE, "--device", "tpu9", "--out", "{tmp}/x.png"],
    ["doctor", FIXTURE, "--device", "tpu9"],
], ids=["sample", "doctor"])
def test_unknown_device_name_lists_the_valid_ones(command, tmp_path, capsys):
    rc, out, err = run_cli([str(a).format(tmp=tmp_path) for a in command], capsys)
    assert rc == 2, (out, err)
    assert "unknown device 'tpu9'" in err and "valid device names: auto, cpu, cuda" in err


def test_api_load_resolves_the_device_the_same_way():
    import steadydiff
    from steadydiff.devices import DeviceError

    with pytest.raises(DeviceError, match="unknown device 'tpu9'"):
        steadydiff.load(FIXTURE, device="tpu9")
    assert steadydiff.load(FIXTURE, device="cpu").device == torch.device("cpu")


# --------------------------------------------------------------------------- 10. config


@pytest.mark.parametrize("text", ["", "# only a comment\n"], ids=["empty", "comments"])
def test_empty_config_file_is_an_error(text, tmp_path, capsys):
    cfg = tmp_path / "empty.yaml"
    cfg.write_text(text)
    rc, out, err = run_cli(["train", cfg, "--dry-run"], capsys)
    assert rc == 2 and "empty config; start from one in configs/" in err, (out, err)


@pytest.mark.parametrize("override,expected", [
    ("train.steps=true", "train.steps: Input should be a valid integer, got true"),
    ("train.batch_size=false", "train.batch_size: Input should be a valid integer, got false"),
    ("model.qk_norm=1", "model.qk_norm: Input should be a valid boolean, got 1"),
    ("optim.lr=true", "optim.lr: expected a number, got true"),
    ("model.unet.channel_mult=[1,true]", "model.unet.channel_mult.1: Input should be a "
                                         "valid integer, got true"),
])
def test_ints_and_bools_are_strict(override, expected):
    from steadydiff.config import ConfigError, load_config

    with pytest.raises(ConfigError) as e:
        load_config(CONFIGS / "digits_cond.yaml", [override])
    assert expected in str(e.value)


def test_yaml_ints_still_fill_float_fields():
    from steadydiff.config import load_config

    cfg = load_config(CONFIGS / "digits_cond.yaml", ["optim.lr=1", "train.ema_decay=0"])
    assert cfg.optim.lr == 1.0 and isinstance(cfg.optim.lr, float)
    assert cfg.train.ema_decay == 0.0


def test_a_bad_set_value_is_blamed_on_the_override_not_the_file(capsys):
    rc, out, err = run_cli(["train", CONFIGS / "digits_cond.yaml", "--dry-run",
                            "--set", "train.steps=true", "train.stepz=3"], capsys)
    assert rc == 2
    assert "--set train.steps=true: train.steps: Input should be a valid integer" in err
    assert "--set train.stepz=3: train.stepz: unknown key; did you mean 'train.steps'" in err
    assert "invalid " + str(CONFIGS / "digits_cond.yaml") not in err
    # a cross-field rule names the override that broke it
    rc, out, err = run_cli(["train", CONFIGS / "digits_cond.yaml", "--dry-run",
                            "--set", "train.grad_accum=3"], capsys)
    assert rc == 2 and "--set train.grad_accum=3: train: train.batch_size" in err


def test_resume_and_no_resume_together_are_refused(tmp_path, capsys):
    rc, out, err = run_cli(["train", CONFIGS / "digits_cond.yaml", "--out", tmp_path / "r",
                            "--resume", tmp_path / "r", "--no-resume"], capsys)
    assert rc == 2 and "contradict each other" in err
    assert not (tmp_path / "r").exists()


RESUMABLE = TINY_MODEL + ["train.steps=2", "train.checkpoint_every=2", "sample.num=2",
                          "sample.steps=2", "logging.report=false", "logging.log_every=1",
                          "train.num_threads=1", "optim.schedule=constant", "optim.warmup_steps=0"]


def test_resume_config_changes_are_split_into_training_and_bookkeeping(tmp_path, capsys):
    run = tmp_path / "r"
    cfg = CONFIGS / "digits_cond.yaml"
    assert run_cli(["train", cfg, "--out", run, "--set", *RESUMABLE], capsys)[0] == 0
    # lr alters training, log_every and the sample cadence are bookkeeping
    rc, out, err = run_cli(["train", cfg, "--out", run, "--set", *RESUMABLE, "train.steps=3",
                            "optim.lr=1e-3", "logging.log_every=2", "train.sample_every=5"],
                           capsys)
    assert rc == 2
    refused, _, safe = err.partition("also changed, safe on resume")
    assert "optim.lr: 0.002 -> 0.001" in refused and "log_every" not in refused
    assert "logging.log_every: 1 -> 2" in safe and "train.sample_every: 0 -> 5" in safe
    # bookkeeping alone resumes, and says so under its own heading
    rc, out, err = run_cli(["train", cfg, "--out", run, "--set", *RESUMABLE, "train.steps=3",
                            "logging.log_every=2"], capsys)
    assert rc == 0, err
    safe = out.partition("bookkeeping (safe to change):\n")[2]
    assert "    train.steps: 2 -> 3\n    logging.log_every: 1 -> 2" in safe
    assert "alter training" not in out


# --------------------------------------------------------------------------- 8. sampling


@pytest.fixture(scope="module")
def uncond_run(tmp_path_factory) -> Path:
    """A 2-step unconditional tiny run (its final checkpoint)."""
    out = tmp_path_factory.mktemp("uncond") / "run"
    rc = main(["train", str(CONFIGS / "digits_uncond.yaml"), "--out", str(out), "--set",
               *TINY_MODEL, "model.num_classes=0", "train.steps=2", "train.checkpoint_every=2",
               "sample.num=2", "sample.steps=2", "logging.report=false",
               "train.num_threads=1"])
    assert rc == 0
    return out


def test_nonfinite_samples_are_an_error_not_written(tmp_path, capsys):
    out = tmp_path / "x.npz"
    rc, so, err = run_cli(["sample", FIXTURE, "--cfg-scale", "nan", "--num", "4",
                           "--steps", "2", "--out", out], capsys)
    assert rc == 2, (so, err)
    assert "4 of 4 samples are non-finite (NaN/Inf); nothing was written" in err
    assert "wrote" not in so and not out.exists()


def test_nonfinite_samples_from_the_api_are_counted():
    import steadydiff
    from steadydiff.loading import NonFiniteSamples

    pipe = steadydiff.load(FIXTURE, device="cpu")
    with torch.no_grad():  # a weight turned NaN after loading (injected, no mock)
        next(pipe.model.parameters()).fill_(float("nan"))
    with pytest.raises(NonFiniteSamples, match="3 of 3 samples are non-finite"):
        pipe.sample(3, steps=2)
    x, _ = pipe.sample(3, steps=2, allow_nonfinite=True)  # eval counts them instead
    assert not torch.isfinite(x).any()


def test_cfg_scale_on_an_unconditional_model_is_refused(uncond_run, tmp_path, capsys):
    rc, so, err = run_cli(["sample", uncond_run, "--cfg-scale", "3", "--num", "2",
                           "--steps", "2", "--out", tmp_path / "x.png"], capsys)
    assert rc == 2 and "unconditional (model.num_classes=0)" in err and "--cfg-scale" in err
    assert not (tmp_path / "x.png").exists()
    # without it, the same model samples
    rc, so, err = run_cli(["sample", uncond_run, "--num", "2", "--steps", "2",
                           "--out", tmp_path / "x.png"], capsys)
    assert rc == 0 and (tmp_path / "x.png").exists(), err


@pytest.mark.parametrize("sampler", ["dpmpp_2m", "euler", "ddpm"])
def test_eta_with_a_sampler_that_ignores_it_is_refused(sampler, tmp_path, capsys):
    from steadydiff.diffusion.samplers import USES_ETA

    assert sampler not in USES_ETA
    rc, so, err = run_cli(["sample", FIXTURE, "--sampler", sampler, "--eta", "0.5", "--num",
                           "2", "--steps", "2", "--out", tmp_path / "x.png"], capsys)
    assert rc == 2, (so, err)
    assert f"eta (--eta) is used by the ddim sampler only; {sampler} ignores it" in err
    rc, so, err = run_cli(["sample", FIXTURE, "--sampler", "ddim", "--eta", "0.5", "--num",
                           "2", "--steps", "2", "--out", tmp_path / "x.png"], capsys)
    assert rc == 0, err


# --------------------------------------------------------------------------- 11. Python API


def _tiny_cfg(*extra: str):
    from steadydiff.config import load_config

    return load_config(None, TINY_MODEL + ["model.num_classes=0", "train.steps=2",
                                           "train.checkpoint_every=2", "sample.num=2",
                                           "sample.steps=2", "logging.report=false",
                                           "train.num_threads=1", "train.ema_decay=0.5",
                                           *extra])


def test_api_trains_on_a_tensor_dataset_of_images(tmp_path):
    import steadydiff
    from torch.utils.data import TensorDataset

    images = torch.rand(16, 1, 8, 8, generator=torch.Generator().manual_seed(0)) * 2 - 1
    res = steadydiff.train(_tiny_cfg(), dataset=TensorDataset(images), out_dir=tmp_path / "r")
    assert res.steps == 2 and res.checkpoint is not None


@pytest.mark.parametrize("scale,span,hint", [
    (255.0, "[0, 255]", "0..255 data: x / 127.5 - 1"),
    (3.0, "[-3, 3]", ""),
], ids=["0..255", "standardized"])
def test_api_refuses_data_outside_minus_one_one(scale, span, hint, tmp_path):
    import steadydiff
    from steadydiff.data import DataError

    class Images(torch.utils.data.Dataset):  # bare tensors: the old code trained on these
        def __len__(self):
            return 16

        def __getitem__(self, i):
            # half the images at the top of the range, half at 0 (0..255) or -scale
            return torch.full((1, 8, 8), scale if i % 2 else (0.0 if scale == 255 else -scale))

    with pytest.raises(DataError) as e:
        steadydiff.train(_tiny_cfg(), dataset=Images(), out_dir=tmp_path / "r")
    msg = str(e.value)
    assert f"dataset values span {span}" in msg and "expected images in [-1, 1]" in msg
    assert hint in msg
    assert not (tmp_path / "r" / "checkpoints").exists()  # refused before any step


def test_api_dataset_of_another_image_size_is_named(tmp_path):
    import steadydiff
    from steadydiff.config import ConfigError
    from torch.utils.data import TensorDataset

    images = torch.zeros(4, 1, 12, 12)  # the config says 8x8
    with pytest.raises(ConfigError, match=r"the dataset's images are 1×12×12 \(C×H×W\) but the "
                                          r"config says data.channels=1, data.image_size=8; "
                                          r"set data.image_size=12"):
        steadydiff.train(_tiny_cfg(), dataset=TensorDataset(images), out_dir=tmp_path / "r")


# model.num_classes=3: ids 0..2 are classes, 3 the null class of classifier-free guidance
VALID_IDS = "valid class ids are 0..2 (model.num_classes=3; id 3 is reserved for the null class"


@pytest.mark.parametrize("bad, said", [
    (3, "label 3 is out of range"),  # the null class: trained as "no class" before
    (9, "label 9 is out of range"),  # an IndexError inside F.embedding before
    (-2, "label -2 is out of range"),
    (1.5, "the label is float 1.5; expected an integer class id"),
], ids=["null-class", "above", "negative", "float"])
def test_api_refuses_a_label_outside_the_models_classes(bad, said, tmp_path):
    """Labels that come only with the images: item 1 is not among the items read at build
    time, so it is refused as it is fetched, in the first batch, with label dropout at 1
    (which used to hide it), before any update or checkpoint."""
    import steadydiff
    from steadydiff.data import DataError

    class Pairs(torch.utils.data.Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, i):
            return torch.zeros(1, 8, 8), bad if i == 1 else i % 3

    cfg = _tiny_cfg("model.num_classes=3", "train.batch_size=64", "diffusion.cfg_dropout=1.0")
    with pytest.raises(DataError) as e:
        steadydiff.train(cfg, dataset=Pairs(), out_dir=tmp_path / "r")
    assert str(e.value).startswith(f"dataset item 1: {said}") and VALID_IDS in str(e.value)
    assert not (tmp_path / "r" / "checkpoints").exists()


def test_api_checks_labels_it_can_read_before_training(tmp_path):
    """A TensorDataset's labels, or a dataset's ``labels``: all checked before the first step
    (no image of the bad item is loaded); good ones train a class-conditional model."""
    import steadydiff
    from steadydiff.data import DataError
    from torch.utils.data import TensorDataset

    images = torch.rand(40, 1, 8, 8, generator=torch.Generator().manual_seed(0)) * 2 - 1
    labels = torch.arange(40) % 3
    res = steadydiff.train(_tiny_cfg("model.num_classes=3"),
                           dataset=TensorDataset(images, labels), out_dir=tmp_path / "ok")
    assert res.steps == 2 and res.checkpoint is not None

    labels[17] = 3
    with pytest.raises(DataError) as e:
        steadydiff.train(_tiny_cfg("model.num_classes=3"),
                         dataset=TensorDataset(images, labels), out_dir=tmp_path / "t")
    assert str(e.value).startswith("dataset item 17: label 3 is out of range; " + VALID_IDS)

    loaded: list[int] = []

    class Labeled(torch.utils.data.Dataset):
        num_classes = 3
        labels = [i % 3 for i in range(40)]
        labels[17] = -1

        def __len__(self):
            return 40

        def __getitem__(self, i):
            loaded.append(i)
            return images[i], self.labels[i]

    with pytest.raises(DataError) as e:
        steadydiff.train(_tiny_cfg("model.num_classes=3"), dataset=Labeled(),
                         out_dir=tmp_path / "l")
    assert str(e.value).startswith("dataset item 17: label -1 is out of range; " + VALID_IDS)
    assert 17 not in loaded  # found from the labels, not by loading the item
    assert not (tmp_path / "t" / "checkpoints").exists()
    assert not (tmp_path / "l" / "checkpoints").exists()


def test_dry_run_refuses_a_folder_with_more_classes_than_the_model(tmp_path, capsys):
    """A folder's labels are its class folders: a third folder for a 2-class model (label 2,
    the null class id) is the config's to fix, said before training, by the dry run too."""
    from PIL import Image

    for name in ["a", "b", "c"]:
        (tmp_path / "img" / name).mkdir(parents=True)
        Image.new("L", (8, 8), 128).save(tmp_path / "img" / name / "0.png")
    argv = ["train", CONFIGS / "digits_cond.yaml", "--set", *TINY_MODEL, "model.num_classes=2",
            "data.dataset=folder", f"data.path={tmp_path / 'img'}", "data.class_labels=true"]
    rc, out, err = run_cli([*argv, "--dry-run"], capsys)
    assert rc == 2 and ("the data has 3 classes but model.num_classes is 2; set "
                        "model.num_classes=3") in err, (out, err)


# --------------------------------------------------------------------------- 7. dry run


@pytest.mark.parametrize("config,override,expected", [
    ("digits_cond", "data.image_size=7", "data.image_size=7, data.channels=1: image_size 7 is "
                                         "not divisible by 4"),
    ("dit", "model.dit.patch_size=3", "image_size 16 is not divisible by patch_size 3"),
    ("digits_cond", "model.unet.norm_groups=5", "32 channels are not divisible by "
                                                "norm_groups=5; choose norm_groups dividing 32"),
    ("digits_cond", "model.unet.head_channels=24", "64 channels are not divisible by "
                                                   "head_channels=24; choose head_channels"),
    ("digits_cond", "model.unet.attention_resolutions=[3]", "attention_resolutions [3] never "
                                                            "occur"),
    ("digits_cond", "model.num_classes=5", "the data has 10 classes but model.num_classes is "
                                           "5; set model.num_classes=10"),
], ids=["image_size", "patch_size", "norm_groups", "head_channels", "attention", "classes"])
def test_dry_run_refuses_what_training_would(config, override, expected, tmp_path, capsys):
    cfg = CONFIGS / f"{config}.yaml"
    rc, out, err = run_cli(["train", cfg, "--dry-run", "--set", override], capsys)
    assert rc == 2 and expected in err, (out, err)
    # the same words as a real start, which now fails before printing any config
    rc2, out2, err2 = run_cli(["train", cfg, "--out", tmp_path / "r", "--set", override,
                               "train.steps=1"], capsys)
    assert rc2 == 2 and expected in err2, (out2, err2)
    assert "diffusion:" not in out2 and len(out2.splitlines()) < 10


def test_dry_run_of_a_good_config_says_what_the_run_is(capsys):
    import yaml

    rc, out, err = run_cli(["train", CONFIGS / "dit.yaml", "--dry-run"], capsys)
    assert rc == 0 and err == ""
    assert yaml.safe_load(out)["model"]["kind"] == "dit"  # stdout stays valid YAML
    assert "# dry run: ok\n# model: dit-tiny, patch 2, 10 classes" in out
    assert "# data:  digits: 1797 images 1×16×16, 10 classes" in out


def test_a_start_prints_a_header_and_writes_the_config(tmp_path, capsys):
    argv = ["train", CONFIGS / "digits_uncond.yaml", "--set", *TINY_MODEL,
            "model.num_classes=0", "train.steps=1", "logging.report=false"]
    rc, out, err = run_cli([*argv, "--out", tmp_path / "a"], capsys)
    assert rc == 0, err
    assert f"run:   {tmp_path / 'a'} (full config: {tmp_path / 'a' / 'config.yaml'})" in out
    assert "model: unet, channels 8 x [1, 2], unconditional" in out
    assert "diffusion:" not in out  # the ~170-line config is not on the terminal
    assert "diffusion:" in (tmp_path / "a" / "config.yaml").read_text()
    rc, out, err = run_cli([*argv, "--out", tmp_path / "b", "--print-config"], capsys)
    assert rc == 0 and "diffusion:\n  objective: ddpm\n  timesteps: 100" in out
