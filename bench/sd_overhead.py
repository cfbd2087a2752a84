"""SD path: what ``steadydiff.Guard`` costs per step in a diffusers-style LoRA loop.

Variants run side by side in one process on the same Stable Diffusion components (the
builders of ``steadydiff.integrations.sd.tiny``, with a UNet larger than the tests': widths
(64, 128), cross-attention at the first level, 32x32 latents; random weights, nothing is
downloaded), interleaved repeat by repeat (a, b, a, b, ...) so load from other processes on
the machine falls on all of them alike:

- ``bare``:  the loop of diffusers' ``train_text_to_image_lora.py``: a peft LoRA (rank 4 on
  ``to_q/to_k/to_v/to_out.0``), ``add_noise``, the UNet forward, the MSE loss against the
  scheduler's target, backward, ``clip_grad_norm_(1.0)``, ``optimizer.step()``,
  ``lr_scheduler.step()``, ``zero_grad()``, and a ``.item()`` of the loss every 10 steps;
- ``steadydiff``: the trainer's own ``train_step`` + ``handle_decision`` on a TrainState
  built from a folder holding the same UNet (the real SD loading code, guard on, EMA), with
  the deferred check as the trainer runs it (one host read every ``guard.check_every``
  steps);
- ``guard``: the same with ``guard.step(loss, t=, per_sample_loss=, inputs=, indices=)`` in
  place of the clip, the optimizer and scheduler steps and ``zero_grad`` (the guard clips at
  1.0 too), the guard in somebody else's loop: its one host read per step, the weight checks before the
  forward and after the update, a snapshot of the LoRA every 50 steps.

Each variant builds its own UNet (same seed: same weights and LoRA) and optimizer; step ``i``
of every variant trains on the same latents, text embeddings, timesteps and noise (drawn
from a generator seeded by ``i``). The frozen VAE and text encoder run once, ahead of the
timing (a latent cache): their cost is the same with and without the guard and would only
dilute the ratio. Each repeat times ``--steps`` consecutive steps of one variant after
``--warmup`` untimed ones; the figures are the medians of ``--repeats`` repeats and their
ratio guard / bare (also the median of the per-repeat ratios). The update part of each step
(everything after ``backward``: what the guard replaces) is also timed on its own, which
resolves the guard's cost where the forward and backward vary more from run to run than
the guard costs.

A variant is one entry of :data:`VARIANTS`: ``name -> build(setup, clock) -> step(i)``.

    python bench/sd_overhead.py                                  # CPU, 1 thread
    python bench/sd_overhead.py --device cuda --batch 32
    python bench/sd_overhead.py --steps 2 --repeats 1 --warmup 1 --json   # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: one busy thread each

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import env_info, print_table  # noqa: E402

Step = Callable[[int], None]
LORA_TARGETS = ["to_k", "to_q", "to_v", "to_out.0"]


@dataclass
class Setup:
    """The components and data every variant shares (built once)."""

    device: torch.device
    unet_config: dict[str, Any]          # every variant builds its own UNet from it
    unet_state: dict[str, torch.Tensor]  # ... with these weights
    noise_scheduler: Any                 # diffusers' DDPMScheduler
    latents: torch.Tensor                # (N, 4, 32, 32), VAE latents x scaling_factor
    text: torch.Tensor                   # (N, 77, D), the frozen text encoder's states
    batch: int
    rank: int = 4
    lr: float = 1e-4
    seed: int = 0

    @property
    def T(self) -> int:
        return self.noise_scheduler.config.num_train_timesteps

    def lora_unet(self) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
        """A fresh UNet (the shared weights) with a rank-``rank`` LoRA (same seed in every
        variant), AdamW over the LoRA and a constant LR scheduler: the diffusers recipe."""
        from diffusers import UNet2DConditionModel
        from diffusers.optimization import get_scheduler
        from peft import LoraConfig

        unet = UNet2DConditionModel.from_config(self.unet_config)
        unet.load_state_dict(self.unet_state)
        unet.requires_grad_(False)
        torch.manual_seed(self.seed)
        unet.add_adapter(LoraConfig(r=self.rank, lora_alpha=self.rank,
                                    init_lora_weights="gaussian",
                                    target_modules=LORA_TARGETS))
        unet.to(self.device).train()
        params = [p for p in unet.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=self.lr, weight_decay=1e-2)
        return unet, opt, get_scheduler("constant", opt)

    def indices(self, i: int) -> torch.Tensor:
        """The dataset indices of step ``i``'s batch."""
        return (i * self.batch + torch.arange(self.batch)) % len(self.latents)

    def loss(self, unet: torch.nn.Module, i: int
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Step ``i``'s forward pass: (loss, per-sample loss (B,), timesteps (B,), latents)."""
        idx = self.indices(i).to(self.device)
        latents, states = self.latents[idx], self.text[idx]
        g = torch.Generator(self.device).manual_seed(self.seed * 1_000_003 + i)
        noise = torch.randn(latents.shape, generator=g, device=self.device)
        t = torch.randint(0, self.T, (latents.shape[0],), generator=g, device=self.device)
        noisy = self.noise_scheduler.add_noise(latents, noise, t)
        target = (noise if self.noise_scheduler.config.prediction_type == "epsilon"
                  else self.noise_scheduler.get_velocity(latents, noise, t))
        pred = unet(noisy, t, states, return_dict=False)[0]
        per_sample = F.mse_loss(pred.float(), target.float(), reduction="none").mean((1, 2, 3))
        return per_sample.mean(), per_sample, t, latents


def build_setup(device: torch.device, *, batch: int, widths: tuple[int, int] = (64, 128),
                latent_size: int = 32, data: int = 64, seed: int = 0,
                prediction: str = "epsilon") -> Setup:
    """The tiny SD components (UNet ``widths`` at ``latent_size``), ``data`` coloured-noise
    images encoded once by the frozen VAE and ``data`` captions by the frozen text encoder."""
    from diffusers import DDPMScheduler

    from steadydiff.integrations.sd.tiny import (tiny_text_encoder, tiny_tokenizer, tiny_unet,
                                                 tiny_vae)

    unet = tiny_unet(32, latent_size, widths=widths, seed=seed)
    vae = tiny_vae(sample_size=2 * latent_size, seed=seed).to(device)   # 2x downsampling
    text_encoder, tokenizer = tiny_text_encoder(32, seed=seed).to(device), tiny_tokenizer()
    sched = DDPMScheduler(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012,
                          beta_schedule="scaled_linear", prediction_type=prediction)
    g = torch.Generator().manual_seed(seed)
    images = torch.rand(data, 3, 2 * latent_size, 2 * latent_size, generator=g) * 2 - 1
    captions = [f"picture number {k}" for k in range(data)]
    ids = tokenizer(captions, max_length=tokenizer.model_max_length, padding="max_length",
                    truncation=True, return_tensors="pt").input_ids
    with torch.no_grad():
        latents = torch.cat([vae.encode(x.to(device)).latent_dist.sample()
                             for x in images.split(16)]) * vae.config.scaling_factor
        text = text_encoder(ids.to(device), return_dict=False)[0]
    return Setup(device=device, unet_config=dict(unet.config),
                 unet_state={k: v.clone() for k, v in unet.state_dict().items()},
                 noise_scheduler=sched, latents=latents, text=text, batch=batch, seed=seed)


# --------------------------------------------------------------------------- the variants


class Clock:
    """Times the update part of a step (after backward: what the guard replaces), so its
    cost is resolved apart from the forward and backward, whose run-to-run spread on a
    shared machine is larger than the whole guard. On an accelerator each reading
    synchronizes the device (two syncs per step, in every variant alike); ``on=False``
    leaves the steps untouched and reads nothing."""

    def __init__(self, device: torch.device, on: bool = True):
        self.device, self.on, self.total = device, on, 0.0
        self._t0 = 0.0

    def start(self) -> None:
        if self.on:
            _sync(self.device)
            self._t0 = time.perf_counter()

    def stop(self) -> None:
        if self.on:
            _sync(self.device)
            self.total += time.perf_counter() - self._t0


def bare(s: Setup, clock: Clock) -> Step:
    """diffusers' LoRA loop: backward, clip, optimizer and scheduler step, zero_grad."""
    unet, opt, sched = s.lora_unet()
    params = [p for p in unet.parameters() if p.requires_grad]

    def step(i: int) -> None:
        loss, _, _, _ = s.loss(unet, i)
        loss.backward()
        clock.start()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        clock.stop()
        if i % 10 == 0:
            loss.item()  # the loop's logging tick (a host sync)
    return step


def guard(s: Setup, clock: Clock) -> Step:
    """The same loop, ``guard.step(...)`` in place of the clip and the optimizer steps."""
    from steadydiff import Guard

    unet, opt, sched = s.lora_unet()
    g = Guard(unet, opt, lr_scheduler=sched, num_timesteps=s.T, clip=1.0)

    def step(i: int) -> None:
        loss, per_sample, t, latents = s.loss(unet, i)
        loss.backward()
        clock.start()
        d = g.step(loss, t=t, per_sample_loss=per_sample, inputs=latents,
                   indices=s.indices(i))
        clock.stop()
        if d.action != "step":
            raise RuntimeError(f"the guard did not step a healthy step {i}: {d}")
    return step


def steadydiff_step(s: Setup, clock: Clock) -> Step:
    """The trainer's own step on the same components: ``train_step`` + ``handle_decision``
    over a TrainState built by ``build_state`` from a folder holding this UNet (the real
    SD loading code: peft LoRA on the same targets, the guard on, EMA of the LoRA, the
    per-step LR, the (seed, step) draws, min-SNR off as in ``bare``). Its update part is not
    separated (the clock reads 0)."""
    import tempfile

    from diffusers import StableDiffusionPipeline, UNet2DConditionModel

    from steadydiff.config import load_config
    from steadydiff.integrations.sd.source import resolve_config
    from steadydiff.integrations.sd.tiny import tiny_text_encoder, tiny_tokenizer, tiny_vae
    from steadydiff.trainer.loop import build_state, handle_decision, train_step

    root = Path(tempfile.mkdtemp(prefix="sd-overhead-")) / "sd"
    unet = UNet2DConditionModel.from_config(s.unet_config)
    unet.load_state_dict(s.unet_state)
    side = int(s.latents.shape[-1])
    StableDiffusionPipeline(
        unet=unet, vae=tiny_vae(sample_size=2 * side), text_encoder=tiny_text_encoder(32),
        tokenizer=tiny_tokenizer(), scheduler=s.noise_scheduler, safety_checker=None,
        feature_extractor=None, requires_safety_checker=False).save_pretrained(root)
    cfg = load_config(None, [
        f"model.pretrained={root}", "data.dataset=folder", f"data.path={root}",
        "data.captions=auto", f"data.image_size={2 * side}", "data.channels=3",
        "adapter.kind=lora", f"adapter.rank={s.rank}", f"adapter.alpha={s.rank}",
        'adapter.targets=["*.to_k","*.to_q","*.to_v","*.to_out.0"]', f"optim.lr={s.lr}",
        "optim.weight_decay=0.01", "optim.grad_clip=1.0", "optim.warmup_steps=0",
        f"train.batch_size={s.batch}", "train.steps=1000000", f"train.seed={s.seed}",
        "diffusion.cfg_dropout=0.0", f"train.device={s.device.type}"])
    cfg, _ = resolve_config(cfg)
    torch.manual_seed(s.seed)
    state = build_state(cfg, 0, s.device)
    from steadydiff.trainer.loop import attach_guard

    guard = attach_guard(state, None, defer=True)  # the deferred check, as the trainer runs it

    def step(i: int) -> None:
        idx = s.indices(i)
        out = train_step(state, (s.latents[idx.to(s.device)], s.text[idx.to(s.device)], idx))
        if handle_decision(state, out.decision, say=lambda *_: None) != "stepped":
            raise RuntimeError(f"the trainer did not step a healthy step {i}")
        if guard.due() and guard.flush().rewind is not None:
            raise RuntimeError(f"the guard redid a window of a healthy run at step {i}")
    return step


# name -> build(setup, clock) -> step(i) (a variant that cannot separate its update leaves
# the clock alone: its update time reads 0).
VARIANTS: dict[str, Callable[[Setup, Clock], Step]] = {"bare": bare, "guard": guard,
                                                      "steadydiff": steadydiff_step}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(s: Setup, names: list[str], *, steps: int, repeats: int, warmup: int,
            split: bool = True) -> dict[str, dict[str, list[float]]]:
    """Seconds per step of each variant (``step``) and of its update part (``update``), one
    entry per repeat, the variants interleaved repeat by repeat."""
    clocks = {n: Clock(s.device, split) for n in names}
    runs = {n: VARIANTS[n](s, clocks[n]) for n in names}
    done = dict.fromkeys(names, 0)  # the step index each variant is at
    for n, step in runs.items():
        for _ in range(warmup):
            step(done[n])
            done[n] += 1
        _sync(s.device)
    times: dict[str, dict[str, list[float]]] = {n: {"step": [], "update": []} for n in names}
    for _ in range(repeats):
        for n, step in runs.items():
            clocks[n].total = 0.0
            _sync(s.device)
            t0 = time.perf_counter()
            for _ in range(steps):
                step(done[n])
                done[n] += 1
            _sync(s.device)
            times[n]["step"].append((time.perf_counter() - t0) / steps)
            times[n]["update"].append(clocks[n].total / steps)
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=10, help="timed steps per repeat")
    p.add_argument("--repeats", type=int, default=5, help="repeats per variant (interleaved)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per variant first")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--latent-size", type=int, default=16,
                   help="latent side (images are twice that)")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (1: the machine is shared; 0 keeps torch's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-split", action="store_true",
                   help="do not time the update part apart (on an accelerator its readings "
                        "add two device syncs per step)")
    p.add_argument("--out", default=None, help="write the figures as JSON to this file")
    p.add_argument("--json", action="store_true", help="end with one JSON line of figures")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    names = [n for n in a.variants.split(",") if n]
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        p.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    device = torch.device(a.device)

    s = build_setup(device, batch=a.batch, latent_size=a.latent_size, seed=a.seed)
    lora = sum(q.numel() for q in s.lora_unet()[0].parameters() if q.requires_grad)
    times = measure(s, names, steps=a.steps, repeats=a.repeats, warmup=a.warmup,
                    split=not a.no_split)
    step = {n: v["step"] for n, v in times.items()}
    upd = {n: v["update"] for n, v in times.items()}
    med = {n: statistics.median(v) for n, v in step.items()}
    med_upd = {n: statistics.median(v) for n, v in upd.items()}
    out: dict[str, Any] = {
        "bench": "sd_overhead", "device": str(device), "steps": a.steps,
        "repeats": a.repeats, "warmup": a.warmup, "batch": a.batch, "split": not a.no_split,
        "model": {"unet_widths": [64, 128], "latent_size": a.latent_size,
                  "unet_params": sum(v.numel() for v in s.unet_state.values()),
                  "lora_rank": s.rank, "lora_params": lora},
        "repeats_sec_per_step": step, "sec_per_step": med,
        "repeats_update_sec_per_step": upd, "update_sec_per_step": med_upd}
    if "bare" in med and "guard" in med:
        out["ratio_guard_vs_bare"] = med["guard"] / med["bare"]
        out["paired_ratio_guard_vs_bare"] = statistics.median(
            g / b for g, b in zip(step["guard"], step["bare"]))
        # the update part alone: what guard.step costs beyond clip + optimizer + zero_grad,
        # as a share of the bare step
        out["guard_update_extra_sec"] = med_upd["guard"] - med_upd["bare"]
        out["guard_update_extra_vs_bare_step"] = out["guard_update_extra_sec"] / med["bare"]
    if "bare" in med and "steadydiff" in med:  # the bar: <= 1.05x
        out["ratio_steadydiff_vs_bare"] = med["steadydiff"] / med["bare"]
        out["paired_ratio_steadydiff_vs_bare"] = statistics.median(
            g / b for g, b in zip(step["steadydiff"], step["bare"]))
    out.update(env_info())

    print(f"SD LoRA loop on {device}, UNet widths (64, 128) at {a.latent_size}x"
          f"{a.latent_size} latents ({out['model']['unet_params'] / 1e6:.1f}M params, LoRA "
          f"rank {s.rank}: {lora} params), batch {a.batch}, {a.repeats} repeats x {a.steps} "
          f"steps, {torch.get_num_threads()} thread(s)")
    base = med.get("bare")
    print_table([[n, f"{med[n] * 1e3:.1f}", f"{statistics.mean(step[n]) * 1e3:.1f}",
                  f"{med[n] / base:.3f}x" if base else "-", f"{med_upd[n] * 1e3:.2f}"]
                 for n in names],
                ["variant", "median ms/step", "mean ms/step", "vs bare (median)",
                 "update ms/step (median)"])
    if "ratio_guard_vs_bare" in out:
        print(f"guard / bare: {out['ratio_guard_vs_bare']:.3f}x on the medians, "
              f"{out['paired_ratio_guard_vs_bare']:.3f}x paired per repeat; the update part: "
              f"{out['guard_update_extra_sec'] * 1e3:+.2f} ms/step "
              f"({out['guard_update_extra_vs_bare_step']:+.2%} of the bare step)")
    if "ratio_steadydiff_vs_bare" in out:
        print(f"steadydiff train_step / bare: {out['ratio_steadydiff_vs_bare']:.3f}x on the "
              f"medians, {out['paired_ratio_steadydiff_vs_bare']:.3f}x paired per repeat")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    if a.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
