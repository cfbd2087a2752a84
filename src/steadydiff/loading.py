"""A trained model from a checkpoint, ready for sampling: :func:`load` and :class:`Pipeline`.

The one place that turns a checkpoint into a model: the config it records, the model it
describes, the weights (EMA or raw; base + adapter for an adapter checkpoint). ``steadydiff
sample``, ``steadydiff eval``, ``steadydiff doctor`` and the Python API all load through it.
A sharded (FSDP) checkpoint is consolidated in this one process on the way.

It also owns the *exported model* file (``steadydiff export RUN --out model.safetensors``,
:func:`export_model`): one safetensors file of the model's weights (EMA by default), whose
metadata holds ``format`` (:data:`EXPORT_FORMAT`), the run's ``config`` (JSON), ``step`` and
``weights`` (ema | raw); :func:`load` reads it like a checkpoint.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import seeding
from .adapters import build_adapted, set_scale
from .config import Config, validate
from .devices import resolve_device
from .diffusion import AnySchedule, make_schedule, sample as run_sampler
from .diffusion.samplers import USES_ETA
from .kinds import OBJECTIVE_SAMPLERS, AdapterKind, SamplerName
from .models import build_model
from .trainer import checkpoint as ckpt


def checkpoint_config(c: ckpt.Checkpoint) -> Config:
    """The validated config a checkpoint records."""
    return validate(c.state["config"], source=f"{c.path}/state.json config")


def build_from_checkpoint(c: ckpt.Checkpoint, cfg: Config, *, use_ema: bool = True,
                          base: str | Path | None = None) -> nn.Module:
    """The model checkpoint ``c`` holds (fp32, on the CPU, in eval mode, frozen).

    Args:
        c: a loaded checkpoint.
        cfg: its config (:func:`checkpoint_config`).
        use_ema: the EMA weights (default) or the raw ones.
        base: an adapter checkpoint's base weights, when they moved since training.

    Raises:
        CheckpointError: the weights do not fit the model the config describes.
    """
    if cfg.model.pretrained or cfg.model.text_encoder:  # text-to-image (docs/sd.md)
        from .integrations.sd import setup as sd_setup  # the [sd] extra
        from .integrations.sd.identity import with_base

        return sd_setup.load_trained(c, with_base(cfg, base), use_ema=use_ema)[0]
    if cfg.adapter.kind != "none":  # base weights + adapter (docs/adapters.md)
        return build_adapted(c, cfg, use_ema=use_ema, base=base)
    model = build_model(cfg.model, image_size=cfg.data.image_size, channels=cfg.data.channels)
    try:
        model.load_state_dict(c.ema if use_ema else c.model)
    except RuntimeError as e:
        raise ckpt.CheckpointError(f"{c.path}: weights do not match the model its config "
                                   f"describes: {e}") from None
    return model.eval().requires_grad_(False)


def sampling_checkpoint(path: str | Path) -> Path:
    """The checkpoint to sample from: ``path`` itself when it is a checkpoint; for a run
    directory its post-hoc EMA choice (``checkpoints/posthoc_best``, written by ``steadydiff
    ema --sweep``) when that is intact and not older than the newest intact checkpoint
    (training went on after the sweep: the newest wins), else the newest intact checkpoint."""
    p = Path(path)
    newest = ckpt.resolve_checkpoint(p)
    best = p / "checkpoints" / "posthoc_best"
    if newest.parent != p / "checkpoints" or not (best / "manifest.json").is_file():
        return newest
    if ckpt.verify_checkpoint(best):
        return newest  # damaged: resolve_checkpoint's rule, skip it
    step = json.loads((best / "manifest.json").read_text()).get("step", -1)
    return best if step >= (ckpt.step_of(newest) or 0) else newest


class NonFiniteSamples(ValueError):
    """Sampling produced NaN/Inf samples (exit code 2): the message says how many."""


@dataclass
class Pipeline:
    """A trained model ready for sampling (returned by :func:`load`)."""

    model: nn.Module
    schedule: AnySchedule
    config: Config
    device: torch.device
    checkpoint: Path
    step: int
    adapter: AdapterKind | None = None  # "lora" / "hypernetwork" for an adapter checkpoint
    nonfinite: list[str] = field(default_factory=list)  # with allow_nonfinite only
    media: Any = None  # a text-to-image model's TextToImage (prompts, latents <-> images)

    @property
    def num_classes(self) -> int:
        return self.model.num_classes

    def set_adapter_scale(self, scale: float) -> None:
        """Apply the adapter at ``scale``: 0 is the base model, 1 the trained adapter."""
        if self.adapter is None:
            raise ValueError(f"{self.checkpoint} holds no adapter; --adapter-scale applies "
                             "to adapter checkpoints only")
        set_scale(self.model, scale)

    @torch.no_grad()
    def sample(self, num: int | None = None, *, sampler: SamplerName | None = None,
               steps: int | None = None, class_label: int | None = None,
               labels: torch.Tensor | None = None, cfg_scale: float | None = None,
               eta: float | None = None, seed: int | None = None,
               allow_nonfinite: bool = False, prompt: str | list[str] | None = None,
               negative_prompt: str | None = None,
               noise: torch.Tensor | None = None,
               control_image: str | Path | torch.Tensor | None = None,
               control_scale: float | None = None, control_start: float | None = None,
               control_end: float | None = None, width: int | None = None,
               height: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draw ``num`` samples. Defaults come from the config's ``sample`` section.

        For a class-conditional model, ``class_label`` fixes the class; otherwise the labels
        cycle through all classes (or are taken from ``labels``). Options the model or the
        sampler would ignore are refused: a class label or ``cfg_scale`` for an
        unconditional model, ``eta`` for a sampler other than those in ``USES_ETA``.

        A text-conditioned model takes ``prompt`` (one for all samples, or one per sample;
        default: the config's ``sample.prompts``, cycled) and ``negative_prompt`` (what
        guidance steers away from; default ``sample.negative_prompt``); a latent model's
        samples are decoded by its VAE.

        Args:
            allow_nonfinite: return NaN/Inf samples (to count them: ``steadydiff eval``)
                instead of raising :class:`NonFiniteSamples`.
            noise: the starting noise (N, C, H, W) in the model's space instead of a draw
                from ``seed`` (to compare with another pipeline on the same latents).
            control_image: a ControlNet run: the conditioning image, a file (resized to
                ``data.image_size``, as diffusers' image processor: Lanczos, [0, 1]) or a
                (N or 1, C, H, W) tensor in [0, 1]; required for such a run.
            control_scale, control_start, control_end: its scale and the fraction of the
                steps it acts on (diffusers' ``controlnet_conditioning_scale``,
                ``control_guidance_start``/``end``; default: the ``controlnet`` section).
            width, height: a text-to-image model's image size in pixels (each a multiple
                of the VAE's x the denoiser's downsampling; default: the model's native
                side, a ControlNet run's data.image_size).

        Returns:
            ``(x, y)``: x (N, C, H, W) float32 in [-1, 1] on the CPU, and the labels used
            (None for unconditional models).

        Raises:
            ValueError: an option this model or sampler does not use, or out of range.
            NonFiniteSamples: some samples are NaN/Inf (unless ``allow_nonfinite``).
        """
        s = self.config.sample
        num = num or s.num
        sampler = sampler or s.sampler
        obj = self.config.diffusion.objective
        if sampler not in OBJECTIVE_SAMPLERS[obj]:
            raise ValueError(f"--sampler {sampler} does not apply to this model's diffusion."
                             f"objective={obj}; valid: {', '.join(OBJECTIVE_SAMPLERS[obj])}")
        if eta is not None and sampler not in USES_ETA:
            raise ValueError(f"eta (--eta) is used by the {', '.join(USES_ETA)} sampler only; "
                             f"{sampler} ignores it: drop it, or choose --sampler "
                             f"{' or '.join(USES_ETA)}")
        if self.media is not None:
            if class_label is not None or labels is not None:
                raise ValueError("this model is conditioned on text, not class labels: give "
                                 "a prompt (--prompt) instead of --class-label")
            control = self._control(control_image, control_scale, control_start,
                                    control_end, sampler, steps)
            with control:
                return self._sample_text(num, sampler, steps, prompt, negative_prompt,
                                         cfg_scale, eta, seed, allow_nonfinite, noise,
                                         (width, height))
        if width is not None or height is not None:
            raise ValueError("--width/--height size a text-to-image model's samples; this "
                             f"model draws {self.model.image_size} px squares: drop them")
        if control_image is not None:
            raise ValueError("--control-image needs a ControlNet run (controlnet.enabled)")
        if prompt is not None or negative_prompt is not None:
            raise ValueError("this model is not conditioned on text; --prompt and "
                             "--negative-prompt need a text-to-image checkpoint")
        if cfg_scale is not None and not self.num_classes:
            raise ValueError("this model is unconditional (model.num_classes=0); classifier-"
                             "free guidance (--cfg-scale) needs a class-conditional model")
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
                        sampler=sampler, steps=steps or s.steps, y=y,
                        cfg_scale=s.cfg_scale if cfg_scale is None else cfg_scale,
                        eta=s.eta if eta is None else eta, generator=gen, device=self.device)
        x = x.float().cpu()
        self._check_finite(x, allow_nonfinite, sampler, s.cfg_scale if cfg_scale is None
                           else cfg_scale)
        return x, (y.cpu() if y is not None else None)

    def _control(self, image, scale, start, end, sampler, steps):
        """The ControlNet's sampling context for :meth:`sample` (a no-op for other runs)."""
        import contextlib

        given = [v for v in (scale, start, end) if v is not None]
        if not hasattr(self.model, "control"):
            if image is not None or given:
                raise ValueError(f"{self.checkpoint} is not a ControlNet run: --control-image, "
                                 "--control-scale, --control-start and --control-end need one")
            return contextlib.nullcontext()
        if image is None:
            raise ValueError(f"{self.checkpoint} is a ControlNet run: give its conditioning "
                             "image (--control-image FILE)")
        c = self.config.controlnet
        scale = c.scale if scale is None else scale
        start = c.start if start is None else start
        end = c.end if end is None else end
        if not 0 <= start < end <= 1 or scale < 0:
            raise ValueError(f"control start {start} / end {end} must satisfy 0 <= start < "
                             f"end <= 1, and the scale ({scale}) be >= 0")
        if not isinstance(image, torch.Tensor):
            from .integrations.controlnet import load_control_image

            side = self.config.data.image_size
            image = load_control_image(image, side, side, c.conditioning_channels)
        from .diffusion.samplers import sampling_timesteps

        ts = sampling_timesteps(self.schedule, steps or self.config.sample.steps)
        return self.model.control(image.to(self.device), scale, start, end, ts)

    def load_lora(self, path: str | Path, scale: float = 1.0) -> None:
        """Apply a LoRA file (diffusers or kohya/A1111 format, through diffusers' own loader)
        to a Stable Diffusion run's base UNet (and text encoders) at ``scale``: LoRA and
        ControlNet together at sampling.

        Raises:
            ValueError: not a text-to-image run, or a file diffusers cannot load (named).
        """
        if self.media is None or not self.config.model.pretrained:
            raise ValueError("--lora applies to a Stable Diffusion run (model.pretrained)")
        from .integrations.sd.setup import apply_lora

        apply_lora(self.model, self.media, path, scale)

    @staticmethod
    def _check_finite(x: torch.Tensor, allow: bool, sampler: str, cfg_scale: float) -> None:
        # the output is checked, not trusted: NaN/Inf survive the final clamp
        bad = int((~torch.isfinite(x.reshape(x.shape[0], -1)).all(1)).sum())
        if bad and not allow:
            raise NonFiniteSamples(
                f"{bad} of {x.shape[0]} samples are non-finite (NaN/Inf); nothing was written. "
                f"Sampler {sampler}, cfg_scale {cfg_scale}: check the guidance "
                "scale, or the model with `steadydiff doctor`")

    def _sample_text(self, num, sampler, steps, prompt, negative_prompt, cfg_scale, eta, seed,
                     allow_nonfinite, noise, size=(None, None)) -> tuple[torch.Tensor, None]:
        s, media, m = self.config.sample, self.media, self.model
        prompts = [prompt] if isinstance(prompt, str) else \
            list(prompt or [p.prompt for p in s.prompts])
        if not prompts:
            raise ValueError("a text-to-image model needs a prompt (--prompt), or "
                             "sample.prompts in its config")
        if noise is not None:
            num = noise.shape[0]
        num = num or (len(prompts) if prompt is not None and not isinstance(prompt, str)
                      else s.num)
        y = media.encode_prompts([prompts[i % len(prompts)] for i in range(num)])
        neg = s.negative_prompt if negative_prompt is None else negative_prompt
        uncond = media.encode_prompts([neg] * num) if neg else None
        scale = s.cfg_scale if cfg_scale is None else cfg_scale
        gen = seeding.generator(self.device, s.seed if seed is None else seed)
        down = media.down if media.latent else 1
        side = self.config.data.image_size // down if hasattr(m, "control") else m.image_size
        h, w = (self._pixels(v, what, down) if v is not None else side
                for v, what in ((size[1], "--height"), (size[0], "--width")))
        z = run_sampler(m, self.schedule, self.config.diffusion.prediction,
                        (num, m.in_channels, h, w), sampler=sampler,
                        steps=steps or s.steps, y=y, cfg_scale=scale,
                        eta=s.eta if eta is None else eta, generator=gen, device=self.device,
                        uncond=uncond, clip_x0=not media.latent, x=noise)
        x = media.decode(z).float().cpu()
        self._check_finite(x, allow_nonfinite, sampler, scale)
        return x, None


    def _pixels(self, v: int, what: str, down: int) -> int:
        """A requested side in pixels as the latent side (checked: a multiple of what the
        VAE and the denoiser downsample by)."""
        m = self.model
        step = m.size_multiple() if hasattr(m, "size_multiple") else down
        if hasattr(m, "control"):
            raise ValueError(f"{what}: a ControlNet run samples at data.image_size "
                             f"({self.config.data.image_size} px), its control image's size")
        if v < step or v % step:
            near = max(step, round(v / step) * step)
            raise ValueError(f"{what} {v} must be a positive multiple of {step} (the VAE's x "
                             f"the denoiser's downsampling): e.g. {near}")
        return v // down


