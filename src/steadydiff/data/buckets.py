"""Aspect-ratio bucketing: images of a folder trained at their own shape, in batches of one shape.

Square center crops throw away the top and bottom of every portrait and the sides of every
landscape. Bucketing (NovelAI's aspect-ratio bucketing, 2022; kohya's sd-scripts
``make_bucket_resolutions``) instead defines a set of resolutions of about the same area as
the base square ``S×S`` (so every step costs about the same and memory is bounded), with
sides that are multiples of ``step`` (a multiple of the model's downsampling: 64 for Stable
Diffusion's 8x VAE and its 3-level UNet), between ``min_side`` and ``max_side``:

    for w in min_side, min_side + step, ..., max_side:
        h = min(max_side, floor(S² / w / step) * step)      # keep the area <= S²
        keep (w, h) and (h, w) when h >= min_side and max(w, h) / min(w, h) <= max_ratio
    plus the square floor(S / step) * step

Each image goes to the bucket whose aspect ratio is closest to its own (distance in
log(w / h), so a 2:1 landscape and a 1:2 portrait are equally far from the square; ties go
to the first bucket in sorted order), is resized so that it covers the bucket (scale =
max(bw / w, bh / h): never stretched) and cropped to it, centered or at a seeded random
offset chosen once per image (``derive_seed(crop tag, seed, index)``: the same crop every
epoch, so a latent cache stays valid, as kohya requires for ``cache_latents``). The crop is
recorded per image as SDXL's micro-conditioning wants it (Podell et al. 2023, §2.2):
original size (h, w), crop top-left (top, left) in the resized image, target size (h, w).

Batches come from one bucket each (:class:`BucketBatchSampler`). Epoch ``e`` shuffles each
bucket's images with a generator seeded by ``(seed, e, bucket)``, cuts them into batches of
the global batch size B, and shuffles the list of batches with ``(seed, e)``: batch ``b`` is
then a pure function of ``b`` (the one-integer data position of ``data/__init__.py``), so a
resumed run, a guard replay and every torchrun rank (each takes its slice of the same global
batch, all from one bucket) see the same batches.

A bucket whose image count is not a multiple of B: its last batch is **filled** with the
first images of the same epoch's shuffle of that bucket (a bucket smaller than B repeats its
images). kohya's sd-scripts instead trains a shorter last batch per bucket; here every step
has B samples, as the rank slices, gradient accumulation and a compiled step expect, and no
image is dropped (OneTrainer's choice).
"""

from __future__ import annotations

import json
import math
import os
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset, Sampler

from steadydiff.seeding import derive_seed

__all__ = ["Bucket", "Crop", "BucketLayout", "BucketBatchSampler", "make_buckets", "assign",
           "plan_crop", "bucket_layout", "histogram", "describe_histogram", "time_ids",
           "write_buckets"]

Bucket = tuple[int, int]  # (width, height) in pixels

# derive_seed domain tags (see data/__init__.py): never change them, old runs would not replay.
_TAG_CROP = 0x63726F70  # "crop"
_TAG_BUCKET = 0x62636B74  # "bckt"
_TAG_BATCHES = 0x62617463  # "batc"


