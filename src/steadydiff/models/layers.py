"""Shared model primitives: timestep/class embeddings, attention (self or cross, optional
QK-norm, probe mode), checked GroupNorm, the denoiser-contract input check, text
conditioning (the null context), gradient checkpointing of blocks and layer-depth lookup.

Both architectures (``unet.py``, ``dit.py``) import these; nothing here is copied into a
model file, so a fix lands once (see STYLE.md, habit 6).
"""

from __future__ import annotations

import contextlib
import math
from typing import cast

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor, nn

__all__ = [
    "Attention",
    "Checkpointable",
    "ClassEmbedder",
    "TextConditioning",
    "TimestepEmbedder",
    "check_inputs",
    "group_norm",
    "lookup_depth",
    "timestep_embedding",
]


# --------------------------------------------------------------------------- checkpointing


class Checkpointable:
    """A block whose activations may be recomputed in the backward pass instead of kept
    (gradient checkpointing, Chen et al. 2016; ``train.gradient_checkpointing``).

    The block's computation is ``_forward``; ``forward`` runs it through
    ``torch.utils.checkpoint`` (non-reentrant, so frozen inputs still give gradients to the
    block's weights and its hooks fire as usual) when ``checkpointed`` is set and autograd
    records, and directly otherwise: sampling, EMA and the guard's no-grad probes keep no
    activations anyway. The RNG state is saved with the inputs, so dropout draws the same
    mask in the recomputation: the gradients equal those of the plain block.
    """

    checkpointed: bool = False  # set per instance by steadydiff.models.enable_checkpointing

    def _run(self, fn, *args):
        if self.checkpointed and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)
        return fn(*args)


# --------------------------------------------------------------------------- embeddings


def timestep_embedding(t: Tensor, dim: int, max_period: float = 10000.0) -> Tensor:
    """Sinusoidal embedding of (possibly fractional) timesteps.

    The transformer position code of Vaswani et al. 2017 applied to the diffusion step
    (Ho et al. 2020, appendix B): frequencies fall geometrically from 1 to 1/max_period, so
    t in [0, T) with T ~ 1000 is resolved from single steps up to the whole range.
    Continuous values (e.g. 437.25) are fine: nothing here rounds.

    Args:
        t: (N,) timesteps, any real dtype; computed in float32 even under autocast,
            because bf16 cannot tell t=437 from t=438 (8 mantissa bits).
        dim: embedding width; an odd ``dim`` gets one zero column at the end.
        max_period: the longest period, in timestep units.

    Returns:
        (N, dim) float32 tensor, ``[cos(t*f_0..f_{h-1}), sin(t*f_0..f_{h-1})]``.
    """
    half = dim // 2
    # f_i = max_period^(-i/half), i = 0..half-1
    freqs = torch.exp(
        -math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t.to(torch.float32)[:, None] * freqs[None]  # (N, half)
    emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)  # (N, 2*half)
    if dim % 2:
        emb = F.pad(emb, (0, 1))
    return emb


class TimestepEmbedder(nn.Module):
    """Sinusoid followed by a 2-layer SiLU MLP (Ho et al. 2020; Peebles & Xie 2023, sec. 3.2).

    Args:
        dim: output width.
        freq_dim: width of the sinusoidal code fed to the MLP (DiT uses 256; the ADM UNet
            uses its base channel count).
        max_period: see :func:`timestep_embedding`.
    """

    def __init__(self, dim: int, freq_dim: int = 256, max_period: float = 10000.0) -> None:
        super().__init__()
        self.freq_dim = freq_dim
        self.max_period = max_period
        self.mlp = nn.Sequential(nn.Linear(freq_dim, dim), nn.SiLU(), nn.Linear(dim, dim))

    def forward(self, t: Tensor) -> Tensor:
        """(N,) timesteps -> (N, dim) embedding."""
        return self.mlp(timestep_embedding(t, self.freq_dim, self.max_period))


