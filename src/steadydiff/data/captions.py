"""Captions for text-to-image training: read beside the images of a folder, or made from the
class names of the bundled labelled datasets.

Two folder conventions are read, the two the ecosystem's trainers use:

* **.txt beside each image** (kohya sd-scripts): ``cat.png`` is captioned by ``cat.txt`` in
  the same folder (same stem, any image extension). Read as UTF-8; a UTF-8 byte-order mark
  and surrounding whitespace are stripped and line breaks inside become single spaces (kohya
  keeps the first line only; a caption wrapped by an editor would lose its tail there). An
  empty file is the empty caption.
* **metadata.jsonl** (Hugging Face ``datasets`` imagefolder): one JSON object per line with
  ``file_name`` (the image path relative to the folder holding the metadata.jsonl) and
  ``text`` (or ``caption`` when there is no ``text``); other keys are ignored, blank lines
  skipped. As in Hugging Face, a sub-folder may hold its own metadata.jsonl.

``auto`` takes, per image, the .txt beside it when there is one, else its metadata.jsonl
entry. Bad input is a :class:`~steadydiff.data.DataError` naming the file (and line), the
problem and what would be valid; an image with no caption is an error listing the first few
(``missing="error"``) or trains with the empty caption ``""`` (``missing="empty"``, logged).

For a model trained from scratch on digits or Fashion-MNIST, :class:`ClassCaptions` turns each
label into a caption ("a photo of a sneaker"), with the phrasing of item i a pure function of
(seed, i): the same in every run, worker and resume.

Every captioned dataset yields ``(image (C, H, W) float32 in [-1, 1], caption str)`` and has
``num_classes = 0``: the condition is the text, not a class id.
"""

from __future__ import annotations

import json
import logging
import os
import re
import stat
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import Dataset

from steadydiff.data import (
    IMAGE_EXTENSIONS, ClassSubset, DataError, ImageFolderDataset, labels_of,
)
from steadydiff.kinds import CaptionSource, LabelledDataset, MissingCaption
from steadydiff.seeding import derive_seed

if TYPE_CHECKING:
    from steadydiff.config import DataConfig

log = logging.getLogger(__name__)

METADATA_FILE = "metadata.jsonl"
# The keys a metadata.jsonl line may carry its caption under, in order of preference.
TEXT_KEYS: tuple[str, ...] = ("text", "caption")
# Missing or unknown files listed by name in an error message; the rest are counted.
_LIST = 5
# The longest caption accepted, in UTF-8 bytes: CLIP reads 77 tokens and T5 (SD3, FLUX) 256
# or 512, a few hundred to ~2,000 characters of English; 8 KiB leaves room for long tag lists
# and bounds the memory and time of reading and tokenizing a caption (a 10 MB one took 7 GB in
# the overflow check). A longer caption file or metadata entry is a DataError naming it.
CAPTION_MAX_BYTES = 8192

# Domain tag for the phrasing draw (see :func:`derive_seed`); changing it changes every
# class-name run's captions: don't.
_TAG_PHRASING = 0x63617074  # "capt"

# Fashion-MNIST's labels in id order (Xiao et al. 2017, table 1; the dataset's README).
CLASS_NAMES: dict[LabelledDataset, tuple[str, ...]] = {
    "digits": ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight",
               "nine"),
    "fashion_mnist": ("T-shirt/top", "trouser", "pullover", "dress", "coat", "sandal",
                      "shirt", "sneaker", "bag", "ankle boot"),
}

# ``{}`` is the class name; the article before it is fixed per name ("an ankle boot"). The
# first one is the canonical prompt (:func:`prompt_for`), so sampling asks for a caption the
# model saw in training.
PHRASINGS: tuple[str, ...] = ("a photo of a {}", "a {}", "a picture of a {}", "{}",
                              "a black and white photo of a {}")


# --------------------------------------------------------------------------- reading files


