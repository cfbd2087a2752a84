"""Enumerations are defined once (steadydiff/kinds.py): the config, the CLI, the API and
every registry that implements a value must agree with them."""

import subprocess
import sys
import typing

import pytest
import torch
from torch import nn

from steadydiff import kinds
from steadydiff.config import Config, DiffusionConfig, FaultConfig

LITERALS = {name: v for name, v in vars(kinds).items()
            if typing.get_origin(v) is typing.Literal}


def _literal_fields(cls, prefix=""):
    """(dotted key, annotation) of every Literal-typed field in the config tree."""
    for name, field in cls.model_fields.items():
        ann = field.annotation
        for a in (ann, *typing.get_args(ann)):  # X, X | None, tuple[X, ...]
            if typing.get_origin(a) is typing.Literal:
                yield f"{prefix}{name}", a
            elif isinstance(a, type) and issubclass(a, Config.__base__):
                yield from _literal_fields(a, f"{prefix}{name}.")


def test_every_config_enumeration_comes_from_kinds():
    fields = list(_literal_fields(Config)) + list(_literal_fields(FaultConfig, "faults[]."))
    assert len(fields) >= 20
    for key, ann in fields:
        assert any(ann == lit for lit in LITERALS.values()), (
            f"{key}: Literal{list(typing.get_args(ann))} is not defined in kinds.py")


def test_value_tuples_are_derived_from_their_literals():
    for name, lit in LITERALS.items():
        if name in ("Split",):  # used only as a type hint
            continue
        tuples = [v for v in vars(kinds).values() if v == typing.get_args(lit)]
        assert tuples, f"kinds.{name} has no tuple of its values"


def test_registries_match_their_enumerations():
    from steadydiff.diffusion.samplers import SAMPLERS
    from steadydiff.eval.during import LOWER_IS_BETTER
    from steadydiff.guard.faults import DEFAULT_FACTOR
    from steadydiff.lint import LR_CEILING, NORM_EPS_FLOOR
    from steadydiff.models.dit import PRESETS
    from steadydiff.trainer.precision import DTYPES

    assert tuple(SAMPLERS) == kinds.SAMPLER_NAMES
    assert tuple(DTYPES) == kinds.PRECISIONS
    assert tuple(PRESETS) == kinds.DIT_PRESETS
    assert tuple(LR_CEILING) == kinds.MODEL_KINDS
    assert tuple(LOWER_IS_BETTER) == kinds.EVAL_METRICS
    assert set(NORM_EPS_FLOOR) <= set(kinds.PRECISIONS)
    assert set(DEFAULT_FACTOR) <= set(kinds.FAULT_KINDS)
    assert set(kinds.LABELLED_DATASETS) <= set(kinds.DATASETS)


def test_cli_and_api_take_their_choices_from_kinds():
    import argparse

    from steadydiff.api import Pipeline
    from steadydiff.cli import _parser

    def choices(parser: argparse.ArgumentParser, command: str, option: str):
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        act = next(a for a in sub.choices[command]._actions if option in a.option_strings)
        return tuple(act.choices)

    p = _parser()
    assert choices(p, "sample", "--sampler") == kinds.SAMPLER_NAMES
    assert choices(p, "eval", "--sampler") == kinds.SAMPLER_NAMES
    hints = typing.get_type_hints(Pipeline.sample)
    assert hints["sampler"] == kinds.SamplerName | None


def test_every_value_is_implemented():
    """Each value the config accepts reaches working code (no unknown-value fallback)."""
    from steadydiff.adapters.layers import wrap
    from steadydiff.diffusion import loss_weights, make_schedule, sample_timesteps
    from steadydiff.guard import clipping

    for s in kinds.SCHEDULES:
        extra = {"piecewise": [[0, 5], [1, -5]]} if s == "piecewise" else {}
        assert make_schedule(DiffusionConfig(schedule=s, timesteps=50, **extra)).T == 50
    g = torch.Generator().manual_seed(0)
    for ts in kinds.TIMESTEP_SAMPLINGS:
        t = sample_timesteps(16, DiffusionConfig(timestep_sampling=ts), 100, g)
        assert t.shape == (16,) and 0 <= t.min() and t.max() < 100
    snr = torch.tensor([0.0, 1.0, float("inf")])
    for w in kinds.OBJECTIVE_WEIGHTINGS["ddpm"]:
        for pred in kinds.PREDICTIONS:
            cfg = DiffusionConfig(loss_weighting=w, prediction=pred)
            assert torch.isfinite(loss_weights(cfg, snr)).all()
    # every objective, with each loss weighting, sampling density and sampler it takes,
    # trains a step of a tiny model and samples from it
    from steadydiff.diffusion import diffusion_loss, sample
    model = _Tiny()
    x0 = torch.zeros(4, 1, 4, 4)
    assert set().union(*kinds.OBJECTIVE_WEIGHTINGS.values()) == set(kinds.LOSS_WEIGHTINGS)
    for obj in kinds.OBJECTIVES:
        dens = kinds.TIMESTEP_SAMPLINGS if obj != "edm" else ("uniform",)
        for w in kinds.OBJECTIVE_WEIGHTINGS[obj]:
            for ts in dens:
                cfg = DiffusionConfig(objective=obj, loss_weighting=w, timestep_sampling=ts)
                out = diffusion_loss(model, x0, None, make_schedule(cfg), cfg, g)
                assert torch.isfinite(out.loss) and out.t.dtype == torch.long
        sched = make_schedule(DiffusionConfig(objective=obj))
        for name in kinds.OBJECTIVE_SAMPLERS[obj]:
            x = sample(model, sched, "eps", (2, 1, 4, 4), sampler=name, steps=3, generator=g)
            assert torch.isfinite(x).all()
    for mode in kinds.CLIP_MODES:
        p = nn.Parameter(torch.ones(3, 2))
        p.grad = torch.full_like(p, 10.0)
        clipping.clip([p], mode, 1.0, clipping.total_norm([p]))
    for kind in kinds.ADAPTER_KINDS:
        # embedding: a Stable Diffusion model's new token rows, no layer wrapped
        # (integrations/sd/embedding.py, tests/test_textual_inversion.py)
        if kind not in ("none", "embedding"):
            wrap(nn.Linear(4, 4), kind, rank=2, alpha=2.0, dropout=0.0, hidden_mult=1.0)


class _Tiny(nn.Module):
    num_classes = 0

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.tensor(0.5))

    def forward(self, x, t, y=None):
        return self.w * x + 1e-4 * t.view(-1, 1, 1, 1)


@pytest.mark.parametrize("module", ["steadydiff.kinds", "steadydiff.config", "steadydiff.lint"])
def test_light_modules_import_no_torch(module):
    code = f"import sys, {module}; assert 'torch' not in sys.modules, sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)
