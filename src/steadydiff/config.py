"""The typed config tree: load YAML, apply ``--set`` overrides, validate, print.

One section per component (data, model, diffusion, optim, train, sample, logging, guard).
Every section forbids unknown keys, so a typo is an error that names the key (with a
"did you mean") instead of a silent fall-back to the default. Ranges live next to the field,
so the error message can say what would be valid. Enumerations come from ``kinds.py``.

A validated config is a value: its sections are frozen and its lists are tuples, so nothing
can change it after validation, and the config a run prints and saves is the one it used.
Code that needs a different config derives one with :func:`replace`, which validates again
(types, ranges and cross-field checks all apply to the copy).
"""

from __future__ import annotations

import difflib
import functools
import json
import math
import re
import types
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError,
                      ValidationInfo, field_validator, model_serializer,
                      model_validator)

from .durations import parse_duration
from .kinds import (LABELLED_DATASETS, AdapterKind, Auto, BaseQuantization, BucketCrop, CaptionSource, Channels, MissingCaption, ClipMode,
                    ConditioningMatch, ConditioningSource,
                    CompileBackend, CompileMode, DatasetName,
                    DeviceName, DiTPreset, EvalMetric, FaultKind, FaultWhere, HyperActivation,
                    FlowGridEnd, LossWeighting, LoraFormat, LoraVariant, LRSchedule, ModelKind, Objective,
                    OBJECTIVE_SAMPLERS,
                    OBJECTIVE_WEIGHTINGS, OnSaveError, OptimizerName, Parallel,
                    Precision, PrecisionSetting,
                    Prediction, SamplerName, ScheduleName, TimestepSampling)


# Counts and switches are strict: YAML's `true` is not the integer 1, nor 1 the boolean true,
# and 2.5 steps is not 2. Float fields stay lax, so `lr: 1` is 1.0.
Int = StrictInt
Bool = StrictBool
# A speed switch: on, off, or ``auto`` (chosen for the device at the start of a run by
# trainer/speed.py; docs/speed.md has each one's choice on the CPU and on CUDA).
AutoBool = Auto | Bool


def _auto_bool(v: Any) -> Any:
    # one message instead of pydantic's two (one per member of the union)
    if v == "auto" or isinstance(v, bool):
        return v
    raise ValueError(f"expected auto, true or false, got {v!r}")

# sigma_rel of the power-function EMA with gamma = 0 (a uniform average over the whole run):
# sigma_rel^2 = (gamma+1) / ((gamma+2)^2 (gamma+3)) = 1/12 there, and below it for gamma > 0
# (EDM2 eq. 3 and its appendix). A post-hoc EMA's sigma_rel must lie in (0, SIGMA_REL_MAX).
SIGMA_REL_MAX = (1.0 / 12.0) ** 0.5


class ConfigError(ValueError):
    """A config that cannot be used. The message names the key and what would be valid."""


class FrozenConfigError(AttributeError):
    """An assignment to a field of a validated config, which is read-only (see :func:`replace`)."""


# the fields that name a file or folder (checked non-empty): one rule, not a list to forget
PATH_FIELD = re.compile(r"^(path|base|pretrained|vae|text_encoder)$"
                        r"|_(dir|path|file|from|config|images)$")


def _scalars_in(v: Any):
    """The scalars inside a field's value (tuples of tuples included)."""
    if isinstance(v, (tuple, list)):
        for x in v:
            yield from _scalars_in(x)
    elif not isinstance(v, BaseModel):
        yield v


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, v: Any, info: ValidationInfo) -> Any:
        # float fields stay lax for YAML ints (lr: 1 is 1.0), but `true` is not a number
        ann = cls.model_fields[info.field_name].annotation
        if isinstance(v, bool) and ann in (float, float | None):
            raise ValueError(f"expected a number, got {str(v).lower()}")
        return v

    @field_validator("*", mode="after")
    @classmethod
    def _only_meant_values(cls, v: Any, info: ValidationInfo) -> Any:
        # values no one can mean, in every section, whatever the field: an infinity or NaN
        # in any number (alpha=inf makes every step NaN; grad_clip=inf is no clipping; a
        # NaN threshold never fires), and an empty or blank path (data.cache_dir='' is the
        # current directory). A disabled feature is null or 0, as each field documents.
        for x in _scalars_in(v):
            if isinstance(x, float) and not math.isfinite(x):
                raise ValueError(f"{x} is not a finite number; give a finite value (or null / "
                                 "0 where the field documents it as off)")
        if PATH_FIELD.search(info.field_name):
            for x in _scalars_in(v):
                if isinstance(x, str) and not x.strip():
                    raise ValueError(f"{x!r} is an empty path; name a file or folder, or "
                                     "leave the key out (null) for none")
        return v


    def __setattr__(self, name: str, value: Any) -> None:
        # Pydantic's own frozen error says only "Instance is frozen"; this one names the key
        # and the way to get a changed config.
        path = _section_paths().get(type(self))
        if path is None:  # not in the tree (a fault of the faults list)
            how = f"{type(self).__name__}.model_copy(update={{{name!r}: {value!r}}})"
            key = f"{type(self).__name__}.{name}"
        else:
            key = f"{path}.{name}" if path else name
            how = f"steadydiff.config.replace(cfg, {{{key!r}: {value!r}}})"
        raise FrozenConfigError(f"{key}: a validated config is read-only; derive a changed "
                                f"copy instead: {how}")


@functools.cache
def _section_paths() -> dict[type[BaseModel], str]:
    """Each section class of the tree -> its dotted key ('' for Config, 'model.unet', ...)."""
    out: dict[type[BaseModel], str] = {Config: ""}

    def walk(cls: type[BaseModel], prefix: str) -> None:
        for name, field in cls.model_fields.items():
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                out[ann] = f"{prefix}{name}"
                walk(ann, f"{prefix}{name}.")

    walk(Config, "")
    return out


# --------------------------------------------------------------------------- data


