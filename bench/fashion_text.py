"""Text conditioning learns (issue 15): a from-scratch text-to-image model on Fashion-MNIST
captions, in pixel space and in a small VAE's latent space, scored by prompt accuracy.

    python bench/fashion_text.py --out runs/bench_ftext --fashion-path FM_DIR --json
    python bench/fashion_text.py --rows pixel --steps 400 --num 50      # one row, shorter

Every row trains ``configs/fashion_text.yaml`` (16x16, the 60k train split, a 32-channel
UNet with cross-attention at 8x8 and 4x4, v-prediction, min-SNR, cosine LR 2e-3, batch 64,
one thread) on the captions of ``data.captions=class_names`` ("a photo of a sneaker", ten
class names in five phrasings); the model never sees a class id. The text encoder is a tiny
**random, frozen** CLIP text model (``tiny_text_encoder(hidden=--hidden)``, 2 layers, and
the byte-level ``tiny_tokenizer()``: one token per character), written to
``OUT/text_encoder`` (no pretrained CLIP exists offline; a random transformer still gives
each class name a distinct token sequence, and the UNet's cross-attention learns to read it).

- **pixel**: the UNet on the 16x16 images.
- **latent**: first a small diffusers AutoencoderKL (``tiny_vae(channels=1,
  latent_channels=4, widths=(32, 64))``: one downsampling, 16x16 -> 4x8x8) is trained here
  on the train split (:func:`train_vae`: MSE + ``--vae-kl`` x KL per pixel, AdamW, a plain
  PyTorch loop), its reconstruction error measured on held-out test images, its
  ``scaling_factor`` set to 1/std of the posterior-mean latents of 2,000 training images
  (so the diffusion model sees latents of unit standard deviation), and saved to
  ``OUT/vae``; then the same UNet recipe is trained on its cached latents
  (``model.vae=OUT/vae``), and samples are decoded by the VAE.

Scoring (the project's offline evaluation, ``steadydiff.eval.evaluate.evaluate_samples``,
in the feature network of ``eval/features.py`` at 16 px): for each class k, ``--num``
samples with the prompt ``prompt_for("fashion_mnist", k)`` ("a photo of a sneaker") at the
config's default guidance (``sample.cfg_scale``) and sampler; **prompt accuracy** = the
fraction the feature network's classifier assigns to class k (its ``class_accuracy``);
FD-fashion_mnist of those samples against ``--num`` real train images of class k, beside
the real-vs-real floor (two disjoint real sets of class k, same N); and the same over all
classes together. The classifier's accuracy on the real test split, overall and per class,
is the reference for what "classified as k" can reach.

A row whose ``OUT/ROW.json`` exists (an earlier run into the same ``--out``) is reported
from it, not retrained: rows can be run one at a time (``--rows pixel``, then ``--rows
pixel,latent``). Times: wall and CPU seconds (``time.process_time`` of this process, one
torch thread) of each training and of the VAE's.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

import steadydiff  # noqa: E402
from steadydiff.config import load_config  # noqa: E402
from steadydiff.data import FASHION_MNIST_DIR, FashionMNISTDataset  # noqa: E402
from steadydiff.data.captions import CLASS_NAMES, prompt_for  # noqa: E402
from steadydiff.eval import features  # noqa: E402
from steadydiff.eval.evaluate import evaluate_samples  # noqa: E402
from steadydiff.eval.grid import save_grid  # noqa: E402
from throughput import env_info  # noqa: E402

CONFIG = ROOT / "configs" / "fashion_text.yaml"
ROWS = ("pixel", "latent")
NAMES = CLASS_NAMES["fashion_mnist"]


class Clock:
    """Wall and CPU seconds of a block (CPU: this process, all its threads)."""

    def __enter__(self) -> "Clock":
        self.w0, self.c0 = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        self.wall_s = round(time.perf_counter() - self.w0, 1)
        self.cpu_s = round(time.process_time() - self.c0, 1)


# --------------------------------------------------------------------------- parts


def build_text_encoder(folder: Path, hidden: int) -> Path:
    """Write a tiny random CLIP text model and the byte-level tokenizer to
    ``folder/{text_encoder,tokenizer}`` (what ``model.text_encoder`` reads); kept if there."""
    from steadydiff.integrations.sd.tiny import tiny_text_encoder, tiny_tokenizer

    if not (folder / "text_encoder" / "config.json").is_file():
        tiny_text_encoder(hidden=hidden, seed=0).save_pretrained(folder / "text_encoder")
        tiny_tokenizer().save_pretrained(folder / "tokenizer")
    return folder


def train_vae(folder: Path, path: str, image_size: int, *, steps: int, batch: int = 64,
              lr: float = 1e-3, kl: float = 1e-4, num_test: int = 1000,
              latent_channels: int = 4) -> dict:
    """Train a small AutoencoderKL on the Fashion-MNIST train split and save it to ``folder``.

    Loss: mean squared error of the reconstruction (from a posterior sample) + ``kl`` x the
    KL divergence to N(0, I) per image pixel (as in the LDM autoencoders, a small weight: it
    keeps the latents bounded without blurring). AdamW with a cosine decay, a seeded batch
    order, one thread. Then: the reconstruction error of the posterior mean on the first
    ``num_test`` test images (MSE on the [0, 1] scale and PSNR), and ``scaling_factor`` =
    1 / std of the posterior-mean latents of 2,000 training images, registered in the saved
    config (steadydiff scales latents by it, as diffusers' training scripts do).
    ``latent_channels``: 4 (SD's), 16 (SD3's and FLUX.1's; bench/flow_learns.py).
    """
    from steadydiff.integrations.sd.tiny import tiny_vae

    if (folder / "config.json").is_file() and (folder / "vae_train.json").is_file():
        return json.loads((folder / "vae_train.json").read_text())  # trained by an earlier run
    xtr = FashionMNISTDataset(image_size, 1, root=path, split="train").images_at(slice(None))
    xte = FashionMNISTDataset(image_size, 1, root=path, split="test").images_at(slice(None))
    vae = tiny_vae(channels=1, latent_channels=latent_channels, widths=(32, 64),
                   sample_size=image_size,
                   seed=0).train()
    opt = torch.optim.AdamW(vae.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, max(steps, 1), eta_min=lr * 0.1)
    g = torch.Generator().manual_seed(0)
    order = torch.empty(0, dtype=torch.long)
    rows = []
    with Clock() as clock:
        for step in range(steps):
            if order.numel() < batch:
                order = torch.cat([order, torch.randperm(len(xtr), generator=g)])
            idx, order = order[:batch], order[batch:]
            x = xtr[idx]
            post = vae.encode(x).latent_dist
            rec = vae.decode(post.sample(generator=g)).sample
            mse = F.mse_loss(rec, x)
            kld = post.kl().mean() / x[0].numel()
            loss = mse + kl * kld
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
            opt.step()
            sched.step()
            if step % 250 == 0 or step == steps - 1:
                rows.append({"step": step, "mse": round(mse.item(), 5),
                             "kl_per_pixel": round(kld.item(), 4)})
                print(f"vae step {step}: mse {mse.item():.5f} kl/px {kld.item():.4f}",
                      file=sys.stderr, flush=True)
    vae.eval().requires_grad_(False)
    with torch.no_grad():
        xt = xte[:num_test]
        rec = torch.cat([vae.decode(vae.encode(xt[i:i + 250]).latent_dist.mean).sample
                         for i in range(0, len(xt), 250)]).clamp(-1, 1)
        mse01 = float(F.mse_loss((rec + 1) / 2, (xt + 1) / 2))
        z = vae.encode(xtr[:2000]).latent_dist.mean  # (2000, 4, s, s)
        std, mean = float(z.std()), float(z.mean())
    vae.register_to_config(scaling_factor=1.0 / std)
    vae.save_pretrained(folder, safe_serialization=True)
    res = {"steps": steps, "batch_size": batch, "lr": lr, "kl_weight": kl,
           "widths": [32, 64], "latent_shape": list(z.shape[1:]),
           "parameters": sum(p.numel() for p in vae.parameters()),
           "wall_s": clock.wall_s, "cpu_s": clock.cpu_s, "log": rows,
           "test_images": len(xt), "test_mse_01": mse01,
           "test_psnr_db": 10 * math.log10(1.0 / mse01) if mse01 > 0 else None,
           "latent_std": std, "latent_mean": mean, "scaling_factor": 1.0 / std}
    (folder / "vae_train.json").write_text(json.dumps(res, indent=1))
    return res


def row_config(a: argparse.Namespace, row: str, encoder: Path, vae: Path | None):
    sets = [f"data.path={a.fashion_path}", f"model.text_encoder={encoder}",
            "logging.progress=false", "logging.report=false", "train.num_threads=1"]
    if a.steps is not None:
        sets.append(f"train.steps={a.steps}")
    if vae is not None:
        sets.append(f"model.vae={vae}")
    return load_config(CONFIG, sets + list(a.set))


def train_row(cfg, run: Path) -> dict:
    with Clock() as clock:
        res = steadydiff.train(cfg, out_dir=run)
    return {"steps": res.steps, "final_loss": res.final_loss, "incidents": res.incidents,
            "wall_s": clock.wall_s, "cpu_s": clock.cpu_s}


# --------------------------------------------------------------------------- scoring


def real_test_accuracy(fx, path: str, image_size: int) -> dict:
    """The feature network's classifier on the real test split: overall and per class."""
    te = FashionMNISTDataset(image_size, 1, root=path, split="test")
    _, p = fx(te.images_at(slice(None)))
    y, pred = te.labels.numpy(), p.argmax(1)
    return {"overall": float((pred == y).mean()),
            "per_class": [float((pred[y == k] == k).mean()) if (y == k).any() else None
                          for k in range(len(NAMES))]}


def score_row(run: Path, fx, a: argparse.Namespace, grid: Path | None) -> dict:
    """Per class k: ``--num`` samples prompted with class k's canonical prompt at the
    config's guidance, evaluated against real images of class k (class-matched subsets)."""
    pipe = steadydiff.load(run, device="cpu")
    s = pipe.config.sample
    per, xs, ys = [], [], []
    with Clock() as clock:
        for k in range(len(NAMES)):
            x, _ = pipe.sample(a.num, prompt=prompt_for("fashion_mnist", k), seed=k,
                               steps=a.sample_steps)
            y = torch.full((a.num,), k, dtype=torch.long)
            r = evaluate_samples(fx, x, y, seed=0)
            pred = torch.from_numpy(fx(x)[1].argmax(1))
            wrong = torch.bincount(pred[pred != k], minlength=len(NAMES))
            per.append({"class": k, "name": NAMES[k], "prompt": prompt_for("fashion_mnist", k),
                        "prompt_accuracy": r["class_accuracy"], "fd": r["fd"],
                        "real_floor_fd": r.get("real_floor", {}).get("fd"),
                        # the class the judge most often saw instead, and how often
                        "confused_with": NAMES[int(wrong.argmax())] if wrong.sum() else None,
                        "confused_share": float(wrong.max()) / a.num})
            xs.append(x)
            ys.append(y)
    x, y = torch.cat(xs), torch.cat(ys)
    allc = evaluate_samples(fx, x, y, seed=0)
    if grid is not None:  # one column per prompt, the first 8 samples of each
        n = min(8, a.num)
        save_grid(torch.stack([xs[k][i] for i in range(n) for k in range(len(NAMES))]),
                  grid, nrow=len(NAMES))
    return {"checkpoint_step": pipe.step, "cfg_scale": s.cfg_scale, "sampler": s.sampler,
            "sample_steps": a.sample_steps or s.steps, "num_per_class": a.num,
            "prompt_accuracy": allc["class_accuracy"], "fd": allc["fd"],
            "real_floor_fd": allc.get("real_floor", {}).get("fd"), "kid": allc["kid"],
            "precision": allc["precision"], "recall": allc["recall"],
            "num_nonfinite": allc["num_nonfinite"], "per_class": per,
            "sample_eval_wall_s": clock.wall_s, "sample_eval_cpu_s": clock.cpu_s,
            "grid": str(grid) if grid else None}


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default="runs/bench_ftext")
    p.add_argument("--fashion-path", default=str(FASHION_MNIST_DIR),
                   help="folder of the Fashion-MNIST idx files")
    p.add_argument("--rows", default="pixel,latent", help="comma-separated: pixel, latent")
    p.add_argument("--steps", type=int, default=None,
                   help="training steps per row (default: the config's train.steps)")
    p.add_argument("--num", type=int, default=100, help="samples per prompt (and real images)")
    p.add_argument("--sample-steps", type=int, default=None,
                   help="sampling steps (default: the config's sample.steps)")
    p.add_argument("--hidden", type=int, default=64, help="the text encoder's width")
    p.add_argument("--vae-steps", type=int, default=1000,
                   help="VAE optimizer steps (batch 64); ~0.5 s each on one loaded core")
    p.add_argument("--vae-kl", type=float, default=1e-4, help="KL weight (per pixel)")
    p.add_argument("--featnet-steps", type=int, default=None,
                   help="train the feature network for this many steps into OUT/featcache "
                        "(tests); default: the project's recipe and shared cache")
    p.add_argument("--grids", type=Path, default=None,
                   help="write each row's sample grid to GRIDS/fashion_text_ROW.png "
                        "(default: OUT)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra config overrides for every row")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    rows = [r for r in a.rows.split(",") if r]
    if not rows or set(rows) - set(ROWS):
        p.error(f"--rows takes a comma-separated subset of {', '.join(ROWS)}, got {a.rows!r}")
    torch.set_num_threads(1)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    encoder = build_text_encoder(out / "text_encoder", a.hidden)
    result: dict = {"config": str(CONFIG.relative_to(ROOT)), "text_encoder_hidden": a.hidden,
                    "rows": {}}

    cfg0 = row_config(a, "pixel", encoder, None)
    size = cfg0.data.image_size
    cache = None
    if a.featnet_steps is not None:
        features.RECIPE["fashion_mnist"] = (a.featnet_steps, features.RECIPE["fashion_mnist"][1])
        cache = out / "featcache"
    fx = features.feature_extractor("fashion_mnist", size, path=a.fashion_path, cache=cache)
    result["feature_net"] = {"steps": fx.meta["train_steps"],
                             "test_accuracy": fx.meta["test_accuracy"],
                             "real_test": real_test_accuracy(fx, a.fashion_path, size)}

    for row in rows:
        done = out / f"{row}.json"
        if done.is_file():  # measured by an earlier run into the same --out: kept
            result["rows"][row] = json.loads(done.read_text())
            continue
        vae = None
        r: dict = {}
        if row == "latent":
            r["vae"] = train_vae(out / "vae", a.fashion_path, size, steps=a.vae_steps,
                                 kl=a.vae_kl)
            vae = out / "vae"
        cfg = row_config(a, row, encoder, vae)
        r["train"] = train_row(cfg, out / row)
        grid = (a.grids or out) / f"fashion_text_{row}.png"
        r["eval"] = score_row(out / row, fx, a, grid)
        result["rows"][row] = r
        done.write_text(json.dumps(r, indent=1))
    result.update(env_info())
    (out / "results.json").write_text(json.dumps(result, indent=1))
    print(table(result))
    if a.json:
        print(json.dumps(result))  # the last line: one JSON object
    return 0


def _pct(v) -> str:
    return "n/a" if v is None else f"{v:.1%}"


def _f(v, spec: str = ".3f") -> str:
    return "n/a" if v is None else format(v, spec)


def table(r: dict) -> str:
    lines = ["| row | steps | train wall s | train CPU s | prompt acc. | FD-fashion_mnist | "
             "floor | KID | precision | recall |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, row in r["rows"].items():
        t, e = row["train"], row["eval"]
        lines.append(f"| {name} | {t['steps']} | {t['wall_s']} | {t['cpu_s']} | "
                     f"{_pct(e['prompt_accuracy'])} | {_f(e['fd'])} | {_f(e['real_floor_fd'])} | "
                     f"{_f(e['kid'], '.4f')} | {_f(e['precision'])} | {_f(e['recall'])} |")
    ref = r["feature_net"]["real_test"]
    lines += ["", "| class | " + " | ".join(r["rows"]) + " | real test acc. |",
              "|---|" + "---|" * (len(r["rows"]) + 1)]
    for k, name in enumerate(NAMES):
        cells = [f"{_pct(row['eval']['per_class'][k]['prompt_accuracy'])}, FD "
                 f"{_f(row['eval']['per_class'][k]['fd'], '.2f')} (floor "
                 f"{_f(row['eval']['per_class'][k]['real_floor_fd'], '.2f')})"
                 for row in r["rows"].values()]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {_pct(ref['per_class'][k])} |")
    lines.append(f"feature net: {r['feature_net']['steps']} steps, test accuracy "
                 f"{_pct(r['feature_net']['test_accuracy'])}")
    if "latent" in r["rows"]:
        v = r["rows"]["latent"]["vae"]
        lines.append(f"VAE: {v['steps']} steps, {v['wall_s']} s wall / {v['cpu_s']} s CPU; "
                     f"test MSE {v['test_mse_01']:.5f} ([0, 1] scale), PSNR "
                     f"{_f(v['test_psnr_db'], '.1f')} dB; latents {v['latent_shape']}, "
                     f"scaling_factor {v['scaling_factor']:.3f}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
