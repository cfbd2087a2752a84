"""The stability guard, tested by injecting each fault into the real step function.

Two drivers, no mocks:
- ``steadydiff.train(cfg)`` with a ``faults:`` list (what a user runs; checks incidents.jsonl,
  metrics rows and the checkpoints on disk);
- :func:`drive`, the trainer's own loop shape over ``train_step`` (build_state + attach_guard),
  which lets a test look at the state between steps: the decision, the EMA at every step,
  the state right after a rollback (bit-equal to the snapshot), the data position.

Then unit tests of the pieces: the per-t-bucket loss-spike detector against a global one, the
grad-norm z-score warm-up, slow divergence, the clipping modes in closed form, the
attention/normalization probes, provenance, and the guard's state round trip.
"""

import json
import math
import subprocess
import sys

import pytest
import torch
import yaml
from torch import nn

import steadydiff
from steadydiff.config import GuardConfig, load_config
from steadydiff.data import build_dataset, make_loader
from steadydiff.guard import Guard, GuardAbort, clipping, probes, provenance
from steadydiff.guard.detectors import BucketLossSpike, Divergence, GradSpike, RunningStats
from steadydiff.models import build_model
from steadydiff.trainer import checkpoint as ckpt
from steadydiff.trainer import speed
from steadydiff.trainer.loop import attach_guard, build_state, configure_runtime, \
    handle_decision, train_step
from steadydiff.trainer.optim import lr_at

from tiny import TINY_MODEL  # noqa: E402  (tests/tiny.py)

TINY = TINY_MODEL + [
    "train.steps=12", "train.checkpoint_every=4", "sample.num=2", "sample.steps=2",
    "logging.log_every=1",
    # a tiny run needs the guard's clocks scaled down with it
    "guard.warmup_steps=4", "guard.snapshot_every=3",
]
FP16 = ["train.precision=fp16", "train.allow_slow_precision=true", "train.batch_size=4",
        "train.checkpoint_every=0"]
VICTIM = "mid.res.0.conv1.weight"  # the parameter the param/grad faults corrupt


def tiny(*extra, faults=()):
    return load_config(None, TINY + list(extra) + [f"faults={json.dumps(list(faults))}"])


def incidents(run_dir):
    p = run_dir / "incidents.jsonl"
    return [json.loads(l) for l in p.read_text().splitlines()] if p.exists() else []


def metrics(run_dir):
    return [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]


def finite(tensors):
    return all(bool(torch.isfinite(t).all()) for t in tensors if t.is_floating_point())


def assert_checkpoints_finite(run_dir):
    paths = ckpt.list_checkpoints(run_dir / "checkpoints")
    for p in paths:
        c = ckpt.load_checkpoint(p)
        assert finite(c.model.values()) and finite(c.ema.values()), p
        assert finite(v for s in c.optimizer["state"].values() for v in s.values()), p
    return paths


class Run:
    """The trainer's loop (trainer/loop.py ``run``) over the real ``train_step``, opened up:
    every decision, the batch indices trained on and the EMA are visible between steps."""

    def __init__(self, cfg, run_dir=None):
        self.cfg = cfg
        self.device = torch.device("cpu")
        configure_runtime(cfg, self.device)
        torch.set_num_threads(1)
        self.data = build_dataset(cfg.data)
        self.state = build_state(cfg, self.data.num_classes, self.device)
        self.guard = attach_guard(self.state, run_dir, self.data)
        self.decisions, self.trained_on = [], []  # (step, action), batch positions stepped
        self._open()

    def _open(self):
        self.pos = self.state.batches_consumed
        self.batches = iter(make_loader(self.data, batch_size=self.cfg.train.batch_size,
                                        seed=self.cfg.train.seed, start_batch=self.pos,
                                        exclude=self.guard.quarantine if self.guard else ()))

    def step(self):
        """One call of train_step; returns its decision (a per-step check: attach_guard's
        default; the deferred one is tests/test_deferred.py's)."""
        s, pos = self.state, self.pos
        out = train_step(s, next(self.batches))
        self.pos += 1
        d = out.decision
        self.decisions.append((d.step, d.action))
        how = handle_decision(s, d, say=lambda _msg: None)  # the loop's own handler
        if how == "rolled_back":
            del self.trained_on[s.step:]  # the undone steps are not part of the trajectory
        elif how == "stepped":
            self.trained_on.append(pos)
        if s.batches_consumed != self.pos or d.quarantined:
            self._open()  # the data continues where the guard says
        return d

    def until(self, steps, every=None):
        while self.state.step < steps:
            d = self.step()
            if every is not None:
                every(self, d)


# =================================================================== every fault, end to end

# kind, fault fields, expected incident kind, expected action, evidence check
CASES = {
    # one NaN pixel in one sample: that sample is dropped, the rest of the batch trains
    "nan_batch": ({"step": 5}, "bad_batch", "drop_samples",
                  lambda e: e["max_abs_input"] == "nan" and len(e["samples"]) == 1
                  and e["samples"][0]["why"] == "non-finite input"
                  and e["samples"][0]["position"] == 0 and e["samples"][0]["micro_batch"] == 0),
    "outlier_batch": ({"step": 11, "factor": 1e4}, "bad_batch", "skip",
                      lambda e: e["max_abs_input"] > 1e3 * e["usual_max_abs_input"]),
    "loss_scale": ({"step": 7, "factor": 1e8}, "loss_spike", "skip",
                   lambda e: e["ratio"] > 1e6 and 0 <= e["t_bucket"] < 10
                   and e["top_grad_layers"][0]["param"]),
    "param_nan": ({"step": 7, "target": VICTIM}, "nonfinite_params", "rollback",
                  lambda e: e["params"] == [VICTIM]),
    "param_huge": ({"step": 7, "factor": 1e3, "target": VICTIM}, "weight_jump", "rollback",
                   lambda e: e["params"][0] == VICTIM and e["norm_ratio"][0] > 100),
    "grad_nan": ({"step": 7, "target": VICTIM}, "nonfinite_grad", "skip",
                 lambda e: e["provenance"]["nonfinite_grad_params"] == [VICTIM]),
}


