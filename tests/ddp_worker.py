"""One training process for the distributed tests: ``steadydiff``'s own ``run``, plus a dump
of what only this rank knows (its weights, EMA, optimizer state and guard decisions), so the
tests can compare ranks. Started by torchrun (or plainly, as a one-process run):

    python -m torch.distributed.run --standalone --nproc_per_node=2 ddp_worker.py CONFIG OUT \
        [SECTION.KEY=VALUE ...]
"""

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from steadydiff import distributed  # noqa: E402
from steadydiff.cli import main as cli_main  # noqa: E402
from steadydiff.trainer import loop  # noqa: E402

torch.set_num_threads(1)
captured = {}
_step = loop.train_step


def spy(state, batch):
    captured["state"] = state
    return _step(state, batch)


def dump(out: Path) -> None:
    state = captured.get("state")
    if state is None:
        return
    tensors = {f"model.{k}": v for k, v in state.model.state_dict().items()}
    tensors.update({f"ema.{k}": v for k, v in state.ema.module.state_dict().items()})
    for i, t in enumerate(distributed.optimizer_tensors(state.optimizer)):
        tensors[f"optim.{i}"] = t
    # FSDP: every rank's shards gathered (a collective: every rank dumps), so each rank's
    # file holds the whole state it takes part in
    tensors = {k: (v.full_tensor() if isinstance(v, DTensor) else v).reshape(-1)
               if k.startswith("optim.") else (v.full_tensor() if isinstance(v, DTensor) else v)
               for k, v in tensors.items()}
    save_file({k: v.detach().cpu().clone() for k, v in tensors.items()},  # EMA may share
              str(out / f"rank{state.rank}.safetensors"))
    incidents = [{"step": i.step, "kind": i.kind, "action": i.action,
                  "rank": i.evidence.get("rank"), "evidence": i.evidence}
                 for i in (state.guard.incidents if state.guard else [])]
    (out / f"rank{state.rank}.json").write_text(json.dumps(
        {"step": state.step, "batches_consumed": state.batches_consumed,
         "train_seconds": state.train_seconds,
         "world_size": state.world_size, "incidents": incidents,
         "sharded": state.sharded}, default=str))


_build = loop.build_state


def spy_build(*args, **kwargs):  # a resumed run that trains no step is dumped too
    captured["state"] = state = _build(*args, **kwargs)
    return state


if __name__ == "__main__":
    loop.train_step = spy
    loop.build_state = spy_build
    # tests/test_max_time.py runs one rank's time-budget clock 4x fast: the ranks must still
    # record the same training seconds, and so take the same LR and stop at the same step
    if os.environ.get("STEADYDIFF_TEST_FAST_CLOCK_RANK") == os.environ.get("RANK", "0"):
        import time

        from steadydiff.trainer import budget
        budget.now = lambda: 4 * time.monotonic()
    config, out, *overrides = sys.argv[1:]
    # dumped before the process group goes (FSDP's shards are gathered with it)
    _teardown = distributed.teardown

    def teardown() -> None:
        if not captured.get("dumped"):
            captured["dumped"] = True
            dump(Path(out))
        _teardown()

    distributed.teardown = teardown
    rc = cli_main(["train", config, "--out", out] + (["--set", *overrides] if overrides else []))
    if not captured.get("dumped"):  # a caller's group, not torn down by the run
        dump(Path(out))
    sys.exit(rc)
