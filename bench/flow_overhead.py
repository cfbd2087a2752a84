"""FLUX.1 path: what a steadydiff LoRA step (guard on) costs against a bare diffusers-style
flow-matching LoRA loop on the same components (issue 29's overhead bar: <= 1.05x).

The components are the families' tiny FLUX.1-dev folder (``make_tiny(..., "flux")``: the
FLUX VAE's shift and scaling factors, a tiny CLIP-L for the pooled output, a 2-layer T5 at
512 tokens, the dynamic-shift FlowMatchEulerDiscreteScheduler), its transformer replaced by
a FluxTransformer2DModel of ``--heads`` x ``--head-dim`` width, ``--layers`` double and
``--single-layers`` single blocks (random weights; nothing is downloaded). ``--heads 2
--head-dim 8 --layers 1 --single-layers 2`` keeps the tiny builder's own transformer.

Two variants, each with its own transformer (same weights, same LoRA init seed) and
optimizer, interleaved repeat by repeat (a, b, a, b, ...) in one process so the load of the
shared machine falls on both alike:

- ``bare``: the loop of diffusers' ``train_dreambooth_lora_flux.py``: a peft LoRA (rank
  ``--rank`` on the joint attention of both streams and the single blocks, the targets of
  configs/flux_lora.yaml), logit-normal(0, 1) timesteps
  (``compute_density_for_timestep_sampling``), ``x_t = (1 - sigma) x0 + sigma noise``, the
  latents packed 2x2 with their position ids, the distilled guidance 3.5, the transformer
  call, the weighted MSE (``compute_loss_weighting_for_sd3``, scheme none) against
  ``noise - x0``, backward, ``clip_grad_norm_(1.0)``, AdamW, ``lr_scheduler.step()``,
  ``zero_grad``, a ``.item()`` of the loss every 10 steps. Its latents and text come from
  ``FluxPipeline``'s VAE and ``encode_prompt``, once, ahead of the timing.
- ``steadydiff``: the trainer's own ``train_step`` + ``handle_decision`` on a TrainState that
  ``build_state`` makes from the same folder with ``configs/flux_lora.yaml`` (the family
  path: recipe from the folder, the LoRA on the same targets, guard on with its deferred
  check as the trainer runs it, EMA of the LoRA); its latents and text from its own cached
  encoders (``encode_images``, ``encode_prompts``), once, ahead of the timing.

Step ``i`` of both trains on the same batch of latents and captions. Each repeat times
``--steps`` consecutive steps of one variant after ``--warmup`` untimed ones; wall and CPU
seconds (``time.process_time``: this process, one torch thread) per step, the medians over
``--repeats`` and their ratios steadydiff / bare.

    python bench/flow_overhead.py --json                        # CPU, 1 thread
    python bench/flow_overhead.py --steps 2 --repeats 1 --warmup 1 --json   # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: one busy thread each

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from throughput import env_info, print_table  # noqa: E402

Step = Callable[[int], None]
CONFIG = ROOT / "configs" / "flux_lora.yaml"


def load_avg() -> list[float]:
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return []


def lora_targets() -> list[str]:
    """configs/flux_lora.yaml's targets, as peft module names (without the ``*.``)."""
    from steadydiff.config import load_config

    return [t.removeprefix("*.") for t in load_config(CONFIG, []).adapter.targets]


