"""Typed incident findings (guard/findings.py): every kind the code emits has a record; the
records' keyword constructors write exactly what the emitting code writes today; their
summaries and recommendations read real rows (a fault-injection run, the detectors and
probes) and never fail on odd ones (unknown kinds, missing keys, "nan" strings); the report
and the doctor give the same advice for the same row.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import get_args

import pytest

import steadydiff
from steadydiff.config import load_config
from steadydiff.doctor import diagnose
from steadydiff.guard import probes
from steadydiff.guard import findings as F
from steadydiff.guard.records import row_severity
from steadydiff.guard.detectors import BucketLossSpike, Divergence, GradSpike, Overflow
from steadydiff.inspect.html import esc, render
from steadydiff.inspect.read import read_run

from tiny import TINY_MODEL  # noqa: E402  (tests/tiny.py)

SRC = Path(steadydiff.__file__).parent
VICTIM = "mid.res.0.conv1.weight"
# what the guard adds to a finding's evidence after detection (not the kind's own keys)
CONTEXT = {"provenance", "health", "rank", "top_grad_layers", "weight_growth_since_snapshot",
           "samples", "elements", "symptom", "rerun"}


# --------------------------------------------------------------------------- the registry


def _emitted() -> tuple[set[str], set[str]]:
    """(kinds, actions) the package's source writes: the string constants in the first
    argument of every ``Finding(...)`` or typed-record constructor call, and in the second
    argument of every ``record(...)`` / ``_record(...)`` call."""
    names = {cls.__name__: k for k, cls in F.REGISTRY.items()}
    kinds, actions = set(), set()
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", None)
            owner = fn.value if isinstance(fn, ast.Attribute) else None
            if name == "Finding" and node.args:
                kinds |= {c.value for c in ast.walk(node.args[0])
                          if isinstance(c, ast.Constant) and isinstance(c.value, str)}
            elif owner is not None and getattr(owner, "attr", getattr(owner, "id", None)) in names:
                kinds.add(names[owner.attr if isinstance(owner, ast.Attribute) else owner.id])
            if name in ("record", "_record") and len(node.args) >= 2:
                actions |= {c.value for c in ast.walk(node.args[1])
                            if isinstance(c, ast.Constant) and isinstance(c.value, str)}
    return kinds, actions


def test_every_kind_the_code_emits_has_a_record():
    kinds, actions = _emitted()
    assert len(kinds) >= 19, kinds  # the scan sees the call sites
    assert kinds == set(F.REGISTRY), (kinds ^ set(F.REGISTRY))
    assert set(get_args(F.IncidentKind)) == set(F.REGISTRY)
    assert actions == set(get_args(F.IncidentAction)), actions ^ set(get_args(F.IncidentAction))
    for kind, cls in F.REGISTRY.items():
        assert cls.KIND == kind and issubclass(cls, F.Finding)
        assert callable(getattr(cls, "new", None) or getattr(cls, "forward", None)), kind


def test_detectors_finding_is_the_base_record():
    from steadydiff.guard.detectors import Finding
    f = Finding("grad_spike", "spike", {"grad_norm": 3.0})
    assert Finding is F.Finding and f.kind == "grad_spike" and f.evidence == {"grad_norm": 3.0}
    f.evidence["rank"] = 1  # the guard adds context after detection
    assert F.finding_from_row({"kind": f.kind, "evidence": f.evidence}).evidence["rank"] == 1
    with pytest.raises(ValueError, match="grad_spike"):
        F.GradSpike("loss_spike", "spike", {})


# --------------------------------------------------------------------------- constructors


def _parts(f: F.Finding) -> tuple:
    return f.kind, f.severity, f.evidence


def test_constructors_write_what_the_detectors_and_probes_write():
    g = GradSpike(momentum=0.9, z_max=3.0, warmup=3)
    for v in (1.0, 1.1, 0.9, 1.0):
        g.observe(v)
    got = g.check(50.0)
    e = got.evidence
    assert _parts(F.GradSpike.new(grad_norm=50.0, running_mean=e["running_mean"],
                                  running_std=e["running_std"], z=e["z"],
                                  threshold=3.0)) == _parts(got)

    ls = BucketLossSpike(buckets=4, momentum=0.9, z_max=3.0, ratio_min=3.0, warmup=3)
    for _ in range(5):
        ls.observe([1.0, 0.5, 0.2, 0.1])
    got = ls.check([1.0, 0.5, 50.0, 0.1])
    e = got.evidence
    assert _parts(F.LossSpike.new(t_bucket=2, buckets=4, loss=50.0,
                                  bucket_mean=e["bucket_mean"], ratio=e["ratio"], z=e["z"],
                                  threshold=3.0, buckets_over=e["buckets_over"])) == _parts(got)

    dv = Divergence(window=20, ratio=1.5, warmup=0)
    got = next(f for x in [1.0] * 30 + [10.0] * 40 if (f := dv.check_and_observe(x)))
    e = got.evidence
    assert F.Divergence.new(smoothed_loss=e["smoothed_loss"],
                            best_smoothed_loss=e["best_smoothed_loss"], threshold_ratio=1.5,
                            window=20).evidence == pytest.approx(e)

    ov = Overflow(limit=2, window=10)
    ov.record(1, 65536.0)
    got = ov.record(2, 32768.0)
    assert _parts(F.Fp16Overflow.repeated(overflows_in_window=2, window=10, limit=2,
                                          loss_scale=32768.0)) == _parts(got)

    stats = {"attn": {"a": {"max_logit": 61.0, "entropy": 0.01}},
             "norm": {"n": {"median_var": 1e-9, "min_var": 1e-10, "eps": 1e-5,
                            "affine_max": 5e3}}}
    got = probes.findings(stats, logit_limit=50.0, entropy_min=0.05, var_ratio=1.0,
                          affine_limit=1e3)
    assert [_parts(f) for f in got] == [_parts(f) for f in (
        F.AttentionLogitGrowth.new(module="a", max_logit=61.0, limit=50.0),
        F.AttentionEntropyCollapse.new(module="a", entropy=0.01, min=0.05),
        F.NormEpsDominated.new(module="n", median_input_var=1e-9, eps=1e-5, var_ratio=1.0),
        F.NormAffineExploded.new(module="n", affine_max=5e3, limit=1e3))]


# --------------------------------------------------------------------------- a real run


FAULTS = [{"kind": "nan_batch", "step": 3}, {"kind": "oom", "step": 4, "factor": 0},
          {"kind": "loss_scale", "step": 6, "factor": 1e8},
          {"kind": "param_nan", "step": 8, "target": VICTIM},
          {"kind": "grad_nan", "step": 10, "target": VICTIM},
          {"kind": "param_huge", "step": 12, "factor": 1e3, "target": VICTIM},
          {"kind": "lr_scale", "step": 14, "factor": 1e4, "steps": 1},
          {"kind": "outlier_batch", "step": 15, "factor": 1e4}]


@pytest.fixture(scope="module")
def faulty(tmp_path_factory):
    """One 17-step tiny run with eight injected faults: its rows and the run's result."""
    run = tmp_path_factory.mktemp("findings") / "run"
    cfg = load_config(None, TINY_MODEL + [
        "train.steps=17", "train.checkpoint_every=0", "logging.log_every=1",
        "logging.report=false", "guard.warmup_steps=4", "guard.snapshot_every=3",
        f"faults={json.dumps(FAULTS)}"])
    res = steadydiff.train(cfg, out_dir=run)
    rows = [json.loads(l) for l in (run / "incidents.jsonl").read_text().splitlines()]
    return run, rows, res


