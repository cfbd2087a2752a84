"""kohya sd-scripts datasets as they are: ``N_name`` repeat folders, the dataset TOML, and
regularization (class) images for DreamBooth prior preservation.

kohya's DreamBooth layout (``train_network.py --train_data_dir D --reg_data_dir R``): each
first-level folder of ``D`` named ``<repeats>_<class tokens>`` (``10_sks dog``) is a subset
whose images are seen ``repeats`` times per epoch; an image without a caption file
(``--caption_extension``, ``.txt`` here) is captioned with the folder's class tokens
(``sks dog``). ``R`` holds the regularization images the same way. kohya's dataset TOML
(``--dataset_config``; its docs ``config_README``) says the same with ``[general]``,
``[[datasets]]`` and ``[[datasets.subsets]]`` tables; a key set higher up is inherited
below.

One epoch is every training image x its repeats, plus as many regularization samples as
training samples (kohya's balancing, ``DreamBoothDataset.__init__``: every regularization
image once with its repeats, then one more repeat image by image until they match; when
there are more regularization samples than training samples, the first ones until they
match). A regularization sample's loss is weighted by ``data.prior_loss_weight`` (kohya's
``--prior_loss_weight``; diffusers' ``train_dreambooth.py`` ``--with_prior_preservation``):
the step's loss is ``mean_i(w_i * loss_i)``, w = 1 for an instance image.

The images are encoded once each (data/cache.py); the repeats are positions of the data
stream (:class:`Repeated` over the encoded dataset), so an epoch of the stream
(``StreamBatchSampler``) is kohya's epoch, and each copy of an image draws its own caption
shuffle.
"""

from __future__ import annotations

import logging
import math
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from . import DataError, ImageFolderDataset
from .buckets import BucketLayout, make_buckets
from .captions import _clean, _read_text, with_trigger

log = logging.getLogger(__name__)

__all__ = ["Subset", "KohyaPlan", "repeat_folders", "read_dataset_toml", "plan_of",
           "KohyaDataset", "Repeated", "balance_reg", "build_kohya", "epoch_lines"]

REPEAT_FOLDER = re.compile(r"^(\d+)_(.*)$")  # kohya's "<repeats>_<class tokens>"

# the TOML keys read, by level (general and dataset keys are inherited by their subsets)
SUBSET_KEYS = {"image_dir", "num_repeats", "caption_extension", "keep_tokens",
               "shuffle_caption", "is_reg", "class_tokens"}
DATASET_KEYS = {"resolution", "batch_size", "subsets"}
# kohya keys a steadydiff run does another way, and where: refused naming the key
ELSEWHERE = {
    "enable_bucket": "data.buckets", "min_bucket_reso": "data.bucket_min_side",
    "max_bucket_reso": "data.bucket_max_side", "bucket_reso_steps": "data.bucket_step",
    "flip_aug": "data.hflip", "caption_dropout_rate": "data.caption_dropout",
    "color_aug": None, "random_crop": "data.bucket_crop=random",
    "metadata_file": "data.captions=jsonl (metadata.jsonl)", "face_crop_aug_range": None,
    "caption_prefix": "data.trigger", "caption_suffix": None, "token_warmup_min": None,
    "token_warmup_step": None, "caption_dropout_every_n_epochs": None,
    "caption_tag_dropout_rate": None, "secondary_separator": None,
    "enable_wildcard": None, "keep_tokens_separator": None, "alpha_mask": None,
    "cache_info": None, "conditioning_data_dir": "data.conditioning",
    "bucket_no_upscale": None, "debug_dataset": None, "validation_seed": None,
    "validation_split": None, "shuffle_caption_sep": "data.caption_separator"}


