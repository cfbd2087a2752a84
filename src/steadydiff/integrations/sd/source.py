"""Where a model comes from: a diffusers folder (folder.py) or a single-file checkpoint with a
local config folder (single_file.py). The one place that tells them apart: the folder of
configs (:func:`model_root`), its family (:func:`family`), the loaded parts
(:func:`load_parts`) and the config the family's recipe decides (:func:`resolve_config`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...config import Config, replace
from ..families import Family, Parts
from ..families.base import Setting
from .folder import SDFolderError, check_folder, family_of, load_folder_parts
from .single_file import check_single_file, is_single_file, load_single_file

__all__ = ["family", "load_parts", "model_root", "resolve_config"]


def model_root(m: Any) -> Path:
    """The folder holding the configs of ``model.pretrained`` (a ``ModelConfig``): the
    folder itself, or ``model.single_file_config`` for a single-file checkpoint (both
    checked)."""
    if is_single_file(m.pretrained):
        return check_single_file(m.pretrained, m.single_file_config)[1]
    if m.single_file_config:
        raise SDFolderError(f"model.single_file_config is set but model.pretrained="
                            f"{m.pretrained} is not a single-file checkpoint: remove it")
    return check_folder(m.pretrained)


def family(m: Any) -> Family:
    """The model family of ``model.pretrained`` (a ``ModelConfig``), from its folder's (or
    its single file's config folder's) model_index.json."""
    return family_of(model_root(m))


def resolve_config(cfg: Config) -> tuple[Config, list[str]]:
    """``cfg`` with the training recipe of ``model.pretrained``'s family (``Family.recipe``:
    the scheduler's diffusion settings, which always apply; the family's trainers'
    defaults, which apply to the keys the user did not set), and a note for each value
    that changed (printed at start; the saved config holds the resolved values). A
    zero-terminal-SNR rescale the user asked for (``diffusion.zero_terminal_snr: true``)
    is kept: it is a fine-tuning choice (Lin et al. 2024), not a property of the folder."""
    if not cfg.model.pretrained:
        return cfg, []
    root = model_root(cfg.model)
    fam = family_of(root)
    recipe = fam.recipe(root)
    if cfg.diffusion.zero_terminal_snr and "diffusion.zero_terminal_snr" in recipe:
        recipe["diffusion.zero_terminal_snr"] = Setting(True, "diffusion.zero_terminal_snr")
    changes, notes = {}, []
    for key, s in recipe.items():
        *sections, name = key.split(".")
        node = cfg
        for sec in sections:
            node = getattr(node, sec)
        old = getattr(node, name)
        if s.default and name in node.model_fields_set:
            continue  # the user's own choice over the trainers' default
        if old != s.value:
            changes[key] = s.value
            notes.append(f"{key}={s.value} (from {s.source}; was {old})")
    cfg = replace(cfg, changes) if changes else cfg
    values = []
    for key in recipe:
        node = cfg
        for part in key.split("."):
            node = getattr(node, part)
        values.append(f"{key}={node}")
    notes.append(f"{fam.label} recipe: " + ", ".join(values + fam.describe(root, cfg.model)))
    return cfg, notes


def load_parts(path: str | Path, config: str | Path | None = None, *,
               denoiser: bool = True) -> Parts:
    """Every part of the model folder at ``path`` (checked first), or of the single-file
    checkpoint ``path`` with the config folder ``config``, fp32 on the CPU; the caller
    moves them and sets their dtypes. ``root`` is the folder or the file. ``denoiser``
    false (a folder): all but the denoiser."""
    if is_single_file(path):
        return load_single_file(path, config)
    return load_folder_parts(path, denoiser=denoiser)
