"""True FID with the standard FID InceptionV3, from a local weights file (never a download).

FID (Heusel et al. 2017) is defined on the 2048-d pool features of one particular
InceptionV3: the TensorFlow graph ``2015-12-05`` that the original TTUR code used, ported to
PyTorch as ``pt_inception-2015-12-05-6726825d.pth`` (pytorch-fid's release). That network is
not torchvision's InceptionV3: four of its blocks differ (Seitzer, pytorch-fid,
``FIDInception*``), and using torchvision's blocks gives different numbers:

- the average-pool branch of the A, C and first E blocks ignores the zero padding in its
  average (TensorFlow's ``count_include_pad=False``);
- the last E block (``Mixed_7c``) pools its branch with a 3x3 *max* pool, stride 1;
- the classifier has 1008 outputs.

This file builds that architecture with the same module names, so the standard state dict
loads key for key (``Conv2d_1a_3x3.conv.weight``, ``Mixed_5b.branch1x1.bn.running_mean``,
``fc.weight`` ...). torchvision is not needed. Inputs are resized to 299×299 bilinearly and
fed in [-1, 1]; gray images are repeated to three channels.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..data import build_dataset
from .features import _atomic_write, _save_npy, cache_dir
from .metrics import frechet_distance_features

FEATURE_DIM = 2048


class BasicConv2d(nn.Module):
    """Conv (no bias) + BatchNorm (eps 1e-3, TensorFlow's) + ReLU."""

    def __init__(self, cin: int, cout: int, kernel_size, stride=1, padding=0) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, kernel_size, stride=stride, padding=padding, bias=False)
        self.bn = nn.BatchNorm2d(cout, eps=0.001)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(x)))


def _avg_pool_no_pad(x: torch.Tensor) -> torch.Tensor:
    return F.avg_pool2d(x, 3, stride=1, padding=1, count_include_pad=False)


class InceptionA(nn.Module):  # Mixed_5b/c/d: 35x35
    def __init__(self, cin: int, pool_features: int) -> None:
        super().__init__()
        self.branch1x1 = BasicConv2d(cin, 64, 1)
        self.branch5x5_1 = BasicConv2d(cin, 48, 1)
        self.branch5x5_2 = BasicConv2d(48, 64, 5, padding=2)
        self.branch3x3dbl_1 = BasicConv2d(cin, 64, 1)
        self.branch3x3dbl_2 = BasicConv2d(64, 96, 3, padding=1)
        self.branch3x3dbl_3 = BasicConv2d(96, 96, 3, padding=1)
        self.branch_pool = BasicConv2d(cin, pool_features, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([
            self.branch1x1(x),
            self.branch5x5_2(self.branch5x5_1(x)),
            self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x))),
            self.branch_pool(_avg_pool_no_pad(x))], 1)


class InceptionB(nn.Module):  # Mixed_6a: 35x35 -> 17x17
    def __init__(self, cin: int) -> None:
        super().__init__()
        self.branch3x3 = BasicConv2d(cin, 384, 3, stride=2)
        self.branch3x3dbl_1 = BasicConv2d(cin, 64, 1)
        self.branch3x3dbl_2 = BasicConv2d(64, 96, 3, padding=1)
        self.branch3x3dbl_3 = BasicConv2d(96, 96, 3, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([
            self.branch3x3(x),
            self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x))),
            F.max_pool2d(x, 3, stride=2)], 1)