class DataConfig(Section):
    dataset: DatasetName = "digits"
    path: str | None = Field(None, description="image folder root (dataset=folder); "
                             "fashion_mnist: the folder of its idx files (default "
                             "/usr/share/datasets/fashion-mnist)")
    image_size: Int = Field(16, ge=4, le=1024)
    channels: Channels = 1
    class_labels: Bool = Field(
        False, description="folder: labels from the first-level sub-folder names")
    hflip: Bool = Field(False, description="random horizontal flip (per sample, seeded)")
    center_crop: Bool = True
    num_workers: Int = Field(0, ge=0, le=64)
    follow_symlinks: Bool = Field(
        False, description="folder: follow symlinks that lead outside the data root")
    classes: tuple[Int, ...] | None = Field(
        None, description="train on these class ids only (labels keep their ids); "
        "None: all classes")
    pad_to: Int | None = Field(
        None, ge=28, le=1024, description="fashion_mnist: pad the 28x28 images (centered, "
        "background -1) to this side first, then resize to image_size; None: resize 28 -> "
        "image_size directly. 32 keeps one framing across a run grown 16 -> 32 (docs/"
        "resolution.md)")
    captions: CaptionSource = Field(
        "none", description="text-conditioned models: auto (a .txt beside each image, else "
        "metadata.jsonl), txt, jsonl (file_name/text), class_names (digits, Fashion-MNIST: "
        "'a photo of a sneaker' from the label); none: no captions (docs/sd.md)")
    missing_caption: MissingCaption = Field(
        "error", description="an image without a caption: error (names it) or empty (train it "
        "with the empty caption)")
    caption_shuffle: Bool = Field(
        False, description="shuffle each caption's comma-separated tags, anew every epoch "
        "(kohya's shuffle_caption; seeded by the run seed, epoch and item); the text encoder "
        "then runs in the step (model.pretrained only; docs/sd.md#captions)")
    keep_tokens: Int = Field(
        0, ge=0, le=1000, description="with data.caption_shuffle: the first N tags stay in "
        "place (kohya's keep_tokens counts tags, not tokenizer tokens)")
    caption_separator: str = Field(
        ",", min_length=1, description="what separates tags for data.caption_shuffle and "
        "data.trigger")
    caption_dropout: float = Field(
        0.0, ge=0.0, le=1.0, description="per-caption dropout (kohya's caption_dropout_rate): "
        "the probability that an item's caption is the empty one at an epoch (seeded by the "
        "run seed, epoch and item; works with the text cache); on top of diffusion.cfg_dropout")
    trigger: str | None = Field(
        None, description="a trigger word put first in every caption (not doubled when a "
        "caption already starts with it as a tag); cached like any caption")
    cache_dir: str | None = Field(
        None, description="where VAE latents and text embeddings are cached (safetensors, "
        "keyed by file content and the encoder's identity; share it between runs); None: "
        "RUN/cache")
    cache_latents: Bool = Field(
        True, description="latent-space models: keep the latents (encoded once, before "
        "training, each checked finite) in data.cache_dir for later runs; false: in memory "
        "for this run only")
    pin_memory: AutoBool = Field(
        "auto", description="page-locked batches, so the host-to-GPU copy of each batch "
        "(images, labels, text contexts) runs without blocking the host; auto: on for CUDA, "
        "off on the CPU (docs/speed.md)")

    buckets: Bool = Field(
        False, description="aspect-ratio bucketing (folder data, model.pretrained): each "
        "image is resized and cropped to the bucket of about image_size² pixels whose aspect "
        "ratio is closest to its own; each batch comes from one bucket (docs/sd.md, Buckets)")
    bucket_step: Int = Field(
        64, ge=8, le=512, description="buckets: every side is a multiple of this (a multiple "
        "of the model's downsampling: 64 for Stable Diffusion, VAE 8 x UNet 8)")
    bucket_min_side: Int | None = Field(
        None, ge=8, le=4096, description="buckets: the shortest side allowed (a multiple of "
        "bucket_step); None: image_size / 2 rounded down to bucket_step")
    bucket_max_side: Int | None = Field(
        None, ge=8, le=4096, description="buckets: the longest side allowed (a multiple of "
        "bucket_step); None: 2 x image_size")
    bucket_max_ratio: float = Field(
        4.0, ge=1.0, le=16.0, description="buckets: the largest long side / short side of a "
        "bucket")
    bucket_crop: BucketCrop = Field(
        "center", description="buckets: where the crop of an image to its bucket lies: "
        "center, or random (seeded by train.seed and the image, the same every epoch)")

    # kohya sd-scripts datasets and DreamBooth (data/kohya.py, docs/sd.md#kohya-datasets)
    dataset_config: str | None = Field(
        None, description="a kohya dataset TOML ([general], [[datasets]], [[datasets.subsets]]: "
        "image_dir, num_repeats, caption_extension, keep_tokens, shuffle_caption, is_reg, "
        "class_tokens; resolution, batch_size) read as it is, instead of data.path")
    repeat_folders: AutoBool = Field(
        "auto", description="data.path's sub-folders named <repeats>_<class tokens> (kohya's "
        "10_sks dog): each image seen <repeats> times per epoch, captioned with the class "
        "tokens when it has no caption file; auto: when data.path holds such folders (and no "
        "images of its own)")
    caption_extension: str = Field(
        ".txt", description="kohya data: the caption file beside each "
        "image (kohya's caption_extension)")
    reg_path: str | None = Field(
        None, description="DreamBooth prior preservation: the regularization (class) images "
        "(kohya's reg_data_dir: <repeats>_<class tokens> folders, or a plain folder captioned "
        "with data.class_prompt); as many regularization samples as instance samples per "
        "epoch, each weighted data.prior_loss_weight")
    prior_loss_weight: float = Field(
        1.0, ge=0.0, le=1000.0, description="the loss weight of a regularization image "
        "(kohya's prior_loss_weight; diffusers' train_dreambooth.py): loss = mean(w_i loss_i)")
    instance_prompt: str | None = Field(
        None, description="DreamBooth: the caption of an instance image without a caption "
        "file (e.g. 'a photo of sks dog')")
    class_prompt: str | None = Field(
        None, description="DreamBooth: the caption of a regularization image without a caption "
        "file (e.g. 'a photo of dog'), and the prompt data.num_class_images are generated with")

    num_class_images: Int = Field(
        0, ge=0, le=100000, description="DreamBooth: when data.reg_path holds fewer images, "
        "generate the missing ones before training from the base model with data.class_prompt "
        "(sample.sampler/steps/cfg_scale), cached there for later runs; 0: none generated")

    conditioning: ConditioningSource = Field(
        "none", description="ControlNet training (controlnet.enabled): where each image's "
        "conditioning image is: folder (data.conditioning_dir: the same relative path, any "
        "image extension), jsonl (the data.conditioning_column of metadata.jsonl, relative "
        "to its folder, as diffusers' train_controlnet.py reads it), auto (the folder when it "
        "exists, else the column); none: no conditioning images (docs/controlnet.md)")
    conditioning_dir: str = Field(
        "conditioning", min_length=1, description="data.conditioning=folder|auto: the folder "
        "of conditioning images, relative to data.path (its files are then not training "
        "images) or absolute")
    conditioning_column: str = Field(
        "conditioning_image", min_length=1, description="data.conditioning=jsonl|auto: the "
        "metadata.jsonl key holding each image's conditioning image path")
    conditioning_match: ConditioningMatch = Field(
        "size", description="how an image and its conditioning image must agree: size (the "
        "same pixel size) or aspect (the same aspect ratio, within a pixel; the conditioning "
        "image is resized with the image's crop); a pair that does not is an error naming "
        "both files")

    _pin_memory = field_validator("pin_memory", mode="before")(_auto_bool)
    _repeat_folders = field_validator("repeat_folders", mode="before")(_auto_bool)

    @field_validator("caption_extension")
    @classmethod
    def _caption_extension(cls, v: str) -> str:
        if not v.startswith(".") or len(v) < 2 or any(c in v for c in "/\\*?"):
            raise ValueError(f"{v!r} is not a file extension: give one starting with '.', e.g. "
                             "'.txt' or '.caption'")
        return v

    @model_validator(mode="after")
    def _check(self) -> "DataConfig":
        if self.dataset == "folder" and not self.path and not self.dataset_config:
            raise ValueError("data.path is required when data.dataset is 'folder' (or "
                             "data.dataset_config, a kohya dataset TOML)")
        kohya = [k for k in ("dataset_config", "reg_path", "instance_prompt", "class_prompt")
                 if getattr(self, k)]
        if kohya and (self.dataset != "folder" or self.captions == "none"):
            raise ValueError(f"data.{kohya[0]} reads a captioned image folder (kohya "
                             f"data, DreamBooth): set data.dataset=folder and data.captions="
                             f"auto (now {self.dataset}, {self.captions})")
        if self.dataset_config and self.path:
            raise ValueError("data.dataset_config names the images (its subsets' image_dir): "
                             "remove data.path")
        if kohya and (self.conditioning != "none" or self.class_labels):
            raise ValueError(f"data.{kohya[0]} (kohya subsets, DreamBooth) does not combine "
                             "with data.conditioning or data.class_labels yet: remove one")
        if self.num_class_images and not (self.reg_path and self.class_prompt):
            raise ValueError("data.num_class_images generates class images with "
                             "data.class_prompt into data.reg_path: set both")
        if self.prior_loss_weight != 1.0 and not (self.reg_path or self.dataset_config):
            raise ValueError("data.prior_loss_weight weighs regularization images: set "
                             "data.reg_path (or is_reg subsets in data.dataset_config)")
        if self.classes is not None:
            if not self.classes:
                raise ValueError("data.classes is empty; list at least one class id, or "
                                 "set it to null for all classes")
            if len(set(self.classes)) != len(self.classes) or min(self.classes) < 0:
                raise ValueError(f"data.classes must be distinct class ids >= 0, got "
                                 f"{self.classes}")
            if self.dataset == "folder" and not self.class_labels:
                raise ValueError("data.classes needs labels: set data.class_labels=true "
                                 "(one sub-folder per class) or remove data.classes")
        if self.captions == "class_names" and self.dataset not in LABELLED_DATASETS:
            raise ValueError(f"data.captions=class_names names the classes of "
                             f"{' or '.join(LABELLED_DATASETS)}; data.dataset={self.dataset} "
                             "has none: use auto, txt or jsonl")
        if self.captions in ("auto", "txt", "jsonl") and self.dataset != "folder":
            raise ValueError(f"data.captions={self.captions} reads caption files beside the "
                             f"images of a folder (data.dataset=folder); {self.dataset} has "
                             "none: use class_names")
        if self.captions == "none":
            for key, off in (("caption_shuffle", False), ("keep_tokens", 0),
                             ("caption_dropout", 0.0), ("trigger", None)):
                if getattr(self, key) != off:
                    raise ValueError(f"data.{key} changes captions, but data.captions=none: "
                                     "set data.captions (auto, txt, jsonl, class_names) or "
                                     f"remove data.{key}")
        if self.trigger is not None and (not self.trigger.strip()
                                         or self.caption_separator in self.trigger):
            raise ValueError(f"data.trigger={self.trigger!r} must be one non-empty tag, without "
                             f"the separator data.caption_separator={self.caption_separator!r}")
        if self.pad_to is not None and self.dataset != "fashion_mnist":
            raise ValueError(f"data.pad_to pads Fashion-MNIST's 28x28 images; data.dataset="
                             f"{self.dataset} has no fixed native size: remove data.pad_to")
        if self.buckets:
            self.bucket_sides()  # raises naming the key
        if self.conditioning != "none" and self.dataset != "folder":
            raise ValueError(f"data.conditioning={self.conditioning} pairs the images of a "
                             f"folder with conditioning images (data.dataset=folder); "
                             f"data.dataset={self.dataset} has none: set data.dataset=folder, "
                             "or pass a dataset with conditioning images to steadydiff.train "
                             "(docs/controlnet.md)")
        return self

    def bucket_sides(self) -> tuple[int, int]:
        """``(min_side, max_side)`` of the buckets, defaults resolved; raises ValueError
        naming the key when they do not fit ``bucket_step`` and ``image_size``."""
        st, s = self.bucket_step, self.image_size
        lo = self.bucket_min_side if self.bucket_min_side is not None \
            else max(st, s // 2 // st * st)
        hi = self.bucket_max_side if self.bucket_max_side is not None else 2 * s // st * st
        if self.dataset != "folder":
            raise ValueError(f"data.buckets groups the images of a folder by aspect ratio; "
                             f"data.dataset={self.dataset} has one square size: set "
                             "data.dataset=folder or data.buckets=false")
        for key, v in (("data.bucket_min_side", lo), ("data.bucket_max_side", hi),
                       ("data.image_size", s)):
            if v % st:
                raise ValueError(f"{key}={v} is not a multiple of data.bucket_step={st}: use "
                                 f"{max(st, v // st * st)} (or another bucket_step)")
        if not lo <= s <= hi:
            raise ValueError(f"data.image_size={s} must lie between data.bucket_min_side={lo} "
                             f"and data.bucket_max_side={hi} (the base square is a bucket)")
        return lo, hi


# --------------------------------------------------------------------------- model


class UNetConfig(Section):
    channels: Int = Field(64, ge=4, le=1024, description="base width")
    channel_mult: tuple[Int, ...] = Field((1, 2, 2), min_length=1, max_length=8)
    num_res_blocks: Int = Field(2, ge=1, le=8)
    attention_resolutions: tuple[Int, ...] = Field(
        (8,), description="feature-map sizes with attention")
    head_channels: Int = Field(32, ge=4, le=512)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    norm_groups: Int = Field(32, ge=1, le=512)
    norm_eps: float = Field(1e-5, gt=0.0, le=1.0)


class DiTConfig(Section):
    preset: DiTPreset = "tiny"
    patch_size: Int = Field(2, ge=1, le=16)
    depth: Int | None = Field(None, ge=1, le=64, description="overrides the preset")
    hidden_size: Int | None = Field(None, ge=8, le=4096, description="overrides the preset")
    num_heads: Int | None = Field(None, ge=1, le=64, description="overrides the preset")
    mlp_ratio: float = Field(4.0, gt=0.0, le=16.0)
    norm_eps: float = Field(1e-6, gt=0.0, le=1.0)


class ModelConfig(Section):
    kind: ModelKind = "unet"
    num_classes: Int = Field(0, ge=0, le=100_000,
                             description="0: unconditional; >0 adds a null class for CFG")
    qk_norm: Bool = False
    upcast_attention: Bool = Field(
        False, description="compute every attention layer's q kᵀ and softmax in fp32 under "
        "fp16/bf16 autocast (the 'upcast attention' fix for fp16 overflow; the guard turns it "
        "on per layer when one overflows)")
    unet: UNetConfig = UNetConfig()
    dit: DiTConfig = DiTConfig()
    pretrained: str | None = Field(
        None, description="a local diffusers Stable Diffusion folder (model_index.json, unet/, "
        "vae/, text_encoder/, tokenizer/, scheduler/) or a single-file .safetensors "
        "checkpoint (the original LDM layout A1111/ComfyUI use; with model.single_file_config)"
        ": fine-tune its UNet (adapter.kind=lora: a peft LoRA; none: the whole UNet); "
        "kind/unet/dit are then unused (docs/sd.md)")
    single_file_config: str | None = Field(
        None, description="model.pretrained is a single-file checkpoint: a local diffusers "
        "Stable Diffusion folder of the same architecture that supplies every config "
        "(unet/vae/text_encoder config.json, tokenizer/, scheduler/; weights not needed); "
        "nothing is downloaded")
    text_encoder: str | None = Field(
        None, description="steadydiff's own models: a folder with text_encoder/ and "
        "tokenizer/ (a transformers CLIP text model; an SD folder works): the model is "
        "conditioned on its token embeddings by cross-attention (data.captions)")
    vae: str | None = Field(
        None, description="steadydiff's own models: train in the latent space of this "
        "diffusers AutoencoderKL folder (its config.json, or an SD folder's vae/)")
    vae_precision: Precision | None = Field(
        None, description="dtype of the frozen VAE (fp32 avoids the fp16 VAE's NaN latents); "
        "None: train.precision")
    text_encoder_precision: Precision | None = Field(
        None, description="model.pretrained: dtype of the frozen text encoders; None: what the "
        "family's trainers use (train.precision; a T5 never fp16: bf16, or fp32 without it). A "
        "caption whose embedding is non-finite in it is encoded again in fp32")
    max_sequence_length: Int | None = Field(
        None, ge=1, le=4096, description="model.pretrained with a T5 text encoder (SD3, "
        "FLUX.1): the captions' T5 token length; None: the family's pipeline's (SD3: 256; "
        "FLUX.1 dev: 512, schnell: 256)")
    offload_text_encoders: Bool = Field(
        False, description="model.pretrained: once the captions are encoded and cached, move "
        "the frozen text encoders to the CPU; validation prompts and sampling encode there "
        "(slower) and send the result to the device (T5-XXL frees ~9.5 GB of a GPU). Not "
        "with data.caption_shuffle or adapter.text_encoder (the encoders then run in every "
        "step)")
    guidance: float | None = Field(
        None, ge=0.0, le=100.0, description="model.pretrained guidance-distilled transformer "
        "(FLUX.1 dev): the guidance value embedded in training and sampling; None: 3.5 (the "
        "pipeline's and the trainers' default)")
    quantize_base: BaseQuantization | None = Field(
        None, description="model.pretrained with adapter.kind=lora: int8 stores the frozen "
        "denoiser's Linear weights in 8 bits (torchao weight-only int8, the steadydiff[quant] "
        "extra) and computes in bf16 (train.precision=bf16); the LoRA trains in fp32 on top. "
        "None: the base in train.precision")


# --------------------------------------------------------------------------- diffusion


class FlowConfig(Section):
    """diffusion.objective=flow: the shift of the noise levels (docs/objectives.md)."""

    shift: float = Field(
        1.0, gt=0.0, le=100.0, description="static shift s of every noise level, training and "
        "sampling: sigma' = s*sigma / (1 + (s-1)*sigma) (SD3 paper eq. 23; SD3 uses 3.0 at "
        "1024^2); s > 1 spends more steps at high noise; 1: none")
    dynamic_shift: Bool = Field(
        False, description="FLUX's resolution-dependent shift instead: s = exp(mu), mu linear "
        "in the image's token count (data.image_size/token_pixels)^2 through (base_seq_len, "
        "base_shift) and (max_seq_len, max_shift)")
    base_seq_len: Int = Field(256, ge=1, le=1_000_000)
    max_seq_len: Int = Field(4096, ge=2, le=1_000_000)
    base_shift: float = Field(0.5, ge=-10.0, le=10.0)
    max_shift: float = Field(1.15, ge=-10.0, le=10.0)
    token_pixels: Int = Field(
        2, ge=1, le=1024, description="the side in pixels of one image token, for the "
        "dynamic shift's token count: 2 for steadydiff's own models (2x2 patches of pixels); "
        "a model family sets its own (FLUX.1: 16, the VAE's x8 times the 2x2 packing)")
    grid_end: FlowGridEnd = Field(
        "steps", description="the sampling grid's last level before 0: steps, 1/steps (the "
        "FLUX pipelines' linspace(1, 1/n, n)); table, the training table's smallest level "
        "shift(1/timesteps) (diffusers' scheduler default: SD3's pipeline)")

    @model_validator(mode="after")
    def _check(self) -> "FlowConfig":
        if self.dynamic_shift and self.shift != 1.0:
            raise ValueError(f"diffusion.flow.shift={self.shift} and diffusion.flow."
                             "dynamic_shift=true both shift the noise levels: keep one (shift: "
                             "1.0, or dynamic_shift: false)")
        if self.max_seq_len <= self.base_seq_len:
            raise ValueError(f"diffusion.flow.max_seq_len ({self.max_seq_len}) must be greater "
                             f"than diffusion.flow.base_seq_len ({self.base_seq_len})")
        return self


class EDMConfig(Section):
    """diffusion.objective=edm: Karras et al. 2022, Table 1 (docs/objectives.md)."""

    sigma_data: float = Field(0.5, gt=0.0, le=100.0, description="the data's standard "
                              "deviation (0.5 for images in [-1, 1])")
    p_mean: float = Field(-1.2, ge=-10.0, le=10.0, description="training: ln(sigma) ~ "
                          "N(p_mean, p_std^2)")
    p_std: float = Field(1.2, gt=0.0, le=10.0)
    sigma_min: float = Field(0.002, gt=0.0, le=1000.0, description="sampling: the Karras "
                             "grid's smallest noise level before 0")
    sigma_max: float = Field(80.0, gt=0.0, le=10_000.0, description="sampling: the first "
                             "noise level (the starting noise has this std)")
    rho: float = Field(7.0, gt=0.0, le=100.0, description="sampling: the Karras grid's "
                       "exponent (eq. 5)")

    @model_validator(mode="after")
    def _check(self) -> "EDMConfig":
        if self.sigma_min >= self.sigma_max:
            raise ValueError(f"diffusion.edm.sigma_min ({self.sigma_min}) must be less than "
                             f"diffusion.edm.sigma_max ({self.sigma_max})")
        return self


# keys of the ddpm objective's schedule and prediction: another objective refuses them
_DDPM_ONLY = ("schedule", "beta_start", "beta_end", "piecewise", "zero_terminal_snr",
              "prediction", "resolution_shift_base")


class DiffusionConfig(Section):
    objective: Objective = Field(
        "ddpm", description="ddpm: the variance-preserving diffusion of diffusion.schedule, "
        "the network predicting diffusion.prediction; flow: rectified flow (x = (1-sigma)*x0 + "
        "sigma*noise, the network predicts noise - x0; diffusion.flow); edm: Karras et al. "
        "2022's preconditioned denoiser (diffusion.edm) (docs/objectives.md)")
    timesteps: Int = Field(1000, ge=2, le=100_000, description="ddpm: the schedule's steps; "
                           "flow/edm: the scale of the network's time input and of the "
                           "guard's t-buckets")
    schedule: ScheduleName = "linear"
    beta_start: float = Field(1e-4, gt=0.0, lt=1.0)
    beta_end: float = Field(0.02, gt=0.0, lt=1.0)
    # piecewise-linear log-SNR: [[t_fraction, log_snr], ...], t_fraction from 0 to 1.
    piecewise: tuple[tuple[float, ...], ...] = ((0.0, 10.0), (1.0, -10.0))
    zero_terminal_snr: Bool = False
    prediction: Prediction = "eps"
    loss_weighting: LossWeighting = "uniform"
    min_snr_gamma: float = Field(5.0, gt=0.0, le=1e4)
    timestep_sampling: TimestepSampling = "uniform"
    logit_mean: float = Field(0.0, ge=-10.0, le=10.0)
    logit_std: float = Field(1.0, gt=0.0, le=10.0)
    mode_scale: float = Field(
        1.29, ge=-1.0, le=1.75, description="timestep_sampling=mode: the scale s of SD3's "
        "mode density (eq. 20; diffusers' default 1.29); it stays monotone for -1 <= s <= "
        "2/(pi-2)")
    sigmoid_scale: float = Field(
        1.0, gt=0.0, le=10.0, description="timestep_sampling=sigmoid: u = sigmoid(scale * "
        "N(0, 1)) (kohya's sigmoid_scale)")
    cfg_dropout: float = Field(0.1, ge=0.0, le=1.0,
                               description="label (or caption) dropout for classifier-free "
                               "guidance: the fraction of samples trained unconditionally")
    noise_offset: float = Field(
        0.0, ge=0.0, le=1.0, description="offset noise (Guttenberg 2023): add this x a "
        "per-channel N(0, 1) constant to the noise, so the model learns to change an image's "
        "mean brightness (SD fine-tunes use ~0.05-0.1); 0: off")
    resolution_shift_base: Int | None = Field(
        None, ge=4, le=1024, description="shift the log-SNR by 2*log(base/data.image_size) "
        "(Hoogeboom et al. 2023, simple diffusion): a larger image gets more noise at the same "
        "t; None: no shift (docs/resolution.md)")
    flow: FlowConfig = FlowConfig()
    edm: EDMConfig = EDMConfig()

    @model_validator(mode="after")
    def _check(self) -> "DiffusionConfig":
        if self.schedule in ("linear", "scaled_linear") and self.beta_end <= self.beta_start:
            raise ValueError(
                f"diffusion.beta_end ({self.beta_end}) must be greater than "
                f"diffusion.beta_start ({self.beta_start})")
        obj = self.objective
        if obj != "ddpm":
            default = DiffusionConfig.model_fields
            for key in _DDPM_ONLY:
                if getattr(self, key) != default[key].default:
                    why = (" (flow reaches pure noise at sigma = 1 by construction; edm has no "
                           "terminal level)") if key == "zero_terminal_snr" else ""
                    how = (" (for a resolution shift set diffusion.flow.shift or "
                           "diffusion.flow.dynamic_shift)") if key == "resolution_shift_base" \
                        and obj == "flow" else ""
                    raise ValueError(f"diffusion.{key} belongs to diffusion.objective=ddpm's "
                                     f"schedule and prediction; diffusion.objective={obj} does "
                                     f"not use it{why}: remove diffusion.{key}{how}")
        valid = OBJECTIVE_WEIGHTINGS[obj]
        if self.loss_weighting not in valid:
            raise ValueError(f"diffusion.loss_weighting={self.loss_weighting} does not apply to "
                             f"diffusion.objective={obj}; valid: {', '.join(valid)}")
        if obj == "edm" and self.timestep_sampling != "uniform":
            raise ValueError(f"diffusion.timestep_sampling={self.timestep_sampling} applies to "
                             "the ddpm and flow objectives; edm draws ln(sigma) ~ N(diffusion."
                             "edm.p_mean, diffusion.edm.p_std^2): remove diffusion."
                             "timestep_sampling")
        for name, cls in (("flow", FlowConfig), ("edm", EDMConfig)):
            if obj != name:
                changed = [k for k in cls.model_fields
                           if getattr(getattr(self, name), k) != cls.model_fields[k].default]
                if changed:
                    keys = ", ".join(f"diffusion.{name}.{k}" for k in changed)
                    raise ValueError(f"{keys} configure diffusion.objective={name}, but the "
                                     f"objective is {obj}: set diffusion.objective={name} or "
                                     "remove them")
        return self


# --------------------------------------------------------------------------- optim


class OptimConfig(Section):
    optimizer: OptimizerName = Field(
        "adamw", description="adamw: torch's AdamW; adamw8bit: bitsandbytes' 8-bit AdamW "
        "(block-wise quantised moments: about a quarter of AdamW's state memory; CUDA and "
        "`pip install bitsandbytes` only; docs/speed.md)")
    lr: float = Field(2e-4, gt=0.0, le=10.0, description="the learning rate (of the "
                      "denoiser, the UNet or transformer, where the text encoders have their "
                      "own: optim.lr_text_encoder)")
    lr_text_encoder: float | list[float] | None = Field(
        None, description="model.pretrained with trained text encoders (adapter.text_encoder"
        "): their learning rate (kohya's --text_encoder_lr), one for all or a list with one "
        "per text encoder in the family's order (SDXL: [CLIP-L, CLIP-G]); null: optim.lr. "
        "Warmup and decay scale it with optim.lr (docs/sd.md#learning-rates-per-part)")
    weight_decay: float = Field(0.0, ge=0.0, le=10.0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0.0, le=1.0)
    schedule: LRSchedule = "constant"
    warmup_steps: Int = Field(0, ge=0)
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0, description="cosine floor, x lr")
    layer_decay: float = Field(1.0, gt=0.0, le=1.0,
                               description="layer-wise LR decay; 1.0 disables it")
    grad_clip: float = Field(
        1.0, ge=0.0, description="clip threshold: the max norm (global, per_layer), the "
        "max ratio |g|/|w| per unit (agc); zclip: the max norm while its statistics warm up "
        "(its z-threshold is guard.grad_z); 0 disables clipping")
    clip_mode: ClipMode = "global"
    fused: AutoBool = Field(
        "auto", description="torch's fused AdamW kernel (one kernel for all parameters; the "
        "grad scaler's inf check is applied inside it); auto: fused wherever torch has the "
        "kernel (CUDA, and the CPU, where its step measured 2.4-5x faster than torch's "
        "per-parameter loop); false: torch's default implementation (docs/speed.md)")

    _fused = field_validator("fused", mode="before")(_auto_bool)

    @model_validator(mode="after")
    def _check(self) -> "OptimConfig":
        for b in self.betas:
            if not 0.0 <= b < 1.0:
                raise ValueError(f"optim.betas must both be in [0, 1), got {list(self.betas)}")
        te = self.lr_text_encoder
        for x in (te if isinstance(te, list) else [] if te is None else [te]):
            if not 0.0 < x <= 10.0:
                raise ValueError(f"optim.lr_text_encoder must be in (0, 10], got {te}")
        if isinstance(te, list) and not te:
            raise ValueError("optim.lr_text_encoder is an empty list: give one learning "
                             "rate, one per text encoder, or null (optim.lr)")
        if self.optimizer == "adamw8bit" and self.fused is True:
            raise ValueError("optim.fused=true picks torch's fused AdamW kernel, but optim."
                             "optimizer=adamw8bit is bitsandbytes' own kernel: set optim.fused"
                             " to auto or false, or optim.optimizer to adamw")
        return self


