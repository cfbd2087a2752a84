"""Distributed benchmarks (two CPU processes, gloo), written to docs/BENCHMARKS.md by hand.

    python bench/ddp.py cost      # the guard's per-step cross-rank collectives, in isolation
    python bench/ddp.py steps     # 2-process step time, guard on vs off, side by side
    python bench/ddp.py hang      # a per-rank decision that is not reduced: what happens
    python bench/ddp.py restarts  # torchrun --max-restarts after a killed worker, N trials

Every mode starts its own torchrun jobs (``--standalone``); nothing here needs a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "digits_cond.yaml"


def _env(**extra: str) -> dict:
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", PYTHONUNBUFFERED="1", **extra)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    return env


def _torchrun(args: list[str], nproc: int = 2, extra: list[str] = (), env: dict | None = None,
              timeout: float = 1800, log: Path | None = None) -> tuple[int, str, float]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", *extra, *args]
    t0 = time.monotonic()
    with tempfile.TemporaryFile("w+") as f:
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env or _env(),
                           timeout=timeout)
        f.seek(0)
        text = f.read()
    if log is not None:
        log.write_text(text)
    return r.returncode, text, time.monotonic() - t0


# --------------------------------------------------------------------------- cost


def cost_worker(iters: int) -> None:
    """Inside torchrun: time the guard's collectives one by one (median of ``iters``)."""
    import torch
    import torch.distributed as dist

    from steadydiff import distributed
    from steadydiff.config import load_config
    from steadydiff.models import build_model
    from steadydiff.trainer.preempt import StopSignals

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()

    def timed(fn, n=iters):
        for _ in range(20):
            fn()
        dist.barrier()
        ts = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts) * 1e6

    row = torch.randn(24)  # loss, grad norm, input max, count, 10 bucket sums, 10 counts
    check = torch.randn(2)
    cfg = load_config(CONFIG)
    model = build_model(cfg.model, image_size=cfg.data.image_size, channels=cfg.data.channels)
    params = list(model.parameters())
    out = {
        "gather_rows_us": timed(lambda: distributed.gather_rows(row)),
        "allreduce_max_2_us": timed(lambda: dist.all_reduce(check, op=dist.ReduceOp.MAX)),
        "fingerprint_local_us": timed(lambda: distributed.tensor_fingerprint(params), 50),
        "fingerprint_and_gather_us": timed(lambda: distributed.gather_rows(
            distributed.tensor_fingerprint(params)), 50),
        "params": sum(p.numel() for p in params),
        # the loop's per-step stop-signal agreement (trainer/preempt.py): MAX of one int,
        # read back on the host
        "stop_flag_us": timed(lambda: StopSignals().agreed(torch.device("cpu"))),
    }
    if rank == 0:
        print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()


def cost(a: argparse.Namespace) -> None:
    rc, text, _ = _torchrun([__file__, "cost-worker", "--iters", str(a.iters)])
    line = next((ln for ln in text.splitlines() if ln.startswith("RESULT ")), None)
    if rc != 0 or line is None:
        sys.exit(f"cost worker failed (rc {rc}):\n{text[-3000:]}")
    r = json.loads(line[7:])
    every = 100
    per_step = r["gather_rows_us"] + r["allreduce_max_2_us"] + \
        r["fingerprint_and_gather_us"] / every
    print(f"guard collectives per step, 2 gloo processes on one host ({a.iters} calls, median):")
    print(f"  gather of the 24-float decision row   {r['gather_rows_us']:8.1f} us")
    print(f"  all-reduce(MAX) of the weight check   {r['allreduce_max_2_us']:8.1f} us")
    print(f"  weight fingerprint ({r['params'] / 1e6:.2f}M params), local  "
          f"{r['fingerprint_local_us']:8.1f} us")
    print(f"  fingerprint + gather (every {every} steps) {r['fingerprint_and_gather_us']:8.1f} us")
    print(f"  => per step, amortized: {per_step:.1f} us")
    print(f"loop's stop-signal agreement per step (all-reduce MAX of one int, read back) "
          f"{r['stop_flag_us']:8.1f} us")


