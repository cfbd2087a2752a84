"""LoHa and LoKr: LyCORIS' Hadamard- and Kronecker-product LoRA variants, trained through
peft (``LoHaConfig`` / ``LoKrConfig``) and exchanged under LyCORIS' key names.

The one owner of what these two variants are in a file:

- **LoHa** (Hyeon-Woo et al. 2022, FedPara): ``dW = (w1_a w1_b) * (w2_a w2_b) * alpha / r``
  (elementwise product of two rank-r products). Per layer ``NAME.hada_w1_a`` (out, r),
  ``hada_w1_b`` (r, in[*k*k]), ``hada_w2_a``, ``hada_w2_b`` and ``NAME.alpha``.
- **LoKr** (Yeh et al. 2024, LyCORIS): ``dW = kron(w1, w2) * scale``, the layer's (out, in)
  factored as (out_l*out_k, in_m*in_n) (``adapter.factor``, LyCORIS' ``factor``: -1 as square
  as possible); ``w1`` (out_l, in_m) full (``lokr_w1``) and ``w2`` (out_k, in_n[*k*k]) full
  (``lokr_w2``) or rank-r (``lokr_w2_a`` @ ``lokr_w2_b``) where r < half its larger side.
  LyCORIS' scale is alpha / r where a factor is rank-decomposed and 1 where both are full;
  peft's is alpha / r always: a layer with two full factors is written with alpha / r
  folded into ``lokr_w1`` (and read back the same way), so every loader sees the delta
  peft trained.

peft's parameter names are LyCORIS' own (``hada_w1_a``, ``lokr_w2_b``, ...) and so are the
shapes (peft's layers were ported from LyCORIS), so writing and reading are renames; the
readers these files are for (LyCORIS' ``lycoris.kohya`` network module in kohya's
sd-scripts, A1111's built-in Lora extension, ComfyUI's weight adapters) read the same keys.
Tucker-decomposed convolutions (``hada_t1``, ``lokr_t2``; LyCORIS' ``use_tucker``) are
neither trained nor read. diffusers loads no LoHa, and a LoKr only through the Z-Image and
FLUX.2 loaders (``Family.diffusers_lycoris``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["ALGOS", "VARIANTS", "peft_config", "algo_of", "file_tensors", "file_scale",
           "load_into", "delta_norm", "shrink", "formats_for", "check_layer"]

#: adapter.variant -> LyCORIS' ``algo`` (ss_network_args) and the factor names it may hold
ALGOS: dict[str, tuple[str, ...]] = {
    "loha": ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b"),
    "lokr": ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b"),
}
VARIANTS = tuple(ALGOS)
TUCKER = ("hada_t1", "hada_t2", "lokr_t2")
PREFIXES = ("hada_", "lokr_")
_ADAPTER = "default"


def peft_config(variant: str, *, rank: int, alpha: float, targets: list[str],
                factor: int = -1) -> Any:
    """peft's config of ``variant`` over the module paths ``targets`` (delta zero at step 0:
    peft zeroes ``hada_w2_b`` / ``lokr_w1``); no Tucker convolutions, as LyCORIS' default."""
    from peft import LoHaConfig, LoKrConfig

    if variant == "loha":
        return LoHaConfig(r=rank, alpha=alpha, target_modules=targets,
                          use_effective_conv2d=False)
    if variant == "lokr":
        return LoKrConfig(r=rank, alpha=alpha, target_modules=targets,
                          decompose_factor=factor, decompose_both=False,
                          use_effective_conv2d=False)
    raise ValueError(f"adapter.variant={variant!r} is not a LyCORIS variant ({VARIANTS})")


def algo_of(layer: nn.Module) -> str | None:
    """"loha" / "lokr" for a peft LoHa / LoKr layer with the default adapter, else None."""
    for algo, names in ALGOS.items():
        for n in names:
            d = getattr(layer, n, None)
            if isinstance(d, nn.ParameterDict) and _ADAPTER in d:
                return algo
    return None


def factors(layer: nn.Module) -> dict[str, nn.Parameter]:
    """The layer's trained factors by their LyCORIS/peft name."""
    algo = algo_of(layer)
    out = {}
    for n in ALGOS[algo] + TUCKER if algo else ():
        d = getattr(layer, n, None)
        if isinstance(d, nn.ParameterDict) and _ADAPTER in d:
            out[n] = d[_ADAPTER]
    return out


def rank_alpha(layer: nn.Module) -> tuple[int, float]:
    return int(layer.r[_ADAPTER]), float(layer.alpha[_ADAPTER])


def _both_full(t: dict[str, Any]) -> bool:
    return "lokr_w1" in t and "lokr_w2" in t


def _first(t: dict[str, Any]) -> str:
    """The factor a scale is folded into (the delta is linear in it)."""
    return next(n for n in ("hada_w1_a", "lokr_w1", "lokr_w1_a") if n in t)


def file_tensors(layer: nn.Module) -> tuple[dict[str, Tensor], float]:
    """The layer's factors as LyCORIS writes them (fp32, CPU) and the alpha to write: a LoKr
    of two full factors has peft's alpha / r folded into ``lokr_w1`` (LyCORIS scales it by
    1) and alpha = r."""
    t = {n: p.detach().to("cpu", torch.float32).contiguous() for n, p in factors(layer).items()}
    r, alpha = rank_alpha(layer)
    if algo_of(layer) == "lokr" and _both_full(t):
        t["lokr_w1"] = t["lokr_w1"] * (alpha / r)
        alpha = float(r)
    return t, alpha