def _read_text(path: Path, what: str, root: Path | None = None,
               follow_symlinks: bool = False, limit: int | None = None) -> str:
    """A whole file as UTF-8 (a BOM dropped), read under the data-folder rules images obey.

    * a symlink whose target resolves outside ``root`` is refused (unless
      ``follow_symlinks``), as :class:`~steadydiff.data.ImageFolderDataset` skips such images;
    * only a regular file is read: a FIFO, socket or device (``/dev/zero``) is refused. The
      file is opened non-blocking, so a FIFO with no writer cannot hang the open, and checked
      with ``fstat`` on the open descriptor, so a swap between check and read cannot slip one in;
    * at most ``limit`` bytes are read (a file that is larger, or grows, is refused).

    Unreadable, non-UTF-8, or any of the above is a DataError naming the file.
    """
    if root is not None and not follow_symlinks and os.path.islink(path):
        target = os.path.realpath(path)
        if not _within(target, os.path.realpath(root)):
            raise DataError(f"{path}: the {what} is a symlink to {target}, outside the data "
                            f"folder {str(root)!r}; captions obey the rule images obey: copy "
                            f"the file into the folder, or set data.follow_symlinks=true")
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        raise DataError(f"{path}: cannot read {what} ({e.strerror or e}); check that it is a "
                        f"readable file") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise DataError(f"{path}: the {what} is {_kind(st.st_mode)}, not a regular file; "
                            f"it must be a plain text file")
        if limit is not None and st.st_size > limit:
            raise DataError(f"{path}: the {what} is {st.st_size:,} bytes; captions are limited "
                            f"to {limit:,} bytes (CAPTION_MAX_BYTES; the text encoders read at "
                            f"most a few hundred tokens): shorten it")
        with os.fdopen(os.dup(fd), "rb") as f:  # a regular file: reads end at EOF
            raw = f.read() if limit is None else f.read(limit + 1)
    except OSError as e:
        raise DataError(f"{path}: cannot read {what} ({e.strerror or e}); check that it "
                        f"is a readable file") from None
    finally:
        os.close(fd)
    if limit is not None and len(raw) > limit:
        raise DataError(f"{path}: the {what} grew past {limit:,} bytes while being read; "
                        f"captions are limited to {limit:,} bytes (CAPTION_MAX_BYTES)")
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise DataError(f"{path}: {what} is not valid UTF-8 (byte offset {e.start}, line "
                        f"{line}: {e.reason}, byte 0x{raw[e.start]:02x}); re-save it as "
                        f"UTF-8 (e.g. `iconv -f latin1 -t utf-8`)") from None


def _kind(mode: int) -> str:
    """What a non-regular file is, in words."""
    for test, word in ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISDIR, "a folder")):
        if test(mode):
            return word
    return "not a regular file"


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _check_length(caption: str, where: str) -> str:
    """``caption`` unless its UTF-8 form is longer than :data:`CAPTION_MAX_BYTES`."""
    n = len(caption.encode("utf-8"))
    if n > CAPTION_MAX_BYTES:
        raise DataError(f"{where}: the caption is {n:,} bytes; captions are limited to "
                        f"{CAPTION_MAX_BYTES:,} bytes (CAPTION_MAX_BYTES; the text encoders "
                        f"read at most a few hundred tokens): shorten it")
    return caption


def _clean(text: str) -> str:
    """One caption line: whitespace around stripped, line breaks inside become spaces."""
    return " ".join(s.strip() for s in text.splitlines() if s.strip())


def _norm(rel: str) -> str:
    """A relative path as the key images and metadata entries are matched by."""
    return os.path.normpath(rel).replace(os.sep, "/")


def _rel(path: str | os.PathLike[str], root: Path) -> str:
    """``path`` relative to ``root``; through symlinks when one side is resolved and the
    other is not (a data root that is itself a link)."""
    rel = os.path.relpath(path, root)
    if rel.startswith(".."):
        rel = os.path.relpath(os.path.realpath(path), os.path.realpath(root))
    return _norm(rel)


def _read_metadata(path: Path, folder_rel: str, out: dict[str, tuple[str, str]],
                   root: Path | None = None, follow_symlinks: bool = False) -> None:
    """Add the entries of one metadata.jsonl to ``out``: key (image path relative to the
    data root) -> (caption, "file:line"). The file obeys the data-folder rules
    (:func:`_read_text`), each caption the size limit (:data:`CAPTION_MAX_BYTES`)."""
    text = _read_text(path, "the metadata file", root, follow_symlinks)
    valid = (f"each line must be a JSON object with \"file_name\" (the image path relative to "
             f"{path.parent}) and \"text\" (or \"caption\"), e.g. "
             f"{{\"file_name\": \"cat.png\", \"text\": \"a photo of a cat\"}}")
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: not valid JSON ({e.msg} at column {e.colno}); "
                            f"{valid}") from None
        if not isinstance(obj, dict):
            raise DataError(f"{where}: a JSON {type(obj).__name__}, not an object; {valid}")
        name = obj.get("file_name")
        if name is None:
            raise DataError(f"{where}: no \"file_name\" key (keys: "
                            f"{', '.join(map(repr, obj)) or 'none'}); {valid}")
        if not isinstance(name, str) or not name.strip():
            raise DataError(f"{where}: \"file_name\" is {name!r}; expected the image path as "
                            f"a non-empty string; {valid}")
        key = next((k for k in TEXT_KEYS if k in obj), None)
        if key is None:
            raise DataError(f"{where}: no caption key (keys: {', '.join(map(repr, obj))}); "
                            f"valid caption keys are {' or '.join(map(repr, TEXT_KEYS))}; "
                            f"{valid}")
        caption = obj[key]
        if not isinstance(caption, str):
            raise DataError(f"{where}: \"{key}\" is a JSON {type(caption).__name__} "
                            f"({caption!r:.40}); expected a string (\"\" for no caption)")
        caption = _clean(_check_length(caption, where))
        if os.path.isabs(name):
            raise DataError(f"{where}: \"file_name\" {name!r} is an absolute path; write it "
                            f"relative to {path.parent}")
        img = _norm(os.path.join(folder_rel, name))
        if img in out and out[img][0] != caption:
            raise DataError(f"{where}: {img!r} is captioned {caption!r:.60} here but "
                            f"{out[img][0]!r:.60} at {out[img][1]}; keep one entry per image")
        out.setdefault(img, (caption, where))


