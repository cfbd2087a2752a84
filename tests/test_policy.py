"""The guard's decision table on its own: guard/policy.py is a pure function of (finding,
history, config), so every rule is checked here without a model, an optimizer or a file."""

import pytest

from steadydiff.config import GuardConfig
from steadydiff.guard.detectors import Finding
from steadydiff.guard.policy import History, decide, decide_oom, fallback, recent

CFG = GuardConfig(skips_before_rollback=3, skip_window=50, max_skips=4, budget_window=1000,
                  max_rollbacks=2)
ALL = frozenset({"fp32", "bf16", "fp16"})


def f(kind, severity="spike", **evidence):
    return Finding(kind, severity, evidence)


def test_recent_counts_only_the_window():
    assert recent((1, 5, 40, 90), now=100, window=50) == 1  # 90 only (50 <= e)
    assert recent((50, 51), now=100, window=50) == 2
    assert recent((), now=100, window=50) == 0


@pytest.mark.parametrize("kind", ["nonfinite_loss", "nonfinite_grad", "loss_spike",
                                  "grad_spike", "lr_spike"])
def test_a_first_incident_is_skipped(kind):
    a = decide(f(kind), History(step=10), CFG)
    assert (a.kind, a.budget_abort, a.scaler) == ("skip", None, False)


def test_repeated_incidents_escalate_to_a_rollback():
    h = History(step=30, skips=(20, 25))  # this one is the 3rd within 50 steps
    a = decide(f("grad_spike"), h, CFG)
    assert (a.kind, a.reason, a.restore_before, a.skip_data) == \
        ("rollback", "repeated incidents", None, "implicated")
    # the same two skips long ago do not escalate
    assert decide(f("grad_spike"), History(step=300, skips=(20, 25)), CFG).kind == "skip"


def test_a_bad_batch_never_escalates():
    h = History(step=30, skips=(27, 28, 29))
    assert decide(f("bad_batch", "fatal"), h, CFG).kind == "skip"


def test_state_unusable_and_divergence_roll_back():
    for kind in ("nonfinite_params", "weight_jump"):
        a = decide(f(kind, "fatal"), History(step=5), CFG)
        assert (a.kind, a.reason, a.restore_before, a.skip_data) == \
            ("rollback", "state unusable", None, "implicated")
        # changed between two steps: the batch is innocent, no data is skipped
        a = decide(f(kind, "fatal", when="before_forward"), History(step=5), CFG)
        assert (a.kind, a.skip_data) == ("rollback", "none")
    # a divergence goes back to before it began (not to the oldest snapshot), skipping nothing
    a = decide(f("divergence", "trend", trend_start_step=120), History(step=200), CFG)
    assert (a.kind, a.reason, a.restore_before, a.skip_data, a.lr_cap_fraction) == \
        ("rollback", "slow divergence", 120, "none", None)


def test_lr_too_high_rolls_back_before_the_trend_and_caps_the_lr():
    c = GuardConfig(lr_cap_fraction=0.5)
    lr = f("lr_too_high", "trend", trend_start_step=120, lr_start=1e-3, lr_end=4e-3)
    h = History(step=200, snapshots=(50, 100, 150, 200))
    a = decide(lr, h, c)
    assert (a.kind, a.restore_before, a.skip_data, a.lr_cap_fraction) == \
        ("rollback", 120, "none", 0.5)
    assert h.snapshot_before(120) == 100 and h.snapshot_before(20) == 50
    assert h.snapshot_before(None) == 200
    # the same snapshot for the same cause again: a stricter cap; a third time: abort
    again = History(step=200, snapshots=(50, 100), last_rollback=(100, "learning rate too high"),
                    same_rollbacks=1)
    assert decide(lr, again, c).lr_cap_fraction == 0.25
    third = History(step=200, snapshots=(50, 100), last_rollback=(100, "learning rate too high"),
                    same_rollbacks=2)
    a = decide(lr, third, c)
    assert a.kind == "abort" and "restored step 100 for learning rate too high 2 times" in a.why
    # another cause at that snapshot is not "the same rollback"
    other = History(step=200, snapshots=(50, 100), last_rollback=(100, "state unusable"),
                    same_rollbacks=2)
    assert decide(lr, other, c).kind == "rollback"


def test_rollback_needs_a_snapshot_and_budget():
    a = decide(f("nonfinite_params", "fatal"), History(step=5, has_snapshot=False), CFG)
    assert (a.kind, a.why) == ("abort", "no verified snapshot to roll back to")
    a = decide(f("nonfinite_params", "fatal"), History(step=500, rollbacks=(100, 400)), CFG)
    assert a.kind == "abort" and a.why == "2 rollbacks within 1000 steps already"
    a = decide(f("nonfinite_params", "fatal"), History(step=1500, rollbacks=(100, 400)), CFG)
    assert a.kind == "rollback"  # those rollbacks are outside the window


def test_skip_budget_counts_skips_spread_over_the_whole_window():
    """Skips every 100 steps never escalate (each is alone within skip_window) but the
    budget counts all of them within budget_window: the 5th skip past max_skips=4 aborts."""
    skips = (100, 200, 300, 400)
    a = decide(f("grad_spike"), History(step=500, skips=skips), CFG)
    assert a.kind == "skip" and a.budget_abort == "more than 4 skipped steps within 1000"
    a = decide(f("grad_spike"), History(step=500, skips=skips[1:]), CFG)
    assert a.kind == "skip" and a.budget_abort is None