@dataclass(frozen=True)
class Subset:
    """One kohya subset: a folder of images, its repeats per epoch, the class tokens that
    caption an image without a caption file, and whether it holds regularization images."""

    image_dir: Path
    num_repeats: int = 1
    class_tokens: str | None = None
    is_reg: bool = False
    caption_extension: str = ".txt"
    keep_tokens: int | None = None
    shuffle_caption: bool | None = None

    @property
    def name(self) -> str:
        return self.image_dir.name


@dataclass
class KohyaPlan:
    """What the folders or the TOML say: the subsets, and the dataset-level settings the
    TOML may set (None: the config's)."""

    subsets: list[Subset]
    source: str
    resolution: int | None = None
    batch_size: int | None = None
    notes: list[str] = field(default_factory=list)

    def caption_rules(self) -> list[tuple[bool, int]] | None:
        """``(shuffle_caption, keep_tokens)`` per subset where the subsets set different
        ones (a subset that sets neither takes kohya's defaults: no shuffle, none kept);
        None where one rule holds for all (then data.caption_shuffle / data.keep_tokens)."""
        rules = [(s.shuffle_caption, s.keep_tokens) for s in self.subsets]
        for k in (0, 1):
            if len({r[k] for r in rules if r[k] is not None}) > 1 or \
                    (any(r[k] is None for r in rules) and any(r[k] for r in rules)):
                return [(bool(s), int(k or 0)) for s, k in rules]
        return None


def repeat_folders(root: str | os.PathLike[str], *, is_reg: bool = False,
                   caption_extension: str = ".txt") -> list[Subset]:
    """The ``<repeats>_<class tokens>`` folders directly under ``root`` as subsets (sorted by
    name). Other folders are left out with a warning, as kohya does.

    Raises:
        DataError: ``root`` is missing, or a folder says 0 repeats.
    """
    root = Path(root).expanduser()
    if not root.is_dir():
        raise DataError(f"{root}: no such folder")
    out, other = [], []
    for d in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        m = REPEAT_FOLDER.match(d.name)
        if m is None:
            other.append(d.name)
            continue
        n = int(m.group(1))
        if n < 1:
            raise DataError(f"{d}: a kohya folder <repeats>_<name> needs repeats >= 1, got "
                            f"{n}")
        out.append(Subset(d, n, m.group(2).strip() or None, is_reg, caption_extension))
    if out and other:
        log.warning("%s: folders without a <repeats>_ prefix are left out, as kohya does: %s",
                    root, ", ".join(other[:5]))
    return out


def is_repeat_layout(root: str | os.PathLike[str]) -> bool:
    """Whether ``root``'s sub-folders are kohya repeat folders (at least one, no images
    directly in ``root``)."""
    from . import IMAGE_EXTENSIONS

    root = Path(root).expanduser()
    if not root.is_dir():
        return False
    entries = list(root.iterdir())
    if any(p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS for p in entries):
        return False
    return any(p.is_dir() and REPEAT_FOLDER.match(p.name) for p in entries)


_KIND = {int: "an integer", str: "a string", bool: "true or false"}


def _typed(where: str, key: str, v: Any, kind: type) -> Any:
    if not isinstance(v, kind) or (isinstance(v, bool) and kind is not bool):
        raise DataError(f"{where}: {key} = {v!r} must be {_KIND[kind]}")
    return v


def _check_keys(where: str, table: dict[str, Any], allowed: set[str]) -> None:
    for k in table:
        if k in allowed:
            continue
        if k in ELSEWHERE:
            there = ELSEWHERE[k]
            raise DataError(f"{where}: {k} is not read from a dataset TOML by steadydiff: "
                            + (f"set {there} in the config instead" if there else
                               "it has no steadydiff equivalent; remove it")
                            + " (docs/sd.md, the kohya mapping)")
        raise DataError(f"{where}: unknown key {k!r}; a kohya dataset TOML here takes "
                        f"{', '.join(sorted(allowed - {'subsets', 'datasets', 'general'}))}")


