"""FSDP2 (``train.parallel=fsdp``): the model sharded over the ranks, and what the guard, the
EMA and the checkpoints need to work on shards.

Sharding is PyTorch's own: :func:`shard` calls ``torch.distributed.fsdp.fully_shard`` on each
block of the model (our UNet's residual and attention blocks, the DiT's blocks: the modules
that are :class:`~steadydiff.models.layers.Checkpointable`; for any other model the
children of its ``ModuleList``\\ s) and then on the whole model. Every parameter becomes a
``DTensor`` sharded on dim 0: each rank keeps 1/N of the weights, of their gradients (reduce-
scattered in the backward pass) and of the AdamW moments; a block's full weights exist only
while it runs.

The guard's checks are reductions over parameters and gradients (finite, norms, weight
jumps, per-layer norms). On shards each rank sees a part, and two ranks can disagree (one
shard finite, the other not), so every such check goes through :func:`norms` or
:func:`total_norm`: the local shards' squared norms are summed over the ranks (one
all-reduce) before anything is decided, and every rank decides from the same numbers.
Everything else works on :func:`local` tensors (the shard a rank holds: a view of the
parameter's storage, so a copy into it is a copy into the parameter).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["is_sharded", "local", "any_sharded", "norms", "total_norm", "all_finite",
           "shard", "shard_units", "mesh", "load_local", "local_bytes", "nested_bytes",
           "on_meta", "materialize"]


def is_sharded(t: Any) -> bool:
    """Whether ``t`` is a sharded tensor (a ``DTensor``: an FSDP2 parameter or its state)."""
    return isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` this rank holds: the shard of a ``DTensor`` (a view of its storage),
    else ``t`` itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def any_sharded(tensors: Iterable[Any]) -> bool:
    return any(isinstance(t, DTensor) for t in tensors)


def _sum_over_ranks(x: torch.Tensor) -> torch.Tensor:
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return x
    if x.device.type == "cpu" and dist.get_backend() == "nccl":  # e.g. a snapshot's norms
        y = x.to(torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(y)
        return y.cpu()
    dist.all_reduce(x)
    return x


def norms(tensors: list[torch.Tensor], reduce: bool | None = None) -> torch.Tensor:
    """(n,) float32 L2 norms of whole ``tensors``, on their device, no host read.

    Sharded tensors (or ``reduce=True``: plain tensors that are shards, e.g. a snapshot's
    copies): each rank's local norms squared, summed over the ranks (one all-reduce), so
    every rank gets the same global norms. A non-finite element anywhere makes that norm
    non-finite on every rank."""
    if reduce is None:
        reduce = any_sharded(tensors)
    if not reduce:
        return torch.stack(torch._foreach_norm(tensors)).float()
    n = torch.stack(torch._foreach_norm([local(t) for t in tensors])).float()
    return _sum_over_ranks(n.square()).sqrt()


def total_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """0-dim float32: the global L2 norm over all of sharded ``tensors`` (one all-reduce)."""
    n = torch.stack(torch._foreach_norm([local(t) for t in tensors])).float()
    return _sum_over_ranks(n.square().sum()).sqrt()


def all_finite(tensors: list[torch.Tensor]) -> torch.Tensor:
    """0-dim bool: every element of every tensor finite, on every rank's shard."""
    if not tensors:
        return torch.tensor(True)
    return torch.isfinite(norms(tensors).sum())


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The modules :func:`shard` wraps one by one: each a unit of FSDP's all-gather (its
    weights are gathered just before it runs and freed after). Our models' blocks are the
    ``Checkpointable`` ones; a model without any gives the children of its outermost
    ``ModuleList``\\ s (a diffusers UNet's down and up blocks, the resnets and attentions of
    its mid block; transformer layers), never one inside another."""
    from .models.layers import Checkpointable

    units = [m for m in model.modules() if isinstance(m, Checkpointable) and m is not model]
    if units:
        return units
    inside: set[int] = set()  # modules within a unit already chosen (pre-order walk)
    for m in model.modules():
        if id(m) in inside or not isinstance(m, nn.ModuleList):
            continue
        for c in m:
            units.append(c)
            inside.update(id(x) for x in c.modules())
    return units


_meshes: dict[str, Any] = {}


def mesh(device: torch.device) -> Any:
    """The 1-D device mesh over every rank (made once per device type)."""
    from torch.distributed.device_mesh import init_device_mesh

    if device.type not in _meshes:
        _meshes[device.type] = init_device_mesh(device.type, (dist.get_world_size(),))
    return _meshes[device.type]


def forget_meshes() -> None:
    """Drop the cached meshes (their process group is gone: ``distributed.teardown``)."""
    _meshes.clear()


def shard(model: nn.Module, device: torch.device, *, precision: str = "fp32",
          offload: bool = False) -> int:
    """Shard ``model`` in place over every rank with FSDP2 (``fully_shard`` per unit of
    :func:`shard_units`, then the whole model). ``precision=bf16``: the gathered weights and
    the forward/backward in bf16, gradients reduced in fp32, the sharded weights and AdamW
    fp32 (``MixedPrecisionPolicy``). ``offload``: the shards live in CPU memory
    (``CPUOffloadPolicy``). Returns the number of units."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    kw: dict[str, Any] = {"mesh": mesh(device)}
    if precision == "bf16":
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                               reduce_dtype=torch.float32)
    if offload:
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    units = shard_units(model)
    for u in units:
        fully_shard(u, **kw)
    # the root too reshards after its forward (FSDP2 keeps the root gathered by default, for
    # the backward that follows in training): after a forward with no backward (a probe, a
    # sample grid, the EMA's sampling) every parameter is its shard again, which is what the
    # guard's checks, the snapshots and the EMA's in-place average read and write
    fully_shard(model, reshard_after_forward=True, **kw)
    return len(units)