def _own(row: dict) -> dict:
    return {k: v for k, v in row["evidence"].items() if k not in CONTEXT}


# the typed constructor for each kind the run produces, from a row's own values
BUILD = {
    "bad_batch": lambda e: F.BadBatch.new(max_abs_input=e["max_abs_input"],
                                          usual_max_abs_input=e.get("usual_max_abs_input")),
    "out_of_memory": lambda e: F.OutOfMemory.new(micro_batch=e["micro_batch"],
                                                 error=e["error"]),
    "loss_spike": lambda e: F.LossSpike.new(
        t_bucket=e["t_bucket"], buckets=round(1 / (e["t_bucket_range"][1]
                                                   - e["t_bucket_range"][0])),
        loss=e["loss"], bucket_mean=e["bucket_mean"], ratio=e["ratio"], z=e["z"],
        threshold=e["threshold"], buckets_over=e["buckets_over"]),
    "nonfinite_params": lambda e: F.NonfiniteParams.new(params=e["params"], count=e["count"]),
    "nonfinite_grad": lambda e: F.NonfiniteGrad.new(loss=e["loss"], grad_norm=e["grad_norm"]),
    "weight_jump": lambda e: F.WeightJump.new(params=e["params"], norm_ratio=e["norm_ratio"],
                                              threshold=e["threshold"]),
    "lr_spike": lambda e: F.LrSpike.new(lr=e["lr"], max_lr_so_far=e["max_lr_so_far"],
                                        threshold=e["threshold"]),
}