def read_dataset_toml(path: str | os.PathLike[str]) -> KohyaPlan:
    """kohya's dataset TOML (``--dataset_config``), read with tomllib.

    ``[general]`` and each ``[[datasets]]`` may set any subset key (inherited); a dataset sets
    ``resolution`` (an int, or ``[w, h]`` with w = h) and ``batch_size``. Several datasets
    must agree on both (steadydiff trains one resolution and batch at a time); relative
    ``image_dir`` paths are relative to the TOML's folder.

    Raises:
        DataError: the file cannot be read or parsed, an unknown key, a key steadydiff sets
            elsewhere (the message names the config key), a wrong type, or no subsets.
    """
    p = Path(path).expanduser()
    try:
        doc = tomllib.loads(_read_text(p, "dataset TOML"))
    except tomllib.TOMLDecodeError as e:
        raise DataError(f"{p}: not valid TOML ({e})") from None
    for k in doc:
        if k not in ("general", "datasets"):
            raise DataError(f"{p}: unknown table {k!r}; a kohya dataset TOML has [general] and "
                            "[[datasets]] (with [[datasets.subsets]])")
    general = doc.get("general", {})
    _check_keys(f"{p} [general]", general, SUBSET_KEYS | DATASET_KEYS - {"subsets"})
    datasets = doc.get("datasets") or []
    if not isinstance(datasets, list) or not datasets:
        raise DataError(f"{p}: no [[datasets]]; add one with [[datasets.subsets]] image_dir = "
                        "...")
    subsets: list[Subset] = []
    res: set[int] = set()
    batch: set[int] = set()
    for di, ds in enumerate(datasets):
        where = f"{p} [[datasets]] #{di + 1}"
        _check_keys(where, ds, SUBSET_KEYS | DATASET_KEYS)
        inherited = {**general, **{k: v for k, v in ds.items() if k != "subsets"}}
        r = inherited.get("resolution")
        if r is not None:
            if isinstance(r, list):
                if len(r) != 2 or r[0] != r[1]:
                    raise DataError(f"{where}: resolution = {r}: steadydiff trains square "
                                    "images at one size (data.image_size; data.buckets for "
                                    "other aspect ratios): give one number")
                r = r[0]
            res.add(int(_typed(where, "resolution", r, int)))
        if inherited.get("batch_size") is not None:
            batch.add(int(_typed(where, "batch_size", inherited["batch_size"], int)))
        subs = ds.get("subsets") or []
        if not subs:
            raise DataError(f"{where}: no [[datasets.subsets]]")
        for si, s in enumerate(subs):
            sw = f"{where} subset #{si + 1}"
            _check_keys(sw, s, SUBSET_KEYS)
            v = {**{k: x for k, x in inherited.items() if k in SUBSET_KEYS}, **s}
            if "image_dir" not in v:
                raise DataError(f"{sw}: no image_dir")
            d = Path(_typed(sw, "image_dir", v["image_dir"], str)).expanduser()
            d = d if d.is_absolute() else p.parent / d
            if not d.is_dir():
                raise DataError(f"{sw}: image_dir {d} is not a folder")
            n = int(_typed(sw, "num_repeats", v.get("num_repeats", 1), int))
            if n < 1:
                raise DataError(f"{sw}: num_repeats = {n}; it must be >= 1")
            ext = _typed(sw, "caption_extension", v.get("caption_extension", ".txt"), str)
            subsets.append(Subset(
                d, n, _typed(sw, "class_tokens", v["class_tokens"], str)
                if v.get("class_tokens") is not None else None,
                bool(_typed(sw, "is_reg", v.get("is_reg", False), bool)),
                ext if ext.startswith(".") else "." + ext,
                int(_typed(sw, "keep_tokens", v["keep_tokens"], int))
                if "keep_tokens" in v else None,
                bool(_typed(sw, "shuffle_caption", v["shuffle_caption"], bool))
                if "shuffle_caption" in v else None))
    for what, vals in (("resolution", res), ("batch_size", batch)):
        if len(vals) > 1:
            raise DataError(f"{p}: the datasets' {what} differ ({sorted(vals)}); steadydiff "
                            f"trains one {what} at a time: make them equal, or train them as "
                            "separate runs")
    return KohyaPlan(subsets, f"dataset TOML {p}", next(iter(res), None),
                     next(iter(batch), None))


