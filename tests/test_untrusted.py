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


# --------------------------------------------------------------------------- run directories


def _project_folder(root: Path) -> dict[str, bytes]:
    """A user's own project folder: a config.yaml, checkpoints/ with their experiments, a
    metrics.jsonl and a report.html of their own. Returns every file's bytes."""
    (root / "checkpoints" / ".tmp-experiments").mkdir(parents=True)
    (root / "checkpoints" / ".tmp-experiments" / "notes.txt").write_text("mine\n")
    (root / "config.yaml").write_text("my: own config\n")
    (root / "metrics.jsonl").write_text('{"my": "metrics"}\n')
    (root / "report.html").write_text("<p>my report</p>")
    (root / "summary.json").write_text("{}")
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_a_users_project_folder_is_refused_as_out_and_nothing_changes(tmp_path, images):
    proj = tmp_path / "project"
    before = _project_folder(proj)
    cfg = _write_cfg(tmp_path / "c.yaml", images, ["train.steps=2"])
    r = _cli("train", str(cfg), "--out", str(proj), cwd=tmp_path)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "is not a steadydiff run" in r.stderr and "config.yaml" in r.stderr
    assert "steadydiff-run.json" in r.stderr and "Traceback" not in r.stderr
    after = {str(p.relative_to(proj)): p.read_bytes() for p in proj.rglob("*") if p.is_file()}
    assert after == before
    # a folder whose only file is the user's own metrics.jsonl: the same
    only = tmp_path / "only"
    only.mkdir()
    (only / "metrics.jsonl").write_text('{"mine": 1}\n')
    r = _cli("train", str(cfg), "--out", str(only), cwd=tmp_path)
    assert r.returncode == 2 and "metrics.jsonl" in r.stderr, r.stderr[-2000:]
    assert (only / "metrics.jsonl").read_text() == '{"mine": 1}\n'
    # `report` will not write into it either
    r = _cli("report", str(proj), cwd=tmp_path)
    assert r.returncode == 2 and (proj / "report.html").read_text() == "<p>my report</p>"


def test_a_run_carries_its_marker_and_an_earlier_run_keeps_working(tmp_path, images,
                                                                   finished):
    from steadydiff.rundir import MARKER, RunDir

    ident = RunDir(finished).identity()
    assert ident is not None and ident["kind"] == "steadydiff-run" and len(ident["id"]) == 32
    # a run written before the marker existed: recognised by its checkpoints' manifest and
    # state, resumed, and marked from then on
    old = tmp_path / "old"
    shutil.copytree(finished, old)
    (old / MARKER).unlink()
    assert RunDir(old).is_run()
    steadydiff.train(_cfg(images, "train.steps=4"), out_dir=old)
    assert RunDir(old).identity() is not None
    assert ckpt.latest_good(old / "checkpoints").name == "step_00000004"


def test_rotation_sweeps_only_its_own_temporaries(tmp_path, images, finished):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    mine = run / "checkpoints" / ".tmp-experiments"
    mine.mkdir()
    (mine / "keep.txt").write_text("x")
    dead = run / "checkpoints" / ".tmp-step_00000003-999999999"  # a killed writer's
    dead.mkdir()
    steadydiff.train(_cfg(images, "train.steps=4", "train.checkpoint_every=1"), out_dir=run)
    assert (mine / "keep.txt").read_text() == "x"
    assert not dead.exists()


# --------------------------------------------------------------------------- outputs


def _files(d: Path) -> set[str]:
    return {p.name for p in d.iterdir()}