class ClassEmbedder(nn.Module):
    """Class-label table with one extra row: index ``num_classes`` is the null class.

    Classifier-free guidance (Ho & Salimans 2022) trains the same network with labels randomly
    replaced by the null class, then mixes conditional and null predictions at sampling time.
    Label dropout itself belongs to the objective (diffusion/), not to the model.

    Args:
        num_classes: number of real classes (labels 0..num_classes-1).
        dim: embedding width.
    """

    def __init__(self, num_classes: int, dim: int) -> None:
        super().__init__()
        self.num_classes = num_classes
        self.table = nn.Embedding(num_classes + 1, dim)

    def forward(self, y: Tensor) -> Tensor:
        """(N,) long labels in [0, num_classes] (num_classes: the null class) -> (N, dim).

        Raises:
            ValueError: floating or boolean labels; on the CPU also a label outside
                [0, num_classes]. On an accelerator the range is not checked here: reading
                it back would be a host sync in every forward pass (the trainer checks labels
                on the CPU as the data is fetched; an out-of-range id there is a device-side
                assert).
        """
        if y.is_floating_point() or y.is_complex() or y.dtype == torch.bool:  # metadata only
            raise ValueError(f"class labels must be an integer tensor, got {y.dtype}; valid "
                             f"labels are 0..{self.num_classes - 1} (and {self.num_classes}, "
                             "the null class)")
        if y.device.type == "cpu" and y.numel() and not torch.compiler.is_compiling():
            lo, hi = int(y.min()), int(y.max())  # CPU tensors: no device to wait for
            if lo < 0 or hi > self.num_classes:
                bad = lo if lo < 0 else hi
                raise ValueError(f"class label {bad} is out of range: valid labels are "
                                 f"0..{self.num_classes - 1}, and {self.num_classes} for the "
                                 "null class (classifier-free guidance)")
        return self.table(y)


# --------------------------------------------------------------------------- attention


def _autocast_off(device: torch.device) -> contextlib.AbstractContextManager:
    """Autocast disabled on ``device``; nothing on the meta device (preflight's forward),
    where ``torch.autocast`` raises and there is no autocast to turn off."""
    if device.type == "meta":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, enabled=False)


