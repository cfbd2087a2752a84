"""The report's figures: matplotlib (object-oriented API, Agg canvas) to PNG data URIs.

Every timeline figure has the same width and fixed margins, so its x axis (the step) lines up
with the others down the page; every incident is a dashed vertical line in its action's
colour. A function returns None when there is nothing to draw (the page says so instead).

To add a plot: a function here taking the :class:`RunLog` (and the :class:`MetricSeries`
and x limits for a timeline), and one line in html.py's :func:`render`.
"""

from __future__ import annotations

import base64
import io
import math
from typing import Any

import numpy as np

from ..values import finite, fmt, module_of, num
from .read import MetricSeries, RunLog

# Colours per guard action (the incident markers, the legend and the page's badges).
ACTION_COLORS = {
    "skip": "#e69f00", "rollback": "#d62728", "attention_upcast": "#c5b0d5",
    "precision_fallback": "#9467bd", "drop_samples": "#f7b6d2", "quarantine": "#e377c2",
    "rerun": "#aec7e8",
    "microbatch_backoff": "#8c564b", "warn": "#7f7f7f", "abort": "#000000",
}
OTHER_ACTION_COLOR = "#17becf"
MAX_HEATMAP_ROWS = 80         # above this many modules the heat map groups them by block


def action_color(action: Any) -> str:
    return ACTION_COLORS.get(str(action), OTHER_ACTION_COLOR)


def _mpl():
    """matplotlib, imported on first use. Deliberately deferred: it costs about 1.5 s, and
    this module is imported with steadydiff.report by the trainer and the CLI, which draw
    only when a report is written (docs/report.md)."""
    import matplotlib
    import matplotlib.backends.backend_agg  # noqa: F401  (FigureCanvasAgg)
    import matplotlib.figure  # noqa: F401
    import matplotlib.ticker  # noqa: F401
    return matplotlib


FIG_WIDTH = 11.0                  # inches, at 80 dpi: 880 px, the page's figure width
AXES_LEFT, AXES_RIGHT = 0.85, 2.0  # inches of margin: every timeline plot shares its x axis
                                   # position, so steps line up down the page


def _figure(height: float, *, left: float = AXES_LEFT, right: float = AXES_RIGHT,
            hspace: float = 0.45):
    """A figure with fixed margins (in inches). The object-oriented API with the Agg canvas:
    no pyplot global state, no backend switch in the caller's process (a notebook keeps its
    inline backend); fixed margins instead of a layout engine (one draw, not several)."""
    mpl = _mpl()
    fig = mpl.figure.Figure(figsize=(FIG_WIDTH, height), dpi=80)
    mpl.backends.backend_agg.FigureCanvasAgg(fig)
    fig.subplots_adjust(left=left / FIG_WIDTH, right=1 - right / FIG_WIDTH,
                        top=1 - 0.32 / height, bottom=0.5 / height, hspace=hspace)
    return fig