def load(checkpoint: str | Path, *, device: str | torch.device | None = None,
         use_ema: bool = True, adapter_scale: float | None = None,
         base: str | Path | None = None, allow_nonfinite: bool = False) -> Pipeline:
    """Load a trained model for sampling.

    Args:
        checkpoint: a checkpoint directory, or a run directory (its newest intact
            checkpoint is used; corrupt ones are reported and skipped).
        device: where to put the model: ``auto``/None (CUDA if available, else the CPU),
            ``cpu``, ``cuda``, ``cuda:N``, ``mps`` (:func:`~steadydiff.devices.resolve_device`;
            an unknown or absent device is a ``DeviceError``).
        use_ema: load the EMA weights (default) instead of the raw model weights.
        adapter_scale: an adapter checkpoint's adapter is applied at this scale (default
            1; 0 gives the base model). Refused for checkpoints without an adapter.
        base: an adapter checkpoint's base weights, or a Stable Diffusion run's base model
            (``model.pretrained``), when they moved since training (their sha256 must match
            the one the checkpoint records: integrations/sd/identity.py).
        allow_nonfinite: load weights holding NaN/Inf (a diverged model, to look at what it
            produces; ``Pipeline.nonfinite`` names them) instead of refusing them.

    Returns:
        A :class:`Pipeline` with the model in eval mode.
    """
    dev = resolve_device(device, what="device")  # before any file: a missing GPU is not a bad file
    if Path(checkpoint).suffix == ".safetensors" and Path(checkpoint).is_file():
        return _load_exported(Path(checkpoint), dev, use_ema, adapter_scale)
    path = sampling_checkpoint(checkpoint)
    c = ckpt.load_checkpoint(path, dev, weights_only=True, allow_nonfinite=allow_nonfinite)
    cfg = checkpoint_config(c)
    media = None
    if cfg.model.pretrained or cfg.model.text_encoder:  # text-to-image (docs/sd.md)
        from .integrations.sd import setup as sd_setup  # the [sd] extra
        from .integrations.sd.identity import with_base

        cfg = with_base(cfg, base)  # --base: the moved original (its identity is checked)
        model, media = sd_setup.load_trained(c, cfg, use_ema=use_ema, device=dev)
    else:
        model = build_from_checkpoint(c, cfg, use_ema=use_ema, base=base).to(dev)
    schedule = make_schedule(cfg.diffusion, cfg.data.image_size)
    pipe = Pipeline(model, schedule, cfg, dev, path, c.step,
                    adapter=None if cfg.adapter.kind == "none" else cfg.adapter.kind,
                    nonfinite=c.nonfinite, media=media)
    if adapter_scale is not None:
        pipe.set_adapter_scale(adapter_scale)
    return pipe


