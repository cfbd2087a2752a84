"""Expensive health probes: one extra forward pass with hooks, every N steps or on an incident.

- Attention: max attention logit and mean attention entropy per attention layer. Logit growth
  precedes attention-entropy collapse and loss divergence (Dehghani et al. 2023, "Scaling
  Vision Transformers to 22B"; Wortsman et al. 2023); QK-norm is the known cure.
- Normalization: GroupNorm/LayerNorm input variance against eps. When the variance of a group
  is comparable to eps, the layer stops normalizing (output ≈ x/√eps, the eps-dominated
  regime): small inputs are amplified unpredictably and fp16 can overflow. Also affine
  parameters that are non-finite or huge.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn

from ..models.layers import Attention
from .findings import (AttentionEntropyCollapse, AttentionLogitGrowth, Finding,
                       NormAffineExploded, NormEpsDominated)


def _norm_input_var(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Per-(sample, group) input variance as the layer computes it: (N, G) or (N, L)."""
    x = x.detach().float()
    if isinstance(module, nn.GroupNorm):
        return x.reshape(x.shape[0], module.num_groups, -1).var(-1, unbiased=False)
    dims = tuple(range(x.ndim - len(module.normalized_shape), x.ndim))
    return x.var(dim=dims, unbiased=False)


@torch.no_grad()
def probe(model: nn.Module, forward: Callable[[], object]) -> dict[str, dict[str, float]]:
    """Run ``forward()`` (one forward pass of ``model``) with probes on, and return per-layer
    statistics: ``{"attn": {name: {"max_logit", "entropy"}}, "norm": {name: {"min_var",
    "median_var", "eps", "affine_max"}}}``."""
    attn = {n: m for n, m in model.named_modules() if isinstance(m, Attention)}
    norms = {n: m for n, m in model.named_modules()
             if isinstance(m, (nn.GroupNorm, nn.LayerNorm))}
    norm_stats: dict[str, dict[str, float]] = {}
    handles = []

    def norm_hook(name):
        def hook(m, inp, _out):
            v = _norm_input_var(m, inp[0])
            w = [p.detach().abs().max() for p in (m.weight, m.bias) if p is not None]
            norm_stats[name] = {
                "min_var": v.min().item(), "median_var": v.median().item(), "eps": m.eps,
                "affine_max": torch.stack(w).max().item() if w else 0.0}
        return hook

    for n, m in norms.items():
        handles.append(m.register_forward_hook(norm_hook(n)))
    for m in attn.values():
        m.probe = True
    was_training = model.training
    try:
        forward()
    finally:
        for h in handles:
            h.remove()
        for m in attn.values():
            m.probe = False
        model.train(was_training)
    attn_stats = {n: {k: float(v) for k, v in (m.last_stats or {}).items()}
                  for n, m in attn.items()}
    return {"attn": attn_stats, "norm": norm_stats}


def findings(stats: dict[str, dict[str, dict[str, float]]], *, logit_limit: float,
             entropy_min: float, var_ratio: float, affine_limit: float) -> list[Finding]:
    """Health warnings from :func:`probe` statistics, worst first within each kind."""
    out: list[Finding] = []
    for name, s in stats["attn"].items():
        if not s:
            continue
        if not math.isfinite(s["max_logit"]) or s["max_logit"] > logit_limit:
            out.append(AttentionLogitGrowth.new(module=name, max_logit=s["max_logit"],
                                                limit=logit_limit))
        if s["entropy"] < entropy_min:
            out.append(AttentionEntropyCollapse.new(module=name, entropy=s["entropy"],
                                                    min=entropy_min))
    for name, s in stats["norm"].items():
        if s["median_var"] < var_ratio * s["eps"]:
            out.append(NormEpsDominated.new(module=name, median_input_var=s["median_var"],
                                            eps=s["eps"], var_ratio=var_ratio))
        if not math.isfinite(s["affine_max"]) or s["affine_max"] > affine_limit:
            out.append(NormAffineExploded.new(module=name, affine_max=s["affine_max"],
                                              limit=affine_limit))
    return out
