"""Sample quality vs steps: FD-digits, KID and precision/recall per sampler and step count.

Every (sampler, steps) cell draws the same N class-conditional samples (labels cycling 0..9,
the same seed, so the same starting noise; the checkpoint's CFG scale) from a trained digits
checkpoint's EMA weights and compares them with N real digits with the same class counts (a
fixed subset) in the digits feature network's space (steadydiff.eval.evaluate). The
real-vs-real row (two disjoint such real subsets) is the floor a perfect model would reach.

Cells run cheapest first and each finished cell is appended to ``--jsonl`` at once, so an
interrupted run keeps what it measured (rerunning skips the cells already there). ``--plot``
draws FD, precision and recall against steps, one line per sampler.

    python bench/eval_samplers.py runs/quickstart --num 128 --jsonl runs/eval_grid.jsonl \\
        --plot docs/images/sampler_quality.png          # hours on a loaded 2-core machine
    python bench/eval_samplers.py runs/quickstart --num 128 --jsonl runs/eval_grid.jsonl \
        --render --plot docs/images/sampler_quality.png # the table and plot of what is done
    python bench/eval_samplers.py runs/quickstart --num 20 --steps 2,4 --samplers ddim   # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch

import torch  # noqa: E402

from steadydiff.kinds import OBJECTIVE_SAMPLERS  # noqa: E402
from steadydiff.kinds import SAMPLER_NAMES as SAMPLERS  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import REPO, env_info, print_table  # noqa: E402

STEPS = (10, 20, 50, 100, 1000)
STYLE = {"ddpm": "o-", "ddim": "s--", "dpmpp_2m": "^-", "euler": "x:", "heun": "d-."}


def plot(rows: list[dict], floor: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, key, label in zip(axes, ("fd", "precision", "recall"),
                              ("FD-digits (lower is better)", "precision", "recall")):
        for s in SAMPLERS:
            pts = sorted((r["steps"], r[key]) for r in rows if r["sampler"] == s
                         and r.get(key) is not None)
            if pts:  # distinct styles: DDIM and Euler coincide on this model
                ax.plot(*zip(*pts), STYLE[s], label=s, mfc="none" if s == "ddim" else None)
        if floor.get(key) is not None:
            ax.axhline(floor[key], color="gray", ls="--", label="real vs real")
        ax.set_xscale("log")
        ax.set_xlabel("sampling steps")
        ax.set_title(label)
        if key != "fd":
            ax.set_ylim(0, 1.02)
    axes[0].legend(fontsize=8)
    n = rows[0]["num"] if rows else 0
    fig.suptitle(f"digits quick-start model, {n} samples per cell, CFG "
                 f"{rows[0]['cfg_scale'] if rows else ''}", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("checkpoint", nargs="?", default=str(REPO / "runs" / "quickstart"))
    p.add_argument("--num", type=int, default=128, help="samples per cell (and real images)")
    p.add_argument("--samplers", default=None,
                   help="comma-separated; default: every sampler the checkpoint's "
                        "diffusion.objective takes")
    p.add_argument("--steps", default=",".join(map(str, STEPS)))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--jsonl", default=None, help="append each finished cell here (resumable)")
    p.add_argument("--plot", default=None, help="write the PNG plot here")
    p.add_argument("--json", action="store_true", help="end with one JSON line")
    p.add_argument("--render", action="store_true",
                   help="sample nothing: table and plot of the cells already in --jsonl")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    from steadydiff import load
    from steadydiff.eval.evaluate import evaluate_samples, extractor_for

    pipe = load(a.checkpoint, device="cpu")
    fx = extractor_for(pipe.config)
    samplers = ([s for s in a.samplers.split(",") if s] if a.samplers is not None
                else list(OBJECTIVE_SAMPLERS[pipe.config.diffusion.objective]))
    steps = sorted(int(s) for s in a.steps.split(",") if s)
    done: list[dict] = []
    if a.jsonl and Path(a.jsonl).is_file():
        done = [json.loads(line) for line in Path(a.jsonl).read_text().splitlines() if line]
        done = [r for r in done if r["num"] == a.num and r["seed"] == a.seed]
    have = {(r["sampler"], r["steps"]) for r in done}
    for n in steps:  # cheapest first
        for s in samplers:
            if (s, n) in have or a.render:
                continue
            t0 = time.perf_counter()
            x, y = pipe.sample(a.num, sampler=s, steps=n, seed=a.seed)
            secs = time.perf_counter() - t0
            r = evaluate_samples(fx, x, y, seed=a.seed, real_floor=False)
            row = {"sampler": s, "steps": n, "num": a.num, "seed": a.seed,
                   "cfg_scale": pipe.config.sample.cfg_scale, "seconds": round(secs, 1),
                   **{k: r.get(k) for k in ("fd", "kid", "kid_std", "precision", "recall",
                                            "class_accuracy", "num_nonfinite")},
                   "date": time.strftime("%H:%M:%S")}
            done.append(row)
            print(f"  {s}@{n}: FD {row['fd']:.3f} P {row['precision']:.3f} "
                  f"R {row['recall']:.3f} ({secs:.0f} s)", file=sys.stderr, flush=True)
            if a.jsonl:
                with open(a.jsonl, "a") as f:
                    f.write(json.dumps(row) + "\n")
    # the floor: two disjoint real subsets of N with the samples' class counts (no sampling)
    import numpy as np
    from steadydiff.eval import metrics
    from steadydiff.eval.evaluate import reference_subset
    g = np.random.default_rng(a.seed)
    y = np.arange(a.num) % pipe.num_classes if pipe.num_classes else None
    ia = reference_subset(fx.labels, y, a.num, g)
    floor = metrics.compare(fx.real[ia], fx.real[reference_subset(fx.labels, y, a.num, g, ia)],
                            seed=a.seed)
    rows = sorted(done, key=lambda r: (SAMPLERS.index(r["sampler"]), r["steps"]))
    print(f"FD-{fx.name} (feature network test accuracy {fx.meta['test_accuracy']:.1%}), "
          f"{a.num} samples per cell, checkpoint {pipe.checkpoint} (step {pipe.step}):")
    table = [[r["sampler"], r["steps"], f"{r['fd']:.3f}", f"{r['kid']:.4f}",
              f"{r['precision']:.3f}", f"{r['recall']:.3f}", f"{r['class_accuracy']:.1%}",
              f"{r['seconds']:.0f}"] for r in rows]
    if floor:
        table.append(["[real vs real]", "-", f"{floor['fd']:.3f}", f"{floor['kid']:.4f}",
                      f"{floor['precision']:.3f}", f"{floor['recall']:.3f}", "-", "-"])
    print_table(table, ["sampler", "steps", "FD", "KID", "precision", "recall", "class acc",
                        "seconds"])
    if a.plot:
        plot(rows, floor, Path(a.plot))
        print(f"plot: {a.plot}")
    if a.json:
        print(json.dumps({"bench": "eval_samplers", "rows": rows, "real_floor": floor,
                          "feature_net": fx.meta, **env_info()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