# --------------------------------------------------------------------------- steps


TINY = ["train.sample_every=0", "logging.progress=false", "logging.report=false",
        "logging.layer_stats_every=0", "train.checkpoint_every=0", "optim.warmup_steps=0",
        "logging.log_every=1"]


def steps(a: argparse.Namespace) -> None:
    """2-process step time with the guard on and off, interleaved, from metrics.jsonl."""
    results: dict[str, list[float]] = {"guard on": [], "guard off": []}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(a.repeats):
            for name, flag in (("guard on", "true"), ("guard off", "false")):
                out = Path(tmp) / f"{name.replace(' ', '_')}_{rep}"
                rc, text, _ = _torchrun(["-m", "steadydiff", "train", str(CONFIG), "--out",
                                         str(out), "--set", f"train.steps={a.steps}",
                                         f"guard.enabled={flag}", *TINY])
                if rc != 0:
                    sys.exit(f"{name} run failed:\n{text[-3000:]}")
                rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
                per = [r["sec_per_step"] for r in rows[5:]]  # skip warm-up steps
                results[name].append(statistics.median(per))
                print(f"  repeat {rep}: {name:<9} {results[name][-1] * 1e3:7.1f} ms/step",
                      flush=True)
    on, off = (statistics.median(results[k]) for k in ("guard on", "guard off"))
    print(f"2 processes, quick-start model, batch 64 global ({a.steps} steps x {a.repeats}):")
    print(f"  guard off {off * 1e3:.1f} ms/step, guard on {on * 1e3:.1f} ms/step, "
          f"ratio {on / off:.3f}")


# --------------------------------------------------------------------------- hang