def metadata_files(root: Path, rels: Sequence[str]) -> list[tuple[str, Path]]:
    """The metadata.jsonl files that may name the images ``rels`` (paths relative to
    ``root``): one in every folder from the root down to each image, as ``(folder relative to
    root, file)``, sorted. (A metadata.jsonl in a folder without images would name only files
    the folder does not use.)"""
    folders = {""}
    for rel in rels:
        parts = rel.split("/")[:-1]
        folders.update("/".join(parts[:k]) for k in range(1, len(parts) + 1))
    # lexists, not is_file: a metadata.jsonl that is a FIFO, a device or a link leading out
    # is refused by name when read (:func:`_read_text`), never silently passed over.
    return [(d, root / d / METADATA_FILE) for d in sorted(folders)
            if os.path.lexists(root / d / METADATA_FILE)
            and not (root / d / METADATA_FILE).is_dir()]


def read_jsonl_lines(path: Path, root: Path | None = None, follow_symlinks: bool = False
                     ) -> Iterator[tuple[str, dict[str, Any]]]:
    """``("file:line", object)`` for each non-blank line of a metadata.jsonl; a line that is
    not a JSON object is a DataError naming the file and line. The file obeys the
    data-folder rules of ``root`` (:func:`_read_text`)."""
    text = _read_text(path, "the metadata file", root, follow_symlinks)
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(obj, dict):
            raise DataError(f"{where}: a JSON {type(obj).__name__}, not an object")
        yield where, obj


def _unknown_entries(root: Path, unknown: list[tuple[str, str]]) -> DataError:
    """The error for metadata entries that name no image of the folder, saying why each
    file might not be there."""
    lines = []
    for img, where in unknown[:_LIST]:
        p = root / img
        if not p.exists():
            why = "no such file (a typo? moved or deleted?)"
        elif p.is_dir():
            why = "a folder, not an image"
        elif not img.lower().endswith(IMAGE_EXTENSIONS):
            why = f"not an image (accepted extensions: {', '.join(IMAGE_EXTENSIONS)})"
        else:
            why = ("not among the folder's images (hidden, behind a symlink leading "
                   "outside the root, or dropped as unreadable)")
        lines.append(f"{where}: {img!r}: {why}")
    more = f" (and {len(unknown) - _LIST} more)" if len(unknown) > _LIST else ""
    return DataError(f"image folder {str(root)!r}: {len(unknown)} metadata entries name no "
                     f"image of the folder{more}:\n  " + "\n  ".join(lines)
                     + f"\nfile_name is relative to the folder holding the {METADATA_FILE}; "
                     f"fix the name or remove the line")


def _read_all(root: str | os.PathLike[str], paths: Sequence[str | os.PathLike[str]],
              source: CaptionSource, missing: MissingCaption,
              skipped: dict[str, str] | None = None, follow_symlinks: bool = False
              ) -> tuple[list[str], list[str | None]]:
    """:func:`read_captions`, plus where each caption came from ("txt", "jsonl" or None)."""
    if source not in ("auto", "txt", "jsonl"):
        raise DataError(f"read_captions: source {source!r} reads no caption files; valid: "
                        f"auto, txt, jsonl (class_names: ClassCaptions; none: no captions)")
    if missing not in ("error", "empty"):
        raise DataError(f"read_captions: missing must be 'error' or 'empty', got {missing!r}")
    root = Path(root)
    rels = [_rel(p, root) for p in paths]
    bad = {_rel(p, root) for p in (skipped or {})}

    meta: dict[str, tuple[str, str]] = {}
    n_meta = 0
    if source != "txt":
        for d, f in metadata_files(root, rels):
            n_meta += 1
            _read_metadata(f, d, meta, root, follow_symlinks)
        used = set(rels)
        # Entries for files the folder dropped as unreadable are no error: the image was
        # already logged and skipped, and one bad file must not stop the run.
        unknown = [(img, w) for img, (_, w) in meta.items() if img not in used and img not in bad]
        if unknown:
            raise _unknown_entries(root, unknown)

    captions: list[str] = []
    origin: list[str | None] = []
    for p, rel in zip(paths, rels):
        if source != "jsonl":
            txt = Path(os.path.splitext(p)[0] + ".txt")
            if txt.exists():  # a folder or unreadable file named NAME.txt is reported
                captions.append(_clean(_read_text(txt, "caption file", root, follow_symlinks,
                                                  CAPTION_MAX_BYTES)))
                origin.append("txt")
                continue
        if rel in meta:
            captions.append(meta[rel][0])
            origin.append("jsonl")
            continue
        captions.append("")
        origin.append(None)

    lost = [rel for rel, o in zip(rels, origin) if o is None]
    if lost and missing == "error":
        first = lost[0]
        fixes = []
        if source != "jsonl":
            fixes.append(f"write NAME.txt beside each image NAME.png "
                         f"(e.g. {os.path.splitext(first)[0]}.txt)")
        if source != "txt":
            line = json.dumps({"file_name": first.rsplit('/', 1)[-1], "text": "..."})
            fixes.append(f"add a line {line} to a {METADATA_FILE} in its folder"
                         + ("" if n_meta else f" (none found under {str(root)!r})"))
        fixes.append("set data.missing_caption=empty to train them with the empty caption")
        more = f" (and {len(lost) - _LIST} more)" if len(lost) > _LIST else ""
        raise DataError(f"image folder {str(root)!r}: {len(lost)} of {len(rels)} images have "
                        f"no caption ({_SOURCE_WORDS[source]}): "
                        f"{', '.join(lost[:_LIST])}{more}; " + ", or ".join(fixes))
    if lost:
        log.warning("image folder %s: %d of %d images have no caption (%s); training them "
                    "with the empty caption (data.missing_caption=empty), e.g. %s",
                    root, len(lost), len(rels), _SOURCE_WORDS[source], lost[0])
    return captions, origin