def test_lr_fault_is_caught_before_the_update(tmp_path):
    """An LR x1e4 is seen before it touches the weights (lr_spike): skipped while it lasts,
    escalated to a rollback (which spends the transient fault), then training goes on."""
    run = tmp_path / "run"
    res = steadydiff.train(tiny(faults=[{"kind": "lr_scale", "step": 7, "factor": 1e4,
                                         "steps": 2}]), out_dir=run)
    rows = incidents(run)
    assert res.steps == 12 and [r["kind"] for r in rows] == ["lr_spike"] * 3
    assert [r["action"] for r in rows] == ["skip", "skip", "rollback"]
    e = rows[0]["evidence"]
    assert e["ratio"] == pytest.approx(1e4) and e["lr"] == pytest.approx(1e4 * e["max_lr_so_far"])
    for c in ckpt.list_checkpoints(run / "checkpoints"):
        ckpt.load_checkpoint(c)  # refuses non-finite weights


@pytest.mark.parametrize("kind", list(CASES))
def test_fault_through_train(tmp_path, kind):
    """steadydiff.train with the fault: the run finishes, incidents.jsonl names the cause and
    the action, and every checkpoint on disk is finite."""
    fields, want_kind, want_action, check = CASES[kind]
    run = tmp_path / "run"
    res = steadydiff.train(tiny(faults=[{"kind": kind, **fields}]), out_dir=run)
    assert res.steps == 12 and res.incidents == 1
    (row,) = incidents(run)
    assert row["step"] == fields["step"]
    assert (row["kind"], row["action"]) == (want_kind, want_action)
    assert check(row["evidence"]), row["evidence"]
    if want_action == "skip":
        assert row["cost"] == {"steps_redone": 0, "batches_skipped": 1,
                               "batch_position": fields["step"]}
    elif want_action == "drop_samples":
        assert row["cost"] == {"samples_dropped": 1, "steps_redone": 0, "batches_skipped": 0,
                               "batch_position": fields["step"]}
    else:  # snapshot at step 6 (every 3): one step redone, only batch 7 (whose update went
        # bad) not trained on; batch 6 is trained on again
        assert row["cost"] == {"steps_redone": 1, "batches_skipped": 1,
                               "skipped_positions": [7], "restored_step": 6}
        assert row["diagnosis"]["lr_factor"] == 0.5
    assert want_kind in res.guard_summary
    paths = assert_checkpoints_finite(run)
    assert [p.name for p in paths][0] == "step_00000012"
    assert all(math.isfinite(r["loss"]) for r in metrics(run))


@pytest.mark.parametrize("kind", list(CASES))
def test_fault_in_train_step_ema_never_nonfinite(kind):
    """The same faults through train_step: the decision at the fault's step, and the weights
    and the EMA finite after every call (a skipped or rolled-back step never reaches them)."""
    fields, want_kind, want_action, _ = CASES[kind]
    r = Run(tiny(faults=[{"kind": kind, **fields}]))
    ema_updates = []

    def check(r, d):
        assert finite(r.state.model.parameters()), (d.step, d.action)
        assert finite(r.state.ema.module.parameters()), (d.step, d.action)
        ema_updates.append(r.state.ema.num_updates)

    r.until(12, every=check)
    acted = [(s, a) for s, a in r.decisions if a != "step"]
    # dropping a sample is a step (the rest of the batch trained)
    assert [a for _, a in acted] == ([] if want_action == "drop_samples" else [want_action])
    assert r.guard.incidents[0].action == want_action
    assert r.guard.incidents[0].kind == want_kind
    # the EMA moved only on applied steps, and a rollback restored it with the weights: one
    # update per step of the final trajectory
    assert r.state.ema.num_updates == 12
    assert r.state.step == 12


# =================================================================== rollback, exactly


def _snapshot_tensors(snap):
    out = {f"model.{k}": v for k, v in snap.model.items()}
    out.update({f"ema.{k}": v for k, v in snap.ema["module"].items()})
    for i, s in snap.optimizer["state"].items():
        out.update({f"opt.{i}.{k}": v for k, v in s.items()})
    return out


def _live_tensors(state):
    out = {f"model.{k}": v for k, v in state.model.state_dict().items()}
    out.update({f"ema.{k}": v for k, v in state.ema.module.state_dict().items()})
    for i, s in state.optimizer.state_dict()["state"].items():
        out.update({f"opt.{i}.{k}": v for k, v in s.items()})
    return out


@pytest.mark.parametrize("skip_batches,new_pos,skipped", [(0, 6, (7,)),
                                                          (5, 11, (6, 7, 8, 9, 10))])
def test_rollback_restores_snapshot_bit_equal_and_skips_data(skip_batches, new_pos, skipped):
    """param_nan at step 7, snapshot at step 6 (data position 6): the state after the
    rollback equals the snapshot bit for bit (model, EMA, optimizer moments, RNG), and the
    data continues at the snapshot's position, skipping only the batch whose update went bad
    (7), plus the first ``skip_batches`` from the snapshot's position when configured."""
    r = Run(tiny(f"guard.skip_batches={skip_batches}",
                 faults=[{"kind": "param_nan", "step": 7, "target": VICTIM}]))
    r.until(7)
    snap = r.guard.ring.newest()
    assert (snap.step, snap.batches_consumed) == (6, 6)
    expect = {k: v.clone() for k, v in _snapshot_tensors(snap).items()}
    d = r.step()
    assert d.action == "rollback" and d.incident.kind == "nonfinite_params"
    assert (d.step, d.data_position) == (6, new_pos)
    assert d.skipped_batches == skipped
    assert (r.state.step, r.state.batches_consumed) == (6, new_pos)
    live = _live_tensors(r.state)
    assert live.keys() == expect.keys()
    for k in expect:
        assert torch.equal(live[k], expect[k]), k  # bit-equal, NaN-free
    assert r.state.ema.num_updates == snap.ema["num_updates"]
    assert torch.equal(torch.get_rng_state(), snap.rng)
    cost = d.incident.cost
    assert cost["skipped_positions"] == list(skipped) and cost["steps_redone"] == 1
    assert cost["batches_skipped"] == len(skipped)
    # the next batch trained on is the one at the new position, the skipped ones never are,
    # and the run goes on
    r.until(12)
    assert r.trained_on[6] == new_pos
    assert set(skipped).isdisjoint(r.trained_on[6:])
    assert r.trained_on[6:] == sorted(r.trained_on[6:])
    assert finite(r.state.model.parameters())


