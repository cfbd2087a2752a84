"""What the default logging costs per training step (issue 5's bar: at most 2%).

Runs the real trainer (``steadydiff.train``) on the quick-start config twice per repeat,
interleaved so machine load falls on both alike:

- ``default``: the shipped logging — a metrics.jsonl row every 25 steps, per-layer statistics
  (layers.jsonl: gradient/weight norms plus the attention/normalization probe forward pass)
  every 100 steps, the progress bar with its status line;
- ``minimal``: one metrics row at the end, no per-layer statistics, no progress bar.

Both: guard on (the default), a 1-image end-of-run grid, no intermediate checkpoints, no
report (it is written once at the end of a run; its cost is printed separately). The figure
is the median over repeats of (default - minimal) / minimal wall time of the run.

    python bench/logging_overhead.py [--steps 200] [--repeats 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

import steadydiff  # noqa: E402
from steadydiff.config import load_config  # noqa: E402

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "digits_cond.yaml"


def _run(steps: int, variant: str, out: Path) -> float:
    common = [f"train.steps={steps}", "train.sample_every=0", "train.checkpoint_every=0",
              "logging.report=false", "optim.warmup_steps=10", "train.num_threads=0",
              "sample.num=1", "sample.steps=1"]  # the end-of-run grid is not logging
    if variant == "default":
        extra = ["logging.log_every=25", "logging.layer_stats_every=100",
                 "logging.progress=true"]
    else:
        extra = [f"logging.log_every={steps}", "logging.layer_stats_every=0",
                 "logging.progress=false"]
    cfg = load_config(CONFIG, common + extra)
    t = time.perf_counter()
    steadydiff.train(cfg, out_dir=out)
    return time.perf_counter() - t


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=200, help="training steps per run")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--json", action="store_true", help="end with one JSON line of figures")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)

    times: dict[str, list[float]] = {"default": [], "minimal": []}
    with tempfile.TemporaryDirectory() as tmp:
        _run(max(2, a.steps // 10), "minimal", Path(tmp) / "warmup")  # imports, allocator
        for r in range(a.repeats):
            for variant in ("default", "minimal"):
                times[variant].append(_run(a.steps, variant, Path(tmp) / f"{variant}{r}"))
        from steadydiff.report import write_report
        t = time.perf_counter()
        write_report(Path(tmp) / "default0")
        report_s = time.perf_counter() - t

    overheads = [d / m - 1 for d, m in zip(times["default"], times["minimal"])]
    med = {k: statistics.median(v) for k, v in times.items()}
    over = statistics.median(overheads)
    print(f"quick-start config, {a.steps} steps per run, {a.repeats} repeats, "
          f"{a.threads} thread(s)")
    print(f"{'logging':<10} {'median s':>10} {'s/step':>9}")
    for k in ("default", "minimal"):
        print(f"{k:<10} {med[k]:>10.2f} {med[k] / a.steps:>9.4f}")
    print(f"default logging overhead: {over:+.2%} (per repeat: "
          f"{', '.join(f'{o:+.2%}' for o in overheads)}); target <= 2%")
    print(f"report.html at the end of the run: {report_s:.2f} s once")
    if a.json:
        print(json.dumps({
            "bench": "logging_overhead", "steps": a.steps, "repeats": a.repeats,
            "threads": a.threads, "seconds": times, "median_seconds": med,
            "overhead": over, "overheads": overheads, "report_seconds": report_s,
            "machine": {"cpu": platform.processor() or platform.machine(),
                        "cores": os.cpu_count()},
            "versions": {"python": platform.python_version(), "torch": torch.__version__,
                         "steadydiff": steadydiff.__version__}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