def plan_of(cfg: Any) -> KohyaPlan | None:
    """The kohya plan of a ``data`` section: its ``dataset_config`` TOML, or ``data.path``'s
    repeat folders (``data.repeat_folders``: auto when they are there) plus
    ``data.reg_path``'s; None for a plain folder."""
    if cfg.dataset_config:
        plan = read_dataset_toml(cfg.dataset_config)
    elif cfg.dataset == "folder" and cfg.path and (
            cfg.repeat_folders is True or (cfg.repeat_folders == "auto"
                                           and is_repeat_layout(cfg.path))):
        subs = repeat_folders(cfg.path, caption_extension=cfg.caption_extension)
        if cfg.instance_prompt:  # the instance prompt over the folder names' class tokens
            subs = [Subset(s.image_dir, s.num_repeats, cfg.instance_prompt, s.is_reg,
                           s.caption_extension) for s in subs]
        if not subs:
            raise DataError(f"data.repeat_folders=true: {cfg.path} has no <repeats>_<name> "
                            "folders (e.g. 10_sks dog)")
        plan = KohyaPlan(subs, f"kohya repeat folders {cfg.path}")
    elif cfg.reg_path:
        root = Path(cfg.path).expanduser()  # a plain folder of instance images, 1 repeat
        plan = KohyaPlan([Subset(root, 1, cfg.instance_prompt, False, cfg.caption_extension)],
                         f"folder {root}")
    else:
        return None
    if cfg.class_labels or cfg.conditioning != "none":
        raise DataError(f"{plan.source}: kohya subsets do not combine with data.class_labels "
                        "or data.conditioning yet: remove them, or set "
                        "data.repeat_folders=false to read the folder as one plain folder")
    if cfg.reg_path:
        reg = repeat_folders(cfg.reg_path, is_reg=True,
                             caption_extension=cfg.caption_extension) \
            if is_repeat_layout(cfg.reg_path) else \
            [Subset(Path(cfg.reg_path).expanduser(), 1, cfg.class_prompt, True,
                    cfg.caption_extension)]
        plan.subsets.extend(reg)
    return plan


# --------------------------------------------------------------------------- balancing


def balance_reg(train_samples: int, reg_images: list[int]) -> list[int]:
    """Each regularization image's repeats so that the regularization samples match the
    ``train_samples`` of an epoch, by kohya's rule: every image once with its own repeats
    (``reg_images[k]``), in order, until the count is reached; then one more repeat image
    by image, in order, until it is. Images past the count get 0. With no training
    samples, the repeats as given."""
    out = [0] * len(reg_images)
    if not reg_images or train_samples <= 0:
        return list(reg_images)
    n, first = 0, True
    while n < train_samples:
        for k, r in enumerate(reg_images):
            if first:
                out[k] = r
                n += r
            else:
                out[k] += 1
                n += 1
            if n >= train_samples:
                break
        first = False
    return out


# --------------------------------------------------------------------------- the dataset


