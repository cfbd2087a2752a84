"""The guard names the cause and repairs it (issue 13): each fault injected into the real
step, through ``steadydiff.train`` (what a user runs) and through the trainer's own loop
(``Run`` from test_guard.py, which shows the state between steps).

- a sample that is bad every time it is drawn: dropped from its step (the rest of the batch
  trains), named (index, micro-batch, file), quarantined the second time, kept out of the
  data stream, saved in the checkpoint (exact resume), listed by the report and ``doctor``;
- an LR that creeps up: ``lr_too_high``, rolled back to before the growth, the LR capped;
- a weight corrupted between two steps: named before any batch is blamed, rolled back at
  once, no data skipped;
- the short-window trend detector on its own.
"""

import json
import math

import numpy as np
import pytest
import torch
from PIL import Image

import steadydiff
from steadydiff.config import load_config
from steadydiff.doctor import diagnose, format_diagnosis
from steadydiff.guard.detectors import Trend
from steadydiff.trainer import checkpoint as ckpt

from test_guard import VICTIM, Run, incidents, metrics, tiny  # noqa: E402
from tiny import TINY_MODEL  # noqa: E402


def folder(tmp_path, n_per_class=8):
    """Two class folders of small gray PNGs (16 images: two batches of 8 per epoch)."""
    g = np.random.default_rng(0)
    for c in ("a", "b"):
        d = tmp_path / "images" / c
        d.mkdir(parents=True)
        for i in range(n_per_class):
            Image.fromarray(g.integers(0, 256, (8, 8), dtype=np.uint8)).save(d / f"{i:02d}.png")
    return tmp_path / "images"


def folder_cfg(root, *extra, faults=()):
    return load_config(None, TINY_MODEL + [
        "data.dataset=folder", f"data.path={root}", "data.class_labels=true",
        "data.channels=1", "model.num_classes=2", "train.steps=12",
        "train.checkpoint_every=6", "sample.num=2", "sample.steps=2", "logging.log_every=1",
        "guard.warmup_steps=4", "guard.snapshot_every=3", *extra,
        f"faults={json.dumps(list(faults))}"])


BAD = 5  # the dataset index of the corrupt sample (a.05.png: sorted paths, class a first)


def test_recurring_bad_sample_is_dropped_named_and_quarantined(tmp_path):
    root = folder(tmp_path)
    run = tmp_path / "run"
    cfg = folder_cfg(root, faults=[{"kind": "bad_sample", "step": 0, "index": BAD}])
    res = steadydiff.train(cfg, out_dir=run)
    assert res.steps == 12
    rows = incidents(run)
    kinds = [(r["kind"], r["action"]) for r in rows]
    # drawn twice (once per epoch of two batches), dropped each time, quarantined the second
    assert kinds == [("bad_batch", "drop_samples"), ("bad_batch", "drop_samples"),
                     ("sample_quarantined", "quarantine")]
    for r in rows[:2]:
        (s,) = r["evidence"]["samples"]
        assert s["index"] == BAD and s["why"] == "non-finite input"
        assert s["source"].endswith("a/05.png") and s["micro_batch"] == 0
        assert r["cost"]["samples_dropped"] == 1 and r["cost"]["batches_skipped"] == 0
    q = rows[2]["evidence"]
    assert q["index"] == BAD and q["source"].endswith("a/05.png") and q["times"] == 2
    # no batch was thrown away: every step trained, the loss is finite throughout
    m = metrics(run)
    assert [r["step"] for r in m] == list(range(1, 13))
    assert all(math.isfinite(r["loss"]) for r in m) and m[-1]["skipped_steps"] == 0
    # the quarantine is in the checkpoint, and the doctor and the report name the file
    c = ckpt.load_checkpoint(res.checkpoint)
    assert c.state["guard"]["quarantine"] == [BAD]
    assert "a/05.png" in (run / "report.html").read_text()
    told = format_diagnosis(diagnose(run, probe=False))
    assert "a/05.png" in told and "quarantine" in told


