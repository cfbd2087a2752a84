"""Conditioning images made from the training images themselves (``steadydiff condition``),
with OpenCV and no network weights.

* ``canny``: Canny edges (Canny 1986) with the double (hysteresis) thresholds ``low`` <
  ``high`` on the gradient magnitude: a pixel above ``high`` is an edge, one between the two
  is an edge when connected to one; ``aperture`` is the Sobel kernel (3, 5, 7), ``l2`` the
  exact gradient magnitude, ``blur`` an optional Gaussian blur (odd kernel side) first. The
  thresholds decide how much structure the control carries: a blurry photo's edges at
  100/200 can be too few to hold its layout (the map is then mostly black), so look at a
  few maps before training. ControlNet's own Canny model was trained on random thresholds
  (Zhang et al. 2023, §4); 100/200 is the usual default of its tools.
* ``gray``: the luminance (ITU-R BT.601, OpenCV's ``COLOR_RGB2GRAY``), for a recolouring
  ControlNet.
* ``tile``: the image shrunk by ``factor`` (area averaging) and enlarged back (bicubic), the
  blurred input of a detail ("tile") ControlNet.

Each map is written as a PNG (lossless) under the same relative path as its image, in a
folder (``DATA/conditioning`` by default: the layout ``data.conditioning=folder`` reads),
with ``conditioning.json`` recording the kind, the parameters, the OpenCV version and the
files written; a run trained on the folder records it (state.json, the run header). An
existing file is never replaced, except with ``force`` one this command wrote before (as
its conditioning.json lists); each file is written atomically.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageOps

from steadydiff.data import _BAD_IMAGE_ERRORS, DataError, ImageFolderDataset
from steadydiff.data.pairs import RECIPE_FILE
from steadydiff.kinds import CONDITION_KINDS, ConditionKind

__all__ = ["DEFAULTS", "ConditionReport", "make", "make_conditioning"]

# Each kind's parameters and their defaults (the CLI's options, the recipe's keys).
DEFAULTS: dict[ConditionKind, dict[str, Any]] = {
    "canny": {"low": 100, "high": 200, "aperture": 3, "l2": False, "blur": 0},
    "gray": {},
    "tile": {"factor": 8},
}


def _cv2():
    try:
        import cv2
    except ImportError:  # the [sd] extra installs it
        raise DataError("steadydiff condition needs OpenCV: pip install "
                        "opencv-python-headless (the [sd] extra)") from None
    return cv2


def check_params(kind: ConditionKind, params: dict[str, Any]) -> dict[str, Any]:
    """``params`` over ``kind``'s defaults, checked; unknown keys and bad values raise a
    DataError naming the parameter and what is valid."""
    if kind not in CONDITION_KINDS:
        raise DataError(f"conditioning kind {kind!r} is unknown; valid: "
                        f"{', '.join(CONDITION_KINDS)}")
    out = dict(DEFAULTS[kind])
    for k, v in params.items():
        if v is None:
            continue
        if k not in out:
            raise DataError(f"--{k} does not apply to --kind {kind} (its parameters: "
                            f"{', '.join(out) or 'none'})")
        out[k] = v
    if kind == "canny":
        lo, hi = out["low"], out["high"]
        if not 0 <= lo < hi <= 1000:
            raise DataError(f"canny thresholds: need 0 <= --low < --high <= 1000 (gradient "
                            f"magnitudes of 8-bit images), got --low {lo} --high {hi}")
        if out["aperture"] not in (3, 5, 7):
            raise DataError(f"--aperture (the Sobel kernel side) must be 3, 5 or 7, got "
                            f"{out['aperture']}")
        if out["blur"] < 0 or (out["blur"] and out["blur"] % 2 == 0):
            raise DataError(f"--blur (the Gaussian kernel side) must be 0 (none) or odd, got "
                            f"{out['blur']}")
    if kind == "tile" and not 2 <= out["factor"] <= 64:
        raise DataError(f"--factor (how much the tile map is shrunk) must be in 2..64, got "
                        f"{out['factor']}")
    return out


def make(kind: ConditionKind, rgb: np.ndarray, params: dict[str, Any]) -> np.ndarray:
    """The conditioning map of one image.

    Args:
        kind: canny, gray or tile.
        rgb: (H, W, 3) uint8.
        params: :func:`check_params`'s.

    Returns:
        (H, W) uint8 (canny: 0 or 255; gray) or (H, W, 3) uint8 (tile).
    """
    cv2 = _cv2()
    if kind == "canny":
        g = cv2.cvtColor(rgb, cv2.COLOR_RGB2GRAY)
        if params["blur"]:
            g = cv2.GaussianBlur(g, (params["blur"],) * 2, 0)
        return cv2.Canny(g, float(params["low"]), float(params["high"]),
                         apertureSize=int(params["aperture"]), L2gradient=bool(params["l2"]))
    if kind == "gray":
        return cv2.cvtColor(rgb, cv2.COLOR_RGB2GRAY)
    h, w = rgb.shape[:2]
    f = int(params["factor"])
    small = cv2.resize(rgb, (max(1, w // f), max(1, h // f)), interpolation=cv2.INTER_AREA)
    return cv2.resize(small, (w, h), interpolation=cv2.INTER_CUBIC)


@dataclass
class ConditionReport:
    """What :func:`make_conditioning` did: ``written`` files, ``skipped`` unreadable images
    ``{path: reason}``, the ``recipe`` (conditioning.json's content) and ``seconds``."""

    out: Path
    written: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    recipe: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _png(a: np.ndarray) -> bytes:
    import io

    buf = io.BytesIO()
    Image.fromarray(a).save(buf, format="PNG")
    return buf.getvalue()


def make_conditioning(root: str | os.PathLike[str], out: str | os.PathLike[str] | None,
                      kind: ConditionKind, params: dict[str, Any] | None = None, *,
                      force: bool = False,
                      say: Callable[[str], None] = lambda s: None) -> ConditionReport:
    """Write the conditioning map of every image under ``root`` into ``out``.

    Args:
        root: the image folder (recursively; hidden files and ``out`` itself skipped).
        out: the output folder (None: ``root/conditioning``); each map goes to the image's
            relative path with the extension ``.png``.
        kind, params: see :func:`make` and :data:`DEFAULTS`.
        force: replace the maps an earlier run of this command wrote there (its
            conditioning.json lists them); nothing else is ever replaced.
        say: progress lines.

    Raises:
        DataError: a bad parameter, no images, an output file that already exists (listing
            the first few), or two images that would write one map (``a.jpg`` and
            ``a.png``).
    """
    t0 = time.perf_counter()
    root = Path(root)
    out = Path(out) if out is not None else root / "conditioning"
    p = check_params(kind, params or {})
    folder = ImageFolderDataset(root, 8, 3, exclude=[out])  # paths and header checks only
    rels = [os.path.relpath(x, root) for x in folder.paths]
    targets = [os.path.splitext(r)[0] + ".png" for r in rels]
    seen: dict[str, str] = {}
    for r, t in zip(rels, targets):
        if t in seen:
            raise DataError(f"{root / seen[t]} and {root / r} would both write "
                            f"{out / t}: rename one of them")
        seen[t] = r
    ours: set[str] = set()
    old = out / RECIPE_FILE
    if old.exists():
        try:
            prev = json.loads(old.read_text())
            if prev.get("made_by") != "steadydiff condition":
                raise ValueError("not ours")
            ours = set(prev.get("files", []))
        except (OSError, ValueError, AttributeError):
            raise DataError(f"{old} exists and was not written by `steadydiff condition`: "
                            f"nothing was written; choose another --out") from None
    exist = [t for t in targets if (out / t).exists() and not (force and t in ours)]
    if exist:
        more = f" (and {len(exist) - 5} more)" if len(exist) > 5 else ""
        mine = [t for t in exist if t in ours]
        raise DataError(f"{len(exist)} conditioning files already exist in {out}: "
                        f"{', '.join(exist[:5])}{more}; nothing was written. Choose another "
                        f"--out" + (", or --force to replace the ones an earlier `steadydiff "
                                    "condition` wrote" if mine else
                                    " (--force replaces only files this command wrote)"))
    rep = ConditionReport(out)
    rep.skipped.update(folder.bad_paths)
    cv2 = _cv2()
    last = time.perf_counter()
    for n, (src, t) in enumerate(zip(folder.paths, targets), 1):
        try:
            with Image.open(src) as im:
                im.load()
                rgb = np.asarray(ImageOps.exif_transpose(im).convert("RGB"), dtype=np.uint8)
        except _BAD_IMAGE_ERRORS as e:
            rep.skipped[str(src)] = f"{type(e).__name__}: {e}"
            continue
        dst = out / t
        dst.parent.mkdir(parents=True, exist_ok=True)
        _write_atomic(dst, _png(make(kind, rgb, p)))
        rep.written.append(t)
        if time.perf_counter() - last >= 10:
            last = time.perf_counter()
            say(f"condition: {n}/{len(targets)}")
    rep.recipe = {"kind": kind, "params": p, "opencv": cv2.__version__,
                  "source": str(root), "made_by": "steadydiff condition",
                  "skipped": rep.skipped, "files": sorted(set(rep.written) | (ours if force
                                                                              else set()))}
    out.mkdir(parents=True, exist_ok=True)
    _write_atomic(old, json.dumps(rep.recipe, indent=1).encode())
    rep.seconds = time.perf_counter() - t0
    return rep
