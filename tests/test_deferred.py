"""The deferred check (``guard.check_every``, issue 17): no host read per step, and the same
run as the per-step check.

The guard judges a window of steps at once; a step that fails sends the run back to the
window's start and is judged on its own. The claim is exact: on the CPU (deterministic) a
run with ``check_every = K`` makes the same decisions at the same steps, writes the same
incidents and metrics, and ends with the same weights, bit for bit, as ``check_every = 1``,
for every fault the guard handles. And between the window's ends the guarded step reads
nothing on the host (counted at the one choke point, :mod:`steadydiff.hostsync`).
"""

from __future__ import annotations

import json

import pytest
import torch

from steadydiff import hostsync
from steadydiff.config import load_config
from steadydiff.data import build_dataset, make_loader
from steadydiff.trainer import checkpoint as ckpt
from steadydiff.trainer import loop
from steadydiff.trainer.loop import (attach_guard, build_state, configure_runtime,
                                     handle_decision, train_step)

from tiny import TINY_MODEL  # noqa: E402  (tests/tiny.py)

TINY = TINY_MODEL + [
    "train.steps=24", "train.checkpoint_every=0", "logging.log_every=6",
    "guard.warmup_steps=4", "guard.snapshot_every=6", "guard.probe_every=12",
    "sample.num=2", "sample.steps=2", "logging.report=false",
]


def _cfg(check_every: int, *extra: str, faults=()):
    return load_config(None, TINY + [f"guard.check_every={check_every}", *extra,
                                     f"faults={json.dumps(list(faults))}"])


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() \
        else []


def _incidents(run):
    keep = ("step", "kind", "action", "cost")
    return [{k: r.get(k) for k in keep} for r in _rows(run / "incidents.jsonl")]


def _metrics(run):
    drop = ("sec_per_step", "memory_mb")
    return [{k: v for k, v in r.items() if k not in drop} for r in _rows(run / "metrics.jsonl")]


def _train(tmp_path, name, check_every, *extra, faults=()):
    torch.set_num_threads(1)
    run = tmp_path / name
    res = loop.run(_cfg(check_every, *extra, faults=faults), run_dir=run)
    return run, res


def _weights(run):
    from safetensors.torch import load_file
    c = ckpt.latest_good(run / "checkpoints")
    return load_file(c / "model.safetensors"), load_file(c / "ema.safetensors")


# (fault list, extra overrides): each a different path through the guard
SCENARIOS = {
    "healthy": ([], ()),
    "nan_batch": ([{"kind": "nan_batch", "step": 9}], ()),  # drop the sample, train the rest
    "nan_batch_skip": ([{"kind": "nan_batch", "step": 9}], ("guard.sample_drop_max=0",)),
    "outlier": ([{"kind": "outlier_batch", "step": 11, "factor": 1e4}], ()),
    "loss_spike": ([{"kind": "loss_scale", "step": 10, "factor": 1e8}], ()),
    "param_nan": ([{"kind": "param_nan", "step": 13}], ()),  # rollback to a snapshot
    "grad_nan": ([{"kind": "grad_nan", "step": 8}], ()),
    "transient": ([{"kind": "transient_nan", "step": 15}], ()),  # re-run: finite
    "weight_jump": ([{"kind": "param_huge", "step": 14}], ()),
    "two_in_a_window": ([{"kind": "nan_batch", "step": 17},
                         {"kind": "grad_nan", "step": 19}], ()),
    # the grad scaler's own state (scale, growth tracker) is part of the window's mark
    "fp16_overflow": ([{"kind": "fp16_overflow", "step": 10}],
                      ("train.precision=fp16", "train.allow_slow_precision=true",
                       "train.batch_size=4")),
}


# in the default suite: a healthy run and one of each outcome (drop samples, roll back, re-run,
# two faults in one window); the rest under `make test-slow`
FAST = {"healthy", "nan_batch", "param_nan", "transient", "two_in_a_window"}


@pytest.mark.parametrize("scenario", [s if s in FAST else pytest.param(s, marks=pytest.mark.slow)
                                      for s in SCENARIOS])
def test_deferred_check_is_the_per_step_check(tmp_path, scenario):
    faults, extra = SCENARIOS[scenario]
    a, ra = _train(tmp_path, "per_step", 1, *extra, faults=faults)
    b, rb = _train(tmp_path, "deferred", 5, *extra, faults=faults)
    assert ra.steps == rb.steps == 24
    assert _incidents(a) == _incidents(b)
    if faults:
        assert _incidents(a), "the fault was not seen: the scenario tests nothing"
        state = json.loads((ckpt.latest_good(b / "checkpoints") / "state.json").read_text())
        assert state["guard"]["counts"]["rewinds"] >= 1, "no window was redone"
    assert _metrics(a) == _metrics(b)
    (ma, ea), (mb, eb) = _weights(a), _weights(b)
    assert ma.keys() == mb.keys()
    assert all(torch.equal(ma[k], mb[k]) for k in ma), "weights differ"
    assert all(torch.equal(ea[k], eb[k]) for k in ea), "EMA differs"