class Attention(nn.Module):
    """Multi-head attention on tokens (N, L, D), with optional QK-norm and a probe mode:
    self-attention, or with ``context_dim`` > 0 cross-attention to a context (N, S, C).

    Cross-attention (Vaswani et al. 2017, sec. 3.2.3; the text conditioning of Rombach et al.
    2022, sec. 3.3): queries from x, keys and values from the context (a frozen text
    encoder's token embeddings), projected from its width C to D. It is this same class, not
    a copy, so QK-norm, the probe, ``fused`` and ``upcast_attention`` (below) mean the same
    for both kinds, and each cross-attention is a module of its own that the guard's
    attention-upcast repair can name. The projections differ: a self-attention has one fused
    ``qkv`` (D -> 3D), a cross-attention ``q`` (D -> D) and ``kv`` (C -> 2D).

    QK-norm (Dehghani et al. 2023, "Scaling Vision Transformers to 22B Parameters", sec. 3.1)
    normalises q and k per head before the dot product. Without it, the attention logits can
    grow without bound during training, the softmax collapses to one-hot (entropy -> 0) and
    the loss diverges; with it, logits are bounded by the norm gains. We use LayerNorm per
    head, as in that paper.

    The fast path is ``F.scaled_dot_product_attention`` (flash / memory-efficient kernels on
    CUDA). Setting ``self.probe = True`` switches to an explicit softmax(q kᵀ/√d) in float32
    and stores ``self.last_stats = {"max_logit", "entropy"}`` (0-dim, detached, no host
    sync) for the stability guard; the output equals the fast path up to float error. The
    probe materialises the (N, heads, L, S) logits, so the guard should turn it on only on
    probe steps.

    ``self.upcast_attention = True`` computes q kᵀ and the softmax in float32 with autocast
    off (inputs cast up, the output cast back to the compute dtype): the "upcast attention"
    fix for fp16 overflow of the logits (Stable Diffusion 2.x; diffusers' ``Attention`` has
    an attribute of the same name and meaning, which is what lets the guard flip it on either
    kind of module). ``model.upcast_attention`` sets it on every layer at build; the guard
    sets it on one layer whose attention overflowed fp16.

    ``self.fused = False`` writes the attention out instead of calling the fused kernel, in
    the compute dtype: under fp16 the (N, heads, L, L) logits are fp16 and overflow past
    65504, as in an unfused kernel (diffusers' classic ``AttnProcessor``, SD 2.x's original
    attention). The fused kernels accumulate q kᵀ in float32 and hide that overflow; the
    ``attn_logit_overflow`` fault (guard/faults.py) turns ``fused`` off to reproduce it.

    Args:
        dim: token width D.
        num_heads: number of heads; must divide ``dim``.
        qk_norm: normalise q and k per head.
        eps: epsilon of the QK LayerNorms.
        context_dim: 0 for self-attention; the context width C for cross-attention.
    """

    def __init__(self, dim: int, num_heads: int, qk_norm: bool = False, eps: float = 1e-6,
                 context_dim: int = 0) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"attention width {dim} is not divisible by num_heads={num_heads}")
        if context_dim < 0:
            raise ValueError(f"attention context_dim must be >= 0 (0: self-attention), "
                             f"got {context_dim}")
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.context_dim = context_dim
        if context_dim:
            self.q = nn.Linear(dim, dim)
            self.kv = nn.Linear(context_dim, 2 * dim)
        else:  # as before cross-attention existed: the same parameters and init RNG draws
            self.qkv = nn.Linear(dim, 3 * dim)
        # No bias on the key norm: a key bias b adds the same q.b to every logit of a query
        # row, which softmax ignores, so it would be a parameter whose gradient is always 0.
        self.q_norm: nn.Module = nn.LayerNorm(self.head_dim, eps=eps) if qk_norm else nn.Identity()
        self.k_norm: nn.Module = (nn.LayerNorm(self.head_dim, eps=eps, bias=False)
                                  if qk_norm else nn.Identity())
        self.proj = nn.Linear(dim, dim)
        self.probe = False
        self.upcast_attention = False
        self.fused = True
        self.last_stats: dict[str, Tensor] | None = None

    def forward(self, x: Tensor, context: Tensor | None = None) -> Tensor:
        """(N, L, D) -> (N, L, D); a cross-attention needs ``context`` (N, S, C), a
        self-attention refuses one."""
        n, length, d = x.shape
        if self.context_dim:
            if context is None or context.ndim != 3 or context.shape[0] != n \
                    or context.shape[2] != self.context_dim:
                got = None if context is None else tuple(context.shape)
                raise ValueError(f"cross-attention expects a context of shape ({n}, S, "
                                 f"{self.context_dim}) for x {tuple(x.shape)}, got {got}")
            s = context.shape[1]
            q = self.q(x).reshape(n, length, self.num_heads, self.head_dim).transpose(1, 2)
            # the context in x's dtype: outside autocast a half-precision encoder output
            # would not multiply float32 weights (under autocast the Linear recasts it)
            kv = self.kv(context.to(x.dtype)).reshape(n, s, 2, self.num_heads, self.head_dim)
            k, v = kv.permute(2, 0, 3, 1, 4).unbind(0)  # each (N, heads, S, Dh)
        else:
            if context is not None:
                raise ValueError("a self-attention layer got a context; build it with "
                                 "context_dim > 0 for cross-attention")
            qkv = self.qkv(x).reshape(n, length, 3, self.num_heads, self.head_dim)
            q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (N, heads, L, Dh)
        # LayerNorm runs in float32 under autocast; bring q, k back to v's dtype so SDPA
        # gets one dtype.
        q = self.q_norm(q).to(v.dtype)
        k = self.k_norm(k).to(v.dtype)
        if self.probe or not self.fused:
            out = self._explicit_attention(q, k, v, fp32=self.probe or self.upcast_attention)
        elif self.upcast_attention:
            # the same fused kernel on float32 inputs: q kᵀ and softmax in fp32
            with _autocast_off(q.device):
                out = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
            out = out.to(v.dtype)
        else:
            out = F.scaled_dot_product_attention(q, k, v)  # (N, heads, L, Dh)
        out = out.transpose(1, 2).reshape(n, length, d)  # (N, L, D)
        return self.proj(out)

    def _explicit_attention(self, q: Tensor, k: Tensor, v: Tensor, fp32: bool) -> Tensor:
        # softmax(q kᵀ/√d) v written out, autocast off. fp32 (the probe, upcast_attention):
        # the statistics describe the logits, not bf16 rounding of them, and logits past
        # 65504 stay finite. Otherwise the logits are in the compute dtype, as an unfused
        # kernel leaves them; the softmax runs in fp32 as autocast would run it.
        dt = torch.float32 if fp32 else v.dtype
        with _autocast_off(q.device):
            logits = (q.to(dt) @ k.to(dt).transpose(-2, -1)) / math.sqrt(self.head_dim)
            logp = torch.log_softmax(logits.float(), dim=-1)  # (N, heads, L, S); S = L self
            p = logp.exp()
            if self.probe:
                # Entropy in nats per query row; log(S) is uniform, 0 is one-hot collapse.
                entropy = -(p * logp).sum(-1).mean()
                self.last_stats = {"max_logit": logits.detach().float().amax(),
                                   "entropy": entropy.detach()}
            out = p.to(dt) @ v.to(dt)
        return out.to(v.dtype)