def test_fp16_overflow_is_the_scalers_until_it_repeats():
    routine = decide(f("fp16_overflow", "routine"), History(step=3, precision="fp16"), CFG)
    assert (routine.kind, routine.scaler, routine.record, routine.precision) == \
        ("skip", True, False, None)
    forward = decide(f("fp16_overflow", "spike"), History(step=3, precision="fp16"), CFG)
    assert forward.scaler and forward.record and forward.precision is None
    h = History(step=3, precision="fp16", supported=ALL)
    assert decide(f("fp16_overflow", "trend"), h, CFG).precision == "bf16"
    h = History(step=3, precision="fp16", supported=frozenset({"fp32", "fp16"}))
    assert decide(f("fp16_overflow", "trend"), h, CFG).precision == "fp32"
    off = GuardConfig(precision_fallback=False)
    assert decide(f("fp16_overflow", "trend"), History(step=3, precision="fp16",
                                                      supported=ALL), off).precision is None


def test_attention_overflow_upcasts_that_layer_first():
    """An fp16 forward overflow that began in an attention layer: the first remedy is that
    layer's attention in fp32 (a scaler skip, no precision change), even when the overflows
    already repeat; the global fallback waits."""
    h = History(step=3, precision="fp16", supported=ALL)
    for sev in ("spike", "trend"):
        a = decide(f("fp16_overflow", sev, attention_module="mid.attn.attn"), h, CFG)
        assert (a.kind, a.scaler, a.upcast, a.precision) == \
            ("skip", True, "mid.attn.attn", None)
    # another layer is upcast already: this one still gets its own upcast
    other = History(step=3, precision="fp16", supported=ALL, upcast=frozenset({"down.1.attn"}))
    assert decide(f("fp16_overflow", attention_module="mid.attn.attn"), other,
                  CFG).upcast == "mid.attn.attn"


def test_overflow_after_the_upcast_falls_back_at_once():
    """The upcast layer overflows again: upcasting did not help, so the precision falls back
    on this first recurrence (not after overflow_limit more); without a fallback, a skip."""
    h = History(step=9, precision="fp16", supported=ALL, upcast=frozenset({"mid.attn.attn"}))
    a = decide(f("fp16_overflow", attention_module="mid.attn.attn"), h, CFG)
    assert (a.kind, a.scaler, a.upcast, a.precision) == ("skip", True, None, "bf16")
    assert "persists after its attention upcast" in a.reason
    off = GuardConfig(precision_fallback=False)
    a = decide(f("fp16_overflow", attention_module="mid.attn.attn"), h, off)
    assert (a.kind, a.scaler, a.precision, a.record) == ("skip", True, None, True)
    # an overflow outside attention keeps the scaler's rules: one is a recorded skip
    a = decide(f("fp16_overflow"), h, CFG)
    assert (a.upcast, a.precision, a.record) == (None, None, True)


def test_bf16_rollback_naming_a_module_falls_back_to_fp32():
    named = f("nonfinite_loss", provenance={"first_nonfinite_module": "mid.attn"})
    h = History(step=30, skips=(20, 25), precision="bf16", supported=ALL)
    a = decide(named, h, CFG)
    assert (a.kind, a.precision) == ("rollback", "fp32")
    assert decide(f("nonfinite_loss"), h, CFG).precision is None  # nothing named


def test_fallback_chain():
    assert fallback("fp16", ALL) == "bf16"
    assert fallback("bf16", ALL) == "fp32"
    assert fallback("fp32", ALL) is None
    assert fallback("fp16", ALL, enabled=False) is None


def test_oom():
    assert decide_oom(8, CFG) == (4, "micro-batch 8 -> 4")
    assert decide_oom(1, CFG)[0] is None
    assert decide_oom(8, GuardConfig(oom_backoff=False)) == (None, "oom_backoff disabled")


def test_budgets_at_their_boundaries():
    """max_skips=4 per budget_window=1000: the 4th skip in the window is allowed, the 5th is
    not; an event exactly budget_window steps back still counts, one more step back does not.
    max_rollbacks=2: the 2nd rollback is allowed, the 3rd aborts."""
    c = GuardConfig(skips_before_rollback=100, skip_window=10, max_skips=4,
                    budget_window=1000, max_rollbacks=2)
    three = (1000, 1200, 1400)
    assert decide(f("grad_spike"), History(step=1500, skips=three), c).budget_abort is None
    four = three + (1450,)
    assert decide(f("grad_spike"), History(step=1500, skips=four), c).budget_abort
    edge = (500,) + three  # 1500 - 1000 = 500: inside the window
    assert decide(f("grad_spike"), History(step=1500, skips=edge), c).budget_abort
    outside = (499,) + three
    assert decide(f("grad_spike"), History(step=1500, skips=outside), c).budget_abort is None
    bad = f("nonfinite_params", "fatal")
    assert decide(bad, History(step=900, rollbacks=(800,)), c).kind == "rollback"
    assert decide(bad, History(step=900, rollbacks=(800, 850)), c).kind == "abort"
    assert decide(bad, History(step=1851, rollbacks=(800, 850)), c).kind == "rollback"
