"""``steadydiff.Guard`` inside a diffusers-style text-to-image LoRA script.

The shape of diffusers' ``train_text_to_image_lora.py``: the UNet, VAE, text encoder,
tokenizer and DDPM noise scheduler of a Stable Diffusion folder, the VAE and the text
encoder frozen, a peft LoRA on the UNet's attention projections, AdamW over the LoRA
parameters, latents from the VAE times its scaling factor, ``add_noise``, an epsilon or v
target (whatever the scheduler's ``prediction_type`` says) and the MSE loss. After
``backward`` one ``guard.step(...)`` takes the place of ``optimizer.step()``: it inspects the
step (per-timestep loss spikes, a corrupt latents batch, non-finite gradients and weights)
and applies it, skips it, or rolls back. At the end the LoRA is saved in the diffusers format
(``pytorch_lora_weights.safetensors``, loadable with ``pipe.load_lora_weights``), and only
when the weights are the ones the guard verified finite: a NaN LoRA never reaches disk.

The data is twelve 32x32 coloured shapes drawn in memory, with captions ("a red square").
Without ``--model`` a tiny SD folder with random weights is built in ``OUT/tiny_sd``
(``steadydiff.integrations.sd.tiny``); nothing is downloaded. Runs in seconds on a CPU:

    python examples/guard_sd_lora.py                     # 40 steps, a healthy run
    python examples/guard_sd_lora.py --inject-nan 25     # a NaN in the latents of step 25
    python examples/guard_sd_lora.py --model PATH        # a local SD 1.x/2.x folder

With ``--inject-nan`` the guard names the latents batch as the problem (``bad_batch``), skips
that step, and the run ends finite, with a finite LoRA: the summary and
``OUT/incidents.jsonl`` say so. docs/guard.md, "Inside a diffusers LoRA script", quotes the
lines that matter; examples/guard_loop.py is the same guard in a plain PyTorch loop.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from diffusers import (AutoencoderKL, DDPMScheduler, StableDiffusionPipeline,
                       UNet2DConditionModel)
from diffusers.optimization import get_scheduler
from diffusers.utils import convert_state_dict_to_diffusers
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict
from transformers import CLIPTextModel, CLIPTokenizer

from steadydiff import Guard

COLORS = {"red": (1.0, -1.0, -1.0), "green": (-1.0, 1.0, -1.0), "blue": (-1.0, -1.0, 1.0),
          "yellow": (1.0, 1.0, -1.0)}


def shapes(size: int = 32) -> tuple[torch.Tensor, list[str]]:
    """Every colour x {square, circle, triangle} on a grey ground: (12, 3, size, size) images
    in [-1, 1] and their captions."""
    yy, xx = torch.meshgrid(torch.linspace(-1, 1, size), torch.linspace(-1, 1, size),
                            indexing="ij")
    masks = {"square": (xx.abs() < 0.5) & (yy.abs() < 0.5),
             "circle": xx ** 2 + yy ** 2 < 0.55 ** 2,
             "triangle": (yy < 0.5) & (yy > 2 * xx.abs() - 0.6)}   # apex up
    images, captions = [], []
    for color, rgb in COLORS.items():
        for shape, mask in masks.items():
            images.append(torch.where(mask, torch.tensor(rgb).view(3, 1, 1), 0.0))
            captions.append(f"a {color} {shape}")
    return torch.stack(images), captions                               # (12, 3, size, size)


def batch_indices(position: int, size: int, n: int) -> torch.Tensor:
    """The dataset indices of the batch at data position ``position`` (reading data by
    position lets a rollback continue where the guard says)."""
    return (position * size + torch.arange(size)) % n


def with_nan(latents: torch.Tensor) -> torch.Tensor:
    """A corrupt batch: one NaN in the first sample's latents (a bad image, a VAE fault)."""
    latents = latents.clone()
    latents[0, 0, 0, 0] = math.nan
    return latents


