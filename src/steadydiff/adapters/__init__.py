"""Fine-tuning with adapters (LoRA, hypernetworks) over frozen base weights, guarded against
their own failure modes. See docs/adapters.md."""

from .core import (
    AdapterError,
    AdapterRun,
    BaseWeights,
    adapter_modules,
    adapter_tensors,
    base_tensors,
    build_adapted,
    check_tensors,
    inject,
    load_base,
    merge_checkpoint,
    merge_into_base,
    set_scale,
    share_frozen_memo,
    tensor_hash,
)
from .layers import HyperAttention, LoRAConv2d, LoRAEmbedding, LoRALinear

__all__ = [
    "AdapterError", "AdapterRun", "BaseWeights", "HyperAttention", "LoRAConv2d",
    "LoRAEmbedding", "LoRALinear", "adapter_modules", "adapter_tensors", "base_tensors",
    "build_adapted", "check_tensors", "inject", "load_base", "merge_checkpoint",
    "merge_into_base", "set_scale", "share_frozen_memo", "tensor_hash",
]
