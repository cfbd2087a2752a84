"""Doctor: one probe forward pass on a real batch, and what it shows.

The run's data (noise when the dataset cannot be built) noised at levels spread over the
objective's range (ddpm: [0, T)): per-layer activation maxima and the fp16 overflow margin
(65504 / max|activation|); normalization layers whose input variance is at or below their eps
(they stop normalizing: output std ≈ sqrt(var / (var + eps)), and the layer that produced the
input is named);
attention logit growth and entropy collapse (Dehghani et al. 2023; the cure is QK-norm).
Uses the guard's own probes (:func:`steadydiff.guard.probes.probe` and ``findings``).
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import torch
from torch import nn

from ..data import build_dataset
from ..diffusion import make_schedule, q_sample
from ..guard import probes
from ..guard.provenance import FP16_MAX, tensors_in
from ..values import fmt, num
from .causes import Cause, Severity
from .stats import median, ratio_words, rms, robust_z

ACT_Z, ACT_RATIO = 6.0, 100.0            # activation outlier: z >= 6 and 100x the median
FP16_MARGIN_WARN = 16.0                  # fp16 runs: under 16x headroom warns
EPS_CRITICAL = 0.01                      # median var below 1% of eps: output std < 0.1

# the checks this module runs (Diagnosis.checks)
CHECKS = ["nonfinite_activation", "fp16_overflow", "activation_outlier",
          "attention_logit_growth", "attention_entropy_collapse", "norm_eps_dominated",
          "data_range"]


def probe_batch(cfg: Any, n: int = 8, *, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor |
                                                                   None, str]:
    """A batch for the probe forward pass: ``n`` images of the run's dataset (evenly spread
    over it), or uniform noise in [-1, 1] when the dataset cannot be built.

    Returns:
        ``(x0, y, source)``: (n, C, H, W) images, labels (or None), and a description.
    """
    try:
        ds = build_dataset(cfg.data)
        if len(ds) == 0:
            raise ValueError("empty dataset")
        idx = [round(i * (len(ds) - 1) / max(n - 1, 1)) for i in range(min(n, len(ds)))]
        items = [ds[i] for i in idx]
        x = torch.stack([it[0] if isinstance(it, (tuple, list)) else it for it in items])
        y = None
        if isinstance(items[0], (tuple, list)) and len(items[0]) > 1:
            y = torch.as_tensor([int(it[1]) for it in items])
        return x.float(), y, f"{len(idx)} images of {cfg.data.dataset}"
    except Exception as e:
        g = torch.Generator().manual_seed(seed)
        size, c = cfg.data.image_size, cfg.data.channels
        x = torch.rand(n, c, size, size, generator=g) * 2 - 1
        return x, None, f"noise ({type(e).__name__}: {e})"


@torch.no_grad()
def run_probe(model: nn.Module, cfg: Any, x0: torch.Tensor, y: torch.Tensor | None, *,
              seed: int = 0, latent: bool = False) -> dict[str, Any]:
    """One forward pass of ``model`` on ``x0`` noised at levels spread over the objective's
    training range (ddpm: timesteps over [0, T); flow, edm: :meth:`spread`), with
    the guard's attention/normalization probes and per-module activation hooks.

    Returns:
        ``{"attn", "norm"}`` as :func:`steadydiff.guard.probes.probe` returns them, plus
        ``"act"``: {leaf module: max |output|} in execution order, ``"producer"``: {norm
        module: the module whose output it normalizes} and ``"input_max"``: max |x0|.
    """
    device = next(model.parameters()).device
    n = x0.shape[0]
    sched = make_schedule(cfg.diffusion, cfg.data.image_size)
    lv = sched.spread(n).to(device)  # ddpm: timesteps over [0, T); flow, edm: σ over training's
    alpha, sigma = sched.alpha_sigma(lv)
    g = torch.Generator(device=device).manual_seed(seed)
    x0 = x0.to(device)
    noise = torch.randn(x0.shape, generator=g, device=device)
    # the network's input and time as the objective trains it (edm: c_in·x at T·¼ln σ)
    # latents (a latent-space run: integrations/sd/probe.py) are not bounded to [-1, 1]
    xt = sched.model_input(q_sample(x0 if latent else x0.clamp(-1, 1), alpha, sigma, noise),
                           lv)
    t = sched.model_time(lv)
    if getattr(model, "num_classes", 0):
        y = (y.to(device).clamp(0, model.num_classes) if y is not None else
             torch.full((n,), model.num_classes, device=device, dtype=torch.long))
    elif y is not None and y.is_floating_point():  # a text condition (N, L, D)
        y = y.to(device)
    else:
        y = None

    names = {m: k for k, m in model.named_modules()}
    leaves = {m for m in model.modules() if next(m.children(), None) is None}
    norms = (nn.GroupNorm, nn.LayerNorm)
    act: dict[str, float] = {}
    producer_of: dict[int, str] = {}
    keep: list[torch.Tensor] = []  # outputs kept alive so no address is reused in the pass
    producer: dict[str, str] = {}

    def fwd(m, _inp, out):
        name = names.get(m, "?")
        ts = [o for o in tensors_in(out) if o.is_floating_point()]
        for o in ts:
            producer_of.setdefault(o.data_ptr(), name)  # inner modules fire first
            keep.append(o)
        if m in leaves and ts and name:
            act[name] = max(float(o.detach().abs().amax()) if o.numel() else 0.0 for o in ts)

    def pre(m, inp):
        if inp and isinstance(inp[0], torch.Tensor):
            src = producer_of.get(inp[0].data_ptr())
            if src:
                producer[names.get(m, "?")] = src

    handles = [m.register_forward_hook(fwd) for m in model.modules() if m is not model]
    handles += [m.register_forward_pre_hook(pre) for m in model.modules()
                if isinstance(m, norms)]
    was = model.training
    model.eval()
    try:
        stats = probes.probe(model, lambda: model(xt, t, y))
    finally:
        for h in handles:
            h.remove()
        model.train(was)
    stats["act"] = act
    stats["producer"] = producer
    if not latent:  # the [-1, 1] range check is for pixels (latents are unbounded)
        stats["input_max"] = float(x0.abs().max())
    return stats


def check_probe(stats: dict[str, Any], cfg: Any, model: nn.Module | None = None,
                init_sd: dict[str, torch.Tensor] | None = None,
                precision: str | None = None) -> list[Cause]:
    """Causes from :func:`run_probe` statistics: non-finite or extreme activations and the
    fp16 overflow margin, eps-dominated normalization, attention logit growth and entropy
    collapse. ``model``/``init_sd`` add the weights behind a finding to its evidence."""
    g = cfg.guard
    precision = precision or cfg.train.precision
    causes: list[Cause] = []
    sd = {k: v for k, v in model.state_dict().items()} if model is not None else {}

    def ratio_vs_init(param: str, rows: slice | None = None) -> float | None:
        if param not in sd or init_sd is None or param not in init_sd:
            return None
        w, w0 = sd[param], init_sd[param]
        if rows is not None:
            w, w0 = w[rows], w0[rows]
        r0 = rms(w0)
        return rms(w) / r0 if r0 else None

    # ---- activations: non-finite, fp16 margin, outliers (execution order)
    act = stats.get("act", {})
    names = list(act)
    nonfinite = [n for n in names if not math.isfinite(act[n])]
    if nonfinite:
        causes.append(Cause(
            "critical", "nonfinite_activation", nonfinite[0],
            f"the forward pass goes non-finite first in {nonfinite[0]} "
            f"({len(nonfinite)} module(s) non-finite in all)",
            {"first_module": nonfinite[0], "modules": nonfinite[:10]},
            f"{nonfinite[0]} produces NaN/Inf from finite weights and a clean batch: look at "
            "its weights and the normalization before it; use fp32/bf16 for this model "
            "until it is fixed.", score=len(nonfinite)))
    fin = [(n, act[n]) for n in names if math.isfinite(act[n])]
    over = [(n, a) for n, a in fin if a > FP16_MAX]
    if over:
        n0, a0 = over[0]
        sev: Severity = "critical" if precision == "fp16" else "warning"
        causes.append(Cause(
            sev, "fp16_overflow", n0,
            f"{n0}: max |activation| {a0:.3g} exceeds the fp16 range (65504)"
            + (f"; {len(over)} module(s) in all" if len(over) > 1 else ""),
            {"module": n0, "max_abs": a0, "fp16_max": FP16_MAX, "precision": precision,
             "modules": [{"module": n, "max_abs": a} for n, a in over[:10]]},
            "use bf16 instead of fp16 (train.precision=bf16): same speed on recent GPUs, "
            "fp32's range" if precision == "fp16" else
            "this model cannot run in fp16 as it is: keep bf16/fp32 (do not switch to "
            "fp16), and look at why these activations are so large", score=math.log10(a0)))
    elif precision == "fp16" and fin:
        n0, a0 = max(fin, key=lambda x: x[1])
        if a0 > 0 and FP16_MAX / a0 < FP16_MARGIN_WARN:
            causes.append(Cause(
                "warning", "fp16_overflow", n0,
                f"{n0}: fp16 headroom only {FP16_MAX / a0:.3g}x (max |activation| {a0:.3g})",
                {"module": n0, "max_abs": a0, "margin": FP16_MAX / a0},
                "use bf16 instead of fp16 (train.precision=bf16) before this layer "
                "overflows", score=FP16_MAX / a0))
    pos = [(n, a) for n, a in fin if a > 0]
    if len(pos) >= 5:
        logs = [math.log10(a) for _, a in pos]
        med = 10 ** median(sorted(logs))
        for (n, a), z in zip(pos, robust_z(logs, 0.25)):
            if z >= ACT_Z and a >= ACT_RATIO * med:
                causes.append(Cause(
                    "warning", "activation_outlier", n,
                    f"{n}: max |activation| {a:.3g}, {a / med:.3g}x the median layer "
                    f"(robust z = {z:.1f}); fp16 margin {FP16_MAX / a:.3g}x",
                    {"module": n, "max_abs": a, "median_max_abs": med, "robust_z": z,
                     "fp16_margin": FP16_MAX / a,
                     "weight_ratio_vs_init": ratio_vs_init(f"{n}.weight")},
                    f"{n} saturates: its outputs are orders of magnitude larger than the "
                    "rest of the network's; look at its weights (weight findings above) "
                    "and the normalization feeding it; keep it out of fp16.", score=z))

    # ---- the guard's probe findings (attention, normalization); affine comes from weights
    found = probes.findings(stats, logit_limit=g.attn_logit_limit,
                            entropy_min=g.attn_entropy_min, var_ratio=g.norm_var_ratio,
                            affine_limit=float("inf"))
    by = defaultdict(list)
    for f in found:
        by[f.kind].append(f)
    qk_norm = bool(cfg.model.qk_norm)
    collapsed = {f.evidence["module"]: f.evidence for f in by["attention_entropy_collapse"]}
    attn = stats.get("attn", {})
    for f in by["attention_logit_growth"]:
        m, e = f.evidence["module"], f.evidence
        logit = num(e["max_logit"])
        ev: dict[str, Any] = {"module": m, "max_logit": logit, "limit": e["limit"],
                              "entropy": attn.get(m, {}).get("entropy")}
        qkv = f"{m}.qkv.weight"
        if qkv in sd:
            d = sd[qkv].shape[0] // 3
            ev["q_weight_ratio_vs_init"] = ratio_vs_init(qkv, slice(0, d))
            ev["k_weight_ratio_vs_init"] = ratio_vs_init(qkv, slice(d, 2 * d))
        if m in collapsed:
            ev["entropy_collapsed"] = True
            ev["entropy_min"] = collapsed.pop(m)["min"]
        why = ""
        if ev.get("q_weight_ratio_vs_init") and ev.get("k_weight_ratio_vs_init"):
            why = (f"; its q/k projections are {ratio_words(ev['q_weight_ratio_vs_init'])} / "
                   f"{ratio_words(ev['k_weight_ratio_vs_init'])} their initial RMS")
        rec = ("enable QK-norm (model.qk_norm=true; it bounds the logits, Dehghani et al. 2023), "
               "and lower the peak LR or lengthen warmup" if not qk_norm else
               "QK-norm is on, so the norm gains themselves grew: lower the peak LR or "
               "lengthen warmup, and consider weight decay on the QK-norm gains")
        sev = "critical" if (logit is None or not math.isfinite(logit) or logit > e["limit"]) \
            else "warning"
        causes.append(Cause(
            sev, "attention_logit_growth", m,
            f"{m}: max attention logit {fmt(logit) or '?'} (limit {e['limit']:g})"
            + (", attention entropy collapsed" if ev.get("entropy_collapsed") else "") + why,
            ev, rec, score=math.log10(max(logit or 1e30, 1e-9) / e["limit"])
            if logit is not None and math.isfinite(logit) else 99.0))
    for m, e in collapsed.items():
        causes.append(Cause(
            "critical", "attention_entropy_collapse", m,
            f"{m}: attention entropy {e['entropy']:.3g} nats (min {e['min']:g}): each query "
            "attends to a single key",
            {"module": m, "entropy": e["entropy"], "min": e["min"],
             "max_logit": attn.get(m, {}).get("max_logit")},
            "enable QK-norm (model.qk_norm=true)" if not qk_norm else
            "lower the peak LR or lengthen warmup", score=-e["entropy"]))
    # Attention logits past half the limit: the trend to act on before the guard fires.
    for m, s in attn.items():
        lg = s.get("max_logit") if s else None
        if lg is not None and math.isfinite(lg) and g.attn_logit_limit / 2 < lg <= \
                g.attn_logit_limit:
            causes.append(Cause(
                "warning", "attention_logit_growth", m,
                f"{m}: max attention logit {lg:.3g}, past half the limit "
                f"{g.attn_logit_limit:g}",
                {"module": m, "max_logit": lg, "limit": g.attn_logit_limit},
                "enable QK-norm (model.qk_norm=true) before the logits grow further"
                if not qk_norm else "lower the peak LR", score=lg / g.attn_logit_limit))

    producer = stats.get("producer", {})
    eps_key = "model.unet.norm_eps" if cfg.model.kind == "unet" else "model.dit.norm_eps"
    for f in by["norm_eps_dominated"]:
        m, e = f.evidence["module"], f.evidence
        var, eps = float(e["median_input_var"]), float(e["eps"])
        ratio = var / eps if eps else 0.0
        out_std = math.sqrt(var / (var + eps)) if var + eps > 0 else 0.0
        src = producer.get(m)
        ev = {"module": m, "median_input_var": var, "min_input_var":
              stats["norm"].get(m, {}).get("min_var"), "eps": eps, "var_over_eps": ratio,
              "output_std": out_std, "input_from": src}
        src_ratio = ratio_vs_init(f"{src}.weight") if src else None
        if src_ratio is not None:
            ev["input_weight_ratio_vs_init"] = src_ratio
        sev = "critical" if ratio < EPS_CRITICAL else "warning"
        kind = "GroupNorm" if ".norm" in m and cfg.model.kind == "unet" else "normalization"
        if src_ratio is not None and src_ratio < 0.1:
            rec = (f"the input of {m} comes from {src}, whose weights shrank to "
                   f"{ratio_words(src_ratio)} of their initial RMS: that layer is dying "
                   "(check weight decay and the LR on it; resume from a checkpoint before the "
                   f"collapse). Raising {kind} eps in {m} ({eps_key}={eps:g}) would only hide "
                   "it.")
        else:
            rec = (f"raise {kind} eps in {m} (now {eps:g}; {eps_key} sets it for every layer) "
                   f"or check the preceding layer{(' ' + src) if src else ''}: its output is "
                   "nearly constant")
        causes.append(Cause(
            sev, "norm_eps_dominated", m,
            f"{m}: input variance {var:.3g} is {ratio:.2g}x its eps {eps:g}: the layer no "
            f"longer normalizes (output std ≈ {out_std:.2g} instead of 1)"
            + (f"; input from {src}" if src else ""),
            ev, rec, score=-math.log10(max(ratio, 1e-30))))
    if stats.get("input_max", 0) > 1.0 + 1e-3:
        causes.append(Cause(
            "warning", "data_range", None,
            f"the probe batch from the run's data has values up to |{stats['input_max']:.3g}|,"
            " outside [-1, 1]",
            {"max_abs_input": stats["input_max"]},
            "check the data: images should be scaled to [-1, 1] (a missing normalization, "
            "or a float image saved in [0, 255])", score=stats["input_max"]))
    return causes