def test_lr_backoff_then_restore(tmp_path):
    """After a rollback the optimizer steps with lr x lr_backoff for lr_backoff_steps steps,
    then with the scheduled LR again. Observed inside optimizer.step (a pre-step hook) and in
    the metrics rows' lr_factor."""
    extra = ["guard.lr_backoff=0.25", "guard.lr_backoff_steps=3", "optim.warmup_steps=20"]
    faults = [{"kind": "param_nan", "step": 7, "target": VICTIM}]
    r = Run(tiny(*extra, faults=faults))
    seen = []
    r.state.optimizer.register_step_pre_hook(
        lambda opt, a, k: seen.append((r.state.step, opt.param_groups[0]["lr"])))
    r.until(12)
    # steps 0-6 at the scheduled LR; the failing step 7; rollback to 6; 6, 7, 8 backed off
    steps = [s for s, _ in seen]
    assert steps == [0, 1, 2, 3, 4, 5, 6, 7, 6, 7, 8, 9, 10, 11]
    factors = [lr / lr_at(s, r.cfg.optim, 12) for s, lr in seen]
    assert factors == pytest.approx([1.0] * 8 + [0.25] * 3 + [1.0] * 3)
    # the scheduled LR is left in the param groups (the factor is applied around the step)
    assert r.state.optimizer.param_groups[0]["lr"] == pytest.approx(lr_at(11, r.cfg.optim, 12))
    # the same through steadydiff.train: metrics rows carry the factor of the step they log
    run = tmp_path / "run"
    steadydiff.train(tiny(*extra, faults=faults), out_dir=run)
    f = {row["step"]: row["lr_factor"] for row in metrics(run)}
    assert [f[s] for s in range(7, 13)] == [0.25, 0.25, 0.25, 1.0, 1.0, 1.0]


# =================================================================== abort


ABORT_FAULTS = [{"kind": "param_nan", "step": 7, "target": VICTIM},
                {"kind": "param_nan", "step": 8, "target": VICTIM}]


def test_abort_when_budget_exhausted(tmp_path):
    """max_rollbacks=1 and the fault comes back after the first rollback: GuardAbort, with an
    abort incident that says why, and no checkpoint of the broken state."""
    run = tmp_path / "run"
    with pytest.raises(GuardAbort, match="1 rollbacks within 1000 steps") as e:
        steadydiff.train(tiny("guard.max_rollbacks=1", faults=ABORT_FAULTS), out_dir=run)
    rows = incidents(run)
    assert [(r["step"], r["kind"], r["action"]) for r in rows] == [
        (7, "nonfinite_params", "rollback"), (8, "nonfinite_params", "abort")]
    assert e.value.incident.action == "abort"
    # step 8's checkpoint was written after the redone steps 6-7, before the second fault
    paths = assert_checkpoints_finite(run)
    assert [p.name for p in paths] == ["step_00000008", "step_00000004"]
    # the guard's last verified snapshot (step 6) is older than step 8's checkpoint: no
    # abort point is written, and the suggestion resumes from the newest checkpoint
    point = json.loads((run / "summary.json").read_text())["abort"]
    assert point["checkpoint"] is None and point["checkpoint_step"] == 8
    assert all("abort" not in json.loads((p / "state.json").read_text()) for p in paths)


def test_abort_leaves_its_last_verified_state_to_resume(tmp_path, capsys):
    """No checkpoint before the abort (checkpoint_every beyond it): the guard's last verified
    snapshot (step 6) is written as a normal, verified checkpoint marked as the abort point,
    and the suggested command (optim.lr times the guard's backoff) resumes it and trains on."""
    from steadydiff.cli import main

    run = tmp_path / "run"
    cfg = tiny("guard.max_rollbacks=1", "train.checkpoint_every=100", "optim.lr=1e-3",
               faults=ABORT_FAULTS)
    with pytest.raises(GuardAbort) as e:
        steadydiff.train(cfg, out_dir=run)
    (path,) = assert_checkpoints_finite(run)
    assert path.name == "step_00000006" and ckpt.verify_checkpoint(path) == []
    c = ckpt.load_checkpoint(path)
    assert c.state["abort"] == {"step": 8, "reason": str(e.value)}
    assert c.state["step"] == 6 and c.state["batches_consumed"] == 6
    assert c.state["guard"]["rollbacks"] == [] and c.state["guard"]["lr_factor"] == 1.0
    summary = json.loads((run / "summary.json").read_text())
    point = summary["abort"]
    assert summary["steps"] == 8 and point["checkpoint"] == str(path)
    assert point["lr"] == 5e-4 and point["lr_factor"] == 0.5  # optim.lr 1e-3 x the backoff
    assert point["resume"] == (f"steadydiff train {run / 'config.yaml'} --out {run} --set "
                               "optim.lr=0.0005 --allow-config-change")
    assert "abort point: wrote" in capsys.readouterr().out
    # the report's verdict and the doctor's abort cause show where to resume, and how
    from steadydiff.doctor import diagnose

    page = (run / "report.html").read_text()
    assert f"abort point: {path}, the guard&#x27;s last verified state (step 6)" in page
    assert point["resume"] in page
    cause = diagnose(run, probe=False).causes[0]
    assert cause.check == "run_aborted" and point["resume"] in cause.recommendation
    assert cause.evidence["abort_point"]["checkpoint"] == str(path)

    # the suggested command, without the injected faults (they would strike again)
    rc = main(point["resume"].split()[1:] + ["--set", "faults=[]"])
    out = capsys.readouterr().out
    assert rc == 0 and f"resumed from {path} at step 6" in out
    assert "optim.lr: 0.001 -> 0.0005" in out
    assert json.loads((run / "summary.json").read_text())["status"] == "finished"
    assert steadydiff.load(run).step == 12


