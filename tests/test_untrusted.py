"""Nothing lost, nothing run (issue 28, part A): untrusted checkpoints, run directories that
are not ours, outputs that already exist, a full disk, config values that cannot be meant.

Every fault here comes from outside the library: the test's own code doctors a sharded
checkpoint so that unpickling it writes a marker file, builds a user's project folder,
fills a file system (RLIMIT_FSIZE in a child process: a real EFBIG from the kernel).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import steadydiff
from steadydiff.trainer import checkpoint as ckpt

from test_reliability import _cfg, _make_images, _Payload, _write_cfg

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _cli(*args: str, cwd: Path, timeout: int = 180) -> subprocess.CompletedProcess:
    """``python -m steadydiff.cli ARGS`` in a real subprocess."""
    return subprocess.run([sys.executable, "-m", "steadydiff.cli", *args], cwd=cwd, env=ENV,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    return _make_images(tmp_path_factory.mktemp("data") / "images")


@pytest.fixture(scope="module")
def finished(tmp_path_factory, images) -> Path:
    """A finished 2-step run with one plain checkpoint, to be copied and doctored."""
    d = tmp_path_factory.mktemp("finished")
    steadydiff.train(_cfg(images, "train.steps=2"), out_dir=d / "run")
    return d / "run"


# --------------------------------------------------------------------------- sharded (DCP)


def _rehash(c: Path) -> None:
    """Every file the manifest lists re-hashed, as anyone can: integrity, not origin."""
    mf = json.loads((c / "manifest.json").read_text())
    for name in mf["files"]:
        data = (c / name).read_bytes()
        mf["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (c / "manifest.json").write_text(json.dumps(mf))
    assert ckpt.verify_checkpoint(c) == []


def _as_sharded(c: Path, param_groups: list | None = None) -> None:
    """Rewrite the plain checkpoint ``c`` in the sharded layout (a DCP folder with the
    model, the EMA and the optimizer keyed by name, as an FSDP run writes it)."""
    import torch.distributed.checkpoint as dcp

    from safetensors.torch import load_file

    model = load_file(str(c / "model.safetensors"))
    ema = load_file(str(c / "ema.safetensors"))
    opt = torch.load(c / "optimizer.pt", weights_only=True)
    names = list(model)
    state = {names[int(i)]: v for i, v in opt["state"].items()}
    groups = param_groups or [{**g, "params": [names[int(i)] for i in g["params"]]}
                              for g in opt["param_groups"]]
    dcp.save({"model": model, "ema": ema, "optimizer": {"state": state,
                                                         "param_groups": groups}},
             checkpoint_id=str(c / ckpt.DCP_DIR), no_dist=True)
    for f in ("model.safetensors", "ema.safetensors", "optimizer.pt"):
        (c / f).unlink()
    files = {f: {} for f in ("rng.pt", "state.json")}
    files.update({f"{ckpt.DCP_DIR}/{p.name}": {} for p in (c / ckpt.DCP_DIR).iterdir()})
    mf = json.loads((c / "manifest.json").read_text())
    mf.update(layout=ckpt.SHARDED, world_size=1, files=files)
    (c / "manifest.json").write_text(json.dumps(mf))
    _rehash(c)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory, finished) -> Path:
    run = tmp_path_factory.mktemp("sharded") / "run"
    shutil.copytree(finished, run)
    _as_sharded(run / "checkpoints" / "step_00000002")
    return run


def test_a_clean_sharded_checkpoint_loads_through_the_safe_reader(sharded, finished):
    a = ckpt.load_checkpoint(sharded / "checkpoints" / "step_00000002")
    b = ckpt.load_checkpoint(finished / "checkpoints" / "step_00000002")
    assert a.model.keys() == b.model.keys()
    assert all(torch.equal(a.model[k], b.model[k]) for k in a.model)
    assert a.optimizer["param_groups"][0]["lr"] == b.optimizer["param_groups"][0]["lr"]


def _doctored_metadata(tmp_path: Path, sharded: Path) -> tuple[Path, Path]:
    """A copy of ``sharded`` whose ``dcp/.metadata`` runs a payload when unpickled."""
    run = tmp_path / "run"
    shutil.copytree(sharded, run)
    c = run / "checkpoints" / "step_00000002"
    marker = tmp_path / "PAYLOAD_RAN"
    md_path = c / ckpt.DCP_DIR / ".metadata"
    md = pickle.loads(md_path.read_bytes())  # our own clean file: trusted here
    md.planner_data = _Payload(marker)
    md_path.write_bytes(pickle.dumps(md))
    _rehash(c)
    pickle.loads(md_path.read_bytes())  # the payload is real: an unsafe load runs it
    assert marker.exists()
    marker.unlink()
    return run, marker


@pytest.mark.parametrize("command", ["sample", "export", "doctor", "train"])
def test_doctored_sharded_metadata_never_runs(tmp_path, sharded, images, command):
    run, marker = _doctored_metadata(tmp_path, sharded)
    args = {"sample": ["sample", str(run), "--out", str(tmp_path / "s.png"), "--num", "1",
                       "--steps", "2"],
            "export": ["export", str(run), "--out", str(tmp_path / "m.safetensors")],
            "doctor": ["doctor", str(run), "--no-probe"],
            "train": ["train", str(_write_cfg(tmp_path / "c.yaml", images, ["train.steps=4"])),
                      "--out", str(run)]}[command]
    r = _cli(*args, cwd=tmp_path)
    assert not marker.exists()
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    assert ".metadata" in r.stderr and "io.open" in r.stderr, r.stderr[-2000:]
    assert "weights_only=False`" not in r.stderr and "add_safe_globals" not in r.stderr


def test_a_pickled_non_tensor_item_is_loaded_weights_only(tmp_path, finished):
    """The optimizer's ``param_groups`` are a DCP bytes item that DCP's planner would
    ``torch.load(weights_only=False)``: here it is refused, nothing runs."""
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    c = run / "checkpoints" / "step_00000002"
    marker = tmp_path / "PAYLOAD_RAN"
    _as_sharded(c, param_groups=[{"lr": 1e-4, "params": [], "x": _Payload(marker)}])
    assert not marker.exists()
    with pytest.raises(ckpt.CheckpointError, match="(?s)cannot be loaded safely.*io.open"):
        ckpt.load_checkpoint(c)
    assert not marker.exists()
    r = _cli("export", str(run), "--out", str(tmp_path / "m.safetensors"), cwd=tmp_path)
    assert r.returncode == 2 and not marker.exists(), r.stderr[-2000:]
    assert "add_safe_globals" not in r.stderr and "Traceback" not in r.stderr


def test_a_storage_entry_outside_the_folder_is_refused(tmp_path, sharded):
    run = tmp_path / "run"
    shutil.copytree(sharded, run)
    c = run / "checkpoints" / "step_00000002"
    md_path = c / ckpt.DCP_DIR / ".metadata"
    md = pickle.loads(md_path.read_bytes())
    for info in md.storage_data.values():
        info.relative_path = "../../../../etc/passwd"
    md_path.write_bytes(pickle.dumps(md))
    _rehash(c)
    with pytest.raises(ckpt.CheckpointError, match="not a file of the checkpoint folder"):
        ckpt.load_checkpoint(c)
