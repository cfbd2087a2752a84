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
