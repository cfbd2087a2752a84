"""The public Python API: ``steadydiff.train`` and ``steadydiff.load``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import seeding
from .config import Config, ConfigError, load_config, validate
from .diffusion import Schedule, make_schedule, sample as run_sampler
from .kinds import AdapterKind, SamplerName
from .models import build_model
from .trainer import checkpoint as ckpt
from .trainer.loop import RunResult, resolve_device, run


def _as_config(config: Config | dict[str, Any] | str | Path) -> Config:
    if isinstance(config, Config):
        return config
    if isinstance(config, dict):
        return validate(config)
    if isinstance(config, (str, Path)):
        return load_config(config)
    raise ConfigError(f"config must be a Config, a dict or a YAML path, got {type(config).__name__}")


def train(config: Config | dict[str, Any] | str | Path,
          dataset: torch.utils.data.Dataset | None = None, *,
          out_dir: str | Path = "runs/train", resume: bool | str | Path = True,
          allow_config_change: bool = False) -> RunResult:
    """Train a diffusion model.

    Args:
        config: a resolved :class:`Config`, a dict of sections, or a YAML path.
        dataset: optional torch Dataset yielding images (C, H, W) in [-1, 1], or
            (image, label) pairs; replaces the config's data source.
        out_dir: the run directory. Rerunning with the same directory resumes.
        resume: True (resume if a checkpoint exists), a checkpoint path, or False.
        allow_config_change: accept config changes on resume that break exactness.

    Returns:
        A :class:`RunResult` (run directory, final step and loss, checkpoint, sample grids).
    """
    return run(_as_config(config), run_dir=out_dir, dataset=dataset, resume=resume,
               allow_config_change=allow_config_change)


@dataclass
class Pipeline:
    """A trained model ready for sampling (returned by :func:`load`)."""

    model: nn.Module
    schedule: Schedule
    config: Config
    device: torch.device
    checkpoint: Path
    step: int
    adapter: AdapterKind | None = None  # "lora" / "hypernetwork" for an adapter checkpoint

    @property
    def num_classes(self) -> int:
        return self.model.num_classes

    def set_adapter_scale(self, scale: float) -> None:
        """Apply the adapter at ``scale``: 0 is the base model, 1 the trained adapter."""
        if self.adapter is None:
            raise ValueError(f"{self.checkpoint} holds no adapter; --adapter-scale applies "
                             "to adapter checkpoints only")
        from .adapters import set_scale
        set_scale(self.model, scale)

    @torch.no_grad()
    def sample(self, num: int | None = None, *, sampler: SamplerName | None = None,
               steps: int | None = None, class_label: int | None = None,
               labels: torch.Tensor | None = None, cfg_scale: float | None = None,
               eta: float | None = None, seed: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draw ``num`` samples. Defaults come from the config's ``sample`` section.

        For a class-conditional model, ``class_label`` fixes the class; otherwise the labels
        cycle through all classes (or are taken from ``labels``).

        Returns:
            ``(x, y)``: x (N, C, H, W) float32 in [-1, 1] on the CPU, and the labels used
            (None for unconditional models).
        """
        s = self.config.sample
        num = num or s.num
        y = None
        if self.num_classes:
            if labels is not None:
                y = labels.to(self.device).long()
            elif class_label is not None:
                if not 0 <= class_label < self.num_classes:
                    raise ValueError(f"class_label must be in [0, {self.num_classes - 1}], "
                                     f"got {class_label}")
                y = torch.full((num,), class_label, device=self.device, dtype=torch.long)
            else:
                y = torch.arange(num, device=self.device) % self.num_classes
        elif class_label is not None or labels is not None:
            raise ValueError("this model is unconditional (model.num_classes=0); "
                             "it takes no class label")
        m = self.model
        gen = seeding.generator(self.device, s.seed if seed is None else seed)
        x = run_sampler(m, self.schedule, self.config.diffusion.prediction,
                        (num, m.in_channels, m.image_size, m.image_size),
                        sampler=sampler or s.sampler, steps=steps or s.steps, y=y,
                        cfg_scale=s.cfg_scale if cfg_scale is None else cfg_scale,
                        eta=s.eta if eta is None else eta, generator=gen, device=self.device)
        return x.float().cpu(), (y.cpu() if y is not None else None)


def load(checkpoint: str | Path, *, device: str | torch.device | None = None,
         use_ema: bool = True, adapter_scale: float | None = None,
         base: str | Path | None = None) -> Pipeline:
    """Load a trained model for sampling.

    Args:
        checkpoint: a checkpoint directory, or a run directory (its newest intact
            checkpoint is used; corrupt ones are reported and skipped).
        device: where to put the model (default: CUDA if available, else CPU).
        use_ema: load the EMA weights (default) instead of the raw model weights.
        adapter_scale: an adapter checkpoint's adapter is applied at this scale (default
            1; 0 gives the base model). Refused for checkpoints without an adapter.
        base: an adapter checkpoint's base weights, when they moved since training (their
            sha256 must match the one the checkpoint records).

    Returns:
        A :class:`Pipeline` with the model in eval mode.
    """
    path = ckpt.resolve_checkpoint(checkpoint)
    dev = torch.device(device) if device is not None else resolve_device("auto")
    c = ckpt.load_checkpoint(path, dev, weights_only=True)
    cfg = validate(c.state["config"], source=f"{path}/state.json config")
    if cfg.adapter.kind != "none":  # base weights + adapter (docs/adapters.md)
        from .adapters import build_adapted
        model = build_adapted(c, cfg, use_ema=use_ema, base=base)
    else:
        model = build_model(cfg.model, image_size=cfg.data.image_size,
                            channels=cfg.data.channels)
        try:
            model.load_state_dict(c.ema if use_ema else c.model)
        except RuntimeError as e:
            raise ckpt.CheckpointError(f"{path}: weights do not match the model its config "
                                       f"describes: {e}") from None
    model.to(dev).eval().requires_grad_(False)
    pipe = Pipeline(model, make_schedule(cfg.diffusion), cfg, dev, path, c.step,
                    adapter=None if cfg.adapter.kind == "none" else cfg.adapter.kind)
    if adapter_scale is not None:
        pipe.set_adapter_scale(adapter_scale)
    return pipe
