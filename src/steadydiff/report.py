"""The health report: ``RUN_DIR/report.html``, one self-contained page per run.

Everything a run leaves behind (config.yaml, metrics.jsonl, incidents.jsonl, layers.jsonl,
summary.json, sample grids) turned into one HTML file that opens in any browser with no
network: plots are PNGs rendered with matplotlib's Agg backend and embedded as base64
``data:`` URIs, the CSS is inline, there is no JavaScript (the collapsible evidence uses the
native ``<details>`` element). Every piece of text from the run is HTML-escaped.

The page, top to bottom: the verdict (healthy / recovered from N incidents / aborted, and
why), key numbers, the training timeline (incidents by kind and action; loss raw, smoothed
and per timestep bucket; gradient norm before/after clipping with the clipping threshold; LR
and the guard's LR factor; the fp16 grad-scaler scale), the per-module gradient-norm heat
map, attention/normalization probes over time, the sample grids, the incident table, the
config and the files read.

Robust to what a killed or aborted run leaves: any file may be missing, the last JSONL line
may be cut short, values may be non-finite (the trainer writes them as "nan"/"inf" strings).
A plot that cannot be drawn becomes a note in the page, never an exception.

The readers (:func:`read_run`, :func:`read_jsonl`) are shared with ``steadydiff doctor``.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

__all__ = ["MetricSeries", "RunLog", "Verdict", "evidence_summary", "metric_series",
           "read_jsonl", "read_run", "render", "verdict", "write_report"]

# Colours per guard action (the incident markers and the legend use the same table).
ACTION_COLORS = {
    "skip": "#e69f00", "rollback": "#d62728", "precision_fallback": "#9467bd",
    "microbatch_backoff": "#8c564b", "warn": "#7f7f7f", "abort": "#000000",
}
_STEP_PNG = re.compile(r"^step_(\d+)\.png$")
MAX_SAMPLE_GRIDS = 8          # sample grids shown (evenly spaced over the run, last included)
MAX_HEATMAP_ROWS = 80         # above this many modules the heat map groups them by block
MAX_EMBED_BYTES = 400_000     # a sample grid larger than this is downscaled before embedding


# --------------------------------------------------------------------------- reading a run


@dataclass
class RunLog:
    """What a run directory holds, read tolerantly (missing files are empty, not errors).

    Attributes:
        run_dir: the directory read.
        config: the resolved config as a plain dict ({} when config.yaml is missing).
        metrics: metrics.jsonl rows in file order (rollbacks make steps repeat).
        incidents: incidents.jsonl rows.
        layers: layers.jsonl rows.
        summary: summary.json, or None (the run was killed, or is still running).
        samples: (step, path) of every sample grid, by step.
        checkpoints: checkpoint directories, newest first.
        problems: human-readable notes on missing or damaged files.
    """

    run_dir: Path
    config: dict[str, Any] = field(default_factory=dict)
    metrics: list[dict[str, Any]] = field(default_factory=list)
    incidents: list[dict[str, Any]] = field(default_factory=list)
    layers: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)  # eval.jsonl (eval.every)
    summary: dict[str, Any] | None = None
    samples: list[tuple[int, Path]] = field(default_factory=list)
    checkpoints: list[Path] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def cfg(self, dotted: str, default: Any = None) -> Any:
        """A config value by dotted key (``"optim.grad_clip"``), or ``default``."""
        node: Any = self.config
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        return node

    @property
    def planned_steps(self) -> int | None:
        v = self.cfg("train.steps")
        return int(v) if isinstance(v, (int, float)) else None

    @property
    def last_step(self) -> int | None:
        steps = [r["step"] for r in self.metrics if isinstance(r.get("step"), int)]
        if self.summary and isinstance(self.summary.get("steps"), int):
            steps.append(self.summary["steps"])
        return max(steps) if steps else None


def read_jsonl(path: Path) -> tuple[list[dict[str, Any]], int]:
    """Rows of a JSONL file, skipping lines that do not parse (a row cut short by a kill).

    Returns:
        ``(rows, bad)``: the dict rows, and how many lines were skipped. A missing file
        gives ``([], 0)``.
    """
    if not path.is_file():
        return [], 0
    rows, bad = [], 0
    with open(path, "rb") as f:
        for raw in f:
            line = raw.decode("utf-8", errors="replace").strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except ValueError:
                bad += 1
                continue
            if isinstance(row, dict):
                rows.append(row)
            else:
                bad += 1
    return rows, bad


def read_run(run_dir: str | Path) -> RunLog:
    """Read everything a run directory holds; never raises for missing or partial files.

    Raises:
        FileNotFoundError: ``run_dir`` does not exist or is not a directory.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"no such run directory: {run_dir}")
    log = RunLog(run_dir)
    cfg_path = run_dir / "config.yaml"
    if cfg_path.is_file():
        try:
            import yaml
            loaded = yaml.safe_load(cfg_path.read_text())
            log.config = loaded if isinstance(loaded, dict) else {}
        except Exception as e:  # a damaged config must not hide the rest of the run
            log.problems.append(f"config.yaml: unreadable ({type(e).__name__}: {e})")
    else:
        log.problems.append("config.yaml: missing")
    for name, attr in (("metrics.jsonl", "metrics"), ("incidents.jsonl", "incidents"),
                       ("layers.jsonl", "layers"), ("eval.jsonl", "evals")):
        rows, bad = read_jsonl(run_dir / name)
        setattr(log, attr, rows)
        if bad:
            log.problems.append(f"{name}: {bad} unreadable line(s) skipped (a row cut short "
                                "by a kill?)")
        if not (run_dir / name).is_file() and name == "metrics.jsonl":
            log.problems.append("metrics.jsonl: missing")
    sp = run_dir / "summary.json"
    if sp.is_file():
        try:
            s = json.loads(sp.read_text())
            log.summary = s if isinstance(s, dict) else None
        except ValueError as e:
            log.problems.append(f"summary.json: unreadable ({e})")
    sdir = run_dir / "samples"
    if sdir.is_dir():
        log.samples = sorted((int(m.group(1)), p) for p in sdir.iterdir()
                             if (m := _STEP_PNG.match(p.name)) and p.is_file())
    cdir = run_dir / "checkpoints"
    if cdir.is_dir():
        found = [(int(m.group(1)), p) for p in cdir.iterdir()
                 if p.is_dir() and (m := re.match(r"^step_(\d{8,})$", p.name))]
        log.checkpoints = [p for _, p in sorted(found, reverse=True)]
    return log


