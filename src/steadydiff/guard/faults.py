"""Fault injection: the failures the guard must survive, on demand, in the real step.

Configured as a ``faults:`` list (see docs/faults.md). The injector implements the trainer's
:class:`~steadydiff.trainer.hooks.StepHooks`; with no faults configured the trainer keeps
their no-op defaults, so the hot path pays a few empty method calls.

Firing rules. A fault fires at optimizer step ``step`` and is *spent* once that step has
ended (stepped, skipped or rolled back), so a rollback that replays step ``step`` does not
meet it again: it models a transient event (a corrupt batch, a cosmic-ray bit flip, a bad LR
for a while). Inside its step it fires for every replay the guard makes (provenance), so the
diagnosis sees what really happened. Three kinds model lasting conditions instead and are
never spent by a rollback: ``oom`` (a memory limit, in force from ``step`` on, until the
micro-batch fits), ``bad_sample`` (a corrupt file: the sample is bad every time it is drawn,
from ``step`` on) and ``lr_ramp`` (a schedule bug: the LR grows by ``factor`` per step for
``steps`` steps, whatever the guard redoes).
"""

from __future__ import annotations

import copy
import os
import signal
import time
from contextlib import contextmanager
from typing import Iterator, Sequence

import torch
from torch import nn

from ..config import FaultConfig
from ..kinds import FaultKind, FaultWhere
from ..sharding import local
from ..trainer.hooks import NO_FAULTS, StepHooks

FP16_MAX = 65504.0


# default strength per kind when ``factor`` is not given
DEFAULT_FACTOR: dict[FaultKind, float] = {"outlier_batch": 1e4, "loss_scale": 1e4,
                                          "lr_scale": 1e4, "param_huge": 1e4,
                                          "fp16_overflow": 1e5, "lr_ramp": 1.05,
                                          "weight_corrupt": 1e36, "attn_logit_overflow": 8.0}
# conditions that last: a rollback does not spend them (module doc)
LASTING: frozenset[FaultKind] = frozenset({"oom", "bad_sample", "lr_ramp"})
# kinds that stay in force for ``steps`` steps
SPANNED: frozenset[FaultKind] = frozenset({"lr_scale", "lr_ramp", "attn_logit_overflow"})


class SimulatedOOM(torch.OutOfMemoryError):
    """Raised by the ``oom`` fault; handled exactly like a real CUDA out-of-memory error."""


