"""The report page: one self-contained HTML string (inline CSS, PNGs as data URIs, no
JavaScript; the collapsible evidence uses the native ``<details>`` element). Every text from
the run reaches the page through :func:`esc`.

The page, top to bottom: the verdict, key numbers, the training timeline (plots.py), the
per-module gradient heat map and the probes, the sample grids, the incident table (one
:mod:`steadydiff.guard.findings` record per row: its summary and recommendation), the config
and the files read. A plot that cannot be drawn becomes a note, never an exception.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import yaml
from PIL import Image

from .. import __version__
from ..guard.findings import RunContext, finding_from_row
from ..values import finite, fmt, num
from . import plots
from .plots import ACTION_COLORS
from .read import MetricSeries, RunLog, metric_series
from .verdict import verdict

MAX_SAMPLE_GRIDS = 8          # sample grids shown (evenly spaced over the run, last included)
MAX_EMBED_BYTES = 400_000     # a sample grid larger than this is downscaled before embedding


def esc(v: Any) -> str:
    """HTML-escape anything (the only way text from a run reaches the page)."""
    return html.escape(str(v), quote=True)



def _embed_image(path: Path) -> tuple[str, int] | None:
    """A PNG file as a data URI and the display width in CSS pixels (small grids are shown
    enlarged by an integer factor, pixelated, to at most 520×300); large files are
    downscaled, other formats re-encoded. None if the file cannot be read as an image."""
    try:
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


def _validation_html(v: dict[str, Any]) -> str:
    """The newest render's validation prompts: each prompt's images with its text and
    settings (trainer/validation.py writes them)."""
    figs = []
    for p in v.get("prompts") or []:
        if not isinstance(p, dict):
            continue
        img = _embed_image(Path(v["folder"]) / str(p.get("file"))) if p.get("file") else None
        bad = p.get("error") or (None if p.get("finite", True) else "non-finite image")
        body = (f'<img src="{img[0]}" alt="validation prompt {esc(p.get("index"))}" '
                f'style="width:{img[1]}px">' if img else
                '<p class="note">no image</p>')
        settings = (f'#{esc(p.get("index"))} · seed {esc(p.get("seed"))} · cfg '
                    f'{esc(p.get("cfg_scale"))} · {esc(p.get("steps"))} steps')
        neg = f'<br>not: {esc(p["negative_prompt"])}' if p.get("negative_prompt") else ""
        warn = (f'<br><b style="color:#b3261e">{esc(bad)}</b>' if bad else "")
        figs.append(f"<figure>{body}<figcaption>{esc(p.get('prompt'))}{neg}<br>{settings}"
                    f"{warn}</figcaption></figure>")
    ema = "EMA" if v.get("use_ema", True) else "raw"
    return (f"<h2>Validation prompts (step {esc(v.get('step'))})</h2>"
            f'<p class="note">{ema} weights, {esc(v.get("sampler"))}; grid '
            f'{esc(v.get("grid"))}, cells listed in its prompts.json.</p>'
            f'<div class="samples">{"".join(figs)}</div>')


def _pick(items: list, k: int) -> list:
    """At most ``k`` items evenly spaced, first and last included."""
    if len(items) <= k:
        return list(items)
    idx = sorted({round(i * (len(items) - 1) / (k - 1)) for i in range(k)})
    return [items[i] for i in idx]



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
.rec{color:#45536a;font-size:12px;margin-top:2px}
"""


def _action_badge(action: Any) -> str:
    a = str(action)
    color = plots.action_color(a)
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
    if tb := log.time_budget:
        cards.append(("training time / budget",
                      f"{fmt(num(tb.get('used')))} s / {fmt(num(tb.get('max_time')))} s"))
    acts = Counter(str(i.get("action")) for i in log.incidents)
    cards.append(("incidents", str(len(log.incidents))))
    for a in ("skip", "rollback", "precision_fallback", "warn"):
        if acts.get(a):
            cards.append((a + "s", str(acts[a])))
    quarantined = [i for i in log.incidents if i.get("kind") == "sample_quarantined"]
    if quarantined:  # the files to fix, where a person looks first
        names = [str((i.get("evidence") or {}).get("source")
                     or f"index {(i.get('evidence') or {}).get('index')}") for i in quarantined]
        cards.append(("quarantined", ", ".join(names[:3])
                      + (f" (+{len(names) - 3})" if len(names) > 3 else "")))
    return '<div class="cards">' + "".join(
        f'<div class="card"><div class="k">{esc(k)}</div><div class="v">{esc(v)}</div></div>'
        for k, v in cards) + "</div>"