# --------------------------------------------------------------------------- train


class TrainConfig(Section):
    steps: Int = Field(1000, ge=1, description="optimizer steps")
    epochs: Int | None = Field(
        None, ge=1, le=1000000, description="train this many epochs instead: train.steps = "
        "ceil(epochs x samples per epoch / batch_size), samples per epoch = the images (x "
        "their repeats, + the balanced regularization samples, for kohya data), printed at "
        "start; None: train.steps")
    checkpoint_every_epochs: Int | None = Field(
        None, ge=1, le=1000000, description="save every N epochs instead (kohya's "
        "save_every_n_epochs): train.checkpoint_every = round(N x samples per epoch / "
        "batch_size) steps, printed at start; None: train.checkpoint_every")
    batch_size: Int = Field(64, ge=1, le=65536, description="global batch per optimizer step")
    grad_accum: Int = Field(1, ge=1, le=1024, description="micro-batches per optimizer step")
    seed: Int = Field(0, ge=0, le=2**63 - 1)
    checkpoint_every: Int = Field(500, ge=0, description="0: only at the end")
    keep_checkpoints: Int = Field(3, ge=1, le=1000)
    sample_every: Int = Field(500, ge=0, description="0: only at the end")
    precision: PrecisionSetting = Field(
        "auto", description="autocast dtype of the forward pass (weights and optimizer stay "
        "fp32); auto: bf16 on a GPU with native bf16, else fp16 with the grad scaler on "
        "CUDA, fp32 on the CPU; resolved once at start and printed (docs/speed.md)")
    allow_slow_precision: Bool = Field(
        False, description="run bf16/fp16 on a device without native support anyway")
    channels_last: AutoBool = Field(
        "auto", description="convolution weights and input batches in channels-last (NHWC) "
        "memory format, which cuDNN's tensor-core convolutions run fastest in; auto: on "
        "for convolutional models (UNets) on CUDA, off on the CPU and for DiT "
        "(docs/speed.md)")
    gradient_checkpointing: Bool = Field(
        False, description="recompute each block's activations in the backward pass instead "
        "of keeping them: our UNet's residual/attention blocks, the DiT's blocks, a Stable "
        "Diffusion UNet's blocks (diffusers) and a text encoder trained with its LoRA "
        "(transformers); about one more forward per step for much less activation memory, "
        "the same gradients (docs/speed.md)")
    tf32: Bool = Field(
        True, description="CUDA: let fp32 matmuls and convolutions use TF32 tensor cores "
        "(10-bit mantissa inputs, fp32 accumulation); no effect on the CPU (docs/speed.md)")
    device: DeviceName = "auto"
    deterministic: Bool = False
    num_threads: Int = Field(0, ge=0, le=1024, description="torch CPU threads; 0: torch default")
    compile: Bool = Field(
        False, description="torch.compile the model for the training forward and backward "
        "(inductor fuses kernels: faster steps once compiled, the first steps slow while it "
        "compiles; on CPU it needs a C++ compiler, on CUDA Triton). Checkpoints, EMA, sample "
        "grids, evaluation and the guard's replays and probes use the plain model "
        "(docs/compile.md)")
    compile_mode: CompileMode = Field(
        "default", description="torch.compile mode (inductor): default | reduce-overhead "
        "(CUDA graphs on CUDA) | max-autotune (times kernel choices: a much longer compile) | "
        "max-autotune-no-cudagraphs")
    compile_backend: CompileBackend = Field(
        "inductor", description="inductor (generated kernels: the speed-up); aot_eager or "
        "eager trace the model but run PyTorch's own kernels (no compiler needed, no "
        "speed-up: to find which stage of a failing compile breaks)")
    ema_decay: float = Field(0.999, ge=0.0, lt=1.0)
    ema_warmup: Bool = Field(True, description="decay ramps as min(decay, (1+n)/(10+n))")
    ema_start: Int = Field(0, ge=0, description="first optimizer step that updates EMA")
    ema_posthoc: Bool = Field(
        False, description="post-hoc EMA (Karras et al. 2024, EDM2): also keep power-function "
        "EMA profiles of the weights and store their snapshots in RUN/posthoc/, so "
        "`steadydiff ema RUN --sigma-rel S` can reconstruct the EMA of any length after "
        "training (docs/ema.md)")
    ema_posthoc_every: Int = Field(
        100, ge=1, description="steps between stored post-hoc EMA snapshots (and one at the "
        "last step); reconstruction needs a few per profile, EDM2 stores ~100-200 per run")
    ema_posthoc_sigma_rels: tuple[float, ...] = Field(
        (0.05, 0.10), description="relative standard deviations of the stored power-function "
        "EMA profiles (EDM2's two defaults); each in (0, 0.2886), distinct")
    dist_timeout: float = Field(
        600.0, gt=0.0, le=86400.0, description="torchrun: seconds a collective may wait for "
        "the other ranks before failing (a peer died or hung); longer than the slowest "
        "sample-grid/checkpoint/eval pause of rank 0")
    watchdog_timeout: float = Field(
        1800.0, ge=0.0, description="torchrun: end a rank whose training made no progress "
        "for this many seconds (stacks printed, exit 5); 0 disables the watchdog")
    parallel: Parallel = Field(
        "ddp", description="how torchrun's processes hold the model: ddp (every rank a full "
        "copy of weights, gradients and AdamW state; the fastest while it fits) or fsdp "
        "(PyTorch FSDP2: each rank holds 1/N of them, gathered block by block for the "
        "forward and backward; checkpoints through torch.distributed.checkpoint, resumable "
        "on any number of processes); docs/distributed.md")
    fsdp_offload: Bool = Field(
        False, description="train.parallel=fsdp: keep the sharded weights, gradients and "
        "AdamW state in CPU memory and the step on the CPU (FSDP2's CPUOffloadPolicy): a "
        "model that does not fit on the GPUs trains, slower")
    on_save_error: OnSaveError = Field(
        "retry", description="disk full / permission denied while saving a checkpoint: keep "
        "training and retry at the next checkpoint (retry), or stop cleanly (stop)")
    max_time: float | None = Field(
        None, description="a time budget (like Lightning's max_time): stop when this much "
        "training time is used, train.steps staying the upper bound; the cosine LR decay then "
        "follows the fraction of the budget used. Seconds, or '90s', '45m', '2h', '1d 2h', "
        "'DD:HH:MM:SS' (stored as seconds); resume continues the budget; null: none "
        "(docs/RELIABILITY.md, \"Time budget\")")

    @field_validator("max_time", mode="before")
    @classmethod
    def _duration(cls, v: Any) -> float | None:
        return None if v is None else parse_duration(v)

    _channels_last = field_validator("channels_last", mode="before")(_auto_bool)

    @model_validator(mode="after")
    def _check(self) -> "TrainConfig":
        if self.compile_mode != "default" and self.compile_backend != "inductor":
            raise ValueError(
                f"train.compile_mode={self.compile_mode} needs train.compile_backend=inductor "
                f"(got {self.compile_backend}); the modes are inductor's: set "
                "train.compile_mode=default or train.compile_backend=inductor")
        if self.batch_size % self.grad_accum:
            raise ValueError(
                f"train.batch_size ({self.batch_size}) must be divisible by train.grad_accum "
                f"({self.grad_accum}); valid grad_accum values divide the batch size")
        rels = self.ema_posthoc_sigma_rels
        if self.ema_posthoc and not rels:
            raise ValueError("train.ema_posthoc_sigma_rels is empty; list at least one "
                             "sigma_rel in (0, 0.2886), e.g. [0.05, 0.10]")
        for r in rels:
            if not 0.0 < r < SIGMA_REL_MAX:
                raise ValueError(f"train.ema_posthoc_sigma_rels: {r} is out of range; each "
                                 f"must be in (0, {SIGMA_REL_MAX:.4f}) (a power-function EMA "
                                 "with exponent gamma > 0), e.g. [0.05, 0.10]")
        if len(set(rels)) != len(rels):
            raise ValueError(f"train.ema_posthoc_sigma_rels must be distinct, got {list(rels)}")
        return self


