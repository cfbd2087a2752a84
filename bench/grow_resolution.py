"""Progressive resolution (issue 19): Fashion-MNIST grown 16 -> 32 against 32 from the start,
at equal compute.

    python bench/grow_resolution.py --out runs/bench_grow [--path FASHION_MNIST_DIR] [--json]

Both runs train the same unconditional UNet (16 channels x [1, 2, 2], attention at the
deepest level, v-prediction, cosine schedule, constant LR after a short warmup, batch 32,
one thread) on the 60k train split framed as 28 padded to 32 (``data.pad_to=32``):

- **grown**: ``--small-steps`` steps at 16x16, then ``steadydiff train ... --set
  data.image_size=32 --grow-resolution`` for ``--grown-steps`` more (the API's
  ``grow_resolution=True``); with ``--shift`` the run also sets
  ``diffusion.resolution_shift_base=16``, so the 32 px stage uses the simple-diffusion shift.
- **full**: ``--full-steps`` steps at 32x32 from the start.

Compute is counted as images x pixels trained on (batch x steps x side²): the defaults give
both 32 x 1024 x 500 = 16.4 M image-pixels (800 x 256 + 300 x 1024 = 500 x 1024 steps-pixels
per image); the measured wall and CPU seconds of each training are reported beside it.

Each final EMA model draws ``--num`` samples at 32x32 (DDIM, ``--sample-steps``, seed 0),
scored with the project's offline evaluation (src/steadydiff/eval: ``evaluate_samples``,
FD-fashion_mnist in the feature network's space, KID, precision/recall) against ``--num``
real images, with the real-vs-real floor at the same N. The feature network is the
project's, at 32 px on the padded framing, but trained for ``--featnet-steps`` (default 600,
instead of its 2000: CPU time) into this benchmark's own cache folder (``OUT/featcache``), so
no shortened network enters the shared cache; its test accuracy is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

sys.path.insert(0, str(ROOT / "bench"))

import steadydiff  # noqa: E402
from steadydiff.config import load_config  # noqa: E402
from steadydiff.data import FASHION_MNIST_DIR  # noqa: E402
from steadydiff.eval import features  # noqa: E402
from steadydiff.eval.evaluate import evaluate_samples  # noqa: E402
from throughput import env_info  # noqa: E402


def base_overrides(a: argparse.Namespace) -> list[str]:
    return [
        "data.dataset=fashion_mnist", f"data.path={a.path}", "data.pad_to=32",
        "model.num_classes=0", "model.unet.channels=16", "model.unet.channel_mult=[1,2,2]",
        "model.unet.num_res_blocks=1", "model.unet.head_channels=16", "model.unet.norm_groups=8",
        "diffusion.timesteps=1000", "diffusion.schedule=cosine", "diffusion.prediction=v",
        "diffusion.loss_weighting=min_snr",
        "optim.lr=1e-3", f"optim.warmup_steps={a.warmup}", "optim.schedule=constant",
        "optim.grad_clip=1.0",
        "train.batch_size=32", "train.seed=0", "train.checkpoint_every=0", "train.sample_every=0",
        "train.ema_decay=0.99", "train.num_threads=1",
        "sample.num=16", "sample.sampler=ddim", "sample.steps=10", "sample.cfg_scale=1.0",
        "eval.every=0", "logging.log_every=50", "logging.progress=false",
        "logging.report=false",
    ] + (["diffusion.resolution_shift_base=16"] if a.shift else [])


def timed_train(cfg, out: Path, **kw) -> dict:
    w0, c0 = time.perf_counter(), time.process_time()
    res = steadydiff.train(cfg, out_dir=out, **kw)
    return {"steps": res.steps, "wall_s": round(time.perf_counter() - w0, 1),
            "cpu_s": round(time.process_time() - c0, 1), "final_loss": res.final_loss,
            "incidents": res.incidents}


def metered_seconds(run: Path) -> dict:
    """Training wall seconds as the trainer measured them (metrics.jsonl: each row's
    ``sec_per_step`` averages the steps since the row before), per resolution."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    hist = json.loads((ckpt_dir(run) / "state.json").read_text()).get("resolution_history", [])
    change = hist[0]["step"] if hist else None
    out: dict[str, float] = {}
    prev = 0
    for r in rows:
        key = "16px" if change is not None and r["step"] <= change else "32px"
        out[key] = out.get(key, 0.0) + r["sec_per_step"] * (r["step"] - prev)
        prev = r["step"]
    out = {k: round(v, 1) for k, v in out.items()}
    out["total"] = round(sum(out.values()), 1)
    return out


def ckpt_dir(run: Path) -> Path:
    from steadydiff.trainer import checkpoint as ckpt
    return ckpt.latest_good(run / "checkpoints")