def _incident_table(log: RunLog) -> str:
    """One row per incident: its record's summary and recommendation (the doctor gives the
    same advice), the full evidence JSON folded under it, the cost and the diagnosis."""
    if not log.incidents:
        return '<p class="note">No incidents: the guard never intervened.</p>'
    ctx = RunContext.from_config(log.config)
    out = ["<table><tr><th>step</th><th>kind</th><th>severity</th><th>action</th>"
           "<th>evidence</th><th>cost</th><th>diagnosis</th></tr>"]
    for inc in log.incidents:
        f = finding_from_row(inc)
        full = json.dumps({k: inc.get(k) for k in ("evidence", "cost", "diagnosis")},
                          indent=1, default=str)
        out.append(
            f'<tr><td class="num">{esc(inc.get("step"))}</td><td>{esc(inc.get("kind"))}</td>'
            f'<td>{esc(inc.get("severity", ""))}</td><td>{_action_badge(inc.get("action"))}</td>'
            f'<td>{esc(f.summary())}<div class="rec">→ {esc(f.recommendation(ctx))}</div>'
            f"<details><summary>all evidence</summary><pre>{esc(full)}</pre></details></td>"
            f"<td>{esc(f.cost.summary())}</td><td>{esc(f.diagnosis.summary())}</td></tr>")
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
        text = yaml.safe_dump(log.config, sort_keys=False)
    except Exception:
        text = json.dumps(log.config, indent=1, default=str)
    return (f'<table style="width:auto">{rows}</table><details><summary>the full resolved '
            f"config</summary><pre>{esc(text)}</pre></details>")


def _files_html(log: RunLog) -> str:
    rd = log.paths
    items = []
    for p in (rd.config, rd.metrics, rd.incidents, rd.layers, rd.summary):
        items.append(f"<li>{esc(p.name)}: " + (f"{p.stat().st_size:,} bytes" if p.is_file()
                                                else "<i>absent</i>") + "</li>")
    items.append(f"<li>samples/: {len(log.samples)} grid(s)</li>")
    # what a fine-tune leaves to load elsewhere (LoRA, hypernetwork, embedding, ControlNet,
    # a full fine-tune's folder), its base and its rank
    root = rd.config.parent
    for sub in ("lora", "hypernetwork", "embeddings", "controlnet", "model"):
        d = root / sub
        if d.is_dir():
            files = sorted(f for f in d.rglob("*.safetensors") if f.is_file())
            shown = ", ".join(f"{esc(f.relative_to(d))} ({f.stat().st_size:,} bytes)"
                              for f in files[:12])
            more = f", and {len(files) - 12} more" if len(files) > 12 else ""
            items.append(f"<li>{sub}/: {len(files)} file(s){': ' if files else ''}"
                         f"{shown}{more}</li>")
    model = log.config.get("model") or {}
    adapter = log.config.get("adapter") or {}
    if model.get("pretrained"):
        kind = adapter.get("kind", "none")
        what = (f"{kind}, rank {adapter.get('rank')}, alpha {adapter.get('alpha')}"
                if kind == "lora" else kind if kind != "none" else "full fine-tune")
        items.append(f"<li>base model: {esc(model['pretrained'])} ({esc(what)}"
                     + (f"; trigger {esc(log.config.get('data', {}).get('trigger'))}"
                        if (log.config.get("data") or {}).get("trigger") else "") + ")</li>")
    items.append(f"<li>checkpoints/: {len(log.checkpoints)} "
                 + (f"(newest {esc(log.checkpoints[0].name)})" if log.checkpoints else "")
                 + "</li>")
    probs = "".join(f"<li>{esc(p)}</li>" for p in log.problems)
    return f"<ul>{''.join(items)}</ul>" + (f"<p><b>problems</b></p><ul>{probs}</ul>"
                                           if probs else "")


