"""Reliability bars (issue 4), measured on the real trainer, CPU, tiny models.

* Kill tests: ``python -m steadydiff.cli train`` in a real subprocess, SIGKILLed by the
  ``kill`` fault before a step, inside a step, or in the middle of writing a checkpoint; the
  same command is run again without the fault, and the final model, EMA, optimizer and RNG
  state must hash identically to a run that was never killed. One shared config has every
  feature that makes resume hard switched on at once: gradient accumulation, epochs ending
  mid-batch, data-loader workers, random flips, dropout (the global torch RNG).
* Known traps: leaving one piece out of the restore changes the resumed parameters.
* Storage: corrupt newest checkpoint, rotation, disk full / permission denied while saving.
* Safe loading: pickle payloads, a doctored state.json, NaN weights.
* Bad images and bad configs through the trainer and the CLI.

docs/RELIABILITY.md tabulates what each test observed.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from safetensors.torch import load_file, save_file

import steadydiff
from steadydiff import preflight
from steadydiff.cli import main
from steadydiff.config import ConfigError, apply_overrides, validate
from steadydiff.trainer import checkpoint as ckpt
from steadydiff.trainer import loop

# One tiny config for every run here. Every feature that makes exact resume hard is on:
# grad accumulation (2 micro-batches), a dataset of 13 images with batch 4 (epochs end
# mid-batch), random horizontal flips, dropout (drawn from the global torch RNG).
TINY = [
    "data.dataset=folder", "data.image_size=8", "data.channels=1", "data.hflip=true",
    "model.num_classes=0", "model.unet.channels=8", "model.unet.channel_mult=[1,2]",
    "model.unet.num_res_blocks=1", "model.unet.attention_resolutions=[4]",
    "model.unet.head_channels=8", "model.unet.norm_groups=4", "model.unet.dropout=0.1",
    "diffusion.timesteps=100", "train.batch_size=4", "train.grad_accum=2", "train.steps=6",
    "train.checkpoint_every=2", "train.sample_every=0", "train.num_threads=1",
    "train.ema_decay=0.9", "sample.num=2", "sample.steps=2", "logging.log_every=1",
    "logging.progress=false",
]
# The subprocess runs add what only a separate process can have: deterministic mode, two
# data-loader workers, and keep_checkpoints=1 (the harshest rotation).
CLI = ["train.deterministic=true", "data.num_workers=2", "train.keep_checkpoints=1"]
N_IMAGES = 13
STEPS = 6
FINAL = ckpt.checkpoint_name(STEPS)
STATE_FILES = ("model.safetensors", "ema.safetensors", "optimizer.pt", "rng.pt")


# --------------------------------------------------------------------------- helpers


def _make_images(root: Path, n: int = N_IMAGES, seed: int = 0) -> Path:
    """``n`` distinct, left-right asymmetric 8×8 gray PNGs (so a flip changes the batch)."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        a = rng.integers(0, 256, (8, 8), dtype=np.uint8)
        a[:, :2] = 255  # a bright left edge
        Image.fromarray(a, "L").save(root / f"img_{i:02d}.png")
    return root


def _raw(data: Path, extra: list[str] = (), faults: list[dict] | None = None) -> dict:
    raw = apply_overrides({}, [*TINY, f"data.path={data}", *extra])
    if faults:
        raw["faults"] = faults
    validate(raw)  # fail here, not inside a subprocess
    return raw


def _write_cfg(path: Path, data: Path, extra: list[str] = (),
               faults: list[dict] | None = None) -> Path:
    path.write_text(yaml.safe_dump(_raw(data, extra, faults), sort_keys=False))
    return path


def _cfg(data: Path, *extra: str):
    return validate(_raw(data, list(extra)))