# --------------------------------------------------------------------------- norms


def group_norm(channels: int, groups: int, eps: float, name: str) -> nn.GroupNorm:
    """``nn.GroupNorm`` that fails at build time, naming the layer, when groups do not fit.

    Args:
        channels: number of channels normalised.
        groups: number of groups; must divide ``channels``.
        eps: GroupNorm epsilon.
        name: module path used in the error message (e.g. ``"down.1.res.0.norm1"``).

    Returns:
        The GroupNorm module (affine).

    Raises:
        ValueError: ``channels % groups != 0``; the message suggests valid group counts.
    """
    if channels % groups:
        divisors = [g for g in range(2, channels + 1) if channels % g == 0]
        # Suggest a few divisors near the requested count, smallest distance first.
        near = sorted(divisors, key=lambda g: (abs(g - groups), g))[:3]
        raise ValueError(
            f"{name}: {channels} channels are not divisible by norm_groups={groups}; "
            f"choose norm_groups dividing {channels} (e.g. {', '.join(map(str, sorted(near)))})")
    return nn.GroupNorm(groups, channels, eps=eps)


# --------------------------------------------------------------------------- contract helpers


def check_inputs(
    model: str,
    x: Tensor,
    t: Tensor,
    y: Tensor | None,
    *,
    in_channels: int,
    image_size: int,
    num_classes: int,
    null_context: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Validate a denoiser call ``model(x, t, y)`` on shapes only (no host sync).

    Args:
        model: model name for messages ("UNet", "DiT").
        x: (N, C, H, W) input.
        t: (N,) timesteps; a 0-dim tensor or Python number is broadcast to (N,).
        y: (N,) long labels in [0, num_classes], the text context (N, L, D) of a
            text-conditioned model (any L; D its ``context_dim``), or None.
        in_channels, image_size, num_classes: the model's build-time values.
        null_context: a text-conditioned model's ``null_context`` (L0, D) buffer, None for
            the others.

    Returns:
        ``(t, y)`` with t of shape (N,) and, when y is None, y replaced by the null
        condition: the null class ``num_classes`` (class-conditional), the null context
        expanded to (N, L0, D) (text-conditioned), None (unconditional).

    Raises:
        ValueError: wrong x/t/y shape or dtype, or a condition passed to an unconditional
            model.
    """
    expected = (in_channels, image_size, image_size)
    if x.ndim != 4 or tuple(x.shape[1:]) != expected:
        raise ValueError(
            f"{model} expects x of shape (N, {in_channels}, {image_size}, {image_size}), "
            f"got {tuple(x.shape)}")
    n = x.shape[0]
    if not isinstance(t, Tensor):
        t = torch.tensor(float(t), device=x.device)
    if t.ndim == 0:
        t = t.expand(n)
    if tuple(t.shape) != (n,):
        raise ValueError(f"{model} expects t of shape ({n},) to match x, got {tuple(t.shape)}")
    if null_context is not None:
        return t, _check_context(model, n, y, null_context)
    if num_classes == 0:
        if y is not None:
            raise ValueError(
                f"{model} was built unconditional (num_classes=0) but got class labels y; "
                f"pass y=None or build with model.num_classes > 0")
        return t, None
    if y is None:
        y = torch.full((n,), num_classes, dtype=torch.long, device=x.device)
    elif tuple(y.shape) != (n,):
        raise ValueError(f"{model} expects y of shape ({n},) to match x, got {tuple(y.shape)}")
    return t, y


def _check_context(model: str, n: int, y: Tensor | None, null_context: Tensor) -> Tensor:
    # A text model's y: the context (N, L, D), any L (cross-attention's cost and result do
    # not depend on L matching the null context's; only guidance, which batches the two,
    # needs equal lengths, see TextConditioning.null_condition). None: the null context.
    dim = null_context.shape[1]
    if y is None:
        return null_context.expand(n, -1, -1)  # (N, L0, D), a view: no copy
    if y.ndim != 3 or y.shape[0] != n or y.shape[2] != dim:
        raise ValueError(
            f"{model} is text-conditioned (context_dim={dim}): y must be the text context of "
            f"shape ({n}, L, {dim}) for x with batch {n}, got y of shape {tuple(y.shape)}"
            + ("; class labels need a model built with num_classes > 0" if y.ndim == 1 else ""))
    if not y.is_floating_point():
        raise ValueError(f"{model} is text-conditioned: y must be a float text context "
                         f"({n}, L, {dim}), got dtype {y.dtype}")
    return y


class TextConditioning:
    """What a text-conditioned denoiser adds to the contract (mixed into UNet and DiT).

    A model is text-conditioned when ``context_dim`` > 0: y is then the (N, L, D) token
    embeddings of a frozen text encoder (D = ``context_dim``), attended to by
    cross-attention. Its classifier-free-guidance "no condition" is the encoding of the empty
    caption, which the model cannot compute (it has no text encoder), so it is a buffer
    ``null_context`` (``context_len``, ``context_dim``) that the trainer fills once with
    :meth:`set_null_context`. The buffer is persistent: a checkpoint carries the null
    condition its model was trained with, and sampling from it needs no text encoder for the
    unconditional half of guidance.

    Class-conditional and unconditional models have ``context_dim = 0``,
    ``context_len = 0`` and no buffer (their state_dict keys are unchanged).
    """

    context_dim: int
    context_len: int
    num_classes: int

    def _init_conditioning(self, model: str, num_classes: int, context_dim: int,
                           context_len: int) -> None:
        if context_dim < 0 or num_classes < 0:
            raise ValueError(f"{model}: num_classes and context_dim must be >= 0, got "
                             f"num_classes={num_classes}, context_dim={context_dim}")
        if num_classes > 0 and context_dim > 0:
            raise ValueError(
                f"{model} is either class- or text-conditioned, not both: got num_classes="
                f"{num_classes} and context_dim={context_dim}; set num_classes=0 for a text "
                f"model (captions can name the classes: data.captions=class_names) or "
                f"context_dim=0 for class labels")
        if context_dim > 0 and context_len < 1:
            raise ValueError(f"{model}: context_len (the null context's token count) must be "
                             f">= 1 for a text model, got {context_len}")
        self.num_classes = num_classes
        self.context_dim = context_dim
        self.context_len = context_len if context_dim > 0 else 0
        if context_dim > 0:
            # zeros until the trainer sets the empty caption's encoding; on the meta device
            # (preflight) it is a meta tensor like the weights
            module = cast(nn.Module, self)  # mixed into an nn.Module
            module.register_buffer("null_context", torch.zeros(context_len, context_dim))

    @torch.no_grad()
    def set_null_context(self, ctx: Tensor) -> None:
        """Store the empty caption's encoding as the null condition.

        Args:
            ctx: (context_len, context_dim) or (1, context_len, context_dim) (a text
                encoder's output for one caption); copied, cast to the buffer's dtype.

        Raises:
            ValueError: a model without text conditioning, or a shape other than the above.
        """
        name = type(self).__name__
        if self.context_dim == 0:
            raise ValueError(f"{name} is not text-conditioned (context_dim=0): it has no null "
                             "context to set")
        want = (self.context_len, self.context_dim)
        shape = tuple(ctx.shape)
        if shape not in (want, (1, *want)):
            raise ValueError(f"{name}.set_null_context expects the empty caption's encoding of "
                             f"shape {want} or {(1, *want)} (context_len, context_dim), got "
                             f"{shape}")
        buf: Tensor = self.null_context  # type: ignore[attr-defined]
        buf.copy_(ctx.reshape(want).to(buf.device, buf.dtype))

    def null_condition(self, y: Tensor) -> Tensor:
        """The classifier-free-guidance null condition shaped like ``y``: the null context
        expanded to (N, L, D) in y's dtype for a text model (y's L must be ``context_len``:
        guidance batches the two); the null class ``num_classes`` for class labels (N,).

        Raises:
            ValueError: y's context length differs from the null context's, or an
                unconditional model.
        """
        name = type(self).__name__
        if self.context_dim > 0:
            if y.ndim != 3 or y.shape[1:] != (self.context_len, self.context_dim):
                raise ValueError(
                    f"{name}'s null context is ({self.context_len}, {self.context_dim}) "
                    f"(context_len, context_dim); the condition y {tuple(y.shape)} must be "
                    f"(N, {self.context_len}, {self.context_dim}) to be guided against it "
                    f"(pad or truncate captions to context_len tokens)")
            buf: Tensor = self.null_context  # type: ignore[attr-defined]
            return buf.expand(y.shape[0], -1, -1).to(y.dtype)
        if self.num_classes > 0:
            return torch.full_like(y, self.num_classes)
        raise ValueError(f"{name} is unconditional: it has no null condition")


# Prefixes added by wrappers whose parameter names the optimizer may see.
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def lookup_depth(name: str, table: dict[str, int], model: str) -> int:
    """Depth of parameter ``name`` from a {module-prefix: depth} table (longest prefix wins).

    Wrapper prefixes (``module.`` from DDP, ``_orig_mod.`` from torch.compile) are stripped.

    Raises:
        KeyError: no prefix of the table matches ``name``.
    """
    stripped = True
    while stripped:
        stripped = False
        for p in _WRAPPER_PREFIXES:
            if name.startswith(p):
                name, stripped = name[len(p):], True
    best, depth = -1, None
    for prefix, d in table.items():
        if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > best:
            best, depth = len(prefix), d
    if depth is None:
        raise KeyError(f"{model}.param_depth: no depth known for parameter {name!r}")
    return depth
