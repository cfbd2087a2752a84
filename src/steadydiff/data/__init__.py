"""Datasets, transforms and the resumable, exactly reproducible batch stream.

Two datasets ship with the library: the digits bundled with scikit-learn (no download, the
quick-start) and a folder of images. Any other torch ``Dataset`` is adapted by ``as_pairs``.
Every dataset yields ``(image (C, H, W) float32 in [-1, 1], label int64)``.

Batching is built so that the whole data position is **one integer**, the number of batches
consumed (EDM2's "progress in one unit, reseed from progress"):

* ``StreamBatchSampler`` treats the data as an endless stream of concatenated epoch
  permutations; batch ``b`` covers stream positions ``[b*B, (b+1)*B)``. The permutation of
  epoch ``e`` comes from a generator seeded by a hash of ``(seed, e)``, so any batch can be
  recomputed from ``b`` alone: resuming at ``start_batch=b`` replays exactly the batches the
  killed run would have seen, and a guard can replay or skip a window of batches.
* ``SeededView`` draws per-sample augmentation from a generator seeded by a hash of
  ``(seed, epoch, index)``, never from the global RNG, so augmentation does not depend on the
  number of data-loader workers, on prefetching, or on where the run was resumed.

Bad input gets a clear ``DataError`` (which path, what would be valid); a corrupt image found
mid-training is logged once, counted and replaced by the next good one so training goes on.
"""

from __future__ import annotations

import gzip
import logging
import math
import os
import warnings
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageOps
from torch.utils.data import DataLoader, Dataset, Sampler

from steadydiff.data.buckets import (BucketBatchSampler, BucketLayout, Crop, assign,
                                     bucket_layout, make_buckets, plan_crop)
from steadydiff.kinds import CHANNELS, DATASETS, Channels, Split
from steadydiff.seeding import derive_seed

if TYPE_CHECKING:
    from steadydiff.config import DataConfig

log = logging.getLogger(__name__)

IMAGE_EXTENSIONS: tuple[str, ...] = (".png", ".jpg", ".jpeg", ".webp")

# One (index, epoch) pair names one sample of the stream: the same index seen in two epochs
# is two different samples (different augmentation).
StreamKey = tuple[int, int]


class DataError(ValueError):
    """Data that cannot be used. The message names the path or item and what would be valid."""


# --------------------------------------------------------------------------- labels

# A class label is an integer id in 0..K-1, K = model.num_classes. Id K is the null class of
# classifier-free guidance (Ho & Salimans 2022): the objective puts it in place of dropped
# labels, so a K coming from the data would silently train as "no class", and anything
# larger or negative would fail inside F.embedding naming neither the item nor the label.
# Labels are therefore checked where they enter: all at once before training when they can
# be read without the images (:func:`check_labels`), else as each item is fetched
# (``SeededView``, on the CPU), never in the model.


def item_name(data: Dataset, i: int) -> str:
    """``dataset item 7``, with its file when there is one (:func:`source_of`)."""
    path = source_of(data, i)
    return f"dataset item {i}" + (f" ({path})" if path is not None else "")


def _valid_ids(k: int) -> str:
    return (f"valid class ids are 0..{k - 1} (model.num_classes={k}; id {k} is reserved for "
            f"the null class of classifier-free guidance)")


def check_label(y: Any, num_classes: int | None, where: str | Any) -> int:
    """One item's label as an int, refused unless it is an integer class id in
    0..num_classes-1.

    Args:
        y: the label: an int, a numpy integer or a one-element integer tensor (on the CPU:
            the data side, no device sync).
        num_classes: the model's classes; 0 or None checks the type only (an unconditional
            model ignores labels).
        where: the item's name, or a function returning it (called only for the message).

    Raises:
        DataError: a non-integer or out-of-range label; the message names the item, the
            label and the valid ids.
    """
    if isinstance(y, torch.Tensor) and y.numel() == 1 and not y.is_floating_point() \
            and not y.is_complex() and y.dtype != torch.bool:
        v = int(y.item())
    elif isinstance(y, (int, np.integer)) and not isinstance(y, (bool, np.bool_)):
        v = int(y)
    else:
        name = where() if callable(where) else where
        ids = f"; {_valid_ids(num_classes)}" if num_classes else ""
        raise DataError(f"{name}: the label is {type(y).__name__} {y!r:.40}; expected an "
                        f"integer class id (int or one-element integer tensor){ids}")
    if num_classes and not 0 <= v < num_classes:
        name = where() if callable(where) else where
        raise DataError(f"{name}: label {v} is out of range; {_valid_ids(num_classes)}")
    return v


def labels_of(data: Dataset) -> torch.Tensor | None:
    """Every item's label, read without loading an image, or None when the labels come only
    with the images.

    Read from ``data.labels`` (the built-in datasets, ``ClassSubset``, a user dataset with
    one label per item; an ``as_pairs`` dataset exposes its source's, or a
    ``TensorDataset``'s second tensor). A ``labels`` attribute of another length (class
    names, say) or of non-numbers is not taken for per-item labels.
    """
    labels = getattr(data, "labels", None)
    if labels is None:
        return None
    try:
        t = (labels.detach().cpu() if isinstance(labels, torch.Tensor)
             else torch.as_tensor(np.asarray(labels)))
    except (TypeError, ValueError, RuntimeError):
        return None
    if t.ndim != 1 or len(t) != len(data) or t.dtype == torch.bool or t.is_complex():
        return None
    return t


def check_labels(data: Dataset, num_classes: int, labels: torch.Tensor | None = None) -> None:
    """Refuse, before training, the first label that is no class id in 0..num_classes-1,
    when the labels can be read without the images (:func:`labels_of`); otherwise they are
    checked as each item is fetched.

    Raises:
        DataError: naming the item (with its file for a folder), the label and the valid ids.
    """
    labels = labels_of(data) if labels is None else labels
    if labels is None or not num_classes:
        return
    bad = (labels < 0) | (labels >= num_classes)
    if labels.is_floating_point():
        bad |= labels != labels.round()  # also NaN
    if not bool(bad.any()):
        return
    i = int(bad.nonzero()[0])
    v = labels[i].item()
    if isinstance(v, float) and not v.is_integer():
        raise DataError(f"{item_name(data, i)}: the label is {v!r}, not an integer class id; "
                        f"{_valid_ids(num_classes)}")
    raise DataError(f"{item_name(data, i)}: label {int(v)} is out of range; "
                    f"{_valid_ids(num_classes)}" + (f" ({int(bad.sum())} labels out of range)"
                                                    if int(bad.sum()) > 1 else ""))


# --------------------------------------------------------------------------- seeding

# Domain tags for ``derive_seed``: the permutation, augmentation and loader streams of one run
# seed must never coincide with each other or with the training step's (seed, step, micro,
# rank) stream. Changing a tag changes every run's data order: don't.
_TAG_PERM = 0x7065726D  # "perm"
_TAG_AUG = 0x61756720  # "aug "
_TAG_LOADER = 0x6C6F6164  # "load"


