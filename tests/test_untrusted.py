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
import re
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


@pytest.mark.parametrize("command", ["sample", "export", "doctor",
                                     pytest.param("train", marks=pytest.mark.slow)])
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


@pytest.mark.parametrize("limit,library", [
    (100_000, "safetensors"), pytest.param(300_000, "torch", marks=pytest.mark.slow)])
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


# --------------------------------------------------------------------------- config values


def _float_fields():
    """Every float-valued key of the config tree (plain, optional, or in a tuple)."""
    from steadydiff.config import _section_paths

    for cls, path in _section_paths().items():
        for name, f in cls.model_fields.items():
            if "float" in str(f.annotation) and "Literal" not in str(f.annotation):
                yield f"{path}.{name}" if path else name, f


@pytest.mark.parametrize("bad", ["inf", "-inf", "nan"])
def test_no_config_number_may_be_infinite_or_nan(bad):
    """Generic: every float field of the tree, not a list of examples."""
    from steadydiff.config import ConfigError, load_config

    checked = 0
    for key, f in _float_fields():
        ann = str(f.annotation)
        value = (f"[{bad}, {bad}]" if "tuple[float, float]" in ann else
                 f"[[0.0, {bad}], [1.0, 1.0]]" if "tuple[tuple" in ann else
                 f"[{bad}]" if "tuple" in ann else bad)
        with pytest.raises(ConfigError, match=rf"(?s){re.escape(key)}"):
            load_config(None, [f"{key}={value}"])
        checked += 1
    assert checked > 60  # the whole tree was walked


def test_the_issues_values_are_refused_with_a_sentence(tmp_path):
    from steadydiff.config import ConfigError, load_config

    for item in ["adapter.alpha=inf", "optim.grad_clip=inf", "adapter.max_delta_ratio=inf",
                 "guard.grad_z=inf", "guard.attn_logit_limit=inf",
                 "train.watchdog_timeout=inf", "eval.min_delta=inf",
                 "diffusion.piecewise=[[0.0,nan],[1.0,-10.0]]"]:
        with pytest.raises(ConfigError, match="not a finite number"):
            load_config(None, [item])
    for item in ["data.cache_dir=''", "data.path='  '", "adapter.init_from=''",
                 "model.pretrained=''", "data.conditioning_dir=''"]:
        with pytest.raises(ConfigError, match="empty path|at least 1 character"):
            load_config(None, [item])
    # through the CLI, from a YAML file: exit 2 naming the key
    cfg = tmp_path / "c.yaml"
    cfg.write_text("data:\n  cache_dir: ''\noptim:\n  grad_clip: .inf\n")
    r = _cli("train", str(cfg), "--dry-run", cwd=tmp_path, timeout=60)
    assert r.returncode == 2 and "data.cache_dir" in r.stderr and "optim.grad_clip" in r.stderr


# --------------------------------------------------------------------------- foreign code


@pytest.fixture(scope="module")
def tiny_sd(tmp_path_factory) -> Path:
    from steadydiff.integrations.sd.tiny import make_tiny_sd

    return make_tiny_sd(tmp_path_factory.mktemp("sd") / "tiny-sd", image_size=32)


_MARKER_CODE = "open({marker!r}, 'w').write('ran')\n"


def _load_in_child(code: str, cwd: Path) -> subprocess.CompletedProcess:
    """Run ``code`` in a child whose stdin is an open pipe holding "y": a prompt that asked
    whether to run the folder's code would read it and say yes."""
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=ENV, input="y\ny\n",
                          capture_output=True, text=True, timeout=120)


def test_a_library_named_in_model_index_is_never_imported(tmp_path, tiny_sd):
    folder = tmp_path / "sd"
    shutil.copytree(tiny_sd, folder)
    marker = tmp_path / "IMPORTED"
    (tmp_path / "my_module.py").write_text(_MARKER_CODE.format(marker=str(marker)) +
                                           "class MyScheduler: pass\n")
    index = json.loads((folder / "model_index.json").read_text())
    index["scheduler"] = ["my_module", "MyScheduler"]
    (folder / "model_index.json").write_text(json.dumps(index))
    code = ("import sys; sys.path.insert(0, '.')\n"  # as `python -m` puts the cwd first
            "from steadydiff.integrations.sd.folder import load_folder_parts\n"
            "from steadydiff.integrations.families import SDFolderError\n"
            f"try:\n    load_folder_parts({str(folder)!r})\n"
            "except SDFolderError as e:\n    print('REFUSED', e); sys.exit(2)\n")
    r = _load_in_child(code, tmp_path)
    assert not marker.exists()
    assert r.returncode == 2 and "my_module" in r.stdout and "diffusers or transformers" \
        in r.stdout, r.stdout + r.stderr[-2000:]
    # the single-file path reads the same folder as its config: refused the same way
    from steadydiff.integrations.families import SDFolderError
    from steadydiff.integrations.sd.folder import check_folder
    with pytest.raises(SDFolderError, match="my_module"):
        check_folder(folder, weights=False)