_SOURCE_WORDS = {"txt": "no .txt beside it", "jsonl": f"no {METADATA_FILE} entry",
                 "auto": f"neither a .txt beside it nor a {METADATA_FILE} entry"}


def read_captions(root: str | os.PathLike[str], paths: Sequence[str | os.PathLike[str]],
                  source: CaptionSource, missing: MissingCaption = "error", *,
                  skipped: dict[str, str] | None = None,
                  follow_symlinks: bool = False) -> list[str]:
    """The caption of each image of a folder, in the order of ``paths``.

    Conventions (see the module docstring):

    * ``txt`` (kohya sd-scripts): ``NAME.txt`` beside ``NAME.png``, UTF-8; BOM and
      surrounding whitespace stripped, line breaks inside turned into spaces; empty file =
      empty caption.
    * ``jsonl`` (Hugging Face imagefolder): ``metadata.jsonl`` lines
      ``{"file_name": "sub/cat.png", "text": "a cat"}`` (``caption`` is accepted when there is
      no ``text``), ``file_name`` relative to the folder holding that metadata.jsonl; the
      root and any folder above an image may hold one. Blank lines are skipped, other keys
      ignored; the same image listed twice must have the same text.
    * ``auto``: per image, the .txt when there is one, else its metadata.jsonl entry. Every
      metadata.jsonl found is still read and checked.

    Args:
        root: the image folder (``ImageFolderDataset.root``).
        paths: the image paths under ``root`` (``ImageFolderDataset.paths``).
        source: ``auto``, ``txt`` or ``jsonl``.
        missing: an image without a caption: ``error`` (a DataError naming the first few) or
            ``empty`` (the caption ``""``, with a warning giving the count).
        skipped: ``{path: reason}`` of images the folder dropped as unreadable
            (``ImageFolderDataset.bad_paths``): metadata entries naming them are ignored
            rather than reported as unknown.
        follow_symlinks: read caption files that are symlinks leading outside ``root``
            (``data.follow_symlinks``, as for images); otherwise they are an error.

    Caption files obey the rules images obey: a symlink leading outside ``root`` is refused
    (unless ``follow_symlinks``), only regular files are read (a FIFO or a device such as
    ``/dev/zero`` is refused without being read), and a caption longer than
    :data:`CAPTION_MAX_BYTES` (a .txt file or a metadata.jsonl entry) is refused.

    Returns:
        One caption per path.

    Raises:
        DataError: naming the file (and line) when a metadata.jsonl line is not JSON, not an
            object, lacks ``file_name`` or the text, has a non-string text, names a file that
            is not among the images, or conflicts with another entry for the same image; a
            caption file that is not UTF-8 (with the byte offset) or cannot be read, that is
            not a regular file, leads outside ``root``, or is over the size limit; images
            without a caption under ``missing="error"``.
    """
    return _read_all(root, paths, source, missing, skipped, follow_symlinks)[0]


# --------------------------------------------------------------------------- folder


