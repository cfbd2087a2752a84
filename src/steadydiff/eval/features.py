"""The feature network for offline Fréchet distance: a small CNN trained on the dataset.

Every FID package downloads Inception weights at run time. Offline, steadydiff trains its own
feature network instead: a small classifier on the labelled training split of the run's
dataset, at the run's resolution, deterministically (fixed seed, one thread, a fixed batch
order), so the same weights come out on any machine with the same torch build. Its features
(the 64 globally pooled channels of the last conv block) define the metric, named after the
dataset: ``FD-digits``, ``FD-fashion_mnist``. Its accuracy on the test split is reported
with every result, as evidence that the features see the dataset's structure.

Which images, per dataset (``labelled_splits``):

- ``digits``: scikit-learn's 1,797 digits at the run's size; a fixed stratified 80/20 split
  (``train_test_split(random_state=0)``) trains / tests the classifier. The real reference
  set is all 1,797 (what the diffusion model trains on).
- ``fashion_mnist``: the official 60k train / 10k test split; reference = the train split.
- ``folder``: no labelled split exists; refused (use ``--inception-weights``).

Cache (``$STEADYDIFF_CACHE``, default ``~/.cache/steadydiff``), one folder per
``featnet-<dataset>-v<VERSION>-<S>px``: ``weights.safetensors``, ``meta.json`` (accuracies,
training cost), ``real_features.npy`` and ``real_labels.npy`` (the reference set). Files are written
to a temporary name and renamed; an unreadable or inconsistent file is rebuilt, with a warning.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from ..data import DigitsDataset, FashionMNISTDataset
from ..kinds import LABELLED_DATASETS, DatasetName

log = logging.getLogger(__name__)

# Bump when the architecture, the training recipe or the preprocessing changes: cached
# weights and statistics of an older version are then ignored, never mixed.
VERSION = 2
FEATURE_DIM = 64
# Training recipe per dataset: (optimizer steps, batch size). Digits: ~10 epochs of 1,437
# images (a few seconds); Fashion-MNIST: ~2 epochs of 60k (about a minute on one thread).
RECIPE = {"digits": (250, 64), "fashion_mnist": (2000, 64)}


class FeatureNet(nn.Module):
    """Three conv blocks (16, 32, 64 channels; 2x downsampling after the first two), global
    average pooling to the 64-d feature, and a linear classifier. Input (N, 1, S, S) in
    [-1, 1], any S >= 4."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()

        def block(cin: int, cout: int) -> nn.Sequential:
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.GroupNorm(8, cout),
                                 nn.SiLU(), nn.Conv2d(cout, cout, 3, padding=1),
                                 nn.GroupNorm(8, cout), nn.SiLU())

        self.blocks = nn.ModuleList([block(1, 16), block(16, 32), block(32, FEATURE_DIM)])
        self.head = nn.Linear(FEATURE_DIM, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """(N, 1, S, S) -> (N, 64)."""
        for i, b in enumerate(self.blocks):
            x = b(x)
            if i < len(self.blocks) - 1 and x.shape[-1] >= 4:
                x = F.avg_pool2d(x, 2)
        return x.mean((2, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def to_gray(x: torch.Tensor) -> torch.Tensor:
    """(N, C, S, S) in [-1, 1] -> (N, 1, S, S) float32 on the CPU (channel mean)."""
    x = x.detach().float().cpu()
    return x.mean(1, keepdim=True) if x.shape[1] > 1 else x


def cache_dir() -> Path:
    return Path(os.environ.get("STEADYDIFF_CACHE") or Path.home() / ".cache" / "steadydiff")


def labelled_splits(dataset: DatasetName, image_size: int, path: str | None = None,
                    pad_to: int | None = None) -> tuple[torch.Tensor, ...]:
    """``(x_train, y_train, x_test, y_test, x_reference, y_reference)``; images gray
    (N, 1, S, S) in [-1, 1], labels (N,) int64.

    Raises:
        ValueError: a dataset without labelled splits (``folder``).
    """
    if dataset == "digits":
        from sklearn.model_selection import train_test_split  # deferred: a slow import

        d = DigitsDataset(image_size, 1)
        x, y = d.images.clone(), d.labels
        itr, ite = train_test_split(np.arange(len(y)), test_size=0.2, random_state=0,
                                    stratify=y.numpy())
        itr, ite = torch.from_numpy(np.sort(itr)), torch.from_numpy(np.sort(ite))
        return x[itr], y[itr], x[ite], y[ite], x, y
    if dataset == "fashion_mnist":
        # the run's own framing (data.pad_to): real and generated images compared alike
        tr = FashionMNISTDataset(image_size, 1, root=path, split="train", pad_to=pad_to)
        te = FashionMNISTDataset(image_size, 1, root=path, split="test", pad_to=pad_to)
        xtr = tr.images_at(slice(None)).contiguous()
        return xtr, tr.labels, te.images_at(slice(None)).contiguous(), te.labels, xtr, tr.labels
    raise ValueError(
        f"the offline feature network needs a labelled dataset with a train/test split "
        f"({', '.join(LABELLED_DATASETS)}); data.dataset={dataset!r} has none. For an image "
        f"folder, evaluate with the standard FID Inception weights: --inception-weights "
        f"pt_inception-2015-12-05-*.pth")


@contextlib.contextmanager
def _isolated(threads: int = 1):
    """Own RNG and one thread: training the feature network must neither depend on nor
    disturb the caller's global RNG (a training run with eval trains like one without)."""
    prev = torch.get_num_threads()
    with torch.random.fork_rng(devices=[]):
        torch.set_num_threads(threads)
        try:
            yield
        finally:
            torch.set_num_threads(prev)


def train_feature_net(x: torch.Tensor, y: torch.Tensor, *, steps: int, batch_size: int = 64,
                      seed: int = 0, num_classes: int = 10) -> FeatureNet:
    """Train a :class:`FeatureNet` deterministically: seeded init, a seeded sequence of
    epoch permutations, AdamW with a cosine decay, one thread, fp32 on the CPU."""
    with _isolated(), torch.enable_grad():  # callers may sit under no_grad (eval in training)
        torch.manual_seed(seed)
        net = FeatureNet(num_classes)
        opt = torch.optim.AdamW(net.parameters(), lr=3e-3, weight_decay=1e-4)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
        g = torch.Generator().manual_seed(seed)
        order = torch.empty(0, dtype=torch.long)
        for _ in range(steps):
            if order.numel() < batch_size:
                order = torch.cat([order, torch.randperm(len(y), generator=g)])
            idx, order = order[:batch_size], order[batch_size:]
            loss = F.cross_entropy(net(x[idx]), y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
    return net.eval().requires_grad_(False)


@torch.no_grad()
def embed(net: FeatureNet, x: torch.Tensor, batch: int = 500) -> tuple[np.ndarray, np.ndarray]:
    """Features (N, 64) float32 and class probabilities (N, K) of images (N, C, S, S)."""
    feats, probs = [], []
    with _isolated():
        for i in range(0, x.shape[0], batch):
            f = net.features(to_gray(x[i:i + batch]))
            feats.append(f)
            probs.append(net.head(f).softmax(1))
    return torch.cat(feats).numpy(), torch.cat(probs).numpy()


@dataclass
class FeatureExtractor:
    """A trained feature network with its reference features, ready to embed samples."""

    name: str                 # the metric's name prefix, e.g. "digits"
    net: FeatureNet
    real: np.ndarray          # (N_ref, 64) features of the reference images
    labels: np.ndarray        # (N_ref,) their class labels
    meta: dict
    path: Path

    def __call__(self, x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        return embed(self.net, x)


def _atomic_write(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _save_npy(path: Path, a: np.ndarray, dtype=np.float32) -> None:
    with open(path, "wb") as f:  # a file object: np.save would append ".npy" to a name
        np.save(f, a.astype(dtype))


def _try_load(folder: Path, num_classes: int) -> FeatureExtractor | None:

    files = [folder / n for n in ("weights.safetensors", "meta.json", "real_features.npy",
                                  "real_labels.npy")]
    if not all(f.is_file() for f in files):
        return None
    try:
        meta = json.loads(files[1].read_text())
        net = FeatureNet(num_classes)
        net.load_state_dict(load_file(str(files[0])))
        real = np.load(files[2], allow_pickle=False)
        labels = np.load(files[3], allow_pickle=False)
        if meta.get("version") != VERSION or real.shape != (meta["num_reference"], FEATURE_DIM) \
                or labels.shape != (real.shape[0],) or not np.isfinite(real).all():
            raise ValueError("metadata and features do not match")
    except Exception as e:  # any corruption: rebuild rather than crash or trust it
        log.warning("feature-network cache %s is unreadable (%s: %s); rebuilding it",
                    folder, type(e).__name__, e)
        print(f"warning: feature-network cache {folder} is unreadable ({e}); rebuilding it",
              file=sys.stderr)
        return None
    return FeatureExtractor(meta["name"], net.eval().requires_grad_(False), real,
                            labels.astype(np.int64), meta, folder)


def feature_extractor(dataset: DatasetName, image_size: int, *, path: str | None = None,
                      cache: Path | None = None, rebuild: bool = False,
                      verbose: bool = True, pad_to: int | None = None) -> FeatureExtractor:
    """The cached feature network for ``dataset`` at ``image_size`` (trained on first use).

    Args:
        dataset: ``digits`` or ``fashion_mnist`` (``folder`` is refused with a ValueError).
        image_size: the run's resolution S.
        path: the dataset's files (``data.path``), for fashion_mnist.
        cache: the cache root (default :func:`cache_dir`).
        rebuild: ignore an existing cache entry.
        pad_to: fashion_mnist's ``data.pad_to`` (the real images framed as the run's are;
            a cache entry of its own).
    """
    if dataset not in LABELLED_DATASETS:
        labelled_splits(dataset, image_size, path)  # raises the explanatory ValueError
    pad = f"-pad{pad_to}" if pad_to else ""
    folder = (cache or cache_dir()) / f"featnet-{dataset}-v{VERSION}-{image_size}px{pad}"
    if not rebuild:
        found = _try_load(folder, 10)
        if found is not None:
            return found

    t0 = time.perf_counter()
    xtr, ytr, xte, yte, xref, yref = labelled_splits(dataset, image_size, path, pad_to)
    steps, bs = RECIPE[dataset]
    if verbose:
        print(f"training the {dataset} feature network ({image_size}px, {steps} steps, "
              f"one thread; cached in {folder}) ...", file=sys.stderr, flush=True)
    net = train_feature_net(xtr, ytr, steps=steps, batch_size=bs)
    _, p_te = embed(net, xte)
    _, p_tr = embed(net, xtr)
    real, _ = embed(net, xref)
    meta = {"name": dataset, "version": VERSION, "image_size": image_size, "pad_to": pad_to,
            "feature_dim": FEATURE_DIM, "train_steps": steps, "batch_size": bs, "seed": 0,
            "num_train": len(ytr), "num_test": len(yte), "num_reference": int(real.shape[0]),
            "train_accuracy": float((p_tr.argmax(1) == ytr.numpy()).mean()),
            "test_accuracy": float((p_te.argmax(1) == yte.numpy()).mean()),
            "train_seconds": round(time.perf_counter() - t0, 1),
            "torch": torch.__version__}
    folder.mkdir(parents=True, exist_ok=True)
    _atomic_write(folder / "weights.safetensors",
                  lambda p: save_file({k: v.contiguous() for k, v in net.state_dict().items()},
                                      str(p)))
    _atomic_write(folder / "real_features.npy", lambda p: _save_npy(p, real))
    _atomic_write(folder / "real_labels.npy", lambda p: _save_npy(p, yref.numpy(), np.int64))
    # meta.json last: its presence with matching shapes marks a complete entry
    _atomic_write(folder / "meta.json", lambda p: p.write_text(json.dumps(meta, indent=1)))
    if verbose:
        print(f"  feature network: test accuracy {meta['test_accuracy']:.1%} "
              f"({meta['train_seconds']:.0f} s)", file=sys.stderr)
    return FeatureExtractor(dataset, net, real, yref.numpy(), meta, folder)
