"""Memory per rank, DDP vs FSDP (``train.parallel``), on the same model, side by side.

    python bench/fsdp_memory.py                    # DiT-S/2 on 16x16 digits, 2 and 3 ranks
    python bench/fsdp_memory.py --preset B --worlds 2

Each variant is a real ``steadydiff train`` under torchrun on CPU processes (gloo), a few
steps with the guard on. After a step every rank reports what it holds, as tensor bytes (the
shard a rank keeps of a sharded tensor): the trainable weights, their gradients (read right
after the backward pass), the AdamW moments, the EMA, and the guard's rollback snapshots;
and its process memory (peak RSS, which also holds Python, torch, the data and, under FSDP,
the full model each rank builds before sharding it). The bar is the first group: FSDP's
weights + gradients + optimizer state per rank ~ 1/N of DDP's. Prints a Markdown table and a
JSON line with ``--json`` (docs/BENCHMARKS.md, "FSDP memory").
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "digits_cond.yaml"
MIB = 2 ** 20


def worker(out: str, overrides: list[str]) -> None:
    """Inside torchrun: train a few steps and write this rank's bytes to ``out``."""
    import torch

    torch.set_num_threads(1)
    from steadydiff import distributed, sharding
    from steadydiff.cli import main as cli_main
    from steadydiff.guard import update as update_mod
    from steadydiff.trainer import loop, telemetry

    seen: dict = {}
    norm = update_mod.Update.norm

    def spy_norm(self, prog):  # right after the backward pass: the gradients exist
        seen["grads"] = sharding.local_bytes(p.grad for p in self.params if p.grad is not None)
        return norm(self, prog)

    update_mod.Update.norm = spy_norm
    step = loop.train_step

    def spy_step(state, batch):
        result = step(state, batch)
        held = telemetry.held_bytes(state)  # what a sharded run's summary.json reports
        seen.update(
            weights=held["weights_bytes"], optimizer=held["optimizer_bytes"],
            ema=held["ema_bytes"], snapshots=held["snapshots_bytes"],
            snapshots_kept=held["snapshots_kept"],
            params=sum(p.numel() for p in state.update.params),
            rank=state.rank, world=state.world_size)
        return result

    loop.train_step = spy_step
    with tempfile.TemporaryDirectory() as run:
        cli_main(["train", str(CONFIG), "--out", run, "--set", *overrides])
    seen["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    Path(f"{out}.rank{seen.get('rank', distributed.rank())}").write_text(json.dumps(seen))


def run_variant(parallel: str, world: int, overrides: list[str]) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "mem")
        env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={world}", __file__, "worker", out, "--",
               *overrides, f"train.parallel={parallel}"]
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
        if r.returncode != 0:
            raise SystemExit(f"{parallel} x{world} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
        return [json.loads(Path(f"{out}.rank{i}").read_text()) for i in range(world)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="mode")
    w = sub.add_parser("worker")
    w.add_argument("out")
    w.add_argument("overrides", nargs="*")
    ap.add_argument("--preset", default="S", help="model.dit.preset (default S: DiT-S)")
    ap.add_argument("--worlds", default="2,3", help="comma-separated world sizes")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="end with one JSON line (with the "
                    "machine and the versions)")
    a = ap.parse_args()
    if a.mode == "worker":
        return worker(a.out, a.overrides)
    overrides = ["model.kind=dit", f"model.dit.preset={a.preset}", "model.dit.patch_size=2",
                 "data.image_size=16", "train.batch_size=12", f"train.steps={a.steps}",
                 "train.checkpoint_every=0", "train.sample_every=0", "logging.report=false",
                 "logging.progress=false", "optim.warmup_steps=0", "guard.snapshot_every=1",
                 "train.dist_timeout=600"]
    rows, out = [], []
    for world in [int(x) for x in a.worlds.split(",")]:
        for parallel in ("ddp", "fsdp"):
            ranks = run_variant(parallel, world, overrides)
            r = max(ranks, key=lambda x: x["weights"] + x["grads"] + x["optimizer"])
            state = r["weights"] + r["grads"] + r["optimizer"]
            out.append({"parallel": parallel, "world": world, "params": r["params"],
                        **{k: r[k] for k in ("weights", "grads", "optimizer", "ema",
                                             "snapshots", "snapshots_kept", "peak_rss")},
                        "state_bytes": state,
                        "peak_rss_per_rank": [x["peak_rss"] for x in ranks]})
            rows.append((parallel, world, r))
    ddp = {o["world"]: o["state_bytes"] for o in out if o["parallel"] == "ddp"}
    print(f"\nDiT-{a.preset}/2, {out[0]['params'] / 1e6:.1f}M parameters; the largest rank's "
          "bytes (MiB)\n")
    print("| parallel | ranks | weights | grads | AdamW | = state | vs DDP | EMA | snapshots "
          "| peak RSS |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for o in out:
        print(f"| {o['parallel']} | {o['world']} | {o['weights'] / MIB:.1f} | "
              f"{o['grads'] / MIB:.1f} | {o['optimizer'] / MIB:.1f} | "
              f"**{o['state_bytes'] / MIB:.1f}** | {o['state_bytes'] / ddp[o['world']]:.3f}× | "
              f"{o['ema'] / MIB:.1f} | {o['snapshots'] / MIB:.1f} ({o['snapshots_kept']}) | "
              f"{o['peak_rss'] / MIB:.0f} |")
    if a.json:
        sys.path.insert(0, str(Path(__file__).parent))
        from throughput import env_info

        print(json.dumps({**env_info(), "preset": a.preset, "results": out}))


if __name__ == "__main__":
    main()
