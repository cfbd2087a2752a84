"""ADM-style UNet denoiser (Ho et al. 2020, appendix B; Dhariwal & Nichol 2021, sec. 3).

conv_in -> down levels (residual blocks, attention at chosen feature-map sizes, stride-2
conv between levels) -> middle (res, attn, res) -> mirrored up levels (skip concatenation,
nearest upsample + conv) -> out (GroupNorm, SiLU, zero-initialised conv).

Module names are what the stability guard prints in its reports, so they read as paths:
``down.0.res.1``, ``down.1.attn.0``, ``down.0.downsample``, ``mid.res.0``, ``mid.attn``,
``up.2.res.0``, ``up.1.upsample``, ``out.conv``. ``up.i`` works at the same resolution as
``down.i`` (they are executed in reverse order).

Text conditioning (``context_dim`` > 0): every attention block attends to the text context
after its self-attention, ``down.1.attn.0.cross_attn``, ``mid.attn.cross_attn``, ... (the
LDM / Stable Diffusion transformer block, Rombach et al. 2022, sec. 3.3 and appendix E.2,
without its feed-forward: the ResBlocks around it are this network's MLPs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from steadydiff.config import UNetConfig
from steadydiff.models.layers import (
    Attention,
    Checkpointable,
    ClassEmbedder,
    TextConditioning,
    TimestepEmbedder,
    check_inputs,
    group_norm,
    lookup_depth,
)

__all__ = ["UNet"]


class ResBlock(Checkpointable, nn.Module):
    """GroupNorm-SiLU-conv, embedding scale-shift, GroupNorm-SiLU-dropout-conv, plus skip.

    The embedding enters as a per-channel scale and shift of the second norm
    ("use_scale_shift_norm", Dhariwal & Nichol 2021, sec. 3: better FID than adding it).
    """

    def __init__(self, in_ch: int, out_ch: int, emb_dim: int, dropout: float,
                 groups: int, eps: float, name: str) -> None:
        super().__init__()
        self.norm1 = group_norm(in_ch, groups, eps, f"{name}.norm1")
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, padding=1)
        self.emb_proj = nn.Linear(emb_dim, 2 * out_ch)  # -> (scale, shift)
        self.norm2 = group_norm(out_ch, groups, eps, f"{name}.norm2")
        self.dropout = nn.Dropout(dropout)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, padding=1)
        # 1x1 conv only when the width changes; identity costs nothing.
        self.skip: nn.Module = nn.Conv2d(in_ch, out_ch, 1) if in_ch != out_ch else nn.Identity()

    def forward(self, x: Tensor, emb: Tensor) -> Tensor:
        return self._run(self._forward, x, emb)

    def _forward(self, x: Tensor, emb: Tensor) -> Tensor:
        h = self.conv1(F.silu(self.norm1(x)))  # (N, C_out, H, W)
        scale, shift = self.emb_proj(F.silu(emb))[:, :, None, None].chunk(2, dim=1)
        h = self.norm2(h) * (1 + scale) + shift
        h = self.conv2(self.dropout(F.silu(h)))
        return self.skip(x) + h


class AttnBlock(Checkpointable, nn.Module):
    """Pre-norm self-attention over the H*W positions of a feature map, with residual; with
    ``context_dim`` > 0 then pre-norm cross-attention to the text context, with residual.

    norm -> self-attn -> norm -> cross-attn, as in the transformer block of LDM / Stable
    Diffusion (Rombach et al. 2022; ``BasicTransformerBlock``): the queries are the feature
    map's positions, keys and values the context's tokens. The cross-attention's norm is a
    LayerNorm over channels per position (``cross_norm``), as there; the self-attention keeps
    its GroupNorm, so a model without context is exactly the plain block.
    """

    def __init__(self, channels: int, head_channels: int, qk_norm: bool,
                 groups: int, eps: float, name: str, context_dim: int = 0) -> None:
        super().__init__()
        heads = channels // head_channels
        self.norm = group_norm(channels, groups, eps, f"{name}.norm")
        self.attn = Attention(channels, heads, qk_norm=qk_norm, eps=eps)
        # absent without context: no new parameters, buffers or init RNG draws
        self.cross_norm: nn.LayerNorm | None = None
        self.cross_attn: Attention | None = None
        if context_dim:
            self.cross_norm = nn.LayerNorm(channels, eps=eps)
            self.cross_attn = Attention(channels, heads, qk_norm=qk_norm, eps=eps,
                                        context_dim=context_dim)

    def forward(self, x: Tensor, context: Tensor | None = None) -> Tensor:
        return self._run(self._forward, x, context)

    def _forward(self, x: Tensor, context: Tensor | None) -> Tensor:
        n, c, h, w = x.shape
        tokens = self.norm(x).reshape(n, c, h * w).transpose(1, 2)  # (N, HW, C)
        out = self.attn(tokens).transpose(1, 2).reshape(n, c, h, w)  # (N, C, H, W)
        x = x + out
        if self.cross_attn is None:
            return x
        assert self.cross_norm is not None
        tokens = self.cross_norm(x.reshape(n, c, h * w).transpose(1, 2))  # (N, HW, C)
        out = self.cross_attn(tokens, context)  # (N, HW, C), context (N, L, D)
        return x + out.transpose(1, 2).reshape(n, c, h, w)


class Downsample(nn.Module):
    """Stride-2 3x3 conv (learned downsampling, as in ADM)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, stride=2, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(x)