def build_folder(root: Path, *, image_size: int, heads: int, head_dim: int, layers: int,
                 single_layers: int, seed: int = 0) -> Path:
    """The tiny FLUX.1-dev folder with a FluxTransformer2DModel of the given shape."""
    from diffusers import FluxTransformer2DModel

    from steadydiff.integrations.sd.tiny import make_tiny

    folder = make_tiny(root / "flux", "flux", image_size=image_size, seed=seed)
    conf = json.loads((folder / "transformer" / "config.json").read_text())
    if head_dim % 4:
        raise SystemExit(f"--head-dim must be a multiple of 4 (the rotary axes), got {head_dim}")
    torch.manual_seed(seed)
    FluxTransformer2DModel(
        patch_size=1, in_channels=conf["in_channels"], num_layers=layers,
        num_single_layers=single_layers, attention_head_dim=head_dim,
        num_attention_heads=heads, joint_attention_dim=conf["joint_attention_dim"],
        pooled_projection_dim=conf["pooled_projection_dim"], guidance_embeds=True,
        axes_dims_rope=(head_dim // 4, head_dim // 4, head_dim // 2),
    ).save_pretrained(folder / "transformer", safe_serialization=True)
    return folder


def images_and_captions(n: int, size: int, seed: int) -> tuple[torch.Tensor, list[str]]:
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(n, 3, size, size, generator=g) * 2 - 1,
            [f"picture number {k} of a small shape" for k in range(n)])


# --------------------------------------------------------------------------- the variants


def bare(folder: Path, a: argparse.Namespace) -> Step:
    """diffusers' FLUX LoRA loop (train_dreambooth_lora_flux.py), latents and text cached."""
    from diffusers import FluxPipeline
    from diffusers.optimization import get_scheduler
    from diffusers.training_utils import (compute_density_for_timestep_sampling,
                                          compute_loss_weighting_for_sd3)
    from peft import LoraConfig

    pipe = FluxPipeline.from_pretrained(folder, local_files_only=True)
    images, captions = images_and_captions(a.data, a.image_size, a.seed)
    with torch.no_grad():
        vae = pipe.vae
        latents = (vae.encode(images).latent_dist.mode() - vae.config.shift_factor) \
            * vae.config.scaling_factor
        embeds, pooled, text_ids = pipe.encode_prompt(captions, prompt_2=captions,
                                                      max_sequence_length=512)
    transformer = pipe.transformer
    transformer.requires_grad_(False)
    torch.manual_seed(a.seed)
    transformer.add_adapter(LoraConfig(r=a.rank, lora_alpha=a.rank,
                                       init_lora_weights="gaussian",
                                       target_modules=lora_targets()))
    transformer.train()
    params = [p for p in transformer.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=a.lr, weight_decay=1e-2)
    sched = get_scheduler("constant", opt)
    n, c, h, w = latents.shape
    img_ids = FluxPipeline._prepare_latent_image_ids(a.batch, h // 2, w // 2, "cpu",
                                                     latents.dtype)
    guidance = torch.full((a.batch,), 3.5)

    def step(i: int) -> None:
        idx = (i * a.batch + torch.arange(a.batch)) % n
        x0 = latents[idx]
        g = torch.Generator().manual_seed(a.seed * 1_000_003 + i)
        noise = torch.randn(x0.shape, generator=g)
        u = compute_density_for_timestep_sampling("logit_normal", a.batch, logit_mean=0.0,
                                                  logit_std=1.0)
        sigma = u.view(-1, 1, 1, 1)
        noisy = (1.0 - sigma) * x0 + sigma * noise
        packed = FluxPipeline._pack_latents(noisy, a.batch, c, h, w)
        pred = transformer(hidden_states=packed, timestep=u, guidance=guidance,
                           pooled_projections=pooled[idx], encoder_hidden_states=embeds[idx],
                           txt_ids=text_ids, img_ids=img_ids, return_dict=False)[0]
        pred = FluxPipeline._unpack_latents(pred, h * pipe.vae_scale_factor,
                                            w * pipe.vae_scale_factor, pipe.vae_scale_factor)
        weighting = compute_loss_weighting_for_sd3("none", sigmas=sigma)
        loss = torch.mean((weighting.float() * (pred.float() - (noise - x0).float()) ** 2)
                          .reshape(a.batch, -1), 1).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if i % 10 == 0:
            loss.item()  # the loop's logging tick (a host sync)
    step.lora_params = sum(p.numel() for p in params)  # type: ignore[attr-defined]
    step.transformer_params = sum(p.numel() for p in transformer.parameters())  # type: ignore
    step.latent_shape = list(latents.shape[1:])  # type: ignore[attr-defined]
    return step