def test_export_and_sample_refuse_an_existing_target_without_force(tmp_path, finished):
    out = tmp_path / "model.safetensors"
    out.write_bytes(b"the user's own file")
    r = _cli("export", str(finished), "--out", str(out), cwd=tmp_path)
    assert r.returncode == 2 and "already exists" in r.stderr and "--force" in r.stderr
    assert out.read_bytes() == b"the user's own file"
    r = _cli("export", str(finished), "--out", str(out), "--force", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    old = os.umask(0)
    os.umask(old)
    assert out.stat().st_mode & 0o777 == 0o666 & ~old  # like a checkpoint, not 0600
    assert _files(tmp_path) >= {"model.safetensors"} and not [
        p for p in _files(tmp_path) if ".tmp" in p]
    # a directory, and the command's own input (or a file inside it): refused, whatever --force
    (tmp_path / "folder.safetensors").mkdir()
    r = _cli("export", str(finished), "--out", str(tmp_path / "folder.safetensors"), "--force",
             cwd=tmp_path)
    assert r.returncode == 2 and "is a directory" in r.stderr, r.stderr[-2000:]
    inside = finished / "checkpoints" / "step_00000002" / "model.safetensors"
    before = inside.read_bytes()
    r = _cli("export", str(finished), "--out", str(inside), "--force", cwd=tmp_path)
    assert r.returncode == 2 and "own input" in r.stderr, r.stderr[-2000:]
    assert inside.read_bytes() == before
    # sample: the same rules
    png = tmp_path / "grid.png"
    png.write_bytes(b"mine")
    args = ["sample", str(finished), "--num", "1", "--steps", "2", "--out"]
    r = _cli(*args, str(png), cwd=tmp_path)
    assert r.returncode == 2 and png.read_bytes() == b"mine" and "--force" in r.stderr
    r = _cli(*args, str(png), "--force", cwd=tmp_path)
    assert r.returncode == 0 and png.read_bytes()[:4] == b"\x89PNG", r.stderr[-2000:]
    (tmp_path / "dir.png").mkdir()
    r = _cli(*args, str(tmp_path / "dir.png"), "--force", cwd=tmp_path)
    assert r.returncode == 2 and "is a directory" in r.stderr


def test_the_python_api_refuses_too(tmp_path, finished):
    from steadydiff.files import OutputExists
    from steadydiff.loading import export_model

    out = tmp_path / "m.safetensors"
    out.write_bytes(b"x")
    with pytest.raises(OutputExists, match="already exists"):
        export_model(finished, out)
    assert export_model(finished, out, force=True) == out and out.stat().st_size > 100


# --------------------------------------------------------------------------- a full disk

# A child process whose files may not grow past LIMIT bytes (RLIMIT_FSIZE) with SIGXFSZ
# ignored: a write past it fails with EFBIG from the kernel, as a full disk fails with ENOSPC.
_LIMITED = """
import resource, runpy, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
limit = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
sys.argv = ["steadydiff", *sys.argv[2:]]
runpy.run_module("steadydiff.cli", run_name="__main__")
"""


def _limited(limit: int, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _LIMITED, str(limit), *args], cwd=cwd,
                          env=ENV, capture_output=True, text=True, timeout=240)


def test_a_full_disk_during_export_and_sample_is_a_sentence_and_the_old_file_stays(
        tmp_path, finished):
    out = tmp_path / "model.safetensors"
    out.write_bytes(b"previous export")
    r = _limited(50_000, "export", str(finished), "--out", str(out), "--force", cwd=tmp_path)
    assert r.returncode == 4, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    assert f"could not write {out}" in r.stderr and "file size limit" in r.stderr
    assert "free there" in r.stderr
    assert out.read_bytes() == b"previous export"
    assert _files(tmp_path) == {"model.safetensors"}, _files(tmp_path)  # no temporary left
    npz = tmp_path / "s.npz"
    r = _limited(2_000, "sample", str(finished), "--num", "8", "--steps", "2", "--out",
                 str(npz), cwd=tmp_path)
    assert r.returncode == 4 and f"could not write {npz}" in r.stderr, r.stderr[-2000:]
    assert not npz.exists() and _files(tmp_path) == {"model.safetensors"}


@pytest.mark.parametrize("limit,library", [(100_000, "safetensors"), (300_000, "torch")])
def test_a_full_disk_while_checkpointing_retries_then_exits_4(tmp_path, images, finished,
                                                              limit, library):
    """safetensors' SafetensorError (the weights) and torch's "enforce fail" RuntimeError
    (optimizer.pt) are storage failures like an OSError: the documented retry, then exit 4
    with the previous checkpoint intact."""
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    cfg = _write_cfg(tmp_path / "c.yaml", images, ["train.steps=4", "train.checkpoint_every=1",
                                                   "train.num_threads=1"])
    r = _limited(limit, "train", str(cfg), "--out", str(run), cwd=tmp_path)
    assert r.returncode == 4, r.stdout[-2000:] + r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    assert "could not write checkpoint at step 3" in r.stdout + r.stderr
    assert "file size limit" in r.stdout + r.stderr
    assert "retrying at the next checkpoint" in r.stdout + r.stderr
    assert ckpt.latest_good(run / "checkpoints").name == "step_00000002"
    assert ckpt.verify_checkpoint(run / "checkpoints" / "step_00000002") == []
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".")]
