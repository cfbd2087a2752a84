"""Post-mortem diagnostics: ``steadydiff doctor RUN_DIR | CHECKPOINT``.

Reads what a run left (checkpoint weights and EMA, metrics, incidents, the config) and names
the likely causes of trouble, ranked, each with its evidence and a concrete recommendation.

Three sources of evidence:

1. **The weights** (model and EMA of the checkpoint) against a freshly initialised model of
   the same config: non-finite tensors; per-layer norm growth and max-abs outliers, judged by
   a robust z-score across layers (median/MAD, so one bad layer cannot hide itself by
   inflating the spread); distribution drift from initialization (the two-sample
   Kolmogorov–Smirnov distance between the layer's weights and the fresh layer's); exploded
   normalization affine parameters; an EMA that left the model behind.
2. **A probe forward pass** on a real batch (the run's dataset; noise when it cannot be built)
   noised at timesteps spread over [0, T): per-layer activation maxima and the fp16 overflow
   margin (65504 / max|activation|); normalization layers whose input variance is at or below
   their eps (they stop normalizing: output std ≈ sqrt(var / (var + eps)), and the layer that
   produced the input is named); attention logit growth and entropy collapse (Dehghani et al.
   2023; the cure is QK-norm). Uses :func:`steadydiff.guard.probes.probe` and ``findings``.
3. **The run's history**: how it ended, every incident grouped by kind with the loss and
   gradient-norm trend before it, and the settings the config linter flags.

Ranking: severity first (critical > warning > info), then the mechanism: non-finite state and
corrupt checkpoints first (nothing else can be trusted), then mechanisms seen in the forward
pass (the proximate cause), then weight statistics (where the weights are odd), then the
history, then the config; within one mechanism the larger deviation first. A weight outlier
inside a module whose forward-pass mechanism is flagged is cited as that mechanism's evidence.

Exit codes (the CLI): 0 healthy or warnings only, 1 at least one critical finding, 2 bad input.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from .guard.provenance import tensors_in
from .report import RunLog, evidence_summary, metric_series, num, read_run

Severity = Literal["critical", "warning", "info"]
SEVERITIES: tuple[Severity, ...] = ("critical", "warning", "info")

FP16_MAX = 65504.0
# Weight statistics (robust z across layers, log10 units). MAD floors keep a run whose layers
# all moved alike (MAD ~ 0) from calling a 10% difference a 50-sigma event.
NORM_Z, NORM_GROWTH = 6.0, 1.0          # critical: z >= 6 and 10x beyond the typical layer
NORM_WARN_Z, NORM_WARN_GROWTH = 4.0, math.log10(3.0)
MAD_FLOOR = 0.05                         # log10 units (12%)
PEAK_Z, PEAK_GROWTH = 6.0, 1.0           # max|w|/rms grew 10x beyond its init ratio
KS_MIN, KS_Z, KS_MAD_FLOOR = 0.3, 4.0, 0.05
KS_MIN_NUMEL, KS_SAMPLE = 64, 20_000
EMA_LAYER_REL, EMA_TOTAL_REL = 0.5, 1.0
ACT_Z, ACT_RATIO = 6.0, 100.0            # activation outlier: z >= 6 and 100x the median
FP16_MARGIN_WARN = 16.0                  # fp16 runs: under 16x headroom warns
EPS_CRITICAL = 0.01                      # median var below 1% of eps: output std < 0.1

# Mechanism order within one severity (see the module docstring).
PRIORITY = {
    "nonfinite_weights": 0, "nonfinite_ema": 0, "checkpoint_corrupt": 0,
    "nonfinite_activation": 1, "attention_logit_growth": 1, "attention_entropy_collapse": 1,
    "norm_eps_dominated": 1, "fp16_overflow": 1, "norm_affine_exploded": 1,
    "data_range": 1,
    "weight_norm_outlier": 2, "weight_maxabs_outlier": 2, "weight_drift": 2,
    "activation_outlier": 2, "ema_divergence": 2,
    "run_aborted": 3, "loss_nonfinite": 3, "loss_diverging": 3, "incidents": 3,
    "grad_scaler": 3, "run_incomplete": 4, "data_skipped": 4,
    "config_lint": 5, "no_checkpoint": 6,
}


@dataclass
class Cause:
    """One likely cause of trouble.

    Attributes:
        severity: ``critical`` (the state is broken or will break training), ``warning``
            (a risk or a recovered problem worth acting on), ``info``.
        check: the mechanism (``nonfinite_weights``, ``attention_logit_growth``, ...; the
            table in docs/doctor.md).
        where: the layer, module or step it concerns (None when run-wide).
        summary: one line, what was found.
        evidence: the numbers behind it (JSON-able).
        recommendation: what to do, concretely.
        score: strength within its severity and mechanism (ranking only).
    """

    severity: Severity
    check: str
    where: str | None
    summary: str
    evidence: dict[str, Any]
    recommendation: str
    score: float = 0.0

    def rank_key(self) -> tuple:
        return (SEVERITIES.index(self.severity), PRIORITY.get(self.check, 9), -self.score)


@dataclass
class Diagnosis:
    """What :func:`diagnose` found, causes ranked most likely first."""

    path: Path
    run_dir: Path | None = None
    checkpoint: Path | None = None
    step: int | None = None
    causes: list[Cause] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)       # checks skipped, and why
    checks: list[str] = field(default_factory=list)      # checks that ran
    measurements: dict[str, Any] = field(default_factory=dict)

    @property
    def status(self) -> Literal["healthy", "warning", "critical"]:
        sev = {c.severity for c in self.causes}
        return "critical" if "critical" in sev else "warning" if "warning" in sev else "healthy"

    @property
    def exit_code(self) -> int:
        """1 with a critical finding, else 0."""
        return 1 if self.status == "critical" else 0

    def counts(self) -> dict[str, int]:
        c = Counter(x.severity for x in self.causes)
        return {s: c.get(s, 0) for s in SEVERITIES}

    def to_dict(self) -> dict[str, Any]:
        """The ``--json`` output (schema in docs/doctor.md)."""
        return _jsonable({
            "path": str(self.path), "run_dir": str(self.run_dir) if self.run_dir else None,
            "checkpoint": str(self.checkpoint) if self.checkpoint else None,
            "step": self.step, "status": self.status, "exit_code": self.exit_code,
            "counts": self.counts(),
            "causes": [{"rank": i + 1, **asdict(c)} for i, c in enumerate(self.causes)],
            "checks": self.checks, "notes": self.notes, "measurements": self.measurements,
        })


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else str(obj)
    if isinstance(obj, torch.Tensor):
        return _jsonable(obj.tolist())
    if isinstance(obj, Path):
        return str(obj)
    return obj


def rank(causes: list[Cause]) -> list[Cause]:
    """Causes sorted most likely first (see the module docstring)."""
    return sorted(causes, key=Cause.rank_key)


# --------------------------------------------------------------------------- small math


def robust_z(values: list[float], floor: float) -> list[float]:
    """(x - median) / max(1.4826·MAD, floor) for each value (the MAD-based z-score)."""
    if not values:
        return []
    s = sorted(values)
    med = _median(s)
    mad = _median(sorted(abs(v - med) for v in values))
    scale = max(1.4826 * mad, floor)
    return [(v - med) / scale for v in values]


def _median(sorted_values: list[float]) -> float:
    n = len(sorted_values)
    if n == 0:
        return float("nan")
    m = n // 2
    return sorted_values[m] if n % 2 else 0.5 * (sorted_values[m - 1] + sorted_values[m])


def ks_distance(a: torch.Tensor, b: torch.Tensor, sample: int = KS_SAMPLE) -> float:
    """Two-sample Kolmogorov–Smirnov statistic sup_x |F_a(x) - F_b(x)| (what
    ``scipy.stats.ks_2samp`` reports), on at most ``sample`` values of each (a fixed,
    evenly strided subsample: deterministic, and plenty for a distance, not a p-value)."""
    a, b = a.detach().flatten().double(), b.detach().flatten().double()
    if a.numel() > sample:
        a = a[torch.linspace(0, a.numel() - 1, sample).long()]
    if b.numel() > sample:
        b = b[torch.linspace(0, b.numel() - 1, sample).long()]
    a, b = a.sort().values, b.sort().values
    grid = torch.cat([a, b])
    fa = torch.searchsorted(a, grid, right=True).double() / a.numel()
    fb = torch.searchsorted(b, grid, right=True).double() / b.numel()
    return float((fa - fb).abs().max())


def _rms(t: torch.Tensor) -> float:
    return float(t.detach().double().pow(2).mean().sqrt()) if t.numel() else 0.0


def _module(param: str) -> str:
    return param.rsplit(".", 1)[0] if "." in param else param


def _ratio_words(r: float) -> str:
    if not math.isfinite(r):
        return f"×{r}"
    return f"×{r:.3g}" if r >= 0.01 else f"×{r:.1e}"


# --------------------------------------------------------------------------- the weights


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
            mods = list(dict.fromkeys(_module(k) for k in bad))
            other = ema_sd if sd is model_sd else model_sd
            other_ok = other is not None and not any(
                v.is_floating_point() and not bool(torch.isfinite(v).all())
                for v in other.values())
            first = mods[0]
            what = ", ".join(f"{k} ({b['nonfinite']} of {b['numel']})" for k, b in
                             list(bad.items())[:4]) + (" ..." if len(bad) > 4 else "")
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
        nonzero_init = sorted(_rms(init_sd[k]) for k in mats if _rms(init_sd[k]) > 0)
        typical = _median(nonzero_init) if nonzero_init else 1.0
        for k in mats:
            w, w0 = finite[k], init_sd[k]
            rms, rms0 = _rms(w), _rms(w0)
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
                row["ks"] = ks_distance(w, w0)
            rows.append(row)
        meas["weights"] = rows
        if len(rows) >= 3:
            zs = robust_z([r["growth"] for r in rows], MAD_FLOOR)
            med = _median(sorted(r["growth"] for r in rows))
            for r, z in zip(rows, zs):
                r["growth_z"] = z
                excess = r["growth"] - med
                sev = ("critical" if z >= NORM_Z and excess >= NORM_GROWTH else
                       "warning" if z >= NORM_WARN_Z and excess >= NORM_WARN_GROWTH else None)
                if sev is None:
                    continue
                ratio = r["norm_ratio"]
                grown = (f"{_ratio_words(ratio)} its initial RMS" if ratio is not None
                         else f"from zero to RMS {r['rms']:.3g}")
                causes.append(Cause(
                    sev, "weight_norm_outlier", _module(r["param"]),
                    f"{r['param']}: weight norm {grown}, {10 ** excess:.3g}x more growth than "
                    f"the median layer (robust z = {z:.1f})",
                    {"param": r["param"], "rms": r["rms"], "rms_init": r["rms_init"],
                     "norm_ratio_vs_init": ratio, "robust_z": z,
                     "median_layer_growth": 10 ** med, "max_abs": r["max_abs"]},
                    f"{_module(r['param'])} blew up relative to the rest of the network: "
                    "resume from a checkpoint before it grew (the incidents say when), then "
                    "lower the peak LR or lengthen warmup; keep gradient clipping on "
                    "(optim.grad_clip) and consider weight decay for this layer.",
                    score=z))
            peaks = [r for r in rows if "peak_growth" in r]
            if len(peaks) >= 3:
                for r, z in zip(peaks, robust_z([r["peak_growth"] for r in peaks], MAD_FLOOR)):
                    if z >= PEAK_Z and r["peak_growth"] >= PEAK_GROWTH:
                        causes.append(Cause(
                            "warning", "weight_maxabs_outlier", _module(r["param"]),
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
                med_ks = _median(sorted(r["ks"] for r in drifts))
                for r, z in zip(drifts, robust_z([r["ks"] for r in drifts], KS_MAD_FLOOR)):
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
                            "warning", "weight_drift", _module(r["param"]),
                            f"{r['param']}: weight distribution {direction} (KS distance "
                            f"to a fresh init {r['ks']:.2f}, median layer {med_ks:.2f}; "
                            f"RMS {_ratio_words(ratio)} of init)",
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
            for (k, r), z in zip(layer, robust_z([math.log10(max(r, 1e-12)) for _, r in layer],
                                                  MAD_FLOOR)):
                if r >= EMA_LAYER_REL and z >= NORM_Z:
                    causes.append(Cause(
                        "warning", "ema_divergence", _module(k),
                        f"{k}: the EMA and the model differ by {r:.2f} of the weight norm "
                        f"(robust z = {z:.1f} across layers)",
                        {"param": k, "relative_distance": r, "robust_z": z},
                        f"{_module(k)} changed recently and abruptly (the EMA has not "
                        "followed): look at the incidents around the checkpoint's step; "
                        "sample from the EMA, resume from an earlier checkpoint.", score=z))
    return causes, meas


# --------------------------------------------------------------------------- the forward probe


def probe_batch(cfg: Any, n: int = 8, *, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor |
                                                                   None, str]:
    """A batch for the probe forward pass: ``n`` images of the run's dataset (evenly spread
    over it), or uniform noise in [-1, 1] when the dataset cannot be built.

    Returns:
        ``(x0, y, source)``: (n, C, H, W) images, labels (or None), and a description.
    """
    try:
        from .data import build_dataset

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
              seed: int = 0) -> dict[str, Any]:
    """One forward pass of ``model`` on ``x0`` noised at timesteps spread over [0, T), with
    the guard's attention/normalization probes and per-module activation hooks.

    Returns:
        ``{"attn", "norm"}`` as :func:`steadydiff.guard.probes.probe` returns them, plus
        ``"act"``: {leaf module: max |output|} in execution order, ``"producer"``: {norm
        module: the module whose output it normalizes} and ``"input_max"``: max |x0|.
    """
    from .diffusion import make_schedule, q_sample
    from .guard import probes

    device = next(model.parameters()).device
    n = x0.shape[0]
    sched = make_schedule(cfg.diffusion)
    t = torch.tensor([round(i * (sched.T - 1) / max(n - 1, 1)) for i in range(n)],
                     device=device)
    alpha, sigma = sched.alpha_sigma(t)
    g = torch.Generator(device=device).manual_seed(seed)
    x0 = x0.to(device)
    noise = torch.randn(x0.shape, generator=g, device=device)
    xt = q_sample(x0.clamp(-1, 1), alpha, sigma, noise)
    if getattr(model, "num_classes", 0):
        y = (y.to(device).clamp(0, model.num_classes) if y is not None else
             torch.full((n,), model.num_classes, device=device, dtype=torch.long))
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
        stats = probes.probe(model, lambda: model(xt, t.float(), y))
    finally:
        for h in handles:
            h.remove()
        model.train(was)
    stats["act"] = act
    stats["producer"] = producer
    stats["input_max"] = float(x0.abs().max())
    return stats


def check_probe(stats: dict[str, Any], cfg: Any, model: nn.Module | None = None,
                init_sd: dict[str, torch.Tensor] | None = None,
                precision: str | None = None) -> list[Cause]:
    """Causes from :func:`run_probe` statistics: non-finite or extreme activations and the
    fp16 overflow margin, eps-dominated normalization, attention logit growth and entropy
    collapse. ``model``/``init_sd`` add the weights behind a finding to its evidence."""
    from .guard import probes

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
        r0 = _rms(w0)
        return _rms(w) / r0 if r0 else None

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
        med = 10 ** _median(sorted(logs))
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
            why = (f"; its q/k projections are {_ratio_words(ev['q_weight_ratio_vs_init'])} / "
                   f"{_ratio_words(ev['k_weight_ratio_vs_init'])} their initial RMS")
        rec = ("enable QK-norm (model.qk_norm=true; it bounds the logits, Dehghani et al. 2023), "
               "and lower the peak LR or lengthen warmup" if not qk_norm else
               "QK-norm is on, so the norm gains themselves grew: lower the peak LR or "
               "lengthen warmup, and consider weight decay on the QK-norm gains")
        sev = "critical" if (logit is None or not math.isfinite(logit) or logit > e["limit"]) \
            else "warning"
        causes.append(Cause(
            sev, "attention_logit_growth", m,
            f"{m}: max attention logit {fmt_num(logit)} (limit {e['limit']:g})"
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
                   f"{_ratio_words(src_ratio)} of their initial RMS: that layer is dying "
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


def fmt_num(v: Any) -> str:
    x = num(v)
    return "?" if x is None else (f"{x:.4g}" if math.isfinite(x) else str(x))


# --------------------------------------------------------------------------- the model


def _fresh_state(cfg: Any) -> dict[str, torch.Tensor]:
    """A freshly initialised model of ``cfg`` (fixed seed; the global RNG is left as found)."""
    from .models import build_model

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        m = build_model(cfg.model, image_size=cfg.data.image_size, channels=cfg.data.channels)
    return {k: v.detach() for k, v in m.state_dict().items()}


def diagnose_model(model: nn.Module, cfg: Any, *, ema_state: dict[str, torch.Tensor] | None = None,
                   batch: tuple[torch.Tensor, torch.Tensor | None] | None = None,
                   probe: bool = True, precision: str | None = None) -> Diagnosis:
    """Weight and probe checks on an in-memory model (what :func:`diagnose` runs on a
    checkpoint).

    Args:
        model: the model to examine (built from ``cfg``; weights as trained).
        cfg: its :class:`~steadydiff.config.Config`.
        ema_state: the EMA weights, for the EMA checks (None skips them).
        batch: ``(x0, y)`` for the probe; default :func:`probe_batch` of ``cfg``.
        probe: run the forward probe.
        precision: the precision the run trains in (default ``cfg.train.precision``).

    Returns:
        A :class:`Diagnosis` (``path`` is ``"<model>"``).
    """
    d = Diagnosis(Path("<model>"))
    _examine(d, model, cfg, ema_state, batch, probe, precision)
    d.causes = _link(rank(d.causes))
    return d


def _examine(d: Diagnosis, model: nn.Module, cfg: Any, ema_sd, batch, probe: bool,
             precision: str | None) -> None:
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    init_sd = _fresh_state(cfg)
    norm_modules = {n: m.eps for n, m in model.named_modules()
                    if isinstance(m, (nn.GroupNorm, nn.LayerNorm))}
    causes, meas = check_weights(sd, init_sd, ema_sd, norm_modules,
                                 affine_limit=cfg.guard.norm_affine_limit)
    d.causes += causes
    d.measurements.update(meas)
    d.checks += ["nonfinite_weights", "weight_norm_outlier", "weight_maxabs_outlier",
                 "weight_drift", "norm_affine_exploded"]
    if ema_sd is not None:
        d.checks += ["nonfinite_ema", "ema_divergence"]
    if not probe:
        d.notes.append("probe forward pass: skipped (--no-probe)")
        return
    if any(c.check == "nonfinite_weights" for c in causes):
        d.notes.append("probe forward pass: skipped, the model weights are non-finite "
                       "(every activation would be NaN)")
        return
    if batch is None:
        x0, y, source = probe_batch(cfg)
    else:
        x0, y = batch
        source = f"{x0.shape[0]} given images"
    try:
        stats = run_probe(model, cfg, x0, y)
    except Exception as e:  # a probe failure is a finding about the tool, not the run
        d.notes.append(f"probe forward pass failed: {type(e).__name__}: {e}")
        return
    d.notes.append(f"probe batch: {source}")
    d.causes += check_probe(stats, cfg, model, init_sd, precision)
    d.checks += ["nonfinite_activation", "fp16_overflow", "activation_outlier",
                 "attention_logit_growth", "attention_entropy_collapse",
                 "norm_eps_dominated", "data_range"]
    d.measurements["probe"] = {
        "activation_max_abs": stats["act"],
        "fp16_margin": {n: (FP16_MAX / a if a > 0 else None) for n, a in stats["act"].items()
                        if math.isfinite(a)},
        "attention": stats["attn"], "norm": stats["norm"], "norm_input_from":
            stats["producer"], "source": source}


def _link(causes: list[Cause]) -> list[Cause]:
    """Cite a weight finding inside a module whose forward-pass mechanism is flagged as that
    mechanism's evidence (it stays in the list, ranked after it)."""
    mech = [c for c in causes if PRIORITY.get(c.check, 9) == 1 and c.where]
    for c in causes:
        if PRIORITY.get(c.check) != 2 or not c.where:
            continue
        for m in mech:
            if c.where == m.where or c.where.startswith(m.where + ".") or \
                    m.evidence.get("input_from") == c.where:
                m.evidence.setdefault("related", []).append(f"{c.check}: {c.summary}")
                c.evidence["explains"] = f"{m.check} in {m.where}"
                break
    return causes