# --------------------------------------------------------------------------- digits


class DigitsDataset(Dataset):
    """scikit-learn's bundled 8×8 digits (1,797 images, labels 0-9), resized, in [-1, 1].

    The resized set is precomputed once as one tensor (1797×S×S floats: 1.8 MB at S=16), so
    ``__getitem__`` is an index, cheap enough for any number of workers. Above
    ``PRECOMPUTE_BYTES`` (S > ~190) each item is resized on access instead, with the same
    result, rather than holding gigabytes of upsampled 8×8 images.

    Args:
        image_size: output side S; 8 is the native size.
        channels: 1 (gray) or 3 (the gray channel repeated, for RGB models).
    """

    num_classes: int = 10
    PRECOMPUTE_BYTES = 256 * 2**20

    def __init__(self, image_size: int = 16, channels: Channels = 1) -> None:
        if channels not in CHANNELS:
            raise DataError(f"digits: channels must be 1 or 3, got {channels!r}")
        if image_size < 1:
            raise DataError(f"digits: image_size must be >= 1, got {image_size!r}")
        # Imported here: scikit-learn takes ~0.5 s to import and only this dataset needs it.
        from sklearn.datasets import load_digits

        d = load_digits()  # bundled with the package: no network
        self._base = torch.from_numpy(d.images.astype(np.float32) / 16.0).unsqueeze(1)
        self.labels = torch.from_numpy(d.target.astype(np.int64))  # (N,)
        self.channels = channels
        self.image_size = image_size
        n = self._base.shape[0]
        # One gray plane per image; channels are repeated at access.
        self._resized = (self._resize(self._base)  # (N, 1, S, S)
                         if n * image_size**2 * 4 <= self.PRECOMPUTE_BYTES else None)

    def _resize(self, x: torch.Tensor) -> torch.Tensor:
        """(n, 1, 8, 8) in [0, 1] -> (n, 1, S, S) in [-1, 1]."""
        s = self.image_size
        # antialias only matters when shrinking (S < 8); upsampling is plain bilinear.
        x = F.interpolate(x, size=(s, s), mode="bilinear", align_corners=False, antialias=True)
        return x.clamp_(0.0, 1.0).mul_(2.0).sub_(1.0)

    @property
    def images(self) -> torch.Tensor:
        """All images, (N, C, S, S); materialized on each call when not precomputed."""
        x = self._resized if self._resized is not None else self._resize(self._base)
        return x.expand(-1, self.channels, -1, -1)

    def __len__(self) -> int:
        return self._base.shape[0]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._resized is not None:
            x = self._resized[i]  # (1, S, S)
        else:
            x = self._resize(self._base[i:i + 1] if i >= 0 else self._base[[i]])[0]
        # A copy (a few KB), never a view: an in-place edit downstream must not reach the cache.
        return x.repeat(self.channels, 1, 1), self.labels[i].clone()

    def describe(self) -> str:
        """One line for the run log, e.g. ``digits: 1797 images 1×16×16, 10 classes``."""
        s = self.image_size
        return f"digits: {len(self)} images {self.channels}×{s}×{s}, {self.num_classes} classes"


# --------------------------------------------------------------------------- Fashion-MNIST

# Where Debian's ``dataset-fashion-mnist`` package installs the four idx files.
FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
_FASHION_FILES = {"train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
                  "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")}


def read_idx(path: str | os.PathLike[str]) -> np.ndarray:
    """Read an idx file (LeCun's MNIST format; gzip-compressed when the name ends in .gz):
    uint8 arrays only (magic 0x0000 08 <ndim>), big-endian dimension sizes."""
    p = Path(path)
    opener = gzip.open if p.suffix == ".gz" else open
    try:
        with opener(p, "rb") as f:
            data = f.read()
    except (OSError, EOFError) as e:
        raise DataError(f"{p}: cannot read idx file ({e})") from None
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] != 0x08:
        raise DataError(f"{p}: not an idx file of unsigned bytes (magic {data[:4].hex()!r}, "
                        "expected 000008xx)")
    ndim = data[3]
    dims = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim)]
    body = data[4 + 4 * ndim:]
    if len(body) != int(np.prod(dims)):
        raise DataError(f"{p}: idx header says {dims} ({int(np.prod(dims))} bytes) but the file "
                        f"holds {len(body)} (truncated?)")
    return np.frombuffer(body, dtype=np.uint8).reshape(dims)


class FashionMNISTDataset(Dataset):
    """Fashion-MNIST (Xiao et al. 2017): 60,000 train / 10,000 test 28×28 gray images of
    clothing in 10 classes, read from the idx files Debian's ``dataset-fashion-mnist``
    package installs (``apt-get install dataset-fashion-mnist``) or from ``root``.

    Kept as uint8 (47 MB for the train split); each item is converted (and resized when
    ``image_size`` != 28, bilinear with antialias) on access.

    Args:
        image_size: output side S (28 is native).
        channels: 1 (gray) or 3 (repeated).
        root: folder holding the four ``*-ubyte.gz`` files (default: the Debian location).
        split: ``train`` (60k) or ``test`` (10k).
        pad_to: pad the 28×28 image, centered, with the background value (0, i.e. -1 after
            scaling) to ``pad_to``×``pad_to`` first, then resize that to S (``data.pad_to``).
            32 is the usual choice: 28 padded to 32 is exactly 32 px, and 16 px is the same
            framing averaged down 2×, so a run grown 16 -> 32 sees one picture at two
            resolutions (docs/resolution.md). None resizes 28 -> S directly.
    """

    num_classes: int = 10

    def __init__(self, image_size: int = 28, channels: Channels = 1,
                 root: str | os.PathLike[str] | None = None,
                 split: Split = "train", pad_to: int | None = None) -> None:
        if channels not in CHANNELS:
            raise DataError(f"fashion_mnist: channels must be 1 or 3, got {channels!r}")
        if pad_to is not None and pad_to < 28:
            raise DataError(f"fashion_mnist: pad_to must be at least the native 28, got "
                            f"{pad_to!r}")
        if image_size < 1:
            raise DataError(f"fashion_mnist: image_size must be >= 1, got {image_size!r}")
        if split not in _FASHION_FILES:
            raise DataError(f"fashion_mnist: split must be 'train' or 'test', got {split!r}")
        self.root = Path(root or FASHION_MNIST_DIR)
        files = [self.root / f for f in _FASHION_FILES[split]]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise DataError(
                f"fashion_mnist: {', '.join(missing)} not found in {str(self.root)!r}; install "
                f"the dataset with `apt-get install dataset-fashion-mnist` (files in "
                f"{FASHION_MNIST_DIR}) or set data.path to a folder holding "
                f"{', '.join(n for pair in _FASHION_FILES.values() for n in pair)}")
        images, labels = read_idx(files[0]), read_idx(files[1])
        if images.ndim != 3 or labels.ndim != 1 or images.shape[0] != labels.shape[0]:
            raise DataError(f"fashion_mnist: {files[0].name} has shape {images.shape} and "
                            f"{files[1].name} {labels.shape}; expected (N, H, W) and (N,)")
        self._base = torch.from_numpy(images.copy())  # (N, 28, 28) uint8
        self.labels = torch.from_numpy(labels.astype(np.int64))
        self.image_size, self.channels, self.split = image_size, channels, split
        self.pad_to = pad_to

    def __len__(self) -> int:
        return self._base.shape[0]

    def images_at(self, idx: torch.Tensor | slice) -> torch.Tensor:
        """A batch of images (n, C, S, S) in [-1, 1]."""
        x = self._base[idx].unsqueeze(1).float().div_(255.0)  # (n, 1, 28, 28)
        if self.pad_to is not None and self.pad_to != x.shape[-1]:
            lo = (self.pad_to - x.shape[-1]) // 2
            hi = self.pad_to - x.shape[-1] - lo
            x = F.pad(x, (lo, hi, lo, hi), value=0.0)  # (n, 1, P, P), background 0 -> -1
        s = self.image_size
        if x.shape[-1] != s:
            x = F.interpolate(x, size=(s, s), mode="bilinear", align_corners=False,
                              antialias=True).clamp_(0.0, 1.0)
        return x.mul_(2.0).sub_(1.0).expand(-1, self.channels, -1, -1)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images_at(slice(i, i + 1) if i >= 0 else [i])[0].clone(), \
            self.labels[i].clone()

    def describe(self) -> str:
        s = self.image_size
        pad = f" (28 padded to {self.pad_to})" if self.pad_to else ""
        return (f"fashion_mnist ({self.split}): {len(self)} images {self.channels}×{s}×{s}"
                f"{pad}, {self.num_classes} classes")


