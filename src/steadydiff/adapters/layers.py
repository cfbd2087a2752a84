"""Adapter layers: LoRA on Linear / Conv2d / Embedding, and Stable-Diffusion-style
hypernetworks on attention keys and values.

LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models", eq. 3):
``h = W x + (alpha / r) * B A x`` with W frozen, A (r, in) random and B (out, r) zero, so an
untrained adapter adds exact zeros and the model starts as the base model, bit for bit.
For a convolution A is a conv with the base kernel (r output channels) and B a 1x1 conv, so
``dW = B @ A`` has the base kernel's shape and merges into it; for an embedding table the
delta is ``A @ B`` with A (num, r) random and B (r, dim) zero.

Hypernetwork (the Stable Diffusion web-UI "hypernetwork", NovelAI 2022): two small MLPs
transform the inputs of the key and value projections of an attention layer,
``k = W_k (x + s * mlp_k(x))``, ``v = W_v (x + s * mlp_v(x))``, queries untouched. Written as
``qkv(x) + [0, W_k d_k, W_v d_v]`` (linearity of W), and with the MLPs' last layer zero, the
untrained adapter again adds exact zeros.

Every adapter module holds the frozen base layer as ``.base`` and has a runtime ``scale``
(0 gives the base model, 1 the trained adapter) and ``delta_ratio()``, the relative size of
its change that the adapter guard watches.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..kinds import AdapterKind
from ..models.layers import Attention

__all__ = ["AdapterModule", "HyperAttention", "LoRAConv2d", "LoRAEmbedding", "LoRALinear",
           "weight_floor"]


def weight_floor(w: Tensor) -> float:
    """The smallest norm a weight counts as having in ``|dW| / |W|``: RMS 0.05, the guard's
    floor, so a near-zero (zero-initialised) base layer does not make every delta infinite."""
    return 0.05 * math.sqrt(w.numel())


class AdapterModule(nn.Module):
    """Common part: the frozen ``base`` layer and the runtime ``scale``."""

    base: nn.Module
    kind: str = "adapter"

    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        self.base = base
        self.scale = 1.0

    def delta_ratio(self) -> Tensor:
        """0-dim fp32 tensor: |change| / max(|W|, floor) at the current scale (no sync)."""
        raise NotImplementedError

    def shrink(self, factor: float) -> None:
        """Multiply the adapter's change by ``factor`` (the delta-norm clamp)."""
        raise NotImplementedError


class _LoRA(AdapterModule):
    kind = "lora"

    def __init__(self, base: nn.Module, rank: int, alpha: float, dropout: float) -> None:
        super().__init__(base)
        self.rank = rank
        self.alpha = alpha
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self._w_norm: float | None = None

    @property
    def factor(self) -> float:
        """``scale * alpha / rank``: what multiplies B A."""
        return self.scale * self.alpha / self.rank

    def delta_weight(self) -> Tensor:
        """dW in the base weight's shape, fp32, including ``scale * alpha / rank``."""
        raise NotImplementedError

    @torch.no_grad()
    def delta_ratio(self) -> Tensor:
        if self._w_norm is None:  # the base is frozen: one host sync, once
            w = self.base.weight
            self._w_norm = max(w.float().norm().item(), weight_floor(w))
        return self.delta_weight().norm() / self._w_norm

    @torch.no_grad()
    def shrink(self, factor: float) -> None:
        self.lora_B.weight.mul_(factor)

    @torch.no_grad()
    def merged_weight(self) -> Tensor:
        """The base weight plus the delta (fp32)."""
        return self.base.weight.float() + self.delta_weight()


class LoRALinear(_LoRA):
    """``base(x) + scale * alpha / r * B(A(dropout(x)))`` for an ``nn.Linear``."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0) -> None:
        super().__init__(base, rank, alpha, dropout)
        self.lora_A = nn.Linear(base.in_features, rank, bias=False)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))  # nn.Linear's own init
        nn.init.zeros_(self.lora_B.weight)

    def forward(self, x: Tensor) -> Tensor:
        return self.base(x) + self.lora_B(self.lora_A(self.dropout(x))) * self.factor

    def delta_weight(self) -> Tensor:
        return (self.lora_B.weight.float() @ self.lora_A.weight.float()) * self.factor


class LoRAConv2d(_LoRA):
    """LoRA for an ``nn.Conv2d`` (groups=1): A is a conv with the base kernel, stride,
    padding and dilation into r channels, B a 1x1 conv back to the base's out channels."""

    def __init__(self, base: nn.Conv2d, rank: int, alpha: float, dropout: float = 0.0) -> None:
        if base.groups != 1:
            raise ValueError(f"LoRA supports Conv2d with groups=1 only, got groups={base.groups}")
        super().__init__(base, rank, alpha, dropout)
        self.lora_A = nn.Conv2d(base.in_channels, rank, base.kernel_size, stride=base.stride,
                                padding=base.padding, dilation=base.dilation, bias=False,
                                padding_mode=base.padding_mode)
        self.lora_B = nn.Conv2d(rank, base.out_channels, 1, bias=False)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)

    def forward(self, x: Tensor) -> Tensor:
        return self.base(x) + self.lora_B(self.lora_A(self.dropout(x))) * self.factor

    def delta_weight(self) -> Tensor:
        a = self.lora_A.weight.float()  # (r, in, kh, kw)
        b = self.lora_B.weight.float().flatten(1)  # (out, r)
        return (b @ a.flatten(1)).view(b.shape[0], *a.shape[1:]) * self.factor