def num(v: Any) -> float | None:
    """A metrics value as a float (NaN/Inf included; the trainer writes them as strings),
    or None when absent or not a number."""
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str):
        try:
            return float(v)  # "nan", "inf", "-inf"
        except ValueError:
            return None
    return None


def _finite(v: Any) -> bool:
    x = num(v)
    return x is not None and math.isfinite(x)


# --------------------------------------------------------------------------- verdict


@dataclass
class Verdict:
    """The one-line answer at the top of the report.

    state: ``healthy`` | ``recovered`` | ``aborted`` | ``diverged`` | ``incomplete``.
    """

    state: str
    headline: str
    details: list[str]


def _interventions(incidents: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [i for i in incidents if i.get("action") not in ("warn", None)]


def verdict(log: RunLog) -> Verdict:
    """Healthy / recovered from N incidents / aborted (and why) / diverged / incomplete."""
    s = log.summary or {}
    incs = log.incidents
    acts = Counter(str(i.get("action")) for i in _interventions(incs))
    warns = sum(1 for i in incs if i.get("action") == "warn")
    kinds = Counter(str(i.get("kind")) for i in _interventions(incs))
    last = log.last_step
    planned = log.planned_steps
    details: list[str] = []
    if acts:
        details.append("guard actions: " + ", ".join(f"{n} × {a}" for a, n in acts.most_common()))
        details.append("incident kinds: " + ", ".join(f"{n} × {k}" for k, n in
                                                      kinds.most_common()))
    if warns:
        details.append(f"{warns} health warning(s) from the periodic probes")

    aborts = [i for i in incs if i.get("action") == "abort"]
    if s.get("status") == "aborted" or aborts:
        step = s.get("steps", aborts[-1].get("step") if aborts else last)
        why = s.get("reason")
        if not why and aborts:
            d = aborts[-1].get("diagnosis") or {}
            why = d.get("why") or aborts[-1].get("kind")
        if aborts:
            a = aborts[-1]
            details.insert(0, f"last incident: {a.get('kind')} at step {a.get('step')}"
                           + (f" ({evidence_summary(a)})" if evidence_summary(a) else ""))
        return Verdict("aborted", f"Aborted at step {step}: {why or 'reason not recorded'}",
                       details)

    losses = [r for r in log.metrics if "loss" in r]
    if losses and not _finite(losses[-1].get("loss")):
        return Verdict("diverged", f"Diverged: the loss is {losses[-1].get('loss')} at step "
                       f"{losses[-1].get('step')}", details)

    if s.get("status") != "finished":
        where = (f"last logged step {last}" + (f" of {planned}" if planned else "")
                 if last is not None else "nothing logged")
        head = ("Incomplete: no summary.json, the run was killed or is still running "
                f"({where})")
        if acts:
            head += f"; {sum(acts.values())} incident(s) so far"
        return Verdict("incomplete", head, details)

    n = sum(acts.values())
    steps = s.get("steps", last)
    if n:
        return Verdict("recovered", f"Recovered from {n} incident{'s' if n != 1 else ''}; "
                       f"finished {steps} steps", details)
    head = f"Healthy: finished {steps} steps with no guard intervention"
    if warns:
        head += f" ({warns} health warning{'s' if warns != 1 else ''})"
    return Verdict("healthy", head, details)


# --------------------------------------------------------------------------- text helpers


def esc(v: Any) -> str:
    """HTML-escape anything (the only way text from a run reaches the page)."""
    return html.escape(str(v), quote=True)


def fmt(v: Any) -> str:
    """Short human form of a number (4 significant digits); other values as str."""
    x = num(v) if not isinstance(v, (str, bool)) or num(v) is not None else None
    if x is None:
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(fmt(e) for e in v[:6]) + (", …" if len(v) > 6 else "") + "]"
        return "" if v is None else str(v)
    if isinstance(v, int) and not isinstance(v, bool):
        return str(v)
    if not math.isfinite(x):
        return str(x)
    return f"{x:.4g}"


def evidence_summary(inc: dict[str, Any]) -> str:
    """The evidence of one incident in one line: the module, values and thresholds."""
    e = inc.get("evidence") or {}
    if not isinstance(e, dict):
        return fmt(e)
    parts: list[str] = []
    prov = e.get("provenance") or {}
    if isinstance(prov, dict):
        if prov.get("first_nonfinite_module"):
            parts.append(f"first non-finite module: {prov['first_nonfinite_module']}")
        if prov.get("first_overflow_module"):
            parts.append(f"first fp16 overflow: {prov['first_overflow_module']}")
        if prov.get("nonfinite_grad_params"):
            parts.append("non-finite grads: " + ", ".join(map(str,
                                                             prov["nonfinite_grad_params"][:3])))
    if e.get("params"):
        ps = e["params"] if isinstance(e["params"], list) else [e["params"]]
        label = "param norm jump" if "norm_ratio" in e else "non-finite params"
        parts.append(f"{label}: " + ", ".join(map(str, ps[:3])))
        if "norm_ratio" in e:
            parts.append(f"norm ×{fmt(e['norm_ratio'])}")
    if e.get("module"):
        vals = [f"{k}={fmt(e[k])}" for k in ("max_logit", "entropy", "median_input_var", "eps",
                                               "affine_max", "limit", "min") if k in e]
        parts.append(f"module {e['module']}" + (f" ({', '.join(vals)})" if vals else ""))
    if "t_bucket" in e:
        parts.append(f"loss {fmt(e.get('loss'))} = ×{fmt(e.get('ratio'))} its t-bucket "
                     f"{e['t_bucket']} mean (z={fmt(e.get('z'))})")
    elif "z" in e and "grad_norm" in e:
        parts.append(f"grad norm {fmt(e.get('grad_norm'))} (z={fmt(e.get('z'))}, threshold "
                     f"{fmt(e.get('threshold'))})")
    for k in ("loss", "grad_norm"):
        if k in e and "t_bucket" not in e and "z" not in e and not isinstance(e[k], dict):
            parts.append(f"{k}={fmt(e[k])}")
    if "max_abs_input" in e:
        parts.append(f"max |x| of the batch = {fmt(e['max_abs_input'])}")
    if e.get("top_grad_layers"):
        top = e["top_grad_layers"][0]
        if isinstance(top, dict):
            parts.append(f"largest grad: {top.get('param')} ({fmt(top.get('grad_norm'))})")
    if "micro_batch" in e:
        parts.append(f"micro-batch {e['micro_batch']}")
    if e.get("note"):
        parts.append(str(e["note"]))
    if e.get("recommendation"):
        parts.append(str(e["recommendation"]))
    if not parts:  # unknown kind: the first few scalar fields
        parts = [f"{k}={fmt(v)}" for k, v in list(e.items())[:4]
                 if not isinstance(v, (dict, list))]
    return "; ".join(parts)


def _cost_summary(inc: dict[str, Any]) -> str:
    c = inc.get("cost") or {}
    if not isinstance(c, dict):
        return fmt(c)
    out = []
    if c.get("steps_redone"):
        out.append(f"{c['steps_redone']} step(s) redone")
    if c.get("batches_skipped"):
        out.append(f"{c['batches_skipped']} batch(es) skipped")
    if "restored_step" in c:
        out.append(f"restored step {c['restored_step']}")
    return ", ".join(out) or "none"


def _diagnosis_summary(inc: dict[str, Any]) -> str:
    d = inc.get("diagnosis") or {}
    if not isinstance(d, dict):
        return fmt(d)
    return "; ".join(f"{k}: {fmt(v)}" for k, v in d.items())


# --------------------------------------------------------------------------- plotting


FIG_WIDTH = 11.0                  # inches, at 80 dpi: 880 px, the page's figure width
AXES_LEFT, AXES_RIGHT = 0.85, 2.0  # inches of margin: every timeline plot shares its x axis
                                   # position, so steps line up down the page


def _figure(height: float, *, left: float = AXES_LEFT, right: float = AXES_RIGHT,
            hspace: float = 0.45):
    """A figure with fixed margins (in inches). The object-oriented API with the Agg canvas:
    no pyplot global state, no backend switch in the caller's process (a notebook keeps its
    inline backend); fixed margins instead of a layout engine (one draw, not several)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(FIG_WIDTH, height), dpi=80)
    FigureCanvasAgg(fig)
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


@dataclass
class MetricSeries:
    """The metrics rows as plot-ready columns: the kept rows (last write of each step) and the
    rows a rollback discarded."""

    steps: list[int]
    rows: list[dict[str, Any]]
    discarded: list[dict[str, Any]]

    def col(self, key: str) -> list[float]:
        return [v if (v := num(r.get(key))) is not None else float("nan") for r in self.rows]


def metric_series(metrics: list[dict[str, Any]]) -> MetricSeries:
    """After a rollback the trainer logs the redone steps again: keep the last row of each
    step on the curve, the superseded ones as 'discarded by rollback'."""
    good = [r for r in metrics if isinstance(r.get("step"), int)]
    last_idx = {r["step"]: i for i, r in enumerate(good)}
    kept = sorted((r for i, r in enumerate(good) if last_idx[r["step"]] == i),
                  key=lambda r: r["step"])
    discarded = [r for i, r in enumerate(good) if last_idx[r["step"]] != i]
    return MetricSeries([r["step"] for r in kept], kept, discarded)


def _mark_incidents(ax, incidents: list[dict[str, Any]]) -> None:
    for inc in incidents:
        s = num(inc.get("step"))
        if s is None:
            continue
        a = str(inc.get("action"))
        ax.axvline(s, color=ACTION_COLORS.get(a, "#17becf"), lw=0.9,
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


def _plot_timeline(log: RunLog, xlim: tuple[float, float]) -> str | None:
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
        ax.scatter([num(inc["step"])], [y], s=60, color=ACTION_COLORS.get(a, "#17becf"),
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


def _plot_loss(log: RunLog, ser: MetricSeries, xlim) -> str | None:
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
        from matplotlib import colormaps

        ax2 = fig.add_subplot(2, 1, 2, sharex=ax)
        nb = max(len(r["loss_t"]) for r in ser.rows if isinstance(r.get("loss_t"), list))
        cmap = colormaps["viridis"]
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


def _plot_grad(log: RunLog, ser: MetricSeries, xlim) -> str | None:
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


def _plot_lr(log: RunLog, ser: MetricSeries, xlim) -> str | None:
    lr = ser.col("lr")
    if not any(math.isfinite(v) for v in lr):
        return None
    fig = _figure(2.6)
    ax = fig.add_subplot()
    from matplotlib.ticker import FuncFormatter

    ax.plot(ser.steps, lr, color="#9467bd", lw=1.5, label="lr (schedule)")
    ax.set_ylabel("learning rate")
    # the exponent in every label: matplotlib's offset text would sit on the title
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.1e}" if v else "0"))
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


def _plot_eval(log: RunLog, xlim) -> str | None:
    """eval.jsonl: the Fréchet distance (left axis) and precision/recall (right axis)."""
    rows = [r for r in log.evals if isinstance(r.get("step"), int)]
    if not rows:
        return None
    steps = [r["step"] for r in rows]
    fig = _figure(2.6)
    ax = fig.add_subplot()
    fd = [v if _finite(v := r.get("fd")) else float("nan") for r in rows]
    ax.plot(steps, fd, color="#1f77b4", marker="o", lw=1.5, label=rows[-1].get("metric", "FD"))
    ax.set_ylabel("Fréchet distance")
    ax2 = ax.twinx()
    for key, color in (("precision", "#2ca02c"), ("recall", "#d62728")):
        ax2.plot(steps, [v if _finite(v := r.get(key)) else float("nan") for r in rows],
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


def _plot_scale(log: RunLog, ser: MetricSeries, xlim) -> str | None:
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


def _module_of(param: str) -> str:
    return param.rsplit(".", 1)[0] if "." in param else param


def _block_of(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:3]) if len(parts) > 3 else module


def _plot_heatmap(log: RunLog, xlim) -> tuple[str | None, str]:
    rows = [r for r in log.layers if isinstance(r.get("grad_norm"), dict)
            and isinstance(r.get("step"), int)]
    if not rows:
        why = ("no layers.jsonl" if not (log.run_dir / "layers.jsonl").is_file()
               else "layers.jsonl has no gradient norms")
        return None, why
    rows.sort(key=lambda r: r["step"])
    order: dict[str, None] = {}
    for r in rows:
        for p in r["grad_norm"]:
            order.setdefault(_module_of(p), None)
    modules = list(order)
    group = _block_of if len(modules) > MAX_HEATMAP_ROWS else (lambda m: m)
    keys = list(dict.fromkeys(group(m) for m in modules))
    index = {k: i for i, k in enumerate(keys)}
    import numpy as np

    sq = np.zeros((len(keys), len(rows)))
    bad = np.zeros((len(keys), len(rows)), dtype=bool)
    for j, r in enumerate(rows):
        for p, v in r["grad_norm"].items():
            x = num(v)
            i = index[group(_module_of(p))]
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
    from matplotlib import colormaps

    cmap = colormaps["magma"].with_extremes(bad="#dddddd")
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


def _plot_probes(log: RunLog, xlim) -> str | None:
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
    from matplotlib import colormaps

    cmap = colormaps["tab10"]
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


# --------------------------------------------------------------------------- samples


def _embed_image(path: Path) -> tuple[str, int] | None:
    """A PNG file as a data URI and the display width in CSS pixels (small grids are shown
    enlarged by an integer factor, pixelated, to at most 520×300); large files are
    downscaled, other formats re-encoded. None if the file cannot be read as an image."""
    try:
        from PIL import Image

        data = path.read_bytes()
        img = Image.open(io.BytesIO(data))
        img.load()
        if data[:8] != b"\x89PNG\r\n\x1a\n" or len(data) > MAX_EMBED_BYTES:
            img.thumbnail((768, 768))
            buf = io.BytesIO()
            img.save(buf, format="PNG")
            data = buf.getvalue()
        w, h = img.size
        scale = max(1, int(min(520 / max(w, 1), 300 / max(h, 1))))
        return ("data:image/png;base64," + base64.b64encode(data).decode("ascii"),
                min(w * scale, 520) if w * scale > 520 else w * scale)
    except Exception:
        return None


def _pick(items: list, k: int) -> list:
    """At most ``k`` items evenly spaced, first and last included."""
    if len(items) <= k:
        return list(items)
    idx = sorted({round(i * (len(items) - 1) / (k - 1)) for i in range(k)})
    return [items[i] for i in idx]


# --------------------------------------------------------------------------- page


_CSS = """
body{font-family:-apple-system,"Segoe UI",Roboto,"Helvetica Neue",Arial,sans-serif;margin:0;
 background:#f6f7f9;color:#1d2330;line-height:1.45}
main{max-width:1120px;margin:0 auto;padding:20px 24px 60px}
h1{font-size:22px;margin:4px 0 2px} h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid
 #d9dde3;padding-bottom:4px} .sub{color:#5b6372;font-size:13px}
.verdict{border-radius:8px;padding:14px 18px;margin:16px 0;border-left:8px solid;background:#fff}
.verdict .head{font-size:19px;font-weight:600} .verdict ul{margin:6px 0 0 18px;padding:0}
.healthy{border-color:#2e9d4f}.healthy .head{color:#1f7a3b}
.recovered{border-color:#e6a100}.recovered .head{color:#9a6b00}
.aborted,.diverged{border-color:#d12f2f}.aborted .head,.diverged .head{color:#b01e1e}
.incomplete{border-color:#6b7a90}.incomplete .head{color:#45536a}
.cards{display:flex;flex-wrap:wrap;gap:10px;margin:8px 0}
.card{background:#fff;border:1px solid #e1e4e9;border-radius:6px;padding:8px 12px;min-width:110px}
.card .k{font-size:11px;color:#6b7382;text-transform:uppercase;letter-spacing:.03em}
.card .v{font-size:16px;font-weight:600}
figure{margin:10px 0;background:#fff;border:1px solid #e1e4e9;border-radius:6px;padding:6px}
figure img{width:100%;height:auto;display:block}
.note{color:#6b7382;font-style:italic;font-size:13px;margin:6px 0}
table{border-collapse:collapse;width:100%;background:#fff;font-size:12.5px}
th,td{border:1px solid #e1e4e9;padding:4px 7px;text-align:left;vertical-align:top}
th{background:#eef0f4} td.num{text-align:right;font-variant-numeric:tabular-nums}
.act{display:inline-block;padding:0 6px;border-radius:3px;color:#fff;font-size:11.5px}
details summary{cursor:pointer;color:#3a5ea8;font-size:12px}
pre{white-space:pre-wrap;word-break:break-word;font-size:11.5px;background:#f3f4f7;padding:6px;
 margin:4px 0;border-radius:4px;max-height:420px;overflow:auto}
.samples{display:flex;flex-wrap:wrap;gap:12px}
.samples figure{margin:0;text-align:center;width:auto;max-width:100%}
.samples img{image-rendering:pixelated;max-width:100%;height:auto;margin:0 auto}
.samples figcaption{font-size:12px;color:#5b6372}
.legend span{margin-right:12px;font-size:12px}
"""


def _action_badge(action: Any) -> str:
    a = str(action)
    color = ACTION_COLORS.get(a, "#17becf")
    return f'<span class="act" style="background:{color}">{esc(a)}</span>'


def _figure_html(uri: str | None, alt: str, note: str = "") -> str:
    if uri is None:
        return f'<p class="note">{esc(note or "nothing to plot")}</p>'
    return f'<figure><img src="{uri}" alt="{esc(alt)}"></figure>'


def _safe_plot(fn: Callable[[], str | None], what: str) -> tuple[str | None, str]:
    try:
        return fn(), ""
    except Exception as e:  # one bad plot must not cost the whole report
        return None, f"could not draw the {what}: {type(e).__name__}: {e}"


def _cards(log: RunLog, ser: MetricSeries) -> str:
    last = ser.rows[-1] if ser.rows else {}
    cards = []
    planned = log.planned_steps
    if log.last_step is not None:
        cards.append(("steps", f"{log.last_step}" + (f" / {planned}" if planned else "")))
    if last:
        cards.append(("final loss", fmt(last.get("loss"))))
        cards.append(("images seen", fmt(last.get("images_seen"))))
        cards.append(("precision", fmt(last.get("precision"))))
        sps = [v for v in ser.col("sec_per_step") if math.isfinite(v)]
        if sps:
            cards.append(("sec / step (median)", fmt(sorted(sps)[len(sps) // 2])))
        mem = [v for v in ser.col("memory_mb") if math.isfinite(v)]
        if mem:
            cards.append(("peak memory MB", fmt(max(mem))))
    acts = Counter(str(i.get("action")) for i in log.incidents)
    cards.append(("incidents", str(len(log.incidents))))
    for a in ("skip", "rollback", "precision_fallback", "warn"):
        if acts.get(a):
            cards.append((a + "s", str(acts[a])))
    return '<div class="cards">' + "".join(
        f'<div class="card"><div class="k">{esc(k)}</div><div class="v">{esc(v)}</div></div>'
        for k, v in cards) + "</div>"


def _incident_table(incs: list[dict[str, Any]]) -> str:
    if not incs:
        return '<p class="note">No incidents: the guard never intervened.</p>'
    out = ["<table><tr><th>step</th><th>kind</th><th>severity</th><th>action</th>"
           "<th>evidence</th><th>cost</th><th>diagnosis</th></tr>"]
    for inc in incs:
        full = json.dumps({k: inc.get(k) for k in ("evidence", "cost", "diagnosis")},
                          indent=1, default=str)
        out.append(
            f'<tr><td class="num">{esc(inc.get("step"))}</td><td>{esc(inc.get("kind"))}</td>'
            f'<td>{esc(inc.get("severity", ""))}</td><td>{_action_badge(inc.get("action"))}</td>'
            f"<td>{esc(evidence_summary(inc))}<details><summary>all evidence</summary>"
            f"<pre>{esc(full)}</pre></details></td>"
            f"<td>{esc(_cost_summary(inc))}</td><td>{esc(_diagnosis_summary(inc))}</td></tr>")
    out.append("</table>")
    return "".join(out)


_CONFIG_KEYS = ("model.kind", "model.qk_norm", "data.dataset", "data.image_size",
                "train.steps", "train.batch_size", "train.grad_accum", "train.precision",
                "train.ema_decay", "optim.lr", "optim.schedule", "optim.warmup_steps",
                "optim.grad_clip", "optim.clip_mode", "optim.weight_decay", "guard.enabled")


def _config_html(log: RunLog) -> str:
    if not log.config:
        return '<p class="note">config.yaml is missing or unreadable.</p>'
    rows = "".join(f"<tr><th>{esc(k)}</th><td>{esc(fmt(log.cfg(k)))}</td></tr>"
                   for k in _CONFIG_KEYS if log.cfg(k) is not None)
    try:
        import yaml
        text = yaml.safe_dump(log.config, sort_keys=False)
    except Exception:
        text = json.dumps(log.config, indent=1, default=str)
    return (f'<table style="width:auto">{rows}</table><details><summary>the full resolved '
            f"config</summary><pre>{esc(text)}</pre></details>")


def _files_html(log: RunLog) -> str:
    names = ["config.yaml", "metrics.jsonl", "incidents.jsonl", "layers.jsonl", "summary.json"]
    items = []
    for n in names:
        p = log.run_dir / n
        items.append(f"<li>{esc(n)}: " + (f"{p.stat().st_size:,} bytes" if p.is_file()
                                           else "<i>absent</i>") + "</li>")
    items.append(f"<li>samples/: {len(log.samples)} grid(s)</li>")
    items.append(f"<li>checkpoints/: {len(log.checkpoints)} "
                 + (f"(newest {esc(log.checkpoints[0].name)})" if log.checkpoints else "")
                 + "</li>")
    probs = "".join(f"<li>{esc(p)}</li>" for p in log.problems)
    return f"<ul>{''.join(items)}</ul>" + (f"<p><b>problems</b></p><ul>{probs}</ul>"
                                           if probs else "")


def render(log: RunLog) -> str:
    """The report page for ``log`` as one HTML string."""
    from . import __version__

    v = verdict(log)
    ser = metric_series(log.metrics)
    steps = ser.steps + [int(s) for i in log.incidents if (s := num(i.get("step"))) is not None]
    steps += [r["step"] for r in log.layers if isinstance(r.get("step"), int)]
    lo, hi = (min(steps), max(steps)) if steps else (0, 1)
    if log.planned_steps and log.summary and log.summary.get("status") == "finished":
        hi = max(hi, log.planned_steps)
    pad = max(0.5, 0.01 * (hi - lo))
    xlim = (lo - pad, hi + pad)

    sections: list[str] = []
    notes: list[str] = []

    def plot(fn, what: str, alt: str, empty: str) -> str:
        uri, err = _safe_plot(fn, what)
        if err:
            notes.append(err)
        return _figure_html(uri, alt, err or empty)

    legend = "".join(f'<span>{_action_badge(a)}</span>' for a in ACTION_COLORS
                     if any(i.get("action") == a for i in log.incidents))
    sections.append("<h2>Timeline</h2>")
    if legend:
        sections.append(f'<p class="legend">incident markers: {legend}</p>')
    sections.append(plot(lambda: _plot_timeline(log, xlim), "incident timeline",
                         "incidents over steps", "No incidents to mark."))
    sections.append(plot(lambda: _plot_loss(log, ser, xlim), "loss curve", "loss curve",
                         "No metrics rows: metrics.jsonl is missing or empty."))
    sections.append(plot(lambda: _plot_grad(log, ser, xlim), "gradient-norm plot",
                         "gradient norm", "No gradient norms logged."))
    sections.append(plot(lambda: _plot_lr(log, ser, xlim), "LR plot", "learning rate",
                         "No learning rates logged."))
    if log.evals:
        sections.append(plot(lambda: _plot_eval(log, xlim), "evaluation plot",
                             "FD, precision and recall over steps", ""))
    if any(_finite(r.get("grad_scale")) for r in ser.rows):
        sections.append(plot(lambda: _plot_scale(log, ser, xlim), "grad-scaler plot",
                             "grad scaler scale", ""))

    sections.append("<h2>Per-layer gradients</h2>")
    try:
        uri, why = _plot_heatmap(log, xlim)
    except Exception as e:
        uri, why = None, f"could not draw the heat map: {type(e).__name__}: {e}"
        notes.append(why)
    sections.append(_figure_html(uri, "per-module gradient norm heat map",
                                 f"No per-layer statistics ({why}); set "
                                 "logging.layer_stats_every to record them."))
    if any(r.get("attn") or r.get("norm") for r in log.layers):
        sections.append(plot(lambda: _plot_probes(log, xlim), "probe plot",
                             "attention and normalization probes", ""))

    sections.append("<h2>Samples over training</h2>")
    picked = _pick(log.samples, MAX_SAMPLE_GRIDS)
    figs = []
    for step, path in picked:
        img = _embed_image(path)
        if img is None:
            figs.append(f'<figure><p class="note">{esc(path.name)}: unreadable</p></figure>')
        else:
            uri, width = img
            figs.append(f'<figure><img src="{uri}" alt="samples at step {step}" '
                        f'style="width:{width}px"><figcaption>step {step}</figcaption>'
                        "</figure>")
    if figs:
        more = (f'<p class="note">{len(picked)} of {len(log.samples)} grids shown, evenly '
                "spaced.</p>" if len(picked) < len(log.samples) else "")
        sections.append(f'<div class="samples">{"".join(figs)}</div>{more}')
    else:
        sections.append('<p class="note">No sample grids in samples/.</p>')

    sections.append(f"<h2>Incidents ({len(log.incidents)})</h2>")
    sections.append(_incident_table(log.incidents))
    sections.append("<h2>Config</h2>" + _config_html(log))
    sections.append("<h2>Files</h2>" + _files_html(log))
    if notes:
        sections.append("<h2>Report notes</h2><ul>" + "".join(f"<li>{esc(n)}</li>"
                                                               for n in notes) + "</ul>")

    details = "".join(f"<li>{esc(d)}</li>" for d in v.details)
    guard_summary = (log.summary or {}).get("guard_summary")
    gs = (f"<details><summary>the guard's summary</summary><pre>{esc(guard_summary)}</pre>"
          "</details>" if guard_summary else "")
    generated = time.strftime("%Y-%m-%d %H:%M:%S")
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
        f"<title>steadydiff report: {esc(log.run_dir.name)}</title><style>{_CSS}</style>"
        "</head><body><main>"
        f"<h1>steadydiff health report</h1><div class=\"sub\">run {esc(log.run_dir)} · "
        f"generated {esc(generated)} by steadydiff {esc(__version__)}</div>"
        f'<div class="verdict {esc(v.state)}"><div class="head">{esc(v.headline)}</div>'
        + (f"<ul>{details}</ul>" if details else "") + gs + "</div>"
        + _cards(log, ser) + "".join(sections) + "</main></body></html>\n")


def write_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the health report of a run.

    Args:
        run_dir: the run directory (what ``steadydiff train`` wrote; partial is fine).
        out: where to write; default ``RUN_DIR/report.html``.

    Returns:
        The path written (written atomically: a temporary file renamed into place).

    Raises:
        FileNotFoundError: ``run_dir`` does not exist.
    """
    log = read_run(run_dir)
    out = Path(out) if out is not None else log.run_dir / "report.html"
    page = render(log)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(out)
    return out
