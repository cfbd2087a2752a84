"""``steadydiff.Guard`` in an ordinary ``for batch in dataloader`` loop, with the loop's own
step counter — plain PyTorch, or the real accelerate package (``--accelerate``).

The loops of examples/guard_loop.py read their batch by position
(``guard.progress.batches_consumed``), so a rollback replays the data exactly. Most loops do
not: they iterate a DataLoader, which cannot go back, and count steps themselves. This is the
pattern for them (docs/guard.md, "An ordinary DataLoader loop"):

- **the step counter follows the guard**: after every decision ``step = d.step``. A healthy
  step advances it; a skip leaves it (the batch is dropped, the next one comes from the
  loader); a rollback moves it back by ``d.steps_back`` to the verified snapshot's step, and
  the steps from there are trained again, on the loader's next batches;
- **the data just goes on**: nothing to rewind; an epoch-based schedule keeps counting the
  loader's batches (``d.data_position`` is the guard's own count, for loops that read by
  position);
- **the guard does the update**: clipping (the global gradient norm to 1.0 unless ``clip=``
  says otherwise), the optimizer, scheduler and EMA steps.

A weight corrupted by the loop's own code (``--corrupt-weight STEP``: one element set to
1e36 before that step, as a memory error would) is named ``weight_jump`` and rolled back:

    python examples/guard_dataloader.py                        # 80 steps, healthy
    python examples/guard_dataloader.py --corrupt-weight 50    # a rollback at step 50
    python examples/guard_dataloader.py --accelerate --corrupt-weight 50
"""

from __future__ import annotations

import argparse

import torch
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader, TensorDataset

from guard_loop import T, Denoiser, diffusion_loss, digits, report_losses
from steadydiff import Guard


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=80, help="optimizer steps (default: 80)")
    p.add_argument("--batch", type=int, default=64, help="batch size (default: 64)")
    p.add_argument("--out", default="runs/guard_dataloader",
                   help="run directory for incidents.jsonl (default: runs/guard_dataloader)")
    p.add_argument("--corrupt-weight", type=int, default=None, metavar="STEP",
                   help="set one weight element to 1e36 before this step (once)")
    p.add_argument("--accelerate", action="store_true",
                   help="prepare model, optimizer and loader with accelerate.Accelerator")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    loader = DataLoader(TensorDataset(digits()), batch_size=args.batch, shuffle=True,
                        drop_last=True, generator=torch.Generator().manual_seed(0))
    model = Denoiser()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    sched = LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))           # warm-up
    backward = torch.Tensor.backward
    if args.accelerate:
        from accelerate import Accelerator
        accelerator = Accelerator(cpu=True)
        model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
        backward = accelerator.backward
    guard = Guard(model, opt, lr_scheduler=sched, run_dir=args.out, num_timesteps=T,
                  config={"warmup_steps": 20, "snapshot_every": 20})  # clips at 1.0
    corrupt_at, losses, step = args.corrupt_weight, [], 0
    while step < args.steps:
        for (x0,) in loader:                                # a plain loader: it goes on
            if step == corrupt_at:                          # the loop's own code, once
                with torch.no_grad():
                    next(model.parameters()).view(-1)[0] = 1e36
                corrupt_at = None
            t = torch.randint(0, T, (x0.shape[0],))
            per_sample = diffusion_loss(model, x0, t)       # (B,)
            loss = per_sample.mean()
            backward(loss)
            d = guard.step(loss, t=t, per_sample_loss=per_sample, inputs=x0)
            if d.action == "abort":
                print(guard.summary())
                raise SystemExit(3)
            if d.action == "rollback":                      # the state went back: so does step
                print(f"guard: rollback at step {step} ({d.incident.kind}): "
                      f"{d.steps_back} step(s) back to step {d.step}; the loader goes on")
            elif d.action == "skip":
                print(f"guard: skip at step {step} ({d.incident.kind if d.incident else ''})")
            else:
                losses.append(d.loss)
            step = d.step                                   # the loop's counter follows the guard
            if step >= args.steps:
                break
    print(guard.summary())
    report_losses(guard, losses)


if __name__ == "__main__":
    main()