class LoRAEmbedding(_LoRA):
    """LoRA for an ``nn.Embedding`` table: ``E + scale * alpha / r * A @ B``, A (num, r)
    random normal, B (r, dim) zero. (No dropout: the input is an index.)"""

    def __init__(self, base: nn.Embedding, rank: int, alpha: float, dropout: float = 0.0) -> None:
        super().__init__(base, rank, alpha, 0.0)
        self.lora_A = nn.Embedding(base.num_embeddings, rank)  # N(0, 1) init
        self.lora_B = nn.Linear(rank, base.embedding_dim, bias=False)
        nn.init.zeros_(self.lora_B.weight)

    def forward(self, y: Tensor) -> Tensor:
        return self.base(y) + self.lora_B(self.lora_A(y)) * self.factor

    def delta_weight(self) -> Tensor:
        # lora_B.weight is (dim, r): the table's delta is A @ B.weight^T, (num, dim)
        return (self.lora_A.weight.float() @ self.lora_B.weight.float().t()) * self.factor


class _HyperMLP(nn.Module):
    """``x -> fc2(silu(fc1(x)))``, fc2 zero-initialised."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        nn.init.zeros_(self.fc2.weight)
        nn.init.zeros_(self.fc2.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.silu(self.fc1(x)))

    def gain_bound(self) -> Tensor:
        """An upper bound of |mlp(x) - mlp(0)| / |x|: |W2|_F |W1|_F * 1.1 (SiLU is
        1.1-Lipschitz; the spectral norm is at most the Frobenius norm)."""
        return 1.1 * self.fc2.weight.float().norm() * self.fc1.weight.float().norm()


class HyperAttention(AdapterModule):
    """A hypernetwork on an :class:`Attention` layer's fused ``qkv`` projection: wraps the
    ``qkv`` Linear (dim -> 3 dim) and adds ``[0, W_k d_k(x), W_v d_v(x)]``, with
    ``d = scale * mlp(x)``."""

    kind = "hypernetwork"

    def __init__(self, base: nn.Linear, hidden_mult: float) -> None:
        super().__init__(base)
        dim = base.in_features
        if base.out_features != 3 * dim:
            raise ValueError(f"hypernetwork: the qkv projection must map width {dim} to "
                             f"3 x {dim} = {3 * dim}, got {base.out_features}")
        hidden = max(1, round(hidden_mult * dim))
        self.hyper_k = _HyperMLP(dim, hidden)
        self.hyper_v = _HyperMLP(dim, hidden)

    def forward(self, x: Tensor) -> Tensor:  # (N, L, D) -> (N, L, 3D)
        out = self.base(x)
        d = self.base.in_features
        w = self.base.weight
        dk = self.hyper_k(x) * self.scale
        dv = self.hyper_v(x) * self.scale
        extra = torch.cat([torch.zeros_like(out[..., :d]),
                           F.linear(dk, w[d:2 * d]), F.linear(dv, w[2 * d:])], dim=-1)
        return out + extra.to(out.dtype)

    @torch.no_grad()
    def delta_ratio(self) -> Tensor:
        # relative change of the key/value inputs (the base weights map both alike)
        return torch.maximum(self.hyper_k.gain_bound(), self.hyper_v.gain_bound()) * abs(self.scale)

    @torch.no_grad()
    def shrink(self, factor: float) -> None:
        for m in (self.hyper_k, self.hyper_v):
            m.fc2.weight.mul_(factor)
            m.fc2.bias.mul_(factor)


def wrap(module: nn.Module, kind: AdapterKind, *, rank: int, alpha: float, dropout: float,
         hidden_mult: float) -> AdapterModule | None:
    """The adapter for ``module`` (or None when ``kind`` does not apply to its type)."""
    if kind == "lora":
        if isinstance(module, nn.Linear):
            return LoRALinear(module, rank, alpha, dropout)
        if isinstance(module, nn.Conv2d) and module.groups == 1:
            return LoRAConv2d(module, rank, alpha, dropout)
        if isinstance(module, nn.Embedding):
            return LoRAEmbedding(module, rank, alpha)
        return None
    if kind == "hypernetwork":
        # self-attention only: a cross-attention (a text model's) has separate q and kv
        # projections, which HyperAttention does not wrap (yet)
        if isinstance(module, Attention) and not module.context_dim:
            return HyperAttention(module.qkv, hidden_mult)
        return None
    raise ValueError(f"adapter.kind must be 'lora' or 'hypernetwork', got {kind!r}")
