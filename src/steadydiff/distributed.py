"""torchrun / DistributedDataParallel: process-group setup, rank-consistent helpers, and
the safety nets that keep a failing group from hanging.

steadydiff has no launcher and no communication layer of its own: ``torchrun`` starts the
processes and sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and the rendezvous; this module
reads them, joins the group (NCCL on CUDA, gloo on CPU) and offers the few collectives the
trainer and the guard need. Design rules:

- Every action is decided identically on every rank: per-rank observations are *gathered*
  before the guard decides, never acted on locally (a rank that skipped a backward the others
  made leaves them waiting in the gradient all-reduce until the collective timeout:
  ``bench/ddp.py`` measures exactly that).
- Nothing waits forever. Collectives time out after ``train.dist_timeout`` seconds with an
  error naming the likely cause, and a wall-clock watchdog ends a process whose step has made
  no progress for ``train.watchdog_timeout`` seconds (a hang outside any collective).
- Only rank 0 writes files; every rank reads the same checkpoint (rank 0 picks it).
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .devices import resolve_device

# exit status of a process that the watchdog ended, or whose collective timed out (a peer
# died or hung); 0/2/3/4 are the CLI's (finished / bad input / aborted / save failed)
EXIT_DIST_FAILURE = 5


class DistributedError(RuntimeError):
    """The process group failed: a peer died or hung, or a collective timed out."""


@dataclass(frozen=True)
class DistContext:
    """Where this process sits in the group (a single process is rank 0 of 1)."""

    rank: int = 0
    world_size: int = 1

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def launched_by_torchrun() -> bool:
    """True when torchrun (or any launcher using its env protocol) started this process."""
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def setup(device_name: str, timeout_s: float, *,
          group_of_one: bool = False) -> tuple[DistContext, torch.device]:
    """Join the process group if launched by torchrun; pick this rank's device.

    Args:
        device_name: the config's ``train.device`` (auto | cpu | cuda).
        timeout_s: collective timeout in seconds.
        group_of_one: a single process gets a process group of its own (FSDP shards over
            a device mesh, which needs one: ``train.parallel=fsdp`` on one GPU, e.g. for
            CPU offload).

    Returns:
        ``(context, device)``. Without torchrun: ``DistContext()`` and the plain device.
        With torchrun: NCCL and ``cuda:LOCAL_RANK`` when CUDA is used, else gloo on the CPU.
    """
    # an absent or unknown device is a DeviceError (exit 2) before anything starts
    use_cuda = resolve_device(device_name, what="train.device").type == "cuda"
    if not launched_by_torchrun() or int(os.environ["WORLD_SIZE"]) == 1:
        if dist.is_available() and dist.is_initialized():  # a caller set up the group itself
            return _context_of_group(), _device(use_cuda, int(os.environ.get("LOCAL_RANK", 0)))
        if group_of_one:
            local = int(os.environ.get("LOCAL_RANK", 0))
            if use_cuda:
                torch.cuda.set_device(local)
            dist.init_process_group("nccl" if use_cuda else "gloo", store=dist.HashStore(),
                                    rank=0, world_size=1,
                                    timeout=datetime.timedelta(seconds=timeout_s))
            return DistContext(), _device(use_cuda, local if use_cuda else None)
        return DistContext(), _device(use_cuda, None)
    local = int(os.environ["LOCAL_RANK"])
    if use_cuda and local >= torch.cuda.device_count():
        raise DistributedError(
            f"LOCAL_RANK {local} but this node has only {torch.cuda.device_count()} CUDA "
            f"device(s); start at most {torch.cuda.device_count()} processes per node "
            "(--nproc_per_node)")
    backend = "nccl" if use_cuda else "gloo"
    if use_cuda:
        torch.cuda.set_device(local)
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s),
                                device_id=torch.device("cuda", local) if use_cuda else None)
    return _context_of_group(), _device(use_cuda, local)


def _device(use_cuda: bool, local: int | None) -> torch.device:
    if not use_cuda:
        return torch.device("cpu")
    return torch.device("cuda", local) if local is not None else torch.device("cuda")


def _context_of_group() -> DistContext:
    return DistContext(dist.get_rank(), dist.get_world_size())


_control: Any = None  # the gloo group of control_group() (None: not made yet)


def control_group() -> Any:
    """The process group for the loop's host-side agreements (stop signals, the time
    budget's clock): a gloo group, so they are CPU all-reduces that never wait for the GPU
    (an NCCL all-reduce's result read on the host would drain the launch queue every step).
    The default group when it is gloo already. Made on first use, which every rank reaches
    at the same point of the loop (its first pass)."""
    global _control
    if dist.get_backend() == "gloo":
        return None
    if _control is None:
        _control = dist.new_group(backend="gloo")
    return _control


def teardown() -> None:
    """Leave the process group (at the end of a run, or on the way out of a failure)."""
    global _control
    _control = None
    from . import sharding

    sharding.forget_meshes()
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # a broken group cannot always be destroyed cleanly
            pass


def active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def group_exists() -> bool:
    """Whether this process is in a process group (of any size, one included)."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's rank in the group (0 when there is none)."""
    return dist.get_rank() if group_exists() else 0


def is_main() -> bool:
    """Rank 0, or not distributed: the process that writes files and prints."""
    return not group_exists() or dist.get_rank() == 0


def wrap(model: nn.Module, device: torch.device) -> nn.Module:
    """DistributedDataParallel around ``model`` (parameters broadcast from rank 0).

    Buffers are constants in our models (position tables): synced once at construction, not
    re-broadcast on every forward (that would put a collective into the guard's local replays
    and probes).
    """
    return nn.parallel.DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None,
        forward_sync_buffers=False)


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` on every rank (pickled: small, trusted, same-job data only)."""
    if not active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def barrier() -> None:
    """Wait until every rank gets here (no-op when not distributed)."""
    if active():
        dist.barrier()


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank (one entry when not distributed)."""
    if not active():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def gather_rows(vec: torch.Tensor) -> torch.Tensor:
    """Stack every rank's 1-D ``vec`` into a (world, n) tensor on every rank (one
    collective). Gathering rather than summing keeps each rank's own values, so a finding can
    name the rank it came from and a max is a max."""
    if not active():
        return vec.unsqueeze(0)
    parts = [torch.empty_like(vec) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, vec.contiguous())
    return torch.stack(parts)


def tensor_fingerprint(tensors: list[torch.Tensor]) -> torch.Tensor:
    """A cheap bitwise fingerprint of ``tensors``: (2,) int64 on their device.

    Each tensor's bytes are read as integers and summed in int64, over all positions and
    over the even ones, so any single changed bit and most moves of values change it. Exactly
    equal tensors on two ranks give exactly equal fingerprints (integer arithmetic, no
    rounding). Cost: one pass over the weights, no copies, no host sync (bench/ddp.py).
    """
    dev = tensors[0].device if tensors else torch.device("cpu")
    ints = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
    acc = torch.zeros(2, dtype=torch.int64, device=dev)
    for t in tensors:
        v = t.detach().reshape(-1).view(ints[t.element_size()])
        acc[0] += v.sum(dtype=torch.int64)
        acc[1] += v[::2].sum(dtype=torch.int64)
    return acc


def broadcast_tensors(tensors: list[torch.Tensor], src: int = 0) -> None:
    """Overwrite ``tensors`` on every rank with rank ``src``'s values, in place."""
    if not active():
        return
    with torch.no_grad():
        for t in tensors:
            dist.broadcast(t.data, src=src)


def optimizer_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's state tensors (Adam moments, step counts), in a fixed order."""
    out: list[torch.Tensor] = []
    for g in opt.param_groups:
        for p in g["params"]:
            for k in sorted(opt.state.get(p, {})):
                v = opt.state[p][k]
                if isinstance(v, torch.Tensor):
                    out.append(v)
    return out


def describe_failure(e: BaseException, ctx: DistContext) -> str:
    """A readable account of a collective failure (timeout, a peer gone)."""
    text = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
    return (f"rank {ctx.rank}/{ctx.world_size}: a collective failed ({text}). Another rank "
            "most likely died (see its log above: torchrun prints the first failure) or hung "
            "past train.dist_timeout. Rerun the same command to resume from the last "
            "checkpoint.")


class Watchdog:
    """Ends this process if no heartbeat arrives for ``timeout_s`` seconds.

    A rank stuck outside any collective (a deadlocked data worker, a hung filesystem) would
    otherwise keep its peers waiting until their collective timeout and keep the job alive
    forever. On expiry the watchdog prints every thread's stack (the evidence) and exits with
    ``EXIT_DIST_FAILURE``; torchrun then stops the other ranks. ``timeout_s <= 0`` disables it.
    """

    def __init__(self, timeout_s: float, rank: int = 0):
        self.timeout_s = timeout_s
        self.rank = rank
        self._last = time.monotonic()
        self._what = "start"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def beat(self, what: str) -> None:
        """Progress was made (``what`` is named if the next one never comes)."""
        self._last = time.monotonic()
        self._what = what

    def __enter__(self) -> "Watchdog":
        if self.timeout_s > 0:
            self._thread = threading.Thread(target=self._watch, name="steadydiff-watchdog",
                                            daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(min(5.0, self.timeout_s / 4)):
            idle = time.monotonic() - self._last
            if idle > self.timeout_s:
                print(f"\nwatchdog: rank {self.rank} made no progress for {idle:.0f}s (last: "
                      f"{self._what}; train.watchdog_timeout={self.timeout_s:g}s); stacks of "
                      "every thread follow, then this process exits "
                      f"{EXIT_DIST_FAILURE}", file=sys.stderr, flush=True)
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                sys.stderr.flush()
                os._exit(EXIT_DIST_FAILURE)


__all__ = ["DistContext", "DistributedError", "EXIT_DIST_FAILURE", "Watchdog", "active",
           "barrier", "broadcast_object", "broadcast_tensors", "describe_failure",
           "gather_objects", "gather_rows", "group_exists", "is_main", "launched_by_torchrun",
           "optimizer_tensors", "rank", "setup", "teardown", "tensor_fingerprint", "wrap"]