# --------------------------------------------------------------------------- exported model

EXPORT_FORMAT = "steadydiff.model.v1"  # an exported model file's metadata "format"


def export_model(source: str | Path, out: str | Path, *, use_ema: bool = True,
                 dtype: torch.dtype | None = None, force: bool = False) -> Path:
    """``steadydiff export RUN --out model.safetensors``: the model of a run or checkpoint
    (any layout, a sharded FSDP one consolidated here) as one safetensors file for
    inference, with the config in its metadata; :func:`load` reads it.

    Args:
        source: a run directory or checkpoint of steadydiff's own UNet/DiT.
        out: the ``.safetensors`` file to write, atomically; an existing one only with
            ``force`` (never a directory, the source, or a file inside it).
        use_ema: the EMA weights (default) or the raw ones.
        dtype: cast the floating-point tensors (torch.float16/bfloat16 halve the file).

    Raises:
        ValueError: ``out`` is not a .safetensors path, or the run is one whose export is
            another format (Stable Diffusion: ``--single-file``; an adapter: ``steadydiff
            merge`` first).
        CheckpointError: no intact checkpoint, or non-finite weights (nothing written).
    """
    from .files import check_output

    out = Path(out).expanduser()
    if out.suffix.lower() != ".safetensors":
        raise ValueError(f"--out must end in .safetensors, got {out}")
    check_output(out, force=force, inputs=[source])
    path = sampling_checkpoint(source)
    c = ckpt.load_checkpoint(path, "cpu", weights_only=True)
    cfg = checkpoint_config(c)
    if cfg.model.pretrained or cfg.model.text_encoder:
        raise ValueError(f"{path} is a text-to-image run: export a Stable Diffusion fine-tune "
                         "with --single-file OUT.safetensors (its LoRA is RUN/lora/)")
    if cfg.adapter.kind != "none":
        raise ValueError(f"{path} is a {cfg.adapter.kind} run: bake the adapter in with "
                         "`steadydiff merge` first, then export the merged run")
    weights = c.ema if use_ema else c.model
    build_from_checkpoint(c, cfg, use_ema=use_ema)  # the weights fit the model: or say why
    if dtype is not None:
        weights = {k: v.to(dtype) if v.is_floating_point() else v for k, v in weights.items()}
    meta = {"format": EXPORT_FORMAT, "config": json.dumps(cfg.to_dict()),
            "step": str(c.step), "weights": "ema" if use_ema else "raw",
            "source": str(path)}
    return ckpt.save_tensors_atomic(out, weights, metadata=meta)