def test_a_quarantined_sample_is_never_drawn_again_and_resume_is_exact(tmp_path):
    """After the quarantine the data stream leaves the sample out (the fault never fires
    again); a run resumed from a checkpoint taken after it equals the uninterrupted one."""
    root = folder(tmp_path)
    faults = [{"kind": "bad_sample", "step": 0, "index": BAD}]
    r = Run(folder_cfg(root, faults=faults))
    r.until(12)
    fired = [f["step"] for f in r.state.faults.fired if f["kind"] == "bad_sample"]
    assert len(fired) == 2 and r.guard.quarantine == {BAD}
    assert all(a == "step" for _, a in r.decisions)  # nothing skipped, nothing rolled back

    whole = tmp_path / "whole"
    steadydiff.train(folder_cfg(root, faults=faults), out_dir=whole)
    part = tmp_path / "part"
    steadydiff.train(folder_cfg(root, "train.steps=6", faults=faults), out_dir=part)
    res = steadydiff.train(folder_cfg(root, faults=faults), out_dir=part)
    a = ckpt.load_checkpoint(ckpt.latest_good(whole / "checkpoints"))
    b = ckpt.load_checkpoint(res.checkpoint)
    assert a.step == b.step == 12
    for k in a.model:
        assert torch.equal(a.model[k], b.model[k]), k
    assert a.state["guard"]["quarantine"] == b.state["guard"]["quarantine"] == [BAD]


def test_bad_sample_in_a_micro_batch_is_named_and_the_rest_trains(tmp_path):
    """Gradient accumulation: the bad sample's micro-batch is named; the step is redone on
    the other seven samples (the step's per-sample losses have seven entries)."""
    root = folder(tmp_path)
    r = Run(folder_cfg(root, "train.grad_accum=2",
                       faults=[{"kind": "bad_sample", "step": 0, "index": BAD}]))
    while not r.guard.incidents:
        r.step()
    inc = r.guard.incidents[0]
    (s,) = inc.evidence["samples"]
    assert inc.action == "drop_samples" and s["index"] == BAD
    assert s["micro_batch"] == s["position"] // 4
    assert r.decisions[-1][1] == "step"
    assert torch.isfinite(torch.stack([p.detach().sum() for p in r.state.model.parameters()])).all()


def test_lr_ramp_is_named_lr_too_high_rolled_back_before_it_and_capped(tmp_path):
    """An LR that grows 10% per step (a scheduler bug) from step 30: the growth (or the spikes
    it ends in) is named for its cause, the run rolls back to a snapshot from before the growth,
    the LR is capped at half the last stable one (saved in the checkpoint), and the run
    finishes without skipping data or aborting."""
    run = tmp_path / "run"
    cfg = tiny("train.steps=110", "train.checkpoint_every=0", "guard.warmup_steps=10",
               "guard.snapshot_every=10", "guard.trend_window=24",
               faults=[{"kind": "lr_ramp", "step": 30, "factor": 1.1, "steps": 200}])
    res = steadydiff.train(cfg, out_dir=run)
    assert res.steps == 110
    rows = incidents(run)
    (lr,) = [r for r in rows if r["kind"] == "lr_too_high"]
    e, cost, diag = lr["evidence"], lr["cost"], lr["diagnosis"]
    # named by the trend itself, or by the spikes it ended in (which of the two comes first
    # depends on the optimizer kernel's rounding: the fused AdamW's run rises steadily)
    assert lr["action"] == "rollback" and e.get("symptom") in (None, "grad_spike", "loss_spike")
    assert e["lr_start"] < e["lr_end"] and 30 <= e["trend_start_step"] <= lr["step"]
    assert cost["restored_step"] <= e["trend_start_step"] and cost["batches_skipped"] == 0
    assert diag["lr_cap"] == pytest.approx(0.5 * e["lr_start"])
    assert not any(r["kind"] == "lr_too_high" for r in rows[rows.index(lr) + 1:])
    # from the rollback on, the applied LR never exceeds the cap
    m = metrics(run)
    back = max(i for i in range(1, len(m)) if m[i]["step"] <= m[i - 1]["step"])
    after = m[back:]  # the rows written after the rollback
    assert after[0]["step"] == cost["restored_step"] + 1
    assert after and all(r["lr"] * r["lr_factor"] <= diag["lr_cap"] * (1 + 1e-6) for r in after)
    c = ckpt.load_checkpoint(res.checkpoint)
    assert c.state["guard"]["lr_cap"] == pytest.approx(diag["lr_cap"])