# --------------------------------------------------------------------------- image folder

# What a broken or hostile file can raise while Pillow opens, verifies or decodes it.
# Listed rather than ``Exception`` so that a bug in our own transform is not mistaken for a
# bad file (it still surfaces: if every file fails, the DataError quotes the reason).
_BAD_IMAGE_ERRORS: tuple[type[BaseException], ...] = (
    OSError,  # truncated data, UnidentifiedImageError, unreadable file
    SyntaxError,  # Pillow's "broken PNG file" and friends
    ValueError, EOFError, IndexError, MemoryError,
    Image.DecompressionBombError,  # more than 2 × MAX_IMAGE_PIXELS
    Image.DecompressionBombWarning,  # more than MAX_IMAGE_PIXELS, turned into an error below
)


class _refuse_bombs(warnings.catch_warnings):
    """Turn Pillow's DecompressionBombWarning into an exception, for this block only.

    The warnings filter is restored on exit, so the process-wide filters are untouched.
    (``catch_warnings`` is not thread-safe; data-loader workers are processes, so fine.)
    """

    def __enter__(self) -> Any:
        out = super().__enter__()
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        return out


def _is_within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


class ImageFolderDataset(Dataset):
    """Every image under ``root`` (recursively), resized and center-cropped, in [-1, 1].

    Files are matched by extension (.png, .jpg, .jpeg, .webp, any case) and sorted by their
    path relative to ``root``, so the index of an image does not depend on the file system's
    listing order. Hidden files and folders (name starting with ".") are ignored, as are
    non-image files.

    At construction each file gets a cheap header check (``Image.open`` + ``verify()``);
    unreadable files and decompression bombs (more pixels than ``PIL.Image.MAX_IMAGE_PIXELS``)
    are dropped, logged and counted. A file that passes the check but fails to decode later
    (a truncated JPEG) is logged once, recorded in ``bad_paths`` and replaced by the next good
    index, so one bad file never stops a run.

    Symlinks (files or folders) whose target resolves outside ``root`` are skipped and counted
    unless ``follow_symlinks``. Each real folder is scanned once (under its real path when it
    has one inside ``root``), so symlink cycles terminate and a linked folder adds no
    duplicates; symlinked *files* are kept as separate items.

    Args:
        root: the image folder.
        image_size: output side S.
        channels: 1 (converted to gray, "L") or 3 (RGB).
        class_labels: label = the first-level sub-folder (sorted names → 0..K-1); images
            directly in ``root`` are then an error.
        center_crop: resize the shorter side to S and crop the center square; False squashes
            the whole image to S×S.
        follow_symlinks: also follow symlinks that lead outside ``root``.
        buckets: aspect-ratio buckets ``[(w, h), ...]`` (``data/buckets.py``): each image
            goes to the closest one and is resized and cropped to it (``center_crop`` is
            then unused); None: every image is S×S.
        random_crop: buckets: a seeded random crop offset per image (the same every epoch),
            else centered.
        crop_seed: the seed of the random crops (the run seed).
        exclude: folders and files under ``root`` that are not images of this dataset (a
            ControlNet data set's conditioning images, data/pairs.py).

    Attributes:
        paths: the usable image paths, sorted; ``labels``: their labels.
        num_classes: K with ``class_labels``, else 0; ``class_names``: the K folder names.
        bad_paths: ``{path: reason}`` for every file dropped or replaced as unreadable.
        skipped: files dropped at construction or replaced at load time (bad files, bombs,
            out-of-root or broken symlinks); ``skipped_symlinks``: the symlinks among them.
        bucket_layout: with ``buckets``, each image's bucket and crop
            (:class:`~steadydiff.data.buckets.BucketLayout`); else None.

    Raises:
        DataError: missing root, root not a directory, no images, every image unreadable, or
            an image directly in ``root`` with ``class_labels``.
    """

    def __init__(self, root: str | os.PathLike[str], image_size: int,
                 channels: Channels = 3, class_labels: bool = False,
                 center_crop: bool = True, follow_symlinks: bool = False,
                 buckets: list[tuple[int, int]] | None = None, random_crop: bool = False,
                 crop_seed: int = 0, exclude: Iterable[str | os.PathLike[str]] = ()) -> None:
        if channels not in CHANNELS:
            raise DataError(f"image folder: channels must be 1 or 3, got {channels!r}")
        if image_size < 1:
            raise DataError(f"image folder: image_size must be >= 1, got {image_size!r}")
        self.root = Path(root)
        self.image_size = image_size
        self.channels = channels
        self.center_crop = center_crop
        self.follow_symlinks = follow_symlinks
        self.bad_paths: dict[str, str] = {}
        self.skipped = 0
        self.skipped_symlinks = 0
        self.exclude = {os.path.realpath(p) for p in exclude}
        # Indices found bad at load time, so a second visit jumps straight to the replacement.
        self._bad_index: set[int] = set()

        exts = ", ".join(IMAGE_EXTENSIONS)
        if not self.root.exists():
            raise DataError(f"image folder {str(self.root)!r} does not exist; expected a "
                            f"directory containing images ({exts})")
        if not self.root.is_dir():
            raise DataError(f"image folder {str(self.root)!r} is not a directory; expected a "
                            f"directory containing images ({exts})")

        candidates = self._scan()
        if not candidates:
            raise DataError(f"image folder {str(self.root)!r} contains no images; accepted "
                            f"extensions (any case): {exts}")

        # Labels come from the first path component under root: the link name, not its target.
        self.class_names: list[str] = []
        if class_labels:
            loose = [p for p in candidates if len(p.relative_to(self.root).parts) == 1]
            if loose:
                raise DataError(
                    f"image folder {str(self.root)!r}: class_labels needs every image inside a "
                    f"class sub-folder, but {str(loose[0])!r} (and {len(loose) - 1} more) lie "
                    f"directly in the root; move them into a sub-folder or set "
                    f"class_labels false")
            # Classes are fixed by the candidate files, before the header check, so one
            # unreadable class folder cannot shift the ids of every class after it.
            self.class_names = sorted({p.relative_to(self.root).parts[0] for p in candidates})
        class_id = {name: k for k, name in enumerate(self.class_names)}
        self.num_classes = len(self.class_names)

        self.paths: list[Path] = []
        self.labels: list[int] = []
        for p in candidates:
            reason = self._check_header(p)
            if reason is not None:
                self._mark_bad(p, reason)
                continue
            self.paths.append(p)
            self.labels.append(class_id[p.relative_to(self.root).parts[0]] if class_labels else 0)

        if not self.paths:
            first = next(iter(self.bad_paths.items()))
            raise DataError(f"image folder {str(self.root)!r}: all {len(candidates)} images are "
                            f"unreadable (first: {first[0]!r}: {first[1]})")
        if self.skipped:
            log.warning("image folder %s: skipped %d files (%d symlinks outside the root or "
                        "broken, %d unreadable)", self.root, self.skipped,
                        self.skipped_symlinks, self.skipped - self.skipped_symlinks)
        self.bucket_layout: BucketLayout | None = None
        if buckets:
            # headers only (Image.open reads no pixels): ~0.1 ms a file
            sizes = [self._size(p) for p in self.paths]
            ids = assign(sizes, buckets)
            self.bucket_layout = BucketLayout(
                list(buckets), ids, [plan_crop(w, h, buckets[k], random_crop, crop_seed, j)
                                     for j, ((w, h), k) in enumerate(zip(sizes, ids))])

    # ..................................................................... scan

    def _scan(self) -> list[Path]:
        """Image candidates under root, sorted by relative path; follows the symlink rules."""
        root_real = os.path.realpath(self.root)
        found: list[tuple[str, Path]] = []
        # (st_dev, st_ino) of every folder entered: a symlink cycle meets a folder it has
        # already scanned and stops there.
        seen: set[tuple[int, int]] = set()
        # Real folders are scanned before symlinked ones, so a folder reachable both ways is
        # listed under its real path (and its real class name), and never twice.
        real: deque[Path] = deque([self.root])
        linked: deque[Path] = deque()
        while real or linked:
            d = real.popleft() if real else linked.popleft()
            try:
                st = d.stat()
            except OSError:
                continue
            if (st.st_dev, st.st_ino) in seen or os.path.realpath(d) in self.exclude:
                continue
            seen.add((st.st_dev, st.st_ino))
            try:
                entries = sorted(os.scandir(d), key=lambda e: e.name)
            except OSError as e:
                log.warning("image folder: cannot list %s (%s); skipped", d, e)
                continue
            for e in entries:
                if e.name.startswith("."):
                    continue  # .ipynb_checkpoints, macOS ._ files: never training data
                is_image = e.name.lower().endswith(IMAGE_EXTENSIONS)
                path = Path(e.path)
                if e.is_symlink():
                    target = os.path.realpath(e.path)
                    if not os.path.exists(target):
                        if is_image:
                            self._mark_bad(path, "broken symlink", symlink=True)
                        continue
                    if not self.follow_symlinks and not _is_within(target, root_real):
                        # Only count what would have been used: a link to an image, or a folder.
                        if is_image or os.path.isdir(target):
                            self.skipped += 1
                            self.skipped_symlinks += 1
                            log.debug("image folder: %s -> %s leads outside the root; skipped "
                                      "(set follow_symlinks to use it)", path, target)
                        continue
                try:
                    if e.is_dir():  # follows symlinks that passed the check above
                        (linked if e.is_symlink() else real).append(path)
                    elif is_image and e.is_file() and \
                            os.path.realpath(e.path) not in self.exclude:
                        found.append((path.relative_to(self.root).as_posix(), path))
                except OSError:
                    continue
        found.sort(key=lambda t: t[0])
        return [p for _, p in found]

    def _mark_bad(self, path: Path, reason: str, symlink: bool = False) -> None:
        if str(path) in self.bad_paths:
            return
        self.bad_paths[str(path)] = reason
        self.skipped += 1
        self.skipped_symlinks += int(symlink)
        log.warning("image folder: skipping %s: %s", path, reason)

    @staticmethod
    def _check_header(path: Path) -> str | None:
        """None when the header looks fine, else the reason. Reads headers, decodes no pixels
        (PNG verify walks the chunk CRCs; it does not inflate)."""
        try:
            with _refuse_bombs(), Image.open(path) as im:
                im.verify()
                if im.width < 1 or im.height < 1:
                    return f"empty image ({im.width}×{im.height})"
        except _BAD_IMAGE_ERRORS as e:
            return _reason(e)
        return None

    @staticmethod
    def _size(path: Path) -> tuple[int, int]:
        """``(width, height)`` as displayed (EXIF orientations 5-8 swap the sides)."""
        with _refuse_bombs(), Image.open(path) as im:
            w, h = im.size
            try:
                turned = im.getexif().get(0x0112) in (5, 6, 7, 8)
            except _BAD_IMAGE_ERRORS:
                turned = False
        return (h, w) if turned else (w, h)

    # ..................................................................... load

    def _load(self, path: Path, crop: Crop | None = None) -> torch.Tensor:
        """Decode, convert, resize/crop; returns (C, S, S) float32 in [-1, 1] (with
        ``crop``: (C, bh, bw), resized and cropped to its bucket)."""
        x = self.pixels(path, crop).to(torch.float32)
        return x.div_(127.5).sub_(1.0).contiguous()

    def pixels(self, path: Path, crop: Crop | None = None,
               channels: Channels | None = None) -> torch.Tensor:
        """The file ``path`` as this dataset prepares its images: (C, S, S) uint8 (with
        ``crop``: (C, bh, bw)), converted to ``channels`` (None: the dataset's).

        ``crop`` is in the pixels of the image it was planned for; a file of another size
        but the same aspect ratio (a ControlNet conditioning image at another resolution)
        gets the same region, scaled to its own pixels. Raises what Pillow raises for a
        bad file (see ``_BAD_IMAGE_ERRORS``)."""
        s = self.image_size
        mode = "RGB" if (channels or self.channels) == 3 else "L"
        with _refuse_bombs(), Image.open(path) as im:
            # JPEG can decode at 1/2, 1/4, 1/8 scale for free; draft keeps both sides >= S,
            # so the final resize still shrinks (antialiased) and never upsamples needlessly.
            if im.format == "JPEG":
                im.draft(mode, (s, s) if crop is None else (max(crop.target_size),) * 2)
            im.load()  # truncated/corrupt data raises here
            im = ImageOps.exif_transpose(im)  # phone photos carry their rotation in EXIF
            im = _to_mode(im, mode)
            w, h = im.size
            if crop is not None:
                # the box is in the original's pixels; a JPEG draft decoded it smaller
                fx, fy = w / crop.original_size[1], h / crop.original_size[0]
                l, t, r, b = crop.box
                bh, bw = crop.target_size
                im = im.resize((bw, bh), Image.Resampling.BICUBIC,
                               box=(l * fx, t * fy, r * fx, b * fy))
            elif self.center_crop:
                # Resizing the center square of the source is the same as "shorter side to S,
                # then center crop", without rounding the intermediate size.
                side = min(w, h)
                box = ((w - side) / 2, (h - side) / 2, (w + side) / 2, (h + side) / 2)
            else:
                box = (0, 0, w, h)
            if crop is None:
                # Pillow's bicubic filter widens its support when shrinking: antialiased.
                im = im.resize((s, s), Image.Resampling.BICUBIC, box=box)
            a = np.asarray(im, dtype=np.uint8)
        x = torch.from_numpy(a.copy())
        return (x.unsqueeze(0) if x.ndim == 2 else x.permute(2, 0, 1)).contiguous()

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y, _ = self.fetch(i)
        return x, y

    def fetch(self, i: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """Like ``self[i]``, plus whether image ``i`` itself was bad (and replaced). The flag
        travels with the batch, so the main process counts bad files even when they were
        found inside a data-loader worker (whose ``bad_paths`` it never sees)."""
        x, j = self.fetch_index(i)
        return x, torch.tensor(self.labels[j], dtype=torch.int64), j != int(i) % len(self.paths)

    def fetch_index(self, i: int) -> tuple[torch.Tensor, int]:
        """Image ``i``, or the next good one when it is bad, and the index actually loaded:
        whatever travels with the image (its label, its caption) must be the replacement's."""
        n = len(self.paths)
        i = int(i)
        if not -n <= i < n:
            raise IndexError(f"index {i} out of range for {n} images")
        i %= n
        # Walk forward from i to the first good image: deterministic (it depends only on which
        # files are bad), and bounded by n tries.
        for k in range(n):
            j = (i + k) % n
            if j in self._bad_index:
                continue
            try:
                x = self._load(self.paths[j], self.bucket_layout.crops[j]
                               if self.bucket_layout is not None else None)
            except _BAD_IMAGE_ERRORS as e:
                self._bad_index.add(j)
                self._mark_bad(self.paths[j], _reason(e) + " (at load time; replaced by the "
                               "next good image)")
                continue
            return x, j
        raise DataError(f"image folder {str(self.root)!r}: every image failed to load "
                        f"(e.g. {next(iter(self.bad_paths.items()))})")

    def describe(self) -> str:
        """One line for the run log, e.g. ``folder data/cats: 120 images 3×64×64, 2 classes``."""
        s = self.image_size
        out = f"folder {self.root}: {len(self)} images {self.channels}×{s}×{s}"
        if self.bucket_layout is not None:
            used = len(set(self.bucket_layout.ids))
            out = (f"folder {self.root}: {len(self)} images {self.channels}×~{s}² in {used} "
                   f"aspect-ratio buckets")
        out += f", {self.num_classes} classes" if self.num_classes else ", unlabeled"
        if self.skipped:
            out += f" ({self.skipped} files skipped)"
        return out


def _reason(e: BaseException) -> str:
    if isinstance(e, (Image.DecompressionBombError, Image.DecompressionBombWarning)):
        return (f"refused as a possible decompression bomb ({e}); raise "
                f"PIL.Image.MAX_IMAGE_PIXELS if the image is genuine")
    return f"{type(e).__name__}: {e}"


def _to_mode(im: Image.Image, mode: str) -> Image.Image:
    """Convert to "RGB" or "L" without the two silent traps of ``Image.convert``."""
    if im.mode in ("I;16", "I;16L", "I;16B", "I;16N", "I"):
        # 16-bit PNGs: convert("L") clips at 255 instead of scaling, giving a white image.
        a = np.asarray(im, dtype=np.float32) / 65535.0
        im = Image.fromarray((a.clip(0, 1) * 255.0 + 0.5).astype(np.uint8), "L")
    if im.mode in ("RGBA", "LA", "PA") or (im.mode == "P" and "transparency" in im.info):
        # Transparent pixels often hold black (or garbage) colour: composite onto white.
        im = im.convert("RGBA")
        bg = Image.new("RGBA", im.size, (255, 255, 255, 255))
        im = Image.alpha_composite(bg, im)
    return im if im.mode == mode else im.convert(mode)


# --------------------------------------------------------------------------- any dataset


# as_pairs checks the value range on this many items spread over a user dataset; values may
# exceed [-1, 1] by rounding (normalize arithmetic), not by more.
RANGE_PROBE = 32
RANGE_SLACK = 1e-3


class PairsDataset(Dataset):
    """``as_pairs`` result: any dataset's items as ``(float32 (C, H, W), int64 label)``.

    ``labels`` is the source's per-item labels when they can be read without the images
    (its ``labels``, or a ``TensorDataset``'s second tensor); ``model_classes`` K, when
    given, refuses on every item a label outside 0..K-1 (:func:`check_label`).
    """

    def __init__(self, dataset: Dataset, model_classes: int | None = None) -> None:
        self.dataset = dataset
        self.model_classes = model_classes
        try:
            n = len(dataset)  # type: ignore[arg-type]
        except TypeError:
            raise DataError(f"dataset {type(dataset).__name__} has no len(); expected a "
                            f"map-style torch Dataset (with __len__ and __getitem__)") from None
        if n == 0:
            raise DataError(f"dataset {type(dataset).__name__} is empty")
        tensors = getattr(dataset, "tensors", None)  # TensorDataset(images, labels)
        if isinstance(dataset, torch.utils.data.TensorDataset) and len(tensors) >= 2:
            self.labels = tensors[1]
        elif getattr(dataset, "labels", None) is not None:
            self.labels = dataset.labels
        self._shape: tuple[int, ...] | None = None
        first = dataset[0]
        # (image, label) items carry labels even when the dataset declares no num_classes
        self.labeled = isinstance(first, (tuple, list)) and len(first) == 2
        x, _ = self._convert(first, 0)  # the first item fixes the shape for the rest
        self._shape = tuple(x.shape)
        self._check_range(n)
        self.channels, h, w = self._shape
        self.image_size: int | None = h if h == w else None
        self.image_shape = self._shape
        self.num_classes: int = int(getattr(dataset, "num_classes", 0) or 0)

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._convert(self.dataset[i], i)

    def _check_range(self, n: int, probe: int = RANGE_PROBE) -> None:
        """Refuse data outside [-1, 1], judged on ``probe`` items spread over the dataset.

        Training on 0..255 (or standardized) data does not fail: the loss settles in the
        thousands and the run looks healthy, so the range is checked before the first step.
        Later items are the guard's to judge (a corrupt batch is an incident, not an end).
        """
        idx = sorted({round(k * (n - 1) / max(probe - 1, 1)) for k in range(min(n, probe))})
        lo, hi = math.inf, -math.inf
        for i in idx:
            x = self._convert(self.dataset[i], i)[0]
            if not x.numel():
                continue
            if not torch.isfinite(x).all():
                raise DataError(f"dataset item {i} holds non-finite values (NaN/Inf); "
                                "expected images in [-1, 1]")
            lo, hi = min(lo, float(x.min())), max(hi, float(x.max()))
        if lo < -1 - RANGE_SLACK or hi > 1 + RANGE_SLACK:
            hint = (" (0..255 data: x / 127.5 - 1)" if hi > 2 and lo >= 0 else
                    " (0..1 data: x * 2 - 1)" if lo >= 0 else "")
            raise DataError(f"dataset values span [{lo:.4g}, {hi:.4g}] over {len(idx)} of "
                            f"{n} items; expected images in [-1, 1]{hint}")
        if lo >= 0 and hi <= 1 and hi > lo:
            log.warning("dataset values span [%.3g, %.3g]: images in [0, 1]? steadydiff "
                        "expects [-1, 1] (x * 2 - 1)", lo, hi)

    def describe(self) -> str:
        """One line for the run log, e.g. ``MyData: 500 images 3×32×32, unlabeled``."""
        shape = "×".join(str(d) for d in self.image_shape)
        cls = f"{self.num_classes} classes" if self.num_classes else "unlabeled"
        return f"{type(self.dataset).__name__}: {len(self)} images {shape}, {cls}"

    def _convert(self, item: Any, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        expected = "expected an image tensor (C,H,W) or an (image, label) pair"
        if isinstance(item, torch.Tensor):
            x, y = item, 0
        elif isinstance(item, (tuple, list)) and len(item) == 2:
            x, y = item
        elif isinstance(item, (tuple, list)) and len(item) == 1:  # TensorDataset(images)
            x, y = item[0], 0
        elif isinstance(item, (tuple, list)):
            raise DataError(f"dataset item {i} is a {type(item).__name__} of length {len(item)}; "
                            f"{expected}")
        else:
            raise DataError(f"dataset item {i} is a {type(item).__name__}; {expected}")
        if not isinstance(x, torch.Tensor):
            hint = (" (convert it to a float tensor in [-1, 1], e.g. with torchvision's "
                    "ToTensor + Normalize(0.5, 0.5))" if isinstance(x, (Image.Image, np.ndarray))
                    else "")
            raise DataError(f"dataset item {i}: the image is a {type(x).__name__}; "
                            f"{expected}{hint}")
        if x.ndim != 3:
            raise DataError(f"dataset item {i}: the image has shape {tuple(x.shape)}; "
                            f"expected 3 dimensions (C,H,W)")
        if not x.is_floating_point():
            # A uint8 image cast to float would silently train on 0..255.
            raise DataError(f"dataset item {i}: the image has dtype {x.dtype}; expected a "
                            f"floating tensor in [-1, 1] (e.g. x.float() / 127.5 - 1)")
        if self._shape is not None and tuple(x.shape) != self._shape:
            raise DataError(f"dataset item {i}: the image has shape {tuple(x.shape)} but item 0 "
                            f"has {self._shape}; every image must have the same shape")
        y = check_label(y, self.model_classes, lambda: item_name(self, i))
        return x.to(torch.float32), torch.tensor(y, dtype=torch.int64)


def as_pairs(dataset: Dataset, model_classes: int | None = None) -> Dataset:
    """Adapt a user dataset to yield ``(image (C,H,W) float32, label int64 scalar)``.

    Items may be an image tensor (label 0), a 1-tuple ``(image,)`` (a ``TensorDataset`` of
    images) or an ``(image, label)`` pair. The first item's type and shape, and the value
    range of items spread over the dataset, are checked here, so a wrong dataset fails at
    build time rather than in the first batch (or, for 0..255 data, never).

    Args:
        dataset: a map-style torch Dataset.
        model_classes: the model's classes K: every item's label must be in 0..K-1
            (None or 0: integers, any value).

    Returns:
        A Dataset with ``channels``, ``image_size`` (None if not square), ``num_classes``
        (from ``dataset.num_classes`` if present, else 0), and ``labels`` when they can be
        read without the images. Our own datasets are returned as is.

    Raises:
        DataError: an empty dataset, an item of the wrong type, shape or dtype, a label
            that is no class id, or values outside [-1, 1] (the message gives the observed
            range).
    """
    if isinstance(dataset, (PairsDataset, DigitsDataset, FashionMNISTDataset,
                            ImageFolderDataset, ClassSubset)) or \
            getattr(dataset, "trains_as_is", False):  # data/cache.py's EncodedDataset
        return dataset
    return PairsDataset(dataset, model_classes)


# --------------------------------------------------------------------------- batching


class StreamBatchSampler(Sampler[list[StreamKey]]):
    """Endless, exactly replayable batches of ``(index, epoch)`` keys.

    The stream is perm(0) ++ perm(1) ++ ..., with perm(e) = ``torch.randperm(n)`` from a
    generator seeded by a hash of ``(seed, e)``. Global batch ``b`` is stream positions
    ``[b*B, (b+1)*B)``: an epoch boundary may fall inside a batch, and a dataset smaller than
    the batch simply contributes several epochs to one batch. Rank ``r`` of ``world_size``
    takes the contiguous slice ``[floor(r*B/W), floor((r+1)*B/W))`` of each global batch, so
    ranks are disjoint and together cover it, and the sample order does not depend on the
    world size (a run resumed on another number of processes sees the same data). The state is
    one integer, batches consumed, and the set of quarantined indices: ``exclude`` removes them
    from every epoch's permutation (an epoch is then n - |exclude| long), so the stream stays a
    pure function of (seed, exclude) and a resumed run with the same set sees the same batches.

    Args:
        num_samples: dataset length n (>= 1).
        batch_size: the *global* batch B (all ranks together); each rank yields about B / W
            keys (exactly, when W divides B).
        seed: the run seed.
        start_batch: the first batch to yield (the resume position).
        rank, world_size: this process's slice under DDP; B >= world_size.
        exclude: dataset indices never drawn (the guard's quarantine).
    """

    def __init__(self, num_samples: int, batch_size: int, *, seed: int, start_batch: int = 0,
                 rank: int = 0, world_size: int = 1, exclude: Iterable[int] = ()) -> None:
        super().__init__()
        if num_samples < 1:
            raise DataError(f"cannot sample from an empty dataset (num_samples={num_samples})")
        self.exclude = frozenset(int(i) for i in exclude if 0 <= int(i) < num_samples)
        if len(self.exclude) >= num_samples:
            raise DataError(f"all {num_samples} samples are quarantined: nothing left to train "
                            "on (see incidents.jsonl, kind sample_quarantined)")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size), got rank={rank}, "
                             f"world_size={world_size}")
        if batch_size < world_size:
            raise ValueError(f"batch_size ({batch_size}) must be at least world_size "
                             f"({world_size}): every rank needs one sample per step")
        if start_batch < 0:
            raise ValueError(f"start_batch must be >= 0, got {start_batch}")
        self.num_samples = num_samples
        self.epoch_len = num_samples - len(self.exclude)
        self.batch_size = batch_size
        self.seed = seed
        self.start_batch = start_batch
        self.rank = rank
        self.world_size = world_size
        # rank r's slice of each global batch: [lo, hi); sizes differ by at most one when
        # world_size does not divide batch_size
        self.lo = batch_size * rank // world_size
        self.hi = batch_size * (rank + 1) // world_size
        self.local_batch_size = self.hi - self.lo
        # A small LRU of permutations: a batch touches at most two epochs unless n < B.
        # Caching cannot change results; it only saves the randperm (O(n)).
        self._perms: OrderedDict[int, torch.Tensor] = OrderedDict()

    def permutation(self, epoch: int) -> torch.Tensor:
        """The sample order of ``epoch``: (n - |exclude|,) int64, a pure function of (seed,
        epoch, n, exclude)."""
        p = self._perms.get(epoch)
        if p is None:
            g = torch.Generator().manual_seed(derive_seed(_TAG_PERM, self.seed, epoch))
            p = torch.randperm(self.num_samples, generator=g)
            if self.exclude:
                p = p[~torch.isin(p, torch.tensor(sorted(self.exclude)))]
            self._perms[epoch] = p
            if len(self._perms) > 4:
                self._perms.popitem(last=False)
        else:
            self._perms.move_to_end(epoch)
        return p

    def _positions(self, start: int, stop: int) -> list[StreamKey]:
        n = self.epoch_len
        out: list[StreamKey] = []
        pos = start
        while pos < stop:  # one pass per epoch the range touches
            e, off = divmod(pos, n)
            take = min(stop - pos, n - off)
            out.extend((i, e) for i in self.permutation(e)[off:off + take].tolist())
            pos += take
        return out

    def global_batch_indices(self, b: int) -> list[StreamKey]:
        """All B ``(index, epoch)`` keys of global batch ``b`` (every rank's slice, in order)."""
        return self._positions(b * self.batch_size, (b + 1) * self.batch_size)

    def batch_indices(self, b: int) -> list[StreamKey]:
        """This rank's ``(index, epoch)`` keys of batch ``b``; a pure function of ``b``."""
        start = b * self.batch_size
        return self._positions(start + self.lo, start + self.hi)

    def epoch_of(self, b: int) -> int:
        """The epoch of batch ``b``'s first (global) stream position."""
        return b * self.batch_size // self.epoch_len

    def __iter__(self) -> Iterator[list[StreamKey]]:
        b = self.start_batch
        while True:  # endless: training is counted in steps, not epochs
            yield self.batch_indices(b)
            b += 1


