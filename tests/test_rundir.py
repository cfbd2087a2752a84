"""Run-directory safety (docs/RELIABILITY.md, "Run-directory safety"): nothing of the user's
or of an earlier run is lost, and nothing misleading is used without comment.

Real files and real subprocesses (``python -m steadydiff.cli``), no mocks: a folder that is
not a run, ``--out`` naming a file, every checkpoint corrupt, ``--restart``, a checkpoint
linked from outside the run or named for another step, two processes training into one
run, a killed process's lock, ``steadydiff report`` on a folder that is not a run.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import steadydiff
from steadydiff.rundir import RunDir, RunDirError
from steadydiff.trainer import checkpoint as ckpt
from test_reliability import FINAL, _cfg, _make_images, _write_cfg

PY = sys.executable


def _cli(*args: str, cwd: Path, timeout: float = 120) -> tuple[int, str]:
    """``python -m steadydiff.cli ARGS`` in a subprocess; (exit status, stdout+stderr)."""
    r = subprocess.run([PY, "-m", "steadydiff.cli", *args], capture_output=True, text=True,
                       cwd=cwd, timeout=timeout,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    return r.returncode, r.stdout + r.stderr


def _tree(root: Path) -> dict[str, str]:
    """Every file under ``root`` (relative path -> sha256): to show nothing changed."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    return _make_images(tmp_path_factory.mktemp("data") / "images")


@pytest.fixture(scope="module")
def finished(tmp_path_factory, images) -> Path:
    """A finished 6-step run with checkpoints at steps 2, 4 and 6."""
    run = tmp_path_factory.mktemp("finished") / "run"
    steadydiff.train(_cfg(images), out_dir=run)
    assert [c.name for c in ckpt.list_checkpoints(run / "checkpoints")] == [
        "step_00000006", "step_00000004", "step_00000002"]
    return run


@pytest.fixture
def cfg_file(tmp_path, images) -> Path:
    return _write_cfg(tmp_path / "tiny.yaml", images)


# --------------------------------------------------------------------------- 1. --out


def test_train_refuses_a_non_empty_folder_that_is_not_a_run(tmp_path, cfg_file, images):
    theirs = tmp_path / "mine"
    theirs.mkdir()
    (theirs / "config.yaml").write_text("my: own config\n")  # a name users use too
    (theirs / "notes.txt").write_text("thesis draft\n")
    (theirs / "report.html").write_text("<p>my report</p>")
    before = _tree(theirs)
    rc, out = _cli("train", str(cfg_file), "--out", str(theirs), cwd=tmp_path)
    assert rc == 2, out
    assert "not empty and is not a steadydiff run" in out
    assert "config.yaml" in out and "notes.txt" in out and "new or empty --out" in out
    assert "Traceback" not in out
    assert _tree(theirs) == before  # nothing written, nothing overwritten
    with pytest.raises(RunDirError, match="not a steadydiff run"):
        steadydiff.train(_cfg(images), out_dir=theirs)
    assert _tree(theirs) == before


def test_out_naming_a_file_is_exit_2_not_a_traceback(tmp_path, cfg_file):
    f = tmp_path / "run.txt"
    f.write_text("keep me\n")
    rc, out = _cli("train", str(cfg_file), "--out", str(f), cwd=tmp_path)
    assert rc == 2, out
    assert "is a file, not a directory" in out and "Traceback" not in out
    assert f.read_text() == "keep me\n"


def test_train_into_an_empty_folder_is_fine(tmp_path, images):
    (tmp_path / "empty").mkdir()
    res = steadydiff.train(_cfg(images, "train.steps=2"), out_dir=tmp_path / "empty")
    assert res.steps == 2 and RunDir(tmp_path / "empty").is_run()