def test_weight_corrupted_between_steps_is_named_and_rolled_back_at_once(tmp_path):
    """One element of a weight becomes 1e36 between two steps: the weight check before the
    forward names the parameter (and how many of its elements are bad) and the guard rolls
    back at once, blaming and skipping no batch."""
    run = tmp_path / "run"
    res = steadydiff.train(tiny(faults=[{"kind": "weight_corrupt", "step": 7,
                                         "target": VICTIM}]), out_dir=run)
    assert res.steps == 12
    (row,) = incidents(run)
    e = row["evidence"]
    assert (row["kind"], row["action"], row["step"]) == ("weight_jump", "rollback", 7)
    assert e["when"] == "before_forward" and e["params"][0] == VICTIM
    (el, *_) = e["elements"]
    assert el["param"] == VICTIM and el["huge"] == 1 and el["nonfinite"] == 0
    assert el["numel"] == 2304 and el["max_abs"] == pytest.approx(1e36)
    assert row["cost"] == {"steps_redone": 1, "batches_skipped": 0, "skipped_positions": [],
                           "restored_step": 6}


# --------------------------------------------------------------------------- the detector


def _feed(trend, lrs, grads, losses):
    for s, (lr, g, lo) in enumerate(zip(lrs, grads, losses)):
        trend.observe(s, lr, g, lo)
    return trend.check()


def test_trend_detector_relates_sustained_growth_to_the_lr():
    n = 30
    up = [1.0 * 1.05 ** i for i in range(n)]           # x4.3 over the window
    loss_up = [0.5 * 1.02 ** i for i in range(n)]      # x1.8
    noisy = [u * (1.3 if i % 5 == 0 else 1.0) for i, u in enumerate(up)]  # spikes ignored
    f = _feed(Trend(n, 2.0, 1.2, 1.1, warmup=0), [1e-3 * 1.05 ** i for i in range(n)],
              noisy, loss_up)
    assert f is not None and f.kind == "lr_too_high"
    assert f.evidence["lr_end"] > f.evidence["lr_start"] and f.evidence["trend_start_step"] < 10
    f = _feed(Trend(n, 2.0, 1.2, 1.1, warmup=0), [1e-3] * n, up, loss_up)
    assert f is not None and f.kind == "divergence" and "trend_start_step" in f.evidence
    # a healthy warm-up: the LR and the grad norm rise, the loss falls
    f = _feed(Trend(n, 2.0, 1.2, 1.1, warmup=0), [1e-3 * (i + 1) / n for i in range(n)], up,
              [1.0 * 0.97 ** i for i in range(n)])
    assert f is None
    # noise around a level is no trend; nor is anything before the warm-up has passed
    g = torch.Generator().manual_seed(0)
    flat = (1 + 0.3 * torch.rand(n, generator=g)).tolist()
    assert _feed(Trend(n, 2.0, 1.2, 1.1, warmup=0), [1e-3] * n, flat, flat) is None
    assert _feed(Trend(n, 2.0, 1.2, 1.1, warmup=10), [1e-3] * n, up, loss_up) is None


def _spiky_guard():
    from torch import nn
    from steadydiff import Guard
    model = nn.Linear(2, 2)
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), num_timesteps=100,
                  config={"warmup_steps": 0, "t_buckets": 4})
    for _ in range(20):
        guard.loss.observe([1.0, 1.0, 1.0, 1.0])  # every bucket's loss about 1
    return guard


