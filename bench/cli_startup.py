"""How long the CLI takes before it does anything (issue 32's bar: <= 0.5 s of CPU each).

Runs ``steadydiff --version``, ``steadydiff --help``, ``steadydiff train --help`` and
``steadydiff lint`` on a shipped config as fresh processes (the console script's own Python,
as a user types them), repeated, and reports the CPU time (user + system of the child, from
``resource.getrusage``) and the wall time: minimum and median over the repeats. CPU time is
the figure that does not depend on the machine's load; wall time is what a user waits.

    python bench/cli_startup.py [--repeats 15] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = {
    "--version": ["--version"],
    "--help": ["--help"],
    "train --help": ["train", "--help"],
    "lint CONFIG": ["lint", str(ROOT / "configs" / "digits_cond.yaml")],
}


def _command() -> list[str]:
    exe = Path(sys.executable).parent / "steadydiff"
    return [str(exe)] if exe.exists() else ([shutil.which("steadydiff")] if shutil.which(
        "steadydiff") else [sys.executable, "-m", "steadydiff"])


def measure(args: list[str], repeats: int) -> dict:
    cpu, wall = [], []
    for _ in range(repeats):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        subprocess.run(_command() + args, check=True, stdout=subprocess.DEVNULL,
                       env={**os.environ, "PYTHONWARNINGS": "ignore"})
        wall.append(time.perf_counter() - t0)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu.append((after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime))
    return {"cpu_min": min(cpu), "cpu_median": statistics.median(cpu),
            "wall_min": min(wall), "wall_median": statistics.median(wall), "repeats": repeats}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    rows = {name: measure(args, a.repeats) for name, args in CASES.items()}
    load = os.getloadavg()[0]
    if a.json:
        print(json.dumps({"rows": rows, "load": load, "python": platform.python_version(),
                          "command": _command()}))
        return 0
    print(f"| command | CPU min | CPU median | wall min | wall median |  (n={a.repeats}, "
          f"load {load:.1f})")
    print("|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| `steadydiff {name}` | {r['cpu_min']:.3f} s | {r['cpu_median']:.3f} s | "
              f"{r['wall_min']:.3f} s | {r['wall_median']:.3f} s |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
