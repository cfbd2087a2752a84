"""The time budget, ``train.max_time`` (issue 17): parsing, the stop at the budget, the LR
driven by the fraction of the budget used, and resume continuing both.

The runs are driven by a fake clock: ``trainer.budget.now`` is replaced, and time moves only
where the test says (one second per training step, a hundred seconds per checkpoint write
and per sample grid), so the budget's arithmetic is checked exactly, not to a tolerance.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import steadydiff
from steadydiff.cli import main
from steadydiff.config import ConfigError, load_config
from steadydiff.durations import format_duration, parse_duration
from steadydiff.trainer import budget, loop
from steadydiff.trainer import checkpoint as ckpt

from tiny import TINY_MODEL

LR, FLOOR, WARMUP, BUDGET = 1e-3, 0.1, 2, 6  # the budget: six one-second steps
TIMED = TINY_MODEL + [
    "train.steps=50", f"train.max_time={BUDGET}s", "optim.schedule=cosine", f"optim.lr={LR}",
    f"optim.min_lr_ratio={FLOOR}", f"optim.warmup_steps={WARMUP}", "logging.log_every=1",
    "train.checkpoint_every=2", "train.sample_every=2", "sample.num=4", "sample.steps=2",
    "train.ema_decay=0.9",
]


def timed(*extra: str):
    return load_config(None, TIMED + list(extra))


# --------------------------------------------------------------------------- parsing


@pytest.mark.parametrize("value, seconds", [
    (5400, 5400.0), (90.5, 90.5), ("5400", 5400.0), ("90s", 90.0), ("45m", 2700.0),
    ("2h", 7200.0), ("1.5h", 5400.0), ("1d 2h", 93600.0), ("1h30m", 5400.0),
    ("2 hours 5 min", 7500.0), ("00:02:00:00", 7200.0), ("01:00:00:00", 86400.0),
    ("02:30:00", 9000.0), ("1-12:00:00", 129600.0), ({"hours": 2, "minutes": 30}, 9000.0),
])
def test_durations(value, seconds):
    assert parse_duration(value) == seconds


@pytest.mark.parametrize("value, why", [
    ("2x", "cannot read '2x'"), ("2h 3h", "cannot read"), ("1h30", "cannot read"),
    ("1:30", "two fields are ambiguous"), ("00:00:61:00", "cannot read"),
    (0, "positive"), (-5, "positive"), ("inf", "positive"), (True, "cannot read"),
    ({"weeks": 1}, "cannot read"), ([1], "cannot read"),
])
def test_bad_durations(value, why):
    with pytest.raises(ValueError, match=why) as e:
        parse_duration(value)
    assert "'DD:HH:MM:SS'" in str(e.value) and "'2h'" in str(e.value)  # the valid forms


def test_config_key_yaml_and_format(tmp_path):
    assert load_config(None).train.max_time is None  # off by default
    # YAML 1.1 would read an unquoted 1:00:00:00 as the base-60 integer 216000
    p = tmp_path / "c.yaml"
    p.write_text("train:\n  max_time: 1:00:00:00\n")
    assert load_config(p).train.max_time == 86400.0
    with pytest.raises(ConfigError, match=r"--set train.max_time=soon: train.max_time: "
                                          r"cannot read 'soon' as a duration; valid forms"):
        load_config(None, ["train.max_time=soon"])
    assert [format_duration(s) for s in (45.5, 90, 7200, 93600)] == \
        ["45.5s", "1m 30s", "2h", "1d 2h"]


def test_dry_run_refuses_a_bad_budget(capsys):
    assert main(["train", "configs/digits_cond.yaml", "--dry-run",
                 "--set", "train.max_time=2 weeks"]) == 2
    err = capsys.readouterr().err
    assert "train.max_time: cannot read '2 weeks' as a duration" in err and "'1d 2h'" in err
    assert main(["train", "configs/digits_cond.yaml", "--dry-run",
                 "--set", "train.max_time=1h30m"]) == 0
    out = capsys.readouterr().out
    assert "max_time: 5400.0" in out and "or 1h 30m of training (train.max_time)" in out


# --------------------------------------------------------------------------- runs


class FakeClock:
    """Time moves by one second per training step and by a hundred per checkpoint write and
    per sample grid (those must not count)."""

    def __init__(self, monkeypatch):
        self.t = 0.0
        monkeypatch.setattr(budget, "now", lambda: self.t)
        for name, cost in (("train_step", 1.0), ("save", 100.0), ("write_sample_grid", 100.0)):
            monkeypatch.setattr(loop, name, self._costs(getattr(loop, name), cost))

    def _costs(self, fn, seconds):
        def timed_fn(*args, **kwargs):
            self.t += seconds
            return fn(*args, **kwargs)
        return timed_fn


def expected_lr(j: int) -> float:
    """0-based step j: warmup in steps, then the cosine at the fraction of the budget used
    before it (j one-second steps)."""
    if j < WARMUP:
        return LR * (j + 1) / WARMUP
    floor = LR * FLOOR
    return floor + (LR - floor) * 0.5 * (1 + math.cos(math.pi * j / BUDGET))


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def final(run: Path) -> tuple[dict[str, torch.Tensor], ckpt.Checkpoint]:
    c = ckpt.load_checkpoint(ckpt.latest_good(run / "checkpoints"))
    return {**c.model, **{"ema." + k: v for k, v in c.ema.items()}}, c


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """A run its budget ends at step 6 of 50 (module-scoped: the resume test compares)."""
    mp = pytest.MonkeyPatch()
    try:
        FakeClock(mp)
        run = tmp_path_factory.mktemp("straight") / "run"
        return steadydiff.train(timed(), out_dir=run), run
    finally:
        mp.undo()


def test_stops_at_the_budget_like_a_finished_run(straight):
    res, run = straight
    # the checkpoint writes and grids (100 fake seconds each) did not count
    assert res.steps == BUDGET and res.train_seconds == BUDGET
    assert res.time_budget == "time budget train.max_time=6s used at step 6 of 50 (6.0 s of " \
                              "training)"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["reason"] == res.time_budget
    assert summary["time_budget"] == {"max_time": 6.0, "used": 6.0, "ended": True}
    assert res.checkpoint.name == "step_00000006"
    _, c = final(run)
    assert c.state["train_seconds"] == BUDGET
    assert res.samples[-1].name == "step_00000006.png"  # the final grid, like a finished run
    assert "at its time budget (train.max_time, of 50 planned)" in \
        (run / "report.html").read_text()


def test_lr_follows_the_budget_used(straight):
    _, run = straight
    got = [(r["step"], r["lr"]) for r in rows(run)]
    assert [s for s, _ in got] == list(range(1, BUDGET + 1))
    for step, lr in got:  # the row of step k holds the LR of the 0-based step k - 1
        assert lr == pytest.approx(expected_lr(step - 1), rel=1e-12), step


def test_resume_continues_the_budget_and_the_lr(tmp_path, monkeypatch, straight):
    clock = FakeClock(monkeypatch)
    run = tmp_path / "run"
    quiet = "logging.report=false"  # bookkeeping, safe on resume
    first = steadydiff.train(timed("train.steps=3", quiet), out_dir=run)  # ends by its steps
    assert first.steps == 3 and first.time_budget is None and first.train_seconds == 3
    assert json.loads((run / "summary.json").read_text())["time_budget"]["ended"] is False
    # a new budget changes the cosine of the remaining time: refused, naming the key
    with pytest.raises(ConfigError, match=r"train.max_time: 6.0 -> 8.0  \(changes the LR"):
        steadydiff.train(timed("train.max_time=8", quiet), out_dir=run)
    clock.t += 1000.0  # time between the two jobs is not training time
    # train.steps is only the bound under a time budget: raising it is safe on resume
    res = steadydiff.train(timed(quiet), out_dir=run)
    assert res.resumed_from.name == "step_00000003"
    assert res.steps == BUDGET and res.train_seconds == BUDGET and res.time_budget
    ours, theirs = rows(run), rows(straight[1])  # the same history, timing columns aside
    assert len(ours) == len(theirs) == BUDGET
    for r, r2 in zip(theirs, ours):
        assert {**r, "sec_per_step": r2["sec_per_step"], "memory_mb": r2["memory_mb"]} == r2
    a, _ = final(straight[1])
    b, _ = final(run)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the run is complete: the same command again trains nothing and says so
    again = steadydiff.train(timed(quiet), out_dir=run)
    assert again.steps == BUDGET and again.time_budget


def test_a_rollback_moves_the_step_back_not_the_time(tmp_path, monkeypatch):
    FakeClock(monkeypatch)
    res = steadydiff.train(timed("train.checkpoint_every=0", "train.sample_every=0",
                                 "logging.report=false",
                                 "faults=[{kind: param_nan, step: 3}]"),
                           out_dir=tmp_path / "run")
    incidents = [json.loads(line) for line in
                 (tmp_path / "run" / "incidents.jsonl").read_text().splitlines()]
    assert any(i["action"] == "rollback" for i in incidents)
    # six seconds of training were spent, but the rolled-back step is not counted twice
    assert res.train_seconds == BUDGET and res.steps < BUDGET and res.time_budget


# --------------------------------------------------------------------------- torchrun


@pytest.mark.slow
def test_ranks_agree_on_the_budget(tmp_path, monkeypatch):
    """Rank 1's clock runs 4x fast: every rank must still record rank 1's (the largest)
    training seconds, take the same time-based LR and stop at the same step."""
    from test_distributed import launch, ranks, same

    monkeypatch.setenv("STEADYDIFF_TEST_FAST_CLOCK_RANK", "1")
    out = tmp_path / "ddp"
    rc, log = launch(out, "train.steps=10000", "train.max_time=8", "optim.schedule=cosine",
                     "train.checkpoint_every=0")
    assert rc == 0, log[-3000:]
    (r0, r1), (s0, s1) = ranks(out)
    assert s0["step"] == s1["step"] < 10000 and s0["train_seconds"] == s1["train_seconds"] >= 8
    assert same(r0, r1) and s0["incidents"] == s1["incidents"] == []  # identical replicas
    summary = json.loads((out / "summary.json").read_text())
    assert summary["time_budget"]["ended"] and summary["steps"] == s0["step"]
    assert "time budget train.max_time=8s used at step" in log
