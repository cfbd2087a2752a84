"""Evaluation during training (``eval.every``): the metric, the best checkpoint, early stopping.

Every ``eval.every`` optimizer steps the trainer calls :meth:`TrainingEvaluator.run`: it draws
``eval.num`` samples from the EMA model with its *own* generator (seeded by ``eval.seed``, the
same noise at every evaluation, so the curve moves only because the model does) and measures
them with :func:`steadydiff.eval.evaluate.evaluate_samples`. Nothing here draws from the
global RNG (the feature network is trained inside a forked RNG), so a run with evaluation
trains exactly like one without.

Each evaluation is one row of ``eval.jsonl`` (and ``eval/*`` scalars in TensorBoard). When
``eval.metric`` improves by more than ``eval.min_delta`` the state is saved to
``checkpoints/best/`` (a checkpoint root of its own holding one checkpoint; the rotation of
``checkpoints/step_*`` never touches it). After ``eval.patience`` evaluations without an
improvement the run stops early and cleanly. The best value, its step and the patience
counter are part of the checkpoint state, so all of this survives a resume.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import seeding
from ..config import EvalConfig
from ..diffusion import sample
from ..trainer.hooks import Evaluation
from .evaluate import evaluate_samples, extractor_for
from ..kinds import EVAL_METRICS, EvalMetric

log = logging.getLogger(__name__)

# direction of each metric: lower is better for distances, higher for the rest (keys: exactly
# kinds.EVAL_METRICS, tests/test_kinds.py)
LOWER_IS_BETTER: dict[EvalMetric, bool] = {"fd": True, "kid": True, "precision": False,
                                           "recall": False, "class_accuracy": False}


@dataclass
class EarlyStopping:
    """Patience logic over a sequence of metric values.

    A value improves on the best when it is better by more than ``min_delta``; a missing or
    non-finite value (a diverged model) never does. After ``patience`` values in a row without
    an improvement, ``should_stop`` is True (never, with ``patience`` 0).
    """

    lower_is_better: bool = True
    patience: int = 0
    min_delta: float = 0.0
    best: float | None = None
    best_step: int | None = None
    bad: int = 0  # evaluations since the last improvement

    def update(self, value: float | None, step: int) -> bool:
        """Record one value; returns whether it is a new best."""
        ok = value is not None and math.isfinite(value)
        if ok and (self.best is None or (self.best - value > self.min_delta
                                         if self.lower_is_better
                                         else value - self.best > self.min_delta)):
            self.best, self.best_step, self.bad = float(value), step, 0
            return True
        self.bad += 1
        return False

    @property
    def should_stop(self) -> bool:
        return self.patience > 0 and self.bad >= self.patience

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "best_step": self.best_step, "bad": self.bad}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.best, self.best_step = d.get("best"), d.get("best_step")
        self.bad = int(d.get("bad", 0))


class TrainingEvaluator(Evaluation):
    """Runs the periodic evaluation for the training loop (see the module docstring)."""

    def __init__(self, cfg, run_dir: Path) -> None:
        self.cfg = cfg
        self.ecfg: EvalConfig = cfg.eval
        self.run_dir = Path(run_dir)
        self.stop = EarlyStopping(LOWER_IS_BETTER[self.ecfg.metric], self.ecfg.patience,
                                  self.ecfg.min_delta)
        self._fx = None

    def due(self, step: int) -> bool:
        return bool(self.ecfg.every) and step % self.ecfg.every == 0

    @property
    def stopped(self) -> bool:
        return self.stop.should_stop

    def stop_reason(self) -> str:
        e, s = self.ecfg, self.stop
        return (f"early stopping: eval.{e.metric} has not improved by more than "
                f"{e.min_delta:g} in {s.bad} evaluations (eval.patience={e.patience}); best "
                f"{s.best if s.best is None else format(s.best, '.4g')} at step {s.best_step}")

    def state_dict(self) -> dict[str, Any]:
        return self.stop.state_dict()

    def load_state_dict(self, d: dict[str, Any] | None) -> None:
        if d:
            self.stop.load_state_dict(d)

    @torch.no_grad()
    def run(self, state, tb=None, save_best=None) -> dict[str, Any]:
        """Evaluate the EMA model of the training ``state`` now and log it; on a new best,
        ``save_best()`` writes the best checkpoint (the trainer's one checkpoint writer) and
        returns its path, or None when it could not."""
        e, c = self.ecfg, self.cfg
        t0 = time.perf_counter()
        if self._fx is None:
            self._fx = extractor_for(c)
        model = state.ema.module
        y = (torch.arange(e.num, device=state.device) % model.num_classes
             if model.num_classes else None)
        gen = seeding.generator(state.device, e.seed)
        x = sample(model, state.schedule, c.diffusion.prediction,
                   (e.num, model.in_channels, model.image_size, model.image_size),
                   sampler=e.sampler, steps=e.steps, y=y,
                   cfg_scale=c.sample.cfg_scale if e.cfg_scale is None else e.cfg_scale,
                   eta=c.sample.eta, generator=gen, device=state.device)
        res = evaluate_samples(self._fx, x.float().cpu(), y.cpu() if y is not None else None,
                               k=e.k, seed=e.seed, real_floor=False)
        step = state.step
        improved = self.stop.update(res.get(e.metric), step)
        row = {"step": step, "metric": res["metric"], "fd": res["fd"], "kid": res["kid"],
               "precision": res["precision"], "recall": res["recall"],
               "class_accuracy": res.get("class_accuracy"),
               "num": e.num, "num_nonfinite": res["num_nonfinite"],
               "best": self.stop.best, "best_step": self.stop.best_step,
               "improved": improved, "bad_evals": self.stop.bad,
               "seconds": round(time.perf_counter() - t0, 2)}
        if improved and e.keep_best and save_best is not None:
            row["best_checkpoint"] = (str(p) if (p := save_best()) is not None else None)
        with open(self.run_dir / "eval.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        if tb is not None:
            for k in EVAL_METRICS:
                if isinstance(row[k], (int, float)):
                    tb.writer.add_scalar(f"eval/{k}", row[k], step)
        v = row[e.metric]
        print(f"eval @ {step}: {res['metric']} {row['fd'] if row['fd'] is not None else 'n/a'}"
              f" | {e.metric} {v if v is None else format(v, '.4g')}"
              f"{' (best)' if improved else ''}"
              + (f" | {row['num_nonfinite']} non-finite samples" if row["num_nonfinite"] else ""))
        return row


def make_evaluator(cfg, run_dir: Path) -> Evaluation:
    """The evaluator for ``cfg`` (the no-op :class:`Evaluation` when ``eval.every`` is 0)."""
    return TrainingEvaluator(cfg, run_dir) if cfg.eval.every else Evaluation()