# --------------------------------------------------------------------------- sample


class ValidationPrompt(Section):
    """One entry of ``sample.prompts`` (a plain string is ``{prompt: STRING}``); every
    unset field takes the ``sample`` section's value (docs/sd.md, "Validation prompts")."""

    prompt: str = Field(description="the text")
    negative_prompt: str | None = Field(None, description="null: sample.negative_prompt")
    seed: Int | None = Field(None, ge=0, le=2**64 - 1, description="the seed of this "
                             "prompt's noise (its own generator); null: sample.seed")
    cfg_scale: float | None = Field(None, ge=0.0, le=100.0, description="null: "
                                    "sample.cfg_scale")
    steps: Int | None = Field(None, ge=1, le=100_000, description="null: sample.steps")
    width: Int | None = Field(None, ge=8, le=4096, description="pixels; a Stable Diffusion "
                              "UNet (model.pretrained) only; null: data.image_size")
    height: Int | None = Field(None, ge=8, le=4096, description="as width")

    @model_serializer(mode="wrap")
    def _as_written(self, handler: Any) -> Any:
        # config.yaml holds an entry as it would be written: the string alone when nothing
        # else is set, else the mapping of the set fields (both read back to this entry)
        d = {k: v for k, v in handler(self).items() if v is not None}
        return d["prompt"] if set(d) == {"prompt"} else d