class SeededView(Dataset):
    """A dataset indexed by ``(index, epoch)`` keys, with seeded per-sample augmentation.

    ``view[(i, e)]`` returns ``(image, label, i, bad)``, ``bad`` True when image ``i`` could
    not be loaded and was replaced (datasets with a ``fetch`` method report it; others never
    do). Augmentation draws from a generator seeded
    by a hash of ``(seed, e, i)``, never from the global RNG, so it is the same in every
    worker, after every resume, and for any batch size.

    Args:
        dataset: any dataset accepted by ``as_pairs``.
        seed: the run seed.
        hflip: flip horizontally with probability 1/2.
        num_classes: the model's classes K: a label outside 0..K-1 is a ``DataError``
            naming the item as it is fetched (0: unconditional, labels unused).
    """

    def __init__(self, dataset: Dataset, *, seed: int, hflip: bool = False,
                 num_classes: int = 0) -> None:
        self.dataset = as_pairs(dataset, num_classes)
        self.seed = seed
        self.hflip = hflip
        self.num_classes = num_classes

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: StreamKey) -> tuple[torch.Tensor, torch.Tensor, int, bool]:
        i, e = key
        at = getattr(self.dataset, "item_at", None)  # an item that changes with the epoch
        fetch = getattr(self.dataset, "fetch", None)
        x, y, bad = (*at(i, e), False) if at is not None else \
            fetch(i) if fetch is not None else (*self.dataset[i], False)
        if self.num_classes:  # a CPU scalar: no device sync; the null class id is refused
            check_label(y, self.num_classes, lambda: item_name(self.dataset, i))
        if self.hflip:
            # A fresh generator + derive_seed cost ~15 µs, nothing next to decoding an image.
            # Keep the draw order fixed when adding augmentations (append new draws after
            # this one) so old runs replay.
            g = torch.Generator().manual_seed(derive_seed(_TAG_AUG, self.seed, e, i))
            if torch.rand((), generator=g).item() < 0.5:
                x = x.flip(-1)
        return x, y, int(i), bool(bad)


