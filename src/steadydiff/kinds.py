"""Every enumeration of the config and the public API, defined once as a ``Literal``.

The config's fields, the public API's type hints, the CLI's ``choices``, the lint checks and
the registries that implement each value (``SAMPLERS``, ``DTYPES``, the DiT ``PRESETS``, ...)
all take their names from here, so adding a sampler or a precision is one edit in this file
plus its implementation, and a contract test (tests/test_kinds.py) fails until both agree.

Where code needs to list the values (``argparse`` choices, an error message, a registry
check) it uses the tuple next to each ``Literal``, derived with :func:`typing.get_args`, never
a second copy of the names.

Light by design: only ``typing`` is imported, so ``steadydiff.config`` (the CLI's ``--help``
and ``--dry-run``) stays free of torch.

Not here: the guard's incident kinds and actions (guard/findings.py) and the doctor's
severities (doctor.py) describe what a run did, not what a user configures.
"""

from __future__ import annotations

from typing import Literal, get_args

# --------------------------------------------------------------------------- data

DatasetName = Literal["digits", "fashion_mnist", "folder"]
DATASETS: tuple[DatasetName, ...] = get_args(DatasetName)

# Datasets with labels and a cached feature network (FD-digits, FD-fashion_mnist).
LabelledDataset = Literal["digits", "fashion_mnist"]
LABELLED_DATASETS: tuple[LabelledDataset, ...] = get_args(LabelledDataset)

# Where a dataset's captions come from (text-conditioned models; docs/sd.md):
#   none: no captions; auto: a .txt beside each image, else metadata.jsonl; txt: kohya's
#   .txt beside each image; jsonl: Hugging Face imagefolder's metadata.jsonl (file_name,
#   text); class_names: digits/Fashion-MNIST, "a photo of a sneaker" from the label.
CaptionSource = Literal["none", "auto", "txt", "jsonl", "class_names"]
CAPTION_SOURCES: tuple[CaptionSource, ...] = get_args(CaptionSource)

# An image without a caption: stop with an error naming it, or train it with "".
MissingCaption = Literal["error", "empty"]
MISSING_CAPTIONS: tuple[MissingCaption, ...] = get_args(MissingCaption)

# ControlNet training (controlnet.enabled; data/pairs.py): where each image's
# conditioning image is: none; folder (data.conditioning_dir, the same relative path, any
# image extension); jsonl (a column of metadata.jsonl, diffusers' train_controlnet.py
# convention); auto (the folder when it exists, else the column).
ConditioningSource = Literal["none", "auto", "folder", "jsonl"]
CONDITIONING_SOURCES: tuple[ConditioningSource, ...] = get_args(ConditioningSource)

# How an image and its conditioning image must agree: the same pixel size, or only the same
# aspect ratio (the conditioning image is then resized with the image's crop).
ConditioningMatch = Literal["size", "aspect"]
CONDITIONING_MATCHES: tuple[ConditioningMatch, ...] = get_args(ConditioningMatch)

# The conditioning images `steadydiff condition` makes (data/conditioning.py, OpenCV, no
# network weights): canny edges (double thresholds), grayscale (recolouring), tile (a
# blurred downscale: detail ControlNets).
ConditionKind = Literal["canny", "gray", "tile"]
CONDITION_KINDS: tuple[ConditionKind, ...] = get_args(ConditionKind)

Channels = Literal[1, 3]
CHANNELS: tuple[Channels, ...] = get_args(Channels)

Split = Literal["train", "test"]

# --------------------------------------------------------------------------- model

ModelKind = Literal["unet", "dit"]
MODEL_KINDS: tuple[ModelKind, ...] = get_args(ModelKind)

DiTPreset = Literal["tiny", "small", "S", "B", "L", "XL"]
DIT_PRESETS: tuple[DiTPreset, ...] = get_args(DiTPreset)

# --------------------------------------------------------------------------- diffusion

ScheduleName = Literal["linear", "cosine", "sigmoid", "piecewise", "scaled_linear"]
SCHEDULES: tuple[ScheduleName, ...] = get_args(ScheduleName)

# The training objective (docs/objectives.md): ddpm, the variance-preserving diffusion of a
# discrete schedule with diffusion.prediction (eps/x0/v); flow, rectified flow
# x = (1-σ)·x0 + σ·ε trained on the velocity ε - x0 (Liu et al. 2022; Esser et al. 2024);
# edm, Karras et al. 2022's preconditioned denoiser over x = x0 + σ·ε.
Objective = Literal["ddpm", "flow", "edm"]
OBJECTIVES: tuple[Objective, ...] = get_args(Objective)

# What the network predicts: the noise, the clean image, or v = alpha·eps - sigma·x0
# (Salimans & Ho 2022). The ddpm objective's; flow predicts ε - x0, edm its F.
Prediction = Literal["eps", "x0", "v"]
PREDICTIONS: tuple[Prediction, ...] = get_args(Prediction)