def test_real_rows_are_typed_and_constructors_match_the_guard(faulty):
    _, rows, _ = faulty
    assert {r["kind"] for r in rows} == set(BUILD)
    for row in rows:
        f = F.finding_from_row(row)
        assert type(f) is F.REGISTRY[row["kind"]]
        assert (f.step, f.action) == (row["step"], row["action"])
        own = _own(row)
        if row["kind"] == "loss_spike":
            own.pop("grad_norm", None)  # the gradient spike it caused, attached by the guard
        built = BUILD[row["kind"]](row["evidence"])
        assert built.evidence == own, row["kind"]
        # the row's severity is the finding's, except that only an abort is fatal
        assert row["severity"] == row_severity(built.severity, row["action"]), row["kind"]


def test_real_rows_summaries(faulty):
    _, rows, res = faulty
    by = {}
    for row in rows:
        by.setdefault(row["kind"], []).append(F.finding_from_row(row))
    # one NaN pixel in one sample: the summary names the sample the guard dropped
    assert by["bad_batch"][0].summary().startswith("max |x| of the batch = nan; samples: index ")
    assert by["bad_batch"][0].summary().endswith("(non-finite input)")
    assert by["bad_batch"][1].summary().startswith("max |x| of the batch = 1e+04 (×1e+04 the "
                                                   "usual")
    assert by["out_of_memory"][0].summary() == "out of memory at micro-batch 8 -> 4"
    assert by["loss_spike"][0].summary().startswith("loss ")
    assert "its t-bucket" in by["loss_spike"][0].summary()
    assert "largest grad: " in by["loss_spike"][0].summary()
    assert by["nonfinite_params"][0].summary() == \
        f"non-finite params: {VICTIM}; {VICTIM}: 1 non-finite of 2304 elements"
    assert f"non-finite grads: {VICTIM}" in by["nonfinite_grad"][0].summary()
    jump = by["weight_jump"][0].summary()
    assert jump.startswith(f"param norm jump in one step: {VICTIM} ×") and "," not in \
        jump.split("(")[0]  # only the parameter past the threshold is named
    assert "the peak so far" in by["lr_spike"][0].summary()
    # the guard's one-screen summary says the same
    for fs in by.values():
        assert fs[0].summary() in res.guard_summary
    for row in rows:
        f = F.finding_from_row(row)
        assert f.recommendation(F.RunContext()), row["kind"]
        assert f.cost.summary()


def test_recommendations():
    ctx = F.RunContext(lr=2e-4, warmup_steps=100, precision="fp16")
    bad = [F.finding_from_row({"kind": "bad_batch", "step": s, "evidence":
                               {"max_abs_input": 412.0}, "cost": {"batch_position": s + 1}})
           for s in (4, 9)]
    assert bad[0].recommendation(ctx, bad).startswith(
        "check the data: the batch at step 4, 9 had values outside [-1, 1] (max |x| = 412; "
        "data-stream batch position 5, 10)")
    spike = F.finding_from_row({"kind": "grad_spike", "step": 5000, "evidence": {}})
    assert "lower the peak LR (optim.lr=0.0002)" in spike.recommendation(ctx)
    nf = F.finding_from_row({"kind": "nonfinite_loss", "step": 5000, "evidence": {
        "provenance": {"first_nonfinite_module": "mid.attn.attn",
                       "first_overflow_module": "mid.attn"}}})
    rec = nf.recommendation(ctx)
    assert "first module to overflow fp16 was mid.attn: use bf16" in rec
    assert "first module to go non-finite was mid.attn.attn; enable QK-norm" in rec
    assert "lower the peak LR" not in rec  # late, no rising trend: the LR is not the lever
    rising = F.RunContext(lr=2e-4, warmup_steps=100, grad_norm_trend=5.0)
    assert "already rising" in nf.recommendation(rising)
    fb = F.finding_from_row({"kind": "fp16_overflow", "action": "precision_fallback"})
    assert fb.recommendation() == F.USE_BF16
    qk = F.finding_from_row({"kind": "attention_logit_growth", "evidence": {"module": "a"}})
    assert "QK-norm" in qk.recommendation() and "QK" not in qk.recommendation(
        F.RunContext(qk_norm=True))
    assert "schedule" in F.finding_from_row({"kind": "lr_spike"}).recommendation()


