"""The fine-tuning bar: a base model on digits 0-4, a LoRA adapter on digits 5-9.

    python bench/finetune.py                       # train both (or resume), merge, measure
    python bench/finetune.py --json runs/finetune.json

1. trains configs/finetune_base_0to4.yaml into runs/finetune_base_0to4 (rerun: resumes/skips);
2. records the sha256 of the base checkpoint's tensors (model and EMA);
3. trains configs/finetune_lora_5to9.yaml (LoRA over that base, digits 5-9 only);
4. merges the adapter into the base (steadydiff merge) into runs/finetune_lora_5to9_merged;
5. samples from base, base + adapter at scale 0 and 1, and the merged checkpoint, for the
   classes 0-4 and 5-9, and scores the samples with the digits classifier
   (steadydiff.eval.digits.evaluate_samples): label accuracy and the histogram of
   confidently classified samples;
6. re-hashes the base checkpoint's tensors: the fine-tune must leave them bit-identical.

Prints a markdown table (docs/BENCHMARKS.md, "Fine-tuning with adapters").
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import steadydiff  # noqa: E402
from steadydiff.adapters import merge_checkpoint, tensor_hash  # noqa: E402
from steadydiff.config import load_config  # noqa: E402
from steadydiff.eval.digits import evaluate_samples  # noqa: E402
from steadydiff.trainer import checkpoint as ckpt  # noqa: E402


def base_hashes(run: Path) -> dict[str, str]:
    c = ckpt.load_checkpoint(ckpt.latest_good(run / "checkpoints"), weights_only=True)
    return {"checkpoint": c.path.name, "model": tensor_hash(c.model), "ema": tensor_hash(c.ema)}


def dir_bytes(path: Path, pattern: str = "*") -> int:
    return sum(p.stat().st_size for p in path.glob(pattern) if p.is_file())


def measure(pipe, classes: list[int], num_per_class: int, steps: int, seed: int) -> dict:
    labels = torch.tensor(classes).repeat_interleave(num_per_class)
    x, y = pipe.sample(len(labels), labels=labels, steps=steps, seed=seed)
    return evaluate_samples(x, y)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-run", default="runs/finetune_base_0to4")
    p.add_argument("--lora-run", default="runs/finetune_lora_5to9")
    p.add_argument("--merged", default="runs/finetune_lora_5to9_merged")
    p.add_argument("--num-per-class", type=int, default=100)
    p.add_argument("--steps", type=int, default=25, help="sampling steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", dest="overrides", nargs="+", default=[],
                   help="overrides for the LoRA config (e.g. train.steps=400)")
    p.add_argument("--json", default=None, help="also write the results here")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    base_run, lora_run, merged = Path(a.base_run), Path(a.lora_run), Path(a.merged)

    t0 = time.perf_counter()
    steadydiff.train(load_config(ROOT / "configs/finetune_base_0to4.yaml"), out_dir=base_run)
    t_base = time.perf_counter() - t0
    before = base_hashes(base_run)

    t0 = time.perf_counter()
    lora_cfg = load_config(ROOT / "configs/finetune_lora_5to9.yaml",
                           [f"adapter.base={base_run}", *a.overrides])
    res = steadydiff.train(lora_cfg, out_dir=lora_run)
    t_lora = time.perf_counter() - t0
    if not merged.exists():
        merge_checkpoint(lora_run, merged)

    pipes = {
        "base (0-4)": steadydiff.load(base_run, device="cpu"),
        "base + LoRA, scale 0": steadydiff.load(lora_run, device="cpu", adapter_scale=0.0),
        "base + LoRA, scale 1": steadydiff.load(lora_run, device="cpu", adapter_scale=1.0),
        "merged (scale 1)": steadydiff.load(merged, device="cpu"),
    }
    results = {}
    for name, pipe in pipes.items():
        results[name] = {"0-4": measure(pipe, [0, 1, 2, 3, 4], a.num_per_class, a.steps, a.seed),
                         "5-9": measure(pipe, [5, 6, 7, 8, 9], a.num_per_class, a.steps, a.seed)}
    after = base_hashes(base_run)

    lora_ckpt = ckpt.latest_good(lora_run / "checkpoints")
    base_ckpt = ckpt.latest_good(base_run / "checkpoints")
    sizes = {"adapter_checkpoint_bytes": dir_bytes(lora_ckpt),
             "adapter_weights_bytes": dir_bytes(lora_ckpt, "model.safetensors"),
             "base_checkpoint_bytes": dir_bytes(base_ckpt),
             "base_weights_bytes": dir_bytes(base_ckpt, "model.safetensors")}
    rec = ckpt.load_checkpoint(lora_ckpt, weights_only=True).state["adapter"]

    print("\n| model | requested | label accuracy | confident (p >= 0.9) | confident samples "
          "by class 0..9 |")
    print("|---|---|---|---|---|")
    for name, r in results.items():
        for c in ("0-4", "5-9"):
            print(f"| {name} | {c} | {r[c]['label_accuracy']:.3f} | "
                  f"{r[c]['confident_rate']:.3f} | {r[c]['class_histogram']} |")
    print(f"\nbase tensors sha256 before {before['ema'][:16]} (EMA) {before['model'][:16]} "
          f"(model), after {after['ema'][:16]} {after['model'][:16]}: "
          f"{'unchanged' if before == after else 'CHANGED'}")
    print(f"adapter checkpoint {sizes['adapter_checkpoint_bytes'] / 1024:.0f} KiB "
          f"(weights {sizes['adapter_weights_bytes'] / 1024:.0f} KiB) vs base checkpoint "
          f"{sizes['base_checkpoint_bytes'] / 1024:.0f} KiB (weights "
          f"{sizes['base_weights_bytes'] / 1024:.0f} KiB)")
    print(f"delta clamps: {rec['clamps']}, max |dW|/|W| seen {rec['max_delta_ratio_seen']:.3g} "
          f"({rec['max_delta_ratio_module']}); training time: base {t_base:.0f}s, LoRA "
          f"{t_lora:.0f}s (0 when already complete)")
    out = {"results": results, "base_hash_before": before, "base_hash_after": after,
           "base_unchanged": before == after, "sizes": sizes, "adapter": rec,
           "lora_steps": res.steps, "seconds": {"base": t_base, "lora": t_lora}}
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0 if before == after else 1


if __name__ == "__main__":
    sys.exit(main())