# uniform: no weighting (diffusers' "none"); min_snr: ddpm's min-SNR-γ; sigma_sqrt and
# cosmap: the flow objective's (diffusers' compute_loss_weighting_for_sd3).
LossWeighting = Literal["uniform", "min_snr", "sigma_sqrt", "cosmap"]
LOSS_WEIGHTINGS: tuple[LossWeighting, ...] = get_args(LossWeighting)
# the flow objective's weights (diffusers' compute_loss_weighting_for_sd3; uniform is its
# "none")
FlowWeighting = Literal["uniform", "sigma_sqrt", "cosmap"]
FLOW_WEIGHTINGS: tuple[FlowWeighting, ...] = get_args(FlowWeighting)

# Where a flow sampling grid ends before 0 (diffusion.flow.grid_end): steps, at 1/steps (the
# FLUX pipelines' linspace(1, 1/n, n)); table, at the training table's smallest level
# shift(1/T) (diffusers' FlowMatchEulerDiscreteScheduler default: SD3's pipeline).
FlowGridEnd = Literal["steps", "table"]
FLOW_GRID_ENDS: tuple[FlowGridEnd, ...] = get_args(FlowGridEnd)

# The density of the training noise level u in [0, 1] (t = u·T for ddpm, σ = u for flow;
# SD3 paper §3.1, kohya's sigmoid). edm draws ln σ from its own normal instead.
TimestepSampling = Literal["uniform", "logit_normal", "mode", "sigmoid"]
TIMESTEP_SAMPLINGS: tuple[TimestepSampling, ...] = get_args(TimestepSampling)

# --------------------------------------------------------------------------- sampling

SamplerName = Literal["ddpm", "ddim", "dpmpp_2m", "euler", "heun"]
SAMPLER_NAMES: tuple[SamplerName, ...] = get_args(SamplerName)

# Which samplers and loss weightings each objective takes (config validation, the API and
# the CLI refuse the others by name). heun is second order in the ODE of flow (x over σ)
# and edm (Karras et al. 2022, Alg. 1); ddpm's samplers are written over any (alpha, sigma).
OBJECTIVE_SAMPLERS: dict[Objective, tuple[SamplerName, ...]] = {
    "ddpm": ("ddpm", "ddim", "dpmpp_2m", "euler"),
    "flow": SAMPLER_NAMES,
    "edm": SAMPLER_NAMES,
}
OBJECTIVE_WEIGHTINGS: dict[Objective, tuple[LossWeighting, ...]] = {
    "ddpm": ("uniform", "min_snr"),
    "flow": FLOW_WEIGHTINGS,
    "edm": ("uniform",),  # EDM's λ(σ) is built in: its F-space loss has unit weight
}

# Which training timesteps a sampler visits (Lin et al. 2024, table 2).
Spacing = Literal["trailing", "leading", "linspace"]
SPACINGS: tuple[Spacing, ...] = get_args(Spacing)

# --------------------------------------------------------------------------- optim / train

LRSchedule = Literal["constant", "cosine"]
LR_SCHEDULES: tuple[LRSchedule, ...] = get_args(LRSchedule)
OptimizerName = Literal["adamw", "adamw8bit"]
OPTIMIZERS: tuple[OptimizerName, ...] = get_args(OptimizerName)
BucketCrop = Literal["center", "random"]  # data.bucket_crop: how an image is cut to its bucket
BUCKET_CROPS: tuple[BucketCrop, ...] = get_args(BucketCrop)
LoraFormat = Literal["diffusers", "kohya", "both"]  # adapter.lora_format: the files written
LORA_FORMATS: tuple[LoraFormat, ...] = get_args(LoraFormat)
# adapter.variant: plain LoRA; DoRA (Liu et al. 2024, weight-decomposed); LoCon (LoRA on the
# UNet's ResNet and sampler convolutions too, kohya's conv_dim)
LoraVariant = Literal["lora", "dora", "locon", "loha", "lokr"]
LORA_VARIANTS: tuple[LoraVariant, ...] = get_args(LoraVariant)

# ``optim.grad_clip = 0`` disables clipping, so there is no "none" mode.
ClipMode = Literal["global", "per_layer", "agc", "zclip"]
CLIP_MODES: tuple[ClipMode, ...] = get_args(ClipMode)

Precision = Literal["fp32", "bf16", "fp16"]
PRECISIONS: tuple[Precision, ...] = get_args(Precision)

# model.quantize_base: how a LoRA's frozen base is stored (integrations/quantize.py)
BaseQuantization = Literal["int8"]
BASE_QUANTIZATIONS: tuple[BaseQuantization, ...] = get_args(BaseQuantization)