def file_scale(algo: str, t: dict[str, Tensor], alpha: float | None, *,
               peft_rank: int | None = None) -> float:
    """The factor a file's layer is scaled by when applied: LyCORIS' (``peft_rank`` None:
    alpha / r, 1 for a LoKr of two full factors, 1 without alpha, as ComfyUI) or peft's
    (a diffusers file: alpha / its config's r)."""
    if peft_rank is not None:
        return 1.0 if alpha is None else alpha / peft_rank
    if alpha is None:
        return 1.0
    if algo == "loha":
        return alpha / t["hada_w1_b"].shape[0]
    dim = (t["lokr_w2_b"].shape[0] if "lokr_w2_b" in t else
           t["lokr_w1_b"].shape[0] if "lokr_w1_b" in t else None)
    return alpha / dim if dim else 1.0


def check_layer(name: str, algo: str, t: dict[str, Tensor]) -> str | None:
    """Why a file's LoHa/LoKr layer cannot be read (None: it can)."""
    tucker = sorted(set(t) & set(TUCKER))
    if tucker:
        return (f"{name} has {tucker}: a Tucker-decomposed convolution (LyCORIS' use_tucker), "
                "which steadydiff neither trains nor reads")
    if algo == "loha":
        missing = sorted(set(ALGOS["loha"]) - set(t))
    else:
        missing = [w for w in ("lokr_w1", "lokr_w2")
                   if w not in t and not {f"{w}_a", f"{w}_b"} <= set(t)]
    if missing:
        return f"{name} is a {algo_name(algo)} layer without {missing}"
    return None


def algo_name(algo: str) -> str:
    return {"loha": "LoHa", "lokr": "LoKr"}[algo]


def load_into(layer: nn.Module, t: dict[str, Tensor], scale: float, where: str) -> None:
    """Copy a file layer's factors (applied at ``scale``) into a peft LoHa/LoKr layer: the
    same delta at the run's alpha / r (the first factor rescaled where the two differ).

    Raises:
        ValueError: another algorithm, or factors peft's layer does not have or shapes it
            does not take (another rank, ``adapter.factor``, or base model), named.
    """
    own = factors(layer)
    mine, theirs = algo_of(layer), next(a for a, ns in ALGOS.items() if set(t) & set(ns))
    if mine != theirs:
        raise ValueError(f"{where} is a {algo_name(theirs)} layer; this run trains a "
                         f"{algo_name(mine)}: set adapter.variant={theirs}")
    if set(own) != set(t):
        raise ValueError(f"{where} holds {sorted(t)} where this run's layer holds "
                         f"{sorted(own)} (LoKr keeps a factor full or rank-decomposed by "
                         "adapter.rank and splits the layer by adapter.factor: set them to "
                         "the file's)")
    r, alpha = rank_alpha(layer)
    ratio = scale / (alpha / r)
    first = _first(t)
    with torch.no_grad():
        for n, src in t.items():
            dst = own[n]
            if tuple(dst.shape) != tuple(src.shape):
                raise ValueError(f"{where}.{n} has shape {tuple(src.shape)}; the layer takes "
                                 f"{tuple(dst.shape)} (adapter.rank / adapter.factor, or "
                                 "another base model?)")
            v = src.to(torch.float32)
            dst.copy_((v * ratio if n == first and ratio != 1.0 else v).to(dst.dtype))


@torch.no_grad()
def delta_norm(layer: nn.Module) -> Tensor:
    """‖dW‖_F of a LoHa/LoKr layer, 0-dim on the device (a LoKr's without forming dW:
    ‖kron(w1, w2)‖ = ‖w1‖ ‖w2‖)."""
    scale = abs(float(layer.scaling[_ADAPTER]))
    if algo_of(layer) == "lokr":
        f = factors(layer)
        w1 = f["lokr_w1"] if "lokr_w1" in f else f["lokr_w1_a"] @ f["lokr_w1_b"]
        w2 = f["lokr_w2"] if "lokr_w2" in f else f["lokr_w2_a"] @ f["lokr_w2_b"]
        return w1.float().norm() * w2.float().norm() * scale
    return layer.get_delta_weight(_ADAPTER).float().norm()


@torch.no_grad()
def shrink(layer: nn.Module, factor: float) -> None:
    """Scale the layer's delta by ``factor`` (its first factor: the delta is linear in it)."""
    f = factors(layer)
    f[_first(f)].mul_(factor)


def formats_for(variant: str, family: Any, requested: str) -> tuple[str, ...]:
    """The LoRA files a run writes (``adapter.lora_format``: diffusers | kohya | both) for
    ``variant`` on ``family``: LoHa/LoKr files are LyCORIS' (the kohya layout) and diffusers'
    only where its loader reads them (``Family.diffusers_lycoris``).

    Raises:
        ValueError: ``requested`` names only a format that cannot hold the variant.
    """
    want = ("diffusers", "kohya") if requested == "both" else (requested,)
    if variant not in ALGOS or variant in family.diffusers_lycoris:
        return want
    if want == ("diffusers",):
        from .. import families

        able = [f.label for f in families.FAMILIES if variant in f.diffusers_lycoris]
        raise ValueError(f"adapter.variant={variant}: diffusers' {family.label} LoRA loader "
                         f"reads no {algo_name(variant)}"
                         + (f" (it does for {', '.join(able)})" if able else "")
                         + ": set adapter.lora_format=kohya (LyCORIS' file, which A1111, "
                         "ComfyUI and kohya's sd-scripts load) or both")
    return ("kohya",)