def score(run: Path, fx, a: argparse.Namespace) -> dict:
    t0 = time.perf_counter()
    pipe = steadydiff.load(run)
    x, _ = pipe.sample(a.num, sampler="ddim", steps=a.sample_steps, seed=0)
    res = evaluate_samples(fx, x, None, seed=0)
    res["sample_eval_s"] = round(time.perf_counter() - t0, 1)
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/bench_grow")
    p.add_argument("--path", default=str(FASHION_MNIST_DIR),
                   help="folder of the Fashion-MNIST idx files")
    p.add_argument("--small-steps", type=int, default=800, help="grown run: steps at 16 px")
    p.add_argument("--grown-steps", type=int, default=300, help="grown run: steps at 32 px")
    p.add_argument("--full-steps", type=int, default=500, help="full run: steps at 32 px")
    p.add_argument("--num", type=int, default=500, help="samples per model (and real images)")
    p.add_argument("--sample-steps", type=int, default=20)
    p.add_argument("--featnet-steps", type=int, default=600)
    p.add_argument("--warmup", type=int, default=50, help="optim.warmup_steps (constant LR after)")
    p.add_argument("--shift", action="store_true",
                   help="the grown run sets diffusion.resolution_shift_base=16")
    p.add_argument("--stage", choices=["all", "grown", "full", "score"], default="all",
                   help="run one part (the two trainings may run in parallel, then score)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()
    base = base_overrides(a)

    px16, px32 = 16 * 16, 32 * 32
    grown_px = a.small_steps * px16 + a.grown_steps * px32
    full_px = a.full_steps * px32
    result: dict = {"compute_image_pixels": {"grown": grown_px * 32, "full": full_px * 32}}

    if a.stage in ("all", "grown"):
        # grown: 16 px, then --grow-resolution to 32 px (the same run directory)
        small = load_config(None, base + ["data.image_size=16",
                                          "model.unet.attention_resolutions=[4]",
                                          f"train.steps={a.small_steps}"])
        r16 = timed_train(small, out / "grown")
        big = load_config(None, base + ["data.image_size=32",
                                        "model.unet.attention_resolutions=[4]",
                                        f"train.steps={a.small_steps + a.grown_steps}"])
        r32 = timed_train(big, out / "grown", grow_resolution=True)
        stage = {"stage16": r16, "stage32": r32, "wall_s": round(r16["wall_s"] + r32["wall_s"], 1),
                 "cpu_s": round(r16["cpu_s"] + r32["cpu_s"], 1)}
        (out / "grown.json").write_text(json.dumps(stage))
    if a.stage in ("all", "full"):
        full = load_config(None, base + ["data.image_size=32",
                                         "model.unet.attention_resolutions=[8]",
                                         f"train.steps={a.full_steps}"])
        (out / "full.json").write_text(json.dumps(timed_train(full, out / "full")))
    if a.stage in ("grown", "full"):
        return 0
    planned = {"grown": a.small_steps + a.grown_steps, "full": a.full_steps}
    ready = []
    for name in ("grown", "full"):
        run = out / name
        c = ckpt_dir(run) if (run / "checkpoints").is_dir() else None
        step = json.loads((c / "state.json").read_text())["step"] if c else None
        if step != planned[name]:  # still training (--stage in parallel): scored later
            print(f"{name}: not finished (checkpoint step {step} of {planned[name]})")
            continue
        f = out / f"{name}.json"
        result[name] = json.loads(f.read_text()) if f.is_file() else {}
        result[name]["metered_train_s"] = metered_seconds(run)
        result[name]["final_step"] = step
        ready.append(name)
    if "grown" in ready:
        rows = [json.loads(line) for line in (out / "grown" / "incidents.jsonl").read_text()
                .splitlines()]
        result["grown"]["incident_kinds"] = [r["kind"] for r in rows]

    # the project's feature network at 32 px, padded framing, shortened recipe, own cache
    features.RECIPE["fashion_mnist"] = (a.featnet_steps, features.RECIPE["fashion_mnist"][1])
    t0 = time.perf_counter()
    fx = features.feature_extractor("fashion_mnist", 32, path=a.path, pad_to=32,
                                    cache=out / "featcache")
    result["feature_net"] = {"steps": a.featnet_steps, "test_accuracy": fx.meta["test_accuracy"],
                             "seconds": round(time.perf_counter() - t0, 1)}
    for name in ready:
        # a run scored by an earlier --stage score (same checkpoint, N, steps) is reused
        cached, key = out / f"eval_{name}.json", [result[name]["final_step"], a.num,
                                                  a.sample_steps, a.featnet_steps]
        old = json.loads(cached.read_text()) if cached.is_file() else {}
        if old.get("key") == key:
            result[name]["eval"] = old["eval"]
        else:
            result[name]["eval"] = score(out / name, fx, a)
            cached.write_text(json.dumps({"key": key, "eval": result[name]["eval"]}))
    if len(ready) < 2:
        print(f"scored {ready}; run --stage score again when both runs are finished")
        return 0
    result["total_s"] = round(time.perf_counter() - t_all, 1)
    result.update(env_info())
    (out / "results.json").write_text(json.dumps(result, indent=1))
    print(table(result))
    if a.json:
        print(json.dumps(result))  # the last line: one JSON object
    return 0


def table(r: dict) -> str:
    lines = ["| run | compute (image-pixels) | train wall s (metered) | train CPU s | "
             "FD-fashion_mnist | KID | precision | recall |", "|---|---|---|---|---|---|---|---|"]
    for name in ("grown", "full"):
        e, m = r[name]["eval"], r[name]["metered_train_s"]
        lines.append(f"| {name} | {r['compute_image_pixels'][name] / 1e6:.1f} M | "
                     f"{m['total']} ({', '.join(f'{k} {v}' for k, v in m.items() if k != 'total')})"
                     f" | {r[name].get('cpu_s', '-')} | {e['fd']:.3f} | "
                     f"{e['kid']:.4f} | {e['precision']:.3f} | {e['recall']:.3f} |")
    f = r["grown"]["eval"].get("real_floor", {})
    if f:
        lines.append(f"| real vs real (N={r['grown']['eval']['num']}) | | | | {f['fd']:.3f} | "
                     f"{f['kid']:.4f} | {f['precision']:.3f} | {f['recall']:.3f} |")
    lines.append(f"feature net: {r['feature_net']['steps']} steps, test accuracy "
                 f"{r['feature_net']['test_accuracy']:.1%}; total {r['total_s']} s")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