def test_cli_abort_exit_code_3(tmp_path):
    """Through the CLI: exit code 3, the summary printed."""
    raw = load_config(None, TINY + ["guard.max_rollbacks=1", "optim.lr=1e-3"]).to_dict()
    raw["faults"] = ABORT_FAULTS
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    p = subprocess.run([sys.executable, "-m", "steadydiff.cli", "train", str(cfg),
                        "--out", str(tmp_path / "run")], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 3, p.stderr[-2000:]
    assert "aborted:" in p.stderr
    # the abort point is older than step 8's checkpoint: resume from the newest, at half LR
    assert ("to resume from the newest checkpoint with the LR the guard found safe "
            "(optim.lr 0.001 x 0.5, the guard's LR backoff at the abort):\n  steadydiff train "
            f"{tmp_path / 'run' / 'config.yaml'} --out {tmp_path / 'run'} --set optim.lr=0.0005 "
            "--allow-config-change") in p.stderr
    assert "guard: 2 incidents" in p.stdout and "nonfinite_params" in p.stdout
    assert "-> abort" in p.stdout


# =================================================================== mixed precision, OOM


def test_fp16_overflow_names_module():
    """fp16, an activation pushed past the fp16 range in one module: the scaler skips the
    step, and the incident names the injected module as the first overflow."""
    target = "down.1.res.0"
    r = Run(tiny(*FP16, "train.steps=4",
                 faults=[{"kind": "fp16_overflow", "step": 2, "target": target}]))
    ema_ok = []
    r.until(4, every=lambda r, d: ema_ok.append(finite(r.state.ema.module.parameters())))
    assert all(ema_ok)
    assert ("skip" in [a for _, a in r.decisions]) and r.guard.scaler_skips == 1
    (inc,) = r.guard.incidents
    assert (inc.step, inc.kind, inc.action) == (2, "fp16_overflow", "skip")
    prov = inc.evidence["provenance"]
    assert prov["first_overflow_module"] == target
    assert prov["first_nonfinite_module"] == target
    assert r.state.precision == "fp16" and r.state.scaler.get_scale() == 32768.0


def test_fp16_persistent_overflow_falls_back(tmp_path):
    """An activation overflow in the attention block's output (its residual add, which an
    fp32 attention cannot fix) in three steps in a row: the first remedy, upcasting the
    block's attention, does not help, so at the next overflow the guard leaves fp16 (for
    bf16 where the device runs it natively, else fp32) and the metrics rows show it."""
    run = tmp_path / "run"
    faults = [{"kind": "fp16_overflow", "step": s, "target": "mid.attn"} for s in (1, 2, 3)]
    res = steadydiff.train(tiny(*FP16, "train.steps=5", "guard.overflow_limit=8",
                                faults=faults), out_dir=run)
    assert res.steps == 5
    rows = incidents(run)
    assert [(r["step"], r["kind"], r["action"]) for r in rows][:2] == [
        (1, "attention_upcast", "attention_upcast"), (2, "fp16_overflow", "precision_fallback")]
    assert rows[0]["evidence"]["module"] == "mid.attn.attn"
    assert "persists after its attention upcast" in rows[1]["diagnosis"]["reason"]
    new = rows[1]["diagnosis"]["new_precision"]
    assert new in ("bf16", "fp32")
    assert rows[1]["evidence"]["provenance"]["first_overflow_module"] == "mid.attn"
    precisions = [m["precision"] for m in metrics(run)]
    assert precisions[0] == "fp16" and precisions[-1] == new
    assert all(m["grad_scale"] is None for m in metrics(run) if m["precision"] != "fp16")
    assert_checkpoints_finite(run)
    c = ckpt.load_checkpoint(res.checkpoint)
    assert c.state["precision"] == new and c.state["scaler"] is None


ATTN = "mid.attn.attn"  # the tiny UNet's middle attention layer


def test_attention_overflow_is_upcast_and_training_stays_fp16():
    """q and k grown until the logits pass 65504 (attn_logit_overflow, in force for steps
    2-6): the replay traces the NaN to the attention layer, the guard skips that one step and
    upcasts that layer's attention; the following steps, with the fault still in force, train
    in fp16 and stay finite; no global fallback. A rollback later (a NaN weight at step 7)
    restores weights, not the upcast."""
    r = Run(tiny(*FP16, "train.steps=9", faults=[
        {"kind": "attn_logit_overflow", "step": 2, "steps": 5, "target": ATTN},
        {"kind": "param_nan", "step": 7, "target": VICTIM}]))
    layer = r.state.model.mid.attn.attn
    assert layer.upcast_attention is False
    r.until(9)
    kinds = [(i.step, i.kind, i.action) for i in r.guard.incidents]
    assert kinds == [(2, "attention_upcast", "attention_upcast"),
                     (7, "nonfinite_params", "rollback")]
    inc = r.guard.incidents[0]
    assert inc.evidence["module"] == ATTN
    assert inc.evidence["provenance"]["first_nonfinite_module"].startswith(ATTN + ".")
    # the fault really was in force after the upcast, and those steps trained in fp16
    assert [f["step"] for f in r.state.faults.fired if f["kind"] == "attn_logit_overflow"] \
        == [2, 3, 4, 5, 6]
    assert [(s, a) for s, a in r.decisions if a != "step"] == [(2, "skip"), (6, "rollback")]
    assert r.state.precision == "fp16" and r.state.scaler is not None
    assert layer.upcast_attention is True and r.guard.upcast == [ATTN]
    assert r.state.ema.module.mid.attn.attn.upcast_attention is True  # the EMA samples
    assert finite(r.state.model.parameters()) and finite(r.state.ema.module.parameters())
    # the set of upcast layers is guard state: a resumed guard re-applies it to a fresh model
    s = json.loads(json.dumps(r.guard.state_dict()))
    fresh = Run(tiny(*FP16, "train.steps=9"))
    assert fresh.state.model.mid.attn.attn.upcast_attention is False
    fresh.guard.load_state_dict(s)
    assert fresh.state.model.mid.attn.attn.upcast_attention is True
    assert fresh.state.ema.module.mid.attn.attn.upcast_attention is True
    assert fresh.guard.upcast == [ATTN]


def test_overflow_elsewhere_after_an_upcast_still_falls_back():
    """After the attention layer was upcast (step 1), an overflow in a residual block (no
    attention to upcast) repeats: the scaler's rules, then the global fallback."""
    r = Run(tiny(*FP16, "train.steps=5", "guard.overflow_limit=3", faults=[
        {"kind": "attn_logit_overflow", "step": 1, "steps": 4, "target": ATTN},
        *({"kind": "fp16_overflow", "step": s, "target": "down.1.res.0"} for s in (2, 3))]))
    r.until(5)
    kinds = [(i.step, i.kind, i.action) for i in r.guard.incidents]
    assert kinds == [(1, "attention_upcast", "attention_upcast"), (2, "fp16_overflow", "skip"),
                     (3, "fp16_overflow", "precision_fallback")]
    assert "attention_module" not in r.guard.incidents[1].evidence
    assert r.state.precision in ("bf16", "fp32") and r.guard.upcast == [ATTN]
    assert finite(r.state.model.parameters())


def test_model_upcast_attention_sets_every_layer():
    r = Run(tiny(*FP16, "train.steps=3", "model.upcast_attention=true", faults=[
        {"kind": "attn_logit_overflow", "step": 1, "steps": 2, "target": ATTN}]))
    layers = [m for m in r.state.model.modules() if hasattr(m, "upcast_attention")]
    assert layers and all(m.upcast_attention for m in layers)
    r.until(3)  # upcast from the start: the grown logits never overflow
    assert r.guard.incidents == [] and r.state.precision == "fp16"
    from steadydiff.config import ModelConfig
    dit = build_model(ModelConfig(kind="dit", upcast_attention=True), image_size=8, channels=1)
    layers = [m for m in dit.modules() if hasattr(m, "upcast_attention")]
    assert layers and all(m.upcast_attention for m in layers)


def test_unfused_fp16_attention_overflows_and_upcast_does_not():
    """The mechanism the fault reproduces, on the layer alone: q kᵀ past 65504 is inf in an
    unfused fp16 attention (NaN after the softmax), finite with upcast_attention, and the
    upcast output equals the fp32 attention (to fp16 rounding)."""
    from steadydiff.models.layers import Attention
    torch.manual_seed(0)
    layer = Attention(16, 2)
    x = torch.randn(2, 6, 16)
    with torch.no_grad():
        layer.qkv.weight[:32] *= 300  # W_q, W_k grown
        want = layer(x)  # fp32
        assert want.isfinite().all()
        with torch.autocast("cpu", dtype=torch.float16):
            layer.fused = False
            assert not layer(x).isfinite().all()
            layer.upcast_attention = True
            for fused in (False, True):
                layer.fused = fused
                got = layer(x)
                assert got.dtype == torch.float16 and got.isfinite().all()
                assert torch.allclose(got.float(), want, rtol=2e-2, atol=2e-2 * want.abs().max())


def test_oom_halves_micro_batch_keeps_global_batch(tmp_path):
    """A memory limit from step 3 on: the micro-batch halves, grad_accum doubles, the global
    batch (images per step) stays 8."""
    run = tmp_path / "run"
    res = steadydiff.train(tiny(faults=[{"kind": "oom", "step": 3, "factor": 0}]), out_dir=run)
    assert res.steps == 12
    (row,) = incidents(run)
    assert (row["step"], row["kind"], row["action"]) == (3, "out_of_memory",
                                                         "microbatch_backoff")
    assert row["evidence"]["micro_batch"] == 8 and row["diagnosis"]["new_micro_batch"] == 4
    rows = metrics(run)
    assert [m["micro_batch"] for m in rows] == [8, 8, 8] + [4] * 9
    assert all(m["images_seen"] == 8 * m["step"] for m in rows)
    c = ckpt.load_checkpoint(res.checkpoint)
    assert c.state["grad_accum"] == 2


def test_oom_at_first_step_equals_grad_accum_run(tmp_path):
    """OOM at step 0 then two micro-batches of 4 is exactly the run configured with
    grad_accum=2: same weights, bit for bit."""
    a = steadydiff.train(tiny("train.steps=4", faults=[{"kind": "oom", "step": 0,
                                                        "factor": 4}]), out_dir=tmp_path / "a")
    b = steadydiff.train(tiny("train.steps=4", "train.grad_accum=2"), out_dir=tmp_path / "b")
    ca, cb = ckpt.load_checkpoint(a.checkpoint), ckpt.load_checkpoint(b.checkpoint)
    for k in ca.model:
        assert torch.equal(ca.model[k], cb.model[k]), k
        assert torch.equal(ca.ema[k], cb.ema[k]), k


def test_faults_leave_the_config_unchanged(tmp_path):
    """The injector keeps what it learns while running (the micro-batch an ``oom`` fault
    settled on, the default strength of a fault) as its own state: the user's validated
    config, and the config the run saves, stay what the user wrote."""
    from steadydiff.guard.faults import FaultInjector, SimulatedOOM

    cfg = tiny("train.steps=3", "train.checkpoint_every=0",
               faults=[{"kind": "oom", "step": 1, "factor": 0}])
    before = cfg.to_dict()
    res = steadydiff.train(cfg, out_dir=tmp_path / "run")
    assert res.steps == 3 and [r["action"] for r in incidents(tmp_path / "run")] == [
        "microbatch_backoff"]
    assert cfg.to_dict() == before and cfg.faults[0].factor == 0
    saved = speed.resolve(cfg, torch.device("cpu"))[0].to_dict()  # its `auto`s resolved only
    assert ckpt.load_checkpoint(res.checkpoint).state["config"] == saved
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text()) == saved

    faults = tiny(faults=[{"kind": "oom", "step": 0}, {"kind": "outlier_batch", "step": 0}]).faults
    inj = FaultInjector(faults)
    with pytest.raises(SimulatedOOM, match="micro-batch 8 > 4"):
        inj.micro_batch(0, 8)
    inj.micro_batch(0, 4)  # the limit stays 4, not half of 4
    with pytest.raises(SimulatedOOM, match="micro-batch 5 > 4"):
        inj.micro_batch(0, 5)
    assert torch.equal(inj.batch(0, torch.ones(1)), torch.full((1,), 1e4))
    assert [f.factor for f in faults] == [None, None]