PROMPT_KEYS = tuple(ValidationPrompt.model_fields)


class SampleConfig(Section):
    sampler: SamplerName = "dpmpp_2m"
    steps: Int = Field(50, ge=1, le=100_000)
    num: Int = Field(64, ge=1, le=100_000, description="images per sample grid (with "
                     "sample.prompts: at least one per prompt)")
    cfg_scale: float = Field(1.0, ge=0.0, le=100.0)
    eta: float = Field(0.0, ge=0.0, le=1.0, description="DDIM stochasticity")
    seed: Int = Field(0, ge=0)
    use_ema: Bool = Field(True, description="sample grids, validation prompts and the "
                          "exported weights use the EMA weights (false: the raw ones)")
    prompts: tuple[ValidationPrompt, ...] = Field(
        (), description="text-conditioned models: the validation prompts rendered into the "
        "sample grids every train.sample_every steps, each a string or a mapping {prompt, "
        "negative_prompt, seed, cfg_scale, steps, width, height} (cycled over sample.num "
        "cells); empty: the captions of the first dataset items")
    negative_prompt: str = Field(
        "", description="text-conditioned models: what guidance steers away from")

    @field_validator("prompts", mode="before")
    @classmethod
    def _prompt_entries(cls, v: Any) -> Any:
        # a string is the prompt alone; anything else but a mapping is named here, with the
        # entry's index, instead of pydantic's "valid dictionary" for the mapping form
        if isinstance(v, str):
            raise ValueError("expected a list of prompts (a string or a mapping each), got "
                             f"the string {v!r}: write [{v!r}]")
        if not isinstance(v, (list, tuple)):
            return v
        out = []
        for i, e in enumerate(v):
            if isinstance(e, str):
                e = {"prompt": e}
            elif not isinstance(e, (Mapping, ValidationPrompt)):
                raise ValueError(f"entry {i} is {type(e).__name__} {e!r}: each prompt is a "
                                 f"string or a mapping with keys {', '.join(PROMPT_KEYS)}")
            out.append(e)
        return out


# --------------------------------------------------------------------------- eval


class EvalConfig(Section):
    """Evaluation during training: FD/KID/precision/recall on the EMA model every N steps,
    the best checkpoint by metric, early stopping (docs/evaluation.md)."""

    every: Int = Field(0, ge=0, description="steps between evaluations; 0 disables them")
    num: Int = Field(200, ge=8, le=100_000, description="samples per evaluation (compared with "
                     "as many real images; keep it fixed across a run: FD depends on it)")
    sampler: SamplerName = "dpmpp_2m"
    steps: Int = Field(20, ge=1, le=100_000)
    cfg_scale: float | None = Field(None, ge=0.0, le=100.0,
                                    description="guidance scale; null: sample.cfg_scale")
    seed: Int = Field(0, ge=0, description="sampling seed: every evaluation uses the same noise")
    metric: EvalMetric = Field(
        "fd", description="what 'best' and early stopping follow (fd, kid: lower is better)")
    k: Int = Field(3, ge=1, le=100, description="nearest neighbours for precision/recall")
    patience: Int = Field(0, ge=0, description="evaluations without an improvement before "
                          "the run stops early; 0: never stop early")
    min_delta: float = Field(0.0, ge=0.0, description="an improvement must exceed this")
    keep_best: Bool = Field(True, description="keep the best checkpoint by metric in "
                            "checkpoints/best (never rotated away)")

    @model_validator(mode="after")
    def _check(self) -> "EvalConfig":
        if self.k >= self.num:
            raise ValueError(f"eval.k ({self.k}) must be below eval.num ({self.num})")
        return self


# --------------------------------------------------------------------------- logging


class LoggingConfig(Section):
    log_every: Int = Field(25, ge=1, description="steps between metrics.jsonl rows")
    progress: Bool = Field(True, description="show progress: a bar on a terminal; in a log "
                           "(CI, SLURM, a pipe) a status line every log_every steps")
    tensorboard: Bool = Field(False, description="also write TensorBoard event files "
                              "(pip install 'steadydiff[tensorboard]')")
    layer_stats_every: Int = Field(100, ge=0, description="steps between per-layer statistics "
                                   "(layers.jsonl: grad/weight norms, attention and norm "
                                   "probes); 0 disables them")
    report: Bool = Field(True, description="write report.html at the end of the run")


# --------------------------------------------------------------------------- guard


class GuardConfig(Section):
    """The stability guard: detection thresholds, recovery policy, and its budget."""

    enabled: Bool = True
    # detection
    warmup_steps: Int = Field(50, ge=0, description="spike detectors observe but do not fire")
    momentum: float = Field(0.97, ge=0.0, lt=1.0,
                            description="EMA momentum of the running mean/variance (ZClip)")
    grad_z: float = Field(6.0, gt=0.0, description="grad-norm spike: z-score threshold")
    loss_z: float = Field(7.0, gt=0.0, description="loss spike: z-score in its t-bucket")
    loss_ratio: float = Field(5.0, ge=1.0,
                              description="loss spike: also at least this x the bucket mean")
    t_buckets: Int = Field(10, ge=1, le=1000)
    divergence_window: Int = Field(1000, ge=0, description="steps; 0 disables the detector")
    divergence_ratio: float = Field(1.5, gt=1.0,
                                    description="smoothed loss risen this x above its best")
    trend_window: Int = Field(48, ge=0, description="steps over which sustained growth of "
                              "the grad norm and the loss is read (robust: the medians of "
                              "the window's thirds); 0 disables the detector")
    trend_grad_ratio: float = Field(2.0, gt=1.0, description="trend: the grad norm's median "
                                    "rose this x from the first third to the last")
    trend_loss_ratio: float = Field(1.2, gt=1.0, description="trend: and the loss's median "
                                    "this x")
    trend_lr_rise: float = Field(1.1, gt=1.0, description="trend: an LR that rose this x "
                                 "across the window makes it lr_too_high (else divergence)")
    lr_cap_fraction: float = Field(0.5, gt=0.0, lt=1.0, description="lr_too_high: cap the LR "
                                   "at this x the LR at which training was last stable")
    sample_drop_max: float = Field(0.25, ge=0.0, le=1.0, description="a data incident "
                                   "singled down to at most this fraction of the batch drops "
                                   "those samples and trains on the rest; 0: skip the batch")
    quarantine_after: Int = Field(2, ge=0, description="a sample implicated this many times "
                                  "is never drawn again this run; 0: never quarantine")
    overflow_limit: Int = Field(8, ge=1, description="fp16 overflow skips within "
                                "overflow_window before falling back in precision")
    overflow_window: Int = Field(100, ge=1)
    probe_every: Int = Field(100, ge=0, description="attention/normalization probes every N "
                             "steps (one extra forward: ~0.4% per step at 100 on the "
                             "quick-start model, docs/BENCHMARKS.md); 0: only on incidents")
    attn_logit_limit: float = Field(50.0, gt=0.0, description="max attention logit")
    attn_entropy_min: float = Field(0.05, ge=0.0, description="nats; below: collapsed")
    norm_var_ratio: float = Field(1.0, gt=0.0, description="norm input variance below this "
                                  "x eps is the eps-dominated regime")
    norm_affine_limit: float = Field(1e3, gt=0.0, description="max |affine| of a norm layer")
    lr_jump: float = Field(10.0, gt=1.0, description="a learning rate this x above the "
                           "largest applied so far is a schedule/config bug: skip the step")
    weight_jump: float = Field(10.0, gt=1.0, description="a parameter whose norm grows this "
                               "x in one step (RMS floor 0.05) is corrupt: roll back")
    update_ratio: float = Field(10.0, ge=0.0, description="an applied update whose "
                                "|update|/|weight| per unit LR is this x its parameter's own "
                                "running mean and this x the step's median over parameters is "
                                "a large_update: the step is undone; 0 disables the check")
    provenance: Bool = Field(True, description="replay a non-finite step to name the module")
    rerun_nonfinite: Bool = Field(True, description="run a non-finite step once more with the "
                                  "same data, timesteps and noise: finite the second time is a "
                                  "transient fault (its update is taken, no data skipped)")
    rank_check_every: Int = Field(100, ge=0, description="torchrun: every N steps compare a "
                                  "fingerprint of the weights across ranks; a mismatch is an "
                                  "incident and the ranks are resynchronized; 0 disables it")
    check_every: Int = Field(10, ge=1, le=10_000, description="steadydiff's trainer judges "
                             "the steps this many at a time: no host read (on a GPU, no "
                             "sync) in between; a failed step sends the run back to the "
                             "window's start and is judged on its own, with the outcome of "
                             "a per-step check (docs/guard.md). 1: every step at once")
    # recovery
    snapshot_every: Int = Field(50, ge=1, description="steps between verified snapshots")
    snapshots: Int = Field(3, ge=1, le=100, description="snapshot ring size (in memory)")
    skips_before_rollback: Int = Field(3, ge=1, description="skips within skip_window "
                                       "before escalating to a rollback")
    skip_window: Int = Field(50, ge=1)
    skip_batches: Int = Field(0, ge=0, description="after a rollback, also skip this many "
                              "batches from the snapshot's position (besides the implicated "
                              "ones)")
    lr_backoff: float = Field(0.5, gt=0.0, le=1.0, description="LR factor after a rollback")
    lr_backoff_steps: Int = Field(200, ge=0, description="steps before the LR is restored")
    precision_fallback: Bool = Field(True, description="fp16 -> bf16 -> fp32 on persistent "
                                     "overflow")
    oom_backoff: Bool = Field(True, description="on out-of-memory, halve the micro-batch and "
                              "double gradient accumulation")
    max_rollbacks: Int = Field(5, ge=0, description="rollbacks per budget_window, then abort")
    max_skips: Int = Field(100, ge=0, description="skipped steps per budget_window, then abort")
    budget_window: Int = Field(1000, ge=1)


# --------------------------------------------------------------------------- adapter


