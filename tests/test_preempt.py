"""Preemption signals (issue 14), measured on the real trainer: real signals sent to real
``python -m steadydiff.cli train`` subprocesses (and to one rank of a real torchrun group).

SIGTERM (SLURM, Kubernetes, spot preemption), SIGINT (Ctrl-C) and SIGUSR1 (requeue scripts)
each make the run finish its step, write a verified checkpoint, ``summary.json`` with
``status: interrupted`` and exit 6; the same command again must end bit for bit where a run
that was never interrupted ends (the SIGKILL tests' standard, tests/test_reliability.py, with
its shared config: grad accumulation, loader workers, flips, dropout). A ``hang`` fault
(docs/faults.md) holds the run at a known point, so the signal lands where the test means it
to: before a step, or in the middle of writing a checkpoint.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest
import torch

from steadydiff.doctor import diagnose
from steadydiff.trainer import checkpoint as ckpt
from steadydiff.trainer.preempt import EXIT_INTERRUPTED, SAME_EVENT_S
from test_distributed import BASE as DDP_BASE, CONFIG as DDP_CONFIG, WORKER, _env, ranks, same
from test_reliability import (CLI, _assert_no_half_checkpoint, _make_images, _metrics,
                              _state_hashes, _write_cfg)


# --------------------------------------------------------------------------- helpers


def _start(cfg: Path, out: Path, log: Path) -> subprocess.Popen:
    """``steadydiff train cfg --out out`` in the background; output to a file (see
    test_reliability._run_cli)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log, "w") as f:
        return subprocess.Popen([sys.executable, "-m", "steadydiff.cli", "train", str(cfg),
                                 "--out", str(out)], stdout=f, stderr=subprocess.STDOUT,
                                env=env, cwd=out.parent)


def _wait_for(what: Callable[[], bool], proc: subprocess.Popen, timeout: float = 120) -> None:
    t0 = time.monotonic()
    while not what():
        assert proc.poll() is None, f"the run ended (rc={proc.returncode}) before the signal"
        assert time.monotonic() - t0 < timeout, "timed out waiting for the run"
        time.sleep(0.02)


def _has(path: Path) -> Callable[[], bool]:
    return path.exists


def _writing(run: Path, step: int) -> Callable[[], bool]:
    """True while checkpoint ``step`` is being written (its temporary directory exists)."""
    return lambda: (run / "checkpoints").is_dir() and any(
        p.name.startswith(f".tmp-{ckpt.checkpoint_name(step)}")
        for p in (run / "checkpoints").iterdir())


def _summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


def _rerun_is_exact(tmp_path: Path, images: Path, run: Path, straight: dict,
                    resumed_at: int) -> None:
    """The same command, the fault removed: ends where the straight run ended."""
    cfg = _write_cfg(tmp_path / "tiny.yaml", images, CLI)
    proc = _start(cfg, run, tmp_path / "log_rerun.txt")
    rc = proc.wait(timeout=180)
    log = (tmp_path / "log_rerun.txt").read_text()
    assert rc == 0, log[-3000:]
    assert f"{ckpt.checkpoint_name(resumed_at)} at step {resumed_at}" in log, log[-3000:]
    assert _state_hashes(run) == straight["hashes"]
    assert _metrics(run) == straight["metrics"]  # the loss history is exact too
    assert _summary(run)["status"] == "finished"


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    return _make_images(tmp_path_factory.mktemp("data") / "images")


@pytest.fixture(scope="module")
def straight(tmp_path_factory, images) -> dict:
    """The run that was never interrupted (test_reliability's straight_cli)."""
    d = tmp_path_factory.mktemp("straight")
    cfg = _write_cfg(d / "tiny.yaml", images, CLI)
    proc = _start(cfg, d / "run", d / "log.txt")
    assert proc.wait(timeout=180) == 0, (d / "log.txt").read_text()
    return {"hashes": _state_hashes(d / "run"), "metrics": _metrics(d / "run")}


# --------------------------------------------------------------------------- one process


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGUSR1],
                         ids=lambda s: s.name)