def test_a_log_opened_before_the_run_is_left_alone(tmp_path, images):
    """`steadydiff train ... --out RUN > RUN/train.log` (or SLURM's --output into the run
    folder): the shell creates the log first; it is no file steadydiff writes, so the run
    starts and the log is kept."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "train.log").write_text("started\n")
    res = steadydiff.train(_cfg(images, "train.steps=2"), out_dir=run)
    assert res.steps == 2 and (run / "train.log").read_text() == "started\n"


# --------------------------------------------------------------------------- 2. corrupt


def _damage(c: Path) -> None:
    data = bytearray((c / "optimizer.pt").read_bytes())
    data[len(data) // 2] ^= 0x01
    (c / "optimizer.pt").write_bytes(bytes(data))


def test_every_checkpoint_corrupt_refuses_lists_why_and_changes_nothing(tmp_path, finished,
                                                                        cfg_file):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    for c in ckpt.list_checkpoints(run / "checkpoints"):
        _damage(c)
    (run / "checkpoints" / "step_00000002" / "manifest.json").unlink()
    before = _tree(run)
    rc, out = _cli("train", str(cfg_file), "--out", str(run), cwd=tmp_path)
    assert rc == 2, out[-3000:]
    assert "every checkpoint failed verification" in out
    for name in ("step_00000006", "step_00000004"):
        assert f"{name}: " in out and "sha256 does not match" in out
    assert "step_00000002: " in out and "no manifest.json" in out
    assert "--restart" in out and "--resume PATH" in out
    assert _tree(run) == before  # no restart at step 0, no checkpoint or log overwritten
    assert not (run / "checkpoints" / "corrupt").exists()


def test_corrupt_checkpoint_is_moved_aside_even_when_an_older_one_is_used(tmp_path, finished,
                                                                          images, capsys):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    _damage(run / "checkpoints" / FINAL)
    damaged = _tree(run / "checkpoints" / FINAL)
    # keep_checkpoints=1: rotation runs at every save and must not touch corrupt/
    res = steadydiff.train(_cfg(images, "train.keep_checkpoints=1"), out_dir=run)
    out = capsys.readouterr().out
    assert res.resumed_from.name == "step_00000004" and res.steps == 6
    aside = run / "checkpoints" / "corrupt" / FINAL
    assert f"moved it to {aside}" in out
    assert _tree(aside) == damaged  # kept byte for byte
    assert "sha256 does not match" in (aside.parent / f"{FINAL}.why.txt").read_text()
    assert ckpt.verify_checkpoint(run / "checkpoints" / FINAL) == []  # the new step 6
    # the same step corrupt again (an older good one put back): a second name, the first kept
    shutil.copytree(finished / "checkpoints" / "step_00000004",
                    run / "checkpoints" / "step_00000004")
    _damage(run / "checkpoints" / FINAL)
    steadydiff.train(_cfg(images, "train.keep_checkpoints=1"), out_dir=run)
    assert _tree(aside) == damaged and (aside.parent / f"{FINAL}-1").is_dir()


def test_corrupt_checkpoint_newer_than_a_stale_latest_pointer_is_moved_aside(tmp_path,
                                                                            finished, images):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    (run / "checkpoints" / "latest").write_text("step_00000004\n")  # killed before the pointer
    _damage(run / "checkpoints" / FINAL)
    damaged = _tree(run / "checkpoints" / FINAL)
    res = steadydiff.train(_cfg(images), out_dir=run)
    assert res.resumed_from.name == "step_00000004"
    assert _tree(run / "checkpoints" / "corrupt" / FINAL) == damaged  # not overwritten
    assert ckpt.verify_checkpoint(run / "checkpoints" / FINAL) == []


def test_restart_starts_over_and_keeps_the_old_run(tmp_path, finished, cfg_file):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    for c in ckpt.list_checkpoints(run / "checkpoints"):
        _damage(c)
    before = {k: v for k, v in _tree(run).items() if k != "run.lock"}  # the lock stays
    rc, out = _cli("train", str(cfg_file), "--out", str(run), "--restart", cwd=tmp_path)
    assert rc == 0, out[-3000:]
    prev = [p for p in run.iterdir() if p.name.startswith("previous-")]
    assert len(prev) == 1 and f"moved to {prev[0]}" in out
    assert _tree(prev[0]) == before  # every old file kept, unchanged
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]  # from step 0
    assert ckpt.verify_checkpoint(run / "checkpoints" / FINAL) == []
    rc, out = _cli("train", str(cfg_file), "--out", str(run), "--restart", "--resume",
                   str(run), cwd=tmp_path)
    assert rc == 2 and "choose one" in out


# --------------------------------------------------------------------------- 4. links, names


def test_checkpoint_linked_from_outside_the_run_is_refused(tmp_path, finished, cfg_file,
                                                           images):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    elsewhere = tmp_path / "elsewhere" / FINAL
    elsewhere.parent.mkdir()
    os.replace(run / "checkpoints" / FINAL, elsewhere)
    link = run / "checkpoints" / FINAL
    link.symlink_to(elsewhere, target_is_directory=True)
    rc, out = _cli("train", str(cfg_file), "--out", str(run), cwd=tmp_path)
    assert rc == 2, out[-3000:]
    assert f"{link} is a symlink to {elsewhere}, outside the run" in out
    assert f"--resume {elsewhere}" in out
    assert link.is_symlink() and ckpt.verify_checkpoint(elsewhere) == []
    # asked for by name, it is used
    res = steadydiff.train(_cfg(images), out_dir=run, resume=elsewhere)
    assert res.resumed_from == elsewhere and res.steps == 6


def test_checkpoint_whose_name_and_recorded_step_disagree_is_refused(tmp_path, finished,
                                                                     images, capsys):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    renamed = run / "checkpoints" / "step_00000009"
    os.replace(run / "checkpoints" / "step_00000004", renamed)
    problems = ckpt.verify_checkpoint(renamed)
    assert problems and "named step 9 but its manifest.json records step 4" in problems[0]
    # a link inside the run, named for another step
    inside = run / "checkpoints" / "step_00000008"
    inside.symlink_to("step_00000002", target_is_directory=True)
    assert "named step 8" in ckpt.verify_checkpoint(inside)[0]
    with pytest.raises(ckpt.CheckpointError, match="named step 9"):
        ckpt.load_checkpoint(renamed)
    (run / "checkpoints" / "latest").write_text("step_00000009\n")
    res = steadydiff.train(_cfg(images), out_dir=run)
    assert res.resumed_from.name == FINAL
    out = capsys.readouterr().out
    corrupt = run / "checkpoints" / "corrupt"
    assert (corrupt / "step_00000009").is_dir() and (corrupt / "step_00000008").is_symlink()
    assert "step_00000009 failed verification" in out


# --------------------------------------------------------------------------- 5. the lock


def _wait_for(cond, timeout: float = 90.0, what: str = "") -> None:
    t = time.monotonic()
    while not cond():
        if time.monotonic() - t > timeout:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def _lock_info(run: Path) -> dict:
    try:
        return json.loads((run / "run.lock").read_text() or "{}")
    except (OSError, ValueError):
        return {}


def test_two_processes_cannot_train_into_one_run(tmp_path, images):
    cfg = _write_cfg(tmp_path / "long.yaml", images, ["train.steps=100000"])
    run = tmp_path / "run"
    log = open(tmp_path / "a.log", "w")
    a = subprocess.Popen([PY, "-m", "steadydiff.cli", "train", str(cfg), "--out", str(run)],
                         stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        _wait_for(lambda: _lock_info(run).get("pid") == a.pid
                  and (run / "checkpoints" / "latest").exists(), what="the first run")
        rc, out = _cli("train", str(cfg), "--out", str(run), cwd=tmp_path)
        assert rc == 2, out[-3000:]
        assert f"being trained into by another process (pid {a.pid} on host " in out
        assert "started " in out and "another --out" in out
        assert a.poll() is None  # the first run goes on, and still holds the lock
        assert _lock_info(run).get("pid") == a.pid
    finally:
        a.send_signal(signal.SIGKILL)
        a.wait()
        log.close()
    # the killed run's lock is stale: the next run takes it over and says so
    assert _lock_info(run).get("pid") == a.pid
    rc, out = _cli("train", str(cfg), "--out", str(run), "--set", "train.steps=2",
                   cwd=tmp_path)
    assert rc == 0, out[-3000:]
    assert f"took over the lock of a process that is no longer running (pid {a.pid}" in out
    assert (run / "run.lock").read_text() == ""  # released at the end


def test_lock_is_released_when_a_run_fails(tmp_path, finished, images):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    for c in ckpt.list_checkpoints(run / "checkpoints"):
        _damage(c)
    with pytest.raises(RunDirError, match="every checkpoint failed"):
        steadydiff.train(_cfg(images), out_dir=run)
    # free again for another process, and not mistaken for a dead holder's
    r = subprocess.run([PY, "-c", "import sys; from steadydiff.rundir import RunDir; "
                        "lock, note = RunDir(sys.argv[1]).lock(); print(note)", str(run)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "None", r.stdout + r.stderr


def test_under_torchrun_a_refused_lock_stops_every_rank_with_the_same_error(tmp_path):
    from test_distributed import launch  # torchrun with 2 CPU processes (gloo)

    run = tmp_path / "run"
    lock, _ = RunDir(run).lock()  # this test process trains there, as far as ranks can see
    try:
        rc, log = launch(run, timeout=120)
    finally:
        lock.release()
    # torchrun exits 1 when a worker fails; rank 0's own status is 2. Rank 0 found the lock
    # taken and broadcast the refusal: both ranks print it, neither hangs or trains
    assert rc != 0 and "exitcode  : 2" in log, log[-3000:]
    assert log.count(f"being trained into by another process (pid {os.getpid()}") == 2, log
    assert not (run / "checkpoints").exists() and not (run / "config.yaml").exists()


# --------------------------------------------------------------------------- 9. report


@pytest.mark.parametrize("content", [[], ["notes.txt", "config.yaml"]])
def test_report_on_a_folder_that_is_not_a_run_is_exit_2_and_writes_nothing(tmp_path,
                                                                           content):
    d = tmp_path / "folder"
    d.mkdir()
    for name in content:
        (d / name).write_text("mine\n")
    before = _tree(d)
    rc, out = _cli("report", str(d), cwd=tmp_path)
    assert rc == 2, out
    assert "not a steadydiff run directory" in out and "Traceback" not in out
    assert _tree(d) == before and sorted(p.name for p in d.iterdir()) == sorted(content)
