"""Files a user is handed, or a careless path, through the real CLI in a subprocess: captions
that lead outside the data folder, block, or never end; a cache folder that is a file; an
output folder inside the data folder; a non-UTF-8 file name (issue 28). Each must end in
exit 2 with a sentence naming the file, never a hang, a traceback or a read of what it points
at. Every file is made here; the model is the tiny SD folder built from configs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("diffusers")
pytest.importorskip("peft")

from steadydiff.integrations.sd.tiny import make_tiny_sd  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def sd_dir(tmp_path_factory) -> Path:
    return make_tiny_sd(tmp_path_factory.mktemp("sd") / "tiny-sd", image_size=32)


def shapes(root: Path, n: int = 4) -> Path:
    """``n`` 32x32 images, each with a .txt caption."""
    from PIL import Image
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        Image.new("RGB", (32, 32), (40 * i, 200, 90)).save(root / f"img{i:02d}.png")
        (root / f"img{i:02d}.txt").write_text(f"a shape number {i}")
    return root


def train_args(sd: Path, data: Path, out: Path, *sets: str) -> list[str]:
    base = [f"model.pretrained={sd}", f"data.path={data}", "data.image_size=32",
            "train.steps=2", "train.batch_size=2", "train.precision=fp32",
            "train.checkpoint_every=2", "train.sample_every=0", "train.num_threads=1",
            "train.device=cpu", "sample.num=1", "sample.steps=2", "optim.warmup_steps=0",
            "guard.warmup_steps=0", "data.num_workers=0", "adapter.rank=4", "adapter.alpha=4",
            "logging.progress=false", *sets]
    return ["train", str(ROOT / "configs/sd_lora.yaml"), "--out", str(out),
            *[x for s in base for x in ("--set", s)]]


class Result:
    def __init__(self, returncode: int, stderr: str) -> None:
        self.returncode, self.stderr = returncode, stderr


def cli(args: list[str], capsys) -> Result:
    """The CLI in this process (the imports are paid once); a hang shows as the test's."""
    from steadydiff.cli import main
    capsys.readouterr()
    rc = main(args)
    return Result(rc, capsys.readouterr().err)


def run_cli(args: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    """The CLI in a subprocess (a real hang or kill), bounded by ``timeout``."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "src"))
    return subprocess.run([sys.executable, "-m", "steadydiff", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


def bad_input(r, *words: str) -> None:
    """Exit 2, a one-sentence error naming ``words``, no traceback."""
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    for w in words:
        assert w in r.stderr, (w, r.stderr[-3000:])


# --------------------------------------------------------------------------- captions


def test_train_refuses_a_fifo_caption_without_hanging(sd_dir, tmp_path):
    data = shapes(tmp_path / "data")
    (data / "img01.txt").unlink()
    os.mkfifo(data / "img01.txt")
    r = run_cli(train_args(sd_dir, data, tmp_path / "run"), timeout=180)
    bad_input(r, "img01.txt", "FIFO")


def test_train_refuses_a_caption_leading_outside_the_folder(sd_dir, tmp_path, capsys):
    data = shapes(tmp_path / "data")
    secret = tmp_path / "private.txt"
    secret.write_text("my bank password")
    (data / "img02.txt").unlink()
    (data / "img02.txt").symlink_to(secret)
    r = cli(train_args(sd_dir, data, tmp_path / "run"), capsys)
    bad_input(r, "img02.txt", "outside the data folder")
    # nothing of the private file reached the run's outputs
    for f in (tmp_path / "run").rglob("*"):
        if f.is_file():
            assert b"bank password" not in f.read_bytes(), f


def test_train_refuses_a_huge_caption(sd_dir, tmp_path, capsys):
    data = shapes(tmp_path / "data")
    (data / "img03.txt").write_bytes(b"tag, " * 2_000_000)  # 10 MB
    r = cli(train_args(sd_dir, data, tmp_path / "run"), capsys)
    bad_input(r, "img03.txt", "10,000,000 bytes", "8,192")


# --------------------------------------------------------------------------- paths


def test_cache_dir_naming_a_file_is_exit_2(sd_dir, tmp_path, capsys):
    data = shapes(tmp_path / "data")
    f = tmp_path / "notes.txt"
    f.write_text("mine")
    for cache in (f, f / "sub"):
        r = cli(train_args(sd_dir, data, tmp_path / f"run-{cache.name}",
                           f"data.cache_dir={cache}"), capsys)
        bad_input(r, "data.cache_dir", str(f), "is a file, not a folder")
    assert f.read_text() == "mine"


def test_a_non_utf8_file_name_is_named(sd_dir, tmp_path, capsys):
    data = shapes(tmp_path / "data")
    raw = os.fsencode(str(data)) + b"/caf\xe9.png"  # Latin-1, as an old Windows share
    (data / "img00.png").rename(os.fsdecode(raw))
    (data / "img00.txt").rename(os.fsdecode(raw[:-4] + b".txt"))
    r = cli(train_args(sd_dir, data, tmp_path / "run"), capsys)
    bad_input(r, "caf\\xe9.png", "not valid UTF-8", "rename it")


def test_out_inside_the_data_folder_is_refused(sd_dir, tmp_path, capsys):
    data = shapes(tmp_path / "data")
    before = sorted(p.name for p in data.iterdir())
    for out in (data / "runs" / "lora", data):
        r = cli(train_args(sd_dir, data, out), capsys)
        bad_input(r, "is inside data.path", "sample images would become training data")
    assert sorted(p.name for p in data.iterdir()) == before  # nothing written there
    # a hidden folder inside it is skipped by the folder's scan: allowed
    from steadydiff.config import load_config
    from steadydiff.trainer.loop import check_out_outside_data
    cfg = load_config(ROOT / "configs/sd_lora.yaml", [f"data.path={data}"])
    check_out_outside_data(cfg, data / ".runs" / "lora")
    check_out_outside_data(cfg, tmp_path / "elsewhere")