def make_buckets(base: int, step: int, min_side: int, max_side: int,
                 max_ratio: float) -> list[Bucket]:
    """The bucket resolutions of about ``base²`` pixels (kohya's ``make_bucket_resolutions``
    with an aspect-ratio limit), sorted.

    Args:
        base: the side of the base square (``data.image_size``).
        step: every side is a multiple of it.
        min_side, max_side: the limits of either side (multiples of ``step``).
        max_ratio: the largest long side / short side kept (>= 1).

    Returns:
        ``[(w, h), ...]`` sorted, the square ``floor(base / step) * step`` among them.
    """
    if step < 1 or min_side < step or max_side < min_side or max_ratio < 1:
        raise ValueError(f"bad bucket parameters: step={step}, min_side={min_side}, "
                         f"max_side={max_side}, max_ratio={max_ratio}")
    area = base * base
    square = max(step, base // step * step)
    out = {(square, square)}
    w = min_side
    while w <= max_side:
        h = min(max_side, area // w // step * step)
        if h >= min_side and max(w, h) / min(w, h) <= max_ratio:
            out.add((w, h))
            out.add((h, w))
        w += step
    return sorted(out)


def assign(sizes: Sequence[tuple[int, int]], buckets: Sequence[Bucket]) -> list[int]:
    """The bucket of each image: the one closest in log aspect ratio (ties: the first).

    Args:
        sizes: each image's ``(width, height)`` (as displayed: after its EXIF rotation).
        buckets: from :func:`make_buckets`.

    Returns:
        One bucket index per image.
    """
    logs = torch.tensor([math.log(w / h) for w, h in buckets], dtype=torch.float64)
    out = []
    for w, h in sizes:
        d = (logs - math.log(w / h)).abs()
        out.append(int(torch.argmin(d)))  # argmin returns the first of equal minima
    return out


@dataclass(frozen=True)
class Crop:
    """How one image was fitted to its bucket: what SDXL's ``add_time_ids`` carries.

    Attributes:
        original_size: the image's ``(height, width)`` before resizing.
        crop_top_left: ``(top, left)`` of the crop in the resized image.
        target_size: the bucket's ``(height, width)``.
        box: the crop in source pixels ``(left, top, right, bottom)`` (what Pillow's
            ``resize(..., box=)`` takes: resize and crop in one resampling).
    """

    original_size: tuple[int, int]
    crop_top_left: tuple[int, int]
    target_size: tuple[int, int]
    box: tuple[float, float, float, float]

    def time_ids(self) -> tuple[int, int, int, int, int, int]:
        """``original_size + crop_top_left + target_size``, diffusers' SDXL order."""
        return (*self.original_size, *self.crop_top_left, *self.target_size)


def plan_crop(width: int, height: int, bucket: Bucket, random: bool = False,
              seed: int = 0, index: int = 0) -> Crop:
    """Resize ``width × height`` to cover ``bucket`` (aspect kept) and crop it to the bucket.

    Args:
        width, height: the image's size.
        bucket: ``(bw, bh)``.
        random: a seeded random offset (``derive_seed(tag, seed, index)``), else centered.
        seed, index: the run seed and the image's index (random crops only).
    """
    bw, bh = bucket
    scale = max(bw / width, bh / height)
    rw, rh = max(bw, round(width * scale)), max(bh, round(height * scale))
    if random:
        g = torch.Generator().manual_seed(derive_seed(_TAG_CROP, seed, index))
        left = int(torch.randint(0, rw - bw + 1, (), generator=g))
        top = int(torch.randint(0, rh - bh + 1, (), generator=g))
    else:
        left, top = (rw - bw) // 2, (rh - bh) // 2
    sx, sy = width / rw, height / rh  # resized -> source pixels
    box = (left * sx, top * sy, (left + bw) * sx, (top + bh) * sy)
    return Crop((height, width), (top, left), (bh, bw), box)


# --------------------------------------------------------------------------- the layout


@dataclass
class BucketLayout:
    """Which bucket each item of a dataset is in, and its crop.

    Attributes:
        buckets: the bucket resolutions ``[(w, h), ...]``.
        ids: per item, its index into ``buckets``.
        crops: per item, its :class:`Crop`.
    """

    buckets: list[Bucket]
    ids: list[int]
    crops: list[Crop]

    def subset(self, index: Sequence[int]) -> BucketLayout:
        """The layout of the items ``index`` (in that order)."""
        return BucketLayout(self.buckets, [self.ids[int(j)] for j in index],
                            [self.crops[int(j)] for j in index])


def bucket_layout(dataset: Dataset) -> BucketLayout | None:
    """The bucket layout of ``dataset``'s items, through the library's wrappers (a class
    subset, a captioned folder, ``as_pairs``), or None when it is not bucketed.

    A dataset is bucketed when it (or what it wraps) has a ``bucket_layout`` attribute that
    is a :class:`BucketLayout` (the image folder with ``data.buckets``, the encoded dataset
    of latents).
    """
    index: list[int] | None = None
    d: Any = dataset
    for _ in range(16):  # wrappers nest a few levels deep at most
        own = getattr(d, "bucket_layout", None)
        if isinstance(own, BucketLayout):
            return own if index is None else own.subset(index)
        inner = getattr(d, "folder", None)
        inner = getattr(d, "dataset", None) if inner is None else inner
        if inner is None:
            return None
        sub = getattr(d, "index", None)
        if isinstance(sub, (list, tuple)):
            index = list(sub) if index is None else [sub[k] for k in index]
        d = inner
    return None


def histogram(layout: BucketLayout) -> list[dict[str, int]]:
    """``[{"width", "height", "images"}, ...]`` for every bucket with images, sorted."""
    counts = [0] * len(layout.buckets)
    for k in layout.ids:
        counts[k] += 1
    return [{"width": w, "height": h, "images": n}
            for (w, h), n in zip(layout.buckets, counts) if n]


def describe_histogram(layout: BucketLayout, batch_size: int) -> str:
    """The histogram for the run log, one bucket a line, e.g. ``  512x768: 120 images``."""
    rows = histogram(layout)
    lines = [f"buckets: {len(rows)} of {len(layout.buckets)} hold {len(layout.ids)} images "
             f"(batch {batch_size}; a bucket's last batch is filled from the same bucket)"]
    top = max(r["images"] for r in rows)
    for r in rows:
        bar = "#" * max(1, round(30 * r["images"] / top))
        lines.append(f"  {r['width']:>5}x{r['height']:<5} {r['images']:>6} images  "
                     f"{math.ceil(r['images'] / batch_size):>5} batches  {bar}")
    return "\n".join(lines)


def write_buckets(path: Path, layout: BucketLayout, batch_size: int) -> None:
    """``RUN/buckets.json``: ``{"batch_size", "defined", "images", "buckets": [{"width",
    "height", "images", "batches"}, ...]}`` (the report's Buckets section reads it)."""
    rows = [{**r, "batches": math.ceil(r["images"] / batch_size)} for r in histogram(layout)]
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({"batch_size": batch_size, "defined": len(layout.buckets),
                               "images": len(layout.ids), "buckets": rows}, indent=1))
    os.replace(tmp, path)


def time_ids(dataset: Dataset, idx: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """SDXL's ``add_time_ids`` of the items ``idx`` of a bucketed dataset: ``(B, 6)`` float32,
    each row ``original (h, w), crop top-left (top, left), target (h, w)``.

    Raises:
        ValueError: ``dataset`` is not bucketed.
    """
    layout = bucket_layout(dataset)
    if layout is None:
        raise ValueError(f"{type(dataset).__name__} is not bucketed (data.buckets=false)")
    rows = [layout.crops[int(i)].time_ids() for i in
            (idx.tolist() if isinstance(idx, torch.Tensor) else idx)]
    return torch.tensor(rows, dtype=torch.float32)


# --------------------------------------------------------------------------- batches


class BucketBatchSampler(Sampler[list[tuple[int, int]]]):
    """Endless, exactly replayable batches of ``(index, epoch)`` keys, each from one bucket.

    The same contract as ``StreamBatchSampler`` (state: batches consumed and the quarantine;
    rank ``r`` takes the slice ``[floor(r*B/W), floor((r+1)*B/W))`` of each global batch),
    with epochs made of whole single-bucket batches (module docstring).

    Args:
        ids: each dataset item's bucket.
        batch_size: the global batch B.
        seed: the run seed.
        start_batch: the first batch to yield (the resume position).
        rank, world_size: this process's slice under DDP.
        exclude: dataset indices never drawn (the guard's quarantine).
    """

    def __init__(self, ids: Sequence[int], batch_size: int, *, seed: int, start_batch: int = 0,
                 rank: int = 0, world_size: int = 1, exclude: Iterable[int] = ()) -> None:
        from steadydiff.data import DataError

        super().__init__()
        n = len(ids)
        if n < 1:
            raise DataError("cannot sample from an empty dataset (no images in any bucket)")
        if batch_size < world_size or batch_size < 1:
            raise ValueError(f"batch_size ({batch_size}) must be at least world_size "
                             f"({world_size}) and >= 1: every rank needs one sample per step")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size), got rank={rank}, "
                             f"world_size={world_size}")
        if start_batch < 0:
            raise ValueError(f"start_batch must be >= 0, got {start_batch}")
        self.exclude = frozenset(int(i) for i in exclude if 0 <= int(i) < n)
        members: dict[int, list[int]] = {}
        for i, k in enumerate(ids):
            if i not in self.exclude:
                members.setdefault(int(k), []).append(i)
        if not members:
            raise DataError(f"all {n} samples are quarantined: nothing left to train on (see "
                            "incidents.jsonl, kind sample_quarantined)")
        self.members = {k: torch.tensor(v, dtype=torch.int64) for k, v in sorted(members.items())}
        self.num_samples = n
        self.batch_size = batch_size
        self.seed = seed
        self.start_batch = start_batch
        self.rank, self.world_size = rank, world_size
        self.lo = batch_size * rank // world_size
        self.hi = batch_size * (rank + 1) // world_size
        self.local_batch_size = self.hi - self.lo
        # batches per epoch: every bucket's images once, its last batch filled
        self.epoch_batches = sum(math.ceil(len(v) / batch_size) for v in self.members.values())
        self._epochs: OrderedDict[int, tuple[list[int], torch.Tensor]] = OrderedDict()

    def epoch(self, e: int) -> tuple[list[int], torch.Tensor]:
        """Epoch ``e``'s batches: their buckets ``[k, ...]`` and indices ``(batches, B)``, a
        pure function of (seed, e, bucket ids, exclude, B)."""
        got = self._epochs.get(e)
        if got is not None:
            self._epochs.move_to_end(e)
            return got
        B = self.batch_size
        rows, which = [], []
        for k, m in self.members.items():
            g = torch.Generator().manual_seed(derive_seed(_TAG_BUCKET, self.seed, e, k))
            p = m[torch.randperm(len(m), generator=g)]
            nb = math.ceil(len(p) / B)
            p = p.repeat(math.ceil(nb * B / len(p)))[:nb * B]  # fill from the same shuffle
            rows.append(p.view(nb, B))
            which += [k] * nb
        g = torch.Generator().manual_seed(derive_seed(_TAG_BATCHES, self.seed, e))
        order = torch.randperm(len(which), generator=g)
        got = ([which[j] for j in order.tolist()], torch.cat(rows)[order])
        self._epochs[e] = got
        if len(self._epochs) > 2:
            self._epochs.popitem(last=False)
        return got

    def bucket_of_batch(self, b: int) -> int:
        """The bucket every sample of global batch ``b`` comes from."""
        e, j = divmod(b, self.epoch_batches)
        return self.epoch(e)[0][j]

    def global_batch_indices(self, b: int) -> list[tuple[int, int]]:
        """All B ``(index, epoch)`` keys of global batch ``b``."""
        e, j = divmod(b, self.epoch_batches)
        return [(i, e) for i in self.epoch(e)[1][j].tolist()]

    def batch_indices(self, b: int) -> list[tuple[int, int]]:
        """This rank's ``(index, epoch)`` keys of batch ``b``; a pure function of ``b``."""
        return self.global_batch_indices(b)[self.lo:self.hi]

    def epoch_of(self, b: int) -> int:
        """The epoch of batch ``b``."""
        return b // self.epoch_batches

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        b = self.start_batch
        while True:
            yield self.batch_indices(b)
            b += 1