def test_oom_without_backoff_aborts(tmp_path):
    with pytest.raises(GuardAbort, match="out of memory at step 2"):
        steadydiff.train(tiny("guard.oom_backoff=false",
                              faults=[{"kind": "oom", "step": 2, "factor": 0}]),
                         out_dir=tmp_path / "run")
    (row,) = incidents(tmp_path / "run")
    assert (row["kind"], row["action"]) == ("out_of_memory", "abort")


# =================================================================== detectors


def _batch(rng, buckets):
    """Per-bucket mean losses and the global mean of a batch whose samples fall in
    ``buckets``; eps-prediction-like levels: ~1.0 near t=0 down to ~0.01 near t=T."""
    losses = [0.6 ** b * (1 + 0.1 * (rng.random() - 0.5)) for b in buckets]
    sums, counts = [0.0] * 10, [0] * 10
    for b, v in zip(buckets, losses):
        sums[b] += v
        counts[b] += 1
    return [s / n if n else None for s, n in zip(sums, counts)], losses


def test_bucket_loss_spike_judges_against_its_own_bucket():
    import random
    rng = random.Random(0)
    det = BucketLossSpike(10, momentum=0.97, z_max=6.0, ratio_min=3.0, warmup=20)
    glob = RunningStats(0.97)  # what a global detector tracks: the log batch-mean loss
    for _ in range(200):  # batches of 16 with uniformly drawn timesteps
        means, losses = _batch(rng, [rng.randrange(10) for _ in range(16)])
        assert det.check(means) is None
        det.observe(means)
        glob.update(math.log(sum(losses) / len(losses)))

    # one sample near t=T with the loss that is normal near t=0: x100 its own bucket
    means, losses = _batch(rng, [rng.randrange(9) for _ in range(15)] + [9])
    means[9] = losses[-1] = 1.0
    f = det.check(means)
    assert f is not None and f.kind == "loss_spike"
    assert f.evidence["t_bucket"] == 9 and f.evidence["t_bucket_range"] == [0.9, 1.0]
    assert f.evidence["ratio"] > 50 and f.evidence["buckets_over"] == 1
    z_spike = glob.z(math.log(sum(losses) / len(losses)), min_std=0.05)

    # a healthy batch whose timesteps all fell near t=0 (a high loss, normal for t near 0)
    means, losses = _batch(rng, [0] * 16)
    assert det.check(means) is None
    z_benign = glob.z(math.log(sum(losses) / len(losses)), min_std=0.05)

    # a global detector misses the spike at z=6 (the batch mean barely moves), and any
    # threshold low enough to catch it also fires on the healthy t~0 batch
    assert z_spike < 6.0 and z_benign > z_spike


