"""Everything a run checks before its first step, without training: :func:`check`.

``steadydiff train --dry-run`` and the trainer's setup run the same checks, so a config the
dry run approves does not fail the moment training starts: the device is resolved, the
precision checked on it, the data built (its classes, image size and channels compared with
the config) and the model built on the meta device (no memory, no weights) and run through one
forward pass, which catches every shape that cannot work (image size vs. down-samplings or
patch size, group norms, attention heads, attention resolutions that never occur).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset

from .config import Config, ConfigError, replace
from .data import as_pairs, build_dataset, check_labels, labels_of
from .data.buckets import bucket_layout, describe_histogram
from .data.captions import build_captioned
from .data.pairs import build_paired, is_paired
from .durations import format_duration
from .devices import resolve_device
from .diffusion.schedules import flow_seq_len, make_schedule
from .models import build_model
from .trainer.compilation import check_toolchain
from .trainer.optim import check_optimizer
from .trainer.precision import check_precision
from .trainer.speed import resolve_precision


@dataclass
class Preflight:
    """What :func:`check` found: the device, the data and the model a run would use."""

    device: torch.device
    data: Dataset
    num_classes_in_data: int
    parameters: int

    def header(self, cfg: Config, run_dir: str | Path | None = None) -> list[str]:
        """A few lines saying what the run is (the full config is in RUN/config.yaml)."""
        m, t = cfg.model, cfg.train
        arch = (f"unet, channels {m.unet.channels} x {list(m.unet.channel_mult)}"
                if m.kind == "unet" else f"dit-{m.dit.preset}, patch {m.dit.patch_size}")
        cond = f"{m.num_classes} classes" if m.num_classes else "unconditional"
        if m.pretrained:
            how = {"lora": f"LoRA rank {cfg.adapter.rank}",
                   "hypernetwork": f"hypernetwork [1, {cfg.adapter.hidden_mult:g}, 1] "
                                   f"{cfg.adapter.hyper_activation}",
                   "embedding": f"textual inversion {cfg.adapter.token} "
                                f"({cfg.adapter.num_vectors} vector(s)), every weight "
                                "frozen"}.get(cfg.adapter.kind, "full fine-tune")
            from .integrations.sd.source import family  # the family table: no diffusers import

            if cfg.controlnet.enabled:
                fam = family(m)
                how = (f"{fam.controlnet_class} from "
                       + (cfg.controlnet.init_from or f"the {fam.denoiser_word}")
                       + f" ({cfg.controlnet.conditioning_channels}-channel conditioning"
                       + (", VAE-encoded" if fam.controlnet_latent else "")
                       + f"), {fam.denoiser_word} frozen")
            arch, cond = f"{family(m).title} of {m.pretrained}, {how}", "text-conditioned"
        elif m.text_encoder:
            cond = "text-conditioned" + (", latent space" if m.vae else "")
        describe = getattr(self.data, "describe", None)
        data = describe() if describe else f"{len(self.data)} images"  # type: ignore[arg-type]
        lines = []
        if run_dir is not None:
            lines.append(f"run:   {run_dir} (full config: {Path(run_dir) / 'config.yaml'})")
        lines += [f"model: {arch}, {cond}, {self.parameters / 1e6:.2f}M parameters",
                  f"data:  {data}",
                  f"train: {t.steps} steps"
                  + (f" or {format_duration(t.max_time)} of training (train.max_time), "
                     "whichever comes first" if t.max_time is not None else "")
                  + f", batch {t.batch_size}, {t.precision} on "
                  f"{self.device}, guard {'on' if cfg.guard.enabled else 'off'}"
                  + (f", torch.compile ({t.compile_backend}, mode {t.compile_mode}: the "
                     "first step compiles)" if t.compile else "")]
        if cfg.diffusion.objective != "ddpm":
            lines.append(f"diffusion: {describe_objective(cfg)}")
        layout = bucket_layout(self.data)  # data.buckets: the histogram
        if layout is not None:
            lines += describe_histogram(layout, t.batch_size).splitlines()
        return lines


def describe_objective(cfg: Config) -> str:
    """One line naming the objective and the values that shape it (the run header prints
    it for flow and edm; the shift is the resolved one, FLUX's dynamic one included)."""
    d, s = cfg.diffusion, cfg.sample
    if d.objective == "flow":
        sched = make_schedule(d, cfg.data.image_size)
        how = (f"dynamic (FLUX: {flow_seq_len(cfg.data.image_size, d.flow.token_pixels)} "
               "tokens)"
               if d.flow.dynamic_shift else "static")
        return (f"rectified flow (velocity target), sigma ~ {d.timestep_sampling}, shift "
                f"{sched.shift:.3g} {how}, {d.loss_weighting} loss weighting; "
                f"sampler {s.sampler}, {s.steps} steps")
    if d.objective == "edm":
        e = d.edm
        return (f"EDM (Karras et al. 2022), sigma_data {e.sigma_data:g}, ln sigma ~ "
                f"N({e.p_mean:g}, {e.p_std:g}^2); sampler {s.sampler} over the Karras grid "
                f"{e.sigma_max:g} -> {e.sigma_min:g} (rho {e.rho:g}), {s.steps} steps")
    return f"ddpm, {d.schedule} schedule, {d.prediction} prediction"


def check_classes(cfg: Config, num_classes_in_data: int) -> None:
    """The model's classes against the data's.

    Raises:
        ConfigError: the data has more classes than ``model.num_classes``, or none for a
            class-conditional model.
    """
    if cfg.model.num_classes and num_classes_in_data > cfg.model.num_classes:
        raise ConfigError(
            f"the data has {num_classes_in_data} classes but model.num_classes is "
            f"{cfg.model.num_classes}; set model.num_classes={num_classes_in_data}")
    if cfg.model.num_classes and num_classes_in_data == 0:
        raise ConfigError(
            f"model.num_classes={cfg.model.num_classes} (class-conditional) but the data has no "
            "labels; set data.class_labels=true for a folder with one sub-folder per class, "
            "or model.num_classes=0 for an unconditional model")


def check_data(cfg: Config, dataset: Dataset | None = None) -> tuple[Dataset, int]:
    """Build the data a run trains on (``dataset``, else ``cfg.data``'s) and compare it with
    the config: classes and labels, and a user dataset's image size and channels.

    Labels are checked here, all of them, when they can be read without the images (a
    dataset with ``labels``, a ``TensorDataset``); otherwise each item's as it is fetched.

    Returns:
        The data, and its number of classes (declared; for labels read without a declared
        count, the largest label + 1; for (image, label) items without either, the model's).

    Raises:
        DataError: the data cannot be read, holds values outside [-1, 1], or a label that
            is no class id of the model (0..model.num_classes-1; the message names the item).
        ConfigError: classes, image size or channels that do not match the config.
    """
    k = cfg.model.num_classes
    if text_model(cfg):
        return _text_data(cfg, dataset), 0
    data = as_pairs(dataset, k) if dataset is not None else build_dataset(cfg.data)
    declared = int(getattr(data, "num_classes", 0) or 0)
    # our own datasets always declare their classes: 0 means unlabeled (a folder without
    # data.class_labels), whatever placeholder labels its items carry
    if k and not declared and not getattr(data, "labeled", False):
        check_classes(cfg, 0)
    labels = labels_of(data) if k else None
    if labels is None and not declared and k and getattr(data, "labeled", False):
        num_classes = k  # (image, label) items, no count declared: each label is checked
        #                  against the model's classes as its item is fetched
    elif labels is None:
        check_classes(cfg, declared)
        num_classes = declared
    else:
        if declared:  # more classes than the model is the config's to fix, said as such
            check_classes(cfg, declared)
        check_labels(data, k, labels)
        num_classes = declared or int(labels.max()) + 1
    shape = getattr(data, "image_shape", None)  # a user dataset's (C, H, W)
    d = cfg.data
    if shape is not None and tuple(shape) != (d.channels, d.image_size, d.image_size):
        c, h, w = shape
        fix = (f"set data.image_size={h}" if h == w else "use square images")
        raise ConfigError(
            f"the dataset's images are {c}×{h}×{w} (C×H×W) but the config says data.channels="
            f"{d.channels}, data.image_size={d.image_size}; {fix}"
            + (f" and data.channels={c}" if c != d.channels else ""))
    return data, num_classes


def resolve(cfg: Config) -> tuple[Config, list[str]]:
    """``cfg`` with what its model folder decides (a Stable Diffusion folder's scheduler:
    betas, timesteps, prediction type), and a note per value changed; other configs as
    they are. The trainer and the dry run both start here."""
    if not cfg.model.pretrained:
        return cfg, []
    from .integrations.sd.source import resolve_config  # the [sd] extra

    return resolve_config(cfg)


def resolve_data(cfg: Config) -> tuple[Config, list[str]]:
    """``cfg`` with what a kohya dataset TOML (``data.dataset_config``) sets: resolution,
    batch size, caption shuffle and keep_tokens (data/kohya.py), a note per value changed."""
    if not cfg.data.dataset_config:
        return cfg, []
    from .data.kohya import resolve_config

    return resolve_config(cfg)


def resolve_epochs(cfg: Config, data: Dataset) -> tuple[Config, list[str]]:
    """``train.epochs`` as steps over ``data`` (its ``epoch_length``: images x repeats with
    regularization images, else its length): ceil(epochs x samples / batch), replacing
    train.steps; and what the run understood of a kohya dataset (data/kohya.py), as lines
    to print."""
    from .data.kohya import epoch_lines

    lines = epoch_lines(data, cfg.train.batch_size)
    n = int(getattr(data, "epoch_length", 0) or len(data))
    every = cfg.train.checkpoint_every_epochs
    if every is not None:  # kohya's save_every_n_epochs, in steps
        steps_every = max(1, round(every * n / cfg.train.batch_size))
        lines.append(f"train.checkpoint_every_epochs={every}: a checkpoint (and its numbered "
                     f"LoRA files) every {steps_every} steps")
        cfg = replace(cfg, {"train.checkpoint_every": steps_every})
    e = cfg.train.epochs
    if e is None:
        if lines:
            lines.append(f"  train.steps={cfg.train.steps}: "
                         f"{cfg.train.steps * cfg.train.batch_size / n:.2f} epochs")
        return cfg, lines
    steps = -(-e * n // cfg.train.batch_size)
    lines.append(f"train.epochs={e}: {e} x {n} samples / batch {cfg.train.batch_size} = "
                 f"{steps} steps" + (f" (train.steps={cfg.train.steps} replaced)"
                                     if cfg.train.steps != steps else ""))
    return replace(cfg, {"train.steps": steps}), lines


def text_model(cfg: Config) -> bool:
    """Whether ``cfg`` trains a text-conditioned model (a Stable Diffusion folder, or ours
    with a text encoder: integrations/sd)."""
    return bool(cfg.model.pretrained or cfg.model.text_encoder)


def _text_data(cfg: Config, dataset: Dataset | None) -> Dataset:
    """The captioned data of a text run: ``cfg.data``'s with its captions, or a user
    dataset of (image, caption) items with a ``captions`` list."""
    if cfg.controlnet.enabled:
        if dataset is None:
            if cfg.data.conditioning == "none":
                raise ConfigError("controlnet.enabled trains on (image, conditioning image, "
                                  "caption) triples: set data.conditioning (folder, jsonl, "
                                  "auto), or pass a dataset with conditioning(i) to "
                                  "steadydiff.train (docs/controlnet.md)")
            return build_paired(cfg.data, cfg.train.seed, cfg.controlnet.conditioning_channels)
        if not is_paired(dataset):
            raise ConfigError(f"controlnet.enabled: {type(dataset).__name__} gives no "
                              "conditioning images: it needs conditioning(i) -> a (C, H, W) "
                              "tensor in [0, 1] (and conditioning_path_of(i) to name the "
                              "files; docs/controlnet.md)")
    if dataset is None:
        from .data.kohya import build_kohya, plan_of

        plan = plan_of(cfg.data)  # kohya repeat folders, its dataset TOML, DreamBooth
        if plan is not None:
            return build_kohya(cfg.data, plan, seed=cfg.train.seed)
        return build_captioned(cfg.data, build_dataset(cfg.data, seed=cfg.train.seed),
                               seed=cfg.train.seed)
    captions = getattr(dataset, "captions", None)
    if not isinstance(captions, (list, tuple)) or len(captions) != len(dataset) or \
            not all(isinstance(c, str) for c in captions):
        raise ConfigError(f"a text-conditioned model needs a dataset with a `captions` list "
                          f"(one str per item); {type(dataset).__name__} has none: see "
                          "steadydiff.data.captions (CaptionedImageFolder, ClassCaptions)")
    return dataset


def _check_text_model(cfg: Config) -> int:
    """A text run's model checked without its weights: the folders' layout and configs, the
    shapes (data.image_size against the VAE and UNet), the parameter count."""
    from .integrations.sd import setup  # the [sd] extra: imported only for text runs

    g = setup.model_geometry(cfg)
    if cfg.model.pretrained:
        return setup.unet_parameters(setup.model_root(cfg.model))
    d, m = cfg.data, cfg.model
    try:
        with torch.device("meta"):
            model = build_model(m, image_size=g["side"], channels=g["channels"],
                                context_dim=g["context_dim"], context_len=g["context_len"])
            x = torch.zeros(2, g["channels"], g["side"], g["side"])
            with torch.no_grad():
                out = model(x, torch.zeros(2), torch.zeros(2, g["context_len"],
                                                            g["context_dim"]))
        if out.shape != x.shape:
            raise ValueError(f"output {tuple(out.shape)} for input {tuple(x.shape)}")
    except (ValueError, RuntimeError) as e:
        raise ConfigError(f"the model cannot be built: model.kind={m.kind} over "
                          f"{g['channels']}x{g['side']}x{g['side']} inputs (data.image_size="
                          f"{d.image_size}{', latents of model.vae' if m.vae else ''}) with a "
                          f"{g['context_dim']}-wide text context: {e}") from None
    return sum(p.numel() for p in model.parameters())


def check_model(cfg: Config) -> int:
    """Build the model on the meta device and run one forward pass; returns its number of
    parameters.

    Raises:
        ConfigError: a model that cannot be built or run at ``data.image_size`` (the message
            names the section and what would be valid).
    """
    if text_model(cfg):
        return _check_text_model(cfg)
    d, m = cfg.data, cfg.model
    where = (f"model.kind={m.kind} (model.{m.kind}.*) at data.image_size={d.image_size}, "
             f"data.channels={d.channels}")
    try:
        with torch.device("meta"):
            model = build_model(m, image_size=d.image_size, channels=d.channels)
            _forward(model, cfg)
    except (ValueError, RuntimeError) as e:
        raise ConfigError(f"the model cannot be built: {where}: {e}") from None
    return sum(p.numel() for p in model.parameters())


def _forward(model: nn.Module, cfg: Config) -> None:
    d = cfg.data
    x = torch.zeros(2, d.channels, d.image_size, d.image_size)
    t = torch.zeros(2)
    y = torch.zeros(2, dtype=torch.long) if cfg.model.num_classes else None
    with torch.no_grad():
        out = model(x, t, y)
    if out.shape != x.shape:
        raise ValueError(f"the model's output has shape {tuple(out.shape)}, expected "
                         f"{tuple(x.shape)}")


def check(cfg: Config, dataset: Dataset | None = None, *,
          device: torch.device | None = None) -> Preflight:
    """Every check a run makes before its first step (the dry run, and the trainer's setup).

    Args:
        cfg: a validated config.
        dataset: a user dataset replacing ``cfg.data``'s (as in ``steadydiff.train``).
        device: the device already chosen (the trainer's, under torchrun this rank's);
            None resolves ``train.device``.

    Returns:
        A :class:`Preflight`: the device, the built data and the model's size.

    Raises:
        ConfigError: device, precision, classes, image shape or model shape (the message
            names the field and what would be valid).
        DataError: data that cannot be read, outside [-1, 1], or a label that is no class id
            of the model.
    """
    device = device if device is not None else resolve_device(cfg.train.device,
                                                             what="train.device")
    check_precision(resolve_precision(cfg.train.precision, device), device,
                    cfg.train.allow_slow_precision)
    check_toolchain(cfg.train, device)  # train.compile: a C++ compiler (CPU), Triton (CUDA)
    check_optimizer(cfg.optim, device)  # adamw8bit: CUDA and bitsandbytes
    if cfg.model.quantize_base:  # the 8-bit base: torchao, a CPU or CUDA device
        from .integrations.quantize import check as check_quantize

        check_quantize(cfg.model.quantize_base, device)
    parameters = check_model(cfg)  # before the data: it may take a while to read
    data, num_classes = check_data(cfg, dataset)
    return Preflight(device, data, num_classes, parameters)
