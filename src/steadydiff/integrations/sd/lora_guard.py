"""The |dW|/|W| guard for a peft LoRA (the delta guard steadydiff's own adapters and the SD
hypernetwork have: adapters/core.py ``clamp_deltas``).

A peft LoRA layer adds ``dW = scaling * B A`` to its frozen base weight W. An absurd
learning rate shows up there first: at lr 1.0 the tiny SD LoRA's ‖dW‖/‖W‖ reached ~2,000
(0.02 at lr 1e-4) while the loss stayed finite, so nothing else looked wrong. After each
applied update (every ``adapter.monitor_every`` steps) the ratio of every LoRA layer is read
(one host sync for all of them); a layer past ``adapter.max_delta_ratio`` is rescaled to the
limit (its B, in the model and in the EMA) and an ``adapter_delta_clamp`` incident names it.

The ratio without forming dW (out x in per layer): with A (r, in) and B (out, r),
``‖B A‖_F² = Σ (BᵀB) ⊙ (A Aᵀ)``, two r x r products. ‖W‖_F of the frozen base is read once.
A LoKr's is ‖w1‖ ‖w2‖ (a Kronecker product's norm); a LoHa's delta is formed (lycoris.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["LoraDelta", "LycorisDelta", "lora_deltas"]


class LoraDelta:
    """One peft LoRA layer's delta, as the delta guard reads and shrinks it.

    Args:
        layer: a peft ``LoraLayer`` (``lora_A``/``lora_B``/``scaling``/``base_layer``).
        adapter: the adapter's name (peft's ``"default"``).
    """

    def __init__(self, layer: nn.Module, adapter: str = "default") -> None:
        self.layer, self.adapter = layer, adapter
        self._w_norm = _base_norm(layer)

    def _ab(self) -> tuple[Tensor, Tensor]:
        a = self.layer.lora_A[self.adapter].weight
        b = self.layer.lora_B[self.adapter].weight
        return a.reshape(a.shape[0], -1).float(), b.reshape(b.shape[0], -1).float()

    @torch.no_grad()
    def delta_ratio(self) -> Tensor:
        """‖scaling · B A‖_F / ‖W‖_F, 0-dim on the device (no host sync)."""
        a, b = self._ab()
        sq = ((b.T @ b) * (a @ a.T)).sum().clamp_min(0)
        scale = float(self.layer.scaling[self.adapter])
        return sq.sqrt() * abs(scale) / self._w_norm.to(sq.device)

    @torch.no_grad()
    def shrink(self, factor: float) -> None:
        """Scale the delta by ``factor`` (B alone: A keeps its direction)."""
        self.layer.lora_B[self.adapter].weight.mul_(factor)


def _base_norm(layer: nn.Module) -> Tensor:
    w = layer.get_base_layer().weight.detach()
    if type(w) is not Tensor and hasattr(w, "dequantize"):  # an 8-bit base (torchao)
        w = w.dequantize()
    return w.float().norm().clamp_min(1e-12)  # frozen: read once


class LycorisDelta:
    """A peft LoHa/LoKr layer's delta (adapter 'default'), as :class:`LoraDelta`."""

    def __init__(self, layer: nn.Module) -> None:
        self.layer = layer
        self._w_norm = _base_norm(layer)

    def delta_ratio(self) -> Tensor:
        from .lycoris import delta_norm

        n = delta_norm(self.layer)
        return n / self._w_norm.to(n.device)

    def shrink(self, factor: float) -> None:
        from .lycoris import shrink

        shrink(self.layer, factor)


def lora_deltas(model: nn.Module) -> dict[str, LoraDelta | LycorisDelta]:
    """``{layer name: LoraDelta}`` for every peft LoRA layer of ``model`` (the denoiser and
    any text encoder trained with its LoRA)."""
    from .lycoris import algo_of

    out: dict[str, LoraDelta | LycorisDelta] = {}
    for name, m in model.named_modules():
        if algo_of(m):
            out[name] = LycorisDelta(m)
            continue
        lora_a = getattr(m, "lora_A", None)
        if isinstance(lora_a, nn.ModuleDict) and hasattr(m, "base_layer") \
                and hasattr(m, "scaling"):
            for adapter in lora_a:
                if adapter in getattr(m, "lora_B", {}):
                    key = name if adapter == "default" else f"{name}[{adapter}]"
                    out[key] = LoraDelta(m, adapter)
    return out


def watched(owner: Any, model: nn.Module, ema_model: nn.Module) -> tuple[dict, dict]:
    """The (model, EMA) LoRA deltas ``owner`` watches, built on first use."""
    if getattr(owner, "_deltas", None) is None:
        owner._deltas = (lora_deltas(model), lora_deltas(ema_model))
    return owner._deltas