def test_grad_spike_warmup_and_firing():
    import random
    rng = random.Random(1)
    det = GradSpike(momentum=0.97, z_max=6.0, warmup=20)
    for i in range(20):
        assert det.check(1e6 if i == 10 else 1.0) is None  # silent while warming up
        det.observe(1.0 + 0.1 * (rng.random() - 0.5))
    assert det.check(1.02) is None
    f = det.check(50.0)
    assert f is not None and f.kind == "grad_spike" and f.evidence["z"] > 6.0
    assert f.evidence["threshold"] == 6.0
    # ZClip's threshold: mean + z·std of the same statistics
    s = det.stats
    assert det.clip_value() == pytest.approx(s.mean + 6.0 * math.sqrt(s.var))


def test_divergence_slow_rise_fires_flat_noise_does_not():
    import random
    rng = random.Random(2)
    # the loss creeps up 0.2% per step (never a spike), x3 over 600 steps
    div = Divergence(window=200, ratio=1.5, warmup=10)
    spikes = BucketLossSpike(1, 0.97, 6.0, 3.0, 10)
    fired = None
    for i in range(600):
        loss = math.exp(0.002 * i) * (1 + 0.1 * (rng.random() - 0.5))
        assert spikes.check([loss]) is None  # no single step is a spike
        spikes.observe([loss])
        f = div.check_and_observe(loss)
        if f is not None:
            fired = (i, f)
            break
    assert fired is not None
    i, f = fired
    assert f.kind == "divergence" and f.evidence["ratio"] > 1.5 and 200 <= i < 450
    # a flat, noisy loss (+-40%) for 3000 steps: silent
    div = Divergence(window=200, ratio=1.5, warmup=10)
    for _ in range(3000):
        assert div.check_and_observe(1.0 * (1 + 0.8 * (rng.random() - 0.5))) is None


def test_divergence_in_the_guard_rolls_back_to_oldest_snapshot():
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    g = Guard(model, opt, config=dict(divergence_window=20, divergence_ratio=1.5,
                                      warmup_steps=2, snapshot_every=5, snapshots=3))
    d = None
    for i in range(200):
        loss = model(torch.ones(1, 4)).sum() * 0 + math.exp(0.02 * i)
        loss.backward()
        d = g.step(loss)
        if d.action != "step":
            break
    assert d.action == "rollback" and d.incident.kind == "divergence"
    assert d.incident.diagnosis["reason"] == "slow divergence"
    assert d.incident.cost["restored_step"] == g.progress.step


# =================================================================== clipping, closed form


def _params(*grads, weights=None):
    ps = []
    for i, g in enumerate(grads):
        w = weights[i] if weights else torch.ones_like(g)
        p = nn.Parameter(w.clone())
        p.grad = g.clone()
        ps.append(p)
    return ps


def test_clip_global():
    ps = _params(torch.tensor([3.0, 4.0]), torch.tensor([0.0, 0.0, 12.0]))  # total norm 13
    clipping.clip(ps, "global", 1.3, clipping.total_norm(ps))
    assert torch.allclose(ps[0].grad, torch.tensor([0.3, 0.4]), atol=1e-6)
    assert torch.allclose(ps[1].grad, torch.tensor([0.0, 0.0, 1.2]), atol=1e-6)
    ps = _params(torch.tensor([0.3, 0.4]))  # under the limit: untouched
    clipping.clip(ps, "global", 1.0, clipping.total_norm(ps))
    assert torch.equal(ps[0].grad, torch.tensor([0.3, 0.4]))


def test_clip_per_layer():
    ps = _params(torch.tensor([3.0, 4.0]), torch.tensor([0.0, 0.0, 12.0]),
                 torch.tensor([0.3, 0.4]))
    clipping.clip(ps, "per_layer", 1.0, clipping.total_norm(ps))
    # each tensor bounded on its own: the small one is not shrunk by the big ones
    assert torch.allclose(ps[0].grad, torch.tensor([0.6, 0.8]), atol=1e-5)
    assert torch.allclose(ps[1].grad, torch.tensor([0.0, 0.0, 1.0]), atol=1e-5)
    assert torch.equal(ps[2].grad, torch.tensor([0.3, 0.4]))


