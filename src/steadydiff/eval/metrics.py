"""Distribution metrics on feature vectors: Fréchet distance, KID, precision/recall.

All three compare two sets of feature vectors (real and generated), computed by some feature
network (``features.py``: a small classifier trained on the dataset; ``inception.py``: the
standard FID InceptionV3). The numbers depend on the feature network: a Fréchet distance on
our digits classifier's features is *not* comparable with an Inception FID.

- Fréchet distance (Heusel et al. 2017, eq. 6): fit a Gaussian to each set and take
  ``|mu1 - mu2|^2 + tr(S1 + S2 - 2 (S1 S2)^(1/2))``. The matrix square root is computed in
  float64 through symmetric eigendecompositions (``tr (S1 S2)^(1/2)`` equals
  ``tr (S1^(1/2) S2 S1^(1/2))^(1/2)``, a symmetric PSD matrix), so it never goes complex.
  Biased upward for small N: compare only numbers computed with the same N.
- KID (Bińkowski et al. 2018, "Demystifying MMD GANs", sec. 4): the unbiased estimator of
  MMD² with the cubic polynomial kernel ``k(a, b) = (a·b / d + 1)^3``, averaged over random
  subsets; unbiased, so its expectation is 0 for two samples of one distribution (a single
  value may be negative).
- Precision and recall (Kynkäänniemi et al. 2019, "Improved Precision and Recall Metric",
  eq. 1-3): each set's manifold is the union of balls around its points with radius the
  distance to the k-th nearest neighbour; precision is the fraction of generated points inside
  the real manifold (fidelity), recall the fraction of real points inside the generated one
  (coverage).
"""

from __future__ import annotations

import numpy as np
import scipy.linalg
import torch


def _as64(x: np.ndarray | torch.Tensor) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2:
        raise ValueError(f"features must be a 2-D array (N, D), got shape {x.shape}")
    return x