def _load_exported(path: Path, dev: torch.device, use_ema: bool,
                   adapter_scale: float | None) -> Pipeline:
    from safetensors import safe_open
    from safetensors.torch import load_file

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except Exception as e:  # not a safetensors file at all
        raise ckpt.CheckpointError(f"{path}: not a readable .safetensors file ({e})") from None
    if meta.get("format") != EXPORT_FORMAT:
        raise ckpt.CheckpointError(
            f"{path} is not a model exported by `steadydiff export RUN --out` (its metadata "
            f"has no format {EXPORT_FORMAT!r}); load a run directory or checkpoint instead")
    if not use_ema and meta.get("weights") == "ema":
        raise ValueError(f"{path} holds the EMA weights only (exported without "
                         "--raw-weights): drop use_ema=False / --raw-weights")
    if adapter_scale is not None:
        raise ValueError(f"{path} holds no adapter; --adapter-scale applies to adapter "
                         "checkpoints only")
    if "config" not in meta:
        raise ckpt.CheckpointError(
            f"{path} has steadydiff's export format but no 'config' in its metadata, so the "
            "model it holds cannot be built; export it again with `steadydiff export RUN "
            "--out FILE`")
    try:
        cfg = validate(json.loads(meta["config"]), source=f"{path} metadata config")
    except json.JSONDecodeError as e:
        raise ckpt.CheckpointError(f"{path}: its metadata config is not JSON ({e})") from None
    model = build_model(cfg.model, image_size=cfg.data.image_size, channels=cfg.data.channels)
    weights = {k: v.float() if v.is_floating_point() else v
               for k, v in load_file(str(path)).items()}
    bad = ckpt.nonfinite_tensors(weights)
    if bad:
        raise ckpt.CheckpointError(f"{path}: {ckpt.nonfinite_message(bad)}")
    try:
        model.load_state_dict(weights)
    except RuntimeError as e:
        raise ckpt.CheckpointError(f"{path}: weights do not match the model its config "
                                   f"describes: {e}") from None
    model = model.eval().requires_grad_(False).to(dev)
    return Pipeline(model, make_schedule(cfg.diffusion, cfg.data.image_size), cfg, dev, path,
                    int(meta.get("step", 0)))
