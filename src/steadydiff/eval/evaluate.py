"""``steadydiff eval``: sample a model and measure how close the samples are to real data.

One function does the measuring for the CLI, the training loop (``eval.every``) and the
benchmarks: :func:`evaluate_samples`. It

1. counts samples holding a non-finite value and drops them (a diverged model gets a report,
   never a crash: with fewer than ``k + 1`` finite samples, the metrics are ``None`` and the
   result says why);
2. embeds the rest with the dataset's feature network (``features.py``) and compares them
   with the same number of real images (a seeded subset of the cached reference features,
   with the same count per class as the samples' requested labels, see
   :func:`reference_subset`):
   ``FD-<dataset>``, KID, precision/recall (k nearest neighbours);
3. for class-conditional samples, reports how often the feature network's classifier agrees
   with the class each sample was drawn for (``class_accuracy``; the network's own test-split
   accuracy is in ``feature_net``);
4. reports the real-vs-real floor: the same metrics between two disjoint real subsets of the
   same size, the value a perfect model would get at this N (FD is biased upward at small N).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..kinds import LABELLED_DATASETS, SAMPLER_NAMES, SamplerName
from ..loading import load
from ..trainer import checkpoint as ckpt
from . import metrics
from .features import FeatureExtractor, feature_extractor
from .inception import inception_fid, load_inception


def _clean(v: Any) -> Any:
    """JSON-safe: non-finite floats become None."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _clean(u) for k, u in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(u) for u in v]
    return v


def evaluate_samples(fx: FeatureExtractor, x: torch.Tensor, labels: torch.Tensor | None = None,
                     *, k: int = 3, seed: int = 0, kid_subsets: int = 50,
                     kid_subset_size: int = 1000, real_floor: bool = True) -> dict:
    """Compare samples ``x`` (N, C, H, W) in [-1, 1] with N real images in ``fx``'s space.

    Args:
        fx: the feature network with its reference features.
        x: the samples; rows with any non-finite value are counted and dropped.
        labels: the classes the samples were drawn for (class-conditional models).
        k: nearest neighbours for precision/recall.
        seed: chooses the real subset and the KID subsets.
        real_floor: also compute the real-vs-real figures at the same N.

    Returns:
        A dict: ``metric`` (e.g. ``FD-digits``), ``num``, ``num_nonfinite``, ``fd``, ``kid``,
        ``kid_std``, ``precision``, ``recall``, ``class_accuracy`` (or absent), ``feature_net``
        (name, version, test accuracy) and ``real_floor``; metrics are None with ``error``
        when too few finite samples remain.
    """
    n = x.shape[0]
    finite = torch.isfinite(x.reshape(n, -1)).all(1)
    res: dict[str, Any] = {
        "metric": f"FD-{fx.name}", "num": int(n), "num_nonfinite": int((~finite).sum()),
        "k": k, "feature_net": {"name": fx.name, "version": fx.meta["version"],
                                "image_size": fx.meta["image_size"],
                                "test_accuracy": fx.meta["test_accuracy"]}}
    xf = x[finite].clamp(-1, 1)
    nf = xf.shape[0]
    empty = {"fd": None, "kid": None, "kid_std": None, "precision": None, "recall": None}
    if nf < k + 2:
        res.update(empty, error=f"only {nf} of {n} samples are finite; need at least {k + 2}")
        if labels is not None:
            res["class_accuracy"] = None
        return res
    feats, probs = fx(xf)
    g = np.random.default_rng(seed)
    y = labels[finite].cpu().numpy() if labels is not None else None
    ia = reference_subset(fx.labels, y, nf, g)
    real = fx.real[ia]
    res.update(metrics.compare(real, feats, k=k, kid_subsets=kid_subsets,
                               kid_subset_size=kid_subset_size, seed=seed))
    if y is not None:
        pred = probs.argmax(1)
        res["class_accuracy"] = float((pred == y).mean())
    res["confident_rate"] = float((probs.max(1) >= 0.9).mean())
    res["class_coverage"] = int(len(np.unique(probs.argmax(1))))
    if real_floor:
        try:
            ib = reference_subset(fx.labels, y, nf, g, exclude=ia)
        except ValueError:
            ib = None  # the reference set is too small for a second, disjoint subset
        if ib is not None:
            res["real_floor"] = metrics.compare(real, fx.real[ib], k=k, kid_subsets=kid_subsets,
                                                kid_subset_size=kid_subset_size, seed=seed)
    return _clean(res)