def test_signal_checkpoints_the_step_then_rerun_is_exact(tmp_path, images, straight, sig):
    # The run holds before step 2 (checkpoint 2 written); the signal lands there. Step 2
    # finishes, then the run stops at step 3, off the checkpoint interval: a checkpoint of
    # step 3 is written because of the signal.
    cfg, run, logf = tmp_path / "tiny.yaml", tmp_path / "run", tmp_path / "log.txt"
    _write_cfg(cfg, images, CLI, faults=[{"kind": "hang", "step": 2, "where": "before_step",
                                          "factor": 2}])
    proc = _start(cfg, run, logf)
    _wait_for(_has(run / "checkpoints" / ckpt.checkpoint_name(2)), proc)
    proc.send_signal(sig)
    rc = proc.wait(timeout=120)
    log = logf.read_text()
    assert rc == EXIT_INTERRUPTED, log[-3000:]
    assert [p.name for p in ckpt.list_checkpoints(run / "checkpoints")] == ["step_00000003"]
    _assert_no_half_checkpoint(run)
    assert ckpt.latest_good(run / "checkpoints").name == "step_00000003"
    s = _summary(run)
    assert (s["status"], s["steps"], s["signal"]) == ("interrupted", 3, sig.name)
    assert f"Interrupted by {sig.name} at step 3 of 6 with a checkpoint" in \
        (run / "report.html").read_text()  # the report's verdict, not "killed"
    assert any(c.summary == f"interrupted by {sig.name} at step 3 of 6, with a checkpoint of "
               "that step" for c in diagnose(run, probe=False).causes)  # and the doctor's
    lines = log.splitlines()  # each message on a line of its own
    assert f"{sig.name} received: stopping after this step, with a checkpoint " \
           "(a second signal stops at once)" in lines
    assert f"interrupted by {sig.name} at step 3; checkpoint " \
           f"{run / 'checkpoints' / 'step_00000003'}" in lines
    i = lines.index("to resume, run the same command again:")
    assert lines[i + 1].split()[-4:] == ["train", str(cfg), "--out", str(run)]
    _rerun_is_exact(tmp_path, images, run, straight, resumed_at=3)


def test_a_second_signal_stops_at_once(tmp_path, images):
    # A long hang before step 2. The first SIGTERM asks for a stop after the step; one within
    # SAME_EVENT_S is the same request (torchrun forwards a Ctrl-C the workers already got);
    # a later one ends the process now, 128 + 15, leaving checkpoint 2 intact.
    cfg, run, logf = tmp_path / "tiny.yaml", tmp_path / "run", tmp_path / "log.txt"
    _write_cfg(cfg, images, CLI, faults=[{"kind": "hang", "step": 2, "where": "before_step",
                                          "factor": 60}])
    proc = _start(cfg, run, logf)
    _wait_for(_has(run / "checkpoints" / ckpt.checkpoint_name(2)), proc)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)  # the same event: ignored
    time.sleep(SAME_EVENT_S + 0.5)
    assert proc.poll() is None
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout=30)
    took = time.monotonic() - t0
    log = logf.read_text()
    assert rc == 128 + signal.SIGTERM, log[-3000:]
    assert took < 5, took  # not the 60 s the hang had left
    assert log.count("SIGTERM received again: stopping now") == 1
    assert log.count("SIGTERM received: stopping after this step") == 1
    _assert_no_half_checkpoint(run)
    assert ckpt.latest_good(run / "checkpoints").name == "step_00000002"
    assert not (run / "summary.json").exists()  # nothing claims the run ended well


def test_signal_while_writing_a_checkpoint_leaves_it_verified(tmp_path, images, straight):
    # The signal lands while checkpoint 4 is half written (model.safetensors in the
    # temporary directory, the writer held there for 2 s): the save completes first, then
    # the stop, after the step in progress (step 4 -> 5).
    cfg, run, logf = tmp_path / "tiny.yaml", tmp_path / "run", tmp_path / "log.txt"
    _write_cfg(cfg, images, CLI, faults=[{"kind": "hang", "step": 4, "where": "in_checkpoint",
                                          "factor": 2}])
    proc = _start(cfg, run, logf)
    _wait_for(_writing(run, 4), proc)
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout=120)
    log = logf.read_text()
    assert rc == EXIT_INTERRUPTED, log[-3000:]
    assert "could not write" not in log and "Traceback" not in log
    _assert_no_half_checkpoint(run)
    assert [p.name for p in ckpt.list_checkpoints(run / "checkpoints")] == ["step_00000005"]
    assert _summary(run)["steps"] == 5
    _rerun_is_exact(tmp_path, images, run, straight, resumed_at=5)