class Upsample(nn.Module):
    """Nearest x2 upsample then 3x3 conv (avoids the checkerboard of transposed convs)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class Level(nn.Module):
    """One resolution level: ``res`` blocks, optional ``attn`` after each, and a resampler."""

    def __init__(self) -> None:
        super().__init__()
        self.res = nn.ModuleList()
        self.attn = nn.ModuleList()  # empty, or one per res block
        self.downsample: nn.Module | None = None
        self.upsample: nn.Module | None = None


class Middle(nn.Module):
    def __init__(self, ch: int, emb_dim: int, cfg: UNetConfig, qk_norm: bool,
                 context_dim: int = 0) -> None:
        super().__init__()
        g, eps = cfg.norm_groups, cfg.norm_eps
        self.res = nn.ModuleList([
            ResBlock(ch, ch, emb_dim, cfg.dropout, g, eps, "mid.res.0"),
            ResBlock(ch, ch, emb_dim, cfg.dropout, g, eps, "mid.res.1"),
        ])
        self.attn = AttnBlock(ch, cfg.head_channels, qk_norm, g, eps, "mid.attn", context_dim)

    def forward(self, h: Tensor, emb: Tensor, context: Tensor | None = None) -> Tensor:
        return self.res[1](self.attn(self.res[0](h, emb), context), emb)


class Out(nn.Module):
    def __init__(self, ch: int, out_ch: int, cfg: UNetConfig) -> None:
        super().__init__()
        self.norm = group_norm(ch, cfg.norm_groups, cfg.norm_eps, "out.norm")
        self.conv = nn.Conv2d(ch, out_ch, 3, padding=1)

    def forward(self, h: Tensor) -> Tensor:
        return self.conv(F.silu(self.norm(h)))


class UNet(TextConditioning, nn.Module):
    """ADM-style UNet following the denoiser contract ``model(x, t, y=None) -> out``.

    Args:
        in_channels: image channels C (output has the same C).
        image_size: H = W; must be divisible by ``2**(len(channel_mult)-1)``.
        cfg: widths, depths, attention sizes, norms (see :class:`UNetConfig`).
        num_classes: 0 for unconditional; otherwise labels 0..num_classes-1 plus the null
            class ``num_classes`` for classifier-free guidance.
        qk_norm: QK-norm in every attention block (Dehghani et al. 2023).
        context_dim: 0, or the width D of a text encoder's token embeddings: y is then the
            text context (N, L, D), attended to by a cross-attention in every attention
            block (``*.attn.*.cross_attn``, ``mid.attn.cross_attn``; with empty
            ``attention_resolutions`` only the middle block's).
        context_len: the null context's length L (77: CLIP's); see
            :class:`~steadydiff.models.layers.TextConditioning`.

    Raises:
        ValueError: at build time, for a shape that cannot work (message names both shapes),
            or both ``num_classes`` and ``context_dim`` > 0.
    """

    def __init__(self, in_channels: int, image_size: int, cfg: UNetConfig,
                 num_classes: int = 0, qk_norm: bool = False, context_dim: int = 0,
                 context_len: int = 77) -> None:
        super().__init__()
        self.in_channels = in_channels
        self.image_size = image_size
        self._init_conditioning("UNet", num_classes, context_dim, context_len)
        cd = self.context_dim
        ch, mults, nrb = cfg.channels, list(cfg.channel_mult), cfg.num_res_blocks
        g, eps = cfg.norm_groups, cfg.norm_eps
        self._check_shapes(image_size, cfg)

        # Embedding width 4x the base width, sinusoid at the base width (ADM).
        emb_dim = 4 * ch
        self.time_embed = TimestepEmbedder(emb_dim, freq_dim=ch)
        self.class_embed = ClassEmbedder(num_classes, emb_dim) if num_classes > 0 else None
        self.conv_in = nn.Conv2d(in_channels, ch, 3, padding=1)

        # Down path. `skips` records the width of every tensor pushed on the skip stack.
        # `depths` maps module prefixes to their layer depth in execution order (LR decay).
        depths: dict[str, int] = {"time_embed": 0, "class_embed": 0, "conv_in": 0}
        d = 1
        skips = [ch]
        cur, size = ch, image_size
        self.down = nn.ModuleList()
        for i, mult in enumerate(mults):
            level, width = Level(), mult * ch
            use_attn = size in cfg.attention_resolutions
            for j in range(nrb):
                level.res.append(ResBlock(cur, width, emb_dim, cfg.dropout, g, eps,
                                          f"down.{i}.res.{j}"))
                if use_attn:
                    level.attn.append(AttnBlock(width, cfg.head_channels, qk_norm, g, eps,
                                                f"down.{i}.attn.{j}", cd))
                depths[f"down.{i}.res.{j}"] = depths[f"down.{i}.attn.{j}"] = d
                d += 1
                cur = width
                skips.append(cur)
            if i < len(mults) - 1:
                level.downsample = Downsample(cur)
                depths[f"down.{i}.downsample"] = d
                d += 1
                skips.append(cur)
                size //= 2
            self.down.append(level)

        self.mid = Middle(cur, emb_dim, cfg, qk_norm, cd)
        depths["mid.res.0"] = depths["mid.attn"] = d
        depths["mid.res.1"] = d + 1
        d += 2

        # Up path, built in execution order (deepest level first), stored by level index so
        # up.i mirrors down.i. Each level has nrb+1 blocks: one per skip pushed on the way down.
        up: list[Level | None] = [None] * len(mults)
        for i in reversed(range(len(mults))):
            level, width = Level(), mults[i] * ch
            use_attn = size in cfg.attention_resolutions
            for j in range(nrb + 1):
                level.res.append(ResBlock(cur + skips.pop(), width, emb_dim, cfg.dropout, g, eps,
                                          f"up.{i}.res.{j}"))
                if use_attn:
                    level.attn.append(AttnBlock(width, cfg.head_channels, qk_norm, g, eps,
                                                f"up.{i}.attn.{j}", cd))
                depths[f"up.{i}.res.{j}"] = depths[f"up.{i}.attn.{j}"] = d
                d += 1
                cur = width
            if i > 0:
                level.upsample = Upsample(cur)
                depths[f"up.{i}.upsample"] = d
                d += 1
                size *= 2
            up[i] = level
        self.up = nn.ModuleList(up)
        assert not skips

        self.out = Out(cur, in_channels, cfg)
        depths["out"] = d
        self.max_depth: int = d
        self._depths = depths
        self.initialize_weights()

    @staticmethod
    def _check_shapes(image_size: int, cfg: UNetConfig) -> None:
        levels = len(cfg.channel_mult)
        factor = 2 ** (levels - 1)
        if image_size % factor:
            raise ValueError(
                f"image_size {image_size} is not divisible by {factor} = 2**{levels - 1} "
                f"down-samplings (channel_mult has {levels} levels); use a multiple of {factor}")
        sizes = [image_size // 2**i for i in range(levels)]
        missing = [r for r in cfg.attention_resolutions if r not in sizes]
        if missing:
            raise ValueError(
                f"attention_resolutions {missing} never occur: with image_size {image_size} and "
                f"{levels} levels the feature-map sizes are {sizes}")
        # Every attention block's width must split into heads of head_channels.
        checks = [(f"down.{i}/up.{i} attention", m * cfg.channels, s)
                  for i, (m, s) in enumerate(zip(cfg.channel_mult, sizes))
                  if s in cfg.attention_resolutions]
        checks.append(("mid.attn", cfg.channel_mult[-1] * cfg.channels, sizes[-1]))
        for where, width, _ in checks:
            if width % cfg.head_channels:
                divisors = [h for h in range(4, width + 1) if width % h == 0]
                raise ValueError(
                    f"{where}: {width} channels are not divisible by head_channels="
                    f"{cfg.head_channels}; choose head_channels dividing {width} "
                    f"(e.g. {', '.join(map(str, divisors[-3:]))})")

    def initialize_weights(self) -> None:
        """Every init decision, in one place.

        - Convs, linears, embeddings: PyTorch defaults (ADM keeps them too).
        - ``res.*.conv2`` and attention ``proj``: zero, so every residual block starts as the
          identity (ADM's ``zero_module``); signal variance does not grow with depth at init.
        - Cross-attention (text models) ``cross_attn.proj``: zero, so at init the model is
          the unconditional one (the context has no path to the output) and training first
          learns the image, then how the caption changes it; a random projection would
          instead add context-dependent noise to every block from step 0 (the same
          reasoning as ControlNet's zero convolutions, Zhang et al. 2023). Its q/kv
          projections and ``cross_norm``: PyTorch defaults. The null context buffer: zeros
          until :meth:`set_null_context`.
        - ``out.conv``: zero, so the model predicts exactly 0 at step 0 (for eps-prediction,
          the prior mean of the noise) and the first loss is the data-independent baseline.
        """
        for m in self.modules():
            if isinstance(m, ResBlock):
                nn.init.zeros_(m.conv2.weight)
                nn.init.zeros_(m.conv2.bias)
            elif isinstance(m, AttnBlock):
                nn.init.zeros_(m.attn.proj.weight)
                nn.init.zeros_(m.attn.proj.bias)
                if m.cross_attn is not None:
                    nn.init.zeros_(m.cross_attn.proj.weight)
                    nn.init.zeros_(m.cross_attn.proj.bias)
        nn.init.zeros_(self.out.conv.weight)
        nn.init.zeros_(self.out.conv.bias)

    def param_depth(self, name: str) -> int:
        """Layer depth of parameter ``name`` for layer-wise LR decay.

        0 for the stem and embeddings; one step per residual block (with its attention,
        self and cross), downsample and upsample in execution order down -> mid -> up;
        ``max_depth`` for ``out``.
        """
        return lookup_depth(name, self._depths, "UNet")

    def forward(self, x: Tensor, t: Tensor, y: Tensor | None = None) -> Tensor:
        """The denoiser contract (see ``steadydiff.models``): x (N, C, H, W), t (N,), y (N,)
        labels, the text context (N, L, context_dim) of a text model, or None -> (N, C, H, W)
        in x's dtype (cast back from autocast's, so the loss is computed in full
        precision)."""
        t, y = check_inputs("UNet", x, t, y, in_channels=self.in_channels,
                            image_size=self.image_size, num_classes=self.num_classes,
                            null_context=getattr(self, "null_context", None))
        # One conditioning vector for all blocks: timestep plus class (ADM adds them). A
        # text context instead enters every attention block by cross-attention.
        emb = self.time_embed(t)  # (N, E)
        if self.class_embed is not None:
            emb = emb + self.class_embed(y)
        context = y if self.context_dim else None  # (N, L, D)

        h = self.conv_in(x)  # (N, ch, H, W)
        # Every down-path output is kept for the mirrored up block at the same resolution:
        # the skips carry the fine detail the bottleneck cannot (Ronneberger et al. 2015).
        hs = [h]
        for level in self.down:
            for j, res in enumerate(level.res):
                h = res(h, emb)
                if len(level.attn):
                    h = level.attn[j](h, context)
                hs.append(h)
            if level.downsample is not None:
                h = level.downsample(h)  # (N, C, H/2, W/2)
                hs.append(h)

        h = self.mid(h, emb, context)

        for level in reversed(self.up):
            for j, res in enumerate(level.res):
                h = res(torch.cat([h, hs.pop()], dim=1), emb)  # skip concatenation
                if len(level.attn):
                    h = level.attn[j](h, context)
            if level.upsample is not None:
                h = level.upsample(h)  # (N, C, 2H, 2W)

        return self.out(h).to(x.dtype)  # (N, C, H, W)