class KohyaDataset(Dataset):
    """The distinct images of every subset, each once, with its caption (the caption file,
    else the subset's class tokens), and per image its repeats per epoch and its loss weight
    (``prior_loss_weight`` for a regularization image). :class:`Repeated` turns the encoded
    images into the epoch's samples.

    Attributes:
        captions, paths: per image. repeats: per image (regularization balanced).
        loss_weights: (N,) float32. is_reg: per image. subsets: the plan's, in order;
        counts: per subset ``(images, samples per epoch)``.
    """

    num_classes: int = 0

    def __init__(self, plan: KohyaPlan, *, image_size: int, channels: int = 3,
                 center_crop: bool = True, follow_symlinks: bool = False,
                 missing: str = "error", trigger: str | None = None, separator: str = ",",
                 prior_loss_weight: float = 1.0, buckets: list[tuple[int, int]] | None = None,
                 random_crop: bool = False, crop_seed: int = 0) -> None:
        self.plan = plan
        self.folders: list[ImageFolderDataset] = []
        self.items: list[tuple[int, int]] = []  # (subset, folder index)
        self.captions: list[str] = []
        self.paths: list[Path] = []
        self.is_reg: list[bool] = []
        lost: list[str] = []
        for k, s in enumerate(plan.subsets):
            f = ImageFolderDataset(s.image_dir, image_size, channels, center_crop=center_crop,
                                   follow_symlinks=follow_symlinks, buckets=buckets,
                                   random_crop=random_crop, crop_seed=crop_seed)
            self.folders.append(f)
            for j, p in enumerate(f.paths):
                cap_file = Path(os.path.splitext(p)[0] + s.caption_extension)
                if cap_file.is_file():
                    cap = _clean(_read_text(cap_file, "caption file"))
                elif s.class_tokens:
                    cap = s.class_tokens
                else:
                    cap = ""
                    lost.append(str(p))
                if not s.is_reg:
                    cap = with_trigger(cap, trigger, separator)
                self.items.append((k, j))
                self.captions.append(cap)
                self.paths.append(Path(p))
                self.is_reg.append(s.is_reg)
        if lost and missing == "error":
            raise DataError(f"{len(lost)} images have neither a caption file nor class tokens, "
                            f"e.g. {lost[0]}: write its caption file, name its folder "
                            "<repeats>_<class tokens>, set class_tokens in the dataset TOML, "
                            "or data.missing_caption=empty")
        per_sub = [sum(1 for k, _ in self.items if k == i) for i in range(len(plan.subsets))]
        base = [plan.subsets[k].num_repeats for k, _ in self.items]
        train = sum(r for r, reg in zip(base, self.is_reg) if not reg)
        reg_idx = [i for i, reg in enumerate(self.is_reg) if reg]
        self.repeats = list(base)
        if reg_idx and train:
            for i, r in zip(reg_idx, balance_reg(train, [base[i] for i in reg_idx])):
                self.repeats[i] = r
        self.loss_weights = torch.tensor([prior_loss_weight if reg else 1.0
                                          for reg in self.is_reg], dtype=torch.float32)
        self.counts = [(per_sub[k], sum(r for (kk, _), r in zip(self.items, self.repeats)
                                        if kk == k)) for k in range(len(plan.subsets))]
        self.prior_loss_weight = prior_loss_weight
        self._item_of = {kj: i for i, kj in enumerate(self.items)}
        # data.buckets: every subset's images in the same buckets, one layout over all
        self.bucket_layout: BucketLayout | None = None
        if buckets is not None and self.items:
            lay = [f.bucket_layout for f in self.folders]
            self.bucket_layout = BucketLayout(lay[0].buckets,
                                              [lay[k].ids[j] for k, j in self.items],
                                              [lay[k].crops[j] for k, j in self.items])
        if not self.items:
            raise DataError(f"{plan.source}: no images in its subsets")

    @property
    def channels(self) -> int:
        return self.folders[0].channels

    @property
    def image_size(self) -> int:
        return self.folders[0].image_size

    @property
    def skipped(self) -> int:
        return sum(f.skipped for f in self.folders)

    @property
    def bad_paths(self) -> dict[str, str]:
        return {k: v for f in self.folders for k, v in f.bad_paths.items()}

    @property
    def epoch_length(self) -> int:
        """Samples per epoch: every image x its repeats."""
        return sum(self.repeats)

    def caption_settings(self) -> list[tuple[bool, int]] | None:
        """``(shuffle, keep_tokens)`` per image where the subsets set different ones
        (``KohyaPlan.caption_rules``; a CaptionVariants' ``per_source``), else None."""
        rules = self.plan.caption_rules()
        return None if rules is None else [rules[k] for k, _ in self.items]

    def __len__(self) -> int:
        return len(self.items)

    def path_of(self, i: int) -> Path:
        return self.paths[int(i)]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, str]:
        x, cap, _ = self.fetch(i)
        return x, cap

    def fetch(self, i: int) -> tuple[torch.Tensor, str, bool]:
        """Image ``i`` (a bad file is replaced by the next good one of its folder, flagged)."""
        k, j = self.items[int(i)]
        x, got = self.folders[k].fetch_index(j)
        other = self._item_of.get((k, got), int(i))
        return x, self.captions[other], got != j

    def describe(self) -> str:
        s = self.image_size
        reg = sum(self.is_reg)
        return (f"KohyaDataset ({self.plan.source}): {len(self) - reg} images"
                + (f" + {reg} regularization images" if reg else "")
                + f" {self.channels}×{s}×{s} in {len(self.plan.subsets)} subsets, "
                f"{self.epoch_length} samples per epoch")


