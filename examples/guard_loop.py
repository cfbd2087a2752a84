"""A plain PyTorch diffusion loop guarded by ``steadydiff.Guard``: the README's snippet, whole.

A small convolutional denoiser learns the 8x8 digits bundled with scikit-learn (no
download) with the DDPM noise-prediction loss (Ho et al. 2020, eq. 14), AdamW, an LR warm-up
and an EMA of the weights. The guard replaces the optimizer, scheduler and EMA steps: after
``backward`` one ``guard.step(...)`` inspects the step and applies it, skips it, rolls the
state back to a verified snapshot, or says abort. Runs in seconds on a CPU:

    python examples/guard_loop.py                      # 100 steps, a healthy run
    python examples/guard_loop.py --inject-nan 60      # a NaN pixel in the batch of step 60

With ``--inject-nan`` the guard names the batch as the problem (``bad_batch``), skips that
step and the run ends as it would have: the summary and ``RUN_DIR/incidents.jsonl`` say so.
docs/guard.md explains the arguments; examples/guard_accelerate_style.py is the same loop
with a wrapped optimizer and an fp16 GradScaler.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.optim.lr_scheduler import LambdaLR
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from steadydiff import Guard

T = 1000
ALPHA_BAR = torch.cumprod(1 - torch.linspace(1e-4, 0.02, T), 0)  # DDPM's linear betas


def digits() -> torch.Tensor:
    """scikit-learn's 1797 bundled 8x8 digits as (N, 1, 8, 8) in [-1, 1], shuffled once."""
    x = torch.tensor(load_digits().images, dtype=torch.float32) / 16  # pixel values 0..16
    x = (x * 2 - 1).unsqueeze(1)
    return x[torch.randperm(len(x), generator=torch.Generator().manual_seed(0))]


def batch_at(data: torch.Tensor, position: int, size: int) -> torch.Tensor:
    """The batch at data position ``position``: reading data by position lets a rollback
    continue where the guard says (``guard.progress.batches_consumed``)."""
    idx = (position * size + torch.arange(size)) % len(data)
    return data[idx]


class Denoiser(nn.Module):
    """(x_t, t) -> the predicted noise: two convolutions with GroupNorm, SiLU and a
    sinusoidal timestep embedding added per channel."""

    def __init__(self, ch: int = 32, emb: int = 32):
        super().__init__()
        self.emb = emb
        self.t_proj = nn.Sequential(nn.Linear(emb, ch), nn.SiLU(), nn.Linear(ch, ch))
        self.inp = nn.Conv2d(1, ch, 3, padding=1)
        self.norm1 = nn.GroupNorm(8, ch)
        self.mid = nn.Conv2d(ch, ch, 3, padding=1)
        self.norm2 = nn.GroupNorm(8, ch)
        self.out = nn.Conv2d(ch, 1, 3, padding=1)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        half = self.emb // 2
        freqs = torch.exp(-math.log(10000) * torch.arange(half, device=x.device) / half)
        angles = t.float()[:, None] * freqs[None]                          # (B, emb/2)
        temb = self.t_proj(torch.cat([angles.sin(), angles.cos()], 1))     # (B, ch)
        h = F.silu(self.norm1(self.inp(x))) + temb[:, :, None, None]       # (B, ch, 8, 8)
        h = F.silu(self.norm2(self.mid(h)))
        return self.out(h)                                                 # (B, 1, 8, 8)


def with_nan_pixel(x0: torch.Tensor) -> torch.Tensor:
    """A corrupt batch: one NaN pixel (a bad file, a broken transform)."""
    x0 = x0.clone()
    x0[0, 0, 0, 0] = math.nan
    return x0


def diffusion_loss(model: nn.Module, x0: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Per-sample DDPM loss ||eps - eps_theta(x_t, t)||^2, (B,)."""
    noise = torch.randn_like(x0)
    ab = ALPHA_BAR[t].view(-1, 1, 1, 1)
    xt = ab.sqrt() * x0 + (1 - ab).sqrt() * noise  # q(x_t | x_0)
    return (model(xt, t) - noise).pow(2).mean(dim=(1, 2, 3))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100, help="optimizer steps (default: 100)")
    p.add_argument("--batch", type=int, default=64, help="batch size (default: 64)")
    p.add_argument("--out", default="runs/guard_loop",
                   help="run directory for incidents.jsonl (default: runs/guard_loop)")
    p.add_argument("--inject-nan", type=int, default=None, metavar="STEP",
                   help="put a NaN pixel into the batch of this step (once)")
    p.add_argument("--log-every", type=int, default=50, help="steps between status lines")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    data, steps, inject_at = digits(), args.steps, args.inject_nan

    model = Denoiser()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    sched = LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))           # warm-up
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.99))
    guard = Guard(model, opt, lr_scheduler=sched, ema=ema, run_dir=args.out,
                  num_timesteps=T, config={"warmup_steps": 20, "snapshot_every": 20})
    losses = []
    while guard.progress.step < steps:                      # the guard's counters drive the loop
        x0 = batch_at(data, guard.progress.batches_consumed, args.batch)  # your data, by position
        if guard.progress.step == inject_at:                # the fault to survive, once
            x0, inject_at = with_nan_pixel(x0), None
        t = torch.randint(0, T, (x0.shape[0],))
        per_sample = diffusion_loss(model, x0, t)           # (B,)
        loss = per_sample.mean()
        loss.backward()
        d = guard.step(loss, t=t, per_sample_loss=per_sample, inputs=x0)  # clip, step, EMA, or not
        if d.action == "abort":
            step = guard.restore_verified()             # the last verified state, or None
            if step is not None:                        # save it, not the broken one
                torch.save({"model": model.state_dict(), "ema": ema.state_dict(),
                            "optimizer": opt.state_dict(), "step": step},
                           f"{args.out}/last_good.pt")
            break
        if d.action == "step":
            losses.append(d.loss)
            if d.step % args.log_every == 0:
                print(f"step {d.step}/{steps} loss {sum(losses[-10:]) / len(losses[-10:]):.4f}")
        else:
            print(f"guard: {d.action} at step {d.step} ({d.incident.kind if d.incident else ''})")
    print(guard.summary())
    report_losses(guard, losses)


def report_losses(guard: Guard, losses: list[float]) -> None:
    """The loss at the start and at the end of the run (the examples' last line)."""
    if losses:
        k = min(10, len(losses))
        print(f"finished {guard.progress.step} steps: loss {sum(losses[:k]) / k:.4f} "
              f"(first {k}) -> {sum(losses[-k:]) / k:.4f} (last {k})")


if __name__ == "__main__":
    main()