def _default_param(model: nn.Module) -> str:
    # the largest weight matrix in the middle of the network: a plausible victim
    names = [n for n, p in model.named_parameters() if p.ndim > 1]
    return names[len(names) // 2]


def _default_attention(model: nn.Module) -> str:
    # the middle one of the attention layers with a fused q/k/v projection (self-attention:
    # a text model's cross-attentions have q and kv, which the fault does not grow)
    names = [n for n, m in model.named_modules()
             if hasattr(m, "upcast_attention") and isinstance(getattr(m, "qkv", None), nn.Module)]
    if not names:
        raise ValueError("fault attn_logit_overflow: the model has no attention layer with a "
                         "fused qkv projection (steadydiff's self-attention)")
    return names[len(names) // 2]


def _default_module(model: nn.Module) -> str:
    # a block in the middle of the network (its output feeds everything after it)
    names = [n for n, m in model.named_modules() if n and len(list(m.children())) > 0]
    return names[len(names) // 2]


def _target_module(model: nn.Module, f: FaultConfig) -> tuple[str, nn.Module]:
    """The module a fault acts on: its ``target``, else the default one."""
    name = f.target or _default_module(model)
    module = dict(model.named_modules()).get(name)
    if module is None:
        raise ValueError(f"fault {f.kind}: no module named {name!r}")
    return name, module


class FaultInjector(StepHooks):
    """Applies the configured faults at their steps. All methods are no-ops off-step.

    The configured faults are read, never written (a validated config is frozen): what the
    injector learns while running (which faults began or are spent, the micro-batch limit an
    ``oom`` fault settled on) is its own state.
    """

    def __init__(self, faults: Sequence[FaultConfig]):
        self.faults = [f if f.factor is not None or f.kind not in DEFAULT_FACTOR
                       else f.model_copy(update={"factor": DEFAULT_FACTOR[f.kind]})
                       for f in faults]
        self.spent: set[int] = set()
        self.started: set[int] = set()
        self.fired: list[dict] = []  # what was injected, for the benchmark's ground truth
        self.oom_limit: dict[int, int] = {}  # fault index -> the largest micro-batch that fits

    def _active(self, step: int,
                kinds: tuple[FaultKind, ...]) -> Iterator[tuple[int, FaultConfig]]:
        for i, f in enumerate(self.faults):
            if f.kind in kinds and i not in self.spent:
                span = f.steps if f.kind in SPANNED else 1
                if f.step <= step < f.step + span or (f.kind in ("oom", "bad_sample")
                                                      and step >= f.step):
                    self.started.add(i)
                    yield i, f

    def _record(self, f: FaultConfig, step: int, **info) -> None:
        if not any(r["kind"] == f.kind and r["step"] == step for r in self.fired):
            self.fired.append({"kind": f.kind, "step": step, **info})

    def end_step(self, step: int) -> None:
        """Mark the faults of ``step`` spent (called once the step is over, whatever happened)."""
        for i, f in enumerate(self.faults):
            last = f.step + (f.steps - 1 if f.kind in SPANNED else 0)
            if f.kind not in ("oom", "bad_sample") and step >= last:
                self.spent.add(i)

    def rollback(self) -> None:
        """After a rollback, faults that already began are spent (transient events do not
        recur when the steps are redone); the lasting ones (:data:`LASTING`) stay."""
        self.spent |= {i for i in self.started if self.faults[i].kind not in LASTING}

    def mark(self) -> tuple:
        """What the injector learnt so far (a speculative window's start)."""
        return copy.deepcopy((self.spent, self.started, self.fired, self.oom_limit))

    def restore(self, mark: tuple) -> None:
        """A rewind: the window's steps run again, and meet their faults again."""
        self.spent, self.started, self.fired, self.oom_limit = copy.deepcopy(mark)

    # ---- the hooks, in the order the step calls them

    def kill(self, step: int, where: FaultWhere) -> None:
        """``kill``: SIGKILL this process; ``hang``: stop responding (sleep) without dying,
        as a deadlocked worker or a stuck filesystem would."""
        for _, f in self._active(step, ("kill", "hang")):
            if f.where != where:
                continue
            if f.kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(f.factor if f.factor is not None else 10**9)

    @torch.no_grad()
    def before_step(self, step: int, model: nn.Module) -> None:
        """``weight_corrupt``: one element of a parameter becomes ``factor`` (1e36) between
        two steps: memory corruption, a bad in-place edit, a broken all-gather."""
        for _, f in self._active(step, ("weight_corrupt",)):
            name = f.target or _default_param(model)
            p = dict(model.named_parameters()).get(name)
            if p is None:
                raise ValueError(f"fault weight_corrupt: no parameter named {name!r}")
            p = local(p)
            if p.numel():
                p.view(-1)[0] = f.factor
            self._record(f, step, param=name, factor=f.factor)

    def lr(self, step: int, lr: float) -> float:
        for _, f in self._active(step, ("lr_scale", "lr_ramp")):
            factor = f.factor if f.kind == "lr_scale" else f.factor ** (step - f.step + 1)
            self._record(f, step, factor=f.factor)
            lr *= factor
        return lr

    def batch(self, step: int, x: torch.Tensor, idx: torch.Tensor | None = None
              ) -> torch.Tensor:
        for _, f in self._active(step, ("nan_batch", "outlier_batch", "bad_sample")):
            if f.kind == "bad_sample":  # only when the corrupt sample is in this batch
                rows = [] if idx is None else (idx.cpu() == f.index).nonzero().flatten().tolist()
                if not rows:
                    continue
                x = x.clone()
                for r in rows:
                    if f.factor is None:
                        x[r].view(-1)[0] = float("nan")
                    else:
                        x[r] = x[r] * f.factor
                self._record(f, step, index=f.index, factor=f.factor)
                continue
            x = x.clone()
            if f.kind == "nan_batch":
                x.view(-1)[0] = float("nan")  # a single NaN pixel
            else:
                x = x * f.factor
            self._record(f, step, factor=f.factor)
        return x

    def micro_batch(self, step: int, size: int) -> None:
        for i, f in self._active(step, ("oom",)):
            limit = self.oom_limit.get(i)
            if limit is None:  # "half the current one" is fixed the first time it fires
                limit = int(f.factor) if f.factor is not None and f.factor >= 1 \
                    else max(1, size // 2)
                self.oom_limit[i] = limit
            if size > limit:
                self._record(f, step, limit=limit)
                raise SimulatedOOM(f"simulated out of memory: micro-batch {size} > {limit}")

    def loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        for _, f in self._active(step, ("loss_scale",)):
            self._record(f, step, factor=f.factor)
            loss = loss * f.factor
        return loss

    @contextmanager
    def forward(self, step: int, model: nn.Module) -> Iterator[None]:
        """During the forward pass: ``fp16_overflow`` scales one module's output past the
        fp16 range (x 1e5 beyond its max), as an overflowing activation would;
        ``transient_nan`` makes one module's output NaN the first time it runs in the step,
        and never again (a flaky device: the same computation run again is clean);
        ``attn_logit_overflow`` grows one attention layer's q and k until its largest logit
        is ``factor`` x 65504, and has it compute its attention unfused (the logits in the
        compute dtype, as an unfused fp16 kernel does): under fp16 they overflow, in fp32
        (or with the layer's ``upcast_attention`` on) the softmax stays finite."""
        handles, unfused = [], []
        for i, f in self._active(step, ("transient_nan",)):
            name, module = _target_module(model, f)
            self._record(f, step, module=name)

            def flaky(_m, _inp, out, i=i):
                if i in self.spent:
                    return out
                self.spent.add(i)  # once: the re-run of the step is clean
                return out * float("nan")

            handles.append(module.register_forward_hook(flaky, prepend=True))
        for _, f in self._active(step, ("fp16_overflow",)):
            name, module = _target_module(model, f)
            self._record(f, step, module=name)

            def hook(_m, _inp, out, scale=f.factor):
                amax = out.detach().abs().amax().clamp_min(1e-3)
                return out * (FP16_MAX * 2 * scale / amax)

            # prepend: run before any other hook (the provenance trace must see the result)
            handles.append(module.register_forward_hook(hook, prepend=True))
        for _, f in self._active(step, ("attn_logit_overflow",)):
            name = f.target or _default_attention(model)
            module = dict(model.named_modules()).get(name)
            if module is None or not isinstance(getattr(module, "qkv", None), nn.Module):
                raise ValueError(f"fault attn_logit_overflow: no attention module named "
                                 f"{name!r} (with a fused qkv projection)")
            self._record(f, step, module=name)
            handles.append(module.qkv.register_forward_hook(
                _grow_qk(module.num_heads, FP16_MAX * f.factor)))
            unfused.append((module, module.fused))
            module.fused = False
        try:
            yield bool(handles)  # hooked: the step runs the plain model (a compiled one
            # would not run hooks added after it was traced: trainer/compilation.py)
        finally:
            for h in handles:
                h.remove()
            for module, fused in unfused:
                module.fused = fused

    def grads(self, step: int, model: nn.Module) -> None:
        for _, f in self._active(step, ("grad_nan",)):
            name = f.target or _default_param(model)
            p = dict(model.named_parameters()).get(name)
            if p is None:
                raise ValueError(f"fault grad_nan: no parameter named {name!r}")
            g = local(p.grad) if p.grad is not None else None  # FSDP: this rank's shard
            if g is not None and g.numel():
                g.view(-1)[0] = float("nan")
            self._record(f, step, param=name)

    @torch.no_grad()
    def params(self, step: int, model: nn.Module) -> None:
        """After the optimizer step: corrupt a parameter (NaN, scaled by ``factor``, or one
        flipped low bit: the silent corruption only a cross-rank fingerprint can see)."""
        for _, f in self._active(step, ("param_nan", "param_huge", "bitflip")):
            params = dict(model.named_parameters())
            name = f.target or _default_param(model)
            if name not in params:
                raise ValueError(f"fault {f.kind}: no parameter named {name!r}")
            p = local(params[name])  # FSDP: this rank's shard of it
            if not p.numel():
                pass  # an empty shard: nothing here to corrupt
            elif f.kind == "param_nan":
                p.view(-1)[0] = float("nan")
            elif f.kind == "bitflip":  # silent data corruption: the lowest mantissa bit
                ints = {4: torch.int32, 2: torch.int16, 8: torch.int64}[p.element_size()]
                p.view(-1)[:1].view(ints).bitwise_xor_(1)
            else:
                p.mul_(f.factor)
            self._record(f, step, param=name, factor=f.factor)


def _grow_qk(heads: int, target: float):
    """A forward hook for an attention layer's fused qkv projection (N, L, 3D): scale q and
    k by one factor s so that the largest logit q·k/√d of the batch becomes ``target``, as
    Q/K weights grown s-fold would make it (s is computed in fp32 from this batch)."""

    def hook(_m, _inp, out):
        n, length, d3 = out.shape
        with torch.autocast(out.device.type, enabled=False):  # fp32 arithmetic here
            qkv = out.detach().float().reshape(n, length, 3, heads, d3 // (3 * heads))
            q, k = qkv[:, :, 0].transpose(1, 2), qkv[:, :, 1].transpose(1, 2)  # (N, h, L, Dh)
            logit = (q @ k.transpose(-2, -1)).abs().amax() / q.shape[-1] ** 0.5
            scale = torch.ones(d3, device=out.device)
            scale[: 2 * d3 // 3] = (target / logit.clamp_min(1e-6)).sqrt()  # q, k; not v
            return (out.float() * scale).to(out.dtype)

    return hook


def make_injector(faults: Sequence[FaultConfig], rank: int = 0) -> StepHooks:
    """An injector for the ``faults`` that fire on ``rank`` (a fault with ``rank: None``
    fires on every rank), or the no-op hooks when there are none."""
    mine = [f for f in faults if f.rank is None or f.rank == rank]
    return FaultInjector(mine) if mine else NO_FAULTS
