"""Doctor: the weights and EMA of a checkpoint, against a freshly initialised model.

Non-finite tensors; per-layer norm growth and max-abs outliers, judged by a robust z-score
across layers (median/MAD, so one bad layer cannot hide itself by inflating the spread);
distribution drift from initialization (the two-sample Kolmogorov–Smirnov distance between the
layer's weights and the fresh layer's); exploded normalization affine parameters; an EMA that
left the model behind. No forward pass.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..values import module_of
from . import stats
from .causes import Cause

# Robust z across layers, log10 units. MAD floors keep a run whose layers all moved alike
# (MAD ~ 0) from calling a 10% difference a 50-sigma event.
NORM_Z, NORM_GROWTH = 6.0, 1.0          # critical: z >= 6 and 10x beyond the typical layer
NORM_WARN_Z, NORM_WARN_GROWTH = 4.0, math.log10(3.0)
MAD_FLOOR = 0.05                         # log10 units (12%)
PEAK_Z, PEAK_GROWTH = 6.0, 1.0           # max|w|/rms grew 10x beyond its init ratio
KS_MIN, KS_Z, KS_MAD_FLOOR = 0.3, 4.0, 0.05
KS_MIN_NUMEL = 64
EMA_LAYER_REL, EMA_TOTAL_REL = 0.5, 1.0

# the checks this module runs (Diagnosis.checks)
CHECKS = ["nonfinite_weights", "weight_norm_outlier", "weight_maxabs_outlier", "weight_drift",
          "norm_affine_exploded"]
EMA_CHECKS = ["nonfinite_ema", "ema_divergence"]


def check_weights(model_sd: dict[str, torch.Tensor], init_sd: dict[str, torch.Tensor] | None,
                  ema_sd: dict[str, torch.Tensor] | None = None,
                  norm_modules: dict[str, float] | None = None,
                  affine_limit: float = 1e3) -> tuple[list[Cause], dict[str, Any]]:
    """Weight and EMA checks (no forward pass).

    Args:
        model_sd: the trained weights.
        init_sd: the same keys freshly initialised (for growth, max-abs and KS drift); None
            skips those checks.
        ema_sd: the EMA weights (non-finite and divergence checks); None skips them.
        norm_modules: names of the normalization modules (GroupNorm/LayerNorm) -> eps, for
            the affine check; None skips it.
        affine_limit: max |affine| of a normalization layer (``guard.norm_affine_limit``).

    Returns:
        ``(causes, measurements)``: causes unranked; per-layer numbers for ``--json``.
    """
    causes: list[Cause] = []
    meas: dict[str, Any] = {}
    order = list(model_sd)

    # ---- non-finite values: nothing else about such a tensor means anything
    for label, sd, check in (("model", model_sd, "nonfinite_weights"),
                             ("EMA", ema_sd, "nonfinite_ema")):
        if sd is None:
            continue
        bad = {}
        for k, v in sd.items():
            if v.is_floating_point():
                n = int((~torch.isfinite(v)).sum())
                if n:
                    bad[k] = {"nonfinite": n, "numel": v.numel(),
                              "nan": int(torch.isnan(v).sum())}
        if bad:
            mods = list(dict.fromkeys(module_of(k) for k in bad))
            other = ema_sd if sd is model_sd else model_sd
            other_ok = other is not None and not any(
                v.is_floating_point() and not bool(torch.isfinite(v).all())
                for v in other.values())
            first = mods[0]
            rec = (f"do not resume from these weights: resume from an earlier checkpoint (or "
                   f"rerun with the guard on: it rolls back when parameters go non-finite). "
                   f"Look up the incident where {first} first went bad; if it recurs in the "
                   "same layer, lower the peak LR or enable gradient clipping.")
            if other_ok:
                rec += (" The EMA weights are finite: sampling from them still works."
                        if sd is model_sd else
                        " The raw model weights are finite: sample with --raw-weights.")
            causes.append(Cause(
                "critical", check, first,
                f"non-finite values in the {label} weights of {first}"
                + (f" and {len(mods) - 1} more module(s)" if len(mods) > 1 else ""),
                {"tensors": bad, "modules": mods, "other_weights_finite": other_ok},
                rec, score=math.log10(1 + sum(b["nonfinite"] for b in bad.values()))))
    finite = {k: v for k, v in model_sd.items()
              if v.is_floating_point() and bool(torch.isfinite(v).all())}

    # ---- growth, max-abs and drift against a fresh initialisation
    if init_sd is not None:
        mats = [k for k in order if k in finite and finite[k].ndim >= 2 and k in init_sd
                and init_sd[k].shape == finite[k].shape]
        rows = []
        nonzero_init = sorted(x for x in (stats.rms(init_sd[k]) for k in mats) if x > 0)
        typical = stats.median(nonzero_init) if nonzero_init else 1.0
        for k in mats:
            w, w0 = finite[k], init_sd[k]
            rms, rms0 = stats.rms(w), stats.rms(w0)
            zero_init = rms0 == 0.0
            ref = rms0 if not zero_init else typical  # zero-init layers: the typical scale
            amax = float(w.detach().abs().max())
            amax0 = float(w0.detach().abs().max())
            row = {"param": k, "rms": rms, "rms_init": rms0, "max_abs": amax,
                   "growth": math.log10(max(rms, 1e-30) / ref), "zero_init": zero_init}
            row["norm_ratio"] = rms / rms0 if rms0 else None
            if not zero_init and rms > 0:
                row["peak_growth"] = (math.log10(amax / rms) - math.log10(amax0 / rms0))
            if not zero_init and w.numel() >= KS_MIN_NUMEL and float(w0.std()) > 0:
                row["ks"] = stats.ks_distance(w, w0)
            rows.append(row)
        meas["weights"] = rows
        if len(rows) >= 3:
            zs = stats.robust_z([r["growth"] for r in rows], MAD_FLOOR)
            med = stats.median(sorted(r["growth"] for r in rows))
            for r, z in zip(rows, zs):
                r["growth_z"] = z
                excess = r["growth"] - med
                sev = ("critical" if z >= NORM_Z and excess >= NORM_GROWTH else
                       "warning" if z >= NORM_WARN_Z and excess >= NORM_WARN_GROWTH else None)
                if sev is None:
                    continue
                ratio = r["norm_ratio"]
                grown = (f"{stats.ratio_words(ratio)} its initial RMS" if ratio is not None
                         else f"from zero to RMS {r['rms']:.3g}")
                causes.append(Cause(
                    sev, "weight_norm_outlier", module_of(r["param"]),
                    f"{r['param']}: weight norm {grown}, {10 ** excess:.3g}x more growth than "
                    f"the median layer (robust z = {z:.1f})",
                    {"param": r["param"], "rms": r["rms"], "rms_init": r["rms_init"],
                     "norm_ratio_vs_init": ratio, "robust_z": z,
                     "median_layer_growth": 10 ** med, "max_abs": r["max_abs"]},
                    f"{module_of(r['param'])} blew up relative to the rest of the network: "
                    "resume from a checkpoint before it grew (the incidents say when), then "
                    "lower the peak LR or lengthen warmup; keep gradient clipping on "
                    "(optim.grad_clip) and consider weight decay for this layer.",
                    score=z))
            peaks = [r for r in rows if "peak_growth" in r]
            if len(peaks) >= 3:
                zs = stats.robust_z([r["peak_growth"] for r in peaks], MAD_FLOOR)
                for r, z in zip(peaks, zs):
                    if z >= PEAK_Z and r["peak_growth"] >= PEAK_GROWTH:
                        causes.append(Cause(
                            "warning", "weight_maxabs_outlier", module_of(r["param"]),
                            f"{r['param']}: a few weights stand far out (max|w| = "
                            f"{r['max_abs']:.3g}, {10 ** r['peak_growth']:.3g}x the max/RMS "
                            f"ratio at init; robust z = {z:.1f})",
                            {"param": r["param"], "max_abs": r["max_abs"], "rms": r["rms"],
                             "peak_ratio_growth": 10 ** r["peak_growth"], "robust_z": z},
                            "individual weights exploded (a corrupted update or a single "
                            "huge gradient): resume from an earlier checkpoint; keep "
                            "gradient clipping on, consider per_layer or agc clipping.",
                            score=z))
            drifts = [r for r in rows if "ks" in r]
            if len(drifts) >= 3:
                med_ks = stats.median(sorted(r["ks"] for r in drifts))
                zs = stats.robust_z([r["ks"] for r in drifts], KS_MAD_FLOOR)
                for r, z in zip(drifts, zs):
                    if r["ks"] >= KS_MIN and z >= KS_Z:
                        ratio = r["norm_ratio"] or float("nan")
                        shrank = ratio < 0.1
                        direction = ("collapsed toward zero" if shrank else
                                     "grew" if ratio > 10 else "changed shape")
                        rec = ("the layer's weights collapsed toward zero, so it outputs "
                               "little more than its bias (and the normalization after it "
                               "may be eps-dominated): check weight decay "
                               "(optim.weight_decay) and the LR for this layer; resume from "
                               "a checkpoint before the collapse" if shrank else
                               "this layer moved much further from its initialization than "
                               "the others: lower the peak LR or lengthen warmup, or use "
                               "optim.layer_decay; resume from an earlier checkpoint if "
                               "samples degraded")
                        causes.append(Cause(
                            "warning", "weight_drift", module_of(r["param"]),
                            f"{r['param']}: weight distribution {direction} (KS distance "
                            f"to a fresh init {r['ks']:.2f}, median layer {med_ks:.2f}; "
                            f"RMS {stats.ratio_words(ratio)} of init)",
                            {"param": r["param"], "ks_distance": r["ks"],
                             "median_ks_distance": med_ks, "robust_z": z,
                             "norm_ratio_vs_init": ratio},
                            rec, score=r["ks"]))

    # ---- normalization affine parameters
    if norm_modules:
        for m in norm_modules:
            vals = [finite[k] for k in (f"{m}.weight", f"{m}.bias") if k in finite]
            if not vals:
                continue
            amax = max(float(v.abs().max()) for v in vals)
            if amax > affine_limit:
                causes.append(Cause(
                    "critical", "norm_affine_exploded", m,
                    f"{m}: normalization scale/shift reached |{amax:.3g}| (limit "
                    f"{affine_limit:g})",
                    {"module": m, "affine_max": amax, "limit": affine_limit},
                    f"the affine parameters of {m} exploded: lower the peak LR, and keep "
                    "them out of weight decay only if they stay bounded; resume from an "
                    "earlier checkpoint.", score=math.log10(amax / affine_limit)))

    # ---- EMA against the model
    if ema_sd is not None:
        num_sq = den_sq = 0.0
        layer = []
        for k in order:
            if k not in finite or k not in ema_sd or not ema_sd[k].is_floating_point():
                continue
            e = ema_sd[k]
            if not bool(torch.isfinite(e).all()) or e.shape != finite[k].shape:
                continue
            d = float((e.double() - finite[k].double()).norm())
            n = max(float(finite[k].double().norm()), float(e.double().norm()))
            num_sq, den_sq = num_sq + d * d, den_sq + n * n
            if n > 0 and finite[k].numel() >= 16:
                layer.append((k, d / n))
        total = math.sqrt(num_sq / den_sq) if den_sq else 0.0
        meas["ema_relative_distance"] = total
        if total > EMA_TOTAL_REL:
            causes.append(Cause(
                "warning", "ema_divergence", None,
                f"the EMA is far from the model (relative distance {total:.2f})",
                {"relative_distance": total},
                "the raw weights moved away from their average: if EMA samples look right, "
                "the raw weights were damaged recently (resume from an earlier checkpoint); "
                "otherwise the EMA decay may be too slow for the run (train.ema_decay).",
                score=total))
        if len(layer) >= 3:
            zs = stats.robust_z([math.log10(max(r, 1e-12)) for _, r in layer], MAD_FLOOR)
            for (k, r), z in zip(layer, zs):
                if r >= EMA_LAYER_REL and z >= NORM_Z:
                    causes.append(Cause(
                        "warning", "ema_divergence", module_of(k),
                        f"{k}: the EMA and the model differ by {r:.2f} of the weight norm "
                        f"(robust z = {z:.1f} across layers)",
                        {"param": k, "relative_distance": r, "robust_z": z},
                        f"{module_of(k)} changed recently and abruptly (the EMA has not "
                        "followed): look at the incidents around the checkpoint's step; "
                        "sample from the EMA, resume from an earlier checkpoint.", score=z))
    return causes, meas