class CaptionedImageFolder(Dataset):
    """An :class:`~steadydiff.data.ImageFolderDataset` whose items are ``(image, caption)``.

    Captions are read once, at construction (:func:`read_captions`), so a caption problem
    stops the run before the first step. Images are loaded by the folder (its resizing,
    cropping and bad-file handling); when an image fails to load and the folder replaces it
    by the next good one, the caption is the replacement's, never the lost image's.

    Args:
        folder: the image folder.
        source: ``auto``, ``txt`` or ``jsonl`` (:func:`read_captions`).
        missing: ``error`` or ``empty``: what an image without a caption gets.
        index: the folder items to use, in order (a class subset's ``index``); None: all.
            Captions are read for these images only.

    Attributes:
        captions: one caption per item; ``paths``: the image paths; ``num_classes``: 0 (the
            text is the condition); ``channels``, ``image_size``, ``skipped``, ``bad_paths``:
            the folder's.

    Raises:
        DataError: see :func:`read_captions`.
    """

    num_classes: int = 0

    def __init__(self, folder: ImageFolderDataset, source: CaptionSource = "auto",
                 missing: MissingCaption = "error", index: Sequence[int] | None = None) -> None:
        self.folder = folder
        self.source = source
        self.index = list(range(len(folder))) if index is None else [int(j) for j in index]
        if not self.index:
            raise DataError(f"image folder {str(folder.root)!r}: no images selected")
        self.paths: list[Path] = [folder.paths[j] for j in self.index]
        self.captions, self._origin = _read_all(folder.root, self.paths, source, missing,
                                                folder.bad_paths, folder.follow_symlinks)
        # folder index -> our item, to caption a replacement image (which may lie outside a
        # subset: then our own next item is taken instead).
        self._item_of = {j: k for k, j in enumerate(self.index)}

    # Read through to the folder: ``skipped`` and ``bad_paths`` grow as bad files turn up.
    @property
    def channels(self) -> int:
        return self.folder.channels

    @property
    def image_size(self) -> int:
        return self.folder.image_size

    @property
    def skipped(self) -> int:
        return self.folder.skipped

    @property
    def bad_paths(self) -> dict[str, str]:
        return self.folder.bad_paths

    def __len__(self) -> int:
        return len(self.index)

    def path_of(self, i: int) -> Path:
        """The image file of item ``i``."""
        return self.paths[int(i)]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, str]:
        x, caption, _ = self.fetch(i)
        return x, caption

    def fetch(self, i: int) -> tuple[torch.Tensor, str, bool]:
        """Like ``self[i]``, plus whether image ``i`` was bad and replaced (by the next good
        item, with its caption); see ``ImageFolderDataset.fetch``."""
        n = len(self.index)
        i = int(i)
        if not -n <= i < n:
            raise IndexError(f"index {i} out of range for {n} images")
        i %= n
        for k in range(n):  # bounded: the folder raises when every image is bad
            x, j = self.folder.fetch_index(self.index[(i + k) % n])
            got = self._item_of.get(j)
            if got is not None:
                return x, self.captions[got], got != i
        raise DataError(f"image folder {str(self.folder.root)!r}: every selected image failed "
                        f"to load (e.g. {next(iter(self.bad_paths.items()), '?')})")

    def describe(self) -> str:
        """One line for the run log, e.g. ``CaptionedImageFolder data/cats: 12 images
        3×32×32, captions from .txt (10) and metadata.jsonl (2)``."""
        s = self.image_size
        counts = [(n, o) for o, n in ((".txt", self._origin.count("txt")),
                                      (METADATA_FILE, self._origin.count("jsonl"))) if n]
        found = " and ".join(f"{o} ({n})" for n, o in counts) or "nowhere"
        empty = self._origin.count(None)
        out = (f"CaptionedImageFolder {self.folder.root}: {len(self)} images "
               f"{self.channels}×{s}×{s}, captions from {found}")
        out += f", {empty} without (empty caption)" if empty else ""
        out += f" ({self.skipped} files skipped)" if self.skipped else ""
        return out


# --------------------------------------------------------------------------- class names


def _article(name: str) -> str:
    """'an' before a vowel sound: "an ankle boot", "an eight", but "a one", "a unicorn"."""
    w = name.lower()
    return "an" if w[:1] in "aeiou" and not w.startswith(("one", "uni", "use", "eu")) else "a"


def phrase(template: str, name: str) -> str:
    """``template`` with ``name`` in place of ``{}`` and the article before it agreeing:
    ``phrase("a photo of a {}", "ankle boot") == "a photo of an ankle boot"``."""
    art = _article(name)
    t = re.sub(r"\b([aA])n? \{\}", lambda m: ("A" + art[1:] if m.group(1) == "A" else art)
               + " {}", template)
    return t.format(name)


def prompt_for(dataset_name: LabelledDataset, label: int) -> str:
    """The canonical prompt for a class, ``"a photo of a {name}"`` (the first of
    :data:`PHRASINGS`, so it is a caption the model was trained on).

    Raises:
        DataError: a dataset without class names or a label outside its classes.
    """
    names = _names(dataset_name)
    if not 0 <= int(label) < len(names):
        raise DataError(f"{dataset_name}: label {label} is out of range; valid labels are "
                        f"0..{len(names) - 1}")
    return phrase(PHRASINGS[0], names[int(label)])


def _names(dataset_name: str) -> tuple[str, ...]:
    if dataset_name not in CLASS_NAMES:
        raise DataError(f"no class names for dataset {dataset_name!r}; class-name captions "
                        f"exist for {', '.join(CLASS_NAMES)}")
    return CLASS_NAMES[dataset_name]  # type: ignore[index]