def ours(folder: Path, a: argparse.Namespace) -> Step:
    """The trainer's train_step + handle_decision on the family path's TrainState."""
    from steadydiff.config import load_config
    from steadydiff.integrations.sd.source import resolve_config
    from steadydiff.trainer.loop import (attach_guard, build_state, handle_decision,
                                         train_step)

    cfg = load_config(CONFIG, [
        f"model.pretrained={folder}", f"data.path={folder}", f"data.image_size={a.image_size}",
        f"adapter.rank={a.rank}", f"adapter.alpha={a.rank}", f"optim.lr={a.lr}",
        "optim.weight_decay=0.01", "optim.grad_clip=1.0", "optim.warmup_steps=0",
        f"train.batch_size={a.batch}", "train.steps=1000000", f"train.seed={a.seed}",
        "train.precision=fp32", "train.gradient_checkpointing=false", "train.device=cpu",
        "train.num_threads=0", "data.num_workers=0", "logging.progress=false"])
    cfg, _ = resolve_config(cfg)
    torch.manual_seed(a.seed)
    state = build_state(cfg, 0, torch.device("cpu"))
    guard = attach_guard(state, None, defer=True)  # the deferred check, as the trainer runs it
    images, captions = images_and_captions(a.data, a.image_size, a.seed)
    latents = state.media.encode_images(images)
    y = state.media.encode_prompts(captions)
    n = len(latents)

    def step(i: int) -> None:
        idx = (i * a.batch + torch.arange(a.batch)) % n
        out = train_step(state, (latents[idx], y[idx], idx))
        if handle_decision(state, out.decision, say=lambda *_: None) != "stepped":
            raise RuntimeError(f"the trainer did not step a healthy step {i}")
        if guard.due() and guard.flush().rewind is not None:
            raise RuntimeError(f"the guard redid a window of a healthy run at step {i}")
    step.guard = state.guard is not None  # type: ignore[attr-defined]
    step.lora_params = sum(p.numel() for p in state.model.parameters()  # type: ignore
                           if p.requires_grad)
    return step


VARIANTS: dict[str, Callable[[Path, argparse.Namespace], Step]] = {"bare": bare,
                                                                  "steadydiff": ours}