# ``train.precision`` also takes ``auto``, resolved once per run to a :data:`Precision` on
# the device (trainer/speed.py: bf16 where native, else fp16 on CUDA; fp32 on the CPU).
PrecisionSetting = Literal["auto", "fp32", "bf16", "fp16"]
PRECISION_SETTINGS: tuple[PrecisionSetting, ...] = get_args(PrecisionSetting)

# The third value of an on/off speed switch (optim.fused, train.channels_last,
# data.pin_memory): chosen for the device at the start of a run (trainer/speed.py).
Auto = Literal["auto"]
AUTO: tuple[Auto, ...] = get_args(Auto)

DeviceName = Literal["auto", "cpu", "cuda"]
DEVICE_NAMES: tuple[DeviceName, ...] = get_args(DeviceName)

# train.parallel: how torchrun's processes share the model (trainer/sharding.py for fsdp)
Parallel = Literal["ddp", "fsdp"]
PARALLELS: tuple[Parallel, ...] = get_args(Parallel)

OnSaveError = Literal["retry", "stop"]
ON_SAVE_ERRORS: tuple[OnSaveError, ...] = get_args(OnSaveError)

# torch.compile's modes (inductor only) and the backends train.compile may use
CompileMode = Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]
COMPILE_MODES: tuple[CompileMode, ...] = get_args(CompileMode)

CompileBackend = Literal["inductor", "aot_eager", "eager"]
COMPILE_BACKENDS: tuple[CompileBackend, ...] = get_args(CompileBackend)

# --------------------------------------------------------------------------- eval

EvalMetric = Literal["fd", "kid", "precision", "recall", "class_accuracy"]
EVAL_METRICS: tuple[EvalMetric, ...] = get_args(EvalMetric)

# --------------------------------------------------------------------------- adapter

AdapterKind = Literal["none", "lora", "hypernetwork", "embedding"]
ADAPTER_KINDS: tuple[AdapterKind, ...] = get_args(AdapterKind)
# a Stable Diffusion hypernetwork's activation, A1111's names ("swish" is its Hardswish)
HyperActivation = Literal["linear", "relu", "leakyrelu", "elu", "swish", "tanh", "sigmoid",
                          "mish"]
HYPER_ACTIVATIONS: tuple[HyperActivation, ...] = get_args(HyperActivation)

# --------------------------------------------------------------------------- faults

FaultKind = Literal["nan_batch", "outlier_batch", "loss_scale", "lr_scale", "param_nan",
                    "param_huge", "bitflip", "grad_nan", "fp16_overflow", "oom", "kill",
                    "hang", "bad_sample", "lr_ramp", "weight_corrupt", "transient_nan",
                    "attn_logit_overflow"]
FAULT_KINDS: tuple[FaultKind, ...] = get_args(FaultKind)

FaultWhere = Literal["before_step", "in_step", "in_checkpoint"]
FAULT_WHERES: tuple[FaultWhere, ...] = get_args(FaultWhere)


__all__ = [
    "CONDITIONING_SOURCES", "ConditioningSource", "CONDITIONING_MATCHES", "ConditioningMatch",
    "CONDITION_KINDS", "ConditionKind",
    "ADAPTER_KINDS", "CAPTION_SOURCES", "CHANNELS", "COMPILE_BACKENDS", "COMPILE_MODES", "MISSING_CAPTIONS", "CLIP_MODES", "DATASETS", "DEVICE_NAMES", "DIT_PRESETS",
    "EVAL_METRICS", "FAULT_KINDS", "FAULT_WHERES", "LABELLED_DATASETS", "LOSS_WEIGHTINGS",
    "LR_SCHEDULES", "MODEL_KINDS", "ON_SAVE_ERRORS", "PRECISIONS", "PRECISION_SETTINGS",
    "PREDICTIONS", "AUTO", "Auto", "PrecisionSetting",
    "SAMPLER_NAMES", "SCHEDULES", "SPACINGS", "TIMESTEP_SAMPLINGS", "OBJECTIVES", "Objective",
    "FLOW_WEIGHTINGS", "FlowWeighting", "OBJECTIVE_SAMPLERS", "OBJECTIVE_WEIGHTINGS",
    "FLOW_GRID_ENDS", "FlowGridEnd",
    "AdapterKind", "LoraVariant", "LORA_VARIANTS", "HYPER_ACTIVATIONS", "HyperActivation", "CaptionSource", "Channels", "CompileBackend", "CompileMode", "MissingCaption", "ClipMode", "DatasetName", "DeviceName", "DiTPreset",
    "EvalMetric", "FaultKind", "FaultWhere", "LRSchedule", "OPTIMIZERS", "OptimizerName", "BUCKET_CROPS", "BucketCrop", "LORA_FORMATS", "LoraFormat", "LabelledDataset", "LossWeighting",
    "ModelKind", "OnSaveError", "PARALLELS", "Parallel", "Precision", "Prediction", "SamplerName", "ScheduleName",
    "Spacing", "Split", "TimestepSampling",
]
