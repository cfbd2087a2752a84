"""The guard on the Stable Diffusion path, against faults the test's own code puts into the
model folder's weights (never steadydiff's fault injector): a broken base named before
training, a frozen weight corrupted mid-run named and restored from disk, a non-finite text
embedding re-encoded in fp32 before any caption is quarantined, the VAE's fp32 fallback read
from disk, a precision fallback that moves the frozen parts, the peft LoRA's |dW|/|W| guard,
and doctor on an SD run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("peft")

from safetensors.torch import load_file, save_file  # noqa: E402

import steadydiff  # noqa: E402
from steadydiff.config import ConfigError  # noqa: E402
from steadydiff.integrations.sd.tiny import make_tiny_sd  # noqa: E402

from test_sd import incidents, sd_config, shapes  # noqa: E402


@pytest.fixture(scope="module")
def clean_sd(tmp_path_factory) -> Path:
    return make_tiny_sd(tmp_path_factory.mktemp("sdg") / "tiny-sd", image_size=32)


def broken(clean: Path, tmp: Path, part: str, edit) -> Path:
    """A copy of the folder ``clean`` whose ``part`` weights file ``edit(tensors)`` changed
    (the test's own code, as a damaged download would)."""
    out = tmp / f"sd-{part}"
    shutil.copytree(clean, out)
    f = next((out / part).glob("*.safetensors"))
    sd = load_file(f)
    edit(sd)
    save_file(sd, f)
    return out


def first(sd: dict, *words: str) -> str:
    return next(k for k in sorted(sd) if all(w in k for w in words) and sd[k].ndim >= 2)


# --------------------------------------------------------------------------- a broken base


@pytest.mark.parametrize("part, words", [("unet", ("conv_in",)), ("vae", ("encoder",)),
                                         ("text_encoder", ("q_proj",))])
def test_a_broken_base_is_named_before_training(clean_sd, tmp_path, part, words):
    """A NaN in the UNet, the VAE or the text encoder: exit 2 before any step, naming the
    tensor and the file to download again (not the data, not the LR)."""
    def nan(sd):
        sd[first(sd, *words)][0].view(-1)[0] = float("nan")

    root = broken(clean_sd, tmp_path, part, nan)
    data = shapes(tmp_path / "images")
    with pytest.raises(ConfigError) as e:
        steadydiff.train(sd_config(root, data), out_dir=tmp_path / "run")
    msg = str(e.value)
    assert "base model is broken" in msg and f"{root / part}" in msg and ".safetensors" in msg
    assert "NaN" in msg and "learning-rate" in msg
    assert not (tmp_path / "run" / "checkpoints").exists()
