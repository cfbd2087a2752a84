"""Multi-process training under torchrun with two CPU processes (gloo), end to end.

Every run here is the real thing: ``python -m torch.distributed.run --standalone
--nproc_per_node=2`` starting ``tests/ddp_worker.py``, which calls steadydiff's CLI and then
dumps what only its rank knows (weights, EMA, optimizer moments, guard decisions) so ranks can
be compared. Faults are injected on one rank only (``faults[].rank``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from steadydiff import distributed
from tiny import TINY_MODEL

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("ddp_worker.py")
CONFIG = ROOT / "configs" / "digits_cond.yaml"
STEPS = 8
BASE = TINY_MODEL + [
    f"train.steps={STEPS}", "train.checkpoint_every=2", "train.keep_checkpoints=10",
    "train.ema_decay=0.8", "optim.warmup_steps=0", "logging.report=false",
    "logging.log_every=1", "guard.rank_check_every=1", "train.dist_timeout=60",
]


def _env() -> dict:
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests"),
                                         env.get("PYTHONPATH", "")])
    return env


def launch(out: Path, *overrides: str, procs: int = 2, timeout: float = 300,
           config: Path = CONFIG, base: list[str] = BASE) -> tuple[int, str]:
    """Train ``config`` (with ``base`` and ``overrides``) into ``out`` with ``procs``
    processes; returns (exit status, combined log)."""
    out.mkdir(parents=True, exist_ok=True)
    head = ([sys.executable, "-m", "torch.distributed.run", "--standalone",
             f"--nproc_per_node={procs}"] if procs > 1 else [sys.executable])
    # beside the run, not in it: training refuses a non-empty folder that is not a run
    log = out.with_name(f"{out.name}-logs") / f"log_{time.monotonic_ns()}.txt"
    log.parent.mkdir(exist_ok=True)
    with open(log, "w") as f:
        r = subprocess.run(head + [str(WORKER), str(config), str(out), *base, *overrides],
                           stdout=f, stderr=subprocess.STDOUT, env=_env(), timeout=timeout)
    return r.returncode, log.read_text()


def ranks(out: Path, n: int = 2) -> tuple[list[dict], list[dict]]:
    return ([load_file(str(out / f"rank{r}.safetensors")) for r in range(n)],
            [json.loads((out / f"rank{r}.json").read_text()) for r in range(n)])


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def max_diff(a: dict, b: dict, prefix: str = "model.") -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a if k.startswith(prefix))


def final_checkpoint(out: Path) -> dict:
    from steadydiff.trainer.checkpoint import load_checkpoint
    c = load_checkpoint(out / "checkpoints" / f"step_{STEPS:08d}")
    return {**{f"model.{k}": v for k, v in c.model.items()},
            **{f"ema.{k}": v for k, v in c.ema.items()}}


@pytest.fixture(scope="module")
def two(tmp_path_factory) -> Path:
    """A clean two-process run (the reference for the fault and resume tests)."""
    return trained(tmp_path_factory, "two")


@pytest.fixture(scope="module")
def one(tmp_path_factory) -> Path:
    """The same global batch in one process."""
    return trained(tmp_path_factory, "one", procs=1)


def trained(factory, name: str, *overrides: str, procs: int = 2,
            expect: str | None = None) -> Path:
    """A clean run in a fresh folder (a module fixture's reference run); ``expect``: a line
    its log must hold."""
    out = factory.mktemp(name)
    rc, log = launch(out, *overrides, procs=procs)
    assert rc == 0, log
    assert expect is None or expect in log, log
    return out


def test_two_ranks_finish_with_identical_state(two):
    (r0, r1), (s0, s1) = ranks(two)
    assert same(r0, r1)  # weights, EMA and optimizer moments, bit for bit
    assert s0["step"] == s1["step"] == STEPS and s0["world_size"] == 2
    assert s0["incidents"] == s1["incidents"] == []  # fingerprints agreed at every step
    # the checkpoint rank 0 wrote holds rank 0's (= every rank's) state
    ck = final_checkpoint(two)
    assert same(ck, {k: v for k, v in r0.items() if not k.startswith("optim.")})
    rows = [json.loads(x) for x in (two / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # one writer, no duplicates


def test_two_processes_match_one_process_with_the_same_global_batch(two, one):
    """Same global batch, same samples, same noise (draws are per global position): only the
    floating-point reduction order differs."""
    (r0, _), _ = ranks(two)
    (p0,), _ = ranks(one, 1)
    diff = max_diff(r0, p0)
    assert diff < 1e-5, diff  # measured 5.5e-7 after 8 steps
    m2 = [json.loads(x)["loss"] for x in (two / "metrics.jsonl").read_text().splitlines()]
    m1 = [json.loads(x)["loss"] for x in (one / "metrics.jsonl").read_text().splitlines()]
    assert m2 == pytest.approx(m1, rel=1e-5)  # measured 1.1e-7


def test_uneven_split_with_accumulation_matches_one_process(tmp_path):
    """7 samples over 2 ranks (3 + 4), each rank's slice split into one-sample micro-batches
    (3 on one rank, 4 on the other; DDP syncs only in the last): every sample still weighs
    1/7 of the step's gradient."""
    rc, log = launch(tmp_path / "two_accum", "train.batch_size=7", "train.steps=4",
                     "train.checkpoint_every=0", "train.grad_accum=7", procs=2)
    assert rc == 0, log
    rc, log = launch(tmp_path / "one", "train.batch_size=7", "train.steps=4",
                     "train.checkpoint_every=0", procs=1)
    assert rc == 0, log
    (ref,), _ = ranks(tmp_path / "one", 1)
    (r0, r1), _ = ranks(tmp_path / "two_accum")
    assert same(r0, r1)
    assert max_diff(r0, ref) < 1e-5


def test_lora_fine_tune_on_two_ranks(tmp_path, two):
    """A LoRA over the 2-process run's checkpoint, itself on 2 processes: DDP reduces only
    the adapter's gradients, the ranks end identical, and the frozen base is untouched."""
    rc, log = launch(tmp_path, "adapter.kind=lora", f"adapter.base={two}", "adapter.rank=2",
                     "train.steps=4")
    assert rc == 0, log
    (r0, r1), (s0, _) = ranks(tmp_path)
    assert same(r0, r1)
    base = final_checkpoint(two)
    ema_base = {k[len("ema."):]: v for k, v in base.items() if k.startswith("ema.")}
    frozen = {k[len("model."):].replace(".base.", "."): v for k, v in r0.items()
              if k.startswith("model.") and "lora" not in k}
    assert frozen.keys() == ema_base.keys()
    assert all(torch.equal(v, ema_base[k]) for k, v in frozen.items())  # base untouched
    assert any("lora" in k for k in r0) and s0["incidents"] == []


def agreed_run(out: Path, *overrides: str) -> tuple[dict, dict, list[tuple]]:
    """Train 2 ranks into ``out``; both must end holding the same state and record the same
    (step, kind, action) decisions. Returns rank 0's tensors, its record and the decisions."""
    rc, log = launch(out, *overrides)
    assert rc == 0, log
    (r0, r1), (s0, s1) = ranks(out)
    assert same(r0, r1)
    decisions = [(i["step"], i["kind"], i["action"]) for i in s0["incidents"]]
    assert decisions == [(i["step"], i["kind"], i["action"]) for i in s1["incidents"]]
    return r0, s0, decisions


def test_fault_on_one_rank_makes_every_rank_act_the_same(tmp_path, two):
    """NaN in rank 1's batch (skip), NaN in rank 1's weights (rollback), and a flipped bit in
    rank 1's weights (the fingerprint check resynchronizes): both ranks record the same
    decisions and end identical."""
    faults = json.dumps([{"kind": "nan_batch", "step": 2, "rank": 1},
                         {"kind": "param_nan", "step": 4, "rank": 1},
                         {"kind": "bitflip", "step": 6, "rank": 1}])
    r0, s0, decisions = agreed_run(tmp_path, f"faults={faults}", "guard.snapshot_every=2")
    kinds = {k: (st, a) for st, k, a in decisions}
    # one NaN pixel in rank 1's first sample: that sample is dropped, both ranks redo the
    # step on the rest (the redone backward all-reduces like any other)
    assert kinds["bad_batch"] == (2, "drop_samples")
    assert kinds["nonfinite_params"][1] == "rollback"
    assert kinds["rank_mismatch"][1] == "resync"
    by_kind = {i["kind"]: i for i in s0["incidents"]}
    assert by_kind["bad_batch"]["rank"] == 1  # the report says where it happened
    (sample,) = by_kind["bad_batch"]["evidence"]["samples"]
    assert sample["rank"] == 1 and sample["position"] == 0
    assert by_kind["rank_mismatch"]["evidence"]["ranks_differing"] == [1]
    written = [json.loads(x)["kind"] for x in (tmp_path / "incidents.jsonl").read_text()
               .splitlines()]
    assert written == [k for _, k, _ in decisions]  # rank 0 wrote each incident once


def test_kill_one_rank_then_rerun_is_bit_exact(tmp_path, two):
    kill = json.dumps([{"kind": "kill", "step": 5, "rank": 1, "where": "in_step"}])
    rc, log = launch(tmp_path, f"faults={kill}")
    assert rc != 0  # torchrun stops the group when a rank dies
    assert (tmp_path / "checkpoints" / "step_00000004").is_dir()
    rc, log = launch(tmp_path)  # the same command again (faults is resume-safe)
    assert rc == 0, log
    assert "resumed from" in log and "step_00000004" in log
    assert same(final_checkpoint(tmp_path), final_checkpoint(two))
    (r0, r1), _ = ranks(tmp_path)
    assert same(r0, r1)
    assert same(r0, ranks(two)[0][0])  # optimizer moments too


def test_resume_on_another_world_size_says_so_and_matches(tmp_path, one):
    kill = json.dumps([{"kind": "kill", "step": 5, "rank": 1, "where": "before_step"}])
    rc, log = launch(tmp_path, f"faults={kill}")
    assert rc != 0
    rc, log = launch(tmp_path, procs=1)  # 2 processes -> 1, from step 4 to the end
    assert rc == 0, log
    assert "written by 2 process(es), this run has 1" in log
    assert "sample order and the noise are the same" in log
    (p,), _ = ranks(tmp_path, 1)
    (ref,), _ = ranks(one, 1)
    assert max_diff(p, ref) < 1e-5


def test_a_hung_rank_fails_the_group_at_the_collective_timeout(tmp_path):
    """Rank 1 stops responding; rank 0 waits in the gradient all-reduce until
    train.dist_timeout, then fails with exit 5 and a message naming the cause."""
    hang = json.dumps([{"kind": "hang", "step": 3, "rank": 1, "where": "before_step"}])
    t0 = time.monotonic()
    rc, log = launch(tmp_path, f"faults={hang}", "train.dist_timeout=8",
                     "train.watchdog_timeout=0", timeout=240)
    took = time.monotonic() - t0
    assert rc != 0
    assert "a collective failed" in log and "another rank" in log.lower()
    assert "exitcode  : 5" in log or "exitcode: 5" in log.replace("  ", " ") or \
        "exit code 5" in log, log[-3000:]
    assert took < 200


def test_watchdog_ends_a_rank_that_makes_no_progress(tmp_path):
    hang = json.dumps([{"kind": "hang", "step": 3, "rank": 1, "where": "before_step"}])
    rc, log = launch(tmp_path, f"faults={hang}", "train.dist_timeout=300",
                     "train.watchdog_timeout=6", timeout=240)
    assert rc != 0
    assert "watchdog: rank 1 made no progress" in log
    assert "Thread" in log  # the stacks of every thread, as evidence


def test_fingerprint_is_bitwise_and_dtype_agnostic():
    a = [torch.randn(5, 3), torch.randn(7).half(), torch.randn(4, dtype=torch.float64)]
    b = [t.clone() for t in a]
    assert torch.equal(distributed.tensor_fingerprint(a), distributed.tensor_fingerprint(b))
    for i in range(3):
        c = [t.clone() for t in a]
        ints = {4: torch.int32, 2: torch.int16, 8: torch.int64}[c[i].element_size()]
        c[i].view(-1)[:1].view(ints).bitwise_xor_(1)  # one low bit
        assert not torch.equal(distributed.tensor_fingerprint(a),
                               distributed.tensor_fingerprint(c))
    swapped = [a[0].clone(), a[1], a[2]]  # same values, two neighbours exchanged
    swapped[0].view(-1)[:2] = a[0].view(-1)[:2].flip(0)
    assert not torch.equal(distributed.tensor_fingerprint(a),
                           distributed.tensor_fingerprint(swapped))


def test_watchdog_exit_status_and_evidence():
    code = ("import time; from steadydiff.distributed import Watchdog\n"
            "with Watchdog(1.0, rank=3) as w:\n"
            "    w.beat('step 7'); time.sleep(30)\n")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=_env(), timeout=60)
    assert r.returncode == distributed.EXIT_DIST_FAILURE
    assert "rank 3 made no progress" in r.stderr and "last: step 7" in r.stderr
    assert time.monotonic() - t0 < 20