class AdapterConfig(Section):
    """Fine-tuning with an adapter over frozen base weights (see docs/adapters.md)."""

    kind: AdapterKind = Field(
        "none", description="none: train the whole model (no fine-tuning); embedding (alias "
        "textual_inversion): new token(s) of a Stable Diffusion model whose embeddings alone "
        "train (docs/sd.md#textual-inversion)")
    base: str | None = Field(None, description="base weights: a steadydiff checkpoint or run "
                             "directory, or a .safetensors file whose keys match the model")
    use_ema_base: Bool = Field(True, description="steadydiff checkpoint: start from its EMA "
                               "weights (else the raw model weights)")
    base_precision: Precision = Field(
        "fp32", description="dtype the frozen base is kept in; the adapter trains in fp32")
    targets: tuple[str, ...] = Field(
        ("*",), min_length=1, description="module-name patterns (fnmatch globs, or 're:' + a "
        "regular expression): lora adapts the matching Linear/Conv2d/Embedding layers, "
        "hypernetwork the matching attention layers")
    rank: Int = Field(4, ge=1, le=4096, description="lora: rank r of the delta B @ A")
    alpha: float | None = Field(None, gt=0.0, description="lora: the delta is scaled by "
                                "alpha / rank; None: alpha = rank (scale 1)")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="lora: dropout on the adapter "
                           "path's input")
    hidden_mult: float = Field(2.0, gt=0.0, le=16.0, description="hypernetwork: hidden width "
                               "of each key/value MLP, x the attention width")
    hyper_activation: HyperActivation = Field(
        "linear", description="hypernetwork over a Stable Diffusion UNet (model.pretrained): "
        "the activation between the MLP's layers, A1111's names (linear, relu, leakyrelu, "
        "elu, swish, tanh, sigmoid, mish); steadydiff's own models use SiLU")
    max_delta_ratio: float = Field(1.0, ge=0.0, description="|dW|/|W| above which a module's "
                                   "delta is rescaled (an incident); 0 disables the clamp")
    monitor_every: Int = Field(1, ge=0, description="steps between delta-norm checks; 0: off")
    text_encoder: Bool = Field(
        False, description="model.pretrained with adapter.kind=lora: also train a LoRA (same "
        "rank/alpha/dropout) on the text encoder's attention projections; its embeddings are "
        "then computed in the step, not cached")
    lora_format: LoraFormat = Field(
        "both", description="model.pretrained LoRA exports: diffusers (RUN/lora/"
        "pytorch_lora_weights.safetensors, pipe.load_lora_weights), kohya (RUN/lora/<run "
        "name>.safetensors, the lora_unet_/lora_te_ file A1111 and ComfyUI load), or both")
    variant: LoraVariant = Field(
        "lora", description="model.pretrained LoRA: lora; dora (DoRA, Liu et al. 2024: a "
        "learned magnitude per output row; kohya file with LyCORIS' dora_scale); locon (LoRA "
        "also on the UNet's ResNet and sampler convolutions, kohya's conv_dim, same rank); "
        "loha (LyCORIS' LoHa: two rank-r products multiplied elementwise); lokr (LyCORIS' "
        "LoKr: a Kronecker product, split by adapter.factor); LoHa/LoKr files are LyCORIS' "
        "(the kohya layout; diffusers reads a LoKr for Z-Image only); "
        "docs/sd.md#lora-variants")
    factor: Int = Field(
        -1, ge=-1, description="adapter.variant=lokr: LyCORIS' factor, the size of the first "
        "Kronecker factor's side (kohya's network_args factor=); -1: as square as the layer's "
        "widths allow")
    keep_files: Int | None = Field(
        None, ge=1, le=100000, description="model.pretrained LoRA/hypernetwork: every save also "
        "writes numbered files (RUN/lora/<run>-step00001000.safetensors and pytorch_lora_"
        "weights-step00001000.safetensors; RUN/hypernetwork/<run>-step...): keep the newest N "
        "steps' (the best evaluation's always stays); None: keep all. Independent of "
        "train.keep_checkpoints")
    init_from: str | None = Field(
        None, description="model.pretrained LoRA: start from this LoRA (a kohya/A1111 "
        ".safetensors, or a diffusers LoRA folder/file) instead of B = 0; its rank and alpha "
        "must equal adapter.rank/alpha")
    token: str | None = Field(
        None, description="adapter.kind=embedding: the new token trained (e.g. <sks>); it "
        "names RUN/embeddings/<token>.safetensors and must appear in the captions "
        "(data.trigger can put it there)")
    init_token: str | None = Field(
        None, description="adapter.kind=embedding: one existing token whose embedding starts "
        "every vector (e.g. dog, person, style); None: the mean of the embedding table")
    num_vectors: Int = Field(1, ge=1, le=75, description="adapter.kind=embedding: vectors "
                             "per token (<token>, <token>_1, ... as diffusers names them)")

    @field_validator("kind", mode="before")
    @classmethod
    def _kind_alias(cls, v: Any) -> Any:
        return "embedding" if v == "textual_inversion" else v

    # adapter.base is required unless model.pretrained is the base: checked by Config


# --------------------------------------------------------------------------- controlnet


class ControlNetConfig(Section):
    """Training a ControlNet over a frozen Stable Diffusion model (SD 1.x/2.x, SDXL, SD3,
    FLUX.1; docs/controlnet.md)."""

    enabled: Bool = Field(
        False, description="train a ControlNet (Zhang et al. 2023) beside model.pretrained's "
        "frozen UNet or transformer, on (image, conditioning image, caption) triples "
        "(data.conditioning)")
    init_from: str | None = Field(
        None, description="continue this local ControlNet (a diffusers ControlNet folder with "
        "config.json, or a single .safetensors in the diffusers or original layout beside a "
        "config.json); null: ControlNetModel.from_unet(the base UNet) or SD3ControlNetModel/"
        "FluxControlNetModel.from_transformer(the base transformer), zero layers at zero")
    conditioning_channels: Int = Field(
        3, ge=1, le=16, description="channels of the conditioning image (3: RGB, as "
        "diffusers' ControlNets; 1: gray); with controlnet.init_from, that model's")
    num_layers: Int | None = Field(
        None, ge=1, le=64, description="an SD3/FLUX.1 ControlNet built from the base "
        "transformer: how many of its first (joint/double) blocks it copies; null: diffusers' "
        "trainers' default (SD3 12, FLUX.1 4), at most the base's. UNet ControlNets copy the "
        "whole encoder")
    num_single_layers: Int | None = Field(
        None, ge=0, le=64, description="a FLUX.1 ControlNet: how many single blocks it "
        "copies; null: diffusers' train_controlnet_flux.py default (4), at most the base's")
    scale: float = Field(
        1.0, ge=0.0, le=10.0, description="sampling: the ControlNet's residuals x this "
        "(diffusers' controlnet_conditioning_scale); validation prompts and `steadydiff "
        "sample --control-scale`")
    start: float = Field(
        0.0, ge=0.0, le=1.0, description="sampling: the fraction of the steps after which "
        "the control starts (diffusers' control_guidance_start)")
    end: float = Field(
        1.0, ge=0.0, le=1.0, description="sampling: the fraction of the steps after which "
        "the control stops (diffusers' control_guidance_end)")
    control_images: tuple[str, ...] = Field(
        (), description="validation: one conditioning image per sample.prompts entry "
        "(cycled; paths, relative to the working directory); empty: the conditioning images "
        "of the first dataset items")

    @model_validator(mode="after")
    def _check(self) -> "ControlNetConfig":
        if self.start >= self.end:
            raise ValueError(f"controlnet.start ({self.start}) must be below controlnet.end "
                             f"({self.end}): the control acts on the steps between them")
        return self


# --------------------------------------------------------------------------- faults


class FaultConfig(Section):
    """One injected fault (for tests and the stability benchmark; see docs/faults.md)."""

    kind: FaultKind
    step: Int = Field(ge=0, description="optimizer step at which it fires")
    factor: float | None = Field(None, description="outlier/loss/lr/huge multiplier (default "
                                 "1e4; fp16_overflow 1e5; attn_logit_overflow: the max logit "
                                 "as a multiple of 65504, default 8); oom: the largest micro-batch that "
                                 "fits (default: half the current one); hang: seconds "
                                 "(default: forever); bad_sample: the sample x factor (default: "
                                 "one NaN pixel); lr_ramp: the LR's growth per step (default "
                                 "1.05); weight_corrupt: the value one element becomes "
                                 "(default 1e36); attn_logit_overflow: the largest logit x "
                                 "65504 (default 8)")
    steps: Int = Field(1, ge=1, description="lr_scale, lr_ramp, attn_logit_overflow: for how "
                       "many steps")
    index: Int | None = Field(None, ge=0, description="bad_sample: the dataset index that is "
                              "corrupt every time it is drawn")
    target: str | None = Field(None, description="parameter (param_*, grad_nan) or module "
                               "(fp16_overflow, attn_logit_overflow) name; None: a default "
                               "one")
    where: FaultWhere = Field(
        "in_step", description="kill, hang: where in the step the process is killed / "
        "stops responding")
    rank: Int | None = Field(None, ge=0, description="torchrun: fire on this rank only; "
                             "None: on every rank")

    @model_validator(mode="after")
    def _check(self) -> "FaultConfig":
        if (self.kind == "bad_sample") != (self.index is not None):
            raise ValueError("index (a dataset index) is required by bad_sample and "
                             f"meaningless for {self.kind}" if self.kind != "bad_sample" else
                             "bad_sample needs index: the dataset index of the corrupt sample")
        return self