def save_lora(unet: UNet2DConditionModel, out: Path) -> Path:
    """The UNet's LoRA in the diffusers format: peft's state dict, converted to diffusers'
    key names, written by the pipeline's own LoRA saver, with the adapter's config (rank,
    alpha, targets) as metadata so ``load_lora_weights`` rebuilds the same scale."""
    unet_lora = convert_state_dict_to_diffusers(get_peft_model_state_dict(unet))
    StableDiffusionPipeline.save_lora_weights(
        out, unet_lora_layers=unet_lora, safe_serialization=True,
        unet_lora_adapter_metadata=unet.peft_config["default"].to_dict())
    return out / "pytorch_lora_weights.safetensors"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=None,
                   help="a local Stable Diffusion folder (default: build a tiny random one)")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps")
    p.add_argument("--batch", type=int, default=8, help="batch size")
    p.add_argument("--resolution", type=int, default=None,
                   help="image side (default: the VAE's sample_size, 32 for the tiny model)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    p.add_argument("--rank", type=int, default=4, help="LoRA rank")
    p.add_argument("--alpha", type=float, default=None, help="lora_alpha (default: the rank)")
    p.add_argument("--out", default="runs/guard_sd_lora",
                   help="run directory: incidents.jsonl and pytorch_lora_weights.safetensors")
    p.add_argument("--inject-nan", type=int, default=None, metavar="STEP",
                   help="put a NaN into the latents of this step's batch (once)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--log-every", type=int, default=10, help="steps between status lines")
    args = p.parse_args(argv)
    torch.manual_seed(args.seed)
    device, out, inject_at = torch.device(args.device), Path(args.out), args.inject_nan
    if args.model is None:
        from steadydiff.integrations.sd.tiny import make_tiny_sd

        args.model = str(make_tiny_sd(out / "tiny_sd"))   # beside the LoRA, to load it with
        print(f"no --model given: built a tiny Stable Diffusion with random weights in "
              f"{args.model}")

    # ---- the model folder's components, frozen except for the UNet's LoRA
    load = {"pretrained_model_name_or_path": args.model, "local_files_only": True}
    noise_scheduler = DDPMScheduler.from_pretrained(**load, subfolder="scheduler")
    tokenizer = CLIPTokenizer.from_pretrained(**load, subfolder="tokenizer")
    text_encoder = CLIPTextModel.from_pretrained(**load, subfolder="text_encoder")
    vae = AutoencoderKL.from_pretrained(**load, subfolder="vae")
    unet = UNet2DConditionModel.from_pretrained(**load, subfolder="unet")
    for m in (unet, vae, text_encoder):
        m.requires_grad_(False)
    unet.add_adapter(LoraConfig(r=args.rank, lora_alpha=args.alpha or args.rank,
                                init_lora_weights="gaussian",
                                target_modules=["to_k", "to_q", "to_v", "to_out.0"]))
    unet.to(device).train()
    vae.to(device).eval()
    text_encoder.to(device).eval()
    lora_params = [q for q in unet.parameters() if q.requires_grad]
    opt = torch.optim.AdamW(lora_params, lr=args.lr, weight_decay=1e-2)
    sched = get_scheduler("constant_with_warmup", opt, num_warmup_steps=5)
    T = noise_scheduler.config.num_train_timesteps
    prediction = noise_scheduler.config.prediction_type

    images, captions = shapes(args.resolution or vae.config.sample_size)
    ids = tokenizer(captions, max_length=tokenizer.model_max_length, padding="max_length",
                    truncation=True, return_tensors="pt").input_ids            # (12, 77)
    # clips at 1.0 (diffusers' --max_grad_norm default), steps AdamW and the LR scheduler
    guard = Guard(unet, opt, lr_scheduler=sched, run_dir=out, num_timesteps=T,
                  config={"warmup_steps": 20, "snapshot_every": 20})
    print(f"{args.model}: {prediction} prediction, LoRA rank {args.rank} on "
          f"{sum(q.numel() for q in lora_params)} parameters, {args.steps} steps")
    losses, d = [], None
    while guard.progress.step < args.steps:
        idx = batch_indices(guard.progress.batches_consumed, args.batch, len(images))
        with torch.no_grad():                               # the frozen VAE and text encoder
            pixels = images[idx].to(device)                 # (B, 3, H, W)
            latents = vae.encode(pixels).latent_dist.sample() * vae.config.scaling_factor
            encoder_hidden_states = text_encoder(ids[idx].to(device), return_dict=False)[0]
        if guard.progress.step == inject_at:                # the fault to survive, once
            latents, inject_at = with_nan(latents), None
        noise = torch.randn_like(latents)                   # (B, 4, H/8, W/8) in SD
        timesteps = torch.randint(0, T, (latents.shape[0],), device=device)
        noisy_latents = noise_scheduler.add_noise(latents, noise, timesteps)
        if prediction == "epsilon":
            target = noise
        elif prediction == "v_prediction":
            target = noise_scheduler.get_velocity(latents, noise, timesteps)
        else:
            raise ValueError(f"unknown prediction type {prediction}")
        model_pred = unet(noisy_latents, timesteps, encoder_hidden_states, return_dict=False)[0]
        per_sample = F.mse_loss(model_pred.float(), target.float(),
                                reduction="none").mean(dim=(1, 2, 3))   # (B,)
        loss = per_sample.mean()
        loss.backward()
        d = guard.step(loss, t=timesteps, per_sample_loss=per_sample, inputs=latents,
                       indices=idx)                         # instead of optimizer.step()
        if d.action == "abort":
            break
        if d.action == "step":
            losses.append(d.loss)
            if d.step % args.log_every == 0:
                print(f"step {d.step}/{args.steps} loss "
                      f"{sum(losses[-10:]) / len(losses[-10:]):.4f}")
        else:
            print(f"guard: {d.action} at step {d.step} ({d.incident.kind if d.incident else ''})")
    print(guard.summary())

    # Every decision but abort leaves the weights the guard last checked finite in the model
    # (step: checked after the update; skip: untouched since; rollback: a verified snapshot
    # restored); after an abort restore_verified() brings back the newest verified snapshot.
    verified = d is None or d.action != "abort" or guard.restore_verified() is not None
    if verified:
        print(f"LoRA (verified finite by the guard) written to {save_lora(unet, out)}")
    else:
        print("no LoRA written: the guard has no verified weights to save")
    if losses:
        k = min(10, len(losses))
        print(f"finished {guard.progress.step} steps: loss {sum(losses[:k]) / k:.4f} "
              f"(first {k}) -> {sum(losses[-k:]) / k:.4f} (last {k})")


if __name__ == "__main__":
    main()