def phrasing_ids(seed: int, n: int, k: int) -> np.ndarray:
    """The phrasing of items 0..n-1, each in 0..k-1: a pure function of (seed, item).

    A key from ``derive_seed(tag, seed)`` mixed with the item index by splitmix64 (Steele et
    al. 2014), vectorized: per-item ``derive_seed`` would cost ~35 µs × 60,000 items for
    Fashion-MNIST, a couple of seconds at every start.
    """
    key = np.uint64(derive_seed(_TAG_PHRASING, seed))
    with np.errstate(over="ignore"):
        z = key + (np.arange(n, dtype=np.uint64) + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
    return (z % np.uint64(k)).astype(np.int64)


class ClassCaptions(Dataset):
    """A labelled dataset whose items are ``(image, caption)``, the caption made from the
    label's class name in one of a few phrasings ("a photo of a sneaker", "a sneaker", ...).

    The phrasing of item ``i`` depends only on ``(seed, i)`` (:func:`phrasing_ids`), so it is
    the same in every run with that seed, in every data-loader worker and after a resume;
    the captions are computed from the labels alone, without loading an image.

    Args:
        dataset: items ``(image, label)``, with ``labels`` readable without the images (the
            built-in datasets, a ``ClassSubset`` of them) and ``num_classes``.
        class_names: one name per class id, e.g. ``CLASS_NAMES["fashion_mnist"]``.
        seed: the run seed.
        phrasings: templates with ``{}`` for the name.

    Attributes:
        captions: one per item; ``labels``: the dataset's (kept for per-class evaluation);
        ``num_classes``: 0 (the model is conditioned on the text, not on a class id);
        ``channels``, ``image_size``: the dataset's.

    Raises:
        DataError: no per-item labels, a name count that is not the dataset's class count, a
            label outside the names, or a phrasing without ``{}``.
    """

    num_classes: int = 0

    def __init__(self, dataset: Dataset, class_names: Sequence[str], *, seed: int = 0,
                 phrasings: Sequence[str] = PHRASINGS) -> None:
        labels = labels_of(dataset)
        if labels is None:
            raise DataError(f"class-name captions need per-item labels readable without the "
                            f"images (a `labels` attribute); {type(dataset).__name__} has none")
        k = int(getattr(dataset, "num_classes", 0) or 0)
        if k and k != len(class_names):
            raise DataError(f"{len(class_names)} class names for a dataset of {k} classes; "
                            f"give one name per class id")
        if not phrasings or any("{}" not in t for t in phrasings):
            raise DataError(f"phrasings must be templates with '{{}}' for the class name, got "
                            f"{list(phrasings)!r}")
        lab = labels.to(torch.int64)
        if len(lab) and (int(lab.min()) < 0 or int(lab.max()) >= len(class_names)):
            bad = int(lab[(lab < 0) | (lab >= len(class_names))][0])
            raise DataError(f"label {bad} has no class name; names cover ids "
                            f"0..{len(class_names) - 1}")
        self.dataset = dataset
        self.class_names = tuple(class_names)
        self.phrasings = tuple(phrasings)
        self.seed = seed
        self.labels = labels
        self._table = [[phrase(t, name) for t in self.phrasings] for name in self.class_names]
        self._phrasing = phrasing_ids(seed, len(lab), len(self.phrasings))  # (N,)
        self.captions: list[str] = [self._table[y][p] for y, p in
                                    zip(lab.tolist(), self._phrasing.tolist())]
        self.channels = dataset.channels
        self.image_size = dataset.image_size
        self.skipped = getattr(dataset, "skipped", 0)
        if hasattr(dataset, "fetch"):  # (image, caption, replaced?) as SeededView asks
            self.fetch = self._fetch

    def _fetch(self, i: int) -> tuple[torch.Tensor, str, bool]:
        x, y, bad = self.dataset.fetch(i)
        return x, self.caption_for(int(y), int(self._phrasing[int(i)])), bad

    def caption_for(self, label: int, k: int) -> str:
        """The caption of class ``label`` in phrasing ``k``."""
        return self._table[int(label)][int(k) % len(self.phrasings)]

    def __len__(self) -> int:
        return len(self.captions)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, str]:
        x, y = self.dataset[i]
        # From the label that came with the image: right even if the dataset replaced it.
        return x, self.caption_for(int(y), int(self._phrasing[int(i)]))

    def describe(self) -> str:
        """One line for the run log: the dataset's, plus where the captions come from."""
        inner = getattr(self.dataset, "describe", lambda: type(self.dataset).__name__)()
        return (f"{inner}; captions from {len(self.class_names)} class names in "
                f"{len(self.phrasings)} phrasings (e.g. {self.captions[0]!r}), not "
                f"class-conditional")


# --------------------------------------------------------------------------- per-step variants

