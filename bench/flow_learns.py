"""The flow path learns (issue 29): a FLUX.1-shaped transformer trained from random init
through the family path on Fashion-MNIST captions, scored by prompt accuracy and FD.

    python bench/flow_learns.py --out runs/bench_flow --fashion-path FM_DIR --json
    python bench/flow_learns.py --out /tmp/fl --n-train 256 --vae-steps 10 --steps 4 \\
        --num 4 --sample-steps 2 --featnet-steps 20            # smoke (tests/test_bench.py)

Everything goes through ``steadydiff train`` / ``steadydiff.load`` on a FLUX.1-dev diffusers
folder built here (``FluxPipeline.save_pretrained``: nothing is downloaded):

1. data: the first ``--n-train`` Fashion-MNIST training images at ``--image-size`` (16;
   gray) written as PNGs with the caption ``prompt_for("fashion_mnist", class)`` ("a photo of
   a sneaker") beside each (``bench/controlnet.py``'s ``write_data``); the model never sees a
   class id;
2. the VAE: a small diffusers AutoencoderKL with **16 latent channels** (FLUX.1's; 1 image
   channel, widths (32, 64): one downsampling, 16 px -> 16x8x8) trained here on the whole
   train split (``fashion_text.train_vae``); its ``shift_factor`` set to the mean and its
   ``scaling_factor`` to 1 / std of the posterior-mean latents of 2,000 training images, as
   FLUX's VAE config carries them (steadydiff encodes ``(z - shift) * scale``);
3. the folder: that VAE, a **random** FluxTransformer2DModel (``--heads`` x ``--head-dim``,
   ``--layers`` double and ``--single-layers`` single blocks, in_channels 64 = 16 x 2x2,
   guidance embedding: dev), a random frozen tiny CLIP-L (its pooled output, ``--clip``
   wide, byte-level tokenizer), a random frozen 2-layer T5 (``--t5`` wide, its
   tokenizer.json), FLUX.1's FlowMatchEulerDiscreteScheduler config (dynamic shift);
   (``--family sd3``: an SD3.5-shaped folder instead, ``build_sd3_folder``: joint blocks
   with QK RMS-norm, CLIP-L and CLIP-G with projections and T5, SD3's static shift 3.0,
   trained with configs/sd3_lora.yaml's caption dropout and sampled at its guidance);
4. training: ``configs/flux_lora.yaml`` with ``adapter.kind=none`` (a full fine-tune of the
   folder's random transformer: training from scratch), the family's recipe from the
   folder as printed at start (rectified flow, logit-normal timesteps, the dynamic shift,
   guidance embedding 3.5, no caption dropout), fp32, one thread, AdamW ``--lr`` with
   warm-up and cosine decay, EMA 0.999, T5 at ``--t5-tokens`` tokens
   (``model.max_sequence_length``: the captions are < 30 characters);
5. scoring (``fashion_text.score_row``): for each class k, ``--num`` samples with its prompt at
   the run's default guidance (FLUX.1-dev: the embedded guidance, ``sample.cfg_scale`` 1.0,
   no unconditional pass) and sampler (flow-match Euler, ``sample.steps``), classified by the
   project's Fashion-MNIST feature network (``eval/features.py``): **prompt accuracy**;
   FD-fashion_mnist against class-matched real images beside the real-vs-real floor;
6. the ceiling: the same judge on 5,000 real test images and on their VAE round trip (every
   sample is decoded by that VAE, so the round trip bounds what prompt accuracy can reach).

Times: wall and CPU seconds (``time.process_time``, one torch thread) of the VAE, of the
training and of the scoring, and the load average at start and end (the machine is shared).
A finished stage is kept in ``--out`` (the VAE, the run) and not redone.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from controlnet import Clock, load_avg, write_data  # noqa: E402
from fashion_text import score_row, train_vae  # noqa: E402
from throughput import env_info  # noqa: E402

CONFIGS = {"flux": ROOT / "configs" / "flux_lora.yaml",
           "sd3": ROOT / "configs" / "sd3_lora.yaml"}


def finish_vae(folder: Path, info: dict) -> None:
    """FLUX's VAE convention: ``shift_factor`` the latents' mean (``train_vae`` set the
    scaling to 1 / their std)."""
    from diffusers import AutoencoderKL

    vae = AutoencoderKL.from_pretrained(folder)
    if vae.config.shift_factor != info["latent_mean"]:
        vae.register_to_config(shift_factor=info["latent_mean"])
        vae.save_pretrained(folder, safe_serialization=True)


def build_flux_folder(out: Path, vae_dir: Path, a: argparse.Namespace) -> Path:
    """A FLUX.1-dev folder: the VAE trained here, a random transformer, random frozen tiny
    CLIP-L and T5, FLUX.1's scheduler config."""
    from diffusers import (AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline,
                           FluxTransformer2DModel)

    from steadydiff.integrations.sd.tiny_parts import (tiny_t5, tiny_t5_tokenizer,
                                                       tiny_text_encoder, tiny_tokenizer)

    if (out / "model_index.json").is_file():
        return out
    vae = AutoencoderKL.from_pretrained(vae_dir)
    torch.manual_seed(a.seed)
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=4 * vae.config.latent_channels, num_layers=a.layers,
        num_single_layers=a.single_layers, attention_head_dim=a.head_dim,
        num_attention_heads=a.heads, joint_attention_dim=a.t5, pooled_projection_dim=a.clip,
        guidance_embeds=True, axes_dims_rope=(a.head_dim // 4, a.head_dim // 4,
                                              a.head_dim // 2))
    sched = FlowMatchEulerDiscreteScheduler(  # FLUX.1-dev's scheduler/scheduler_config.json
        num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5,
        max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096)
    FluxPipeline(transformer=transformer, vae=vae,
                 text_encoder=tiny_text_encoder(a.clip, seed=a.seed), tokenizer=tiny_tokenizer(),
                 text_encoder_2=tiny_t5(a.t5, seed=a.seed + 2),
                 tokenizer_2=tiny_t5_tokenizer(512), scheduler=sched,
                 ).save_pretrained(out, safe_serialization=True)
    return out


def build_sd3_folder(out: Path, vae_dir: Path, a: argparse.Namespace) -> Path:
    """An SD3.5-shaped folder: the VAE trained here, a random SD3Transformer2DModel of
    ``--layers`` + ``--single-layers`` joint blocks with SD3.5's QK RMS-norm (2x2 patches
    over the 16-channel latents), random frozen tiny CLIP-L and CLIP-G with projections
    (``--clip`` / 2 wide each: their pooled outputs concatenated) and T5, SD3's scheduler
    config (static shift 3.0)."""
    from diffusers import (AutoencoderKL, FlowMatchEulerDiscreteScheduler,
                           SD3Transformer2DModel, StableDiffusion3Pipeline)

    from steadydiff.integrations.sd.tiny_parts import (tiny_t5, tiny_t5_tokenizer,
                                                       tiny_text_encoder, tiny_tokenizer)

    if (out / "model_index.json").is_file():
        return out
    vae = AutoencoderKL.from_pretrained(vae_dir)
    torch.manual_seed(a.seed)
    half = a.clip // 2
    side = a.image_size // 2  # the latents' side (the VAE's one downsampling)
    transformer = SD3Transformer2DModel(
        sample_size=side, patch_size=2, in_channels=vae.config.latent_channels,
        num_layers=a.layers + a.single_layers, attention_head_dim=a.head_dim,
        num_attention_heads=a.heads, joint_attention_dim=a.t5,
        caption_projection_dim=a.heads * a.head_dim, pooled_projection_dim=2 * half,
        out_channels=vae.config.latent_channels, pos_embed_max_size=side,
        qk_norm="rms_norm")
    StableDiffusion3Pipeline(
        transformer=transformer, vae=vae,
        text_encoder=tiny_text_encoder(half, seed=a.seed, projection=half),
        tokenizer=tiny_tokenizer(),
        text_encoder_2=tiny_text_encoder(half, seed=a.seed + 1, projection=half),
        tokenizer_2=tiny_tokenizer(pad_token="!"),
        text_encoder_3=tiny_t5(a.t5, seed=a.seed + 2), tokenizer_3=tiny_t5_tokenizer(),
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0),
    ).save_pretrained(out, safe_serialization=True)
    return out