def test_clip_agc_unit_wise():
    # rows are units: |w| = 5, 0 (floored at 1e-3), 10; lambda = 0.1
    w = torch.tensor([[3.0, 4.0], [0.0, 0.0], [6.0, 8.0]])
    g = torch.tensor([[30.0, 40.0], [1.0, 0.0], [0.3, 0.4]])
    bias_w, bias_g = torch.tensor([2.0, 0.0]), torch.tensor([0.0, 20.0])
    ps = _params(g, bias_g, weights=[w, bias_w])
    clipping.clip(ps, "agc", 0.1, clipping.total_norm(ps))
    assert torch.allclose(ps[0].grad[0], torch.tensor([0.3, 0.4]), atol=1e-5)   # 50 -> 0.5
    assert torch.allclose(ps[0].grad[1], torch.tensor([1e-4, 0.0]), atol=1e-8)  # -> 1e-4
    assert torch.equal(ps[0].grad[2], torch.tensor([0.3, 0.4]))  # 0.5 <= 1.0: untouched
    assert torch.allclose(ps[1].grad, torch.tensor([0.0, 0.2]), atol=1e-6)  # 1-d: whole norm


def test_clip_zclip():
    ps = _params(torch.tensor([3.0, 4.0]))
    clipping.clip(ps, "zclip", 1.0, clipping.total_norm(ps), zclip_value=2.5)
    assert torch.allclose(ps[0].grad, torch.tensor([1.5, 2.0]), atol=1e-6)
    ps = _params(torch.tensor([3.0, 4.0]))  # statistics not warm yet: the fallback threshold
    clipping.clip(ps, "zclip", 1.0, clipping.total_norm(ps), zclip_value=None)
    assert torch.allclose(ps[0].grad, torch.tensor([0.6, 0.8]), atol=1e-6)
    with pytest.raises(ValueError, match="valid: global, per_layer, agc, zclip"):
        clipping.clip(ps, "bogus", 1.0, clipping.total_norm(ps))


def test_zclip_in_the_guard_uses_running_stats():
    """In the guard, zclip caps the norm at mean + grad_z·std of the grad-norm history. A
    norm over that cap but under the spike threshold (whose std is floored at 5% of the
    mean) is clipped to the cap and applied."""
    model = nn.Linear(3, 1, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    g = Guard(model, opt, clip_mode="zclip", clip=0.0, config=dict(warmup_steps=5, grad_z=2.0))
    x = torch.tensor([[1.0, 0.0, 0.0]])  # grad of k·w·x has norm k
    for i in range(8):  # grad norms 1.00, 1.01, 1.00, ...
        model(x).sum().mul(1.0 + 0.01 * (i % 2)).backward()
        assert g.step(torch.tensor(1.0)).action == "step"
    cap = g.grad.clip_value()
    assert 1.0 < cap < 1.05
    seen = []
    opt.register_step_pre_hook(lambda o, a, k: seen.append(model.weight.grad.norm().item()))
    model(x).sum().mul(1.05).backward()
    assert g.step(torch.tensor(1.0)).action == "step"
    assert seen[0] == pytest.approx(cap, rel=1e-5)


# =================================================================== probes, provenance


def _unet(**over):
    cfg = load_config(None, TINY + [f"model.{k}={v}" for k, v in over.items()])
    torch.manual_seed(0)
    return build_model(cfg.model, image_size=8, channels=1).eval()


def _forward(model, n=2):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, 1, 8, 8, generator=gen)
    t = torch.tensor([10, 90][:n])
    y = torch.zeros(n, dtype=torch.long)
    return lambda: model(x, t, y)


def _thresholds():
    c = GuardConfig()
    return dict(logit_limit=c.attn_logit_limit, entropy_min=c.attn_entropy_min,
                var_ratio=c.norm_var_ratio, affine_limit=c.norm_affine_limit)


def test_probe_healthy_model_is_quiet():
    m = _unet()
    stats = probes.probe(m, _forward(m))
    assert set(stats["attn"]) == {"down.1.attn.0.attn", "mid.attn.attn", "up.1.attn.0.attn",
                                  "up.1.attn.1.attn"}
    assert probes.findings(stats, **_thresholds()) == []


def test_probe_attention_logit_growth_names_the_module():
    m = _unet()
    with torch.no_grad():
        m.mid.attn.attn.qkv.weight.mul_(30)
    stats = probes.probe(m, _forward(m))
    found = [f for f in probes.findings(stats, **_thresholds())
             if f.kind == "attention_logit_growth"]
    assert [f.evidence["module"] for f in found] == ["mid.attn.attn"]
    assert found[0].evidence["max_logit"] > 50 and "qk_norm" in found[0].evidence["recommendation"]
    # QK-norm is the cure: the same scaling leaves the logits bounded
    m = _unet(qk_norm="true")
    with torch.no_grad():
        m.mid.attn.attn.qkv.weight.mul_(30)
    stats = probes.probe(m, _forward(m))
    assert not [f for f in probes.findings(stats, **_thresholds())
                if f.kind == "attention_logit_growth"]


def test_probe_norm_eps_dominated_and_affine_exploded():
    net = nn.Sequential(nn.Conv2d(1, 8, 1), nn.GroupNorm(4, 8, eps=1e-5), nn.Conv2d(8, 8, 1),
                        nn.GroupNorm(4, 8))
    x = 0.3 + 1e-4 * torch.randn(2, 1, 4, 4)  # near-constant input

    with torch.no_grad():
        net[0].weight.fill_(1.0)
        net[0].bias.zero_()
        net[3].weight.fill_(1e5)
    stats = probes.probe(net, lambda: net(x))
    kinds = {(f.kind, f.evidence["module"]) for f in probes.findings(stats, **_thresholds())}
    assert ("norm_eps_dominated", "1") in kinds
    assert ("norm_affine_exploded", "3") in kinds
    assert stats["norm"]["1"]["median_var"] < 1e-5 and stats["norm"]["3"]["affine_max"] == 1e5


