"""Progressive resolution: continue a run at a larger ``data.image_size`` (issue 19).

``steadydiff train CONFIG --set data.image_size=32 --grow-resolution`` resumes a run whose
checkpoint was trained at a smaller size and goes on at the new one. What carries over and
what restarts (docs/resolution.md):

- **Weights and EMA** carry over unchanged: the model is built at the new size and the
  checkpoint's tensors load into it. Nothing in either model has a shape that depends on the
  image size: the UNet is convolutional (its attention blocks act on any number of tokens),
  and the DiT's patch embedding and blocks act per token; the DiT's only size-dependent
  tensor, the 2-D sin-cos position code, is a non-persistent buffer recomputed for the new
  patch grid when the model is built (:func:`~steadydiff.models.dit.sincos_pos_embed_2d`).
- **UNet attention stays at the same depths.** ``model.unet.attention_resolutions`` names
  feature-map sizes; growing 16 -> 32 doubles every level's size, so the same sizes would
  name other levels (whose attention weights do not exist). Left as the checkpoint had it,
  the list is rescaled by depth ([4] -> [8] for 16 -> 32), and the resolved config says so;
  a list that puts attention at other levels is refused. The cost: attention at a level
  now sees 4x the tokens (16x the attention matrix).
- **Optimizer state** carries over (the parameter shapes are the same); so do the LR
  schedule, the data position, the RNG and the guard's budgets, LR cap and quarantine.
- **What restarts:** the guard's per-timestep loss statistics, grad-norm statistics,
  input-range statistics, divergence and trend windows warm up again (the loss scale changes
  with resolution: a per-pixel MSE at 32 px is not comparable with 16 px), the snapshot ring
  starts from the grown state, and evaluation's best value (an FD at another resolution is
  another scale). The change is an incident row (``resolution_change``) in incidents.jsonl.
- **Checkpoints** record the size they were trained at (``image_size``) and every change
  (``resolution_history``: ``[{step, from, to}]``) in state.json.

The noise-schedule shift for the larger size is ``diffusion.resolution_shift_base``
(:func:`~steadydiff.diffusion.schedules.resolution_shift`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..config import Config, ConfigError, replace, validate

__all__ = ["GROW_KEYS", "Growth", "apply_growth", "grow_config", "grow_from_checkpoint",
           "valid_sizes"]

# The fields --grow-resolution accepts changing on resume (everything else still follows
# check_resume_config's rules): the size itself, the attention list that follows it, the
# schedule shift and the Fashion-MNIST framing that go with a new size.
GROW_KEYS = ("data.image_size", "model.unet.attention_resolutions",
             "diffusion.resolution_shift_base", "data.pad_to")


@dataclass(frozen=True)
class Growth:
    """One resolution change: from ``old`` to ``new`` pixels per side at ``step``."""

    old: int
    new: int
    step: int

    def row(self) -> dict[str, int]:
        return {"step": self.step, "from": self.old, "to": self.new}


def valid_sizes(cfg: Config, above: int, count: int = 4) -> list[int]:
    """The next ``count`` image sizes above ``above`` that ``cfg``'s model can be built at
    (a multiple of the DiT patch, or of the UNet's 2**(levels-1))."""
    m = cfg.model
    step = m.dit.patch_size if m.kind == "dit" else 2 ** (len(m.unet.channel_mult) - 1)
    first = (above // step + 1) * step
    return [first + i * step for i in range(count)]


def _attention_depths(sizes: tuple[int, ...], image_size: int, levels: int) -> set[int]:
    per_level = [image_size // 2**i for i in range(levels)]
    return {i for i, s in enumerate(per_level) if s in sizes}


def grow_config(saved: Config, cfg: Config, origin: int | None = None
                ) -> tuple[Config, list[str]]:
    """The config to continue ``saved``'s run with at ``cfg.data.image_size``.

    Args:
        saved: the checkpoint's config (trained at ``saved.data.image_size``).
        cfg: the new config (the same run, at a larger or the same ``data.image_size``).
        origin: the size the run started at (the first ``from`` of the checkpoint's
            ``resolution_history``; default: the checkpoint's size). A UNet attention list
            written for it, as the run's own config file has it, is read by depth.

    Returns:
        ``(cfg, notes)``: ``cfg`` with a UNet's ``attention_resolutions`` rescaled to the
        same depths when it was written for the checkpoint's or the run's first size;
        ``notes`` says what changed. At the checkpoint's own size this is a plain resume
        (rerunning the grow command after the change continues the grown run).

    Raises:
        ConfigError: a smaller size, an adapter run, a size the model cannot be built at,
            or attention at other depths; the message names what would be valid.
    """
    old, new = saved.data.image_size, cfg.data.image_size
    origin = origin or old
    if new == old and (cfg.model.kind != "unet" or cfg.model.unet.attention_resolutions
                       == saved.model.unet.attention_resolutions):
        return cfg, []
    if new < old:
        raise ConfigError(
            f"--grow-resolution: data.image_size {new} is smaller than the checkpoint's {old}; "
            f"a run only grows (valid: a size above {old}, e.g. "
            f"{', '.join(map(str, valid_sizes(cfg, old, 3)))}); to train at {new}, start a "
            "new run (--out elsewhere)")
    if saved.adapter.kind != "none" or cfg.adapter.kind != "none":
        raise ConfigError(
            f"--grow-resolution: an adapter run (adapter.kind={cfg.adapter.kind}) trains over "
            f"a frozen base built at data.image_size={old}; its size cannot change. Grow the "
            "base run instead, then train the adapter on the grown base")
    if cfg.model.kind != saved.model.kind:
        raise ConfigError(
            f"--grow-resolution keeps the model: model.kind {saved.model.kind} -> "
            f"{cfg.model.kind} is a different model, whose weights cannot carry over")
    m, notes = cfg.model, []
    if m.kind == "dit":
        p = m.dit.patch_size
        if new % p:
            raise ConfigError(
                f"--grow-resolution: data.image_size {new} is not a multiple of the DiT's "
                f"model.dit.patch_size {p} (the patch grid must be whole); valid sizes above "
                f"{old}: {', '.join(map(str, valid_sizes(cfg, old)))}")
        notes.append(f"DiT patch grid {old // p}x{old // p} -> {new // p}x{new // p}: the "
                     "sin-cos position code is recomputed for it")
        return cfg, notes
    levels = len(m.unet.channel_mult)
    factor = 2 ** (levels - 1)
    if new % factor:
        raise ConfigError(
            f"--grow-resolution: data.image_size {new} is not divisible by {factor} = "
            f"2**{levels - 1} (the UNet's down-samplings, model.unet.channel_mult has {levels} "
            f"levels); valid sizes above {old}: {', '.join(map(str, valid_sizes(cfg, old)))}")
    was = _attention_depths(saved.model.unet.attention_resolutions, old, levels)
    keep = tuple(sorted((new // 2**i for i in was), reverse=True))
    asked = m.unet.attention_resolutions
    as_written = {old, origin}  # the list as the checkpoint's, or the run's first, config has it
    if asked != keep and any(set(asked) <= set(size // 2**i for i in range(levels))
                             and _attention_depths(asked, size, levels) == was
                             for size in as_written):
        cfg = replace(cfg, {"model.unet.attention_resolutions": list(keep)}, "--grow-resolution")
        notes.append(f"model.unet.attention_resolutions {list(asked)} -> {list(keep)}: attention "
                     f"stays at the same depths (levels {sorted(was)}) at {new} px")
    elif _attention_depths(asked, new, levels) != was \
            or not set(asked) <= {new // 2**i for i in range(levels)}:
        raise ConfigError(
            f"--grow-resolution: model.unet.attention_resolutions={list(asked)} puts attention "
            f"at other levels than the checkpoint's {list(saved.model.unet.attention_resolutions)}"
            f" at {old} px (levels {sorted(was)}), so its attention weights cannot carry over; "
            f"use {list(keep)} (the same levels at {new} px), or leave the field as it was")
    return cfg, notes


def grow_from_checkpoint(cfg: Config, source: Path) -> tuple[Config, list[str]]:
    """:func:`grow_config` against the checkpoint at ``source`` (its state.json: the config
    and the run's resolution history); the trainer and ``--dry-run`` both call it."""
    state = json.loads((Path(source) / "state.json").read_text())
    saved = validate(state["config"], f"{source}/state.json config")
    history = state.get("resolution_history") or []
    return grow_config(saved, cfg, history[0]["from"] if history else None)


def apply_growth(state, growth: Growth, say: Callable[[str], None] = print) -> None:
    """Carry out a resolution change on a resumed ``state`` (built at the new size, the
    checkpoint's weights, EMA and optimizer already loaded, the guard attached): record it,
    restart the guard's statistics and snapshot ring (an incident row) and evaluation's
    best value."""
    state.resolution_history.append(growth.row())
    cfg = state.cfg
    shift = cfg.diffusion.resolution_shift_base
    if state.guard is not None:
        state.guard.resolution_changed(
            growth.old, growth.new, model=cfg.model.kind, resolution_shift_base=shift)
    # an FD at another resolution is on another scale: the next evaluation is the new best
    state.evaluator.load_state_dict({"best": None, "best_step": None, "bad": 0})
    say(f"grow resolution: {growth.old}x{growth.old} -> {growth.new}x{growth.new} at step "
        f"{growth.step}; weights, EMA and optimizer state carried over"
        + ("; the guard's statistics restart their warm-up" if state.guard else "")
        + (f"; log-SNR shifted for base {shift}" if shift else ""))