def run_config(folder: Path, data: Path, a: argparse.Namespace):
    from steadydiff.config import load_config
    from steadydiff.data.captions import prompt_for

    return load_config(CONFIGS[a.family], [
        f"model.pretrained={folder}", f"data.path={data}", "data.captions=txt",
        f"data.image_size={a.image_size}", "data.channels=1", "data.num_workers=0",
        "adapter.kind=none", f"model.max_sequence_length={a.t5_tokens}",
        f"train.steps={a.steps}", f"train.batch_size={a.batch}", "train.precision=fp32",
        "train.gradient_checkpointing=false", "train.num_threads=1", "train.device=cpu",
        f"train.seed={a.seed}", f"optim.lr={a.lr}", f"optim.warmup_steps={a.warmup}",
        "optim.schedule=cosine", "train.ema_decay=0.999", f"train.checkpoint_every={a.steps}",
        "train.sample_every=0", "logging.log_every=100", "logging.progress=false",
        "sample.num=10",
        f"train.max_time={'null' if a.max_time == 'none' else a.max_time}",
        "sample.prompts=" + json.dumps([prompt_for("fashion_mnist", k) for k in range(10)]),
        *a.set])


def ceiling(fx, vae_dir: Path, a: argparse.Namespace, n: int = 5000) -> dict:
    """What a perfect generator could score: the judge's accuracy on the first ``n`` real test
    images, and on the same images after the VAE (encode, posterior mean, decode), overall and
    per class. Samples come out of that decoder, so its round trip bounds prompt accuracy."""
    from diffusers import AutoencoderKL

    from fashion_text import NAMES
    from steadydiff.data import FashionMNISTDataset

    test = FashionMNISTDataset(a.image_size, 1, root=a.fashion_path, split="test")
    x, y = test.images_at(slice(0, n)).contiguous(), test.labels[:n].numpy()
    vae = AutoencoderKL.from_pretrained(vae_dir).eval()
    with torch.no_grad():
        rec = torch.cat([vae.decode(vae.encode(x[i:i + 500]).latent_dist.mean).sample
                         for i in range(0, len(x), 500)]).clamp(-1, 1)

    def acc(images: torch.Tensor) -> tuple[float, list[float]]:
        pred = fx(images)[1].argmax(1)
        return float((pred == y).mean()), [float((pred[y == k] == k).mean()) if (y == k).any()
                                           else float("nan") for k in range(len(NAMES))]

    (real, real_k), (vae_acc, vae_k) = acc(x), acc(rec)
    return {"test_images": int(len(y)), "real_accuracy": real, "vae_roundtrip_accuracy": vae_acc,
            "per_class": [{"name": NAMES[k], "real": real_k[k], "vae_roundtrip": vae_k[k]}
                          for k in range(len(NAMES))]}