class InceptionC(nn.Module):  # Mixed_6b/c/d/e: 17x17, factorized 7x7
    def __init__(self, cin: int, c7: int) -> None:
        super().__init__()
        row = dict(kernel_size=(1, 7), padding=(0, 3))  # a 1x7 then a 7x1: a factorized 7x7
        col = dict(kernel_size=(7, 1), padding=(3, 0))
        self.branch1x1 = BasicConv2d(cin, 192, 1)
        self.branch7x7_1 = BasicConv2d(cin, c7, 1)
        self.branch7x7_2 = BasicConv2d(c7, c7, **row)
        self.branch7x7_3 = BasicConv2d(c7, 192, **col)
        self.branch7x7dbl_1 = BasicConv2d(cin, c7, 1)
        self.branch7x7dbl_2 = BasicConv2d(c7, c7, **col)
        self.branch7x7dbl_3 = BasicConv2d(c7, c7, **row)
        self.branch7x7dbl_4 = BasicConv2d(c7, c7, **col)
        self.branch7x7dbl_5 = BasicConv2d(c7, 192, **row)
        self.branch_pool = BasicConv2d(cin, 192, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x
        for m in (self.branch7x7dbl_1, self.branch7x7dbl_2, self.branch7x7dbl_3,
                  self.branch7x7dbl_4, self.branch7x7dbl_5):
            d = m(d)
        return torch.cat([
            self.branch1x1(x),
            self.branch7x7_3(self.branch7x7_2(self.branch7x7_1(x))),
            d,
            self.branch_pool(_avg_pool_no_pad(x))], 1)


class InceptionD(nn.Module):  # Mixed_7a: 17x17 -> 8x8
    def __init__(self, cin: int) -> None:
        super().__init__()
        self.branch3x3_1 = BasicConv2d(cin, 192, 1)
        self.branch3x3_2 = BasicConv2d(192, 320, 3, stride=2)
        self.branch7x7x3_1 = BasicConv2d(cin, 192, 1)
        self.branch7x7x3_2 = BasicConv2d(192, 192, (1, 7), padding=(0, 3))
        self.branch7x7x3_3 = BasicConv2d(192, 192, (7, 1), padding=(3, 0))
        self.branch7x7x3_4 = BasicConv2d(192, 192, 3, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = self.branch7x7x3_4(self.branch7x7x3_3(self.branch7x7x3_2(self.branch7x7x3_1(x))))
        return torch.cat([self.branch3x3_2(self.branch3x3_1(x)), b,
                          F.max_pool2d(x, 3, stride=2)], 1)


class InceptionE(nn.Module):  # Mixed_7b/c: 8x8, expanded filter banks
    def __init__(self, cin: int, max_pool: bool) -> None:
        super().__init__()
        self.max_pool = max_pool  # Mixed_7c of the FID network max-pools its pool branch
        self.branch1x1 = BasicConv2d(cin, 320, 1)
        self.branch3x3_1 = BasicConv2d(cin, 384, 1)
        self.branch3x3_2a = BasicConv2d(384, 384, (1, 3), padding=(0, 1))
        self.branch3x3_2b = BasicConv2d(384, 384, (3, 1), padding=(1, 0))
        self.branch3x3dbl_1 = BasicConv2d(cin, 448, 1)
        self.branch3x3dbl_2 = BasicConv2d(448, 384, 3, padding=1)
        self.branch3x3dbl_3a = BasicConv2d(384, 384, (1, 3), padding=(0, 1))
        self.branch3x3dbl_3b = BasicConv2d(384, 384, (3, 1), padding=(1, 0))
        self.branch_pool = BasicConv2d(cin, 192, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.branch3x3_1(x)
        d = self.branch3x3dbl_2(self.branch3x3dbl_1(x))
        pool = F.max_pool2d(x, 3, stride=1, padding=1) if self.max_pool else _avg_pool_no_pad(x)
        return torch.cat([
            self.branch1x1(x),
            self.branch3x3_2a(a), self.branch3x3_2b(a),
            self.branch3x3dbl_3a(d), self.branch3x3dbl_3b(d),
            self.branch_pool(pool)], 1)


class FIDInceptionV3(nn.Module):
    """The FID variant of InceptionV3; :meth:`features` gives the 2048-d pool3 vector."""

    def __init__(self) -> None:
        super().__init__()
        self.Conv2d_1a_3x3 = BasicConv2d(3, 32, 3, stride=2)
        self.Conv2d_2a_3x3 = BasicConv2d(32, 32, 3)
        self.Conv2d_2b_3x3 = BasicConv2d(32, 64, 3, padding=1)
        self.Conv2d_3b_1x1 = BasicConv2d(64, 80, 1)
        self.Conv2d_4a_3x3 = BasicConv2d(80, 192, 3)
        self.Mixed_5b = InceptionA(192, 32)
        self.Mixed_5c = InceptionA(256, 64)
        self.Mixed_5d = InceptionA(288, 64)
        self.Mixed_6a = InceptionB(288)
        self.Mixed_6b = InceptionC(768, 128)
        self.Mixed_6c = InceptionC(768, 160)
        self.Mixed_6d = InceptionC(768, 160)
        self.Mixed_6e = InceptionC(768, 192)
        self.Mixed_7a = InceptionD(768)
        self.Mixed_7b = InceptionE(1280, max_pool=False)
        self.Mixed_7c = InceptionE(2048, max_pool=True)
        self.fc = nn.Linear(2048, 1008)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """(N, C, H, W) in [-1, 1], C = 1 or 3 -> (N, 2048)."""
        if x.shape[1] == 1:
            x = x.expand(-1, 3, -1, -1)
        x = F.interpolate(x, size=(299, 299), mode="bilinear", align_corners=False)
        x = self.Conv2d_2b_3x3(self.Conv2d_2a_3x3(self.Conv2d_1a_3x3(x)))  # (N, 64, 147, 147)
        x = F.max_pool2d(x, 3, stride=2)
        x = self.Conv2d_4a_3x3(self.Conv2d_3b_1x1(x))  # (N, 192, 71, 71)
        x = F.max_pool2d(x, 3, stride=2)  # (N, 192, 35, 35)
        for m in (self.Mixed_5b, self.Mixed_5c, self.Mixed_5d, self.Mixed_6a, self.Mixed_6b,
                  self.Mixed_6c, self.Mixed_6d, self.Mixed_6e, self.Mixed_7a, self.Mixed_7b,
                  self.Mixed_7c):
            x = m(x)  # ... -> (N, 2048, 8, 8)
        return x.mean((2, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x))


class InceptionWeightsError(ValueError):
    """The weights file is missing, unreadable, or not the FID Inception state dict."""


def load_inception(path: str | Path) -> FIDInceptionV3:
    """Build :class:`FIDInceptionV3` and load the state dict at ``path`` (a local file, read
    with ``torch.load(weights_only=True)``: tensors only, nothing is unpickled).

    Raises:
        InceptionWeightsError: no such file, not loadable safely, or keys/shapes that do not
            match (the message lists the missing and unexpected keys).
    """
    p = Path(path)
    if not p.is_file():
        raise InceptionWeightsError(
            f"Inception weights {str(p)!r} not found; pass the local path of the standard FID "
            f"weights (pt_inception-2015-12-05-6726825d.pth, pytorch-fid's release). steadydiff "
            f"never downloads them.")
    try:
        sd = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:
        from ..trainer.safe_dcp import why_refused

        raise InceptionWeightsError(f"{p}: cannot be loaded as a tensor state dict "
                                    f"({type(e).__name__}: {why_refused(e)}); it was not "
                                    f"unpickled") from None
    if not isinstance(sd, dict):
        raise InceptionWeightsError(f"{p}: holds a {type(sd).__name__}, expected a state dict")
    net = FIDInceptionV3()
    want = {k: v.shape for k, v in net.state_dict().items()
            if not k.endswith("num_batches_tracked")}
    have = {k for k in sd if not k.endswith("num_batches_tracked")}
    missing, unexpected = sorted(set(want) - have), sorted(have - set(want))
    bad_shape = [f"{k}: {tuple(sd[k].shape)} (expected {tuple(want[k])})" for k in want
                 if k in sd and tuple(sd[k].shape) != tuple(want[k])]
    if missing or unexpected or bad_shape:
        def show(keys: list[str]) -> str:
            return ", ".join(keys[:8]) + (f" ... ({len(keys)} in all)" if len(keys) > 8 else "")
        raise InceptionWeightsError(
            f"{p} is not the FID InceptionV3 state dict: "
            + "; ".join(part for part in (
                f"missing keys: {show(missing)}" if missing else "",
                f"unexpected keys: {show(unexpected)}" if unexpected else "",
                f"wrong shapes: {show(bad_shape)}" if bad_shape else "") if part))
    net.load_state_dict({k: v for k, v in sd.items() if k in want}, strict=False)
    return net.eval().requires_grad_(False)


@torch.no_grad()
def inception_features(net: FIDInceptionV3, x: torch.Tensor, batch: int = 50) -> np.ndarray:
    """(N, C, H, W) in [-1, 1] -> (N, 2048) float64 features."""
    dev = next(net.parameters()).device
    return torch.cat([net.features(x[i:i + batch].float().to(dev)).double().cpu()
                      for i in range(0, x.shape[0], batch)]).numpy()


def _sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:12]


def inception_fid(weights: str | Path, x: torch.Tensor, cfg, *, seed: int = 0,
                  cache: Path | None = None, net: FIDInceptionV3 | None = None) -> dict:
    """FID between samples ``x`` and as many real images of ``cfg.data``'s dataset (a seeded
    subset; their features are cached per dataset, resolution, weights file and N)."""

    net = net or load_inception(weights)
    n = x.shape[0]
    finite = torch.isfinite(x.reshape(n, -1)).all(1)
    xf = x[finite].clamp(-1, 1)
    res = {"weights": str(weights), "num_nonfinite": int((~finite).sum()), "fid": None}
    data = build_dataset(cfg.data)
    m = min(len(data), n)
    res["num_real"] = m
    key = f"inception-{cfg.data.dataset}-{cfg.data.image_size}px-{_sha(Path(weights))}-n{m}-s{seed}"
    folder = (cache or cache_dir())
    path = folder / f"{key}.npy"
    real = None
    if path.is_file():
        try:
            real = np.load(path, allow_pickle=False)
            if real.shape != (m, FEATURE_DIM) or not np.isfinite(real).all():
                real = None
        except (OSError, ValueError):
            real = None  # corrupt: rebuilt below
    if real is None:
        idx = np.random.default_rng(seed).permutation(len(data))[:m]
        xr = torch.stack([data[int(i)][0] for i in idx])
        real = inception_features(net, xr)
        folder.mkdir(parents=True, exist_ok=True)
        _atomic_write(path, lambda p: _save_npy(p, real))
        (folder / f"{key}.json").write_text(json.dumps({"dataset": cfg.data.dataset, "n": m}))
    if xf.shape[0] >= 2:
        res["fid"] = frechet_distance_features(real, inception_features(net, xf))
    else:
        res["error"] = f"only {xf.shape[0]} finite samples"
    if m < FEATURE_DIM:
        res["note"] = (f"{m} images < 2048 feature dimensions: the covariances are rank-"
                       f"deficient and FID is strongly biased upward; compare only at equal N")
    return res
