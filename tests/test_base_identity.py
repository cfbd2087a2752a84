"""An adapter run knows its base (issue 28, item 9): ``model.pretrained`` is made absolute at
train time and the base's identity (every model file's sha256) recorded in state.json;
``sample``, ``export`` and resume refuse another base with both identities in the message,
and ``--base PATH`` points at the moved original. Everything through the real CLI on tiny SD
folders built from configs; the other model is one the test makes itself."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("diffusers")
pytest.importorskip("peft")

from steadydiff.cli import main  # noqa: E402
from steadydiff.integrations.sd.identity import (BaseMismatchError, base_identity,  # noqa: E402
                                                 check_base)
from steadydiff.integrations.sd.tiny import make_tiny_sd  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def shapes(root: Path, n: int = 4) -> Path:
    from PIL import Image
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        Image.new("RGB", (32, 32), (60 * i, 200, 90)).save(root / f"img{i:02d}.png")
        (root / f"img{i:02d}.txt").write_text(f"a square number {i}")
    return root


def train(out: Path, pretrained: str, data: Path, steps: int = 2, *sets: str) -> list[str]:
    base = [f"model.pretrained={pretrained}", f"data.path={data}", "data.image_size=32",
            f"train.steps={steps}", "train.batch_size=2", "train.precision=fp32",
            "train.checkpoint_every=2", "train.sample_every=0", "train.num_threads=1",
            "train.device=cpu", "sample.num=1", "sample.steps=2", "optim.warmup_steps=0",
            "guard.warmup_steps=0", "data.num_workers=0", "adapter.rank=4",
            "optim.schedule=constant",  # more steps on resume: the same LR
            "adapter.alpha=4", "logging.progress=false", "logging.report=false", *sets]
    return ["train", str(ROOT / "configs/sd_lora.yaml"), "--out", str(out),
            *[x for s in base for x in ("--set", s)]]


def cli(args: list[str], capsys) -> tuple[int, str]:
    capsys.readouterr()
    rc = main(args)
    return rc, capsys.readouterr().err


# --------------------------------------------------------------------------- the identity


def test_identity_follows_the_files_not_the_place(tmp_path):
    a = make_tiny_sd(tmp_path / "a")
    ida = base_identity(a)
    assert len(ida["sha256"]) == 64 and "unet/diffusion_pytorch_model.safetensors" in ida["files"]
    copy = tmp_path / "elsewhere" / "copy"
    shutil.copytree(a, copy)
    assert base_identity(copy)["sha256"] == ida["sha256"]  # moved or copied: the same base
    (copy / "README.md").write_text("my notes")  # not a model file
    assert base_identity(copy)["sha256"] == ida["sha256"]
    other = make_tiny_sd(tmp_path / "b", seed=1)
    assert base_identity(other)["sha256"] != ida["sha256"]
    # one byte of one weight file
    w = copy / "vae" / "diffusion_pytorch_model.safetensors"
    data = bytearray(w.read_bytes())
    data[-1] ^= 1
    w.write_bytes(bytes(data))
    changed = base_identity(copy, known=ida)  # another place: hashed again, not trusted
    assert changed["sha256"] != ida["sha256"]
    with pytest.raises(BaseMismatchError) as e:
        from steadydiff.config import load_config
        cfg = load_config(ROOT / "configs/sd_lora.yaml", [f"model.pretrained={copy}",
                                                          "data.path=x"])
        check_base(ida, cfg, "the run R")
    msg = str(e.value)
    assert ida["sha256"][:16] in msg and changed["sha256"][:16] in msg
    assert "vae/diffusion_pytorch_model.safetensors" in msg and "--base PATH" in msg


# --------------------------------------------------------------------------- through the CLI


def test_a_lora_run_knows_its_base(tmp_path, monkeypatch, capsys):
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir()
    elsewhere.mkdir()
    original = make_tiny_sd(work / "base")
    data = shapes(tmp_path / "data")
    run = tmp_path / "run"
    monkeypatch.chdir(work)
    rc, err = cli(train(run, "base", data), capsys)  # a relative model.pretrained
    assert rc == 0, err
    state = json.loads(next((run / "checkpoints").glob("step_*/state.json")).read_text())
    assert state["config"]["model"]["pretrained"] == str(original)  # stored absolute
    assert state["base"]["sha256"] == base_identity(original)["sha256"]

    # another directory holding another model under the same relative name: the run still
    # draws from its own base (the stored path is absolute)
    make_tiny_sd(elsewhere / "base", seed=3)
    monkeypatch.chdir(elsewhere)
    rc, err = cli(["sample", str(run), "--prompt", "a square", "--num", "1", "--steps", "2",
                   "--device", "cpu", "--out", str(tmp_path / "a.png")], capsys)
    assert rc == 0, err

    # the original replaced by another model at its very path: refused, both identities named
    moved = tmp_path / "moved-base"
    original.rename(moved)
    make_tiny_sd(original, seed=7)
    want, have = base_identity(moved)["sha256"], base_identity(original)["sha256"]
    for args in (["sample", str(run), "--prompt", "a square", "--num", "1", "--steps", "2",
                  "--device", "cpu", "--out", str(tmp_path / "b.png")],
                 ["export", str(run), "--single-file", str(tmp_path / "x.safetensors")],
                 train(run, str(original), data, 4)):
        rc, err = cli(args, capsys)
        assert rc == 2, (args[0], err)
        assert "trained on another base model" in err and want[:16] in err \
            and have[:16] in err and "--base PATH" in err, (args[0], err)
        assert "Traceback" not in err
    assert not (tmp_path / "b.png").exists() and not (tmp_path / "x.safetensors").exists()

    # --base points at the moved original: sample works; train resumes with the new path
    rc, err = cli(["sample", str(run), "--base", str(moved), "--prompt", "a square", "--num",
                   "1", "--steps", "2", "--device", "cpu", "--out", str(tmp_path / "c.png")],
                  capsys)
    assert rc == 0, err
    rc, err = cli(train(run, str(moved), data, 4), capsys)
    assert rc == 0, err
    state = json.loads((run / "checkpoints" / "step_00000004" / "state.json").read_text())
    assert state["base"]["path"] == str(moved) and state["base"]["sha256"] == want

    # merge is steadydiff's own adapters' tool: an SD LoRA run gets a sentence, not a TypeError
    rc, err = cli(["merge", str(run), "--out", str(tmp_path / "merged")], capsys)
    assert rc == 2 and "Stable Diffusion LoRA run" in err and "pytorch_lora_weights" in err
    assert not (tmp_path / "merged").exists()


def test_the_fast_path_never_trusts_a_rewritten_file(tmp_path):
    import os
    a = make_tiny_sd(tmp_path / "a")
    ida = base_identity(a)
    # the same path, untouched: every recorded sha256 reused (nothing read)
    again = base_identity(a, known=ida)
    assert again == ida
    # one weight file rewritten in place with its size and modification time put back
    w = a / "unet" / "diffusion_pytorch_model.safetensors"
    st = w.stat()
    data = bytearray(w.read_bytes())
    data[-1] ^= 1
    w.write_bytes(bytes(data))
    os.utime(w, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert base_identity(a, known=ida)["sha256"] != ida["sha256"]  # ctime moved: re-hashed