def test_handlers_are_restored_after_train(tmp_path, images):
    # steadydiff.train() in this process: the caller's own handlers are back afterwards.
    import steadydiff
    from test_reliability import _cfg

    mine = lambda *_: None  # noqa: E731
    sigint = signal.getsignal(signal.SIGINT)
    before = {s: signal.signal(s, mine) for s in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        steadydiff.train(_cfg(images, "train.steps=1", "logging.report=false"),
                         out_dir=tmp_path / "run")
        assert signal.getsignal(signal.SIGTERM) is mine
        assert signal.getsignal(signal.SIGUSR1) is mine
        assert signal.getsignal(signal.SIGINT) is sigint
    finally:
        for s, h in before.items():
            signal.signal(s, h)


def test_the_cli_documents_the_exit_code():
    from steadydiff import cli

    assert cli.EXIT_INTERRUPTED == EXIT_INTERRUPTED  # a copy: the CLI module avoids torch
    assert f"{EXIT_INTERRUPTED} interrupted by SIGTERM" in cli.__doc__.replace("\n", " ")
    assert f"{EXIT_INTERRUPTED} interrupted by SIGTERM/SIGINT/SIGUSR1" in cli._parser().epilog


# --------------------------------------------------------------------------- torchrun


def _rank_pids(torchrun: subprocess.Popen) -> dict[int, int]:
    """{rank: pid} of torchrun's worker processes (read from their environment)."""
    found = {}
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            if int((p / "stat").read_text().rsplit(")", 1)[1].split()[1]) != torchrun.pid:
                continue
            env = dict(kv.split("=", 1) for kv in (p / "environ").read_text().split("\0")
                       if "=" in kv)
        except (OSError, ValueError, IndexError):
            continue
        if "RANK" in env:
            found[int(env["RANK"])] = int(p.name)
    return found


@pytest.mark.parametrize("target", ["rank1", "torchrun"])
def test_signal_to_one_rank_stops_every_rank_at_the_same_step(tmp_path, target):
    # 2 gloo ranks held before step 2; SIGTERM reaches rank 1 only (rank1), or torchrun,
    # which forwards it to every worker (what SLURM and Kubernetes do). The per-step MAX
    # all-reduce of the stop request makes both ranks stop after step 2, at step 3; rank 0
    # writes the one checkpoint of step 3 and exits 6.
    hang = json.dumps([{"kind": "hang", "step": 2, "where": "before_step", "factor": 2}])
    out = tmp_path / "run"
    out.mkdir()
    logf = tmp_path / "log.txt"
    with open(logf, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             "--nproc_per_node=2", str(WORKER), str(DDP_CONFIG), str(out), *DDP_BASE,
             f"faults={hang}"], stdout=f, stderr=subprocess.STDOUT, env=_env())
    _wait_for(_has(out / "checkpoints" / ckpt.checkpoint_name(2)), proc, timeout=240)
    pids = _rank_pids(proc)
    assert sorted(pids) == [0, 1], pids
    os.kill(pids[1] if target == "rank1" else proc.pid, signal.SIGTERM)
    rc = proc.wait(timeout=240)
    log = logf.read_text()
    # torchrun reports the group failed (exit 1): the first worker to exit had status 6, and
    # torchrun then ends the others (SIGTERM), which by then have written everything
    assert rc != 0, log[-3000:]
    if target == "rank1":
        assert f"failed (exitcode: {EXIT_INTERRUPTED})" in log, log[-3000:]
        assert log.count("SIGTERM received: stopping") == 1
    else:  # the agent waits for its workers (30 s at most), then raises on the signal
        assert "SignalException" in log and log.count("SIGTERM received: stopping") == 2
    (r0, r1), (s0, s1) = ranks(out)
    assert s0["step"] == s1["step"] == 3
    assert same(r0, r1)
    names = sorted(p.name for p in ckpt.list_checkpoints(out / "checkpoints"))
    assert names == ["step_00000002", "step_00000003"]
    assert ckpt.verify_checkpoint(out / "checkpoints" / "step_00000003") == []
    s = json.loads((out / "summary.json").read_text())
    assert (s["status"], s["steps"], s["signal"]) == ("interrupted", 3, "SIGTERM")
    assert log.count("interrupted by SIGTERM at step 3") == 1  # rank 0 speaks for the group
    assert "rank 1: SIGTERM received: stopping after this step" in log
    assert "to resume, run the same torchrun command again" in log


# --------------------------------------------------------------------------- random signals


