"""Sample quality per sampler, judged by the digits classifier (steadydiff.eval.digits).

Issue 2's bar: DPM-Solver++(2M) at 20 steps should give digits as good as DDPM at 1000 steps.
Each sampler draws the same number of class-conditional samples (labels cycling 0..9, the
checkpoint's classifier-free guidance scale, the same seeds) from a trained quick-start
checkpoint's EMA weights; the classifier reports the confident rate (top class probability
>= 0.9), the class coverage among confident samples, and the label accuracy (the classifier
agrees with the class the sample was drawn for). The classifier's own figures on held-out
real digits and on noise give the scale.

    make quickstart                               # trains runs/quickstart (~6-10 minutes)
    python bench/samplers.py                      # ~10 minutes on 2 cores (ddpm is 1000 steps)
    python bench/samplers.py runs/quickstart --num 20 --steps-scale 0.02 --json   # smoke
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import REPO, env_info, print_table  # noqa: E402

# the samplers compared, with their step counts (model evaluations)
SAMPLERS = {"dpmpp_2m": 20, "ddpm": 1000, "ddim": 50, "euler": 50}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("checkpoint", nargs="?", default=str(REPO / "runs" / "quickstart"),
                   help="checkpoint or run directory of a digits model")
    p.add_argument("--samplers", default=",".join(f"{k}:{v}" for k, v in SAMPLERS.items()),
                   help="comma list of sampler:steps")
    p.add_argument("--num", type=int, default=500, help="samples per sampler and seed")
    p.add_argument("--seeds", default="0", help="comma list of sampling seeds")
    p.add_argument("--steps-scale", type=float, default=1.0,
                   help="multiply every step count (smoke tests)")
    p.add_argument("--cfg-scale", type=float, default=None,
                   help="guidance scale (default: the checkpoint's sample.cfg_scale)")
    p.add_argument("--threshold", type=float, default=0.9)
    p.add_argument("--threads", type=int, default=1, help="torch threads (0: torch default)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", action="store_true", help="end with one JSON line")
    a = p.parse_args(argv)

    if a.threads:
        torch.set_num_threads(a.threads)
    from steadydiff import load
    from steadydiff.eval.digits import evaluate_samples, reference_scores
    from steadydiff.trainer.checkpoint import CheckpointError

    try:
        pipe = load(a.checkpoint, device=a.device)
    except (CheckpointError, FileNotFoundError, OSError) as e:
        print(f"no usable checkpoint at {a.checkpoint} ({e}).\nMake the quick-start one with "
              "`make quickstart` (or `steadydiff train configs/digits_cond.yaml --out "
              "runs/quickstart`), or pass a checkpoint/run directory.", file=sys.stderr)
        return 2
    if pipe.config.data.dataset != "digits":
        print(f"{a.checkpoint} was trained on {pipe.config.data.dataset!r}; the classifier "
              "judges digits models only", file=sys.stderr)
        return 2
    cfg_scale = pipe.config.sample.cfg_scale if a.cfg_scale is None else a.cfg_scale
    seeds = [int(s) for s in a.seeds.split(",") if s]
    samplers = {}
    for item in a.samplers.split(","):
        name, _, steps = item.partition(":")
        samplers[name] = max(1, round(int(steps or SAMPLERS[name]) * a.steps_scale))

    result: dict[str, Any] = {"bench": "samplers", "checkpoint": str(pipe.checkpoint),
                              "checkpoint_step": pipe.step, "num": a.num, "seeds": seeds,
                              "cfg_scale": cfg_scale, "threshold": a.threshold,
                              "samplers": {}}
    result.update(env_info())
    for name, steps in samplers.items():
        xs, ys, secs = [], [], 0.0
        for seed in seeds:
            t0 = time.perf_counter()
            x, y = pipe.sample(a.num, sampler=name, steps=steps, cfg_scale=cfg_scale, seed=seed)
            secs += time.perf_counter() - t0
            xs.append(x)
            ys.append(y)
        x = torch.cat(xs)
        y = torch.cat(ys) if ys[0] is not None else None
        s = evaluate_samples(x, y, a.threshold)
        n = s["num"]
        s.update(steps=steps, seconds=secs, images_per_sec=n / secs,
                 confident_rate_se=math.sqrt(max(s["confident_rate"] * (1 - s["confident_rate"]),
                                                 1e-12) / n))
        result["samplers"][name] = s
        print(f"  {name} ({steps} steps): {s['confident_rate']:.1%} confident, "
              f"{secs:.0f} s", file=sys.stderr)
    ref = reference_scores(a.threshold)
    result["reference"] = ref

    print(f"sample quality, {a.num * len(seeds)} class-conditional samples per sampler "
          f"(cfg scale {cfg_scale}), checkpoint {pipe.checkpoint} (step {pipe.step}):")
    rows = [[k, v["steps"], f"{v['confident_rate']:.1%} ± {v['confident_rate_se']:.1%}",
             f"{v['class_coverage']}/10",
             f"{v['label_accuracy']:.1%}" if "label_accuracy" in v else "-",
             f"{v['mean_confidence']:.3f}", f"{v['images_per_sec']:.1f}"]
            for k, v in result["samplers"].items()]
    rows += [[f"[{k}]", "-", f"{v['confident_rate']:.1%}", f"{v['class_coverage']}/10",
              f"{v['label_accuracy']:.1%}" if "label_accuracy" in v else "-",
              f"{v['mean_confidence']:.3f}", "-"] for k, v in ref.items()]
    print_table(rows, ["sampler", "steps", "confident (±1 SE)", "coverage", "label acc",
                       "mean conf", "images/s"])

    sp = result["samplers"]
    if "dpmpp_2m" in sp and "ddpm" in sp:
        d, b = sp["dpmpp_2m"], sp["ddpm"]
        diff = d["confident_rate"] - b["confident_rate"]
        se = math.hypot(d["confident_rate_se"], b["confident_rate_se"])
        acc = (d.get("label_accuracy", 0) - b.get("label_accuracy", 0))
        # "as good": not worse by more than two standard errors, on both rates, and covering
        # as many classes
        good = (diff >= -2 * se and acc >= -2 * se
                and d["class_coverage"] >= b["class_coverage"])
        result["dpmpp_vs_ddpm"] = {"confident_rate_diff": diff, "label_accuracy_diff": acc,
                                   "se": se, "as_good": good,
                                   "speedup": d["images_per_sec"] / b["images_per_sec"]}
        print(f"DPM-Solver++(2M)@{d['steps']} vs DDPM@{b['steps']}: confident "
              f"{diff:+.1%}, label accuracy {acc:+.1%} (±{se:.1%} SE), "
              f"{result['dpmpp_vs_ddpm']['speedup']:.0f}x faster -> "
              f"{'as good' if good else 'NOT as good'}")
    if a.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