def test_attention_upcast_says_what_changed_and_what_to_set():
    f = F.AttentionUpcast.new(module="mid.attn.attn", loss=float("nan"), loss_scale=65536.0,
                              provenance={"first_nonfinite_module": "mid.attn.attn.proj"})
    row = {"step": 2, "kind": f.kind, "severity": f.severity, "evidence": f.evidence,
           "action": "attention_upcast"}
    g = F.finding_from_row(json.loads(json.dumps(row, default=str)))
    assert type(g) is F.AttentionUpcast and g.where() == "mid.attn.attn"
    assert g.summary().startswith("fp16 overflow in the attention of mid.attn.attn: its q kᵀ "
                                  "and softmax now run in fp32")
    rec = g.recommendation()
    assert "set model.upcast_attention=true from the start" in rec and "mid.attn.attn" in rec
    assert "qk_norm" in rec and "qk_norm" not in g.recommendation(F.RunContext(qk_norm=True))


# --------------------------------------------------------------------------- rows as written


ROWS = [  # rows the guard writes for kinds a tiny CPU run does not reach
    {"step": 40, "kind": "nonfinite_loss", "severity": "fatal", "action": "rollback",
     "evidence": {"loss": "nan", "grad_norm": "nan", "rank": 1,
                  "provenance": {"first_nonfinite_module": "down.0.res.0.norm1",
                                 "nonfinite_grad_params": [], "reproduced": True}},
     "cost": {"steps_redone": 4, "batches_skipped": 5, "skipped_batches": [36, 41],
              "restored_step": 36},
     "diagnosis": {"reason": "state unusable", "lr_factor": 0.5, "lr_restored_at_step": 236}},
    {"step": 900, "kind": "divergence", "severity": "trend", "action": "rollback",
     "evidence": {"smoothed_loss": 0.3, "best_smoothed_loss": 0.1, "ratio": 3.0,
                  "threshold_ratio": 1.5, "window": 1000}},
    {"step": 3, "kind": "fp16_overflow", "severity": "spike", "action": "skip",
     "evidence": {"loss": "inf", "loss_scale": 65536.0, "provenance": None,
                  "note": "an activation exceeded the fp16 range in the forward pass"}},
    {"step": 7, "kind": "fp16_overflow", "severity": "trend", "action": "precision_fallback",
     "evidence": {"overflows_in_window": 8, "window": 100, "limit": 8, "loss_scale": 1.0,
                  "precision": "fp16", "provenance": {"first_overflow_module": "mid.attn"}},
     "diagnosis": {"new_precision": "bf16"}},
    {"step": 120, "kind": "skip_budget", "severity": "fatal", "action": "abort",
     "evidence": {"skips": 101, "max_skips": 100, "window": 1000},
     "diagnosis": {"why": "more than 100 skipped steps within 1000"}},
    {"step": 300, "kind": "rank_mismatch", "severity": "fatal", "action": "resync",
     "evidence": {"ranks_differing": [1], "source_rank": 0, "world_size": 2,
                  "fingerprints": [[1, 2], [1, 3]], "note": F.RankMismatch.NOTE},
     "diagnosis": {"why": "rank(s) [1] resynchronized from rank 0"}},
    {"step": 50, "kind": "adapter_base_modified", "severity": "fatal", "action": "abort",
     "evidence": {"expected_sha256": "a" * 64, "found_sha256": "b" * 64,
                  "note": F.AdapterBaseModified.NOTE}},
    {"step": 9, "kind": "adapter_delta_clamp", "severity": "warn", "action": "rescale_delta",
     "evidence": F.AdapterDeltaClamp.new(module="mid.attn.attn.qkv", ratio=1.7,
                                         max_delta_ratio=1.0, modules=["mid.attn.attn.qkv"],
                                         ratios=[1.7]).evidence,
     "cost": {"modules_rescaled": 1}},
]

SUMMARIES = [
    "loss nan, grad norm nan; first non-finite module: down.0.res.0.norm1; first seen on rank 1",
    "smoothed loss 0.3 = ×3 its best 0.1 (threshold ×1.5, window 1000 steps)",
    "an activation exceeded the fp16 range in the forward pass (loss inf, loss scale 6.554e+04)",
    "8 fp16 overflows within 100 steps (limit 8); loss scale 1; first fp16 overflow: mid.attn",
    "101 skipped steps within 1000 (at most 100)",
    "rank(s) [1] differ bitwise from rank 0 (world size 2)",
    "the frozen base weights changed: sha256 aaaaaaaaaaaa -> bbbbbbbbbbbb",
    "|dW|/|W| of mid.attn.attn.qkv = 1.7 > adapter.max_delta_ratio=1; 1 module(s) rescaled",
]