@torch.no_grad()
def load_local(module: nn.Module, values: dict[str, torch.Tensor]) -> None:
    """Copy ``values`` (each the local shard of the parameter or buffer of that name, as
    :func:`local` gives it) into ``module``'s tensors in place (a snapshot's rollback)."""
    own = dict(module.named_parameters())
    own.update(dict(module.named_buffers()))
    for k, v in values.items():
        dst = local(own[k])
        if dst.shape != v.shape:  # a parameter not in its sharded state: a bug, say which
            raise RuntimeError(f"{k}: this rank holds {tuple(dst.shape)}, the saved shard is "
                               f"{tuple(v.shape)}")
        dst.copy_(v)


def local_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes this rank holds of ``tensors`` (a DTensor counts its shard only)."""
    return sum(local(t).numel() * local(t).element_size() for t in tensors)


def nested_bytes(obj: Any) -> int:
    """Bytes of every tensor in a nested structure of dicts, lists, tuples and dataclasses (a
    snapshot, a state dict), a DTensor counting its shard only."""
    if isinstance(obj, torch.Tensor):
        return local_bytes([obj])
    if isinstance(obj, dict):
        return sum(nested_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(nested_bytes(v) for v in obj)
    if hasattr(obj, "__dataclass_fields__"):
        return sum(nested_bytes(getattr(obj, k)) for k in obj.__dataclass_fields__)
    return 0


# --------------------------------------------------------------------------- meta-device init


def on_meta(module: nn.Module) -> bool:
    """Whether ``module`` has tensors on the meta device (built without storage, to be
    sharded first and read shard by shard: :func:`materialize`)."""
    return any(t.is_meta for t in list(module.parameters()) + list(module.buffers()))


@torch.no_grad()
def materialize(module: nn.Module, device: torch.device,
                read: Callable[[str, int | None, int | None], torch.Tensor]) -> int:
    """Give ``module`` (built on the meta device, then sharded by :func:`shard`) storage
    on ``device`` and fill each tensor with the part this rank holds, so that no rank ever
    holds the whole module: a sharded parameter's rows ``[start, stop)`` of its dim 0 (FSDP2
    shards dim 0) come from ``read(name, start, stop)``, an unsharded tensor (a buffer)
    whole from ``read(name, None, None)`` (PyTorch's FSDP2 recipe: ``to_empty``, then
    initialise; torchtitan's ``init_weights`` after ``fully_shard``).

    Returns:
        the bytes read (this rank's shards).
    """
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    module.to_empty(device=device)
    total = 0
    named = list(module.named_parameters()) + list(module.named_buffers())
    for name, t in named:
        if isinstance(t, DTensor):
            if list(t.placements) != [Shard(0)]:
                raise RuntimeError(f"{name}: placements {t.placements}, expected FSDP2's "
                                   "Shard(0)")
            shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh,
                                                                  t.placements)
            dst = t.to_local()
            src = read(name, offset[0], offset[0] + shape[0])
        else:
            dst, src = t, read(name, None, None)
        if tuple(src.shape) != tuple(dst.shape):
            raise RuntimeError(f"{name}: read {tuple(src.shape)}, this rank holds "
                               f"{tuple(dst.shape)}")
        dst.copy_(src)
        total += src.numel() * src.element_size()
    return total