# --------------------------------------------------------------------------- the history


def _trend(ser, step: float, window: int) -> dict[str, Any]:
    """Loss and grad-norm trend over the logged rows in [step - window, step)."""
    rows = [(s, r) for s, r in zip(ser.steps, ser.rows) if step - window <= s < step]
    out: dict[str, Any] = {"rows": len(rows)}
    if len(rows) < 2:
        return out
    third = max(1, len(rows) // 3)
    for key in ("loss", "grad_norm"):
        vals = [num(r.get(key)) for _, r in rows]
        a = [v for v in vals[:third] if v is not None and math.isfinite(v)]
        b = [v for v in vals[-third:] if v is not None and math.isfinite(v)]
        if a and b and sum(a) > 0:
            out[f"{key}_trend"] = (sum(b) / len(b)) / (sum(a) / len(a))
    out["lr"] = num(rows[-1][1].get("lr"))
    out["from_step"], out["to_step"] = rows[0][0], rows[-1][0]
    return out


_SPIKY = {"loss_spike", "grad_spike", "divergence", "nonfinite_loss", "nonfinite_grad",
          "nonfinite_params", "weight_jump", "skip_budget"}


def _incident_recommendation(kind: str, incs: list[dict], trend: dict, log: RunLog) -> str:
    lr, warm = log.cfg("optim.lr"), log.cfg("optim.warmup_steps", 0) or 0
    precision = log.cfg("train.precision")
    first = incs[0]
    e = first.get("evidence") or {}
    prov = e.get("provenance") or {}
    recs = []
    if kind == "bad_batch":
        steps = ", ".join(str(i.get("step")) for i in incs[:5])
        mx = e.get("max_abs_input")
        pos = ", ".join(str((i.get("cost") or {}).get("batch_position")) for i in incs[:5])
        return (f"check the data: the batch at step {steps} had values outside [-1, 1] "
                f"(max |x| = {mx}; data-stream batch position {pos}): look for a corrupt "
                "image, or a transform that yields NaN/Inf or values outside [-1, 1]")
    if kind in ("fp16_overflow",) or first.get("action") == "precision_fallback":
        return "use bf16 instead of fp16 (train.precision=bf16): fp32's range, no scaler"
    if kind == "attention_logit_growth":
        return ("enable QK-norm (model.qk_norm=true)" if not log.cfg("model.qk_norm") else
                "lower the peak LR or lengthen warmup")
    if kind == "attention_entropy_collapse":
        return "enable QK-norm (model.qk_norm=true); attention collapsed onto single keys"
    if kind == "norm_eps_dominated":
        mods = sorted({str((i.get("evidence") or {}).get("module")) for i in incs})
        return (f"raise GroupNorm eps in {', '.join(mods[:3])} (model.*.norm_eps), or check "
                "the layer before it: its output is nearly constant")
    if kind == "norm_affine_exploded":
        return "lower the peak LR; normalization gains/shifts exploded"
    if kind == "out_of_memory":
        return "lower train.batch_size or raise train.grad_accum (the global batch stays)"
    if prov.get("first_overflow_module") and precision == "fp16":
        recs.append(f"the first module to overflow fp16 was {prov['first_overflow_module']}: "
                    "use bf16 instead of fp16")
    mod = prov.get("first_nonfinite_module")
    if mod:
        recs.append(f"the first module to go non-finite was {mod}"
                    + ("; raise GroupNorm eps in " + mod if "norm" in mod.split(".")[-1] else
                       "; enable QK-norm" if ".attn" in mod and not log.cfg("model.qk_norm")
                       else ""))
    elif prov.get("nonfinite_grad_params"):
        recs.append("the first non-finite gradient was in "
                    + ", ".join(map(str, prov["nonfinite_grad_params"][:2])))
    if kind in _SPIKY:
        s0 = num(first.get("step")) or 0
        rising = (trend.get("grad_norm_trend") or 1) > 2 or (trend.get("loss_trend") or 1) > 2
        early = warm == 0 or s0 < 3 * warm
        if rising or early or kind in ("divergence", "loss_spike", "grad_spike"):
            recs.append(f"lower the peak LR (optim.lr={lr}) or lengthen warmup "
                        f"(optim.warmup_steps={warm})"
                        + (": the gradient norm was already rising before it" if
                           (trend.get("grad_norm_trend") or 1) > 2 else ""))
        if kind in ("nonfinite_params", "weight_jump"):
            params = e.get("params") or []
            if params:
                recs.append(f"look at {params[0]}: it went bad first")
    if not recs:
        recs.append("the guard recovered; if it recurs, lower the peak LR or lengthen warmup")
    return "; ".join(recs)


def check_history(log: RunLog, cfg: Any = None) -> list[Cause]:
    """Causes from the run's record: how it ended, incidents grouped by kind with the trend
    before them, the loss at the end, the grad scaler, skipped images, the config linter."""
    causes: list[Cause] = []
    ser = metric_series(log.metrics)
    s = log.summary or {}
    incs = [i for i in log.incidents if isinstance(i, dict)]
    log_every = log.cfg("logging.log_every", 1) or 1
    window = max(10, 10 * int(log_every))

    aborts = [i for i in incs if i.get("action") == "abort"]
    if s.get("status") == "aborted" or aborts:
        last = aborts[-1] if aborts else {}
        why = s.get("reason") or (last.get("diagnosis") or {}).get("why") or last.get("kind")
        before = [i for i in incs if i is not last][-5:]
        trig = Counter(str(i.get("kind")) for i in before)
        kind = (trig.most_common(1)[0][0] if trig else str(last.get("kind")))
        causes.append(Cause(
            "critical", "run_aborted", f"step {s.get('steps', last.get('step'))}",
            f"the run aborted at step {s.get('steps', last.get('step'))}: {why}",
            {"reason": why, "abort_incident": last, "incidents_before": dict(trig)},
            f"the recovery budget ran out on repeated {kind}: "
            + _incident_recommendation(kind, [i for i in incs if i.get("kind") == kind] or
                                       [last], _trend(ser, num(last.get("step")) or 0, window),
                                       log), score=len(incs)))
    elif not s and log.metrics:
        planned = log.planned_steps
        if planned is None or (log.last_step or 0) < planned:
            causes.append(Cause(
                "info", "run_incomplete", None,
                f"no summary.json: the run stopped at step {log.last_step}"
                + (f" of {planned}" if planned else "") + " (killed, or still running)",
                {"last_step": log.last_step, "planned_steps": planned},
                "rerun the same command to resume from the newest intact checkpoint"))

    by_kind: dict[str, list[dict]] = defaultdict(list)
    for i in incs:
        if i.get("action") != "abort":
            by_kind[str(i.get("kind"))].append(i)
    for kind, group in by_kind.items():
        steps = [num(i.get("step")) for i in group]
        acts = Counter(str(i.get("action")) for i in group)
        first_step = steps[0] if steps[0] is not None else 0
        trend = _trend(ser, first_step, window)
        rollbacks = acts.get("rollback", 0)
        serious = kind in _SPIKY or kind in ("bad_batch", "fp16_overflow", "out_of_memory")
        sev: Severity = "warning" if (rollbacks or len(group) >= 3 or acts.get("warn")
                                      or kind in ("nonfinite_params", "nonfinite_loss",
                                                  "nonfinite_grad", "bad_batch",
                                                  "divergence")) else "info"
        t_note = ""
        if "loss_trend" in trend or "grad_norm_trend" in trend:
            t_note = (f"; over the {trend['rows']} logged steps before step "
                      f"{int(first_step)}: loss ×{trend.get('loss_trend', float('nan')):.2g}, "
                      f"grad norm ×{trend.get('grad_norm_trend', float('nan')):.2g}")
        ev0 = group[0].get("evidence") or {}
        prov0 = ev0.get("provenance") or {}
        params0 = ev0.get("params") or prov0.get("nonfinite_grad_params") or []
        where = (ev0.get("module") or prov0.get("first_nonfinite_module")
                 or (_module(str(params0[0])) if params0 else None))
        causes.append(Cause(
            sev, "incidents", where or f"step {int(first_step)}",
            f"{len(group)} × {kind} (steps "
            f"{', '.join(str(int(x)) for x in steps[:6] if x is not None)}"
            f"{' ...' if len(steps) > 6 else ''}; "
            + ", ".join(f"{n} {a}" for a, n in acts.most_common()) + ")" + t_note,
            {"kind": kind, "count": len(group), "steps": steps, "actions": dict(acts),
             "first": evidence_summary(group[0]), "trend_before_first": trend,
             "serious": serious},
            _incident_recommendation(kind, group, trend, log),
            score=len(group) + 10 * rollbacks))

    losses = ser.col("loss")
    if losses and not math.isfinite(losses[-1]):
        causes.append(Cause(
            "critical", "loss_nonfinite", f"step {ser.steps[-1]}",
            f"the loss is {losses[-1]} at the last logged step {ser.steps[-1]}",
            {"step": ser.steps[-1]},
            "the run diverged: turn the guard on (guard.enabled=true) to roll back instead, "
            "and lower the peak LR or lengthen warmup"))
    finite = [v for v in losses if math.isfinite(v)]
    if len(finite) >= 20:
        k = max(3, len(finite) // 10)
        end = sum(finite[-k:]) / k
        best = min(sum(finite[i:i + k]) / k for i in range(0, len(finite) - k + 1))
        if best > 0 and end / best > 2.0:
            causes.append(Cause(
                "warning", "loss_diverging", None,
                f"the loss at the end ({end:.3g}) is {end / best:.2g}x its best ({best:.3g})",
                {"end_loss": end, "best_loss": best, "ratio": end / best},
                "the run is diverging: resume from the best checkpoint and lower the peak LR "
                "or lengthen warmup", score=end / best))
    scales = [v for v in ser.col("grad_scale") if math.isfinite(v)]
    if scales and min(scales) < 1.0:
        causes.append(Cause(
            "warning", "grad_scaler", None,
            f"the fp16 grad-scaler scale fell to {min(scales):.3g} (below 1: gradients "
            "overflow even unscaled)",
            {"min_scale": min(scales), "last_scale": scales[-1]},
            "use bf16 instead of fp16 (train.precision=bf16)"))
    skipped = [num(r.get("data_skipped")) or 0 for r in ser.rows]
    if skipped and max(skipped) > 0:
        causes.append(Cause(
            "info", "data_skipped", None,
            f"{int(max(skipped))} unreadable image(s) were skipped by the data loader",
            {"data_skipped": int(max(skipped))},
            "check the data folder: the trainer logs which files it skipped"))

    if cfg is not None:
        try:
            from .lint import lint
        except ImportError:
            lint = None
        if lint is not None:
            unstable = any(str(i.get("kind")) in _SPIKY or i.get("action") == "abort"
                           for i in incs)
            for msg in lint(cfg):
                m = re.match(r"^([a-z_0-9]+(?:\.[a-z_0-9]+)+)(=\S+)?", msg)
                key = m.group(1) if m else None
                flagged = (m.group(0).rstrip(",:;") if m else msg.split(":", 1)[0])[:80]
                causes.append(Cause(
                    "warning" if unstable else "info", "config_lint", key,
                    f"the config linter flags {flagged}"
                    + (" (the run had instability incidents)" if unstable else ""),
                    {"message": msg}, msg))
    return causes


# --------------------------------------------------------------------------- entry point


def _is_checkpoint(p: Path) -> bool:
    return p.is_dir() and ((p / "manifest.json").is_file() or (p / "model.safetensors").is_file()
                           or re.match(r"^step_\d{8,}$", p.name) is not None)


def _load_config(raw: dict, source: str):
    from .config import validate
    return validate(raw, source=source)


def diagnose(path: str | Path, *, probe: bool = True, device: str = "cpu") -> Diagnosis:
    """Post-mortem of a run directory or a checkpoint directory.

    Args:
        path: a run directory (its newest intact checkpoint is examined, plus the run's
            metrics, incidents and config) or a checkpoint directory (its weights; plus the
            run's history when it sits in a run's ``checkpoints/``).
        probe: run the forward probe (one forward pass on a small batch).
        device: where the probe runs.

    Returns:
        A :class:`Diagnosis`, causes ranked most likely first.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: ``path`` is neither a run directory nor a checkpoint.
    """
    from .trainer import checkpoint as ckpt

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no such run directory or checkpoint: {path}")
    d = Diagnosis(path)
    candidates: list[Path]
    if _is_checkpoint(path):
        candidates = [path]
        parent = path.parent.parent
        if path.parent.name == "checkpoints" and ((parent / "metrics.jsonl").is_file() or
                                                  (parent / "config.yaml").is_file()):
            d.run_dir = parent
    elif path.is_dir() and any((path / n).exists() for n in ("checkpoints", "metrics.jsonl",
                                                             "config.yaml", "incidents.jsonl")):
        d.run_dir = path
        candidates = ckpt.list_checkpoints(path / "checkpoints")
        pointer = path / "checkpoints" / "latest"
        if pointer.is_file():
            named = path / "checkpoints" / pointer.read_text().strip()
            if named in candidates:
                candidates.remove(named)
                candidates.insert(0, named)
    else:
        raise ValueError(f"{path} is neither a run directory (config.yaml, metrics.jsonl, "
                         "checkpoints/) nor a checkpoint directory (manifest.json)")

    # ---- the newest checkpoint that verifies; corrupt ones are findings
    chosen = None
    for c in candidates:
        problems = ckpt.verify_checkpoint(c)
        if not problems:
            chosen = c
            break
        d.causes.append(Cause(
            "critical" if c is candidates[-1] or path == c else "warning",
            "checkpoint_corrupt", c.name, f"checkpoint {c.name} fails verification",
            {"problems": problems},
            "do not load it; resuming skips it automatically (the previous intact checkpoint "
            "is used); delete it once a newer one is written", score=len(problems)))
    d.checks.append("checkpoint_corrupt")

    cfg = None
    log = read_run(d.run_dir) if d.run_dir is not None else None
    if chosen is not None:
        d.checkpoint = chosen
        try:
            from safetensors.torch import load_file

            state = json.loads((chosen / "state.json").read_text())
            cfg = _load_config(state["config"], f"{chosen}/state.json config")
            d.step = int(state.get("step", 0))
            # not ckpt.load_checkpoint: it refuses non-finite weights, which we want to see
            model_sd = load_file(str(chosen / "model.safetensors"), device="cpu")
            ema_sd = load_file(str(chosen / "ema.safetensors"), device="cpu")
        except Exception as e:
            d.causes.append(Cause("critical", "checkpoint_corrupt", chosen.name,
                                  f"checkpoint {chosen.name} cannot be read",
                                  {"error": f"{type(e).__name__}: {e}"},
                                  "use an earlier checkpoint"))
            model_sd = None
        if model_sd is not None and cfg.adapter.kind != "none":
            # an adapter checkpoint: examine base + adapter (the base is loaded and checked)
            from .adapters import AdapterError, build_adapted
            c = ckpt.Checkpoint(chosen, model_sd, ema_sd, None, None, state)
            try:
                adapted = build_adapted(c, cfg, use_ema=False).to(device)
                ema_sd = build_adapted(c, cfg, use_ema=True).state_dict()
                _examine(d, adapted, cfg, ema_sd, None, probe,
                         state.get("precision") or cfg.train.precision)
            except (AdapterError, ckpt.CheckpointError) as e:
                d.causes.append(Cause("critical", "checkpoint_corrupt", chosen.name,
                                      f"the adapter in {chosen.name} cannot be paired with "
                                      "its base weights", {"error": str(e)[:500]},
                                      "point at the base it was trained on (the checkpoint's "
                                      "state.json records its path and sha256)"))
        elif model_sd is not None:
            from .models import build_model

            model = build_model(cfg.model, image_size=cfg.data.image_size,
                                channels=cfg.data.channels)
            try:
                # strict: a mismatch is a finding about the checkpoint, not a crash
                model.load_state_dict(model_sd)
            except RuntimeError as e:
                d.causes.append(Cause("critical", "checkpoint_corrupt", chosen.name,
                                      f"the weights in {chosen.name} do not match the model "
                                      "its config describes", {"error": str(e)[:500]},
                                      "use a checkpoint written by this config"))
            else:
                model.to(device)
                precision = state.get("precision") or cfg.train.precision
                _examine(d, model, cfg, ema_sd, None, probe, precision)
    else:
        d.causes.append(Cause(
            "info", "no_checkpoint", None, "no intact checkpoint to examine",
            {"candidates": [c.name for c in candidates]},
            "weights and probe checks need a checkpoint (train.checkpoint_every); only the "
            "run's history was examined"))
        d.notes.append("weights and probe: skipped (no intact checkpoint)")

    if log is not None:
        d.notes += [f"run files: {p}" for p in log.problems]
        if cfg is None and log.config:
            try:
                cfg = _load_config(log.config, f"{d.run_dir}/config.yaml")
            except Exception as e:
                d.notes.append(f"config.yaml does not validate: {e}")
        d.causes += check_history(log, cfg)
        d.checks += ["run_aborted", "incidents", "loss_nonfinite", "loss_diverging",
                     "grad_scaler", "config_lint"]
        if d.step is None:
            d.step = log.last_step
    d.causes = _link(rank(d.causes))
    return d


# --------------------------------------------------------------------------- output


def format_diagnosis(d: Diagnosis, *, verbose: bool = False) -> str:
    """The human-readable report: verdict, then the causes, most likely first."""
    c = d.counts()
    head = {"critical": "CRITICAL", "warning": "WARNINGS", "healthy": "HEALTHY"}[d.status]
    lines = [f"steadydiff doctor: {d.path}"]
    where = []
    if d.checkpoint:
        where.append(f"checkpoint {d.checkpoint.name}")
    if d.step is not None:
        where.append(f"step {d.step}")
    if d.run_dir:
        where.append(f"run {d.run_dir}")
    if where:
        lines.append("  " + ", ".join(where))
    lines.append(f"verdict: {head} ({c['critical']} critical, {c['warning']} warning(s), "
                 f"{c['info']} info)")
    shown = [x for x in d.causes if verbose or x.severity != "info" or len(d.causes) <= 12]
    for i, x in enumerate(shown, 1):
        lines.append("")
        lines.append(f"{i:>2}. [{x.severity}] {x.check}"
                     + (f" @ {x.where}" if x.where else ""))
        lines.append(f"    {x.summary}")
        rel = x.evidence.get("related") or []
        for r in rel[:3]:
            lines.append(f"    related: {r}")
        if x.evidence.get("explains"):
            lines.append(f"    (see above: {x.evidence['explains']})")
        lines.append(f"    -> {x.recommendation}")
    if len(shown) < len(d.causes):
        lines.append(f"\n({len(d.causes) - len(shown)} info finding(s) hidden; --verbose "
                     "or --json shows them)")
    if not d.causes:
        lines.append("\nno problems found.")
    if d.notes:
        lines.append("")
        lines += [f"note: {n}" for n in d.notes]
    return "\n".join(lines) + "\n"
