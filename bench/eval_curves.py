"""Training curves of the evaluation metric: plot the ``eval.jsonl`` of one or more runs.

Each run is trained with ``eval.every`` (see docs/evaluation.md); this script only reads
what the runs wrote and draws FD and precision/recall against the training step, one column
per run, and prints the rows as a table.

    steadydiff train configs/fashion_mnist.yaml --out runs/fashion
    steadydiff train configs/digits_cond.yaml --out runs/digits_eval --set eval.every=100
    python bench/eval_curves.py runs/digits_eval runs/fashion --plot docs/images/eval_curves.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import env_info  # noqa: E402


def read(run: Path) -> list[dict]:
    p = run / "eval.jsonl"
    if not p.is_file():
        raise SystemExit(f"{p} not found: train the run with eval.every > 0 first")
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("runs", nargs="+", help="run directories holding eval.jsonl")
    p.add_argument("--plot", default=None, help="write a PNG here")
    p.add_argument("--json", action="store_true", help="end with one JSON line")
    a = p.parse_args(argv)
    data = {Path(r): read(Path(r)) for r in a.runs}
    for run, rows in data.items():
        print(f"{run} ({rows[0]['metric'] if rows else '-'}):")
        print("  step  fd      kid      precision  recall  class_acc  best")
        for r in rows:
            def f(k, spec):
                return "n/a" if r.get(k) is None else format(r[k], spec)
            print(f"  {r['step']:<5} {f('fd', '.3f'):<7} {f('kid', '.4f'):<8} "
                  f"{f('precision', '.3f'):<10} {f('recall', '.3f'):<7} "
                  f"{f('class_accuracy', '.3f'):<10} {'*' if r.get('improved') else ''}")
    if a.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, len(data), figsize=(5.5 * len(data), 3.6), squeeze=False)
        for ax, (run, rows) in zip(axes[0], data.items()):
            steps = [r["step"] for r in rows]
            ax.plot(steps, [r["fd"] for r in rows], "o-", color="#1f77b4",
                    label=rows[0]["metric"] if rows else "FD")
            ax.set_xlabel("training step")
            ax.set_ylabel("Fréchet distance (lower is better)")
            ax2 = ax.twinx()
            for k, c in (("precision", "#2ca02c"), ("recall", "#d62728"),
                         ("class_accuracy", "#9467bd")):
                ax2.plot(steps, [r[k] for r in rows], ".--", color=c, label=k)
            ax2.set_ylim(0, 1.02)
            h1, l1 = ax.get_legend_handles_labels()
            h2, l2 = ax2.get_legend_handles_labels()
            ax.legend(h1 + h2, l1 + l2, fontsize=8, loc="center right")
            ax.set_title(f"{run.name}: {rows[0]['num'] if rows else 0} samples per evaluation",
                         fontsize=10)
        fig.tight_layout()
        Path(a.plot).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(a.plot, dpi=110)
        print(f"plot: {a.plot}")
    if a.json:
        print(json.dumps({"bench": "eval_curves", "runs": {str(k): v for k, v in data.items()},
                          **env_info()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