def _worker_init(_: int) -> None:
    # N workers × default thread count oversubscribes the CPU; each worker decodes one image
    # at a time anyway.
    torch.set_num_threads(1)
    # A stop signal sent to the whole process group (SLURM, Kubernetes) is the main
    # process's to act on: it checkpoints and ends the workers (trainer/preempt.py).
    from steadydiff.trainer.preempt import ignore_in_worker

    ignore_in_worker()


def make_loader(dataset: Dataset, *, batch_size: int, seed: int, start_batch: int = 0,
                hflip: bool = False, num_workers: int = 0, rank: int = 0, world_size: int = 1,
                pin_memory: bool = False, exclude: Iterable[int] = (),
                num_classes: int = 0) -> DataLoader:
    """An endless loader of ``(x (b,C,H,W), y (b,), idx (b,), bad (b,))`` batches, resumable
    exactly (``bad`` flags samples whose image failed to load and was replaced).

    Args:
        dataset: any dataset accepted by ``as_pairs``.
        batch_size: the global batch B; each rank gets its slice (about B / world_size).
        seed: the run seed (permutations and augmentation derive from it).
        start_batch: batches already consumed (the resume position): the loader starts with
            the batch the killed run would have seen next.
        hflip: seeded random horizontal flip.
        num_workers: loader processes (persistent, one torch thread each); results do not
            depend on it.
        rank, world_size: the DDP slice.
        pin_memory: pin batches for faster host-to-GPU copies.
        exclude: dataset indices never drawn (the guard's quarantine; see
            :class:`StreamBatchSampler`).
        num_classes: the model's classes K: a label outside 0..K-1 stops the run with a
            ``DataError`` naming the item (0: unconditional, labels unused).

    Returns:
        A DataLoader whose ``batch_sampler`` is the ``StreamBatchSampler`` (use its
        ``batch_indices(b)`` to name the samples of batch ``b``), or for a bucketed dataset
        (``data.buckets``) the ``BucketBatchSampler``: every batch from one bucket. It never
        ends: count steps.
    """
    view = SeededView(dataset, seed=seed, hflip=hflip, num_classes=num_classes)
    layout = bucket_layout(dataset)
    sampler: Sampler[list[StreamKey]]
    if layout is not None:
        sampler = BucketBatchSampler(layout.ids, batch_size, seed=seed, start_batch=start_batch,
                                     rank=rank, world_size=world_size, exclude=exclude)
    else:
        sampler = StreamBatchSampler(len(view), batch_size, seed=seed, start_batch=start_batch,
                                     rank=rank, world_size=world_size, exclude=exclude)
    return DataLoader(
        view, batch_sampler=sampler, num_workers=num_workers, pin_memory=pin_memory,
        persistent_workers=num_workers > 0,
        worker_init_fn=_worker_init if num_workers > 0 else None,
        # Without its own generator, every iter(loader) draws a worker base seed from the
        # *global* torch RNG, shifting the model's random stream by how often it was called.
        generator=torch.Generator().manual_seed(derive_seed(_TAG_LOADER, seed, rank)),
    )