def _run_cli(cfg_path: Path, out: Path, log: Path, env: dict | None = None) -> tuple[int, str]:
    """``steadydiff train cfg --out out`` in a subprocess. Output goes to a file, not a pipe:
    data-loader workers orphaned by a SIGKILL would hold a pipe open for seconds."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    with open(log, "w") as f:
        r = subprocess.run([sys.executable, "-m", "steadydiff.cli", "train", str(cfg_path),
                            "--out", str(out)], stdout=f, stderr=subprocess.STDOUT,
                           env=full_env, cwd=out.parent, timeout=120)
    return r.returncode, log.read_text()


def _state_hashes(run: Path) -> dict[str, str]:
    """sha256 of the final checkpoint's model, EMA, optimizer and RNG files (verified)."""
    c = run / "checkpoints" / FINAL
    assert ckpt.verify_checkpoint(c) == []
    return {f: hashlib.sha256((c / f).read_bytes()).hexdigest() for f in STATE_FILES}


def _metrics(run: Path) -> list[tuple]:
    rows = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], r["grad_norm"], r["lr"], r["ema_decay"]) for r in rows]


def _tensors(run: Path, name: str = FINAL) -> dict[str, torch.Tensor]:
    c = ckpt.load_checkpoint(run / "checkpoints" / name)
    return {**c.model, **{"ema." + k: v for k, v in c.ema.items()}}