def test_single_process_is_not_distributed(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    ctx, device = distributed.setup("cpu", 10)
    assert not ctx.enabled and ctx.is_main and device.type == "cpu"
    assert distributed.gather_objects({"a": 1}) == [{"a": 1}]
    v = torch.arange(3.0)
    assert torch.equal(distributed.gather_rows(v), v.unsqueeze(0))


def test_incidents_name_the_rank_and_its_parameters(tmp_path):
    """Faults on rank 1 only: a NaN weight, a weight scaled 1e4x, a finite outlier batch.
    Rank 0 writes the incidents, and each names rank 1 and what went wrong there (rank 0
    used to list its own, healthy, parameters: none; and a finite outlier had no rank)."""
    faults = json.dumps([{"kind": "param_nan", "step": 3, "rank": 1},
                         {"kind": "param_huge", "step": 6, "rank": 1},
                         {"kind": "outlier_batch", "step": 12, "rank": 1}])
    rc, log = launch(tmp_path, f"faults={faults}", "guard.snapshot_every=2", "train.steps=14")
    assert rc == 0, log
    (r0, r1), (s0, s1) = ranks(tmp_path)
    assert same(r0, r1)
    by_kind = {i["kind"]: i for i in s0["incidents"]}
    nan = by_kind["nonfinite_params"]
    assert nan["rank"] == 1 and nan["evidence"]["params"] and nan["evidence"]["count"] >= 1
    jump = by_kind["weight_jump"]
    assert jump["rank"] == 1 and jump["evidence"]["norm_ratio"][0] > 100
    assert jump["evidence"]["params"][0] == nan["evidence"]["params"][0]  # the same victim
    outlier = by_kind["bad_batch"]
    assert outlier["rank"] == 1 and outlier["evidence"]["usual_max_abs_input"] > 0
    assert [(i["kind"], i["rank"]) for i in s0["incidents"]] == \
        [(i["kind"], i["rank"]) for i in s1["incidents"]]