def reference_subset(ref_labels: np.ndarray, labels: np.ndarray | None, n: int,
                     g: np.random.Generator, exclude: np.ndarray | None = None) -> np.ndarray:
    """Indices of ``n`` reference images, none in ``exclude``.

    With ``labels`` (the classes class-conditional samples were drawn for), the subset has
    exactly the same number of images of each class: the metric then compares p(x | y) for the
    same classes, and is not moved by the random class mix of a small real subset (at N=128,
    class-count noise alone made real-vs-real FD-digits 6x larger than our samples' FD).
    Without labels: a uniformly random subset.

    Raises:
        ValueError: not enough reference images (of some class).
    """
    free = np.ones(len(ref_labels), bool)
    if exclude is not None:
        free[exclude] = False
    if labels is None:
        pool = np.flatnonzero(free)
        if len(pool) < n:
            raise ValueError(f"only {len(pool)} reference images for {n} samples")
        return g.choice(pool, n, replace=False)
    out = []
    for c, cnt in zip(*np.unique(labels, return_counts=True)):
        pool = np.flatnonzero(free & (ref_labels == c))
        if len(pool) < cnt:
            raise ValueError(f"only {len(pool)} reference images of class {c} for {cnt} samples")
        out.append(g.choice(pool, cnt, replace=False))
    return np.concatenate(out)


def extractor_for(cfg, *, cache: Path | None = None, verbose: bool = True) -> FeatureExtractor:
    """The feature network for a run config (its dataset and resolution)."""
    d = cfg.data
    return feature_extractor(d.dataset, d.image_size, path=d.path, cache=cache,
                             verbose=verbose, pad_to=d.pad_to)


def evaluate_checkpoint(checkpoint: str | Path, *, num: int = 500,
                        sampler: SamplerName | None = None,
                        steps: int | None = None, cfg_scale: float | None = None,
                        seed: int = 0, k: int = 3, inception_weights: str | Path | None = None,
                        device: str | None = None, cache: Path | None = None) -> dict:
    """Sample ``num`` images (EMA weights) from a checkpoint and evaluate them.

    The offline ``FD-<dataset>`` figures need a labelled dataset (digits, fashion_mnist); an
    image-folder run is evaluated only with ``inception_weights`` (standard FID).
    """
    pipe = load(checkpoint, device=device, allow_nonfinite=True)
    # a diverged model is sampled anyway, so the report counts what it really produces
    diverged = (f"{pipe.checkpoint}: {ckpt.nonfinite_message(pipe.nonfinite)}"
                if pipe.nonfinite else None)
    cfg = pipe.config
    labelled = cfg.data.dataset in LABELLED_DATASETS
    if not labelled and inception_weights is None:
        extractor_for(cfg, cache=cache)  # raises the explanation (folder: no labelled split)
    inception = None
    if inception_weights is not None:  # a bad file is refused before any sampling
        inception = load_inception(inception_weights).to(pipe.device)
    s = cfg.sample
    t0 = time.perf_counter()
    x, y = pipe.sample(num, sampler=sampler, steps=steps, cfg_scale=cfg_scale, seed=seed,
                       allow_nonfinite=True)  # counted in the figures (num_nonfinite)
    sample_s = time.perf_counter() - t0
    res: dict[str, Any] = {}
    if labelled:
        res = evaluate_samples(extractor_for(cfg, cache=cache), x, y, k=k, seed=seed)
    if inception_weights is not None:
        res["inception"] = inception_fid(inception_weights, x, cfg, seed=seed, cache=cache,
                                         net=inception)
        res.setdefault("num", num)
        res.setdefault("num_nonfinite", res["inception"]["num_nonfinite"])
    res.update(checkpoint=str(pipe.checkpoint), step=pipe.step, dataset=cfg.data.dataset,
               sampler=sampler or s.sampler, steps=steps or s.steps,
               cfg_scale=s.cfg_scale if cfg_scale is None else cfg_scale, seed=seed,
               sample_seconds=round(sample_s, 2))
    if diverged:
        res["error"] = "; ".join(filter(None, [f"{diverged} (the model diverged)",
                                              res.get("error")]))
    return _clean(res)