def _same_tensors(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _assert_no_half_checkpoint(run: Path) -> None:
    """Every checkpoint under a real name is complete and verifies; ``latest`` names one."""
    root = run / "checkpoints"
    for c in ckpt.list_checkpoints(root):
        assert ckpt.verify_checkpoint(c) == [], c
    if (root / "latest").exists():
        assert (root / (root / "latest").read_text().strip()).is_dir()


def _doctor_manifest(cdir: Path, name: str) -> None:
    """Make the manifest match a replaced file, as an attacker would."""
    mf = json.loads((cdir / "manifest.json").read_text())
    data = (cdir / name).read_bytes()
    mf["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (cdir / "manifest.json").write_text(json.dumps(mf))
    assert ckpt.verify_checkpoint(cdir) == []


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    return _make_images(tmp_path_factory.mktemp("data") / "images")


@pytest.fixture(scope="module")
def straight_cli(tmp_path_factory, images) -> dict:
    """The run that was never killed, in a subprocess with the shared config."""
    d = tmp_path_factory.mktemp("straight")
    cfg = _write_cfg(d / "tiny.yaml", images, CLI)
    rc, log = _run_cli(cfg, d / "run", d / "log.txt")
    assert rc == 0, log
    return {"hashes": _state_hashes(d / "run"), "metrics": _metrics(d / "run"), "dir": d}


@pytest.fixture(scope="module")
def straight_inproc(tmp_path_factory, images) -> dict:
    """The same config in-process (no workers, not deterministic mode): checkpoints at 2, 4,
    6 kept; reference for the in-process storage and trap tests."""
    d = tmp_path_factory.mktemp("straight_inproc")
    res = steadydiff.train(_cfg(images), out_dir=d / "run")
    assert res.steps == STEPS
    return {"run": d / "run", "tensors": _tensors(d / "run"), "hashes": _state_hashes(d / "run")}


# --------------------------------------------------------------------------- kill tests


def _kill_then_finish(tmp_path: Path, images: Path, straight: dict, kills: list[dict],
                      extra_after: list[str] = ()) -> list[str]:
    """Run the shared config once per kill (each run must die by SIGKILL), then once without
    faults; the end state must equal the straight run's bit for bit. Returns the logs."""
    cfg, run = tmp_path / "tiny.yaml", tmp_path / "run"
    logs = []
    for i, k in enumerate(kills):
        _write_cfg(cfg, images, CLI, faults=[{"kind": "kill", **k}])
        rc, log = _run_cli(cfg, run, tmp_path / f"log{i}.txt")
        logs.append(log)
        assert rc == -9, f"kill {k} did not fire (rc={rc}):\n{log[-2000:]}"
        _assert_no_half_checkpoint(run)
    _write_cfg(cfg, images, CLI + list(extra_after))  # the same command, fault removed
    rc, log = _run_cli(cfg, run, tmp_path / "log_final.txt")
    logs.append(log)
    assert rc == 0, log[-3000:]
    assert _state_hashes(run) == straight["hashes"]
    assert _metrics(run) == straight["metrics"]  # the loss history is exact too
    assert not [p.name for p in (run / "checkpoints").iterdir() if p.name.startswith(".")]
    return logs


def test_kill_in_checkpoint_then_rerun_is_exact(tmp_path, images, straight_cli):
    # SIGKILL after model.safetensors of step 4 is in the temporary directory: step 2 stays
    # the newest checkpoint (keep_checkpoints=1 must not have deleted it), nothing half
    # written appears under a real name, and the rerun resumes from step 2.
    cfg, run = tmp_path / "tiny.yaml", tmp_path / "run"
    _write_cfg(cfg, images, CLI, faults=[{"kind": "kill", "step": 4, "where": "in_checkpoint"}])
    rc, log = _run_cli(cfg, run, tmp_path / "log0.txt")
    assert rc == -9, log[-2000:]
    root = run / "checkpoints"
    assert [p.name for p in ckpt.list_checkpoints(root)] == ["step_00000002"]
    assert ckpt.latest_good(root).name == "step_00000002"
    partial = [p for p in root.iterdir() if p.name.startswith(".tmp-step_00000004")]
    assert len(partial) == 1 and (partial[0] / "model.safetensors").is_file()
    assert not (partial[0] / "manifest.json").exists()

    _write_cfg(cfg, images, CLI)
    rc, log = _run_cli(cfg, run, tmp_path / "log1.txt")
    assert rc == 0, log[-3000:]
    assert "resumed from" in log and "step_00000002 at step 2" in log
    assert _state_hashes(run) == straight_cli["hashes"]
    assert _metrics(run) == straight_cli["metrics"]
    assert not partial[0].exists()  # the stale temporary was cleaned up


@pytest.mark.parametrize("step,where", [
    (3, "before_step"), (3, "in_step"),
    pytest.param(0, "in_step", marks=pytest.mark.slow),
    pytest.param(6, "in_checkpoint", marks=pytest.mark.slow)])
def test_kill_once_then_rerun_is_exact(tmp_path, images, straight_cli, step, where):
    # (0, in_step): killed before any checkpoint exists; the rerun starts over in the same
    # run directory. (6, in_checkpoint): killed while writing the final checkpoint.
    _kill_then_finish(tmp_path, images, straight_cli, [{"step": step, "where": where}])


@pytest.mark.slow
def test_several_kills_in_one_run_is_exact(tmp_path, images, straight_cli):
    # before step 1 (no checkpoint yet) -> in the checkpoint of step 2 (still none good)
    # -> inside step 5 (checkpoint 4 good) -> to the end.
    logs = _kill_then_finish(tmp_path, images, straight_cli, [
        {"step": 1, "where": "before_step"}, {"step": 2, "where": "in_checkpoint"},
        {"step": 5, "where": "in_step"}])
    assert "resumed from" not in logs[1] and "resumed from" not in logs[2]
    assert "step_00000004 at step 4" in logs[3]


@pytest.mark.slow
def test_kill_with_workers_resume_without_them_is_exact(tmp_path, images, straight_cli):
    # data.num_workers is resume-safe: the batches do not depend on it (per-sample seeded
    # augmentation, loader generator of its own).
    _kill_then_finish(tmp_path, images, straight_cli, [{"step": 3, "where": "in_step"}],
                      extra_after=["data.num_workers=0"])


# --------------------------------------------------------------------------- known traps


def _without_optimizer(c):
    c.optimizer = {"state": {}, "param_groups": c.optimizer["param_groups"]}


def _without_data_position(c):
    c.state["batches_consumed"] = 0


def _without_ema_state(c):
    c.state["ema"] = {**c.state["ema"], "num_updates": 0}


@pytest.mark.parametrize("piece", ["nothing", "rng", "optimizer", "data_position", "ema_state"])
def test_leaving_out_one_piece_changes_the_resumed_run(tmp_path, monkeypatch, images,
                                                       straight_inproc, piece):
    """Resume at step 2 with one piece of the checkpoint dropped: the result differs from
    the straight run, so that piece matters (and "nothing" proves the harness is exact)."""
    run = tmp_path / "run"
    shutil.copytree(straight_inproc["run"], run)
    for c in ckpt.list_checkpoints(run / "checkpoints"):
        if c.name != "step_00000002":
            shutil.rmtree(c)
    (run / "checkpoints" / "latest").write_text("step_00000002\n")
    if piece == "rng":  # dropout then redraws the masks the straight run drew at step 0-1
        monkeypatch.setattr(ckpt, "restore_rng", lambda state: None)
    elif piece != "nothing":
        edit = {"optimizer": _without_optimizer, "data_position": _without_data_position,
                "ema_state": _without_ema_state}[piece]
        real = ckpt.load_checkpoint

        def load(*a, **k):
            c = real(*a, **k)
            edit(c)
            return c

        monkeypatch.setattr(ckpt, "load_checkpoint", load)
    res = steadydiff.train(_cfg(images), out_dir=run)
    assert res.resumed_from.name == "step_00000002"
    same = _same_tensors(_tensors(run), straight_inproc["tensors"])
    assert same == (piece == "nothing"), f"leaving out {piece}: same={same}"


# --------------------------------------------------------------------------- storage


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupt_newest_checkpoint_falls_back_and_says_so(tmp_path, images, straight_inproc,
                                                         caplog, capsys, damage):
    run = tmp_path / "run"
    shutil.copytree(straight_inproc["run"], run)
    newest = run / "checkpoints" / FINAL
    target = newest / "optimizer.pt"
    data = bytearray(target.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
    else:
        data = data[: len(data) // 2]
    target.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        res = steadydiff.train(_cfg(images), out_dir=run)  # rerun the same command
    out = capsys.readouterr().out
    warned = caplog.text
    assert "skipping corrupt checkpoint" in warned and FINAL in warned
    assert ("sha256 does not match" if damage == "flip" else "truncated") in warned
    assert res.resumed_from.name == "step_00000004"
    assert "resumed from" in out and "step_00000004 at step 4" in out
    # the corrupt step 6 was replaced by a good one, equal to the straight run's
    assert _state_hashes(run) == straight_inproc["hashes"]


def test_every_corrupt_checkpoint_is_an_error_not_a_silent_restart(tmp_path, images,
                                                                   straight_inproc):
    # All checkpoints damaged: resume=True must not silently start over... it finds none
    # good, so it starts fresh; --resume PATH names the checkpoint and refuses it.
    run = tmp_path / "run"
    shutil.copytree(straight_inproc["run"], run)
    for c in ckpt.list_checkpoints(run / "checkpoints"):
        (c / "model.safetensors").write_bytes(b"\0" * 16)
    with pytest.raises(ckpt.CheckpointError, match="failed verification"):
        steadydiff.train(_cfg(images), out_dir=tmp_path / "other",
                         resume=run / "checkpoints" / FINAL)
    assert main(["train", str(_write_cfg(tmp_path / "c.yaml", images)), "--out",
                 str(tmp_path / "x"), "--resume", str(run)]) == 2


def test_rotation_never_leaves_zero_good_checkpoints(tmp_path, monkeypatch, images):
    """keep_checkpoints=1, a checkpoint every step: after every save exactly one good
    checkpoint exists, and it is the newest."""
    seen = []
    real = ckpt.save_checkpoint

    def save(root, step, **kw):
        path = real(root, step, **kw)
        good = [c for c in ckpt.list_checkpoints(root) if not ckpt.verify_checkpoint(c)]
        seen.append([c.name for c in good])
        assert ckpt.latest_good(root) == path
        return path

    monkeypatch.setattr(ckpt, "save_checkpoint", save)
    steadydiff.train(_cfg(images, "train.keep_checkpoints=1", "train.checkpoint_every=1",
                          "train.steps=3"), out_dir=tmp_path / "run")
    assert seen == [[ckpt.checkpoint_name(s)] for s in (1, 2, 3)]


def _fail_save(monkeypatch, kind: str, step: int = 4) -> list:
    """Make the checkpoint of ``step`` fail once: disk full while writing the weights
    (save_file raises ENOSPC), or permission denied at the final rename (EACCES)."""
    fired = []
    tag = ckpt.checkpoint_name(step)
    if kind == "ENOSPC":
        real = ckpt.save_file

        def fake(tensors, filename, *a, **k):
            if f".tmp-{tag}" in str(filename) and not fired:
                fired.append(filename)
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(filename))
            return real(tensors, filename, *a, **k)

        monkeypatch.setattr(ckpt, "save_file", fake)
    else:
        real = os.replace

        def fake(src, dst, *a, **k):
            if Path(dst).name == tag and not fired:
                fired.append(dst)
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(dst))
            return real(src, dst, *a, **k)

        monkeypatch.setattr(os, "replace", fake)
    return fired


def _assert_previous_intact(run: Path, previous: str = "step_00000002") -> None:
    root = run / "checkpoints"
    assert ckpt.verify_checkpoint(root / previous) == []
    ckpt.load_checkpoint(root / previous)  # loadable, finite
    assert not (root / "step_00000004").exists()
    assert not [p.name for p in root.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("kind", ["ENOSPC", "EACCES"])
def test_save_error_retry_keeps_training(tmp_path, monkeypatch, caplog, capsys, images,
                                         straight_inproc, kind):
    fired = _fail_save(monkeypatch, kind)
    run = tmp_path / "run"
    with caplog.at_level(logging.WARNING):
        res = steadydiff.train(_cfg(images, "train.on_save_error=retry"), out_dir=run)
    assert fired and res.steps == STEPS
    said = caplog.text + "".join(capsys.readouterr())
    assert os.strerror(errno.ENOSPC if kind == "ENOSPC" else errno.EACCES) in said
    _assert_previous_intact(run)
    assert ckpt.latest_good(run / "checkpoints").name == FINAL  # the next save succeeded
    assert _same_tensors(_tensors(run), straight_inproc["tensors"])  # training unaffected


@pytest.mark.parametrize("kind", ["ENOSPC", "EACCES"])
def test_save_error_stop_exits_4(tmp_path, monkeypatch, capsys, images, kind):
    fired = _fail_save(monkeypatch, kind)
    cfg = _write_cfg(tmp_path / "c.yaml", images, ["train.on_save_error=stop"])
    run = tmp_path / "run"
    assert main(["train", str(cfg), "--out", str(run)]) == 4
    assert fired
    err = capsys.readouterr().err
    assert "could not write checkpoint" in err
    _assert_previous_intact(run)
    assert ckpt.latest_good(run / "checkpoints").name == "step_00000002"


# --------------------------------------------------------------------------- safe loading


class _Payload:
    """Unpickling this creates ``marker``: proof that code ran on load."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.fixture(scope="module")
def finished(tmp_path_factory, images) -> Path:
    """A finished 2-step run with one checkpoint, to be copied and doctored."""
    d = tmp_path_factory.mktemp("finished")
    steadydiff.train(_cfg(images, "train.steps=2"), out_dir=d / "run")
    return d / "run"


def _evil_copy(tmp_path: Path, finished: Path, file: str) -> tuple[Path, Path, Path]:
    """A copy of ``finished`` whose ``file`` (optimizer.pt or rng.pt) carries a payload,
    with the manifest doctored to match. Returns (run, checkpoint, marker)."""
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    c = run / "checkpoints" / "step_00000002"
    marker = tmp_path / "PAYLOAD_RAN"
    obj = torch.load(c / file, weights_only=True)
    if isinstance(obj, dict):
        obj["x"] = _Payload(marker)
    torch.save(obj, c / file)
    _doctor_manifest(c, file)
    # the payload is real: an unsafe load runs it
    torch.load(c / file, weights_only=False)
    assert marker.exists()
    marker.unlink()
    return run, c, marker


@pytest.mark.parametrize("file", ["optimizer.pt", "rng.pt"])
def test_pickle_payload_is_refused_and_never_runs(tmp_path, images, finished, file):
    run, c, marker = _evil_copy(tmp_path, finished, file)
    with pytest.raises(ckpt.CheckpointError, match="cannot be loaded safely"):
        ckpt.load_checkpoint(c)
    assert not marker.exists()
    with pytest.raises(ckpt.CheckpointError, match="(?s)cannot be loaded safely.*Unsupported "
                       "global: GLOBAL io.open"):
        steadydiff.train(_cfg(images, "train.steps=4"), out_dir=run)  # resume refuses
    assert not marker.exists()
    # load() (for sampling) reads only the safetensors weights and JSON; it never opens
    # optimizer.pt / rng.pt, so the payload has nothing to run from.
    pipe = steadydiff.load(run, device="cpu")
    assert pipe.step == 2 and not marker.exists()


def test_pickle_refusal_names_the_file_and_gives_no_unsafe_advice(tmp_path, finished):
    _, c, _ = _evil_copy(tmp_path, finished, "rng.pt")
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.load_checkpoint(c)
    assert "rng.pt" in str(e.value) and "weights_only` set to `False`" not in str(e.value)


def test_force_no_weights_only_env_does_not_run_the_payload(tmp_path, images, finished):
    # An explicit weights_only=True survives TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1; the default
    # would not. Checked in a subprocess, where the variable is set before torch starts.
    run, _, marker = _evil_copy(tmp_path, finished, "optimizer.pt")
    cfg = _write_cfg(tmp_path / "c.yaml", images, ["train.steps=4"])
    rc, log = _run_cli(cfg, run, tmp_path / "log.txt",
                       env={"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"})
    assert rc == 2, log[-2000:]
    assert "cannot be loaded safely" in log
    assert not marker.exists()


def _doctor_state(c: Path, edit) -> None:
    st = json.loads((c / "state.json").read_text())
    edit(st)
    (c / "state.json").write_text(json.dumps(st))
    _doctor_manifest(c, "state.json")


@pytest.mark.parametrize("doctored,needle", [
    (lambda st: st["config"]["train"].update(stepz=5), "stepz"),
    (lambda st: st["config"]["optim"].update(lr="fast"), "optim.lr"),
], ids=["unknown_key", "wrong_type"])
def test_doctored_state_json_is_refused_by_load(tmp_path, finished, doctored, needle):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    _doctor_state(run / "checkpoints" / "step_00000002", doctored)
    with pytest.raises(ConfigError, match=needle):
        steadydiff.load(run, device="cpu")


@pytest.mark.parametrize("doctored,needle", [
    (lambda st: st["config"]["train"].update(stepz=5), "stepz"),
    (lambda st: st["config"]["optim"].update(lr="fast"), "optim.lr"),
], ids=["unknown_key", "wrong_type"])
def test_doctored_state_json_is_refused_by_resume_cli(tmp_path, capsys, images, finished,
                                                      doctored, needle):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    _doctor_state(run / "checkpoints" / "step_00000002", doctored)
    cfg = _write_cfg(tmp_path / "c.yaml", images, ["train.steps=4"])
    assert main(["train", str(cfg), "--out", str(run)]) == 2
    assert needle in capsys.readouterr().err


def test_doctored_state_json_resume_error_is_a_config_error(tmp_path, images, finished):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    _doctor_state(run / "checkpoints" / "step_00000002",
                  lambda st: st["config"]["train"].update(stepz=5))
    with pytest.raises((ConfigError, ckpt.CheckpointError), match="state.json"):
        steadydiff.train(_cfg(images, "train.steps=4"), out_dir=run)


@pytest.mark.parametrize("file", ["model.safetensors", "ema.safetensors"])
def test_nan_weights_are_refused(tmp_path, images, finished, file):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    c = run / "checkpoints" / "step_00000002"
    sd = load_file(str(c / file))
    k = next(k for k, v in sd.items() if v.is_floating_point() and v.numel() > 1)
    sd[k].view(-1)[0] = float("nan")
    save_file(sd, str(c / file))
    _doctor_manifest(c, file)
    with pytest.raises(ckpt.CheckpointError, match="non-finite weights"):
        steadydiff.load(run, device="cpu")
    with pytest.raises(ckpt.CheckpointError, match="non-finite weights"):
        steadydiff.train(_cfg(images, "train.steps=4"), out_dir=run)


# --------------------------------------------------------------------------- bad images


def _bad_image_folder(tmp_path: Path, monkeypatch) -> Path:
    """6 good images, a truncated JPEG, a garbage .png, a decompression bomb, a text file and
    a symlink leading outside the root; Pillow's pixel limit lowered for the bomb."""
    root = _make_images(tmp_path / "imgs", n=6)
    # A noisy JPEG cut at 60% keeps its headers (the header check passes) but loses scan
    # data: it fails at load time, mid-run, and is replaced by the next good image.
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(1).integers(0, 256, (96, 96, 3), dtype=np.uint8),
                    "RGB").save(buf, "JPEG", quality=95)
    (root / "truncated.jpg").write_bytes(buf.getvalue()[: len(buf.getvalue()) * 6 // 10])
    (root / "garbage.png").write_bytes(b"this is not a PNG at all" * 10)
    Image.new("L", (160, 160)).save(root / "bomb.png")  # 25600 px > 2 x MAX_IMAGE_PIXELS
    (root / "notes.txt").write_text("not an image; ignored, not counted")
    outside = _make_images(tmp_path / "outside", n=1, seed=5) / "img_00.png"
    (root / "link.png").symlink_to(outside)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 10_000)  # the JPEG has 9216
    return root


def test_bad_images_are_skipped_counted_and_the_run_finishes(tmp_path, monkeypatch, caplog):
    root = _bad_image_folder(tmp_path, monkeypatch)
    built = []
    real_build = preflight.build_dataset  # the trainer's setup builds the data there
    monkeypatch.setattr(preflight, "build_dataset",
                        lambda c: built.append(real_build(c)) or built[-1])
    with caplog.at_level(logging.WARNING):
        res = steadydiff.train(validate(apply_overrides({}, [
            *TINY, f"data.path={root}", "train.steps=4", "train.checkpoint_every=0"])),
            out_dir=tmp_path / "run")
    assert res.steps == 4 and np.isfinite(res.final_loss)
    ds = built[0]
    assert len(ds) == 7  # 6 good + the truncated JPEG, whose header looks fine
    bad = {Path(p).name: why for p, why in ds.bad_paths.items()}
    assert set(bad) == {"garbage.png", "bomb.png", "truncated.jpg"}, bad
    assert "decompression bomb" in bad["bomb.png"]
    assert "at load time" in bad["truncated.jpg"]
    assert ds.skipped == 4 and ds.skipped_symlinks == 1  # + the link leading outside
    for name in bad:
        assert name in caplog.text
    rows = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["data_skipped"] == 4  # visible in the run's metrics


def test_bad_images_counted_with_workers(tmp_path, monkeypatch):
    root = _bad_image_folder(tmp_path, monkeypatch)
    res = steadydiff.train(validate(apply_overrides({}, [
        *TINY, f"data.path={root}", "train.steps=4", "train.checkpoint_every=0",
        "data.num_workers=2"])), out_dir=tmp_path / "run")
    assert res.steps == 4
    rows = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["data_skipped"] == 4


def test_empty_or_unreadable_folder_is_exit_2(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    cfg = _write_cfg(tmp_path / "c.yaml", tmp_path / "empty")
    assert main(["train", str(cfg), "--out", str(tmp_path / "r1")]) == 2
    assert "contains no images" in capsys.readouterr().err
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "a.png").write_bytes(b"junk")
    cfg = _write_cfg(tmp_path / "c.yaml", tmp_path / "bad")
    assert main(["train", str(cfg), "--out", str(tmp_path / "r2")]) == 2
    assert "all 1 images are unreadable" in capsys.readouterr().err
    assert not (tmp_path / "r1" / "checkpoints").exists()


# --------------------------------------------------------------------------- bad configs


@pytest.mark.parametrize("overrides,needle", [
    (["train.stepz=5"], "did you mean 'train.steps'"),
    (["optim.lr=-1"], "optim.lr: Input should be greater than 0"),
    (["data.image_size=9"], "image_size 9 is not divisible by 2 = 2**1 down-samplings"),
    (["model.kind=dit", "model.dit.patch_size=3"], "image_size 8 is not divisible by "
                                                   "patch_size 3"),
    (["model.unet.norm_groups=3"], "8 channels are not divisible by norm_groups=3"),
    (["model.num_classes=10"], "model.num_classes=10 (class-conditional) but the data has no "
                               "labels"),
], ids=["near_miss_key", "out_of_range", "unet_downsampling", "dit_patch", "groupnorm",
        "conditional_unlabeled"])
def test_bad_config_is_exit_2_with_the_reason(tmp_path, capsys, images, overrides, needle):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(apply_overrides({}, [*TINY, f"data.path={images}",
                                                       *overrides])))
    assert main(["train", str(cfg), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and needle in err, err
    assert not (tmp_path / "run" / "checkpoints").exists()