def _png(fig) -> str:
    """The figure as a base64 PNG data URI (no metadata: the PNG carries no URL)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": None})
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _smooth(y: list[float], span: float) -> list[float]:
    """Bias-corrected exponential moving average over the finite values (TensorBoard style)."""
    a = 1.0 - 1.0 / max(span, 1.0)
    out, m, w = [], 0.0, 0.0
    for v in y:
        if math.isfinite(v):
            m, w = a * m + (1 - a) * v, a * w + (1 - a)
        out.append(m / w if w else float("nan"))
    return out


def _mark_incidents(ax, incidents: list[dict[str, Any]]) -> None:
    for inc in incidents:
        s = num(inc.get("step"))
        if s is None:
            continue
        a = str(inc.get("action"))
        ax.axvline(s, color=action_color(a), lw=0.9,
                   ls=":" if a == "warn" else "--", alpha=0.8, zorder=1)


def _positive(v: list[float]) -> list[float]:
    return [x for x in v if math.isfinite(x) and x > 0]


def _logscale_if_wide(ax, values: list[float], ratio: float = 30.0) -> None:
    pos = _positive(values)
    if pos and max(pos) / min(pos) > ratio:
        ax.set_yscale("log")


def _nonfinite_marks(ax, steps: list[int], values: list[float], label: str) -> None:
    bad = [s for s, v in zip(steps, values) if not math.isfinite(v)]
    if bad:
        ax.plot(bad, [1.0] * len(bad), "x", color="#d62728", ms=7, clip_on=False,
                transform=ax.get_xaxis_transform(), label=f"{label} non-finite")


def plot_timeline(log: RunLog, xlim: tuple[float, float]) -> str | None:
    incs = [i for i in log.incidents if num(i.get("step")) is not None]
    if not incs:
        return None
    kinds = list(dict.fromkeys(str(i.get("kind")) for i in incs))
    fig = _figure(1.0 + 0.3 * max(len(kinds), 2))
    ax = fig.add_subplot()
    seen = set()
    for inc in incs:
        a = str(inc.get("action"))
        y = kinds.index(str(inc.get("kind")))
        ax.scatter([num(inc["step"])], [y], s=60, color=action_color(a),
                   marker="X" if a in ("abort", "rollback") else "o", zorder=3,
                   edgecolor="white", linewidth=0.5, label=a if a not in seen else None)
        seen.add(a)
    # kind names inside the axes (not as tick labels), so the x axis lines up with the
    # plots below whatever the names' length
    ax.set_yticks(range(len(kinds)), [""] * len(kinds))
    for y, k in enumerate(kinds):
        ax.text(0.004, y + 0.28, k, transform=ax.get_yaxis_transform(), fontsize=8,
                va="center", color="#333333")
    ax.set_ylim(-0.6, len(kinds) - 0.3)
    ax.set_xlim(*xlim)
    ax.set_xlabel("step")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, title="action",
              title_fontsize=8, frameon=False)
    ax.set_title("incidents (colour = the guard's action)", fontsize=10, loc="left")
    return _png(fig)


def plot_loss(log: RunLog, ser: MetricSeries, xlim) -> str | None:
    if not ser.rows:
        return None
    loss = ser.col("loss")
    has_t = any(isinstance(r.get("loss_t"), list) for r in ser.rows)
    fig = _figure(5.6 if has_t else 3.0)
    ax = fig.add_subplot(2 if has_t else 1, 1, 1)
    ax.plot(ser.steps, loss, color="#1f77b4", alpha=0.35, lw=0.9, label="loss (raw)")
    ax.plot(ser.steps, _smooth(loss, max(1.0, len(loss) / 25)), color="#1f77b4", lw=2,
            label="loss (smoothed)")
    if ser.discarded:
        ax.plot([r["step"] for r in ser.discarded],
                [v if (v := num(r.get("loss"))) is not None else float("nan")
                 for r in ser.discarded], ".", color="#999999", ms=5,
                label="discarded by a rollback")
    _nonfinite_marks(ax, ser.steps, loss, "loss")
    _logscale_if_wide(ax, loss)
    _mark_incidents(ax, log.incidents)
    ax.set_xlim(*xlim)
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    ax.set_title("training loss (dashed lines: incidents)", fontsize=10, loc="left")
    if has_t:
        ax2 = fig.add_subplot(2, 1, 2, sharex=ax)
        nb = max(len(r["loss_t"]) for r in ser.rows if isinstance(r.get("loss_t"), list))
        cmap = _mpl().colormaps["viridis"]
        allv: list[float] = []
        for b in range(nb):
            xs, ys = [], []
            for s, r in zip(ser.steps, ser.rows):
                lt = r.get("loss_t")
                v = num(lt[b]) if isinstance(lt, list) and b < len(lt) else None
                if v is not None:
                    xs.append(s)
                    ys.append(v)
            if xs:
                allv += ys
                ax2.plot(xs, _smooth(ys, max(1.0, len(ys) / 25)), color=cmap(b / max(nb - 1, 1)),
                         lw=1.3, label=f"t ∈ [{b / nb:.1f}, {(b + 1) / nb:.1f})·T")
        _logscale_if_wide(ax2, allv)
        _mark_incidents(ax2, log.incidents)
        ax2.set_ylabel("loss per t-bucket")
        ax2.set_xlabel("step")
        ax2.grid(alpha=0.3)
        ax2.legend(fontsize=7, ncol=1, loc="upper left", bbox_to_anchor=(1.01, 1.0),
                   frameon=False)
        ax2.set_title("loss per timestep bucket (smoothed)", fontsize=10, loc="left")
    else:
        ax.set_xlabel("step")
    return _png(fig)


def plot_grad(log: RunLog, ser: MetricSeries, xlim) -> str | None:
    g = ser.col("grad_norm")
    if not any(math.isfinite(v) for v in g) and not any(not math.isfinite(v) for v in g):
        return None
    fig = _figure(3.0)
    ax = fig.add_subplot()
    ax.plot(ser.steps, g, color="#ff7f0e", lw=1.2, label="before clipping")
    gc = ser.col("grad_norm_clipped")
    if any(math.isfinite(v) for v in gc):
        ax.plot(ser.steps, gc, color="#2ca02c", lw=1.2, label="after clipping")
    clip = num(log.cfg("optim.grad_clip"))
    mode = log.cfg("optim.clip_mode", "global")
    if clip and mode in ("global", "zclip", None):
        ax.axhline(clip, color="#d62728", lw=1, ls="-.",
                   label=f"optim.grad_clip = {fmt(clip)}" + (" (zclip fallback)"
                                                             if mode == "zclip" else ""))
    _nonfinite_marks(ax, ser.steps, g, "grad norm")
    _logscale_if_wide(ax, g + ([clip] if clip else []))
    _mark_incidents(ax, log.incidents)
    ax.set_xlim(*xlim)
    ax.set_xlabel("step")
    ax.set_ylabel("global grad norm")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    title = "gradient norm" + (f" (clip mode {mode})" if mode else "")
    ax.set_title(title, fontsize=10, loc="left")
    return _png(fig)


def plot_lr(log: RunLog, ser: MetricSeries, xlim) -> str | None:
    lr = ser.col("lr")
    if not any(math.isfinite(v) for v in lr):
        return None
    fig = _figure(2.6)
    ax = fig.add_subplot()
    ax.plot(ser.steps, lr, color="#9467bd", lw=1.5, label="lr (schedule)")
    ax.set_ylabel("learning rate")
    # the exponent in every label: matplotlib's offset text would sit on the title
    ax.yaxis.set_major_formatter(
        _mpl().ticker.FuncFormatter(lambda v, _: f"{v:.1e}" if v else "0"))
    ax.tick_params(axis="y", labelsize=8)
    fac = ser.col("lr_factor")
    backoff = any(math.isfinite(v) and v != 1.0 for v in fac)
    if backoff:
        ax2 = ax.twinx()
        ax2.plot(ser.steps, fac, color="#8c564b", lw=1, ls="--", label="lr_factor")
        ax.plot(ser.steps, [a * f for a, f in zip(lr, fac)], color="#9467bd", lw=1, ls=":",
                label="lr × lr_factor")  # what the optimizer applied
        ax2.set_ylabel("lr_factor")
        ax2.set_ylim(0, 1.05)
    handles, labels = ax.get_legend_handles_labels()
    if backoff:
        h2, l2 = ax2.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
    _mark_incidents(ax, log.incidents)
    ax.set_xlim(*xlim)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.legend(handles, labels, fontsize=7, loc="upper left",
              bbox_to_anchor=(1.1 if backoff else 1.01, 1.0), frameon=False)
    ax.set_title("learning-rate schedule (lr_factor: the guard's backoff after a rollback)",
                 fontsize=10, loc="left")
    return _png(fig)


def plot_eval(log: RunLog, xlim) -> str | None:
    """eval.jsonl: the Fréchet distance (left axis) and precision/recall (right axis)."""
    rows = [r for r in log.evals if isinstance(r.get("step"), int)]
    if not rows:
        return None
    steps = [r["step"] for r in rows]
    fig = _figure(2.6)
    ax = fig.add_subplot()
    fd = [v if finite(v := r.get("fd")) else float("nan") for r in rows]
    ax.plot(steps, fd, color="#1f77b4", marker="o", lw=1.5, label=rows[-1].get("metric", "FD"))
    ax.set_ylabel("Fréchet distance")
    ax2 = ax.twinx()
    for key, color in (("precision", "#2ca02c"), ("recall", "#d62728")):
        ax2.plot(steps, [v if finite(v := r.get(key)) else float("nan") for r in rows],
                 color=color, marker=".", lw=1, ls="--", label=key)
    ax2.set_ylim(0, 1.05)
    best = [r for r in rows if r.get("improved")]
    if best:
        ax.axvline(best[-1]["step"], color="gray", ls=":", lw=1)
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=7, loc="upper left", bbox_to_anchor=(1.1, 1.0),
              frameon=False)
    ax.set_xlim(*xlim)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.set_title("evaluation (eval.jsonl; dotted: the best checkpoint)", fontsize=10, loc="left")
    return _png(fig)


def plot_scale(log: RunLog, ser: MetricSeries, xlim) -> str | None:
    sc = ser.col("grad_scale")
    if not any(math.isfinite(v) for v in sc):
        return None
    fig = _figure(2.4)
    ax = fig.add_subplot()
    ax.plot(ser.steps, sc, color="#17becf", lw=1.5, drawstyle="steps-post")
    if _positive(sc):
        ax.set_yscale("log", base=2)
    _mark_incidents(ax, log.incidents)
    ax.set_xlim(*xlim)
    ax.set_xlabel("step")
    ax.set_ylabel("scale")
    ax.grid(alpha=0.3)
    ax.set_title("fp16 grad-scaler scale (drops = overflowing steps)", fontsize=10, loc="left")
    return _png(fig)


def _block_of(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:3]) if len(parts) > 3 else module


def plot_heatmap(log: RunLog, xlim) -> tuple[str | None, str]:
    rows = [r for r in log.layers if isinstance(r.get("grad_norm"), dict)
            and isinstance(r.get("step"), int)]
    if not rows:
        why = ("no layers.jsonl" if not log.paths.layers.is_file()
               else "layers.jsonl has no gradient norms")
        return None, why
    rows.sort(key=lambda r: r["step"])
    order: dict[str, None] = {}
    for r in rows:
        for p in r["grad_norm"]:
            order.setdefault(module_of(p), None)
    modules = list(order)
    group = _block_of if len(modules) > MAX_HEATMAP_ROWS else (lambda m: m)
    keys = list(dict.fromkeys(group(m) for m in modules))
    index = {k: i for i, k in enumerate(keys)}
    sq = np.zeros((len(keys), len(rows)))
    bad = np.zeros((len(keys), len(rows)), dtype=bool)
    for j, r in enumerate(rows):
        for p, v in r["grad_norm"].items():
            x = num(v)
            i = index[group(module_of(p))]
            if x is None or not math.isfinite(x):
                bad[i, j] = True
            else:
                sq[i, j] += x * x  # a module's norm: sqrt of the sum over its parameters
    val = np.sqrt(sq)
    with np.errstate(divide="ignore"):
        lv = np.where(val > 0, np.log10(np.where(val > 0, val, 1.0)), np.nan)
    lv = np.ma.masked_invalid(lv)
    height = min(1.0 + 0.13 * len(keys), 14.0)
    fig = _figure(height, left=0.06 * max(map(len, keys)) + 0.2, right=1.2)
    ax = fig.add_subplot()
    cmap = _mpl().colormaps["magma"].with_extremes(bad="#dddddd")
    steps = [r["step"] for r in rows]
    # cell edges halfway between logged steps, so uneven intervals are drawn to scale
    edges = [steps[0] - 0.5] + [(a + b) / 2 for a, b in zip(steps, steps[1:])] + \
            [steps[-1] + 0.5] if len(steps) > 1 else [steps[0] - 0.5, steps[0] + 0.5]
    mesh = ax.pcolormesh(edges, np.arange(len(keys) + 1), lv, cmap=cmap, shading="flat")
    if bad.any():
        ii, jj = np.nonzero(bad)
        ax.scatter([steps[j] for j in jj], [i + 0.5 for i in ii], marker="x", color="#00e5ff",
                   s=25, label="non-finite")
        ax.legend(fontsize=8, loc="lower left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    ax.set_yticks(np.arange(len(keys)) + 0.5, keys, fontsize=6 if len(keys) > 30 else 8)
    ax.invert_yaxis()
    lo, hi = xlim
    ax.set_xlim(min(lo, edges[0]), max(hi, edges[-1]))
    _mark_incidents(ax, log.incidents)
    ax.set_xlabel("step")
    cb = fig.colorbar(mesh, cax=fig.add_axes((1 - 1.05 / FIG_WIDTH, 0.5 / height, 0.15 / FIG_WIDTH,
                                                   1 - 0.82 / height)))
    cb.set_label("log10 grad norm")
    grouped = " (grouped by block)" if group is _block_of else ""
    ax.set_title(f"per-module gradient norm before clipping{grouped}; grey = no gradient",
                 fontsize=10, loc="left")
    return _png(fig), ""


def plot_probes(log: RunLog, xlim) -> str | None:
    rows = sorted((r for r in log.layers if isinstance(r.get("step"), int)
                   and (r.get("attn") or r.get("norm"))), key=lambda r: r["step"])
    if not rows:
        return None
    attn_names = list(dict.fromkeys(n for r in rows for n, s in (r.get("attn") or {}).items()
                                    if s))
    norm_names = list(dict.fromkeys(n for r in rows for n in (r.get("norm") or {})))
    if not attn_names and not norm_names:
        return None
    panels = (1 if attn_names else 0) + (1 if norm_names else 0)
    fig = _figure(2.8 * panels)
    k = 1
    cmap = _mpl().colormaps["tab10"]
    if attn_names:
        ax = fig.add_subplot(panels, 1, k)
        k += 1
        for i, n in enumerate(attn_names):
            xs, ys = zip(*[(r["step"], num((r["attn"].get(n) or {}).get("max_logit")))
                           for r in rows if (r.get("attn") or {}).get(n)]) or ((), ())
            ax.plot(xs, [y if y is not None else float("nan") for y in ys], marker=".",
                    color=cmap(i % 10), label=n)
        lim = num(log.cfg("guard.attn_logit_limit"))
        if lim:
            ax.axhline(lim, color="#d62728", ls="-.", lw=1, label=f"limit {fmt(lim)}")
        ax.set_ylabel("max attention logit")
        _mark_incidents(ax, log.incidents)
        ax.set_xlim(*xlim)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
        ax.set_title("attention: max logit per layer (growth precedes entropy collapse)",
                     fontsize=10, loc="left")
    if norm_names:
        ax = fig.add_subplot(panels, 1, k)
        # min over layers would hide which one; plot each layer's median input var / eps
        worst = []
        for n in norm_names:
            vals = [num((r.get("norm") or {}).get(n, {}).get("median_var")) for r in rows]
            eps = [num((r.get("norm") or {}).get(n, {}).get("eps")) for r in rows]
            ratio = [v / e if v is not None and e else float("nan") for v, e in zip(vals, eps)]
            finite = [x for x in ratio if math.isfinite(x)]
            worst.append((min(finite) if finite else float("inf"), n, ratio))
        worst.sort(key=lambda w: w[0])
        for i, (_, n, ratio) in enumerate(worst[:6]):  # the six closest to the eps regime
            ax.plot([r["step"] for r in rows], ratio, marker=".", color=cmap(i % 10), label=n)
        ax.axhline(num(log.cfg("guard.norm_var_ratio")) or 1.0, color="#d62728", ls="-.",
                   lw=1, label="eps-dominated below")
        ax.set_yscale("log")
        ax.set_ylabel("median input var / eps")
        _mark_incidents(ax, log.incidents)
        ax.set_xlim(*xlim)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
        ax.set_title("normalization: input variance against eps (the six layers closest "
                     "to eps)", fontsize=10, loc="left")
    return _png(fig)