@pytest.mark.parametrize("row,want", list(zip(ROWS, SUMMARIES)), ids=[r["kind"] for r in ROWS])
def test_rows_as_the_guard_writes_them(row, want):
    f = F.finding_from_row(row)
    assert type(f) is F.REGISTRY[row["kind"]]
    assert f.summary() == want
    assert f.recommendation()


def test_cost_and_diagnosis_summaries():
    f = F.finding_from_row(ROWS[0])
    assert f.cost.summary() == "4 step(s) redone, 5 batch(es) skipped, restored step 36"
    assert f.diagnosis.summary() == "state unusable; LR ×0.5 until step 236"
    assert f.where() == "down.0.res.0.norm1"
    assert F.finding_from_row(ROWS[3]).diagnosis.summary() == "precision -> bf16"
    odd = F.finding_from_row({"kind": "x", "cost": {"new_key": 3}, "diagnosis": "text"})
    assert odd.cost.summary() == "new_key: 3" and odd.diagnosis.summary() == "value: text"


def test_unknown_kinds_and_odd_rows_never_raise():
    f = F.finding_from_row({"step": 5, "kind": "from_the_future", "severity": "spike",
                            "action": "quarantine", "evidence": {"module": "m", "x": "nan",
                                                                 "note": "hello"}})
    assert type(f) is F.Finding and f.kind == "from_the_future"
    assert f.summary() == "module=m; x=nan; hello" and f.where() == "m"
    assert f.recommendation()
    own = F.finding_from_row({"kind": "new_kind", "evidence": {"recommendation": "do X"}})
    assert own.recommendation() == "do X"  # a newer kind that carries its own advice
    for row in (None, {}, {"evidence": [1, 2]}, {"kind": 3, "step": "nan", "evidence": "?"}):
        g = F.finding_from_row(row)
        assert isinstance(g.summary(), str) and g.recommendation() and g.where() is None
    # every record, with no evidence or with garbage in every field
    for kind, cls in F.REGISTRY.items():
        for ev in ({}, {k: "nan" for k in ("loss", "grad_norm", "ratio", "z", "lr", "module",
                                            "params", "norm_ratio", "threshold", "provenance",
                                            "modules", "top_grad_layers", "health")},
                   {"provenance": {"nonfinite_grad_params": 5, "first_nonfinite_module": 3,
                                   "first_overflow_module": 4}, "params": 7,
                    "top_grad_layers": [1], "health": [None, {"kind": 2}]}):
            g = F.finding_from_row({"kind": kind, "evidence": ev, "cost": None})
            assert type(g) is cls and isinstance(g.summary(), str) and g.recommendation()


# --------------------------------------------------------------------------- one advice


def test_report_and_doctor_give_the_same_advice(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(load_config(None, TINY_MODEL).to_yaml())
    row = {"step": 4, "kind": "bad_batch", "severity": "fatal", "action": "skip",
           "evidence": {"max_abs_input": "nan", "note": "x"},
           "cost": {"steps_redone": 0, "batches_skipped": 1, "batch_position": 5}}
    (run / "incidents.jsonl").write_text(json.dumps(row) + "\n")
    (run / "metrics.jsonl").write_text(json.dumps({"step": 4, "loss": 0.5}) + "\n")
    f = F.finding_from_row(row)
    rec = f.recommendation(F.RunContext.from_config(read_run(run).config))
    d = diagnose(run, probe=False)
    cause = next(c for c in d.causes if c.check == "incidents")
    assert cause.recommendation == rec and cause.evidence["first"] == f.summary()
    page = render(read_run(run))
    assert esc(rec) in page and esc(f.summary()) in page


def test_every_kind_is_explained_in_the_guide():
    """docs/guard.md has an entry per incident kind (what it means, what the guard did, what
    to change): the kinds are listed once, in findings.py, and the guide follows them."""
    guide = (Path(__file__).resolve().parents[1] / "docs" / "guard.md").read_text()
    missing = [k for k in get_args(F.IncidentKind) if f"### `{k}`" not in guide]
    assert not missing, missing
