"""Diffusion Transformer with adaLN-Zero conditioning (Peebles & Xie 2023, "Scalable
Diffusion Models with Transformers", sec. 3.2).

patchify (conv, kernel = stride = patch) + fixed 2-D sin-cos positions -> ``depth``
transformer blocks, each modulated by c = t_emb + y_emb through shift/scale/gate
(adaLN-Zero: the modulation projection starts at zero, so every block starts as the
identity) -> final adaLN + linear (zero) -> unpatchify.

Output width is ``in_channels`` (the denoiser contract); there is no learned-sigma half.

Text conditioning (``context_dim`` > 0) is the cross-attention variant of PixArt-α (Chen et
al. 2023, "PixArt-α: Fast Training of Diffusion Transformer for Photorealistic
Text-to-Image Synthesis", sec. 2.3 and fig. 4): each block is self-attn -> cross-attn to the
text tokens -> MLP, and adaLN-Zero still modulates the self-attention and the MLP from the
timestep alone. It is not the joint-token design of MMDiT / SD3 (Esser et al. 2024), which
concatenates text and image tokens into one self-attention with a second weight stream for
the text: there the cost grows with (T + L)² and the pooled text must enter adaLN; here it is
T·L per block, independent of the context length in the self-attention, adaLN stays the
timestep's (so DiT's class-conditional and text variants share every other weight), and the
text tokens are computed once by the frozen encoder, not transformed per block. Two
departures from PixArt-α: adaLN-Zero per block as in DiT (not PixArt's shared adaLN-single),
and a LayerNorm before the cross-attention's queries (PixArt feeds the raw residual stream;
pre-norm is the transformer default and keeps q bounded as the stream grows).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from steadydiff.config import DiTConfig
from steadydiff.kinds import DiTPreset
from steadydiff.models.layers import (
    Attention,
    Checkpointable,
    ClassEmbedder,
    TextConditioning,
    TimestepEmbedder,
    check_inputs,
    lookup_depth,
)

__all__ = ["DiT", "PRESETS", "sincos_pos_embed_2d"]

# Model sizes are data (STYLE.md habit 4). S/B/L/XL are table 1 of Peebles & Xie 2023;
# tiny/small are CPU-sized for tests and quick starts.
PRESETS: dict[DiTPreset, dict[str, int]] = {
    "tiny": {"depth": 4, "hidden_size": 128, "num_heads": 4},
    "small": {"depth": 6, "hidden_size": 192, "num_heads": 4},
    "S": {"depth": 12, "hidden_size": 384, "num_heads": 6},
    "B": {"depth": 12, "hidden_size": 768, "num_heads": 12},
    "L": {"depth": 24, "hidden_size": 1024, "num_heads": 16},
    "XL": {"depth": 28, "hidden_size": 1152, "num_heads": 16},
}


def sincos_pos_embed_2d(dim: int, grid: int) -> Tensor:
    """Fixed 2-D sin-cos position code for a ``grid x grid`` token map.

    Half the channels encode the row, half the column, each with the 1-D transformer code
    (Vaswani et al. 2017) at frequencies 10000^(-k/(dim/4)). Fixed rather than learned, as
    in DiT: nothing to diverge, and it is the same at every resolution's grid points.

    Args:
        dim: token width; must be divisible by 4.
        grid: tokens per side.

    Returns:
        (grid*grid, dim) float32 tensor, row-major token order (matches ``flatten(2)``).
    """
    quarter = dim // 4
    omega = 1.0 / 10000 ** (torch.arange(quarter, dtype=torch.float32) / quarter)  # (D/4,)
    pos = torch.arange(grid, dtype=torch.float32)
    rows, cols = torch.meshgrid(pos, pos, indexing="ij")  # (G, G) each

    def code(p: Tensor) -> Tensor:
        args = p.reshape(-1, 1) * omega[None]  # (G*G, D/4)
        return torch.cat([torch.sin(args), torch.cos(args)], dim=1)  # (G*G, D/2)

    return torch.cat([code(rows), code(cols)], dim=1)  # (G*G, D)


def modulate(x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    """x * (1 + scale) + shift, broadcast over tokens. (N, L, D), (N, D), (N, D) -> (N, L, D)."""
    return x * (1 + scale[:, None]) + shift[:, None]


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class DiTBlock(Checkpointable, nn.Module):
    """Pre-norm transformer block with adaLN-Zero (Peebles & Xie 2023, fig. 3).

    The LayerNorms have no affine parameters: the per-sample shift/scale from c replace them.
    ``gate`` multiplies each residual branch; zero-initialising its projection makes the
    block the identity at step 0, which the paper found to train best (and it keeps early
    activations bounded, which is what a stable run needs).

    With ``context_dim`` > 0 a cross-attention to the text context sits between the two
    (PixArt-α, Chen et al. 2023, fig. 4): ``x + cross_attn(cross_norm(x), context)``, not
    modulated or gated by c (its own zero-initialised ``proj`` plays the gate's part at init).
    """

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float, qk_norm: bool,
                 eps: float, context_dim: int = 0) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=eps)
        self.attn = Attention(dim, num_heads, qk_norm=qk_norm, eps=eps)
        # absent without context: no new parameters and no init RNG draws
        self.cross_norm: nn.LayerNorm | None = None
        self.cross_attn: Attention | None = None
        if context_dim:
            self.cross_norm = nn.LayerNorm(dim, eps=eps)  # affine: c does not modulate it
            self.cross_attn = Attention(dim, num_heads, qk_norm=qk_norm, eps=eps,
                                        context_dim=context_dim)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=eps)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))
        self.adaLN_modulation = nn.Linear(dim, 6 * dim)  # shift/scale/gate for attn and mlp

    def forward(self, x: Tensor, c: Tensor, context: Tensor | None = None) -> Tensor:
        return self._run(self._forward, x, c, context)

    def _forward(self, x: Tensor, c: Tensor, context: Tensor | None) -> Tensor:
        mod = self.adaLN_modulation(F.silu(c))  # (N, 6D)
        shift_a, scale_a, gate_a, shift_m, scale_m, gate_m = mod.chunk(6, dim=1)
        x = x + gate_a[:, None] * self.attn(modulate(self.norm1(x), shift_a, scale_a))
        if self.cross_attn is not None:
            assert self.cross_norm is not None
            x = x + self.cross_attn(self.cross_norm(x), context)  # context (N, L, C)
        x = x + gate_m[:, None] * self.mlp(modulate(self.norm2(x), shift_m, scale_m))
        return x  # (N, T, D)


class FinalLayer(nn.Module):
    """adaLN (shift/scale, no gate) then a linear to patch*patch*C values per token."""

    def __init__(self, dim: int, patch: int, out_channels: int, eps: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=eps)
        self.adaLN_modulation = nn.Linear(dim, 2 * dim)
        self.linear = nn.Linear(dim, patch * patch * out_channels)

    def forward(self, x: Tensor, c: Tensor) -> Tensor:
        shift, scale = self.adaLN_modulation(F.silu(c)).chunk(2, dim=1)
        return self.linear(modulate(self.norm(x), shift, scale))  # (N, L, p*p*C)


class DiT(TextConditioning, nn.Module):
    """Diffusion Transformer following the denoiser contract ``model(x, t, y=None) -> out``.

    Args:
        in_channels: image/latent channels C (output has the same C).
        image_size: H = W; must be divisible by ``cfg.patch_size``.
        cfg: preset and overrides (``depth``/``hidden_size``/``num_heads`` replace the
            preset's row when not None), patch size, MLP ratio, norm epsilon.
        num_classes: 0 for unconditional; otherwise labels 0..num_classes-1 plus the null
            class ``num_classes`` for classifier-free guidance.
        qk_norm: QK-norm in every attention layer (Dehghani et al. 2023).
        context_dim: 0, or the width D of a text encoder's token embeddings: y is then the
            text context (N, L, D), attended to by ``blocks.i.cross_attn`` (the PixArt-α
            cross-attention variant, see the module docstring).
        context_len: the null context's length L (77: CLIP's); see
            :class:`~steadydiff.models.layers.TextConditioning`.

    Raises:
        ValueError: at build time, for a shape that cannot work (message names both shapes),
            or both ``num_classes`` and ``context_dim`` > 0.
    """

    def __init__(self, in_channels: int, image_size: int, cfg: DiTConfig,
                 num_classes: int = 0, qk_norm: bool = False, context_dim: int = 0,
                 context_len: int = 77) -> None:
        super().__init__()
        row = PRESETS[cfg.preset]
        depth = cfg.depth if cfg.depth is not None else row["depth"]
        dim = cfg.hidden_size if cfg.hidden_size is not None else row["hidden_size"]
        heads = cfg.num_heads if cfg.num_heads is not None else row["num_heads"]
        p = cfg.patch_size
        if image_size % p:
            raise ValueError(
                f"image_size {image_size} is not divisible by patch_size {p}; use an image "
                f"size that is a multiple of {p} or a patch_size dividing {image_size}")
        if dim % heads:
            raise ValueError(
                f"hidden_size {dim} is not divisible by num_heads {heads} "
                f"(preset {cfg.preset!r} with overrides); choose num_heads dividing {dim}")
        if dim % 4:
            raise ValueError(
                f"hidden_size {dim} is not divisible by 4, which the 2-D sin-cos position "
                f"embedding needs (a quarter of the channels per sin/cos per axis)")

        self.in_channels = in_channels
        self.image_size = image_size
        self._init_conditioning("DiT", num_classes, context_dim, context_len)
        self.patch_size = p
        self.hidden_size = dim
        self.depth = depth
        self.num_heads = heads
        self.grid = image_size // p

        self.x_embedder = nn.Conv2d(in_channels, dim, kernel_size=p, stride=p)
        # Non-persistent: recomputed from the shape, never stored in checkpoints.
        self.register_buffer("pos_embed", sincos_pos_embed_2d(dim, self.grid)[None],
                             persistent=False)  # (1, T, D)
        self.t_embedder = TimestepEmbedder(dim, freq_dim=256)
        self.y_embedder = ClassEmbedder(num_classes, dim) if num_classes > 0 else None
        self.blocks = nn.ModuleList(
            DiTBlock(dim, heads, cfg.mlp_ratio, qk_norm, cfg.norm_eps, self.context_dim)
            for _ in range(depth))
        self.final_layer = FinalLayer(dim, p, in_channels, cfg.norm_eps)

        # Layer depth for LR decay: embeddings 0, block i -> i+1, final layer depth+1.
        self.max_depth: int = depth + 1
        self._depths: dict[str, int] = {"x_embedder": 0, "t_embedder": 0, "y_embedder": 0,
                                        "final_layer": depth + 1}
        self._depths.update({f"blocks.{i}": i + 1 for i in range(depth)})
        self.initialize_weights()

    def initialize_weights(self) -> None:
        """Every init decision, in one place (Peebles & Xie 2023, sec. 3.2 and their code's
        choices, re-derived here).

        - All linears (qkv, proj, MLP; a text model's cross-attention q, kv): Xavier-uniform
          weights, zero bias (standard ViT).
        - Patch embedding: Xavier-uniform on the conv viewed as a (D, C*p*p) linear, zero bias.
        - Class table: N(0, 0.02). Timestep MLP: N(0, 0.02) weights.
        - QK LayerNorms: ones/zeros (PyTorch default).
        - adaLN modulation in every block: weight and bias zero (adaLN-Zero), so shift = 0,
          scale = 0 (i.e. x1) and gate = 0: each block is the identity at init.
        - Final adaLN modulation and final linear: zero, so the output is exactly 0 at init.
        - Cross-attention ``proj`` (text models): zero, so each block starts without its
          text branch and the model starts as the unconditional DiT; the cross-attention
          has no adaLN gate to do this (PixArt-α zero-initialises it likewise). A random
          output would make every block's residual depend on the caption before the
          self-attention and MLP have learned anything. ``cross_norm``: ones/zeros. The null
          context buffer: zeros until :meth:`set_null_context`.
        """
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        w = self.x_embedder.weight
        nn.init.xavier_uniform_(w.view(w.shape[0], -1))
        nn.init.zeros_(self.x_embedder.bias)
        if self.y_embedder is not None:
            nn.init.normal_(self.y_embedder.table.weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[0].weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[2].weight, std=0.02)
        for block in self.blocks:
            nn.init.zeros_(block.adaLN_modulation.weight)
            nn.init.zeros_(block.adaLN_modulation.bias)
            if block.cross_attn is not None:
                nn.init.zeros_(block.cross_attn.proj.weight)
                nn.init.zeros_(block.cross_attn.proj.bias)
        for lin in (self.final_layer.adaLN_modulation, self.final_layer.linear):
            nn.init.zeros_(lin.weight)
            nn.init.zeros_(lin.bias)

    def param_depth(self, name: str) -> int:
        """Layer depth of parameter ``name`` for layer-wise LR decay: 0 for the patch,
        timestep and class embeddings, i+1 for ``blocks.i`` (its cross-attention included),
        ``max_depth`` for the final layer."""
        return lookup_depth(name, self._depths, "DiT")

    def unpatchify(self, x: Tensor) -> Tensor:
        """(N, T, p*p*C) tokens -> (N, C, H, W) image."""
        n, g, p, c = x.shape[0], self.grid, self.patch_size, self.in_channels
        x = x.reshape(n, g, g, p, p, c)
        x = x.permute(0, 5, 1, 3, 2, 4)  # (N, C, G, p, G, p)
        return x.reshape(n, c, g * p, g * p)

    def forward(self, x: Tensor, t: Tensor, y: Tensor | None = None) -> Tensor:
        """The denoiser contract (see ``steadydiff.models``): x (N, C, H, W), t (N,), y (N,)
        labels, the text context (N, L, context_dim) of a text model, or None ->
        (N, C, H, W) in x's dtype (cast back from autocast's, so the loss is computed in
        full precision)."""
        t, y = check_inputs("DiT", x, t, y, in_channels=self.in_channels,
                            image_size=self.image_size, num_classes=self.num_classes,
                            null_context=getattr(self, "null_context", None))
        context = y if self.context_dim else None  # (N, L, D)
        h = self.x_embedder(x).flatten(2).transpose(1, 2)  # (N, T, D), T = (H/p)*(W/p)
        h = h + self.pos_embed
        c = self.t_embedder(t)  # (N, D)
        if self.y_embedder is not None:
            c = c + self.y_embedder(y)
        for block in self.blocks:
            h = block(h, c, context)  # (N, T, D)
        h = self.final_layer(h, c)  # (N, T, p*p*C)
        return self.unpatchify(h).to(x.dtype)  # (N, C, H, W)
