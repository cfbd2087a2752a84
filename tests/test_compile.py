"""``train.compile``: torch.compile of the training forward (trainer/compilation.py).

The default suite runs the trainer's wiring with the ``aot_eager`` backend (dynamo traces
the model and AOTAutograd its backward, PyTorch's own kernels run: seconds); the ``slow``
tests compile with inductor, which on CPU builds C++ kernels with the machine's compiler
(a minute or two per model cold, on 2 cores), for a UNet and a DiT.
"""

import json
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

import steadydiff
from steadydiff.cli import main
from steadydiff.config import ConfigError, load_config
from steadydiff.trainer import checkpoint as ckpt
from steadydiff.trainer.compilation import CompileError, check_toolchain, compile_failure

from tiny import TINY_MODEL  # noqa: E402  (tests/tiny.py)

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
BASE = TINY_MODEL + ["train.checkpoint_every=2", "sample.num=2", "sample.steps=2",
                     "logging.log_every=1", "logging.report=false", "train.ema_decay=0.5"]
DIT = ["model.kind=dit", "model.dit.depth=2", "model.dit.hidden_size=16",
       "model.dit.num_heads=2"]
AOT = ["train.compile=true", "train.compile_backend=aot_eager"]
INDUCTOR = ["train.compile=true"]


def cfg(steps, *extra, faults=()):
    return load_config(None, BASE + [f"train.steps={steps}", *extra,
                                     f"faults={json.dumps(list(faults))}"])


def final(run: Path) -> ckpt.Checkpoint:
    return ckpt.load_checkpoint(ckpt.latest_good(run / "checkpoints"))


def losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def plain_keys(*extra) -> set[str]:
    from steadydiff.models import build_model
    c = cfg(1, *extra)
    return set(build_model(c.model, image_size=c.data.image_size,
                           channels=c.data.channels).state_dict())


def assert_close(a: ckpt.Checkpoint, b: ckpt.Checkpoint, atol: float) -> None:
    assert a.model.keys() == b.model.keys() and a.ema.keys() == b.ema.keys()
    for part in ("model", "ema"):
        for k, v in getattr(a, part).items():
            torch.testing.assert_close(v, getattr(b, part)[k], rtol=0, atol=atol,
                                       msg=lambda m, k=k, part=part: f"{part}.{k}: {m}")


def compiled_graphs() -> int:
    return counters["stats"]["unique_graphs"]


# --------------------------------------------------------------------------- default suite


def test_compiled_training_matches_eager_resumes_both_ways_and_saves_plain_keys(tmp_path):
    """A UNet run that trains steps 0-1 eager, 2-3 compiled (resumed from the eager
    checkpoint), step 4 eager again (resumed from the compiled one) ends where the straight
    eager run does; the compiled run's checkpoint holds the plain module's keys; its step
    with a forward fault (hooks on a submodule) runs the plain model, so the fault fires and
    the guard's rerun repairs it as in the eager run."""
    fault = [{"kind": "transient_nan", "step": 3}]
    eager = steadydiff.train(cfg(5, faults=fault), out_dir=tmp_path / "eager")
    run = tmp_path / "mixed"
    steadydiff.train(cfg(2, faults=fault), out_dir=run)
    torch._dynamo.reset()
    res = steadydiff.train(cfg(4, *AOT, faults=fault), out_dir=run)
    assert res.resumed_from.name == "step_00000002"  # compile on: a bookkeeping change
    assert compiled_graphs() >= 1  # the training forward went through dynamo
    c4 = final(run)
    assert set(c4.model) == set(c4.ema) == plain_keys()  # no "_orig_mod." anywhere
    res = steadydiff.train(cfg(5, faults=fault), out_dir=run)  # and off again
    assert res.resumed_from.name == "step_00000004" and res.steps == 5
    assert_close(final(run), final(tmp_path / "eager"), atol=1e-5)
    assert losses(run) == pytest.approx(losses(tmp_path / "eager"), rel=1e-5)
    # the fault's hook fired in the compiled segment: a compiled graph would have run
    # without it (hooks added after tracing are not seen) and there would be no incident
    rows = [json.loads(line) for line in (run / "incidents.jsonl").read_text().splitlines()]
    assert [(r["step"], r["kind"], r["action"]) for r in rows] == \
        [(3, "transient_fault", "rerun")]
    assert eager.incidents == 1


def test_missing_cxx_compiler_is_a_clear_error_before_training(tmp_path, capsys):
    import torch._inductor.config as ic
    with ic.patch({"cpp.cxx": (None, str(tmp_path / "no-such-g++"))}):
        with pytest.raises(CompileError, match=r"needs a C\+\+ compiler.*train.compile=false"):
            check_toolchain(cfg(1, *INDUCTOR).train, torch.device("cpu"))
        check_toolchain(cfg(1, *AOT).train, torch.device("cpu"))  # needs no compiler
        rc = main(["train", str(CONFIGS / "digits_cond.yaml"), "--dry-run",
                   "--set", "train.compile=true"])
    err = capsys.readouterr().err
    assert rc == 2 and "needs a C++ compiler" in err and "train.compile=false" in err


def test_compile_failure_names_the_way_out():
    from torch._inductor.exc import InvalidCxxCompiler
    tcfg = cfg(1, *INDUCTOR).train
    e = compile_failure(InvalidCxxCompiler("no-such-g++"), tcfg)
    assert isinstance(e, CompileError)
    assert "torch.compile failed" in str(e) and "train.compile=false" in str(e)
    assert compile_failure(RuntimeError("CUDA out of memory"), tcfg) is None
    assert compile_failure(InvalidCxxCompiler("g++"), cfg(1).train) is None  # compile off


def test_compile_mode_needs_inductor():
    with pytest.raises(ConfigError, match="train.compile_mode=max-autotune needs "
                                          "train.compile_backend=inductor"):
        cfg(1, *AOT, "train.compile_mode=max-autotune")
    with pytest.raises(ConfigError, match="train.compile_mode"):
        cfg(1, "train.compile_mode=fast")


# --------------------------------------------------------------------------- inductor


@pytest.mark.slow
@pytest.mark.parametrize("model", ["unet", "dit"])
def test_inductor_matches_eager_and_resumes(model, tmp_path):
    """Inductor-compiled training (C++ kernels) follows the eager run to rounding over 4
    steps, for a UNet and a DiT; a compiled run resumed compiled at step 2 ends where the
    straight compiled run does; the checkpoints hold the plain module's keys."""
    extra = DIT if model == "dit" else []
    steadydiff.train(cfg(4, *extra), out_dir=tmp_path / "eager")
    torch._dynamo.reset()
    steadydiff.train(cfg(4, *extra, *INDUCTOR), out_dir=tmp_path / "compiled")
    assert compiled_graphs() >= 1
    eager, comp = final(tmp_path / "eager"), final(tmp_path / "compiled")
    assert set(comp.model) == set(comp.ema) == plain_keys(*extra)
    assert losses(tmp_path / "compiled") == pytest.approx(losses(tmp_path / "eager"),
                                                          rel=1e-4)
    assert_close(comp, eager, atol=1e-4)
    # resume with compile on (the second compile of the same graphs hits inductor's cache)
    steadydiff.train(cfg(2, *extra, *INDUCTOR), out_dir=tmp_path / "resumed")
    res = steadydiff.train(cfg(4, *extra, *INDUCTOR), out_dir=tmp_path / "resumed")
    assert res.resumed_from.name == "step_00000002"
    assert_close(final(tmp_path / "resumed"), comp, atol=1e-5)
