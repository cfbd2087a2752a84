"""Provenance: which module went bad first.

On a non-finite incident the guard replays the offending micro-batch deterministically (same
data, same t and noise: every random draw of a step comes from a generator seeded by the
step) with forward hooks on every module, and names

- the first module, in execution order, whose output held a non-finite value;
- the first module whose output overflowed the fp16 range (|x| > 65504), which is where an
  fp16 run would have produced its first inf even when this replay runs in fp32;
- the parameters whose gradients are non-finite, in the order backward reached them (the
  first is closest to the loss), and how many.

Only on incidents: a replay costs one forward and backward pass.

:func:`attention_owner` maps the module a replay named to the attention layer it belongs
to (any module with an ``upcast_attention`` attribute: steadydiff's and diffusers'), for the
guard's first fp16 remedy, upcasting that layer's attention.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ..sharding import local

FP16_MAX = 65504.0


def tensors_in(out: object) -> list[torch.Tensor]:
    """Every tensor inside a module output (tensor, or nested list/tuple/dict)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in tensors_in(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in tensors_in(o)]
    return []


def is_attention(m: nn.Module) -> bool:
    """An attention layer the guard can upcast: one that keeps an ``upcast_attention``
    attribute of its own (steadydiff's and diffusers' attention set it in ``__init__``; a
    diffusers model only answers for its config, which is no attention layer)."""
    return "upcast_attention" in vars(m)


def attention_owner(model: nn.Module, name: str | None) -> str | None:
    """The attention layer behind module ``name``: the module itself or its nearest
    ancestor with an ``upcast_attention`` attribute (``mid.attn.attn.proj`` ->
    ``mid.attn.attn``; diffusers' ``...attn1.to_out.0`` -> ``...attn1``), else its first
    descendant with one (an overflow in a block's own residual add, after its attention).
    None when there is none (a convolution, a norm, an MLP) or ``name`` is None."""
    if not name:
        return None
    mods = dict(model.named_modules())
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        m = mods.get(".".join(parts[:i]))
        if m is not None and is_attention(m):
            return ".".join(parts[:i])
    return next((n for n, m in mods.items()
                 if n.startswith(name + ".") and is_attention(m)), None)


def nonfinite_grads(model: nn.Module) -> list[str]:
    """Names of parameters whose .grad holds NaN/Inf (one host sync)."""
    named = [(n, local(p.grad)) for n, p in model.named_parameters() if p.grad is not None]
    if not named:
        return []
    flags = torch.stack([torch.isfinite(g).all() for _, g in named]).cpu().tolist()
    return [n for (n, _), ok in zip(named, flags) if not ok]


def nonfinite_params(model: nn.Module) -> list[str]:
    """Names of parameters holding NaN/Inf (one host sync)."""
    named = list(model.named_parameters())  # FSDP: this rank's shards
    flags = torch.stack([torch.isfinite(local(p)).all() for _, p in named]).cpu().tolist()
    return [n for (n, _), ok in zip(named, flags) if not ok]


def trace(model: nn.Module, replay: Callable[[int], torch.Tensor], num_micro: int,
          after_backward: Callable[[], None] | None = None, every: bool = False) -> dict:
    """Replay micro-batches until one is non-finite, and trace where it went bad.

    Args:
        model: the (unwrapped) model the replay runs.
        replay: ``replay(i)`` recomputes micro-batch ``i`` exactly as the step did (forward,
            faults, loss) and returns its loss without calling backward.
        num_micro: number of micro-batches in the step.
        after_backward: called after each replayed backward (the step's gradient faults).
        every: replay every micro-batch even after one went bad (the first bad one is still
            the one reported): under FSDP each replay's forward and backward are
            collectives, so every rank must run as many as the others.

    Returns:
        A dict with ``micro_batch``, ``first_nonfinite_module``, ``first_overflow_module``,
        ``loss_finite``, ``nonfinite_grad_params`` (first few, backward order) and
        ``nonfinite_grad_count``; ``reproduced`` is False when no micro-batch went bad again.
    """
    names = {m: n for n, m in model.named_modules()}
    order: list[tuple[str, bool, bool]] = []  # (module, non-finite, overflow), execution order

    def hook(m, _inp, out):
        ts = [t for t in tensors_in(out) if t.is_floating_point()]
        if not ts:
            return
        amax = torch.stack([t.detach().abs().amax().float() for t in ts]).max()
        order.append((names.get(m, "?"), amax, None))

    grad_order: list[tuple[str, torch.Tensor]] = []

    def grad_hook(name):
        def h(g):
            grad_order.append((name, torch.isfinite(g).all()))
        return h

    handles = [m.register_forward_hook(hook) for m in model.modules() if m is not model]
    handles += [p.register_hook(grad_hook(n)) for n, p in model.named_parameters()
                if p.requires_grad]
    result: dict = {"reproduced": False}
    try:
        for i in range(num_micro):
            order.clear()
            grad_order.clear()
            model.zero_grad(set_to_none=True)
            loss = replay(i)
            loss_finite = bool(torch.isfinite(loss.detach()).all())
            if loss.requires_grad:
                loss.backward()
            if after_backward is not None:
                after_backward()
            # one sync for all module maxima of this replay
            amaxes = torch.stack([a for _, a, _ in order]).cpu().tolist() if order else []
            first_nf = next((order[j][0] for j, a in enumerate(amaxes)
                             if not (a == a and a != float("inf"))), None)
            first_of = next((order[j][0] for j, a in enumerate(amaxes) if a > FP16_MAX), None)
            bad_grads = [n for n, ok in grad_order if not bool(ok)]
            bad_grads += [n for n in nonfinite_grads(model) if n not in bad_grads]
            if (not loss_finite or first_nf or bad_grads) and not result["reproduced"]:
                result = {"reproduced": True, "micro_batch": i, "loss_finite": loss_finite,
                          "first_nonfinite_module": first_nf,
                          "first_overflow_module": first_of,
                          "nonfinite_grad_params": bad_grads[:5],
                          "nonfinite_grad_count": len(bad_grads)}
                if not every:
                    break
            if first_of and "first_overflow_module" not in result \
                    and not result["reproduced"]:
                result.update(micro_batch=i, first_overflow_module=first_of)
    finally:
        for h in handles:
            h.remove()
        model.zero_grad(set_to_none=True)
    return result
