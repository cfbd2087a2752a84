"""Conditioning pairs for ControlNet training: each training image with its conditioning
image (an edge map, a depth map, a pose drawing) and its caption.

Two layouts are read, the ones the ecosystem's ControlNet trainers use:

* **a conditioning folder** (kohya sd-scripts' ``conditioning_data_dir``): ``DATA/cat.jpg``
  is conditioned by ``DATA/conditioning/cat.png`` — the same path relative to the folder
  ``data.conditioning_dir`` (relative to ``data.path``, or absolute), with any image
  extension (an edge map is usually a PNG beside a JPEG photo). The folder's files are not
  training images.
* **metadata.jsonl** (diffusers' ``train_controlnet.py``, ``--conditioning_image_column``):
  each line ``{"file_name": "images/cat.jpg", "text": "a cat", "conditioning_image":
  "conditioning_images/cat.png"}``, the conditioning path relative to the folder holding that
  metadata.jsonl (``data.conditioning_column`` names the key). The files such lines name are
  not training images.

``auto`` takes the folder when it exists, else the column. Every pair is checked before the
first step and all problems are reported at once, each naming both files: a missing partner,
two candidates for one image (``cat.png`` and ``cat.jpg`` in the conditioning folder), an
unreadable conditioning image, and a size mismatch (``data.conditioning_match=size``: the
same pixel size) or an aspect mismatch (``aspect``: the same aspect ratio within the
rounding of one pixel; the conditioning image is then resized).

A conditioning image gets its image's own preparation — the center crop, or the image's
bucket and crop (``data.buckets``), scaled to its own pixels — so the two stay aligned
pixel for pixel. The model sees it as float in [0, 1] (what diffusers' ControlNet pipelines
feed: the image processor without normalisation). It is not VAE-encoded: the prepared
uint8 pixels are cached (``data/cache.py``, :func:`~steadydiff.data.cache.encode_conditioning`).

A user dataset given to ``steadydiff.train`` is paired when it has ``conditioning(i)`` (a
float tensor (C, H, W) in [0, 1], H and W the image's) and names the files with
``conditioning_path_of(i)``; it is read in the step, unchecked before it, so the guard is
what catches a non-finite one (the pair is dropped, then quarantined, naming both files).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import Dataset

from steadydiff.data import (_BAD_IMAGE_ERRORS, IMAGE_EXTENSIONS, DataError,
                             ImageFolderDataset, build_dataset)
from steadydiff.data.captions import (CaptionedImageFolder, build_captioned, metadata_files,
                                      read_jsonl_lines)
from steadydiff.kinds import ConditioningMatch, ConditioningSource

if TYPE_CHECKING:
    from steadydiff.config import DataConfig

__all__ = ["RECIPE_FILE", "ConditionedImageFolder", "PairError", "build_paired",
           "conditioning_of", "find_partners", "is_paired", "pair_name", "partner_exclusions"]

log = logging.getLogger(__name__)

# What `steadydiff condition` writes beside the conditioning images it made (its kind and
# parameters, data/conditioning.py); a run over that folder records it.
RECIPE_FILE = "conditioning.json"
_LIST = 5  # problems listed by name per kind; the rest are counted


class PairError(DataError):
    """Images and conditioning images that do not pair (the message names both files)."""


def _rel(path: Path, root: Path) -> str:
    return os.path.relpath(path, root).replace(os.sep, "/")


def _folder(cfg_dir: str, root: Path) -> Path:
    p = Path(cfg_dir).expanduser()
    return p if p.is_absolute() else root / p


def _resolve_source(source: ConditioningSource, folder: Path) -> ConditioningSource:
    if source == "auto":
        return "folder" if folder.is_dir() else "jsonl"
    return source


def _column_entries(root: Path, rels: Sequence[str] | None, column: str
                    ) -> dict[str, tuple[Path, str]]:
    """``{image path relative to root: (conditioning file, "metadata.jsonl:line")}`` from
    the metadata.jsonl files that may name the images ``rels`` (None: every one under
    ``root``). A line without ``column`` names no partner (a missing partner, reported)."""
    if rels is None:
        files = [(_rel(f.parent, root) if f.parent != root else "", f)
                 for f in sorted(root.rglob("metadata.jsonl")) if not any(
                     part.startswith(".") for part in f.relative_to(root).parts)]
    else:
        files = metadata_files(root, rels)
    out: dict[str, tuple[Path, str]] = {}
    for d, f in files:
        for where, obj in read_jsonl_lines(f, root):
            if column not in obj:
                continue
            name, value = obj.get("file_name"), obj[column]
            if not isinstance(value, str) or not value.strip():
                raise PairError(f"{where}: \"{column}\" is {value!r}; expected the "
                                f"conditioning image's path (relative to {f.parent}) as a "
                                f"non-empty string")
            if not isinstance(name, str) or not name.strip():
                raise PairError(f"{where}: \"{column}\" is set but \"file_name\" is "
                                f"{name!r}: each line pairs the image file_name with its "
                                f"conditioning image")
            img = os.path.normpath(os.path.join(d, name)).replace(os.sep, "/")
            out[img] = (f.parent / value, where)
    return out


def partner_exclusions(cfg: DataConfig) -> list[Path]:
    """What the image folder ``cfg.path`` must not train on: the conditioning folder, or the
    files metadata.jsonl names as conditioning images (``cfg.conditioning``)."""
    if cfg.conditioning == "none" or not cfg.path:
        return []
    root = Path(cfg.path).expanduser()
    folder = _folder(cfg.conditioning_dir, root)
    if _resolve_source(cfg.conditioning, folder) == "folder":
        return [folder]
    if not root.is_dir():
        return []  # the folder's own check names the problem
    return [p for p, _ in _column_entries(root, None, cfg.conditioning_column).values()]


def _candidates(folder: Path, rel: str) -> list[Path]:
    """The files of ``folder`` that may pair with the image ``rel``: the same relative path,
    else the same path with another image extension (any case)."""
    same = folder / rel
    if same.is_file():
        return [same]
    stem = os.path.splitext(rel)[0]
    parent = (folder / stem).parent
    base = Path(stem).name
    try:
        names = os.listdir(parent)
    except OSError:
        return []
    return sorted(parent / n for n in names
                  if os.path.splitext(n)[0] == base and n.lower().endswith(IMAGE_EXTENSIONS)
                  and not n.startswith("."))


def find_partners(root: Path, paths: Sequence[Path], source: ConditioningSource, *,
                  folder: str | os.PathLike[str] = "conditioning",
                  column: str = "conditioning_image",
                  match: ConditioningMatch = "size") -> list[Path]:
    """Each image's conditioning image, every pair checked (see the module docstring).

    Args:
        root: the image folder.
        paths: its training images.
        source: ``folder``, ``jsonl`` or ``auto``.
        folder: the conditioning folder (relative to ``root``, or absolute).
        column: the metadata.jsonl key.
        match: ``size`` or ``aspect``.

    Returns:
        One conditioning file per image, in the order of ``paths``.

    Raises:
        PairError: listing every kind of problem found, each with both files.
    """
    root = Path(root)
    cdir = _folder(str(folder), root)
    kind = _resolve_source(source, cdir)
    rels = [_rel(p, root) for p in paths]
    missing: list[str] = []
    ambiguous: list[str] = []
    partners: list[Path | None] = []
    if kind == "folder":
        if not cdir.is_dir():
            raise PairError(f"conditioning folder {str(cdir)!r} does not exist; expected "
                            f"one conditioning image per training image there, under the "
                            f"same relative path (e.g. {cdir / rels[0]}); make them with "
                            f"`steadydiff condition {root} --kind canny`, or set "
                            f"data.conditioning_dir")
        for p, rel in zip(paths, rels):
            found = _candidates(cdir, rel)
            if len(found) > 1:
                ambiguous.append(f"{p}: {', '.join(str(f) for f in found)}")
            if not found:
                missing.append(f"{p}: no {cdir / os.path.splitext(rel)[0]}.* "
                               f"({'/'.join(e[1:] for e in IMAGE_EXTENSIONS)})")
            partners.append(found[0] if len(found) == 1 else None)
    else:
        entries = _column_entries(root, rels, column)
        for p, rel in zip(paths, rels):
            got = entries.get(rel)
            if got is None:
                missing.append(f"{p}: no \"{column}\" in a metadata.jsonl line with "
                               f"\"file_name\" naming it")
                partners.append(None)
            elif not got[0].is_file():
                missing.append(f"{p}: {got[0]} ({got[1]}) "
                               + ("is a folder" if got[0].is_dir() else "does not exist"))
                partners.append(None)
            else:
                partners.append(got[0])
    unreadable, mismatch = [], []
    for p, c in zip(paths, partners):
        if c is None:
            continue
        reason = ImageFolderDataset._check_header(c)
        if reason is not None:
            unreadable.append(f"{p}: its conditioning image {c} is unreadable ({reason})")
            continue
        why = _mismatch(ImageFolderDataset._size(p), ImageFolderDataset._size(c), match)
        if why:
            mismatch.append(f"{p} and {c}: {why}")
    problems = [(missing, "have no conditioning image"),
                (ambiguous, "have more than one conditioning image (keep one)"),
                (unreadable, "have an unreadable conditioning image"),
                (mismatch, "do not match their conditioning image")]
    if any(lst for lst, _ in problems):
        lines = []
        for lst, what in problems:
            if lst:
                more = f" (and {len(lst) - _LIST} more)" if len(lst) > _LIST else ""
                lines.append(f"{len(lst)} of {len(paths)} images {what}{more}:")
                lines += [f"  {x}" for x in lst[:_LIST]]
        how = (f"conditioning images live in {cdir} under the images' relative paths"
               if kind == "folder" else
               f"each metadata.jsonl line names its image's conditioning image in "
               f"\"{column}\", relative to the metadata.jsonl's folder")
        raise PairError(f"image folder {str(root)!r}: bad image/conditioning pairs:\n"
                        + "\n".join(lines) + f"\n({how}; data.conditioning_match={match}"
                        + ("; `aspect` accepts another size of the same aspect ratio"
                           if match == "size" and mismatch else "") + ")")
    return [c for c in partners if c is not None]


def _mismatch(a: tuple[int, int], b: tuple[int, int], match: ConditioningMatch) -> str:
    """Why images of sizes ``a`` and ``b`` (w, h) do not pair, or ""."""
    (w1, h1), (w2, h2) = a, b
    if match == "size":
        return "" if a == b else f"the image is {w1}x{h1}, the conditioning image {w2}x{h2}"
    # resized by s and rounded to whole pixels: |w1*h2 - w2*h1| <= (w + h) / 2 of the larger
    if abs(w1 * h2 - w2 * h1) <= max(w1 + h1, w2 + h2) / 2:
        return ""
    return (f"aspect ratios differ: the image is {w1}x{h1} ({w1 / h1:.3f}), the conditioning "
            f"image {w2}x{h2} ({w2 / h2:.3f})")


def read_recipe(folder: Path) -> dict[str, Any] | None:
    """What made the conditioning images of ``folder`` (``steadydiff condition``'s
    conditioning.json), or None."""
    f = folder / RECIPE_FILE
    if not f.is_file():
        return None
    try:
        d = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        log.warning("%s: unreadable (%s); the run records no conditioning recipe", f, e)
        return None
    return d if isinstance(d, dict) else None


class ConditionedImageFolder(Dataset):
    """A captioned image folder whose items each have a conditioning image.

    Items are the captioned folder's ``(image, caption)``; :meth:`conditioning` gives item
    ``i``'s conditioning image prepared like the image (float (C, H, W) in [0, 1]) and
    :meth:`conditioning_pixels` the same as uint8 (what the cache stores).

    Args:
        captioned: the captioned folder (a class subset's index included).
        partners: one conditioning file per item (:func:`find_partners`).
        channels: the conditioning images' channels (the ControlNet's
            ``conditioning_channels``: 3 RGB, 1 gray).
        recipe: what made them (``conditioning.json``), recorded by the run.

    Attributes:
        captions, paths, index, folder, channels, image_size, skipped, bad_paths: the
        captioned folder's; ``conditioning_paths``: the partners; ``conditioning_channels``.
    """

    num_classes: int = 0

    def __init__(self, captioned: CaptionedImageFolder, partners: Sequence[Path], *,
                 channels: int = 3, recipe: dict[str, Any] | None = None) -> None:
        if len(partners) != len(captioned):
            raise PairError(f"{len(partners)} conditioning images for {len(captioned)} images")
        if channels not in (1, 3):
            raise PairError(f"conditioning images are read as 1 (gray) or 3 (RGB) channels, "
                            f"got {channels}")
        self.captioned = captioned
        self.folder, self.index = captioned.folder, captioned.index
        self.paths, self.captions = captioned.paths, captioned.captions
        self.conditioning_paths = list(partners)
        self.conditioning_channels = channels
        self.recipe = recipe
        self.fetch = captioned.fetch

    channels = property(lambda self: self.captioned.channels)
    image_size = property(lambda self: self.captioned.image_size)
    skipped = property(lambda self: self.captioned.skipped)
    bad_paths = property(lambda self: self.captioned.bad_paths)

    def __len__(self) -> int:
        return len(self.captioned)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, str]:
        return self.captioned[i]

    def path_of(self, i: int) -> Path:
        """The image file of item ``i``."""
        return self.paths[int(i)]

    def conditioning_path_of(self, i: int) -> Path:
        """The conditioning image file of item ``i``."""
        return self.conditioning_paths[int(i)]

    def conditioning_pixels(self, i: int) -> torch.Tensor:
        """Item ``i``'s conditioning image, (C, H, W) uint8, cropped and resized as its
        image is (same bucket and crop, scaled to the conditioning file's pixels).

        Raises:
            DataError: the file cannot be decoded (naming both files).
        """
        layout = self.folder.bucket_layout
        crop = layout.crops[self.index[int(i)]] if layout is not None else None
        c = self.conditioning_paths[int(i)]
        try:
            return self.folder.pixels(c, crop, self.conditioning_channels)
        except _BAD_IMAGE_ERRORS as e:
            raise DataError(f"{self.paths[int(i)]}: its conditioning image {c} cannot be "
                            f"decoded ({type(e).__name__}: {e})") from None

    def conditioning(self, i: int) -> torch.Tensor:
        """Item ``i``'s conditioning image, (C, H, W) float32 in [0, 1]."""
        return self.conditioning_pixels(i).to(torch.float32).div_(255.0)

    def describe(self) -> str:
        made = (f", made by `steadydiff condition --kind {self.recipe.get('kind')}`"
                if self.recipe else "")
        return (f"{self.captioned.describe()}; {len(self)} conditioning images "
                f"({self.conditioning_channels} channels, e.g. {self.conditioning_paths[0]})"
                f"{made}")


def is_paired(dataset: Any) -> bool:
    """Whether ``dataset`` gives conditioning images (:func:`conditioning_of` reads them)."""
    return callable(getattr(dataset, "conditioning", None))


def conditioning_of(dataset: Any, i: int) -> torch.Tensor:
    """Item ``i``'s conditioning image, float (C, H, W), as the dataset gives it.

    Raises:
        DataError: not a (C, H, W) tensor (naming the item).
    """
    c = dataset.conditioning(int(i))
    if not isinstance(c, torch.Tensor) or c.ndim != 3:
        got = tuple(c.shape) if isinstance(c, torch.Tensor) else type(c).__name__
        raise DataError(f"dataset item {i}: conditioning({i}) must return a (C, H, W) "
                        f"tensor in [0, 1], got {got}")
    return c if c.is_floating_point() else c.to(torch.float32).div_(255.0)


def pair_name(dataset: Any, i: int) -> str | None:
    """``"IMAGE (conditioning COND)"`` for item ``i`` of a paired dataset, what incidents
    name; None when the dataset names neither file."""
    path_of = getattr(dataset, "path_of", None)
    cpath = getattr(dataset, "conditioning_path_of", None)
    img = str(path_of(int(i))) if callable(path_of) else None
    cond = str(cpath(int(i))) if callable(cpath) else None
    if img is None and cond is None:
        return None
    return f"{img or f'item {i}'} (conditioning {cond or 'unnamed'})"


def build_paired(cfg: DataConfig, seed: int = 0, channels: int = 3) -> ConditionedImageFolder:
    """The paired dataset of a ``data`` section with ``conditioning`` set: the image folder
    without its conditioning files, its captions, and every pair checked.

    Raises:
        DataError: the folder, its captions or a pair (:class:`PairError`).
    """
    data = build_dataset(cfg, seed=seed, exclude=partner_exclusions(cfg))
    captioned = build_captioned(cfg, data, seed)
    if not isinstance(captioned, CaptionedImageFolder):
        raise PairError("conditioning pairs need a captioned image folder (data.dataset="
                        "folder, data.captions auto|txt|jsonl)")
    root = Path(cfg.path).expanduser()
    partners = find_partners(root, captioned.paths, cfg.conditioning,
                             folder=cfg.conditioning_dir, column=cfg.conditioning_column,
                             match=cfg.conditioning_match)
    cdir = _folder(cfg.conditioning_dir, root)
    recipe = read_recipe(cdir) if _resolve_source(cfg.conditioning, cdir) == "folder" else None
    return ConditionedImageFolder(captioned, partners, channels=channels, recipe=recipe)