def source_of(dataset: Dataset, i: int) -> str | None:
    """What names item ``i`` for a person: its file path for an image folder (through any
    class subset), or for a user dataset (through ``as_pairs``) that has ``path_of(i)`` or
    one entry of ``paths`` per item; else None (the index is all there is)."""
    i = int(i)
    while isinstance(dataset, (ClassSubset, PairsDataset)):
        if isinstance(dataset, ClassSubset):
            dataset, i = dataset.dataset, dataset.index[i]
        else:
            dataset = dataset.dataset
    path_of = getattr(dataset, "path_of", None)
    if callable(path_of):
        return str(path_of(i))
    paths = getattr(dataset, "paths", None)
    if isinstance(paths, (list, tuple)) and 0 <= i < len(paths) and (
            isinstance(dataset, ImageFolderDataset) or len(paths) == len(dataset)):
        return str(paths[i])
    return None


# --------------------------------------------------------------------------- class subset


class ClassSubset(Dataset):
    """The items of a labeled dataset whose label is in ``classes`` (labels keep their ids,
    so a model trained on digits 5-9 still calls them 5-9 and ``num_classes`` is unchanged).

    Args:
        dataset: a dataset with ``labels`` (one int per item) and ``num_classes``.
        classes: the class ids to keep; each must be in [0, num_classes).

    Raises:
        DataError: an unknown class id, or a class with no items.
    """

    def __init__(self, dataset: Dataset, classes: list[int]) -> None:
        k = int(getattr(dataset, "num_classes", 0) or 0)
        bad = [c for c in classes if not 0 <= c < k]
        if bad:
            raise DataError(f"data.classes {bad} unknown: this dataset has {k} classes, "
                            f"valid ids are 0..{k - 1}")
        labels = torch.as_tensor(list(dataset.labels))
        keep = torch.isin(labels, torch.tensor(classes))
        empty = [c for c in classes if not (labels == c).any()]
        if empty:
            raise DataError(f"data.classes {empty} have no images in this dataset")
        self.dataset = dataset
        self.index = keep.nonzero().flatten().tolist()
        self.labels = labels[keep].tolist()
        self.classes = list(classes)
        self.num_classes = k
        self.channels = dataset.channels
        self.image_size = dataset.image_size
        self.skipped = getattr(dataset, "skipped", 0)
        if hasattr(dataset, "fetch"):
            self.fetch = lambda i: dataset.fetch(self.index[int(i)])

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.dataset[self.index[int(i)]]

    def describe(self) -> str:
        return f"{self.dataset.describe()}; classes {self.classes} only: {len(self)} images"