def measure(runs: dict[str, Step], a: argparse.Namespace) -> tuple[dict, dict]:
    done = dict.fromkeys(runs, 0)
    for n, step in runs.items():
        for _ in range(a.warmup):
            step(done[n])
            done[n] += 1
    wall: dict[str, list[float]] = {n: [] for n in runs}
    cpu: dict[str, list[float]] = {n: [] for n in runs}
    for _ in range(a.repeats):
        for n, step in runs.items():
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(a.steps):
                step(done[n])
                done[n] += 1
            wall[n].append((time.perf_counter() - t0) / a.steps)
            cpu[n].append((time.process_time() - c0) / a.steps)
    return wall, cpu


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=10, help="timed steps per repeat")
    p.add_argument("--repeats", type=int, default=7, help="repeats per variant (interleaved)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per variant first")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--data", type=int, default=16, help="images (and captions) cached")
    p.add_argument("--image-size", type=int, default=32,
                   help="pixels (the tiny VAE downsamples 2x, then 2x2 packing)")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=16)
    p.add_argument("--layers", type=int, default=2, help="double-stream blocks")
    p.add_argument("--single-layers", type=int, default=4, help="single-stream blocks")
    p.add_argument("--rank", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--out", default=None, help="also write the figures as JSON here")
    p.add_argument("--json", action="store_true", help="end with one JSON line of figures")
    a = p.parse_args(argv)
    for k in ("steps", "repeats", "batch", "data", "heads", "layers", "rank", "threads"):
        if getattr(a, k) < 1:
            p.error(f"--{k} must be >= 1, got {getattr(a, k)}")
    if a.image_size % 4:
        p.error(f"--image-size must be a multiple of 4 (2x VAE, 2x2 packing), got "
                f"{a.image_size}")
    torch.set_num_threads(a.threads)
    load0 = load_avg()
    with tempfile.TemporaryDirectory(prefix="flow-overhead-") as tmp:
        folder = build_folder(Path(tmp), image_size=a.image_size, heads=a.heads,
                              head_dim=a.head_dim, layers=a.layers,
                              single_layers=a.single_layers, seed=a.seed)
        runs = {n: build(folder, a) for n, build in VARIANTS.items()}
        if not getattr(runs["steadydiff"], "guard", False):
            raise RuntimeError("the steadydiff variant has no guard: nothing to measure")
        wall, cpu = measure(runs, a)
    med = {n: statistics.median(v) for n, v in wall.items()}
    med_cpu = {n: statistics.median(v) for n, v in cpu.items()}
    b = runs["bare"]
    out: dict[str, Any] = {
        "bench": "flow_overhead", "device": "cpu", "steps": a.steps, "repeats": a.repeats,
        "warmup": a.warmup, "batch": a.batch, "image_size": a.image_size,
        "model": {"family": "flux (dev: guidance embedding)", "heads": a.heads,
                  "head_dim": a.head_dim, "double_blocks": a.layers,
                  "single_blocks": a.single_layers, "t5_tokens": 512,
                  "latent_shape": b.latent_shape, "transformer_params": b.transformer_params,
                  "lora_rank": a.rank, "lora_params_bare": b.lora_params,
                  "lora_params_steadydiff": runs["steadydiff"].lora_params},
        "repeats_sec_per_step": wall, "sec_per_step": med,
        "repeats_cpu_sec_per_step": cpu, "cpu_sec_per_step": med_cpu,
        "ratio_steadydiff_vs_bare": med["steadydiff"] / med["bare"],
        "paired_ratio_steadydiff_vs_bare": statistics.median(
            x / y for x, y in zip(wall["steadydiff"], wall["bare"])),
        "cpu_ratio_steadydiff_vs_bare": med_cpu["steadydiff"] / med_cpu["bare"],
        "paired_cpu_ratio_steadydiff_vs_bare": statistics.median(
            x / y for x, y in zip(cpu["steadydiff"], cpu["bare"])),
        "load_at_start": load0, "load_at_end": load_avg()}
    out.update(env_info())
    print(f"FLUX.1-dev LoRA loop on CPU ({a.threads} thread): transformer {a.heads}x"
          f"{a.head_dim} wide, {a.layers} double + {a.single_layers} single blocks "
          f"({b.transformer_params / 1e6:.2f}M params), latents {b.latent_shape}, T5 512 "
          f"tokens, LoRA rank {a.rank} ({b.lora_params} params), batch {a.batch}, "
          f"{a.repeats} repeats x {a.steps} steps")
    print_table([[n, f"{med[n] * 1e3:.1f}", f"{med_cpu[n] * 1e3:.1f}",
                  f"{med[n] / med['bare']:.3f}x", f"{med_cpu[n] / med_cpu['bare']:.3f}x"]
                 for n in runs],
                ["variant", "median ms/step", "median CPU ms/step", "wall vs bare",
                 "CPU vs bare"])
    print(f"steadydiff / bare: wall {out['ratio_steadydiff_vs_bare']:.3f}x (paired "
          f"{out['paired_ratio_steadydiff_vs_bare']:.3f}x), CPU "
          f"{out['cpu_ratio_steadydiff_vs_bare']:.3f}x (paired "
          f"{out['paired_cpu_ratio_steadydiff_vs_bare']:.3f}x); load {load0} -> "
          f"{out['load_at_end']}")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    if a.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