# Domain tags for the per-(epoch, item) draws; changing one changes every run's captions.
_TAG_SHUFFLE = 0x73687566  # "shuf"
_TAG_DROP = 0x64726f70  # "drop"


def with_trigger(caption: str, trigger: str | None, separator: str = ",") -> str:
    """``caption`` with ``trigger`` as its first tag: prepended (``"sks, a dog"``), or kept as
    is when the caption already starts with it (as a whole tag), so it is never doubled.
    The empty caption stays empty only when there is no trigger."""
    if not trigger:
        return caption
    tags = split_tags(caption, separator)
    if tags and tags[0] == trigger:
        return caption
    return join_tags([trigger, *tags], separator)


def split_tags(caption: str, separator: str = ",") -> list[str]:
    """The tags of a caption: split at ``separator``, each stripped, empty ones dropped."""
    return [t.strip() for t in caption.split(separator) if t.strip()]


def join_tags(tags: Sequence[str], separator: str = ",") -> str:
    """Tags joined as kohya writes them: the separator, then one space (``"a, b"``)."""
    return (separator.strip() + " " if separator.strip() else separator).join(tags)


class CaptionVariants:
    """The caption an item trains with at an epoch: tag shuffle (kohya's ``shuffle_caption``)
    with the first ``keep_tokens`` tags in place, and caption dropout (the empty caption, the
    null condition of classifier-free guidance; Ho & Salimans 2022).

    Every draw is a pure function of ``(seed, epoch, item)``, the key of the seeded data
    stream (``SeededView``): a resumed run, any worker count and any batch size see the same
    caption at the same step. The trigger word (``data.trigger``) is already in the caption
    (:func:`with_trigger`) and is its first tag: it stays first (it is not counted in
    ``keep_tokens``) and is dropped with the rest.

    Args:
        seed: the run seed.
        shuffle: permute the tags after the first ``keep_tokens`` (and the trigger).
        keep_tokens: tags kept in place (kohya counts comma-separated tags, not tokens).
        separator: the tag separator.
        dropout: probability that an item's caption is the empty one at an epoch.
        trigger: the trigger word, kept first.
        per_source: ``(shuffle, keep_tokens)`` per source item (a kohya TOML whose subsets
            set different ones), read through the ``source`` index each call passes; None:
            ``shuffle``/``keep_tokens`` for every item.
    """

    def __init__(self, seed: int, *, shuffle: bool = False, keep_tokens: int = 0,
                 separator: str = ",", dropout: float = 0.0,
                 trigger: str | None = None,
                 per_source: list[tuple[bool, int]] | None = None) -> None:
        if not 0.0 <= dropout <= 1.0:
            raise ValueError(f"caption dropout must be in [0, 1], got {dropout}")
        if keep_tokens < 0:
            raise ValueError(f"keep_tokens must be >= 0, got {keep_tokens}")
        self.seed, self.shuffle, self.keep_tokens = seed, shuffle, keep_tokens
        self.separator, self.dropout, self.trigger = separator, dropout, trigger
        self.per_source = per_source
        if per_source is not None:  # some items shuffle: captions are tokenized per epoch
            self.shuffle = any(s for s, _ in per_source)

    def dropped(self, i: int, epoch: int) -> bool:
        """Whether item ``i`` trains with the empty caption at ``epoch``."""
        if self.dropout <= 0.0:
            return False
        u = np.random.default_rng(derive_seed(_TAG_DROP, self.seed, epoch, i)).random()
        return bool(u < self.dropout)

    def shuffled(self, caption: str, i: int, epoch: int, source: int | None = None) -> str:
        """``caption``'s tags after the kept ones permuted, by a draw of (seed, epoch, i)
        (``source``: the item's source index, for ``per_source``)."""
        shuffle, keep_tokens = self.shuffle, self.keep_tokens
        if self.per_source is not None and source is not None:
            shuffle, keep_tokens = self.per_source[source]
        if not shuffle:
            return caption
        tags = split_tags(caption, self.separator)
        keep = keep_tokens + (1 if self.trigger and tags[:1] == [self.trigger] else 0)
        if len(tags) - keep < 2:
            return caption
        rng = np.random.default_rng(derive_seed(_TAG_SHUFFLE, self.seed, epoch, i))
        rest = tags[keep:]
        order = rng.permutation(len(rest))
        return join_tags(tags[:keep] + [rest[k] for k in order], self.separator)

    def __call__(self, caption: str, i: int, epoch: int, source: int | None = None) -> str:
        """The caption item ``i`` trains with at ``epoch``: "" when dropped, else shuffled."""
        return "" if self.dropped(i, epoch) else self.shuffled(caption, i, epoch, source)

    @property
    def varies(self) -> bool:
        """Whether the caption changes with the epoch (shuffle or dropout on)."""
        return self.shuffle or self.dropout > 0.0

    @classmethod
    def from_config(cls, cfg: DataConfig, seed: int,
                    per_source: list[tuple[bool, int]] | None = None) -> "CaptionVariants":
        return cls(seed, shuffle=cfg.caption_shuffle, keep_tokens=cfg.keep_tokens,
                   separator=cfg.caption_separator, dropout=cfg.caption_dropout,
                   trigger=cfg.trigger, per_source=per_source)