# --------------------------------------------------------------------------- config


def build_dataset(cfg: DataConfig, seed: int = 0,
                  exclude: Iterable[str | os.PathLike[str]] = ()) -> Dataset:
    """The dataset named by ``cfg`` (``data`` section): digits, Fashion-MNIST (train split;
    ``data.path`` overrides the folder of its idx files) or an image folder.

    Args:
        cfg: the ``data`` section.
        seed: the run seed (``data.bucket_crop=random``: each image's crop offset).
        exclude: folder data: folders and files under ``data.path`` that are not training
            images (a ControlNet data set's conditioning images, data/pairs.py).

    Returns:
        A dataset of ``(image, label)`` pairs with ``num_classes``, ``channels``,
        ``image_size`` and ``describe()`` (with ``data.buckets``, its ``bucket_layout``).

    Raises:
        DataError: the folder is missing, empty or unreadable.
    """
    if cfg.dataset == "digits":
        data: Dataset = DigitsDataset(cfg.image_size, cfg.channels)
    elif cfg.dataset == "fashion_mnist":
        data = FashionMNISTDataset(cfg.image_size, cfg.channels, root=cfg.path,
                                   pad_to=cfg.pad_to)
    elif cfg.dataset == "folder":
        if not cfg.path:
            raise DataError("data.path is required when data.dataset is 'folder'")
        buckets = None
        if cfg.buckets:
            lo, hi = cfg.bucket_sides()
            buckets = make_buckets(cfg.image_size, cfg.bucket_step, lo, hi,
                                   cfg.bucket_max_ratio)
        data = ImageFolderDataset(cfg.path, cfg.image_size, cfg.channels,
                                  class_labels=cfg.class_labels, center_crop=cfg.center_crop,
                                  follow_symlinks=cfg.follow_symlinks, buckets=buckets,
                                  random_crop=cfg.bucket_crop == "random", crop_seed=seed,
                                  exclude=exclude)
    else:
        raise DataError(f"data.dataset {cfg.dataset!r} is unknown; valid: "
                        f"{', '.join(DATASETS)}")
    return ClassSubset(data, cfg.classes) if cfg.classes is not None else data


__all__ = [
    "IMAGE_EXTENSIONS", "ClassSubset", "DataError", "DigitsDataset", "FashionMNISTDataset",
    "ImageFolderDataset", "PairsDataset",
    "SeededView", "StreamBatchSampler", "as_pairs", "build_dataset", "check_label",
    "check_labels", "item_name", "labels_of", "make_loader", "source_of",
]
