"""The model-family table: every family steadydiff fine-tunes, listed once, and the one place
that tells which family a folder, a single file or a module belongs to.

Each family is a module of this package holding one :class:`~.base.Family` (its folder
layout, encoders and their packing, latent preparation, denoiser call, recipe, LoRA names,
single-file layout, tiny folder). Adding a family is adding its module and its row here;
nothing else asks for a family by name (docs/sd.md, "Model families").

No diffusers/transformers import here or in the family modules' top level: the dry run and
the CLI read the table for free.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from .base import Family, Layout, Parts, SDFolderError, TextEncoder, read_json
from .flux import Flux
from .sd import SD
from .sd3 import SD3
from .sdxl import SDXL
from .zimage import ZImage

__all__ = ["FAMILIES", "Family", "Layout", "Parts", "SDFolderError", "TextEncoder", "get",
           "names", "of_index", "of_folder", "of_module", "read_json", "expected"]

#: The table: one instance per family (order: what error messages list).
FAMILIES: tuple[Family, ...] = (SD(), SDXL(), SD3(), Flux(), ZImage())


def names() -> tuple[str, ...]:
    return tuple(f.name for f in FAMILIES)


def get(name: str) -> Family:
    """The family called ``name``.

    Raises:
        KeyError: no such family (the message lists them).
    """
    for f in FAMILIES:
        if f.name == name:
            return f
    raise KeyError(f"no model family {name!r}; valid: {', '.join(names())}")


def expected() -> str:
    """The pipelines a folder may be, for error messages."""
    return ", ".join(f"{f.pipelines[0]} ({f.label})" for f in FAMILIES)


def of_index(index: dict[str, Any], where: Path | str) -> Family:
    """The family of a folder whose model_index.json is ``index`` (its ``_class_name``).

    Raises:
        SDFolderError: a pipeline no family has (the message lists the ones that are).
    """
    cls = index.get("_class_name")
    for f in FAMILIES:
        if cls in f.pipelines:
            return f
    raise SDFolderError(f"{where}/model_index.json: _class_name is {cls!r}; expected one of "
                        f"{expected()}")


def of_folder(root: str | Path) -> Family | None:
    """The family of the diffusers folder ``root`` from its model_index.json, or None when
    it has none or names no family (the folder is not otherwise checked)."""
    p = Path(root).expanduser() / "model_index.json"
    if not p.is_file():
        return None
    cls = read_json(p, "the pipeline's index").get("_class_name")
    return next((f for f in FAMILIES if cls in f.pipelines), None)


def of_module(module: nn.Module) -> Family:
    """The family whose denoiser ``module`` is (a bare UNet or transformer: LoRA files
    name its layers as that family's trainers do).

    Raises:
        ValueError: no family has such a denoiser.
    """
    for f in FAMILIES:
        if f.owns(module):
            return f
    raise ValueError(f"{type(module).__name__} is no model family's denoiser (families: "
                     f"{', '.join(names())})")