def test_a_rewind_costs_at_most_the_window(tmp_path):
    # windows of 8 start at steps 1, 9, 17 (step 0 is read at once: it creates the
    # optimizer state); the fault at step 13 is the window's 5th step
    run, res = _train(tmp_path, "r", 8, "guard.snapshot_every=100", "guard.probe_every=0",
                      "logging.log_every=100", faults=[{"kind": "nan_batch", "step": 13}])
    assert res.incidents == 1
    state = json.loads((ckpt.latest_good(run / "checkpoints") / "state.json").read_text())
    counts = state["guard"]["counts"]
    assert counts["rewinds"] == 1 and counts["steps_discarded"] == 8
    assert "1 window(s) of the deferred check redone (8 steps discarded)" in \
        json.loads((run / "summary.json").read_text())["guard_summary"]


# ------------------------------------------------------------------ host reads per step


class _Loop:
    """The trainer's step and the loop's flush rule, opened up to count host reads."""

    def __init__(self, check_every: int, *extra: str, faults=()):
        cfg = _cfg(check_every, "guard.snapshot_every=1000", "guard.probe_every=0",
                   "logging.log_every=1000", *extra, faults=faults)
        torch.set_num_threads(1)
        configure_runtime(cfg, torch.device("cpu"))
        self.data = build_dataset(cfg.data)
        self.state = build_state(cfg, self.data.num_classes, torch.device("cpu"))
        self.guard = attach_guard(self.state, None, self.data, defer=True)
        self.batches = iter(make_loader(self.data, batch_size=cfg.train.batch_size,
                                        seed=cfg.train.seed))

    def step(self) -> tuple[int, int]:
        """One step and, when due, the flush: (reads in the step, reads in the flush)."""
        n0 = hostsync.reads()
        out = train_step(self.state, next(self.batches))
        handle_decision(self.state, out.decision, say=lambda _m: None)
        n1 = hostsync.reads()
        if self.guard.due():
            assert self.guard.flush().rewind is None
        return n1 - n0, hostsync.reads() - n1


def test_no_host_read_per_steady_step():
    lp = _Loop(8)
    for _ in range(3):  # the first step creates the optimizer state: it is read at once
        lp.step()
    counts = [lp.step() for _ in range(32)]
    assert [s for s, _ in counts] == [0] * 32  # no read in any step
    flushes = [f for _, f in counts if f]
    assert flushes == [1] * 4  # one read per window of 8 steps
    # and the counter does see reads: the per-step check reads once per step and more
    lp = _Loop(1)
    lp.step()
    assert all(s >= 1 for s, _ in (lp.step() for _ in range(4)))


def test_a_bad_step_is_gated_on_the_device_until_the_window_is_judged():
    # NaN gradients at step 5, inside a window: the fused AdamW skips itself (found_inf) and
    # the EMA's weight is 0, so nothing non-finite is written before the host reads the flag
    lp = _Loop(8, faults=[{"kind": "grad_nan", "step": 5}])
    assert lp.state.update.fused  # optim.fused=auto: a fused AdamW on the CPU too
    while lp.state.step < 5:
        lp.step()
    params = [p.detach().clone() for p in lp.state.update.params]
    moments = [v.clone() for p in lp.state.update.params
               for v in lp.state.optimizer.state[p].values()]
    ema = [p.detach().clone() for p in lp.state.ema.module.parameters()]
    out = train_step(lp.state, next(lp.batches))
    assert out.decision.pending and lp.guard.pending
    assert all(torch.equal(a, p) for a, p in zip(params, lp.state.update.params))
    assert all(torch.equal(a, v) for a, v in zip(moments, (
        v for p in lp.state.update.params for v in lp.state.optimizer.state[p].values())))
    assert all(torch.equal(a, p) for a, p in zip(ema, lp.state.ema.module.parameters()))
    flushed = lp.guard.flush()
    assert flushed.rewind is not None and flushed.rewind.at == 5 and \
        flushed.rewind.why == "nonfinite"


def test_zclip_is_read_every_step():
    # ZClip's threshold comes from the statistics of every step before: no speculation
    lp = _Loop(8, "optim.clip_mode=zclip")
    lp.step()
    assert all(s >= 1 for s, _ in (lp.step() for _ in range(4)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_steady_steps_do_not_synchronize():
    """On a GPU: N steady guarded steps under ``set_sync_debug_mode("error")``: any sync
    outside the flushes (hostsync's deliberate reads) raises."""
    cfg = _cfg(8, "guard.snapshot_every=1000", "guard.probe_every=0",
               "logging.log_every=1000", "train.device=cuda")
    dev = torch.device("cuda")
    configure_runtime(cfg, dev)
    data = build_dataset(cfg.data)
    state = build_state(cfg, data.num_classes, dev)
    guard = attach_guard(state, None, data, defer=True)
    batches = iter(make_loader(data, batch_size=cfg.train.batch_size, seed=cfg.train.seed,
                               pin_memory=True))
    for _ in range(2):
        handle_decision(state, train_step(state, next(batches)).decision)
        if guard.due():
            guard.flush()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(24):
            handle_decision(state, train_step(state, next(batches)).decision)
            if guard.due():
                assert guard.flush().rewind is None
    finally:
        torch.cuda.set_sync_debug_mode(0)
