"""Numbered adapter files: one LoRA (hypernetwork) file per saved step, as kohya writes one
per epoch (``name-000004.safetensors``), so a user picks the best step rather than only
the last.

Beside the latest files (``RUN/lora/pytorch_lora_weights.safetensors`` and
``RUN/lora/<run>.safetensors``, which every save replaces) each save leaves byte copies
named by its step::

    RUN/lora/<run>-step00001000.safetensors                    kohya / A1111 / ComfyUI
    RUN/lora/pytorch_lora_weights-step00001000.safetensors     diffusers:
        pipe.load_lora_weights("RUN/lora", weight_name="pytorch_lora_weights-step00001000.safetensors")
    RUN/hypernetwork/<run>-step00001000.safetensors            A1111 hypernetwork

Their keep policy is their own (``adapter.keep_files``: the newest N steps, None: all),
independent of ``train.keep_checkpoints``; the step evaluation found best
(``RUN/<folder>/best.json``) is never removed. This module owns the names: the writers
(model.py, hypernetwork.py) and ``steadydiff export --step`` call it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterable

__all__ = ["numbered_name", "numbered_step", "publish", "prune", "mark_best", "best_step",
           "numbered_files", "BEST_FILE"]

BEST_FILE = "best.json"
_NUMBERED = re.compile(r"^(?P<stem>.+)-step(?P<step>\d{8,})\.safetensors$")


def numbered_name(stem: str, step: int) -> str:
    """``<stem>-step00001000.safetensors`` (8 digits, like the checkpoints' ``step_00001000``)."""
    return f"{stem}-step{int(step):08d}.safetensors"


def numbered_step(name: str, stem: str | None = None) -> int | None:
    """The step of a numbered file's name (of ``stem``'s, when given), else None."""
    m = _NUMBERED.match(Path(name).name)
    if m is None or (stem is not None and m.group("stem") != stem):
        return None
    return int(m.group("step"))


def numbered_files(folder: Path, stems: Iterable[str]) -> dict[int, list[Path]]:
    """The numbered files of ``stems`` in ``folder``, by step (ascending)."""
    stems = set(stems)
    out: dict[int, list[Path]] = {}
    if not folder.is_dir():
        return out
    for p in sorted(folder.glob("*-step*.safetensors")):
        m = _NUMBERED.match(p.name)
        if m is not None and m.group("stem") in stems:
            out.setdefault(int(m.group("step")), []).append(p)
    return dict(sorted(out.items()))


def _copy_atomic(src: Path, dst: Path) -> None:
    fd, tmp = tempfile.mkstemp(dir=dst.parent, prefix=f".{dst.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f, open(src, "rb") as s:
            shutil.copyfileobj(s, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, dst)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def publish(files: dict[Path, str], folder: Path, step: int, *,
            overwrite: bool = True) -> tuple[list[Path], list[Path]]:
    """Copy each written file (``{file: stem}``) to ``folder/<stem>-stepNNNNNNNN.safetensors``,
    atomically. ``overwrite=False`` (``steadydiff export --step``) leaves a file already
    there as it is.

    Returns:
        ``(written, left)``: the numbered files written, and those already there and kept.
    """
    folder.mkdir(parents=True, exist_ok=True)
    written, left = [], []
    for src, stem in files.items():
        dst = folder / numbered_name(stem, step)
        if dst.exists() and not overwrite:
            left.append(dst)
            continue
        _copy_atomic(src, dst)
        written.append(dst)
    return written, left


def best_step(folder: Path) -> int | None:
    """The step ``folder/best.json`` marks as evaluation's best, else None."""
    try:
        return int(json.loads((folder / BEST_FILE).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def mark_best(folder: Path, step: int, files: list[Path], info: dict[str, Any]) -> Path:
    """Write ``folder/best.json``: the best evaluation's step, its numbered files and the
    evaluation (``info``: metric and value), atomically."""
    path = folder / BEST_FILE
    body = {"step": int(step), "files": [p.name for p in files], **info}
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{BEST_FILE}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(body, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
    return path


def prune(folder: Path, stems: Iterable[str], keep: int | None) -> list[Path]:
    """Remove the numbered files of ``stems`` in ``folder`` beyond the newest ``keep``
    steps (None: keep all), never the best step's. Only names this module writes are
    touched. Returns the files removed."""
    if keep is None:
        return []
    by_step = numbered_files(folder, stems)
    protect = best_step(folder)
    gone: list[Path] = []
    for s in list(by_step)[:-keep] if keep < len(by_step) else []:
        if s == protect:
            continue
        for p in by_step[s]:
            p.unlink(missing_ok=True)
            gone.append(p)
    return gone
