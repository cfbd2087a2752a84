"""Fused AdamW on the CPU: what ``optim.fused=auto`` chooses there, measured (issue 17).

Two measurements, each side by side in one process, interleaved (a, b, c, a, b, c, ...) so
load from other processes falls on all variants alike; each figure is the median of
``--repeats`` repeats of ``--steps`` steps after a warm-up:

- the optimizer step alone (random gradients, the model's parameter groups) for torch's
  per-parameter loop (its CPU default), ``foreach`` and ``fused``, on the quick-start UNet
  (configs/digits_cond.yaml) and the DiT of configs/dit.yaml, with the largest difference
  of the weights between fused and loop after the timed steps;
- the trainer's whole ``train_step`` (guard off) on the quick-start model with
  ``optim.fused=false`` (the loop) and ``true``: one step of each in turn on the same
  batch, the order alternating, the median over ``--train-steps`` steps.

    python bench/fused_adamw.py            # ~1 minute on 2 cores
    python bench/fused_adamw.py --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from steadydiff.config import load_config
from steadydiff.data import make_loader
from steadydiff.models import build_model
from steadydiff.preflight import check_data
from steadydiff.trainer import loop
from steadydiff.trainer.optim import param_groups

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
KINDS = {"loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def optimizer_steps(cfg, steps: int, repeats: int) -> dict[str, float]:
    model = build_model(cfg.model, image_size=cfg.data.image_size, channels=cfg.data.channels)
    opts, params = {}, {}
    for kind, kw in KINDS.items():
        m = build_model(cfg.model, image_size=cfg.data.image_size, channels=cfg.data.channels)
        m.load_state_dict(model.state_dict())
        g = torch.Generator().manual_seed(0)
        for p in m.parameters():
            p.grad = torch.randn(p.shape, generator=g)
        opts[kind] = torch.optim.AdamW(param_groups(m, cfg.optim), lr=1e-3, **kw)
        params[kind] = m
        for _ in range(3):
            opts[kind].step()
    times: dict[str, list[float]] = {k: [] for k in KINDS}
    for _ in range(repeats):
        for kind, opt in opts.items():
            t = time.perf_counter()
            for _ in range(steps):
                opt.step()
            times[kind].append((time.perf_counter() - t) / steps)
    diff = max(float((a - b).detach().abs().max())
               for a, b in zip(params["fused"].parameters(), params["loop"].parameters()))
    out = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    out["max_abs_diff"] = diff
    out["params_M"] = sum(p.numel() for p in model.parameters()) / 1e6
    return out


def train_steps(steps: int) -> dict[str, float]:
    states, data = {}, None
    for fused in (False, True):
        cfg = load_config(CONFIGS / "digits_cond.yaml", [
            "guard.enabled=false", "train.device=cpu", f"optim.fused={str(fused).lower()}"])
        if data is None:
            data, _ = check_data(cfg)
            batches = list(zip(range(steps + 3), make_loader(
                data, batch_size=cfg.train.batch_size, seed=0, num_classes=10)))
        loop.configure_runtime(cfg, torch.device("cpu"))
        states[fused] = loop.build_state(cfg, 10, torch.device("cpu"))
    times: dict[bool, list[float]] = {False: [], True: []}
    for s in states.values():  # warm-up
        for _, b in batches[:3]:
            loop.train_step(s, b)
    # one step of each in turn, the order alternating, so load drift falls on both alike
    for i, (_, b) in enumerate(batches[3:]):
        for fused in ((False, True) if i % 2 == 0 else (True, False)):
            s = states[fused]
            t = time.perf_counter()
            loop.train_step(s, b)
            times[fused].append(time.perf_counter() - t)
    return {("fused" if k else "loop"): statistics.median(v) * 1e3 for k, v in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--train-steps", type=int, default=20)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    print(f"torch {torch.__version__}, {a.threads} thread(s)")
    print("optimizer step alone (ms, median):")
    for name in ("digits_cond.yaml", "dit.yaml"):
        r = optimizer_steps(load_config(CONFIGS / name), a.steps, a.repeats)
        print(f"  {name:17s} {r['params_M']:.2f}M params: loop {r['loop']:.2f}, foreach "
              f"{r['foreach']:.2f}, fused {r['fused']:.2f} ({r['loop'] / r['fused']:.1f}x "
              f"vs loop); max |fused - loop| after {3 + a.steps * a.repeats} steps "
              f"{r['max_abs_diff']:.1e}")
    r = train_steps(a.train_steps)
    print(f"whole train_step, digits_cond.yaml, guard off (ms, median): loop {r['loop']:.1f}, "
          f"fused {r['fused']:.1f} ({(r['loop'] - r['fused']) / r['loop']:.1%} less)")


if __name__ == "__main__":
    main()
