"""ControlNet (issue 30): the control is learned, and what a steadydiff ControlNet step costs.

Two bars, each a subcommand:

    python bench/controlnet.py learned --out runs/bench_cn --json
    python bench/controlnet.py overhead --json
    python bench/controlnet.py learned --out /tmp/cn --n-train 256 --vae-steps 20 \\
        --base-steps 10 --cn-steps 10 --num 8 --sample-steps 4 --featnet-steps 50  # smoke

**learned** — a small Stable Diffusion-shaped model trained here, then a Canny ControlNet on
it, all through ``steadydiff train``:

1. data: the first ``--n-train`` Fashion-MNIST training images at ``--image-size`` (32;
   gray) written as a
   folder with the caption ``"a photo of a <class>"`` beside each, and their Canny edges
   (``steadydiff condition --kind canny --low 100 --high 200``) in ``conditioning/``;
   held-out: the first ``--num`` test images' Canny edges, never trained on;
2. the base: a small AutoencoderKL trained here (``fashion_text.train_vae``: 1 channel, 2x
   downsampling: 4x16x16 latents at 32 px), a frozen random tiny CLIP text encoder (its
   byte-level
   tokenizer), and a diffusers UNet2DConditionModel (widths 64, 128, cross-attention at both
   levels) trained from random init (a full fine-tune of the folder's random UNet) for
   ``--base-steps``; its export ``BASE/model`` is a diffusers SD folder;
3. the ControlNet: ``controlnet.enabled`` over that folder (``from_unet``), ``--cn-steps``
   steps; its wall and CPU time are the "within 30 CPU-minutes" figure;
4. scoring, for each held-out edge map and its class prompt, the same noise drawn twice:
   with the ControlNet (scale 1) and without (scale 0: the base alone); each sample's own
   Canny edges (same thresholds) against the conditioning edges: precision, recall and F1
   with a one-pixel tolerance (an edge pixel counts as matched when the other map has an
   edge within one pixel), averaged over images; and the class prompt: the project's
   Fashion-MNIST classifier (``eval/features.py``, at the image size) on the samples, with
   and without
   the control.

**overhead** — ``bench/sd_overhead.py``'s setup (tiny SD components, 16x16 latents, one
thread, variants interleaved repeat by repeat) with a ControlNet from the UNet: ``bare`` is
the loop of diffusers' ``train_controlnet.py`` (the frozen UNet, ``add_noise``, the
ControlNet's residuals into the UNet, MSE, backward, ``clip_grad_norm_(1.0)``, AdamW,
``lr_scheduler.step()``, ``zero_grad``, a ``.item()`` every 10 steps); ``steadydiff`` is the
trainer's ``train_step`` + ``handle_decision`` on a TrainState built from a folder holding the
same UNet with ``controlnet.enabled`` (guard on, deferred check, EMA of the ControlNet), the
conditioning image riding in y as in a run. Both see the same latents, text states,
conditioning images, timesteps and noise at step i. The bar: steadydiff <= 1.05x bare.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from throughput import env_info, print_table  # noqa: E402

NAMES = ("T-shirt/top", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker",
         "bag", "ankle boot")
CANNY = {"low": 100, "high": 200}


class Clock:
    """Wall and CPU seconds of a block (CPU: this process)."""

    def __enter__(self) -> "Clock":
        self.w0, self.c0 = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        self.wall_s = round(time.perf_counter() - self.w0, 1)
        self.cpu_s = round(time.process_time() - self.c0, 1)


def load_avg() -> list[float]:
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return []


# =========================================================================== learned


def write_data(out: Path, fm: str, n: int, split: str, captions: bool,
               size: int = 32) -> tuple[Path, list[int]]:
    """The first ``n`` images of a Fashion-MNIST split as ``size``-pixel gray PNGs (+
    captions), and their labels."""
    from PIL import Image

    from steadydiff.data import FashionMNISTDataset
    from steadydiff.data.captions import prompt_for

    ds = FashionMNISTDataset(size, 1, root=fm, split=split)
    x = ds.images_at(slice(0, n))  # (n, 1, size, size) in [-1, 1]
    labels = ds.labels[:n].tolist()
    out.mkdir(parents=True, exist_ok=True)
    a = ((x[:, 0] + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).numpy()
    for i in range(n):
        Image.fromarray(a[i], "L").save(out / f"{i:05d}.png")
        if captions:
            (out / f"{i:05d}.txt").write_text(prompt_for("fashion_mnist", labels[i]))
    return out, labels


def build_base_folder(out: Path, vae_dir: Path, size: int, hidden: int = 64) -> Path:
    """A Stable Diffusion folder: the VAE trained here, a random frozen tiny CLIP, a random
    2-level UNet with cross-attention at both levels, the SD 1.x scheduler config."""
    from diffusers import (AutoencoderKL, PNDMScheduler, StableDiffusionPipeline,
                           UNet2DConditionModel)

    from steadydiff.integrations.sd.tiny import tiny_text_encoder, tiny_tokenizer

    if (out / "model_index.json").is_file():
        return out
    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        sample_size=size // 2, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=(64, 128),
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=hidden, attention_head_dim=8, norm_num_groups=16)
    sched = PNDMScheduler(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012,
                          beta_schedule="scaled_linear", prediction_type="epsilon",
                          set_alpha_to_one=False, skip_prk_steps=True, steps_offset=1)
    StableDiffusionPipeline(
        unet=unet, vae=AutoencoderKL.from_pretrained(vae_dir),
        text_encoder=tiny_text_encoder(hidden, seed=0), tokenizer=tiny_tokenizer(),
        scheduler=sched, safety_checker=None, feature_extractor=None,
        requires_safety_checker=False).save_pretrained(out, safe_serialization=True)
    return out


def run_config(pretrained: Path, data: Path, steps: int, lr: float, batch: int, size: int,
               *sets: str):
    from steadydiff.config import load_config

    return load_config(None, [
        f"model.pretrained={pretrained}", "data.dataset=folder", f"data.path={data}",
        "data.captions=txt", f"data.image_size={size}", "data.channels=1",
        "adapter.kind=none",
        f"train.steps={steps}", f"train.batch_size={batch}", "train.precision=fp32",
        "train.num_threads=1", "train.device=cpu", f"optim.lr={lr}", "optim.warmup_steps=50",
        "optim.schedule=cosine", "train.ema_decay=0.99", f"train.checkpoint_every={steps}",
        "train.sample_every=0", "logging.log_every=50", "logging.progress=false",
        "diffusion.cfg_dropout=0.1", "sample.sampler=dpmpp_2m", "sample.steps=25",
        "sample.cfg_scale=2.0", "sample.num=10",
        "sample.prompts=" + json.dumps([f"a photo of a {n}" if n[0] not in "aeiou"
                                        else f"a photo of an {n}" for n in NAMES]),
        *sets])


def edges(x: torch.Tensor) -> np.ndarray:
    """(N, 1, H, W) in [-1, 1] -> (N, H, W) bool Canny edges at the bench's thresholds."""
    import cv2

    a = ((x[:, 0].clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).numpy()
    return np.stack([cv2.Canny(im, CANNY["low"], CANNY["high"]) > 0 for im in a])


def edge_f1(pred: np.ndarray, ref: np.ndarray) -> dict[str, float]:
    """Mean over images of precision, recall and F1 of ``pred`` edges against ``ref`` edges
    with a one-pixel tolerance (3x3 dilation of the other map)."""
    import cv2

    k = np.ones((3, 3), np.uint8)
    ps, rs, fs = [], [], []
    for p, r in zip(pred, ref):
        pd = cv2.dilate(p.astype(np.uint8), k) > 0
        rd = cv2.dilate(r.astype(np.uint8), k) > 0
        prec = float((p & rd).sum() / p.sum()) if p.sum() else 0.0
        rec = float((r & pd).sum() / r.sum()) if r.sum() else 0.0
        ps.append(prec)
        rs.append(rec)
        fs.append(2 * prec * rec / (prec + rec) if prec + rec else 0.0)
    return {"precision": float(np.mean(ps)), "recall": float(np.mean(rs)),
            "f1": float(np.mean(fs))}


def score(run: Path, held: Path, labels: list[int], fx, steps: int, size: int,
          seed: int = 0) -> dict:
    """Samples with and without the ControlNet for every held-out edge map (same noise)."""
    import steadydiff
    from steadydiff.data.captions import prompt_for
    from steadydiff.integrations.controlnet import load_control_image

    pipe = steadydiff.load(run, device="cpu")
    files = sorted((held / "conditioning").glob("*.png"))
    conds = torch.cat([load_control_image(f, size, size) for f in files])  # (M, 3, S, S)
    ref = np.stack([(c[0] > 0.5).numpy() for c in conds])
    out: dict[str, Any] = {}
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(len(files), 4, size // 2, size // 2, generator=g)
    prompts = [prompt_for("fashion_mnist", k) for k in labels[:len(files)]]
    samples = {}
    with Clock() as clock:
        for name, scale in (("with_controlnet", 1.0), ("base_alone", 0.0)):
            xs = []
            for i in range(0, len(files), 25):
                x, _ = pipe.sample(prompt=prompts[i:i + 25], noise=z[i:i + 25],
                                   control_image=conds[i:i + 25], control_scale=scale,
                                   steps=steps)
                xs.append(x)
            x = torch.cat(xs)
            samples[name] = x
            _, p = fx(x)
            acc = float((p.argmax(1) == np.asarray(labels[:len(files)])).mean())
            out[name] = {**edge_f1(edges(x), ref), "class_accuracy": acc}
    out["images"] = len(files)
    out["sample_wall_s"], out["sample_cpu_s"] = clock.wall_s, clock.cpu_s
    out["samples"] = samples
    return out


def learned(a: argparse.Namespace) -> dict:
    import steadydiff
    from steadydiff.data.conditioning import make_conditioning
    from steadydiff.eval import features
    from steadydiff.eval.grid import save_grid
    from steadydiff.integrations.controlnet import load_control_image

    from fashion_text import train_vae

    torch.set_num_threads(1)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {"bench": "controlnet_learned", "load_at_start": load_avg()}
    size = a.image_size
    data, _ = write_data(out / "data", a.fashion_path, a.n_train, "train", True, size)
    edges_dir = out / "edges"  # beside the images: the base run trains on data/ alone
    if not (edges_dir / "conditioning.json").is_file():
        make_conditioning(data, edges_dir, "canny", CANNY)
    held, labels = write_data(out / "held", a.fashion_path, a.num, "test", False, size)
    if not (held / "conditioning" / "conditioning.json").is_file():
        make_conditioning(held, None, "canny", CANNY)
    res["data"] = {"train": a.n_train, "held_out": a.num, "canny": CANNY, "image_size": size}

    with Clock() as c:
        res["vae"] = train_vae(out / "vae", a.fashion_path, size, steps=a.vae_steps)
    res["vae"]["this_run_wall_s"] = c.wall_s
    sd = build_base_folder(out / "sd", out / "vae", size)

    with Clock() as c:
        base = steadydiff.train(run_config(sd, data, a.base_steps, a.base_lr, a.batch, size),
                                out_dir=out / "base")
    res["base"] = {"steps": base.steps, "final_loss": base.final_loss,
                   "incidents": base.incidents, "wall_s": c.wall_s, "cpu_s": c.cpu_s,
                   "load_after": load_avg()}
    with Clock() as c:
        cn = steadydiff.train(run_config(out / "base" / "model", data, a.cn_steps, a.cn_lr,
                                         a.batch, size, "controlnet.enabled=true",
                                         "data.conditioning=folder",
                                         f"data.conditioning_dir={edges_dir.resolve()}"),
                        out_dir=out / "cn")
    res["controlnet"] = {"steps": cn.steps, "final_loss": cn.final_loss,
                         "incidents": cn.incidents, "wall_s": c.wall_s, "cpu_s": c.cpu_s,
                         "cpu_minutes": round(c.cpu_s / 60, 1), "load_after": load_avg()}

    cache = None
    if a.featnet_steps is not None:
        features.RECIPE["fashion_mnist"] = (a.featnet_steps, features.RECIPE["fashion_mnist"][1])
        cache = out / "featcache"
    fx = features.feature_extractor("fashion_mnist", size, path=a.fashion_path, cache=cache)
    res["feature_net"] = {"steps": fx.meta["train_steps"],
                          "test_accuracy": fx.meta["test_accuracy"]}
    sc = score(out / "cn", held, labels, fx, a.sample_steps, size)
    samples = sc.pop("samples")
    n = min(10, sc["images"])
    conds = torch.cat([load_control_image(f, size, size, 1) for f in
                       sorted((held / "conditioning").glob("*.png"))[:n]])
    # rows: the held-out edges, the samples with the ControlNet, the base's
    grid = torch.cat([conds * 2 - 1, samples["with_controlnet"][:n], samples["base_alone"][:n]])
    save_grid(grid, out / "controlnet_samples.png", nrow=n)
    res["score"] = sc
    res["grid"] = str(out / "controlnet_samples.png")
    res["load_at_end"] = load_avg()
    res.update(env_info())
    return res


# =========================================================================== overhead


def overhead(a: argparse.Namespace) -> dict:
    import sd_overhead as sdo

    torch.set_num_threads(a.threads)
    device = torch.device("cpu")
    s = sdo.build_setup(device, batch=a.batch, latent_size=a.latent_size, seed=0)
    side = 2 * a.latent_size
    g = torch.Generator().manual_seed(1)
    cond = (torch.rand(len(s.latents), 3, side, side, generator=g) > 0.9).float()

    def controlnet_for(unet):
        from diffusers import ControlNetModel

        from steadydiff.integrations.controlnet import embedding_widths

        torch.manual_seed(0)
        return ControlNetModel.from_unet(unet, conditioning_embedding_out_channels=
                                         embedding_widths(2))

    def bare(clock: sdo.Clock) -> Callable[[int], None]:
        from diffusers import UNet2DConditionModel
        from diffusers.optimization import get_scheduler

        unet = UNet2DConditionModel.from_config(s.unet_config)
        unet.load_state_dict(s.unet_state)
        unet.requires_grad_(False)
        net = controlnet_for(unet).train()
        opt = torch.optim.AdamW(net.parameters(), lr=s.lr, weight_decay=1e-2)
        sched = get_scheduler("constant", opt)

        def step(i: int) -> None:
            idx = s.indices(i)
            latents, states, c = s.latents[idx], s.text[idx], cond[idx]
            gen = torch.Generator().manual_seed(i)
            noise = torch.randn(latents.shape, generator=gen)
            t = torch.randint(0, s.T, (latents.shape[0],), generator=gen)
            noisy = s.noise_scheduler.add_noise(latents, noise, t)
            down, mid = net(noisy, t, encoder_hidden_states=states, controlnet_cond=c,
                            return_dict=False)
            pred = unet(noisy, t, encoder_hidden_states=states,
                        down_block_additional_residuals=down,
                        mid_block_additional_residual=mid, return_dict=False)[0]
            loss = F.mse_loss(pred.float(), noise.float())
            loss.backward()
            clock.start()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            clock.stop()
            if i % 10 == 0:
                loss.item()
        return step

    def ours(clock: sdo.Clock) -> Callable[[int], None]:
        import tempfile

        from diffusers import StableDiffusionPipeline, UNet2DConditionModel

        from steadydiff.config import load_config
        from steadydiff.data.cache import append_rows
        from steadydiff.integrations.sd.source import resolve_config
        from steadydiff.integrations.sd.tiny import tiny_text_encoder, tiny_tokenizer, tiny_vae
        from steadydiff.trainer.loop import (attach_guard, build_state, handle_decision,
                                             train_step)

        root = Path(tempfile.mkdtemp(prefix="cn-overhead-")) / "sd"
        unet = UNet2DConditionModel.from_config(s.unet_config)
        unet.load_state_dict(s.unet_state)
        StableDiffusionPipeline(
            unet=unet, vae=tiny_vae(sample_size=side), text_encoder=tiny_text_encoder(32),
            tokenizer=tiny_tokenizer(), scheduler=s.noise_scheduler, safety_checker=None,
            feature_extractor=None, requires_safety_checker=False).save_pretrained(root)
        cfg = load_config(None, [
            f"model.pretrained={root}", "data.dataset=folder", f"data.path={root}",
            "data.captions=auto", f"data.image_size={side}", "data.channels=3",
            "adapter.kind=none", "controlnet.enabled=true", f"optim.lr={s.lr}",
            "optim.weight_decay=0.01", "optim.grad_clip=1.0", "optim.warmup_steps=0",
            f"train.batch_size={s.batch}", "train.steps=1000000", "train.seed=0",
            "diffusion.cfg_dropout=0.0", "train.device=cpu"])
        cfg, _ = resolve_config(cfg)
        torch.manual_seed(0)
        state = build_state(cfg, 0, device)
        guard = attach_guard(state, None, defer=True)
        ys = torch.stack([append_rows(s.text[k], cond[k]) for k in range(len(s.text))])

        def step(i: int) -> None:
            idx = s.indices(i)
            out = train_step(state, (s.latents[idx], ys[idx], idx))
            if handle_decision(state, out.decision, say=lambda *_: None) != "stepped":
                raise RuntimeError(f"the trainer did not step a healthy step {i}")
            if guard.due() and guard.flush().rewind is not None:
                raise RuntimeError(f"the guard redid a window of a healthy run at step {i}")
        return step

    variants = {"bare": bare, "steadydiff": ours}
    clocks = {n: sdo.Clock(device) for n in variants}
    runs = {n: build(clocks[n]) for n, build in variants.items()}
    done = dict.fromkeys(runs, 0)
    for n, step in runs.items():
        for _ in range(a.warmup):
            step(done[n])
            done[n] += 1
    times: dict[str, list[float]] = {n: [] for n in runs}
    cpu: dict[str, list[float]] = {n: [] for n in runs}
    load0 = load_avg()
    for _ in range(a.repeats):
        for n, step in runs.items():
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(a.steps):
                step(done[n])
                done[n] += 1
            times[n].append((time.perf_counter() - t0) / a.steps)
            cpu[n].append((time.process_time() - c0) / a.steps)
    med = {n: statistics.median(v) for n, v in times.items()}
    med_cpu = {n: statistics.median(v) for n, v in cpu.items()}
    res = {"bench": "controlnet_overhead", "steps": a.steps, "repeats": a.repeats,
           "warmup": a.warmup, "batch": a.batch, "latent_size": a.latent_size,
           "unet_params": sum(v.numel() for v in s.unet_state.values()),
           "repeats_sec_per_step": times, "sec_per_step": med,
           "repeats_cpu_sec_per_step": cpu, "cpu_sec_per_step": med_cpu,
           "ratio_steadydiff_vs_bare": med["steadydiff"] / med["bare"],
           "paired_ratio_steadydiff_vs_bare": statistics.median(
               x / y for x, y in zip(times["steadydiff"], times["bare"])),
           "cpu_ratio_steadydiff_vs_bare": med_cpu["steadydiff"] / med_cpu["bare"],
           "load_at_start": load0, "load_at_end": load_avg()}
    res.update(env_info())
    print_table([[n, f"{med[n] * 1e3:.1f}", f"{med_cpu[n] * 1e3:.1f}",
                  f"{med[n] / med['bare']:.3f}x"] for n in runs],
                ["variant", "median ms/step", "median CPU ms/step", "vs bare"])
    print(f"steadydiff / bare: {res['ratio_steadydiff_vs_bare']:.3f}x on the medians, "
          f"{res['paired_ratio_steadydiff_vs_bare']:.3f}x paired, CPU "
          f"{res['cpu_ratio_steadydiff_vs_bare']:.3f}x; load {load0} -> {res['load_at_end']}")
    return res


def main(argv: list[str] | None = None) -> int:
    from steadydiff.data import FASHION_MNIST_DIR

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sub = p.add_subparsers(dest="bar", required=True)
    le = sub.add_parser("learned", help="the control is learned (edge F1 with/without)",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    le.add_argument("--out", default="runs/bench_controlnet")
    le.add_argument("--fashion-path", default=str(FASHION_MNIST_DIR))
    le.add_argument("--n-train", type=int, default=6000, help="training images")
    le.add_argument("--image-size", type=int, default=32, help="the images' side (16: a "
                    "quarter of the cost)")
    le.add_argument("--num", type=int, default=100, help="held-out edge maps scored")
    le.add_argument("--vae-steps", type=int, default=600)
    le.add_argument("--base-steps", type=int, default=1500)
    le.add_argument("--base-lr", type=float, default=1e-3)
    le.add_argument("--cn-steps", type=int, default=1000)
    le.add_argument("--cn-lr", type=float, default=5e-4)
    le.add_argument("--batch", type=int, default=32)
    le.add_argument("--sample-steps", type=int, default=25)
    le.add_argument("--featnet-steps", type=int, default=None,
                    help="train the classifier this many steps into OUT/featcache (smoke)")
    le.add_argument("--json", action="store_true")
    ov = sub.add_parser("overhead", help="steadydiff ControlNet step vs a bare loop",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ov.add_argument("--steps", type=int, default=10)
    ov.add_argument("--repeats", type=int, default=5)
    ov.add_argument("--warmup", type=int, default=3)
    ov.add_argument("--batch", type=int, default=8)
    ov.add_argument("--latent-size", type=int, default=16)
    ov.add_argument("--threads", type=int, default=1)
    ov.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    res = learned(a) if a.bar == "learned" else overhead(a)
    if a.bar == "learned":
        s = res["score"]
        print_table([[k, f"{s[k]['f1']:.3f}", f"{s[k]['precision']:.3f}",
                      f"{s[k]['recall']:.3f}", f"{s[k]['class_accuracy']:.2%}"]
                     for k in ("with_controlnet", "base_alone")],
                    ["samples", "edge F1", "precision", "recall", "class prompt held"])
        print(f"ControlNet training: {res['controlnet']['steps']} steps, "
              f"{res['controlnet']['wall_s']} s wall, {res['controlnet']['cpu_s']} s CPU; base "
              f"{res['base']['steps']} steps {res['base']['wall_s']} s wall")
        Path(a.out, "results.json").write_text(json.dumps(res, indent=1))
    if a.json:
        print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
