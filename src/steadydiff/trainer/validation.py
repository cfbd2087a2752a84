"""Validation prompts: what a text-to-image run draws every ``train.sample_every`` steps.

``sample.prompts`` lists them, each a string or a mapping {prompt, negative_prompt, seed,
cfg_scale, steps, width, height} whose unset fields come from the ``sample`` section (without
the list: the captions of the first dataset items). Each render draws every prompt from the
EMA weights (``sample.use_ema``), with the adapter of a LoRA run on, and writes

    samples/step_00001234.png            the grid: sample.num cells, the prompts cycled
                                         (one column per prompt when there are at most 16)
    samples/step_00001234/prompts.json   which cell holds which prompt, its settings, finite?
    samples/step_00001234/prompt_00.png  each prompt's own images (the report shows these)

and, with ``logging.tensorboard``, one image per prompt (``validation/prompt_00``).

The noise of a prompt comes from its own generator, seeded from its seed alone
(:func:`steadydiff.seeding.generator`), so a prompt's image is the same at every render
given the same weights, whatever the other prompts are; the global RNGs are forked around a
render, so training is bit-identical with and without validation (tests/test_validation.py).
Prompts that share steps, guidance and size are drawn in one batch when the sampler is
deterministic (its only randomness is the starting noise); ddpm and ddim with eta > 0 draw
per-step noise, so each prompt is then a call of its own, with its own generator.

A render never stops training: a prompt whose image is non-finite, or whose sampling
raised, is named in a warning and in prompts.json, and the run goes on.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .. import hostsync, seeding
from ..config import Config, ConfigError, ValidationPrompt
from ..diffusion import sample
from ..diffusion.samplers import sampling_timesteps
from ..eval.grid import grid_nrow, make_grid, save_grid
from .state import TrainState

log = logging.getLogger(__name__)

MAX_COLUMNS = 16  # up to this many prompts: one grid column per prompt
SIDE_FILE = "prompts.json"


@dataclass(frozen=True)
class Prompt:
    """A validation prompt with every default filled in (``sample.prompts`` entry
    ``index``). ``width``/``height`` are pixels."""

    index: int
    prompt: str
    negative_prompt: str
    seed: int
    cfg_scale: float
    steps: int
    width: int
    height: int


@dataclass
class Rendered:
    """One prompt's result at one render: its images (K, C, H, W) in [-1, 1] on the CPU
    (None when sampling raised), the grid cells it fills, and what went wrong."""

    prompt: Prompt
    cells: list[int]
    images: torch.Tensor | None = None
    finite: bool = True
    error: str | None = None
    file: str | None = None


def resolve(cfg: Config, captions: Sequence[str], model: nn.Module,
            media: Any) -> list[Prompt]:
    """The run's validation prompts, defaults filled from ``cfg.sample``: ``sample.prompts``,
    or else one plain prompt per caption of the first ``sample.num`` items.

    Raises:
        ConfigError: a width/height the model cannot sample (naming the entry's key).
    """
    s, size = cfg.sample, cfg.data.image_size
    entries = list(s.prompts) or [ValidationPrompt(prompt=c) for c in captions[:s.num]]
    out = []
    for i, e in enumerate(entries):
        w, h = e.width or size, e.height or size
        if (w, h) != (size, size):
            _check_size(model, media, i, w, h)
        out.append(Prompt(
            index=i, prompt=e.prompt,
            negative_prompt=s.negative_prompt if e.negative_prompt is None else e.negative_prompt,
            seed=s.seed if e.seed is None else e.seed,
            cfg_scale=s.cfg_scale if e.cfg_scale is None else e.cfg_scale,
            steps=s.steps if e.steps is None else e.steps, width=w, height=h))
    for p in out:
        if p.steps > cfg.diffusion.timesteps:
            raise ConfigError(f"sample.prompts.{p.index}.steps={p.steps}: at most "
                              f"diffusion.timesteps ({cfg.diffusion.timesteps})")
    return out


def _check_size(model: nn.Module, media: Any, i: int, w: int, h: int) -> None:
    """A model family's diffusers denoiser samples any size its down-sampling divides;
    ours do not."""
    multiple = getattr(model, "size_multiple", None)
    if multiple is None:
        raise ConfigError(f"sample.prompts.{i}: width/height {w}x{h} need a pretrained "
                          "model (model.pretrained: a Stable Diffusion UNet or a "
                          "transformer); this model samples at data.image_size only")
    step = multiple()
    down = getattr(media, "down", 1) if getattr(media, "latent", False) else 1
    for k, v in (("width", w), ("height", h)):
        if v % step:
            raise ConfigError(f"sample.prompts.{i}.{k}={v} is not a multiple of {step} (the "
                              f"VAE's x{down} times the {model.family.denoiser_word}'s "
                              f"down-sampling): use {max(step, round(v / step) * step)}")


@contextlib.contextmanager
def sampling_model(state: TrainState) -> Iterator[nn.Module]:
    """The weights grids sample from: the EMA's (``sample.use_ema``), else the raw model in
    eval mode (no dropout; every module's own mode restored after), under the weights'
    sampling context (an fp16/bf16 base's autocast), with the global RNGs forked so the
    training randomness after a render is the one without it."""
    model = state.ema.module if state.cfg.sample.use_ema else state.model
    modes = [(m, m.training) for m in model.modules()]
    devices = [state.device] if state.device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad(), \
                state.weights.sampling_context(state):
            model.eval()
            yield model
    finally:
        for m, training in modes:
            m.train(training)


def layout(prompts: Sequence[Prompt], num: int) -> tuple[list[list[int]], int]:
    """Grid cells per prompt (``max(num, P)`` cells, cell i holds prompt i mod P) and the
    images per row: one column per prompt up to :data:`MAX_COLUMNS` prompts, else square."""
    n, total = len(prompts), max(num, len(prompts))
    cells = [list(range(j, total, n)) for j in range(n)]
    return cells, (n if n <= MAX_COLUMNS else grid_nrow(total))


def _deterministic(state: TrainState) -> bool:
    s = state.cfg.sample
    return s.sampler not in ("ddpm",) and not (s.sampler == "ddim" and s.eta > 0)


def draw(state: TrainState, model: nn.Module, prompts: Sequence[Prompt],
         counts: Sequence[int]) -> list[tuple[torch.Tensor | None, str | None]]:
    """``counts[j]`` images of each prompt j, (K_j, C, H, W) on the CPU in [-1, 1], or
    (None, the error) where its sampling raised. The starting noise of prompt j is drawn
    from a generator seeded from its seed alone."""
    s, media = state.cfg.sample, state.media
    groups: dict[tuple, list[int]] = {}
    for j, p in enumerate(prompts):  # a batch per setting (per prompt: stochastic samplers)
        key = (p.steps, p.cfg_scale, p.height, p.width)
        groups.setdefault(key if _deterministic(state) else (j,), []).append(j)
    out: list[tuple[torch.Tensor | None, str | None]] = [(None, None)] * len(prompts)
    down = media.down if media.latent else 1
    for members in groups.values():
        p0 = prompts[members[0]]
        shape = (model.in_channels, p0.height // down, p0.width // down)
        try:
            gens = [seeding.generator(state.device, prompts[j].seed) for j in members]
            x = torch.cat([torch.randn((counts[j], *shape), generator=g, device=state.device)
                           for j, g in zip(members, gens)])
            texts = [prompts[j].prompt for j in members for _ in range(counts[j])]
            negs = [prompts[j].negative_prompt for j in members for _ in range(counts[j])]
            y = media.encode_prompts(texts)
            uncond = media.encode_prompts(negs) if any(negs) else None
            ts = sampling_timesteps(state.schedule, p0.steps)
            with _control(state, model, members, counts, ts):
                z = sample(model, state.schedule, state.cfg.diffusion.prediction,
                           tuple(x.shape), sampler=s.sampler, steps=p0.steps, y=y,
                           cfg_scale=p0.cfg_scale, eta=s.eta, generator=gens[0],
                           device=state.device, uncond=uncond, clip_x0=not media.latent, x=x,
                           ts=ts)  # latents are not bounded to [-1, 1]
            imgs = media.decode(z).float().cpu()
            for j, part in zip(members, imgs.split([counts[j] for j in members])):
                out[j] = (part, None)
        except Exception as e:  # noqa: BLE001 (a render must never stop training)
            for j in members:
                out[j] = (None, f"{type(e).__name__}: {e}")
    return out


def _control(state: TrainState, model: nn.Module, members: Sequence[int],
             counts: Sequence[int], ts: torch.Tensor):
    """A ControlNet run's control for the prompts ``members`` (each its conditioning image
    ``state.control[j]``, ``counts[j]`` times), at ``controlnet.scale``/``start``/``end``;
    else nothing."""
    if state.control is None or not hasattr(model, "control"):
        return contextlib.nullcontext()
    c = state.cfg.controlnet
    image = torch.stack([state.control[j] for j in members for _ in range(counts[j])])
    return model.control(image, c.scale, c.start, c.end, ts)


def _padded(x: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """(K, C, h0, w0) centred on a black (K, C, h, w) canvas (mixed sizes in one grid)."""
    if x.shape[-2:] == (h, w):
        return x
    out = torch.full((*x.shape[:2], h, w), -1.0)
    t, left = (h - x.shape[-2]) // 2, (w - x.shape[-1]) // 2
    out[..., t:t + x.shape[-2], left:left + x.shape[-1]] = x
    return out


def render(state: TrainState, path: Path, tb: Any = None, write: bool = True) -> Path:
    """Draw every validation prompt (``state.prompts``) and write the grid ``path``, its
    side folder (prompts.json, one PNG per prompt) and, given ``tb`` (the run's
    :class:`~steadydiff.trainer.telemetry.TensorBoard`), one image per prompt. Never
    raises for a failed or non-finite prompt: each is named in a warning and in
    prompts.json. ``write=False`` draws and writes nothing (an FSDP rank other than 0:
    its share of the sharded model's forward passes is what rank 0 draws with). Returns
    ``path``."""
    prompts, s, step = state.prompts, state.cfg.sample, state.step
    if not prompts:
        return path
    cells, nrow = layout(prompts, s.num)
    results = [Rendered(p, c) for p, c in zip(prompts, cells)]
    with sampling_model(state) as model:
        drawn = draw(state, model, prompts, [len(c) for c in cells])
    if not write:
        return path
    for r, (x, err) in zip(results, drawn):
        r.images, r.error = x, err
    # non-finite images: one read for all prompts (counted: the run's only host syncs are
    # meant to be the ones it knows about)
    ok = [r for r in results if r.images is not None]
    if ok:
        flags = hostsync.values(torch.stack([torch.isfinite(r.images).all() for r in ok]))
        for r, f in zip(ok, flags):
            r.finite = bool(f)
    side = path.with_suffix("")  # samples/step_00001234/
    side.mkdir(parents=True, exist_ok=True)
    c = next((r.images.shape[1] for r in ok), state.cfg.data.channels)
    h = max(p.height for p in prompts)
    w = max(p.width for p in prompts)
    canvas = torch.full((sum(len(r.cells) for r in results), c, h, w), -1.0)
    for r in results:
        if r.images is None:
            continue
        canvas[r.cells] = _padded(torch.nan_to_num(r.images, nan=-1.0), h, w)
        r.file = f"prompt_{r.prompt.index:02d}.png"
        save_grid(torch.nan_to_num(r.images, nan=-1.0), side / r.file, nrow=len(r.cells))
        if tb is not None:
            tb.writer.add_image(f"validation/prompt_{r.prompt.index:02d}",
                                make_grid(torch.nan_to_num(r.images, nan=-1.0),
                                          nrow=len(r.cells)), step, dataformats="HWC")
    for r in results:
        if r.error or not r.finite:
            what = r.error or "non-finite (NaN/Inf) image"
            log.warning("validation prompt %d (%r) at step %d: %s; training goes on",
                        r.prompt.index, r.prompt.prompt, step, what)
            if r.error is None:
                r.error = what
    save_grid(canvas, path, nrow=nrow)
    if tb is not None:
        tb.writer.add_text("validation/prompts", "\n\n".join(
            f"{r.prompt.index}: {r.prompt.prompt}" for r in results), step)
    side_file = {
        "step": step, "grid": path.name, "nrow": nrow, "use_ema": s.use_ema,
        "sampler": s.sampler,
        "prompts": [{**asdict(r.prompt), "cells": r.cells, "file": r.file,
                     "finite": r.finite if r.images is not None else None,
                     "error": r.error}
                    for r in results]}
    tmp = side / f".{SIDE_FILE}.tmp"
    tmp.write_text(json.dumps(side_file, indent=1))
    tmp.replace(side / SIDE_FILE)
    return path


def safe_render(state: TrainState, path: Path, tb: Any = None, write: bool = True) -> Path:
    """:func:`render`, and anything it did not foresee (a full disk, a broken writer) a
    warning rather than the end of the run."""
    try:
        return render(state, path, tb, write)
    except Exception as e:  # noqa: BLE001 (a render must never stop training)
        log.warning("validation at step %d failed: %s: %s; training goes on", state.step,
                    type(e).__name__, e)
        return path


def read_side_file(folder: Path) -> dict[str, Any] | None:
    """A render's prompts.json (None: missing or unreadable)."""
    try:
        d = json.loads((folder / SIDE_FILE).read_text())
        return d if isinstance(d, dict) and isinstance(d.get("prompts"), list) else None
    except (OSError, ValueError):
        return None


__all__ = ["Prompt", "resolve", "render", "safe_render", "layout", "draw", "sampling_model",
           "read_side_file", "MAX_COLUMNS", "SIDE_FILE"]