def _f(v: Any, spec: str) -> str:
    return "n/a" if v is None else format(v, spec)


def format_result(res: dict) -> str:
    """The human-readable summary of :func:`evaluate_checkpoint`."""
    lines = [f"{res['num']} samples from {res['checkpoint']} (step {res['step']}; "
             f"{res['sampler']}, {res['steps']} steps, cfg {res['cfg_scale']}):"]
    if res.get("num_nonfinite"):
        lines.append(f"  NON-FINITE samples: {res['num_nonfinite']} of {res['num']} "
                     "(dropped before measuring)")
    if "metric" in res:
        fn = res["feature_net"]
        fl = res.get("real_floor") or {}
        lines.append(f"  feature network: {fn['name']} v{fn['version']} at "
                     f"{fn['image_size']}px, test accuracy {fn['test_accuracy']:.1%}")
    if res.get("error"):
        lines.append(f"  no metrics: {res['error']}" if res.get("fd") is None
                     else f"  warning: {res['error']}")
    if "metric" in res:
        rows = [(res["metric"], "fd", ".3f"), ("KID", "kid", ".4f"),
                ("precision", "precision", ".3f"), ("recall", "recall", ".3f")]
        for label, key, spec in rows:
            floor = f"   [real vs real at this N: {_f(fl.get(key), spec)}]" if fl else ""
            # a spread only when KID had several distinct subsets (N > 1,000)
            extra = (f" ± {_f(res.get('kid_std'), '.4f')}"
                     if key == "kid" and (res.get("kid_std") or 0) > 1e-12 else "")
            lines.append(f"  {label + ':':<12} {_f(res.get(key), spec)}{extra}{floor}")
        if "class_accuracy" in res:
            lines.append(f"  {'class acc.:':<12} {_f(res['class_accuracy'], '.1%')}   "
                         f"[samples classified as the class they were drawn for]")
    if "inception" in res:
        inc = res["inception"]
        lines.append(f"  Inception FID: {_f(inc.get('fid'), '.2f')} "
                     f"({inc['num_real']} real images, {inc['weights']})")
    return "\n".join(lines)


def run_cli(a: argparse.Namespace) -> dict:
    """Evaluate, print the summary (or JSON), optionally write JSON; returns the figures."""
    if a.num < 2:
        raise ValueError(f"--num must be at least 2, got {a.num}")
    if a.steps is not None and a.steps < 1:
        raise ValueError(f"--steps must be at least 1, got {a.steps}")
    if a.k < 1 or a.k >= a.num:
        raise ValueError(f"-k must be in [1, {a.num - 1}] (below --num), got {a.k}")
    res = evaluate_checkpoint(a.checkpoint, num=a.num, sampler=a.sampler, steps=a.steps,
                              cfg_scale=a.cfg_scale, seed=a.seed, k=a.k,
                              inception_weights=a.inception_weights, device=a.device)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=1))
    if a.json:
        print(json.dumps(res))
    else:
        print(format_result(res))
        if a.out:
            print(f"  figures: {a.out}")
    return res