def _f(v) -> str:
    return "n/a" if v is None else f"{v:.3f}"


def main(argv: list[str] | None = None) -> int:
    from steadydiff.data import FASHION_MNIST_DIR

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default="runs/bench_flow")
    p.add_argument("--family", choices=sorted(CONFIGS), default="flux",
                   help="flux: FLUX.1-dev-shaped (double + single blocks, embedded guidance);"
                   " sd3: SD3.5-shaped (joint blocks, CLIP-L/G + T5, classifier-free guidance)")
    p.add_argument("--fashion-path", default=str(FASHION_MNIST_DIR))
    p.add_argument("--n-train", type=int, default=10000, help="training images")
    p.add_argument("--image-size", type=int, default=16)
    p.add_argument("--vae-steps", type=int, default=300, help="VAE steps (batch 64)")
    p.add_argument("--vae-kl", type=float, default=1e-4,
                   help="the VAE's KL weight (per pixel): higher, smoother latents")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=16)
    p.add_argument("--layers", type=int, default=2, help="double-stream blocks")
    p.add_argument("--single-layers", type=int, default=2, help="single-stream blocks")
    p.add_argument("--clip", type=int, default=64, help="the tiny CLIP's width (pooled)")
    p.add_argument("--t5", type=int, default=64, help="the tiny T5's width")
    p.add_argument("--t5-tokens", type=int, default=24,
                   help="model.max_sequence_length (the captions take at most 21)")
    p.add_argument("--steps", type=int, default=40000, help="the upper bound on steps")
    p.add_argument("--max-time", default="27.5m",
                   help="train.max_time: the training time budget (the cosine decay follows "
                   "it); with the setup and the latent cache the run stays within 30 "
                   "CPU-minutes; 'none': train.steps alone")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num", type=int, default=100, help="samples per prompt (and real images)")
    p.add_argument("--sample-steps", type=int, default=None,
                   help="sampling steps (default: the run's sample.steps)")
    p.add_argument("--featnet-steps", type=int, default=None,
                   help="train the classifier this many steps into OUT/featcache (smoke)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="more config overrides of the training run")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if a.head_dim % 4 or a.head_dim < 4:
        p.error(f"--head-dim must be a positive multiple of 4 (FLUX's three rotary axes), "
                f"got {a.head_dim}")
    if a.image_size % 4:
        p.error(f"--image-size must be a multiple of 4 (the VAE's 2x and the 2x2 packing), "
                f"got {a.image_size}")
    import steadydiff
    from steadydiff.eval import features

    torch.set_num_threads(1)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    res: dict = {"bench": "flow_learns", "load_at_start": load_avg()}
    data = out / "data"
    if not (data / f"{a.n_train - 1:05d}.txt").is_file() or (data / f"{a.n_train:05d}.txt"
                                                            ).is_file():
        write_data(data, a.fashion_path, a.n_train, "train", True, a.image_size)
    res["data"] = {"train": a.n_train, "image_size": a.image_size}
    with Clock() as c:
        res["vae"] = train_vae(out / "vae", a.fashion_path, a.image_size, steps=a.vae_steps,
                               kl=a.vae_kl, latent_channels=16)
        finish_vae(out / "vae", res["vae"])
    kept = (res["vae"]["steps"], res["vae"]["kl_weight"])
    if kept != (a.vae_steps, a.vae_kl):
        p.error(f"{out / 'vae'} holds a VAE trained with {kept[0]} steps at KL weight "
                f"{kept[1]}, not --vae-steps {a.vae_steps} --vae-kl {a.vae_kl}: use another "
                f"--out, or delete that folder and its {a.family} folder")
    res["vae"]["this_run_wall_s"] = c.wall_s
    folder = (build_flux_folder if a.family == "flux" else build_sd3_folder)(
        out / a.family, out / "vae", a)
    cfg = run_config(folder, data, a)
    if not (out / "train.json").is_file():
        with Clock() as c:
            run = steadydiff.train(cfg, out_dir=out / "run")
        (out / "train.json").write_text(json.dumps({
            "steps": run.steps, "final_loss": run.final_loss, "incidents": run.incidents,
            "wall_s": c.wall_s, "cpu_s": c.cpu_s, "cpu_minutes": round(c.cpu_s / 60, 1),
            "load_after": load_avg()}, indent=1))
    res["train"] = json.loads((out / "train.json").read_text())
    res["transformer_params"] = sum(
        v.numel() for v in steadydiff.load(out / "run", device="cpu").model.parameters())
    res["recipe"] = {"family": "flux (dev)" if a.family == "flux" else "sd3.5",
                     "heads": a.heads, "head_dim": a.head_dim,
                     "double_blocks": a.layers, "single_blocks": a.single_layers,
                     "clip": a.clip, "t5": a.t5, "t5_tokens": a.t5_tokens, "steps": a.steps,
                     "max_time": a.max_time, "batch": a.batch, "lr": a.lr,
                     "warmup": a.warmup, "seed": a.seed,
                     "set": a.set}

    cache = None
    if a.featnet_steps is not None:
        features.RECIPE["fashion_mnist"] = (a.featnet_steps, features.RECIPE["fashion_mnist"][1])
        cache = out / "featcache"
    fx = features.feature_extractor("fashion_mnist", a.image_size, path=a.fashion_path,
                                    cache=cache)
    res["feature_net"] = {"steps": fx.meta["train_steps"],
                          "test_accuracy": fx.meta["test_accuracy"]}
    res["eval"] = score_row(out / "run", fx, a, out / "flow_samples.png")
    res["ceiling"] = ceiling(fx, out / "vae", a)
    res["load_at_end"] = load_avg()
    res.update(env_info())
    (out / "results.json").write_text(json.dumps(res, indent=1))
    e, t, v = res["eval"], res["train"], res["vae"]
    shape = "FLUX.1" if a.family == "flux" else "SD3.5"
    print(f"{shape}-shaped transformer from random init, {t['steps']} steps: prompt accuracy "
          f"{e['prompt_accuracy']:.1%} at cfg {e['cfg_scale']} ({e['sampler']}, "
          f"{e['sample_steps']} steps, {e['num_per_class']} per class); FD "
          f"{_f(e['fd'])} (real-vs-real floor {_f(e['real_floor_fd'])}); training "
          f"{t['wall_s']} s wall / {t['cpu_s']} s CPU; VAE {v['cpu_s']} s CPU; load "
          f"{res['load_at_start']} -> {res['load_at_end']}")
    ce = res["ceiling"]
    print(f"ceiling ({ce['test_images']} real test images): the judge scores "
          f"{ce['real_accuracy']:.1%} on them, {ce['vae_roundtrip_accuracy']:.1%} after the VAE")
    for r, c in zip(e["per_class"], ce["per_class"]):
        print(f"  {r['name']:12s} {r['prompt_accuracy']:.0%}  FD {_f(r['fd'])} "
              f"(floor {_f(r['real_floor_fd'])}); real {c['real']:.0%}, after the VAE "
              f"{c['vae_roundtrip']:.0%}" + (f"; else mostly {r['confused_with']} "
                                              f"({r['confused_share']:.0%})"
                                              if r["confused_with"] else ""))
    if a.json:
        print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
