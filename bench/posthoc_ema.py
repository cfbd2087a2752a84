"""Post-hoc EMA vs fixed-decay EMAs of the same run, at a fixed training budget (issue 19).

For each dataset config, one run is trained with ``train.ema_posthoc=true`` (EDM2's two
profiles, sigma_rel 0.05 and 0.10). The same loop (steadydiff's ``train_step`` and
``handle_decision``, the trainer's own EMA class) also carries fixed-decay EMAs (by default
0.99, 0.999 and 0.9999, with the trainer's default warm-up; ``--warmups both`` adds them
without it), updated on exactly the
steps the trainer's EMA sees. At the end the post-hoc EMA is reconstructed at a range of
sigma_rel from the stored snapshots (``steadydiff.posthoc``), and every EMA, fixed or
post-hoc, is sampled with the same noise and labels and measured with the project's offline
FD (``steadydiff.eval``) against the same real subset; the real-vs-real FD at the same N is
the floor. It reports the best post-hoc EMA (and its sigma_rel) against the best fixed one.

    python bench/posthoc_ema.py --steps 100 --every 10 --num 128 --sample-steps 10 --json
    python bench/posthoc_ema.py --configs configs/digits_cond.yaml --steps 100 --num 64

Fashion-MNIST needs its files (``--fashion-path`` or ``data.path`` in the config).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import env_info, print_table  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def train(cfg, run_dir: Path, decays: list[float], warmups: tuple[bool, ...]) -> dict:
    """Train ``cfg`` into ``run_dir`` with the trainer's step function, the post-hoc
    profiles and extra fixed-decay EMAs; store snapshots like the trainer, save a final
    checkpoint. Returns the fixed EMAs' weights and the timing."""
    from steadydiff.data import build_dataset, make_loader
    from steadydiff.rundir import RunDir
    from steadydiff.trainer import loop
    from steadydiff.trainer.ema import EMA

    dev = torch.device("cpu")
    loop.configure_runtime(cfg, dev)
    data = build_dataset(cfg.data)
    state = loop.build_state(cfg, cfg.model.num_classes, dev)
    guard = loop.attach_guard(state, None)
    extra = {(d, w): EMA(state.model, d, warmup=w) for d in decays for w in warmups}
    run = RunDir(run_dir)
    run.root.mkdir(parents=True, exist_ok=True)
    run.config.write_text(cfg.to_yaml())

    def batches_from(pos: int):
        return iter(make_loader(data, batch_size=cfg.train.batch_size, seed=cfg.train.seed,
                                start_batch=pos, hflip=cfg.data.hflip,
                                exclude=guard.quarantine if guard else (),
                                num_classes=cfg.model.num_classes))

    t0 = time.perf_counter()
    batches, pos, interventions = batches_from(0), 0, 0
    while state.step < cfg.train.steps:
        out = loop.train_step(state, next(batches))
        pos += 1
        how = loop.handle_decision(state, out.decision, lambda *_: None)
        if how == "stepped":
            for e in extra.values():  # the trainer's EMA rule, on the trainer's steps
                e.update(state.model, state.step - 1)
            loop.store_posthoc(state, run, force=state.step == cfg.train.steps)
        else:
            interventions += 1
            if how == "rolled_back":
                raise SystemExit("the guard rolled back: the fixed EMAs here would not follow")
        if state.batches_consumed != pos or out.decision.quarantined:
            batches, pos = batches_from(state.batches_consumed), state.batches_consumed
    train_s = time.perf_counter() - t0
    loop.save(state, run)
    fixed = {k: {n: p.detach().clone() for n, p in e.module.named_parameters()}
             for k, e in extra.items()}
    return {"fixed": fixed, "train_seconds": train_s, "interventions": interventions,
            "trainer_ema": (cfg.train.ema_decay, cfg.train.ema_warmup)}