def test_guard_probe_every_records_warnings(tmp_path):
    """With guard.probe_every the trainer runs the probes on real data; a warning is an
    incident with action warn (training goes on), said once, not every probe."""
    r = Run(tiny("guard.probe_every=2", "train.steps=6"), run_dir=tmp_path)
    with torch.no_grad():
        r.state.model.mid.attn.attn.qkv.weight.mul_(30)
    r.until(6)
    warns = [i for i in r.guard.incidents if i.action == "warn"]
    assert {w.evidence["module"] for w in warns} == {"mid.attn.attn"}
    kinds = [w.kind for w in warns]
    assert "attention_logit_growth" in kinds and len(kinds) == len(set(kinds))  # said once
    assert r.guard.counts["warnings"] == len(warns)
    assert {i["action"] for i in incidents(tmp_path)} == {"warn"}


def test_grown_qk_is_seen_by_the_default_probe_cadence():
    """Attention health is on by default: q and k grown (attn_logit_overflow, in fp32 where
    it overflows nothing) from the start give no finding of any other kind, and the guard's
    own probe at step 100 (guard.probe_every's default; the layer statistics, which also
    probe, are off here) reports attention_logit_growth for the layer (and the entropy
    collapse that logits this large cause), once each."""
    assert GuardConfig().probe_every == 100
    r = Run(tiny("train.steps=100", "logging.layer_stats_every=0", faults=[
        {"kind": "attn_logit_overflow", "step": 0, "steps": 100, "target": ATTN}]))
    r.until(99)
    assert r.guard.incidents == []  # nothing sees it between probes
    r.until(100)
    assert [(i.step, i.kind, i.action, i.evidence["module"]) for i in r.guard.incidents] == [
        (100, "attention_logit_growth", "warn", ATTN),
        (100, "attention_entropy_collapse", "warn", ATTN)]
    assert r.guard.incidents[0].evidence["max_logit"] > 1e5 > r.guard.incidents[0].evidence[
        "limit"]


def test_provenance_names_first_nonfinite_module():
    m = _unet().train()
    with torch.no_grad():
        m.mid.res[1].conv1.weight.view(-1)[0] = float("nan")
    fwd = _forward(m)
    out = provenance.trace(m, lambda i: fwd().square().mean(), 1)
    assert out["reproduced"] and not out["loss_finite"]
    assert out["first_nonfinite_module"] == "mid.res.1.conv1"
    assert out["first_overflow_module"] is None
    # the first parameters whose gradients went non-finite, in backward order
    assert out["nonfinite_grad_count"] > 0 and out["nonfinite_grad_params"][0].startswith("out.")
    assert all(p.grad is None for p in m.parameters())  # the replay leaves no gradients


def test_provenance_clean_step_not_reproduced():
    m = _unet().train()
    fwd = _forward(m)
    assert provenance.trace(m, lambda i: fwd().square().mean(), 1) == {"reproduced": False}


# =================================================================== guard state


def test_guard_state_round_trip_keeps_detector_stats():
    # (sample_drop_max=0: the NaN batch is skipped whole, so there is a skip to keep)
    r = Run(tiny("train.steps=8", "guard.sample_drop_max=0",
                 faults=[{"kind": "nan_batch", "step": 5}]))
    r.until(8)
    g = r.guard
    s = json.loads(json.dumps(g.state_dict()))  # checkpoints store it as JSON
    assert s["grad"][2] == 8 and s["counts"]["skips"] == 1  # 8 healthy steps observed
    fresh = Run(tiny("train.steps=8", "guard.sample_drop_max=0"))
    fresh.guard.load_state_dict(s)
    h = fresh.guard
    # (the number of incidents is the next test's business)
    assert {k: v for k, v in h.state_dict().items() if k != "incidents"} == \
        {k: v for k, v in g.state_dict().items() if k != "incidents"}
    assert (h.grad.stats.mean, h.grad.stats.var, h.grad.stats.count) == \
        (g.grad.stats.mean, g.grad.stats.var, g.grad.stats.count)
    assert [st.state() for st in h.loss.stats] == [st.state() for st in g.loss.stats]
    assert h.divergence.state() == g.divergence.state()
    assert list(h.skips) == list(g.skips) == [5]


def test_resume_keeps_guard_state(tmp_path):
    run = tmp_path / "run"
    steadydiff.train(tiny("train.steps=4"), out_dir=run)
    c = ckpt.load_checkpoint(ckpt.latest_good(run / "checkpoints"))
    saved = c.state["guard"]
    assert saved["grad"][2] == 4
    res = steadydiff.train(tiny("train.steps=6", "guard.warmup_steps=100"), out_dir=run,
                           allow_config_change=True)
    c = ckpt.load_checkpoint(res.checkpoint)
    assert c.state["guard"]["grad"][2] == 6  # continued from 4, not restarted at 0


def test_incident_count_survives_resume(tmp_path):
    """The metrics rows' ``incidents`` keeps counting across a resume, like ``skipped_steps``
    and ``rollbacks`` do (the guard state saves the count)."""
    run = tmp_path / "run"
    steadydiff.train(tiny("train.steps=4", "guard.sample_drop_max=0",
                          faults=[{"kind": "nan_batch", "step": 2}]), out_dir=run)
    steadydiff.train(tiny("train.steps=6", "guard.sample_drop_max=0"), out_dir=run,
                     allow_config_change=True)
    last = metrics(run)[-1]
    assert last["skipped_steps"] == 1
    assert last["incidents"] == 1


def test_skip_budget_counts_skips_spread_over_the_window(tmp_path):
    """A corrupt batch every 4th step: each skip is alone within skip_window=2 (so none
    escalates), but the budget counts all of them within budget_window, and the 4th skip is
    one more than max_skips=3: abort (the escalation check used to forget old skips before
    the budget saw them, so spread-out skips never ended the run)."""
    faults = [{"kind": "nan_batch", "step": s} for s in (1, 4, 7, 10)]
    cfg = tiny("train.steps=14", "guard.skip_window=2", "guard.max_skips=3",
               "guard.budget_window=1000", "train.checkpoint_every=0",
               "guard.sample_drop_max=0", faults=faults)
    with pytest.raises(GuardAbort, match="more than 3 skipped steps within 1000"):
        steadydiff.train(cfg, out_dir=tmp_path / "run")
    rows = incidents(tmp_path / "run")
    assert [(r["kind"], r["action"]) for r in rows] == [("bad_batch", "skip")] * 4 + [
        ("skip_budget", "abort")]
