"""The first hour (issue 32): the CLI's start-up cost, its parsing, init and lint, the
shipped task configs, and the hints a newcomer reads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from steadydiff import tasks
from steadydiff.cli import main
from steadydiff.config import load_config

ROOT = Path(__file__).resolve().parents[1]


def test_help_and_version_import_neither_torch_nor_pydantic():
    code = ("import sys\nfrom steadydiff.cli import main\n"
            "for argv in (['--version'], ['--help'], ['train', '--help'], ['init', '--help']):\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            "print(sorted(m for m in ('torch', 'pydantic', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_lint_prints_the_warnings_without_building_anything(tmp_path, capsys):
    assert main(["lint", str(ROOT / "configs/dit.yaml"), "--set", "optim.lr=0.05"]) == 0
    out = capsys.readouterr().out
    assert "optim.lr=0.05" in out and "1 warning" in out
    assert main(["lint", str(ROOT / "configs/dit.yaml"), "--set", "optim.lr=0.05",
                 "--strict"]) == 1
    capsys.readouterr()
    assert main(["lint", str(ROOT / "configs/dit.yaml"), "--set", "optim.lrr=1"]) == 2
    assert "did you mean 'optim.lr'" in capsys.readouterr().err


@pytest.mark.parametrize("task", tasks.names())
def test_init_writes_the_tasks_config_and_it_loads(task, tmp_path, capsys):
    out = tmp_path / "cfg" / f"{task}.yaml"
    assert main(["init", task, "--out", str(out)]) == 0
    assert f"steadydiff train {out}" in capsys.readouterr().out
    text = out.read_text()
    assert text.startswith(f"# written by `steadydiff init {task}`")
    assert load_config(out) == load_config(tasks.configs_dir() / tasks.get(task).config)
    before = out.read_text()
    assert main(["init", task, "--out", str(out)]) == 2  # never replaced without --force
    assert "exists" in capsys.readouterr().err and out.read_text() == before
    assert main(["init", task, "--out", str(out), "--force"]) == 0


def test_init_refuses_a_directory_and_an_unknown_task(tmp_path, capsys):
    assert main(["init", "lora", "--out", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["init", "lorra"])
    assert "invalid choice: 'lorra'" in capsys.readouterr().err


@pytest.mark.parametrize("task", tasks.TASKS, ids=lambda t: t.name)
def test_shipped_task_configs_hold_only_what_differs_or_must_be_set(task):
    """Each key of a task's shipped config differs from its default, or is one its users
    must set (a path, the model, the dozen every run sets)."""
    from steadydiff.config import Config, _leaves
    defaults = dict(_leaves(Config().to_dict()))
    raw = yaml.safe_load((tasks.configs_dir() / task.config).read_text())
    idle = [k for k, v in _leaves(raw) if defaults.get(k, object()) == v
            and k not in task.must_set and k not in tasks.ALWAYS_SET]
    assert not idle, f"{task.config}: these keys only repeat their defaults: {idle}"


def test_missing_caption_hint_is_valid_json(tmp_path):
    from PIL import Image

    from steadydiff.data import DataError
    from steadydiff.data.captions import read_captions
    Image.new("RGB", (8, 8)).save(tmp_path / "it's.png")
    with pytest.raises(DataError) as e:
        read_captions(tmp_path, [tmp_path / "it's.png"], "auto", "error")
    line = str(e.value).split("add a line ", 1)[1].split(" to a ", 1)[0]
    assert json.loads(line) == {"file_name": "it's.png", "text": "..."}


def test_tiny_kit_says_what_it_wrote_and_what_to_run(tmp_path, capsys):
    from steadydiff.integrations.sd.tiny import main as tiny
    tiny([str(tmp_path / "kit")])
    out = capsys.readouterr().out
    assert f"to {tmp_path / 'kit'}" in out
    assert (f"steadydiff train configs/sd_lora.yaml --set model.pretrained={tmp_path / 'kit'}"
            " --set data.path=YOUR_IMAGES --set data.image_size=32") in out


def test_export_out_writes_a_stable_diffusion_folder_as_one_file(tmp_path, capsys):
    """`--out` is the file export writes, whatever the source: a diffusers SD folder gives
    the original single-file layout, as --single-file did."""
    pytest.importorskip("diffusers")
    from safetensors import safe_open

    from steadydiff.integrations.sd.tiny import make_tiny_sd
    folder = make_tiny_sd(tmp_path / "sd")
    out = tmp_path / "model.safetensors"
    assert main(["export", str(folder), "--out", str(out)]) == 0
    assert "original single-file layout" in capsys.readouterr().out
    with safe_open(str(out), "pt") as f:
        keys = list(f.keys())
    assert any(k.startswith("model.diffusion_model.") for k in keys)
    assert any(k.startswith("first_stage_model.") for k in keys)


def test_dry_run_makes_the_caption_length_check_the_run_makes(tmp_path, capsys):
    pytest.importorskip("diffusers")
    from steadydiff.integrations.sd.tiny import captioned_digits, make_tiny_sd
    folder = make_tiny_sd(tmp_path / "sd")
    images = captioned_digits(tmp_path / "images", n=4)
    (images / "digit_002.txt").write_text(" ".join(f"tag{i}," for i in range(120)))
    assert main(["train", str(ROOT / "configs/sd_lora.yaml"), "--dry-run",
                 "--set", f"model.pretrained={folder}", "--set", f"data.path={images}",
                 "--set", "data.image_size=32", "--set", "train.precision=fp32"]) == 0
    err = capsys.readouterr().err
    assert err.count("1 of 4 captions are longer") == 1 and "digit_002.png" in err