class Config(Section):
    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    diffusion: DiffusionConfig = DiffusionConfig()
    optim: OptimConfig = OptimConfig()
    train: TrainConfig = TrainConfig()
    sample: SampleConfig = SampleConfig()
    logging: LoggingConfig = LoggingConfig()
    eval: EvalConfig = EvalConfig()
    guard: GuardConfig = GuardConfig()
    adapter: AdapterConfig = AdapterConfig()
    controlnet: ControlNetConfig = ControlNetConfig()
    faults: tuple[FaultConfig, ...] = ()

    @model_validator(mode="after")
    def _check(self) -> "Config":
        a, m, d = self.adapter, self.model, self.data
        if m.single_file_config and not m.pretrained:
            raise ValueError("model.single_file_config is the config of a single-file "
                             "model.pretrained: set model.pretrained to the .safetensors file "
                             "or remove it")
        if a.kind != "none" and not a.base and not m.pretrained:
            raise ValueError(f"adapter.kind={a.kind} needs adapter.base: a steadydiff "
                             "checkpoint or run directory, or a .safetensors file (or "
                             "model.pretrained: a Stable Diffusion folder)")
        if a.init_from and not (m.pretrained and a.kind == "lora"):
            raise ValueError("adapter.init_from starts a Stable Diffusion LoRA from a file: it "
                             "needs model.pretrained and adapter.kind=lora")
        if a.hyper_activation != "linear" and not (m.pretrained and a.kind == "hypernetwork"):
            raise ValueError(f"adapter.hyper_activation={a.hyper_activation} applies to a "
                             "hypernetwork over a Stable Diffusion UNet (model.pretrained, "
                             "adapter.kind=hypernetwork); remove it")
        if m.pretrained and a.base:
            raise ValueError("model.pretrained is the base of the adapter: remove adapter.base")
        if a.kind == "embedding" and not m.pretrained:
            raise ValueError("adapter.kind=embedding (textual inversion) adds tokens to a "
                             "Stable Diffusion model's text encoders: it needs "
                             "model.pretrained (an SD 1.x/2.x or SDXL folder or file)")
        if a.kind == "embedding" and not a.token:
            raise ValueError("adapter.kind=embedding needs adapter.token: the new word to "
                             "train, e.g. adapter.token='<sks>'")
        if a.kind != "embedding" and (a.token or a.init_token or a.num_vectors != 1):
            raise ValueError("adapter.token, adapter.init_token and adapter.num_vectors "
                             "configure textual inversion: set adapter.kind=embedding or "
                             "remove them")
        if a.kind == "embedding" and m.offload_text_encoders:
            raise ValueError("model.offload_text_encoders: textual inversion runs the text "
                             "encoders in every step; set model.offload_text_encoders=false")
        if a.variant != "lora" and not (m.pretrained and a.kind == "lora"):
            raise ValueError(f"adapter.variant={a.variant} is a LoRA variant over a model "
                             "family's denoiser: it needs model.pretrained and "
                             "adapter.kind=lora")
        if a.variant in ("loha", "lokr") and a.dropout:
            raise ValueError(f"adapter.dropout={a.dropout}: peft's {a.variant} layers have no "
                             "dropout on their input (LyCORIS' rank/module dropout are not "
                             "trained here); set adapter.dropout=0")
        if a.factor != -1 and a.variant != "lokr":
            raise ValueError(f"adapter.factor={a.factor} splits a LoKr's Kronecker factors; "
                             f"adapter.variant is {a.variant}: set adapter.variant=lokr or "
                             "remove adapter.factor")
        if a.factor == 0:
            raise ValueError("adapter.factor=0: use -1 (as square as possible) or a side "
                             "length >= 1")
        if a.variant in ("dora", "loha", "lokr") and m.quantize_base:
            raise ValueError(f"adapter.variant={a.variant}: peft's {a.variant} layers read "
                             f"the base weight, which model.quantize_base={m.quantize_base} "
                             "stores in a form they do not read: use adapter.variant=lora "
                             "with it, or drop model.quantize_base")
        if a.text_encoder and not (m.pretrained and a.kind == "lora"):
            raise ValueError("adapter.text_encoder trains a LoRA on a Stable Diffusion text "
                             "encoder: it needs model.pretrained and adapter.kind=lora"
                             + (" (a hypernetwork transforms the UNet's cross-attention "
                                "context, not the text encoder: set adapter.text_encoder="
                                "false)" if a.kind == "hypernetwork" else ""))
        if m.offload_text_encoders and (not m.pretrained or d.caption_shuffle
                                        or (a.kind == "lora" and a.text_encoder)):
            raise ValueError("model.offload_text_encoders moves a pretrained model's text "
                             "encoders off the device once the captions are cached; with "
                             "data.caption_shuffle or adapter.text_encoder they encode in "
                             "every step: set model.offload_text_encoders=false")
        if m.quantize_base and not (m.pretrained and a.kind == "lora"):
            raise ValueError(f"model.quantize_base={m.quantize_base} stores a pretrained "
                             "model's frozen base in 8 bits under a LoRA: it needs "
                             "model.pretrained and adapter.kind=lora (a full fine-tune trains "
                             "the weights it would quantize)")
        if m.quantize_base and self.train.precision != "bf16":
            raise ValueError(f"model.quantize_base={m.quantize_base} computes the 8-bit base "
                             f"in bf16: set train.precision=bf16 (it is "
                             f"{self.train.precision})")
        for key in ("max_sequence_length", "guidance"):
            if getattr(m, key) is not None and not m.pretrained:
                raise ValueError(f"model.{key} configures a pretrained model family's text "
                                 "encoder or transformer (model.pretrained): remove it")
        if m.pretrained and (m.text_encoder or m.vae):
            raise ValueError("model.pretrained brings its own text encoder and VAE: remove "
                             "model.text_encoder and model.vae")
        if d.caption_shuffle and not m.pretrained:
            raise ValueError("data.caption_shuffle encodes each step's shuffled captions with "
                             "the text encoder in the step, which the Stable Diffusion path "
                             "does (model.pretrained); with model.text_encoder the captions "
                             "are encoded once: remove data.caption_shuffle")
        text = bool(m.pretrained or m.text_encoder)
        if text and d.captions == "none":
            raise ValueError("a text-conditioned model (model.pretrained or model.text_encoder) "
                             "needs captions: set data.captions (auto, txt, jsonl, or "
                             "class_names for digits/Fashion-MNIST)")
        if d.captions != "none" and not text:
            raise ValueError(f"data.captions={d.captions} needs a text encoder: set "
                             "model.pretrained (Stable Diffusion) or model.text_encoder, or "
                             "data.captions=none")
        if self.sample.prompts and not text:
            raise ValueError("sample.prompts are validation prompts for a text-conditioned "
                             "model, but this one is not (no model.pretrained or "
                             "model.text_encoder): remove sample.prompts (the grids show one "
                             "column per class, or unconditional samples)")
        if not m.pretrained:
            for i, p in enumerate(self.sample.prompts):
                for k in ("width", "height"):
                    if getattr(p, k) not in (None, d.image_size):
                        raise ValueError(
                            f"sample.prompts.{i}.{k}={getattr(p, k)}: steadydiff's own "
                            f"{m.kind} samples at data.image_size ({d.image_size}) only; "
                            "another size needs a Stable Diffusion UNet (model.pretrained)")
        if text and m.num_classes:
            raise ValueError("a text-conditioned model is conditioned on captions: set "
                             "model.num_classes=0")
        if d.buckets and not m.pretrained:
            raise ValueError("data.buckets trains non-square batches, which a Stable Diffusion "
                             "UNet (model.pretrained) accepts; steadydiff's own UNet and DiT "
                             "are built for data.image_size squares (the DiT's position "
                             "embeddings, the sample grid, the evaluator): set "
                             "model.pretrained or data.buckets=false")
        if (m.pretrained or m.vae) and d.hflip:
            raise ValueError("data.hflip flips images, but a latent-space model trains on "
                             "latents encoded once, before the first step: set "
                             "data.hflip=false (or flip the image files themselves)")
        # (train.precision=auto is checked once resolved: trainer/speed.py validates again)
        if a.kind != "none" and self.train.precision != "auto" \
                and a.base_precision not in ("fp32", self.train.precision):
            raise ValueError(
                f"adapter.base_precision={a.base_precision} needs autocast in that dtype: set "
                f"train.precision={a.base_precision} (now {self.train.precision}), or "
                "adapter.base_precision=fp32")
        obj = self.diffusion.objective
        if self.sample.sampler not in OBJECTIVE_SAMPLERS[obj]:
            raise ValueError(f"sample.sampler={self.sample.sampler} does not apply to "
                             f"diffusion.objective={obj}; valid: "
                             f"{', '.join(OBJECTIVE_SAMPLERS[obj])}")
        if m.pretrained and obj == "edm":
            raise ValueError("diffusion.objective=edm: a pretrained model trains with the "
                             "objective its scheduler folder describes (ddpm for Stable "
                             "Diffusion 1.x/2.x and SDXL, flow for SD3 and FLUX.1); remove "
                             "diffusion.objective (edm trains steadydiff's own UNet and DiT)")
        if self.optim.clip_mode == "zclip" and not self.guard.enabled:
            raise ValueError("optim.clip_mode=zclip takes its threshold from the guard's "
                             "grad-norm statistics; set guard.enabled=true or choose "
                             "optim.clip_mode global, per_layer or agc")
        if self.train.ema_posthoc and a.kind != "none":
            raise ValueError(f"train.ema_posthoc is not supported with adapter.kind={a.kind} "
                             "yet; set train.ema_posthoc=false, or adapter.kind=none")
        if self.eval.every and self.data.dataset not in LABELLED_DATASETS:
            raise ValueError("eval.every needs a labelled dataset for its feature network "
                             f"(data.dataset {' or '.join(LABELLED_DATASETS)}); an image "
                             "folder has none: set eval.every=0 and use `steadydiff eval "
                             "--inception-weights` (see docs/evaluation.md)")
        self._check_controlnet()
        self._check_fsdp()
        return self

    def _check_controlnet(self) -> None:
        """A ControlNet trains beside a frozen Stable Diffusion UNet on paired data."""
        c, d = self.controlnet, self.data
        if d.conditioning != "none" and not c.enabled:
            raise ValueError(f"data.conditioning={d.conditioning} pairs images with "
                             "conditioning images for ControlNet training: set "
                             "controlnet.enabled=true, or data.conditioning=none")
        if not c.enabled:
            for key, off in (("init_from", None), ("control_images", ()),
                             ("num_layers", None), ("num_single_layers", None)):
                if getattr(c, key) != off:
                    raise ValueError(f"controlnet.{key} applies to ControlNet training: set "
                                     f"controlnet.enabled=true or remove controlnet.{key}")
            return
        if not self.model.pretrained:
            raise ValueError("controlnet.enabled trains a ControlNet for a Stable Diffusion "
                             "model: set model.pretrained (a local diffusers folder or "
                             "single file)")
        if self.adapter.kind != "none":
            raise ValueError(f"controlnet.enabled trains the ControlNet with the base UNet "
                             f"frozen; adapter.kind={self.adapter.kind} would train the UNet "
                             "too: set adapter.kind=none (train a LoRA in its own run and "
                             "sample with both: steadydiff sample RUN --lora FILE)")
        if d.caption_shuffle:
            raise ValueError("data.caption_shuffle runs the text encoder in the step, which "
                             "ControlNet training does not support: set "
                             "data.caption_shuffle=false (data.caption_dropout works)")
        if self.train.parallel == "fsdp":
            raise ValueError("train.parallel=fsdp shards a full fine-tune; a ControlNet "
                             "trains under train.parallel=ddp")

    def _check_fsdp(self) -> None:
        """What train.parallel=fsdp does not combine with (yet): each named with the way out
        (docs/distributed.md, "FSDP")."""
        t = self.train
        if t.fsdp_offload and t.parallel != "fsdp":
            raise ValueError("train.fsdp_offload keeps FSDP's shards in CPU memory: it needs "
                             "train.parallel=fsdp (or set train.fsdp_offload=false)")
        if t.parallel != "fsdp":
            return
        refused = [
            (self.adapter.kind != "none", f"adapter.kind={self.adapter.kind} (an adapter's "
             "trainable part is small: use train.parallel=ddp)"),
            (self.data.caption_shuffle, "data.caption_shuffle (the text encoder would run "
             "in the step, inside the sharded model: set it false)"),
            (t.precision == "fp16", "train.precision=fp16 (the grad scaler would see only "
             "each rank's shard: use bf16 or fp32)"),
            (t.ema_posthoc, "train.ema_posthoc (set it false)"),
            (t.compile, "train.compile (set it false)"),
            (bool(self.eval.every), "eval.every (set eval.every=0 and run `steadydiff eval "
             "RUN` afterwards: it reads the sharded checkpoint)"),
            (self.optim.optimizer != "adamw", f"optim.optimizer={self.optim.optimizer} "
             "(use adamw)"),
            (self.optim.clip_mode == "per_layer", "optim.clip_mode=per_layer (use global, "
             "agc or zclip)"),
        ]
        bad = [why for hit, why in refused if hit]
        if bad:
            raise ValueError("train.parallel=fsdp does not support " + "; ".join(bad))

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def differences(self) -> list[tuple[str, Any, Any]]:
        """The keys whose value differs from the default: ``[(dotted key, value, default)]``,
        in the config's order. What a run changed, out of ~190 keys (printed first by
        ``train --dry-run`` and ``--print-config``)."""
        mine, default = dict(_leaves(self.to_dict())), dict(_leaves(_defaults().to_dict()))
        return [(k, v, default.get(k)) for k, v in mine.items() if default.get(k, _NO) != v]

    def changed_yaml(self) -> str:
        """The keys that differ from the defaults, as a (nested, valid) YAML config: a
        config file holding only them loads to this same config."""
        tree: dict[str, Any] = {}
        for key, value, _ in self.differences():
            *sections, leaf = key.split(".")
            node = tree
            for part in sections:
                node = node.setdefault(part, {})
            node[leaf] = value
        return yaml.safe_dump(tree, sort_keys=False) if tree else "{}\n"