def _buckets_html(b: dict) -> str:
    """The aspect-ratio bucket histogram (buckets.json): one row per bucket with images."""
    rows = [r for r in b.get("buckets", []) if isinstance(r, dict)]
    top = max([int(r.get("images", 0)) for r in rows] or [1]) or 1
    body = "".join(
        f"<tr><td>{esc(r.get('width'))}×{esc(r.get('height'))}</td>"
        f"<td>{esc(r.get('images'))}</td><td>{esc(r.get('batches'))}</td>"
        f'<td><div style="background:#3a5ea8;height:10px;width:'
        f'{round(200 * int(r.get("images", 0)) / top)}px"></div></td></tr>' for r in rows)
    return (f'<p class="note">{esc(b.get("images"))} images in {len(rows)} of '
            f'{esc(b.get("defined"))} buckets, batch {esc(b.get("batch_size"))}; every batch '
            "comes from one bucket (a bucket's last batch is filled from itself).</p>"
            '<table style="width:auto"><tr><th>bucket (w×h)</th><th>images</th>'
            f"<th>batches per epoch</th><th></th></tr>{body}</table>")


def render(log: RunLog) -> str:
    """The report page for ``log`` as one HTML string."""
    v = verdict(log)
    ser = metric_series(log.metrics)
    steps = ser.steps + [int(s) for i in log.incidents if (s := num(i.get("step"))) is not None]
    steps += [r["step"] for r in log.layers if isinstance(r.get("step"), int)]
    lo, hi = (min(steps), max(steps)) if steps else (0, 1)
    if log.planned_steps and log.summary and log.summary.get("status") == "finished" \
            and not (log.time_budget or {}).get("ended"):  # a time budget ended it early
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
    sections.append(plot(lambda: plots.plot_timeline(log, xlim), "incident timeline",
                         "incidents over steps", "No incidents to mark."))
    sections.append(plot(lambda: plots.plot_loss(log, ser, xlim), "loss curve", "loss curve",
                         "No metrics rows: metrics.jsonl is missing or empty."))
    sections.append(plot(lambda: plots.plot_grad(log, ser, xlim), "gradient-norm plot",
                         "gradient norm", "No gradient norms logged."))
    sections.append(plot(lambda: plots.plot_lr(log, ser, xlim), "LR plot", "learning rate",
                         "No learning rates logged."))
    if log.evals:
        sections.append(plot(lambda: plots.plot_eval(log, xlim), "evaluation plot",
                             "FD, precision and recall over steps", ""))
    if any(finite(r.get("grad_scale")) for r in ser.rows):
        sections.append(plot(lambda: plots.plot_scale(log, ser, xlim), "grad-scaler plot",
                             "grad scaler scale", ""))

    sections.append("<h2>Per-layer gradients</h2>")
    try:
        uri, why = plots.plot_heatmap(log, xlim)
    except Exception as e:
        uri, why = None, f"could not draw the heat map: {type(e).__name__}: {e}"
        notes.append(why)
    sections.append(_figure_html(uri, "per-module gradient norm heat map",
                                 f"No per-layer statistics ({why}); set "
                                 "logging.layer_stats_every to record them."))
    if any(r.get("attn") or r.get("norm") for r in log.layers):
        sections.append(plot(lambda: plots.plot_probes(log, xlim), "probe plot",
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

    if log.buckets:
        sections.append("<h2>Buckets</h2>" + _buckets_html(log.buckets))
    if log.validation is not None:
        sections.append(_validation_html(log.validation))
    sections.append(f"<h2>Incidents ({len(log.incidents)})</h2>")
    sections.append(_incident_table(log))
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