def _buckets(ps, t):
    return [float(ps[(t * 4 // 100) == b].mean()) for b in range(4)]


def test_a_loss_spike_is_pinned_on_the_fewest_samples_that_explain_it():
    """One sample with 400x the usual loss fires its t-bucket; without it the bucket would
    not: that sample, and only it, is named. When more than sample_drop_max of the batch is
    off, it is the batch's (or the model's) problem: nobody is singled out."""
    guard = _spiky_guard()
    t = torch.tensor([5, 30, 55, 80] * 4)
    ps = torch.ones(16)
    ps[6] = 400.0  # t=55: bucket 2
    f = guard.loss.check(_buckets(ps, t))
    assert f is not None and f.kind == "loss_spike" and f.evidence["t_bucket"] == 2
    samples = guard._attribute(f, t, ps, None, torch.arange(100, 116), 1, 1)
    assert [s["index"] for s in samples] == [106]
    assert samples[0]["position"] == 6 and samples[0]["why"] == "loss far above its t-bucket's"
    many = torch.ones(16)
    many[[2, 6, 10, 14]] = 400.0  # all of bucket 2: 4 of 16 = at the limit
    many[[1, 5]] = 400.0          # and two more: over it
    f = guard.loss.check(_buckets(many, t))
    assert guard._attribute(f, t, many, None, torch.arange(16), 1, 1) is None


class _Captioned(torch.utils.data.Dataset):
    """A user's own dataset: (image, label) pairs and a ``path_of(i)`` naming its files."""

    def __init__(self, n=16):
        g = torch.Generator().manual_seed(0)
        self.x = torch.rand(n, 1, 8, 8, generator=g) * 2 - 1
        self.y = torch.arange(n) % 2
        self.num_classes = 2

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], int(self.y[i])

    def path_of(self, i):
        return f"/data/mine/{i:03d}.png"


def test_quarantine_works_for_a_users_own_dataset(tmp_path):
    """steadydiff.train with a Dataset of one's own: the bad item is named by index and by
    the dataset's own ``path_of``, and quarantined the same way."""
    run = tmp_path / "run"
    cfg = tiny("model.num_classes=2", "train.steps=8", faults=[
        {"kind": "bad_sample", "step": 0, "index": 3}])
    res = steadydiff.train(cfg, out_dir=run, dataset=_Captioned())
    assert res.steps == 8
    rows = incidents(run)
    assert [(r["kind"], r["action"]) for r in rows] == [
        ("bad_batch", "drop_samples"), ("bad_batch", "drop_samples"),
        ("sample_quarantined", "quarantine")]
    assert rows[2]["evidence"]["index"] == 3
    assert rows[2]["evidence"]["source"] == "/data/mine/003.png"


# --------------------------------------------------------------------------- transient faults


def test_a_step_that_is_finite_when_run_again_is_a_transient_fault(tmp_path):
    """A NaN activation the first time step 7 runs, and never again (a flaky device): the
    guard runs the step once more with the same data, timesteps and noise, takes that update
    and skips no data; the incident says transient_fault, the summary counts it."""
    run = tmp_path / "run"
    res = steadydiff.train(tiny(faults=[{"kind": "transient_nan", "step": 7}]), out_dir=run)
    assert res.steps == 12
    (row,) = incidents(run)
    assert (row["kind"], row["action"], row["step"]) == ("transient_fault", "rerun", 7)
    assert row["evidence"]["first"] == "nonfinite_loss"
    assert row["cost"] == {"steps_redone": 0, "batches_skipped": 0, "reruns": 1}
    assert "1 transient fault(s)" in res.guard_summary
    m = metrics(run)
    assert [r["step"] for r in m] == list(range(1, 13)) and m[-1]["skipped_steps"] == 0
    # the re-run's update is the clean run's: the same weights at the end
    clean = steadydiff.train(tiny(), out_dir=tmp_path / "clean")
    a, b = ckpt.load_checkpoint(res.checkpoint), ckpt.load_checkpoint(clean.checkpoint)
    for k in a.model:
        assert torch.equal(a.model[k], b.model[k]), k


def test_a_fault_that_repeats_on_the_rerun_is_persistent(tmp_path):
    """A NaN gradient injected every time step 7 is computed: non-finite again on the re-run,
    so it is persistent and handled as before (skipped), with the re-run noted."""
    run = tmp_path / "run"
    steadydiff.train(tiny(faults=[{"kind": "grad_nan", "step": 7, "target": VICTIM}]),
                     out_dir=run)
    (row,) = incidents(run)
    assert (row["kind"], row["action"]) == ("nonfinite_grad", "skip")
    assert row["evidence"]["rerun"].endswith("persistent")


def test_many_transient_faults_on_one_rank_are_a_hardware_finding():
    from steadydiff.guard import findings as F
    rows = [{"kind": "transient_fault", "step": s, "evidence": {"first": "nonfinite_loss",
                                                                "rank": 1}}
            for s in (10, 50, 90)]
    group = [F.finding_from_row(r) for r in rows]
    advice = group[0].recommendation(F.RunContext(), group)
    assert "3 transient faults on rank 1's device" in advice and "hardware" in advice
    one = group[0].recommendation(F.RunContext(), group[:1])
    assert one.startswith("a one-off")


def test_spikes_that_keep_coming_are_not_pinned_on_samples():
    """Right after a spike was skipped (or pinned on samples), a new loss spike is the
    model's: an unstable model spikes on many samples, and dropping them would hide it."""
    guard = _spiky_guard()
    t = torch.tensor([5, 30, 55, 80] * 4)
    ps = torch.ones(16)
    ps[6] = 400.0
    f = guard.loss.check(_buckets(ps, t))
    guard.progress.step = 40
    guard.skips.append(35)  # a grad spike was skipped 5 steps ago
    assert guard._attribute(f, t, ps, None, torch.arange(16), 1, 1) is None
    guard.skips.clear()
    assert guard._attribute(f, t, ps, None, torch.arange(16), 1, 1) is not None
