"""The health report (``RUN_DIR/report.html``): self-contained, lists every incident, shows
the verdict, survives partial files, escapes what the run wrote; on a synthetic run
directory and on a real tiny run with injected faults."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import steadydiff
from steadydiff.cli import main
from steadydiff.config import load_config
from steadydiff.inspect.read import read_run
from steadydiff.inspect.verdict import verdict
from steadydiff.report import write_report
from steadydiff.rundir import RunDir

from tiny import TINY_MODEL  # noqa: E402  (tests/tiny.py)

TINY = TINY_MODEL + [
    "sample.num=4", "sample.steps=2", "logging.log_every=1",
]
EVIL = '<img src="x.png" onerror="alert(1)"><script>alert(2)</script>'


def assert_self_contained(page: str) -> None:
    assert "http://" not in page and "https://" not in page
    assert "<script" not in page.lower() and "<link" not in page.lower()
    assert "@import" not in page and "url(" not in page
    srcs = re.findall(r'<img[^>]*\ssrc="([^"]*)"', page)
    assert srcs and all(s.startswith("data:image/png;base64,") for s in srcs)


def incident_rows(page: str) -> set[tuple[int, str]]:
    """(step, kind) of every row of the incident table."""
    return {(int(s), k) for s, k in
            re.findall(r'<tr><td class="num">(\d+)</td><td>([^<]*)</td>', page)}


def _png(path: Path, seed: int = 0) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    a = np.random.default_rng(seed).integers(0, 255, (19, 37, 3), dtype=np.uint8)
    Image.fromarray(a).save(path)


def synthetic_run(root: Path, *, status: str | None = "finished", steps: int = 40,
                  incidents: list[dict] | None = None, truncate: bool = False) -> Path:
    """A run directory written by hand, with every file the trainer writes."""
    root.mkdir(parents=True)
    RunDir(root).mark()  # the marker every run steadydiff starts writes first
    (root / "config.yaml").write_text(load_config(None, TINY + [f"train.steps={steps}"]).to_yaml())
    rows = []
    for s in range(1, steps + 1):
        rows.append({"step": s, "images_seen": 8 * s, "loss": 1.0 / (1 + 0.05 * s),
                     "grad_norm": 0.5 + (20.0 if s == 12 else 0.0), "grad_norm_clipped": 0.5,
                     "lr": 2e-4 * min(1.0, s / 10), "lr_factor": 0.5 if 12 <= s < 20 else 1.0,
                     "sec_per_step": 0.01, "ema_decay": 0.99, "grad_scale": 2.0 ** (16 - s // 10),
                     "precision": "fp16", "micro_batch": 8, "incidents": 0, "skipped_steps": 0,
                     "rollbacks": 0, "data_skipped": 0, "memory_mb": 100.0,
                     "loss_t": [0.2 * b + 1 / s for b in range(4)] if s % 3 else None})
    rows[20]["loss"] = "nan"  # the trainer writes non-finite values as strings
    rows.insert(15, dict(rows[14], loss=9.0))  # a step logged again after a rollback
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if truncate:
        text += '{"step": 41, "loss": 0.3, "gra'  # a row cut short by a kill
    (root / "metrics.jsonl").write_text(text)
    incidents = incidents if incidents is not None else [
        {"step": 12, "kind": "grad_spike", "severity": "spike", "action": "skip",
         "evidence": {"grad_norm": 20.5, "z": 9.1, "threshold": 6.0},
         "cost": {"steps_redone": 0, "batches_skipped": 1}, "diagnosis": {}},
        {"step": 15, "kind": "nonfinite_params", "severity": "fatal", "action": "rollback",
         "evidence": {"params": ["up.0.res.0.conv1.weight"], "count": 1},
         "cost": {"steps_redone": 3, "batches_skipped": 1, "restored_step": 12},
         "diagnosis": {"reason": "state unusable", "lr_factor": 0.5}},
        {"step": 22, "kind": "attention_logit_growth", "severity": "warn", "action": "warn",
         "evidence": {"module": "mid.attn.attn", "max_logit": 61.0, "limit": 50.0,
                      "recommendation": "enable model.qk_norm"}},
        {"step": 30, "kind": EVIL, "severity": "fatal", "action": "precision_fallback",
         "evidence": {"note": EVIL}},
    ]
    (root / "incidents.jsonl").write_text("".join(json.dumps(i) + "\n" for i in incidents))
    layers = []
    for s in range(5, steps + 1, 5):
        layers.append({"step": s,
                       "grad_norm": {"conv_in.weight": 0.1 * s, "conv_in.bias": 0.01,
                                     "mid.attn.attn.qkv.weight": 0.2,
                                     "out.conv.weight": "nan" if s == 15 else 0.0},
                       "weight_norm": {"conv_in.weight": 1.0},
                       "attn": {"mid.attn.attn": {"max_logit": 2.0 * s, "entropy": 1.0}},
                       "norm": {"out.norm": {"min_var": 0.1, "median_var": 0.2, "eps": 1e-5,
                                             "affine_max": 1.0}}})
    (root / "layers.jsonl").write_text("".join(json.dumps(r) + "\n" for r in layers))
    for s in (10, 20, 30, 40):
        _png(root / "samples" / f"step_{s:08d}.png", seed=s)
    if status is not None:
        summary = {"status": status, "steps": steps if status == "finished" else 30,
                   "incidents": len(incidents), "guard_summary": "guard: ..."}
        if status == "aborted":
            summary["reason"] = "5 rollbacks within 1000 steps already"
        (root / "summary.json").write_text(json.dumps(summary))
    return root


# --------------------------------------------------------------------------- synthetic


def test_self_contained_and_lists_every_incident(tmp_path):
    run = synthetic_run(tmp_path / "run")
    out = write_report(run)
    assert out == run / "report.html"
    page = out.read_text()
    assert_self_contained(page)
    incs = [json.loads(l) for l in (run / "incidents.jsonl").read_text().splitlines()]
    import html
    assert incident_rows(page) == {(i["step"], html.escape(i["kind"])) for i in incs}
    assert "Recovered from 3 incidents" in page  # warnings are not interventions
    # plots: timeline, loss (+ t-buckets), grad norm, LR, scaler, heat map, probes; samples
    assert len(re.findall(r'<img[^>]*alt="samples at step', page)) == 4
    for alt in ("incidents over steps", "loss curve", "gradient norm", "learning rate",
                "grad scaler scale", "per-module gradient norm heat map",
                "attention and normalization probes"):
        assert f'alt="{alt}"' in page, alt


def test_everything_is_escaped(tmp_path):
    page = write_report(synthetic_run(tmp_path / "run")).read_text()
    assert EVIL not in page and 'onerror="alert' not in page
    assert "&lt;img src=&quot;x.png&quot; onerror=&quot;alert(1)&quot;&gt;&lt;script&gt;" in page


@pytest.mark.parametrize("status,expected", [
    ("finished", "Recovered from 3 incidents"),
    ("aborted", "Aborted at step 30: 5 rollbacks within 1000 steps already"),
    (None, "Incomplete: no summary.json"),
])
def test_verdict(tmp_path, status, expected):
    run = synthetic_run(tmp_path / "run", status=status)
    assert expected in write_report(run).read_text()


def test_healthy_verdict(tmp_path):
    run = synthetic_run(tmp_path / "run", incidents=[])
    v = verdict(read_run(run))
    assert v.state == "healthy" and v.headline.startswith("Healthy")
    assert "No incidents" in write_report(run).read_text()


def test_partial_files(tmp_path):
    # a truncated last row, no layers.jsonl, a corrupt summary.json, an unreadable grid
    run = synthetic_run(tmp_path / "run", truncate=True)
    (run / "layers.jsonl").unlink()
    (run / "summary.json").write_text('{"status": "fini')
    (run / "samples" / "step_00000040.png").write_bytes(b"not a png")
    page = write_report(run, tmp_path / "elsewhere" / "r.html").read_text()
    assert_self_contained(page)
    assert "1 unreadable line(s) skipped" in page and "summary.json: unreadable" in page
    assert "No per-layer statistics (no layers.jsonl)" in page
    assert "step_00000040.png: unreadable" in page
    # nothing at all is not a run: refused, and nothing written into it (docs/RELIABILITY.md,
    # "Run-directory safety"); a run killed before its first row still gets a page
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="not a steadydiff run"):
        write_report(tmp_path / "empty")
    assert not any((tmp_path / "empty").iterdir())
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match="not a steadydiff run"):  # a user's file: not ours
        write_report(tmp_path / "empty")
    RunDir(tmp_path / "empty").mark()  # a run killed before its first row
    page = write_report(tmp_path / "empty").read_text()
    assert "Incomplete" in page and "nothing logged" in page
    # only a config and half a metrics row
    (tmp_path / "killed").mkdir()
    (tmp_path / "killed" / "metrics.jsonl").write_text('{"step": 1, "loss": 0.5, "grad_norm"')
    RunDir(tmp_path / "killed").mark()
    assert "Incomplete" in write_report(tmp_path / "killed").read_text()


def test_cli_report(tmp_path, capsys):
    run = synthetic_run(tmp_path / "run")
    assert main(["report", str(run), "--out", str(tmp_path / "x.html")]) == 0
    assert (tmp_path / "x.html").is_file() and "wrote" in capsys.readouterr().out
    assert main(["report", str(tmp_path / "missing")]) == 2


# --------------------------------------------------------------------------- a real run


def test_real_run_with_incidents(tmp_path):
    torch.manual_seed(0)
    raw = load_config(None, TINY + ["train.steps=14", "train.checkpoint_every=7",
                                    "train.sample_every=7", "guard.snapshot_every=2",
                                    "guard.warmup_steps=3",
                                    "logging.layer_stats_every=3"]).to_dict()
    raw["faults"] = [{"kind": "param_nan", "step": 5},
                     {"kind": "nan_batch", "step": 9}]
    run = tmp_path / "run"
    steadydiff.train(raw, out_dir=run)
    page = write_report(run).read_text()
    assert_self_contained(page)
    incs = [json.loads(l) for l in (run / "incidents.jsonl").read_text().splitlines()]
    kinds = {i["kind"] for i in incs}
    assert {"nonfinite_params", "bad_batch"} <= kinds
    assert incident_rows(page) == {(i["step"], i["kind"]) for i in incs}
    assert f"Recovered from {len(incs)} incident" in page
    assert 'alt="samples at step 14"' in page
    if (run / "layers.jsonl").is_file():  # written by the trainer since issue 5
        assert 'alt="per-module gradient norm heat map"' in page


def test_files_section_lists_what_a_fine_tune_leaves_to_load(tmp_path):
    """A fine-tune's report names its LoRA files, its base model, the rank and the trigger
    (what a user loads in ComfyUI, A1111 or diffusers)."""
    import yaml

    run = synthetic_run(tmp_path / "run")
    conf = yaml.safe_load((run / "config.yaml").read_text()) or {}
    conf.setdefault("model", {})["pretrained"] = "/models/sd-1-5"
    conf["adapter"] = {"kind": "lora", "rank": 8, "alpha": 4}
    conf.setdefault("data", {})["trigger"] = "sks"
    (run / "config.yaml").write_text(yaml.safe_dump(conf))
    (run / "lora").mkdir()
    (run / "lora" / "run.safetensors").write_bytes(b"x" * 100)
    (run / "lora" / "pytorch_lora_weights.safetensors").write_bytes(b"x" * 50)
    page = write_report(run).read_text()
    assert "lora/: 2 file(s)" in page and "run.safetensors (100 bytes)" in page
    assert "base model: /models/sd-1-5 (lora, rank 8, alpha 4; trigger sks)" in page