def hang_worker(timeout: float, skip_step: int, total: int) -> None:
    """Inside torchrun: a plain DDP loop where rank 1 skips one step on its own (the
    decision an un-reduced guard would make) and everything else is the same."""
    import datetime

    import torch
    import torch.distributed as dist
    from torch import nn

    from steadydiff import distributed

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(16, 64), nn.ReLU(),
                                                              nn.Linear(64, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    t_last = time.monotonic()
    for step in range(total):
        if rank == 1 and step == skip_step:
            print(f"rank 1: skips step {step} locally (not reduced)", flush=True)
            continue
        x = torch.randn(8, 16, generator=g)
        loss = model(x).square().mean()
        try:
            loss.backward()
        except Exception as e:  # the collective that never completes
            waited = time.monotonic() - t_last
            fp = distributed.tensor_fingerprint(list(model.parameters())).tolist()
            print(f"RESULT {json.dumps({'rank': rank, 'step': step, 'waited_s': waited, 'fingerprint': fp, 'error': str(e).splitlines()[0][:160]})}", flush=True)
            os._exit(1)
        opt.step()
        opt.zero_grad()
        t_last = time.monotonic()
    fp = distributed.tensor_fingerprint(list(model.parameters())).tolist()
    print(f"RESULT {json.dumps({'rank': rank, 'step': total, 'finished': True, 'fingerprint': fp})}",
          flush=True)
    time.sleep(timeout * 3)  # stay alive, as a rank that went on to other work would
    dist.destroy_process_group()


def hang(a: argparse.Namespace) -> None:
    rc, text, wall = _torchrun([__file__, "hang-worker", "--timeout", str(a.timeout),
                                "--skip-step", "3", "--total", "10"])
    res = [json.loads(ln[7:]) for ln in text.splitlines() if ln.startswith("RESULT ")]
    print(f"rank 1 skipped step 3 of 10 on its own; collective timeout {a.timeout:g}s")
    for r in sorted(res, key=lambda r: r["rank"]):
        print(f"  rank {r['rank']}: " + (f"finished its loop, weights fingerprint "
                                         f"{r['fingerprint']}" if r.get("finished") else
                                         f"blocked in the all-reduce of step {r['step']} for "
                                         f"{r['waited_s']:.1f}s, then: {r['error']} "
                                         f"(weights fingerprint {r['fingerprint']})"))
    print(f"  torchrun exit status {rc} after {wall:.1f}s wall")


# --------------------------------------------------------------------------- restarts


def restarts(a: argparse.Namespace) -> None:
    """Kill one worker (SIGKILL from outside, as a preemption would) once the run has a
    checkpoint, and see whether ``torchrun --max-restarts`` brings the group back to finish
    (with and without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)."""
    import socket

    for share_off in (False, True):
        ok = 0
        for trial in range(a.trials):
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp) / "run"
                env = _env(**({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if share_off else {}))
                if a.rdzv == "standalone":
                    rdzv = ["--standalone"]
                else:  # the multi-node form, on one host: an explicit c10d endpoint
                    with socket.socket() as sock:
                        sock.bind(("127.0.0.1", 0))
                        port = sock.getsockname()[1]
                    rdzv = ["--nnodes=1", "--rdzv-backend=c10d",
                            f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=bench{trial}"]
                cmd = [sys.executable, "-m", "torch.distributed.run", *rdzv,
                       "--nproc_per_node=2", "--max-restarts=3", "-m", "steadydiff", "train",
                       str(CONFIG), "--out", str(out), "--set", *TINY, "train.steps=40",
                       "train.checkpoint_every=10", "train.batch_size=16"]
                log = open(Path(tmp) / "log.txt", "w+")
                p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
                killed = _kill_a_worker_after(p, out / "checkpoints" / "step_00000010")
                try:
                    rc = p.wait(timeout=a.timeout)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    rc = "timeout"
                done = (out / "checkpoints" / "step_00000040").is_dir()
                log.seek(0)
                text = log.read()
                resumed = "resumed from" in text
                ok += int(rc == 0 and done and killed and resumed)
                print(f"  {a.rdzv} share_rdzv_store={'off' if share_off else 'on '} trial "
                      f"{trial}: killed={killed} rc={rc} resumed={resumed} finished={done}",
                      flush=True)
        print(f"{a.rdzv}: TORCH_DISABLE_SHARE_RDZV_TCP_STORE={'1' if share_off else 'unset'}: "
              f"{ok}/{a.trials} restarted, resumed and finished", flush=True)


def _kill_a_worker_after(agent: subprocess.Popen, marker: Path, limit: float = 600) -> bool:
    """SIGKILL one of the agent's worker processes once ``marker`` exists."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit and agent.poll() is None:
        if marker.is_dir():
            kids = subprocess.run(["pgrep", "-P", str(agent.pid)], capture_output=True,
                                  text=True).stdout.split()
            if kids:
                os.kill(int(kids[-1]), signal.SIGKILL)
                return True
        time.sleep(0.2)
    return False


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="mode", required=True)
    c = sub.add_parser("cost")
    c.add_argument("--iters", type=int, default=2000)
    w = sub.add_parser("cost-worker")
    w.add_argument("--iters", type=int, default=2000)
    s = sub.add_parser("steps")
    s.add_argument("--steps", type=int, default=40)
    s.add_argument("--repeats", type=int, default=3)
    h = sub.add_parser("hang")
    h.add_argument("--timeout", type=float, default=20.0)
    hw = sub.add_parser("hang-worker")
    hw.add_argument("--timeout", type=float, default=20.0)
    hw.add_argument("--skip-step", type=int, default=3)
    hw.add_argument("--total", type=int, default=10)
    r = sub.add_parser("restarts")
    r.add_argument("--trials", type=int, default=5)
    r.add_argument("--timeout", type=float, default=900)
    r.add_argument("--rdzv", choices=["standalone", "c10d"], default="standalone",
                   help="--standalone, or an explicit c10d endpoint (the multi-node form)")
    a = p.parse_args()
    if a.mode == "cost":
        cost(a)
    elif a.mode == "cost-worker":
        cost_worker(a.iters)
    elif a.mode == "steps":
        steps(a)
    elif a.mode == "hang":
        hang(a)
    elif a.mode == "hang-worker":
        hang_worker(a.timeout, a.skip_step, a.total)
    else:
        restarts(a)


if __name__ == "__main__":
    main()