def bench_one(config: Path, args, out_root: Path) -> dict:
    from steadydiff import posthoc
    from steadydiff.config import load_config
    from steadydiff.trainer import checkpoint as ckpt

    sets = [f"train.steps={args.steps}", "train.ema_posthoc=true",
            f"train.ema_posthoc_every={args.every}", "train.num_threads=1",
            "logging.progress=false", "eval.every=0", "train.checkpoint_every=0"]
    if "fashion" in config.name and args.fashion_path:
        sets.append(f"data.path={args.fashion_path}")
    sets += args.overrides
    cfg = load_config(config, sets)
    run_dir = out_root / config.stem
    if run_dir.exists():
        raise SystemExit(f"{run_dir} exists: pass a new --out")
    t0 = time.perf_counter()
    tr = train(cfg, run_dir, args.decays, (True, False) if args.warmups == "both" else
               (args.warmups == "on",))
    snaps = posthoc.find_snapshots(run_dir)
    c = ckpt.load_checkpoint(snaps.checkpoint)
    t1 = time.perf_counter()
    measure = posthoc.Measure(c, num=args.num, steps=args.sample_steps, seed=0, device="cpu")
    rows, real_floor = [], None
    for i, ((d, w), ema) in enumerate(tr["fixed"].items()):
        r = measure(ema, floor=i == 0)  # the real-vs-real floor once: the same real subset
        floor = r.pop("real_floor_fd")
        real_floor = floor if i == 0 else real_floor
        rows.append({"ema": f"fixed {d:g}" + (" (warm-up)" if w else ""), "decay": d,
                     "warmup": w, **r})
    for ema, fit in posthoc.reconstruct(snaps, args.sigma_rels):
        r = measure(ema)
        r.pop("real_floor_fd")
        rows.append({"ema": f"post-hoc sigma_rel={fit['sigma_rel']:g}",
                     "sigma_rel": fit["sigma_rel"], "residual": fit["residual"], **r})
    fixed_rows = [r for r in rows if "decay" in r and r["fd"] is not None]
    post_rows = [r for r in rows if "sigma_rel" in r and r["fd"] is not None]
    best_fixed = min(fixed_rows, key=lambda r: r["fd"])
    best_post = min(post_rows, key=lambda r: r["fd"])
    return {"config": str(config), "dataset": cfg.data.dataset, "steps": cfg.train.steps,
            "batch_size": cfg.train.batch_size, "snapshots": len(snaps.entries),
            "profiles": list(snaps.sigma_rels), "num": args.num,
            "sample_steps": args.sample_steps or cfg.sample.steps,
            "train_seconds": round(tr["train_seconds"], 1),
            "eval_seconds": round(time.perf_counter() - t1, 1),
            "seconds": round(time.perf_counter() - t0, 1),
            "guard_interventions": tr["interventions"], "real_floor_fd": real_floor,
            "rows": rows, "best_fixed": best_fixed["ema"], "best_fixed_fd": best_fixed["fd"],
            "best_posthoc_sigma_rel": best_post["sigma_rel"],
            "best_posthoc_fd": best_post["fd"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--configs", nargs="+", type=Path,
                   default=[ROOT / "configs/digits_cond.yaml", ROOT / "configs/fashion_mnist.yaml"])
    p.add_argument("--steps", type=int, default=100, help="training budget (optimizer steps)")
    p.add_argument("--every", type=int, default=10, help="train.ema_posthoc_every")
    p.add_argument("--num", type=int, default=128, help="samples per evaluated EMA")
    p.add_argument("--sample-steps", type=int, default=10, help="sampling steps per sample")
    p.add_argument("--decays", type=lambda s: [float(v) for v in s.split(",")],
                   default=[0.99, 0.999, 0.9999])
    p.add_argument("--warmups", choices=["on", "off", "both"], default="on",
                   help="fixed EMAs with the trainer's warm-up min(decay, (1+n)/(10+n)) "
                        "(train.ema_warmup's default), without it, or both")
    p.add_argument("--sigma-rels", type=lambda s: [float(v) for v in s.split(",")],
                   default=[0.03, 0.05, 0.08, 0.13, 0.2])
    p.add_argument("--fashion-path", default=None, help="Fashion-MNIST's idx.gz folder")
    p.add_argument("--set", dest="overrides", nargs="+", default=[], metavar="KEY=VALUE",
                   help="more config overrides, for every config (e.g. a smaller model)")
    p.add_argument("--out", type=Path, default=Path("runs/bench_posthoc"))
    p.add_argument("--json", action="store_true", help="end with one JSON line")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    results = []
    for config in a.configs:
        res = bench_one(config, a, a.out)
        results.append(res)
        print(f"\n{res['dataset']} ({res['steps']} steps x batch {res['batch_size']}, "
              f"{res['snapshots']} snapshots, N={res['num']}, {res['sample_steps']} sampling "
              f"steps; train {res['train_seconds']}s, eval {res['eval_seconds']}s):")
        print_table([[r["ema"], r["fd"], r.get("residual", "")] for r in res["rows"]],
                    ["EMA", f"FD-{res['dataset']}", "kernel fit residual"])
        print(f"real-vs-real floor: {res['real_floor_fd']:.3f}; best fixed: "
              f"{res['best_fixed']} FD {res['best_fixed_fd']:.3f}; best post-hoc: sigma_rel="
              f"{res['best_posthoc_sigma_rel']:g} FD {res['best_posthoc_fd']:.3f}")
    if a.json:
        print(json.dumps({**env_info(), "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