@pytest.mark.slow
def test_twenty_randomly_timed_signals_each_rerun_is_exact(tmp_path, images, straight):
    # 20 trials (seeded): a random signal, at a random point: a random time into the 1 s
    # hold before a random step, or in the middle of writing checkpoint 2 or 4. Each
    # interrupted run verifies, and its rerun ends bit for bit where the straight run ends.
    rng = random.Random(14)
    sigs = [signal.SIGTERM, signal.SIGINT, signal.SIGUSR1]
    seen = []
    for trial in range(20):
        d = tmp_path / f"t{trial:02d}"
        d.mkdir()
        cfg, run, logf = d / "tiny.yaml", d / "run", d / "log.txt"
        sig = rng.choice(sigs)
        if rng.random() < 0.35:
            step = rng.choice([2, 4])
            _write_cfg(cfg, images, CLI, faults=[{"kind": "hang", "step": step,
                                                  "where": "in_checkpoint", "factor": 1}])
            proc = _start(cfg, run, logf)
            _wait_for(_writing(run, step), proc)
            delay, where = 0.0, f"in_checkpoint {step}"
        else:
            # within the 1 s hang: a later signal may come after the run ended (exit 0, or
            # death by the signal once the handlers are restored)
            step, delay = rng.randint(1, 5), rng.uniform(0, 0.8)
            _write_cfg(cfg, images, CLI, faults=[{"kind": "hang", "step": step,
                                                  "where": "before_step", "factor": 1}])
            proc = _start(cfg, run, logf)
            _wait_for(lambda: (run / "metrics.jsonl").exists() and any(
                json.loads(r)["step"] == step
                for r in (run / "metrics.jsonl").read_text().splitlines()), proc)
            where = f"{delay:.2f}s into the hold before step {step}"
        time.sleep(delay)
        proc.send_signal(sig)
        rc = proc.wait(timeout=120)
        log = logf.read_text()
        assert rc in (EXIT_INTERRUPTED, 0), f"trial {trial} ({sig.name} {where}): " + log[-3000:]
        _assert_no_half_checkpoint(run)
        stop = _summary(run)["steps"]
        seen.append((sig.name, where, rc, stop))
        if rc == 0:  # the signal came after the last step: the run had finished
            assert stop == 6
            assert _state_hashes(run) == straight["hashes"]
            continue
        assert _summary(run)["status"] == "interrupted"
        assert ckpt.latest_good(run / "checkpoints").name == ckpt.checkpoint_name(stop)
        _rerun_is_exact(d, images, run, straight, resumed_at=stop)
    print("\n".join(map(str, seen)))
    assert sum(1 for s in seen if s[2] == EXIT_INTERRUPTED) >= 15


# --------------------------------------------------------------------------- process group
# What SLURM's scancel, Kubernetes and most launchers do: the signal goes to every process of
# the job, data-loader workers included (issue 28, item 10). torch's worker loop installs its
# own SIGTERM handler (die unless the parent sent it); the workers must ignore the stop
# signals and leave the stop to the main process.