def gaussian_stats(feats: np.ndarray | torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Mean (D,) and covariance (D, D), float64 (unbiased covariance, N-1)."""
    f = _as64(feats)
    if f.shape[0] < 2:
        raise ValueError(f"need at least 2 feature vectors for a covariance, got {f.shape[0]}")
    return f.mean(0), np.cov(f, rowvar=False)


def _psd_sqrt(s: np.ndarray) -> np.ndarray:
    w, v = scipy.linalg.eigh((s + s.T) / 2)
    return (v * np.sqrt(np.clip(w, 0.0, None))) @ v.T


def frechet_distance(mu1: np.ndarray, s1: np.ndarray, mu2: np.ndarray, s2: np.ndarray) -> float:
    """Fréchet distance between N(mu1, s1) and N(mu2, s2), in float64."""
    mu1, mu2 = np.asarray(mu1, np.float64), np.asarray(mu2, np.float64)
    s1, s2 = np.asarray(s1, np.float64), np.asarray(s2, np.float64)
    if mu1.shape != mu2.shape or s1.shape != s2.shape or s1.shape != (mu1.size, mu1.size):
        raise ValueError(f"Fréchet distance: mismatched shapes mu {mu1.shape}/{mu2.shape}, "
                         f"sigma {s1.shape}/{s2.shape}")
    r1 = _psd_sqrt(s1)
    m = r1 @ s2 @ r1  # symmetric PSD; its square root has the trace of (s1 s2)^(1/2)
    tr_covmean = np.sqrt(np.clip(scipy.linalg.eigvalsh((m + m.T) / 2), 0.0, None)).sum()
    d = mu1 - mu2
    return float(d @ d + np.trace(s1) + np.trace(s2) - 2.0 * tr_covmean)


def frechet_distance_features(a: np.ndarray | torch.Tensor,
                              b: np.ndarray | torch.Tensor) -> float:
    """Fréchet distance between the Gaussians fitted to two feature sets."""
    return frechet_distance(*gaussian_stats(a), *gaussian_stats(b))


def _mmd2_unbiased(x: np.ndarray, y: np.ndarray) -> float:
    d = x.shape[1]
    kxx = (x @ x.T / d + 1.0) ** 3
    kyy = (y @ y.T / d + 1.0) ** 3
    kxy = (x @ y.T / d + 1.0) ** 3
    m, n = x.shape[0], y.shape[0]
    return float((kxx.sum() - np.trace(kxx)) / (m * (m - 1))
                 + (kyy.sum() - np.trace(kyy)) / (n * (n - 1)) - 2.0 * kxy.mean())


def kernel_inception_distance(a: np.ndarray | torch.Tensor, b: np.ndarray | torch.Tensor, *,
                              subsets: int = 50, subset_size: int = 1000,
                              seed: int = 0) -> tuple[float, float]:
    """KID: unbiased MMD² (cubic polynomial kernel) averaged over random subsets.

    Each subset draws ``min(subset_size, len(a), len(b))`` points of each set without
    replacement. Returns ``(mean, std)`` over the subsets.
    """
    x, y = _as64(a), _as64(b)
    if x.shape[1] != y.shape[1]:
        raise ValueError(f"KID: feature widths differ ({x.shape[1]} vs {y.shape[1]})")
    m = min(subset_size, x.shape[0], y.shape[0])
    if m < 2:
        raise ValueError(f"KID needs at least 2 points per set, got {x.shape[0]} and {y.shape[0]}")
    g = np.random.default_rng(seed)
    vals = [_mmd2_unbiased(x[g.choice(x.shape[0], m, replace=False)],
                           y[g.choice(y.shape[0], m, replace=False)]) for _ in range(subsets)]
    return float(np.mean(vals)), float(np.std(vals))


def _kth_nn_radius(x: torch.Tensor, k: int, chunk: int = 1024) -> torch.Tensor:
    """Distance from each point to its k-th nearest neighbour in the same set (self excluded)."""
    out = []
    for i in range(0, x.shape[0], chunk):
        d = torch.cdist(x[i:i + chunk], x)  # (c, N)
        # the point itself is at distance 0 and is the 1st smallest: take the (k+1)-th
        out.append(d.kthvalue(k + 1, dim=1).values)
    return torch.cat(out)


def _inside(points: torch.Tensor, centers: torch.Tensor, radii: torch.Tensor,
            chunk: int = 1024) -> torch.Tensor:
    """For each point: is it within radius of at least one center?"""
    out = []
    for i in range(0, points.shape[0], chunk):
        d = torch.cdist(points[i:i + chunk], centers)  # (c, M)
        out.append((d <= radii[None, :]).any(1))
    return torch.cat(out)


def precision_recall(real: np.ndarray | torch.Tensor, fake: np.ndarray | torch.Tensor,
                     k: int = 3) -> tuple[float, float]:
    """Improved precision and recall (Kynkäänniemi et al. 2019) with k nearest neighbours.

    Returns ``(precision, recall)``, each in [0, 1].
    """
    r, f = torch.from_numpy(_as64(real)), torch.from_numpy(_as64(fake))
    if r.shape[1] != f.shape[1]:
        raise ValueError(f"precision/recall: feature widths differ ({r.shape[1]} vs {f.shape[1]})")
    if k < 1 or k >= min(r.shape[0], f.shape[0]):
        raise ValueError(f"precision/recall: k must be in [1, {min(r.shape[0], f.shape[0]) - 1}] "
                         f"for sets of {r.shape[0]} and {f.shape[0]} points, got {k}")
    precision = _inside(f, r, _kth_nn_radius(r, k)).double().mean().item()
    recall = _inside(r, f, _kth_nn_radius(f, k)).double().mean().item()
    return precision, recall


def compare(real: np.ndarray | torch.Tensor, fake: np.ndarray | torch.Tensor, *, k: int = 3,
            kid_subsets: int = 50, kid_subset_size: int = 1000, seed: int = 0) -> dict:
    """FD, KID (mean, std) and precision/recall between two feature sets (finite rows only)."""
    fd = frechet_distance_features(real, fake)
    kid, kid_std = kernel_inception_distance(real, fake, subsets=kid_subsets,
                                             subset_size=kid_subset_size, seed=seed)
    p, r = precision_recall(real, fake, k)
    return {"fd": fd, "kid": kid, "kid_std": kid_std, "precision": p, "recall": r}
