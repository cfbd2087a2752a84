"""Stable Diffusion 1.x and 2.x (Rombach et al. 2022): a UNet conditioned by cross-attention
on one CLIP text encoder's last hidden state, trained with a DDPM noise schedule.

A diffusers folder (what ``StableDiffusionPipeline.save_pretrained`` writes)::

    model_index.json        {"_class_name": "StableDiffusionPipeline", "unet": [...], ...}
    unet/                   config.json + diffusion_pytorch_model.safetensors
    vae/                    config.json + diffusion_pytorch_model.safetensors
    text_encoder/           config.json + model.safetensors   (CLIPTextModel)
    tokenizer/              vocab.json + merges.txt, or tokenizer.json
    scheduler/              scheduler_config.json

The scheduler's config decides the diffusion the UNet was trained with (:func:`ddpm_recipe`:
betas, prediction type eps or v, zero terminal SNR); steadydiff trains with the same.

Files: kohya's LoRA names are ``lora_unet_`` + diffusers' UNet module path, ``lora_te_`` +
the CLIP path (sd-scripts train SD 1.x/2.x on the diffusers UNet); a single file is the
original ``ldm`` layout (``model.diffusion_model.``, ``first_stage_model.``,
``cond_stage_model.transformer.``; ldm.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..sd.ldm import TEXT, UNET, LayoutError, clip_to_original, unet_to_original, vae_to_original
from .base import Family, Parts, SDFolderError, Setting, TextEncoder, read_json

__all__ = ["SD", "ddpm_recipe", "SCHEDULERS"]

# the scheduler classes an SD/SDXL folder may name (any of them: steadydiff reads the betas
# and the prediction type, and samples with its own samplers)
SCHEDULERS = ("PNDMScheduler", "DDPMScheduler", "DDIMScheduler", "EulerDiscreteScheduler",
              "EulerAncestralDiscreteScheduler", "LMSDiscreteScheduler",
              "DPMSolverMultistepScheduler", "UniPCMultistepScheduler")

_PREDICTIONS = {"epsilon": "eps", "v_prediction": "v", "sample": "x0"}
_SCHEDULES = {"scaled_linear": "scaled_linear", "linear": "linear",
              "squaredcos_cap_v2": "cosine"}


def ddpm_recipe(root: Path) -> dict[str, Any]:
    """The ``diffusion.*`` values a DDPM-family scheduler config implies (SD 1.x and
    2.x-base: eps; SD 2.x 768-v: v; ``rescale_betas_zero_snr``: zero terminal SNR).

    Raises:
        SDFolderError: a beta schedule or prediction type steadydiff does not train.
    """
    path = Path(root) / "scheduler" / "scheduler_config.json"
    s = read_json(path, "the scheduler's configuration")
    pred = s.get("prediction_type", "epsilon")
    if pred not in _PREDICTIONS:
        raise SDFolderError(f"{path}: prediction_type {pred!r} is not one steadydiff trains; "
                            f"valid: {', '.join(_PREDICTIONS)}")
    kind = s.get("beta_schedule", "linear")
    if s.get("trained_betas") is not None or kind not in _SCHEDULES:
        raise SDFolderError(f"{path}: beta_schedule {kind!r}"
                            f"{' with trained_betas' if s.get('trained_betas') else ''} is not "
                            f"supported; valid: {', '.join(_SCHEDULES)}")
    out: dict[str, Any] = {
        "diffusion.objective": "ddpm",
        "diffusion.timesteps": int(s.get("num_train_timesteps", 1000)),
        "diffusion.schedule": _SCHEDULES[kind],
        "diffusion.prediction": _PREDICTIONS[pred],
        "diffusion.zero_terminal_snr": bool(s.get("rescale_betas_zero_snr", False)),
    }
    if kind != "squaredcos_cap_v2":
        out["diffusion.beta_start"] = float(s.get("beta_start", 0.0001))
        out["diffusion.beta_end"] = float(s.get("beta_end", 0.02))
    return out


def single_file_error(e: Exception, f: Path, root: Path) -> SDFolderError:
    """diffusers' ``from_single_file`` failure as an :class:`SDFolderError` (a hub lookup
    named as such: steadydiff loads offline only)."""
    msg = str(e).splitlines()[0] if str(e) else ""
    offline = any(w in msg.lower() for w in ("offline", "connect", "huggingface.co",
                                               "local_files_only", "cache"))
    hint = (" (it tried to fetch a file from the hub: steadydiff loads offline only; "
            "model.single_file_config must hold every config)" if offline else
            f" (is {root} the same architecture as the file?)")
    return SDFolderError(f"model.pretrained: {f} does not load with model.single_file_config="
                         f"{root}: {type(e).__name__}: {msg}{hint}")


class SD(Family):
    """Stable Diffusion 1.x / 2.x."""

    name = "sd"
    label = "Stable Diffusion 1.x/2.x"
    title = "Stable Diffusion UNet"
    pipelines = ("StableDiffusionPipeline",)
    controlnet_file_layout = "original"  # lllyasviel's control_model.* releases
    parts = {
        "unet": ("UNet2DConditionModel",),
        "vae": ("AutoencoderKL",),
        "text_encoder": ("CLIPTextModel",),
        "tokenizer": ("CLIPTokenizer", "CLIPTokenizerFast"),
        "scheduler": SCHEDULERS,
    }
    text = (TextEncoder("text_encoder", "tokenizer", ("CLIPTextModel",), kohya="lora_te_"),)
    modelspec = "stable-diffusion-v1/lora"

    def owns(self, module: nn.Module) -> bool:
        return super().owns(module) and \
            getattr(module.config, "addition_embed_type", None) != "text_time"

    def recipe(self, root: Path) -> dict[str, Setting]:
        src = f"{Path(root).name}/scheduler/scheduler_config.json"
        return {k: Setting(v, src) for k, v in ddpm_recipe(root).items()}

    def base_version(self, denoiser: nn.Module) -> str:
        """``ss_base_model_version`` as sd-scripts spell it: sd_v1 or sd_v2 (a 1024-wide
        context, OpenCLIP)."""
        dim = denoiser.config.cross_attention_dim
        return "sd_v2" if (dim if isinstance(dim, int) else dim[0]) == 1024 else "sd_v1"

    # ------------------------------------------------------------------ single files

    def single_file_keys(self) -> tuple[str, ...]:
        return (UNET,)

    def load_single_file(self, f: Path, root: Path) -> Parts:
        from diffusers import StableDiffusionPipeline
        from diffusers.loaders.single_file_utils import SingleFileComponentError

        try:
            pipe = StableDiffusionPipeline.from_single_file(
                str(f), config=str(root), local_files_only=True, torch_dtype=torch.float32,
                safety_checker=None, feature_extractor=None, requires_safety_checker=False)
        except (OSError, ValueError, KeyError, RuntimeError, SingleFileComponentError) as e:
            raise single_file_error(e, f, root) from None
        return Parts(f, self, pipe.unet, pipe.vae.eval(), [pipe.tokenizer],
                     [pipe.text_encoder.eval()])

    def original_state_dict(self, denoiser: nn.Module, vae: nn.Module | None,
                            text_encoders: list[nn.Module | None],
                            prefix: str | None = None) -> dict[str, Tensor]:
        """UNet, VAE and the CLIP text encoder in the original SD 1.x layout (the CLIP
        under ``cond_stage_model.transformer.``).

        Raises:
            LayoutError: an SD 2.x OpenCLIP text encoder converted to transformers (its
                original layout is not written from a diffusers folder).
        """
        out = unet_to_original(denoiser)
        if vae is not None:
            out.update(vae_to_original(vae))
        te = text_encoders[0] if text_encoders else None
        if te is not None:
            act = getattr(te.config, "hidden_act", "quick_gelu")
            if act != "quick_gelu":  # SD 1.x CLIP ViT-L uses quick_gelu; SD 2.x OpenCLIP gelu
                raise LayoutError(
                    f"the text encoder (hidden_act={act}) looks like SD 2.x's OpenCLIP, whose "
                    "original layout (cond_stage_model.model.*) steadydiff does not write from "
                    "a diffusers folder; train from the SD 2.x single file instead (its text "
                    "encoder is then copied as it was), or use the diffusers folder RUN/model")
            out.update(clip_to_original(te, TEXT + "transformer."))
        return out

    # ------------------------------------------------------------------ tiny

    def tiny(self, path: Path, *, image_size: int = 32, seed: int = 0, hidden: int = 32,
             prediction: str = "epsilon", vae_widths: tuple[int, ...] = (16, 32),
             **kw: Any) -> Path:
        """A tiny SD 1.x/2.x-layout folder: a 2-level UNet with cross-attention of width
        ``hidden`` (= the CLIP's), the PNDM scheduler SD ships with ``prediction`` (epsilon;
        SD 2.x 768: v_prediction); a VAE of ``len(vae_widths)`` levels: latents image_size
        / 2 by default, / 8 (SD's) with four."""
        from diffusers import PNDMScheduler, StableDiffusionPipeline

        from ..sd.tiny_parts import tiny_text_encoder, tiny_tokenizer, tiny_unet, tiny_vae

        path = Path(path)
        # SD 1.x/2.x ship a PNDM scheduler config with these values
        sched = PNDMScheduler(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012,
                              beta_schedule="scaled_linear", prediction_type=prediction,
                              set_alpha_to_one=False, skip_prk_steps=True, steps_offset=1)
        pipe = StableDiffusionPipeline(
            unet=tiny_unet(hidden, image_size // 2 ** (len(vae_widths) - 1), seed=seed),
            vae=tiny_vae(widths=vae_widths, sample_size=image_size, seed=seed),
            text_encoder=tiny_text_encoder(hidden, seed=seed), tokenizer=tiny_tokenizer(),
            scheduler=sched, safety_checker=None, feature_extractor=None,
            requires_safety_checker=False)
        pipe.save_pretrained(path, safe_serialization=True)
        return path