def _start_group(cfg: Path, out: Path, log: Path) -> subprocess.Popen:
    """:func:`_start` as the leader of its own process group (a job under a launcher)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log, "w") as f:
        return subprocess.Popen([sys.executable, "-m", "steadydiff.cli", "train", str(cfg),
                                 "--out", str(out)], stdout=f, stderr=subprocess.STDOUT,
                                env=env, cwd=out.parent, start_new_session=True)


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


@pytest.mark.parametrize("sig,workers", [
    (signal.SIGTERM, ["data.num_workers=2"]),  # persistent workers (always, when > 0)
    (signal.SIGINT, ["data.num_workers=1", "data.pin_memory=true"]),  # pinned batches
    (signal.SIGUSR1, ["data.num_workers=2"]),
], ids=["SIGTERM-2workers", "SIGINT-pinned", "SIGUSR1-2workers"])
def test_signal_to_the_process_group_checkpoints_the_step(tmp_path, images, sig, workers):
    cfg, run, logf = tmp_path / "tiny.yaml", tmp_path / "run", tmp_path / "log.txt"
    _write_cfg(cfg, images, [*CLI, *workers],
               faults=[{"kind": "hang", "step": 2, "where": "before_step", "factor": 2}])
    proc = _start_group(cfg, run, logf)
    _wait_for(_has(run / "checkpoints" / ckpt.checkpoint_name(2)), proc)
    assert _children(proc.pid), "the data-loader workers should be running"
    os.killpg(proc.pid, sig)  # the main process and every worker
    rc = proc.wait(timeout=120)
    log = logf.read_text()
    assert rc == EXIT_INTERRUPTED, log[-3000:]
    assert "killed by signal" not in log and "Traceback" not in log, log[-3000:]
    _assert_no_half_checkpoint(run)
    assert [p.name for p in ckpt.list_checkpoints(run / "checkpoints")] == ["step_00000003"]
    assert ckpt.verify_checkpoint(run / "checkpoints" / "step_00000003") == []
    s = _summary(run)
    assert (s["status"], s["steps"], s["signal"]) == ("interrupted", 3, sig.name)


def test_signal_to_the_torchrun_process_group_with_workers(tmp_path):
    # torchrun, 2 gloo ranks, each with 2 data-loader workers, all in one process group;
    # SIGTERM to the group (scancel): torchrun, both ranks and the four workers get it. Both
    # ranks stop at step 3 with a verified checkpoint; no worker death is reported.
    hang = json.dumps([{"kind": "hang", "step": 2, "where": "before_step", "factor": 2}])
    out = tmp_path / "run"
    out.mkdir()
    logf = tmp_path / "log.txt"
    with open(logf, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             "--nproc_per_node=2", str(WORKER), str(DDP_CONFIG), str(out), *DDP_BASE,
             "data.num_workers=2", f"faults={hang}"], stdout=f, stderr=subprocess.STDOUT,
            env=_env(), start_new_session=True)
    _wait_for(_has(out / "checkpoints" / ckpt.checkpoint_name(2)), proc, timeout=240)
    pids = _rank_pids(proc)
    assert sorted(pids) == [0, 1] and all(_children(p) for p in pids.values()), pids
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=240)
    log = logf.read_text()
    assert "killed by signal" not in log, log[-3000:]
    (r0, r1), (s0, s1) = ranks(out)
    assert s0["step"] == s1["step"] == 3
    assert same(r0, r1)
    assert ckpt.verify_checkpoint(out / "checkpoints" / "step_00000003") == []
    s = json.loads((out / "summary.json").read_text())
    assert (s["status"], s["steps"], s["signal"]) == ("interrupted", 3, "SIGTERM")
    assert log.count("interrupted by SIGTERM at step 3") == 1


# --------------------------------------------------------------------------- while caching


def test_a_signal_while_caching_latents_stops_promptly_and_keeps_the_cache(tmp_path):
    # Encoding the latents of a large folder takes minutes; a stop signal must not wait for
    # the last image (issue 28: it did, 111 s). 400 images on the tiny SD model: SIGTERM to
    # the process group as soon as the first latent is cached.
    pytest.importorskip("diffusers")
    pytest.importorskip("peft")
    import numpy as np
    from PIL import Image

    from steadydiff.integrations.sd.tiny import make_tiny_sd

    sd = make_tiny_sd(tmp_path / "tiny-sd", image_size=32)
    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    for i in range(400):
        Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(
            data / f"im{i:03d}.png")
        (data / f"im{i:03d}.txt").write_text(f"noise {i % 7}")
    run = tmp_path / "run"
    sets = [f"model.pretrained={sd}", f"data.path={data}", "data.image_size=32",
            "train.steps=2", "train.batch_size=2", "train.precision=fp32",
            "train.device=cpu", "train.sample_every=0", "data.num_workers=0",
            "adapter.rank=4", "adapter.alpha=4", "logging.progress=false"]
    logf = tmp_path / "log.txt"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(logf, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "steadydiff.cli", "train",
             str(Path(__file__).resolve().parents[1] / "configs" / "sd_lora.yaml"),
             "--out", str(run), *[x for s in sets for x in ("--set", s)]],
            stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    latents = run / "cache" / "latents"
    _wait_for(lambda: latents.is_dir() and any(latents.rglob("*.safetensors")), proc,
              timeout=240)
    os.killpg(proc.pid, signal.SIGTERM)
    t0 = time.monotonic()
    rc = proc.wait(timeout=120)
    took = time.monotonic() - t0
    log = logf.read_text()
    assert rc == EXIT_INTERRUPTED, log[-3000:]
    assert took < 15, took  # the next image, not the 399 others
    assert "stopped while caching latents" in log and "Traceback" not in log, log[-3000:]
    assert "interrupted by SIGTERM at step 0; no checkpoint was written" in log
    cached = list(latents.rglob("*.safetensors"))
    assert 1 <= len(cached) <= 40, len(cached)  # stopped at the next image (not at 400)
    assert not list(latents.rglob(".*.tmp"))
    from safetensors.torch import load_file
    for p in cached:  # every entry complete
        assert torch.isfinite(load_file(p)["latent"]).all()