_NO = object()


def _leaves(tree: Mapping[str, Any], prefix: str = "") -> Iterable[tuple[str, Any]]:
    """``("train.steps", 1000)`` for every leaf of a nested config dict (lists are leaves)."""
    for key, value in tree.items():
        if isinstance(value, Mapping) and value:
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


@functools.cache
def _defaults() -> "Config":
    return Config()


# --------------------------------------------------------------------------- loading

# Keys every script relies on; renaming one is a breaking change (see README).
STABLE_KEYS = (
    "data.dataset", "data.path", "data.image_size", "model.kind", "train.steps",
    "train.batch_size", "train.seed", "train.checkpoint_every", "train.sample_every",
    "train.precision", "optim.lr",
)


def _section_at(path: tuple[Any, ...]) -> type[BaseModel] | None:
    cls: type[BaseModel] = Config
    parts = list(path)
    while parts:
        field = cls.model_fields.get(str(parts.pop(0)))
        if field is None:
            return None
        ann, args = field.annotation, typing.get_args(field.annotation)
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            cls = ann
        elif (typing.get_origin(ann) is tuple and args and isinstance(args[0], type)
              and issubclass(args[0], BaseModel) and parts and isinstance(parts[0], int)):
            cls = args[0]  # an entry of a list of sections (sample.prompts.2, faults.0)
            parts.pop(0)
        else:
            return None
    return cls


def _type_name(ann: Any) -> str:
    """A field's type as the YAML author sees it: the tree's tuples are YAML lists."""
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if origin is typing.Annotated:  # Int, Bool: strict int, bool
        return _type_name(args[0])
    if origin is tuple:
        inner = _type_name(args[0]) if len(args) == 2 and args[1] is Ellipsis else \
            ", ".join(_type_name(a) for a in args)
        return f"list[{inner}]"
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if ann is type(None):
        return "null"
    return getattr(ann, "__name__", None) or str(ann).replace("typing.", "")


def _describe_range(path: tuple[Any, ...]) -> str:
    """Describe what values the field at ``path`` accepts, from its annotation and bounds."""
    parent = _section_at(path[:-1])
    if parent is None:
        return ""
    field = parent.model_fields.get(str(path[-1]))
    if field is None:
        return ""
    if getattr(field.annotation, "__origin__", None) is Literal:
        return ""  # pydantic's message already lists the allowed values
    ann = _type_name(field.annotation)
    bounds = []
    for m in field.metadata:
        for attr, sym in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            v = getattr(m, attr, None)
            if v is not None:
                bounds.append(f"{sym} {v}")
    desc = f" (expected {ann}"
    if bounds:
        desc += ", " + " and ".join(bounds)
    return desc + ")"


def format_validation_error(err: ValidationError, source: str = "config",
                            overrides: Iterable[str] = ()) -> str:
    """One line per error, naming the key, the value and what would be valid.

    An error at (or inside) a key that a ``--set`` override set is blamed on that override
    (``--set train.steps=true: ...``), not on the file ``source``.
    """
    by_key = {item.partition("=")[0].strip(): item for item in overrides if "=" in item}

    def blame(key: str) -> str | None:
        for k, item in by_key.items():
            if key == k or key.startswith(k + "."):
                return item
        return None

    lines: list[tuple[str | None, str]] = []  # (the override to blame or None, the line)
    for e in err.errors():
        loc = tuple(p for p in e["loc"])
        key = ".".join(str(p) for p in loc)
        if e["type"] == "extra_forbidden":
            parent = _section_at(loc[:-1])
            known = list(parent.model_fields) if parent else []
            hint = difflib.get_close_matches(str(loc[-1]), known, n=1, cutoff=0.6)
            msg = f"{key}: unknown key"
            if hint:
                prefix = ".".join(str(p) for p in loc[:-1])
                msg += f"; did you mean '{prefix + '.' if prefix else ''}{hint[0]}'?"
            msg += f" (valid keys here: {', '.join(known)})"
        elif e["type"] == "value_error" or not loc:
            msg = f"{key + ': ' if key else ''}{e['msg'].removeprefix('Value error, ')}"
        else:
            got = e.get("input")
            got_s = json.dumps(got) if isinstance(got, (int, float, str, bool, type(None))) else repr(got)
            # the tree's tuples are lists in YAML: say so in the author's terms
            text = e["msg"].replace("valid tuple", "valid list").replace("Tuple should",
                                                                         "List should")
            msg = f"{key}: {text}, got {got_s}{_describe_range(loc)}"
        item = blame(key) if key else None
        if item is None:  # a cross-field rule: blame the overrides of the keys it names
            named = [i for k, i in by_key.items() if k in msg]
            item = " --set ".join(named) or None
        lines.append((item, msg))
    if all(item is not None for item, _ in lines):
        head = "invalid --set override" + ("s" if len({i for i, _ in lines}) > 1 else "") + ":"
    else:
        head = f"invalid {source}:"
    return "\n".join([head] + [f"  --set {item}: {msg}" if item else f"  {msg}"
                                for item, msg in lines])


class _Loader(yaml.SafeLoader):
    """YAML without base-60 numbers (as YAML 1.2): PyYAML reads ``1:00:00:00`` as the
    integer 216000 and ``1:30`` as 90, which would silently misread a duration
    (``train.max_time``); here they stay strings, for the duration parser to read or refuse."""

    def resolve(self, kind, value, implicit):  # noqa: ANN001, ANN201 (PyYAML's signature)
        if kind is yaml.ScalarNode and implicit[0] and _BASE_60.fullmatch(value):
            return "tag:yaml.org,2002:str"
        return super().resolve(kind, value, implicit)


_BASE_60 = re.compile(r"[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?")


def _yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)  # noqa: S506 (a SafeLoader)


def _parse_value(text: str) -> Any:
    """``--set`` values are YAML scalars/lists: 1e-4, true, [1,2,2], null, cosine."""
    try:
        return _yaml(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"cannot parse override value {text!r}: {e}") from None


def _set_key(raw: dict[str, Any], key: str, value: Any) -> None:
    """Set the dotted ``key`` of a raw config dict to ``value``, creating sections on the way."""
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"override key {key!r} is empty or malformed")
    node = raw
    for p in parts[:-1]:
        nxt = node.setdefault(p, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"override {key!r}: '{p}' is a value, not a section")
        node = nxt
    node[parts[-1]] = value


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``section.key=value`` overrides to a raw (unvalidated) config dict."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form section.key=value")
        key, _, value = item.partition("=")
        _set_key(raw, key, _parse_value(value))
    return raw


def validate(raw: dict[str, Any], source: str = "config",
             overrides: Iterable[str] = ()) -> Config:
    """Validate a raw config dict; ``overrides`` (the ``--set`` items applied to it) are
    named in the errors they cause."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections, "
                          f"got {type(raw).__name__}")
    try:
        return Config.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, source, overrides)) from None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Load a YAML config file (or the defaults when ``path`` is None) and apply overrides."""
    raw: dict[str, Any] = {}
    source = "config"
    if path is not None:
        p = Path(path)
        source = str(p)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            raw = _yaml(p.read_text())
        except yaml.YAMLError as e:
            raise ConfigError(f"{p}: not valid YAML: {e}") from None
        if raw is None:  # an empty file (or only comments) is a mistake, not "all defaults"
            raise ConfigError(f"{p}: empty config; start from one in configs/ (e.g. "
                              "configs/digits_cond.yaml)")
        if not isinstance(raw, dict):
            raise ConfigError(f"{p}: the top level must be a mapping of sections")
    overrides = list(overrides or [])
    raw = apply_overrides(raw, overrides)
    return validate(raw, source, overrides)


def replace(cfg: Config, changes: Mapping[str, Any] | Iterable[str],
            source: str = "config") -> Config:
    """A validated copy of ``cfg`` with ``changes`` applied; ``cfg`` itself is unchanged.

    Args:
        cfg: a validated config.
        changes: ``{"train.steps": 5, "guard.enabled": False}`` (dotted keys, Python values),
            or ``--set`` strings: ``["train.steps=5", "guard.enabled=false"]``.
        source: names the config in error messages.

    Returns:
        The new config, validated like a loaded one: a typo, an out-of-range value or a
        broken cross-field rule is a :class:`ConfigError` naming the key. Which keys count
        as set by the user (lint reads ``model_fields_set``) carries over from ``cfg``.
    """
    raw = cfg.model_dump(mode="json", exclude_unset=True)
    if isinstance(changes, Mapping):
        for key, value in changes.items():
            if isinstance(value, BaseModel):
                value = value.model_dump(mode="json", exclude_unset=True)
            elif isinstance(value, (list, tuple)):
                value = [v.model_dump(mode="json", exclude_unset=True)
                         if isinstance(v, BaseModel) else v for v in value]
            _set_key(raw, key, value)
    else:
        if isinstance(changes, str):
            raise ConfigError(f"replace: pass a list of overrides, not the string {changes!r}")
        changes = list(changes)
        raw = apply_overrides(raw, changes)
        return validate(raw, source, changes)
    return validate(raw, source)


def config_diff(old: Config, new: Config) -> list[tuple[str, Any, Any]]:
    """Field-by-field differences between two configs: [(key, old, new)]."""
    out: list[tuple[str, Any, Any]] = []

    def walk(a: Any, b: Any, prefix: str) -> None:
        if isinstance(a, dict) and isinstance(b, dict):
            for k in dict.fromkeys([*a, *b]):
                walk(a.get(k), b.get(k), f"{prefix}.{k}" if prefix else k)
        elif a != b:
            out.append((prefix, a, b))

    walk(old.to_dict(), new.to_dict(), "")
    return out