def test_a_tokenizer_with_auto_map_never_runs_its_code_and_nothing_asks(tmp_path, tiny_sd):
    folder = tmp_path / "sd"
    shutil.copytree(tiny_sd, folder)
    marker = tmp_path / "TOKENIZER_CODE_RAN"
    tok = folder / "tokenizer"
    (tok / "my_tok.py").write_text(_MARKER_CODE.format(marker=str(marker)) +
                                   "from transformers import CLIPTokenizer\n"
                                   "class MyTok(CLIPTokenizer): pass\n")
    conf = json.loads((tok / "tokenizer_config.json").read_text())
    conf["auto_map"] = {"AutoTokenizer": ["my_tok.MyTok", None]}
    conf["tokenizer_class"] = "MyTok"
    (tok / "tokenizer_config.json").write_text(json.dumps(conf))
    code = ("import sys\n"
            "from steadydiff.integrations.sd.folder import load_folder_parts\n"
            "from steadydiff.integrations.families import SDFolderError\n"
            f"try:\n    load_folder_parts({str(folder)!r}); print('LOADED')\n"
            "except SDFolderError as e:\n    print('REFUSED', e); sys.exit(2)\n")
    r = _load_in_child(code, tmp_path)
    assert not marker.exists(), r.stdout + r.stderr[-2000:]
    assert "trust_remote_code" not in r.stderr or r.returncode == 2
    assert "[y/N]" not in r.stdout + r.stderr  # never asked
    assert r.returncode in (0, 2), r.stderr[-2000:]


def test_pickled_text_encoder_shards_and_a_corrupt_part_are_refused(tmp_path, tiny_sd):
    from steadydiff.integrations.families import SDFolderError
    from steadydiff.integrations.sd.folder import load_folder_parts

    folder = tmp_path / "sd"
    shutil.copytree(tiny_sd, folder)
    te = folder / "text_encoder"
    marker = tmp_path / "SHARD_UNPICKLED"
    torch.save({"x": _Payload(marker)}, te / "pytorch_model-00001-of-00001.bin")
    weights = next(te.glob("*.safetensors"))
    weights.unlink()
    (te / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"text_model.embeddings.token_embedding.weight":
                                        "pytorch_model-00001-of-00001.bin"}}))
    with pytest.raises(SDFolderError, match=r"(?s)pytorch_model-00001-of-00001\.bin.*"
                                            r"\.safetensors"):
        load_folder_parts(folder)
    assert not marker.exists()
    # a damaged text encoder's safetensors: a sentence naming the folder, not a traceback
    folder2 = tmp_path / "sd2"
    shutil.copytree(tiny_sd, folder2)
    w = next((folder2 / "text_encoder").glob("*.safetensors"))
    w.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all" + b"\0" * 64)
    with pytest.raises(SDFolderError, match="text encoder does not load"):
        load_folder_parts(folder2)


def test_an_exported_file_without_its_config_is_a_sentence(tmp_path, finished):
    from safetensors.torch import load_file, save_file

    from steadydiff.loading import EXPORT_FORMAT, export_model

    src = export_model(finished, tmp_path / "m.safetensors")
    bad = tmp_path / "noconfig.safetensors"
    save_file(load_file(str(src)), str(bad), metadata={"format": EXPORT_FORMAT})
    r = _cli("sample", str(bad), "--num", "1", "--steps", "2", "--out",
             str(tmp_path / "s.png"), cwd=tmp_path)
    assert r.returncode == 2 and "no 'config'" in r.stderr and "Traceback" not in r.stderr


# A child that exports with the write slowed down (the tensors written, then a pause before
# the rename), so the test can signal it mid-write from outside.
_SLOW_EXPORT = """
import sys, time
import steadydiff.trainer.checkpoint as ck
real = ck.save_file
def slow(*a, **k):
    real(*a, **k)
    print("WRITING", flush=True)
    time.sleep(60)
ck.save_file = slow
from steadydiff.cli import main
sys.exit(main(["export", sys.argv[1], "--out", sys.argv[2], "--force"]))
"""


@pytest.mark.parametrize("sig", ["SIGTERM", pytest.param("SIGKILL", marks=pytest.mark.slow)])
def test_a_kill_during_export_leaves_the_old_file_and_no_temporary(tmp_path, finished, sig):
    import signal

    out = tmp_path / "model.safetensors"
    out.write_bytes(b"previous export")
    p = subprocess.Popen([sys.executable, "-c", _SLOW_EXPORT, str(finished), str(out)],
                         cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    assert p.stdout.readline().strip() == "WRITING"
    assert [n for n in _files(tmp_path) if ".tmp-" in n]  # mid-write: the temporary exists
    p.send_signal(getattr(signal, sig))
    p.wait(timeout=60)
    assert out.read_bytes() == b"previous export"
    left = [n for n in _files(tmp_path) if ".tmp-" in n]
    if sig == "SIGTERM":  # unwound: the temporary removed, the process ends as SIGTERM would
        assert p.returncode == 128 + signal.SIGTERM and not left, (p.returncode, left)
    else:  # nothing can run on SIGKILL: the next write of that target sweeps it
        assert left
        r = _cli("export", str(finished), "--out", str(out), "--force", cwd=tmp_path)
        assert r.returncode == 0 and _files(tmp_path) == {"model.safetensors"}


def test_a_run_named_pytorch_lora_weights_keeps_both_lora_files(tmp_path):
    """--out .../pytorch_lora_weights: the kohya file is named after the run, which here is
    diffusers' own file name; the two no longer collide. Both get the umask's mode."""
    from safetensors.torch import load_file

    from steadydiff.integrations.sd.model import save_lora
    from test_sd_lora_files import lora_pair

    unet, te = lora_pair()
    out = tmp_path / "pytorch_lora_weights"
    f = save_lora(unet, out, te, format="both", kohya_name=out.name)
    kohya = out / "pytorch_lora_weights_kohya.safetensors"
    assert f == out / "pytorch_lora_weights.safetensors" and kohya.is_file()
    assert all(k.startswith(("unet.", "text_encoder.")) for k in load_file(f))
    assert all(k.startswith(("lora_unet_", "lora_te")) for k in load_file(kohya))
    old = os.umask(0)
    os.umask(old)
    assert {p.stat().st_mode & 0o777 for p in (f, kohya)} == {0o666 & ~old}
    assert sorted(p.name for p in out.iterdir()) == [f.name, kohya.name]  # no temporary
