"""A LoRA's frozen base stored in 8 bits (``model.quantize_base=int8``): the denoiser's
Linear weights kept as int8 with one bf16 scale per output row, dequantized in each matmul,
the activations in bf16; the LoRA layers peft puts on top train in fp32 (QLoRA's idea,
Dettmers et al. 2023, with 8-bit weights; what FLUX.1/SD3.5 trainers offer to fit a 12B
transformer on one 24 GB card).

Through torchao (``Int8WeightOnlyConfig``; the ``steadydiff[quant]`` extra, pinned in
constraints.txt): PyTorch's own quantization library, released with each torch, with no
dependencies of its own, which peft's LoRA layers wrap (peft's ``TorchaoLoraLinear``).
optimum-quanto was the other candidate; its last release (0.2.7) predates torch 2.13 by
over a year.

What is quantized: every Linear of the denoiser except those diffusers keeps in high
precision for the model (its ``_skip_layerwise_casting_patterns``: timestep and caption
embedders, norms); the text encoders and the VAE stay as they are (their outputs are
cached; T5 and Qwen3 already run outside fp16). Refused, with the reason, where it cannot
run: torchao missing or older than 0.18, a device other than a CPU or a CUDA GPU (torchao's
int8 kernels), or bf16 the device emulates (``train.precision``'s own check).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from ..config import ConfigError

__all__ = ["check", "quantize_base", "stored_bytes"]

#: the oldest torchao whose int8 tensors peft 0.21's LoRA layers wrap (v2 tensor subclasses)
MIN_TORCHAO = (0, 18)


def check(kind: str, device: torch.device) -> None:
    """Raise :class:`ConfigError` (exit 2) when ``model.quantize_base=kind`` cannot run on
    ``device`` here, saying why and what would."""
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"model.quantize_base={kind}: torchao's int8 weight-only kernels "
                          f"run on a CPU or a CUDA GPU, not on {device.type}; remove "
                          "model.quantize_base (the base then stays in train.precision)")
    try:
        import torchao
    except ImportError:
        raise ConfigError(f"model.quantize_base={kind} needs torchao (pip install "
                          "'steadydiff[quant]' -c constraints.txt), which is not installed; "
                          "or remove model.quantize_base") from None
    have = tuple(int(x) for x in re.findall(r"\d+", torchao.__version__)[:2])
    if have < MIN_TORCHAO:
        raise ConfigError(f"model.quantize_base={kind} needs torchao >= "
                          f"{'.'.join(map(str, MIN_TORCHAO))} (peft wraps its int8 tensors "
                          f"from then on); torchao {torchao.__version__} is installed")


def _skipped(model: nn.Module) -> list[str]:
    """The module-name patterns diffusers keeps in high precision for this model."""
    return list(getattr(model, "_skip_layerwise_casting_patterns", None) or ())


def quantize_base(model: nn.Module, kind: str, device: torch.device) -> dict[str, Any]:
    """Store the frozen ``model``'s Linear weights in ``kind`` (int8) in place, on
    ``device``, before the LoRA is added (peft then wraps the quantized layers).

    Returns:
        ``{"layers": n quantized, "kept": n left in high precision, "bytes_before": ...,
        "bytes_after": ...}`` (the model's stored bytes).

    Raises:
        ConfigError: torchao missing, too old, or the device cannot run it (:func:`check`).
    """
    check(kind, device)
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    before = stored_bytes(model)
    skip = [re.compile(p) for p in _skipped(model)]
    names = {m: n for n, m in model.named_modules()}

    def pick(m: nn.Module, fqn: str = "") -> bool:
        name = names.get(m, fqn)
        return isinstance(m, nn.Linear) and not any(p.search(name) for p in skip)

    chosen = [n for n, m in model.named_modules() if pick(m, n)]
    kept = sum(isinstance(m, nn.Linear) for m in model.modules()) - len(chosen)
    quantize_(model, Int8WeightOnlyConfig(), filter_fn=pick, device=device)
    model.requires_grad_(False)
    return {"layers": len(chosen), "kept": kept, "bytes_before": before,
            "bytes_after": stored_bytes(model)}


def stored_bytes(model: nn.Module) -> int:
    """The bytes ``model``'s parameters and buffers occupy (an int8 weight: its int8 data
    and scales)."""
    total = 0
    for t in list(model.parameters()) + list(model.buffers()):
        inner = getattr(t, "__tensor_flatten__", None)
        if inner is not None:  # a torchao tensor: its stored parts
            names, _ = t.__tensor_flatten__()
            total += sum(getattr(t, n).numel() * getattr(t, n).element_size() for n in names)
        else:
            total += t.numel() * t.element_size()
    return total
