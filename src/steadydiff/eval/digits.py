"""Are the samples digits? A classifier trained on the real bundled digits judges them.

Used by the sampler and fine-tuning benchmarks (``bench/samplers.py``, ``bench/finetune.py``);
``steadydiff eval`` uses the FD/KID/precision-recall evaluation in :mod:`.evaluate`. An
RBF-SVM (with Platt-scaled probabilities) trained on scikit-learn's 1,797 real 8x8 digits
scores the samples, after the samples are average-pooled back to 8x8. Reported:

- ``confident_rate``: fraction of samples whose top class probability is >= ``threshold``;
- ``class_coverage``: how many of the ten classes appear among the confident samples;
- ``label_accuracy``: for class-conditional samples, how often the classifier agrees with the
  label the sample was drawn for;
- the same classifier's figures on held-out real digits and on noise, as the scale to read
  the numbers against (real digits score near the top, noise near the bottom).
"""

from __future__ import annotations

import functools
import warnings

import numpy as np
import torch
import torch.nn.functional as F


@functools.lru_cache(maxsize=1)
def classifier(seed: int = 0):
    """An RBF-SVM on the real 8x8 digits (features scaled to [0, 1]); cached per process.

    Returns ``(model, held_out_x, held_out_y)``: the fitted classifier and a 20% split it
    was not trained on (for calibration figures).
    """
    from sklearn.datasets import load_digits  # deferred: scikit-learn is a slow import
    from sklearn.model_selection import train_test_split
    from sklearn.svm import SVC

    d = load_digits()
    x = d.data.astype(np.float64) / 16.0
    xtr, xte, ytr, yte = train_test_split(x, d.target, test_size=0.2, random_state=seed,
                                          stratify=d.target)
    # libsvm's pairwise-coupled Platt probabilities. sklearn 1.9 deprecates them for
    # CalibratedClassifierCV, but that one-vs-rest calibration calls 64-78% of pure noise
    # "confidently a digit" (measured), which would make this metric meaningless; the
    # pairwise coupling calls 0% of noise confident. Hence scikit-learn<1.11 in pyproject.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model = SVC(C=10.0, gamma="scale", probability=True, random_state=seed).fit(xtr, ytr)
    return model, xte, yte


def to_features(x: torch.Tensor) -> np.ndarray:
    """(N, C, H, W) images in [-1, 1] -> (N, 64) gray 8x8 features in [0, 1]."""
    x = x.detach().float().cpu()
    if x.shape[1] > 1:
        x = x.mean(1, keepdim=True)
    x = F.adaptive_avg_pool2d(x, 8) if x.shape[-1] != 8 else x
    return ((x.clamp(-1, 1) + 1) / 2).reshape(x.shape[0], 64).numpy().astype(np.float64)


def score_features(feats: np.ndarray, labels: np.ndarray | None = None,
                   threshold: float = 0.9) -> dict:
    model, _, _ = classifier()
    probs = model.predict_proba(feats)
    pred = model.classes_[probs.argmax(1)]
    conf = probs.max(1)
    confident = conf >= threshold
    out = {
        "num": int(len(feats)),
        "confident_rate": float(confident.mean()),
        "mean_confidence": float(conf.mean()),
        "class_coverage": int(len(set(pred[confident].tolist()))),
        "class_histogram": np.bincount(pred[confident], minlength=10).tolist(),
        "threshold": threshold,
    }
    if labels is not None:
        out["label_accuracy"] = float((pred == labels).mean())
    return out


def evaluate_samples(x: torch.Tensor, labels: torch.Tensor | None = None,
                     threshold: float = 0.9) -> dict:
    """Score samples (N, C, H, W) in [-1, 1]; ``labels`` are the classes they were drawn for."""
    return score_features(to_features(x), None if labels is None else labels.cpu().numpy(),
                          threshold)


def reference_scores(threshold: float = 0.9, seed: int = 0) -> dict:
    """The classifier's figures on held-out real digits and on two kinds of noise."""
    _, xte, yte = classifier()
    g = np.random.default_rng(seed)
    noise = g.uniform(0, 1, size=(500, 64))
    blobs = F.avg_pool2d(torch.from_numpy(g.uniform(0, 1, (500, 1, 8, 8))), 3, 1, 1)
    return {
        "real_held_out": score_features(xte, yte, threshold),
        "uniform_noise": score_features(noise, None, threshold),
        "smoothed_noise": score_features(blobs.reshape(500, 64).numpy(), None, threshold),
    }