def token_overflow(captions: Sequence[str], count: Callable[[list[str]], list[int]],
                   limit: int, names: Sequence[str] | None = None) -> list[tuple[str, int]]:
    """The captions longer than ``limit`` tokens: ``[(name, tokens)]`` in item order, one per
    distinct name. ``count`` returns each caption's token count (start/end tokens included,
    as the tokenizer's ``model_max_length`` counts them); ``names`` name the items (their
    files), else the caption's start is the name.

    Bounded: each caption is counted on its first :data:`CAPTION_MAX_BYTES` characters (the
    longest caption read from files; a trigger word adds a few), so no caption, wherever it
    came from, has megabytes tokenized; a longer one is reported with the count of that
    prefix, already far past any encoder's limit."""
    distinct = list(dict.fromkeys(captions))
    n = (dict(zip(distinct, count([c[:CAPTION_MAX_BYTES] for c in distinct])))
         if distinct else {})
    out: list[tuple[str, int]] = []
    seen: set[str] = set()
    for k, c in enumerate(captions):
        if n[c] > limit:
            name = str(names[k]) if names is not None else repr(c[:40])
            if name not in seen:
                seen.add(name)
                out.append((name, n[c]))
    return out


def overflow_message(over: list[tuple[str, int]], limit: int, total: int) -> str:
    """The start-of-run warning for :func:`token_overflow`'s result."""
    shown = ", ".join(f"{name} ({k} tokens)" for name, k in over[:_LIST])
    more = f" and {len(over) - _LIST} more" if len(over) > _LIST else ""
    return (f"{len(over)} of {total} captions are longer than the text encoder's "
            f"{limit} tokens (start/end tokens included) and will be truncated: "
            f"{shown}{more}; shorten them (put what matters first), or use fewer tags")


# --------------------------------------------------------------------------- config


def build_captioned(cfg: DataConfig, data: Dataset, seed: int = 0) -> Dataset:
    """The captioned dataset for the ``data`` section of a config.

    Args:
        cfg: the ``data`` section (``captions``, ``missing_caption``, ``dataset``).
        data: what :func:`~steadydiff.data.build_dataset` returned for it.
        seed: the run seed (the phrasing of class-name captions).

    The trigger word (``data.trigger``) is put first in every caption here
    (:func:`with_trigger`); shuffle and dropout vary per step (:class:`CaptionVariants`,
    applied where the captions are encoded).

    Returns:
        ``data`` unchanged for ``captions=none``; a :class:`ClassCaptions` for
        ``class_names``; a :class:`CaptionedImageFolder` for ``auto``/``txt``/``jsonl`` (over
        the selected classes only when ``data.classes`` made a subset).

    Raises:
        DataError: a caption source the dataset cannot have, or any caption problem
            (:func:`read_captions`).
    """
    source = cfg.captions
    if source == "none":
        return data
    if source == "class_names":
        if cfg.dataset not in CLASS_NAMES:
            raise DataError(f"data.captions=class_names names the classes of "
                            f"{' or '.join(CLASS_NAMES)}; data.dataset={cfg.dataset} has "
                            f"none: use auto, txt or jsonl")
        out = ClassCaptions(data, CLASS_NAMES[cfg.dataset], seed=seed)  # type: ignore[index]
        if cfg.trigger:
            out._table = [[with_trigger(c, cfg.trigger, cfg.caption_separator) for c in row]
                          for row in out._table]
            out.captions = [with_trigger(c, cfg.trigger, cfg.caption_separator)
                            for c in out.captions]
        return out
    index = None
    folder = data
    if isinstance(data, ClassSubset):
        folder, index = data.dataset, data.index
    if not isinstance(folder, ImageFolderDataset):
        raise DataError(f"data.captions={source} reads caption files beside the images of a "
                        f"folder (data.dataset=folder); {type(folder).__name__} has none: use "
                        f"class_names for digits or fashion_mnist")
    out = CaptionedImageFolder(folder, source, cfg.missing_caption, index=index)
    if cfg.trigger:  # static: the text cache keeps working
        out.captions = [with_trigger(c, cfg.trigger, cfg.caption_separator)
                        for c in out.captions]
    return out


__all__ = [
    "CAPTION_MAX_BYTES", "CLASS_NAMES", "METADATA_FILE", "PHRASINGS", "TEXT_KEYS", "CaptionVariants",
    "CaptionedImageFolder", "ClassCaptions", "build_captioned", "join_tags", "metadata_files",
    "overflow_message", "phrase", "phrasing_ids", "prompt_for", "read_captions", "read_jsonl_lines", "split_tags",
    "token_overflow", "with_trigger",
]
