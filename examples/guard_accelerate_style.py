"""``steadydiff.Guard`` in an accelerate-style loop: a prepared (wrapped) optimizer, an fp16
GradScaler handed to the guard, ``accelerator.backward(loss)`` and ``accelerator.autocast()``.

The accelerate package is not needed: :class:`Accelerator` below has the shape of the pieces
of ``accelerate.Accelerator`` a training loop touches (``prepare``, ``backward``, ``autocast``,
``scaler``), built from torch's own ``GradScaler`` and ``autocast``. With the real package the
loop is the same, with ``scaler=accelerator.scaler`` (the guard then unscales, steps and
updates the scaler: do not also step it yourself). The model, data and loss are those of
examples/guard_loop.py. fp16 on a CPU is emulated (slow), so the defaults are small:

    python examples/guard_accelerate_style.py                       # fp16, 60 steps
    python examples/guard_accelerate_style.py --inject-overflow 30  # an inf gradient at step 30
    python examples/guard_accelerate_style.py --inject-nan 30       # a NaN batch at step 30

An overflowed gradient is the GradScaler's business: the step is skipped, the loss scale
halved, and no incident is written (the summary counts it as an fp16 overflow skip). A NaN
batch is a ``bad_batch`` incident: skipped, and the run ends as it would have.
"""

from __future__ import annotations

import argparse
import contextlib
import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from guard_loop import (T, Denoiser, batch_at, diffusion_loss, digits, report_losses,
                        with_nan_pixel)
from steadydiff import Guard


class AcceleratedOptimizer:
    """What ``accelerator.prepare`` returns for an optimizer: a wrapper that forwards."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def step(self, closure=None):
        self.optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True):
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state):
        self.optimizer.load_state_dict(state)


class Accelerator:
    """The shape of ``accelerate.Accelerator``: ``prepare``, ``backward``, ``autocast``, and
    in fp16 a ``scaler`` (a ``torch.amp.GradScaler``)."""

    def __init__(self, mixed_precision: str = "fp16", device: str = "cpu"):
        self.device = torch.device(device)
        self.fp16 = mixed_precision == "fp16"
        self.scaler = torch.amp.GradScaler(self.device.type) if self.fp16 else None

    def prepare(self, model, optimizer, scheduler):
        return model.to(self.device), AcceleratedOptimizer(optimizer), scheduler

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def autocast(self):
        return (torch.autocast(self.device.type, dtype=torch.float16) if self.fp16
                else contextlib.nullcontext())


class EMAModel:
    """The shape of diffusers' ``EMAModel``: ``step(parameters)`` and ``shadow_params``."""

    def __init__(self, parameters, decay: float = 0.99):
        self.decay = decay
        self.shadow_params = [p.detach().clone() for p in parameters]

    @torch.no_grad()
    def step(self, parameters):
        for s, p in zip(self.shadow_params, parameters):
            s.lerp_(p, 1 - self.decay)

    def state_dict(self):
        return {"decay": self.decay, "shadow_params": self.shadow_params}

    def load_state_dict(self, state):
        self.decay = state["decay"]
        self.shadow_params = [t.clone() for t in state["shadow_params"]]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60, help="optimizer steps (default: 60)")
    p.add_argument("--batch", type=int, default=32, help="batch size (default: 32)")
    p.add_argument("--mixed-precision", choices=["fp16", "no"], default="fp16",
                   help="autocast precision, as accelerate's option (default: fp16)")
    p.add_argument("--out", default="runs/guard_accelerate_style",
                   help="run directory for incidents.jsonl "
                        "(default: runs/guard_accelerate_style)")
    p.add_argument("--inject-nan", type=int, default=None, metavar="STEP",
                   help="put a NaN pixel into the batch of this step (once)")
    p.add_argument("--inject-overflow", type=int, default=None, metavar="STEP",
                   help="make a gradient of this step infinite (once), as an fp16 overflow")
    p.add_argument("--log-every", type=int, default=20, help="steps between status lines")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    data, steps = digits(), args.steps
    nan_at, overflow_at = args.inject_nan, args.inject_overflow

    accelerator = Accelerator(args.mixed_precision)
    model = Denoiser()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    sched = LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))
    model, opt, sched = accelerator.prepare(model, opt, sched)
    ema = EMAModel(model.parameters())
    guard = Guard(model, opt, lr_scheduler=sched, ema=ema, scaler=accelerator.scaler,
                  run_dir=args.out, num_timesteps=T,
                  config={"warmup_steps": 20, "snapshot_every": 20})
    losses = []
    while guard.progress.step < steps:
        x0 = batch_at(data, guard.progress.batches_consumed, args.batch)
        if guard.progress.step == nan_at:                   # a fault to survive, once
            x0, nan_at = with_nan_pixel(x0), None
        t = torch.randint(0, T, (x0.shape[0],))
        with accelerator.autocast():
            per_sample = diffusion_loss(model, x0, t).float()
        loss = per_sample.mean()
        accelerator.backward(loss)
        if guard.progress.step == overflow_at:              # another: an overflowed gradient
            model.mid.weight.grad.view(-1)[0], overflow_at = math.inf, None
        d = guard.step(loss, t=t, per_sample_loss=per_sample, inputs=x0)
        if d.action == "abort":
            break
        if d.action == "step":
            losses.append(d.loss)
            if d.step % args.log_every == 0:
                print(f"step {d.step}/{steps} loss {sum(losses[-10:]) / len(losses[-10:]):.4f}"
                      + (f" loss scale {guard.scaler.get_scale():g}" if guard.scaler else ""))
        else:
            print(f"guard: {d.action} at step {d.step} "
                  f"({d.incident.kind if d.incident else 'fp16 overflow: the scaler skips'})")
    print(guard.summary())
    report_losses(guard, losses)


if __name__ == "__main__":
    main()