class Repeated(Dataset):
    """The encoded images (``EncodedDataset`` over a :class:`KohyaDataset`) as an epoch's
    samples: image ``p`` at ``repeats`` positions. Position ``i`` (copy ``r`` of its image)
    at epoch ``e`` is the image's item at key ``e * R + r`` (R: the most repeats), so each
    copy draws its own caption shuffle/dropout, a pure function of (seed, e, i).

    Attributes:
        loss_weights: (N,) per position (prior_loss_weight for a regularization image).
        epoch_length: N.
    """

    trains_as_is = True
    num_classes: int = 0

    def __init__(self, encoded: Any, repeats: list[int], weights: torch.Tensor) -> None:
        self.encoded = encoded
        pos, copy, w = [], [], []
        for p in range(len(encoded)):
            s = encoded.source_index(p)
            for r in range(repeats[s]):
                pos.append(p)
                copy.append(r)
                w.append(float(weights[s]))
        if not pos:
            raise DataError("no samples: every image has 0 repeats")
        self._pos = pos
        self._copy = copy
        self._r = max(repeats) if repeats else 1
        self.loss_weights = torch.tensor(w, dtype=torch.float32)
        self.epoch_length = len(pos)
        for a in ("channels", "image_size", "item_shape", "context_shape", "null_context",
                  "quarantined", "caption_overflow", "variants"):
            setattr(self, a, getattr(encoded, a, None))
        lay = getattr(encoded, "bucket_layout", None)  # each position in its image's bucket
        self.bucket_layout = lay.subset(pos) if lay is not None else None

    def __len__(self) -> int:
        return len(self._pos)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.encoded[self._pos[int(i)]]

    def item_at(self, i: int, epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = int(i)
        return self.encoded.item_at(self._pos[i], epoch * self._r + self._copy[i])

    def source_index(self, i: int) -> int:
        return self.encoded.source_index(self._pos[int(i)])

    def copies(self, indices: Any) -> set[int]:
        """Every position showing the image of any of ``indices``: a sample the guard
        quarantines leaves the stream with all its repeats (the same latent)."""
        images = {self._pos[int(i)] for i in indices}
        return {i for i, p in enumerate(self._pos) if p in images}

    def path_of(self, i: int) -> str | None:
        return self.encoded.path_of(self._pos[int(i)])

    def describe(self) -> str:
        return f"{self.encoded.describe()}; {len(self)} samples per epoch with the repeats"


def build_kohya(cfg: Any, plan: KohyaPlan, seed: int = 0) -> KohyaDataset:
    """The :class:`KohyaDataset` of a ``data`` section and its plan (the per-subset
    shuffle/keep_tokens were applied to the config by :func:`resolve_config`)."""
    buckets = None
    if cfg.buckets:
        lo, hi = cfg.bucket_sides()
        buckets = make_buckets(cfg.image_size, cfg.bucket_step, lo, hi, cfg.bucket_max_ratio)
    return KohyaDataset(plan, image_size=cfg.image_size, channels=cfg.channels,
                        center_crop=cfg.center_crop, follow_symlinks=cfg.follow_symlinks,
                        missing=cfg.missing_caption, trigger=cfg.trigger,
                        separator=cfg.caption_separator,
                        prior_loss_weight=cfg.prior_loss_weight, buckets=buckets,
                        random_crop=cfg.bucket_crop == "random", crop_seed=seed)


def resolve_config(cfg: Any) -> tuple[Any, list[str]]:
    """``cfg`` with what a kohya dataset TOML sets (data.image_size from ``resolution``,
    train.batch_size, data.caption_shuffle and data.keep_tokens from the subsets'
    ``shuffle_caption``/``keep_tokens``), and a note per value changed.

    Raises:
    Subsets that set different shuffle_caption/keep_tokens keep their own
    (``KohyaPlan.caption_rules``; data.caption_shuffle is then on for the stream, whose
    captions are tokenized per epoch).
    """
    from ..config import replace as replace_cfg

    d = cfg.data
    if not d.dataset_config:
        return cfg, []
    plan = read_dataset_toml(d.dataset_config)
    changes: dict[str, Any] = {}
    if plan.resolution is not None and plan.resolution != d.image_size:
        changes["data.image_size"] = plan.resolution
    if plan.batch_size is not None and plan.batch_size != cfg.train.batch_size:
        changes["train.batch_size"] = plan.batch_size
    rules = plan.caption_rules()
    if rules is not None:  # per subset (KohyaDataset.caption_settings)
        if any(s for s, _ in rules) and not d.caption_shuffle:
            changes["data.caption_shuffle"] = True
        notes = [f"{s.name}: " + (f"tags shuffled, first {k} kept" if sh else "as written")
                 for s, (sh, k) in zip(plan.subsets, rules)]
        out = replace_cfg(cfg, changes) if changes else cfg
        return out, [f"{k}={v} (from the dataset TOML)" for k, v in changes.items()] + \
            ["captions per subset (the dataset TOML): " + "; ".join(notes)]
    for key, ours in (("shuffle_caption", "caption_shuffle"), ("keep_tokens", "keep_tokens")):
        vals = {getattr(s, key) for s in plan.subsets if getattr(s, key) is not None}
        if vals and next(iter(vals)) != getattr(d, ours):
            changes[f"data.{ours}"] = next(iter(vals))
    if not changes:
        return cfg, []
    return replace_cfg(cfg, changes), [f"{k}={v} (from the dataset TOML)"
                                       for k, v in changes.items()]


def epoch_lines(data: Any, batch_size: int) -> list[str]:
    """What the run understood of a kohya dataset: images x repeats per subset, the epoch's
    samples and steps."""
    if not isinstance(data, KohyaDataset):
        return []
    out = [f"dataset: {data.plan.source}"]
    for s, (n, samples) in zip(data.plan.subsets, data.counts):
        kind = "regularization" if s.is_reg else "instance"
        rep = f"x {s.num_repeats} repeats" if samples == n * s.num_repeats else \
            f"balanced to {samples} samples (kohya's rule: as many as the instance samples)"
        out.append(f"  {kind} subset {s.name}: {n} images {rep} = {samples} samples"
                   + (f", class tokens {s.class_tokens!r}" if s.class_tokens else "")
                   + (f", loss weight {data.prior_loss_weight:g} (data.prior_loss_weight)"
                      if s.is_reg else ""))
    n = data.epoch_length
    out.append(f"  epoch: {n} samples = {math.ceil(n / batch_size)} steps of batch "
               f"{batch_size}")
    return out
