"""A local Stable Diffusion model folder: its layout checked, its parts loaded.

A diffusers-format folder (what ``StableDiffusionPipeline.save_pretrained`` writes and the
Hugging Face hub holds) looks like::

    model_index.json        {"_class_name": "StableDiffusionPipeline", "unet": [...], ...}
    unet/                   config.json + diffusion_pytorch_model.safetensors
    vae/                    config.json + diffusion_pytorch_model.safetensors
    text_encoder/           config.json + model.safetensors
    tokenizer/              vocab.json + merges.txt, or tokenizer.json
    scheduler/              scheduler_config.json

Every part loads with ``local_files_only=True`` (nothing is downloaded) and from safetensors
only (``use_safetensors=True``: a pickled ``.bin`` is never unpickled). What is missing or
wrong is an :class:`SDFolderError` that names the file and says what would be valid. A
single-file checkpoint (``model.pretrained`` a ``.safetensors`` file) takes its configs from
``model.single_file_config``, a folder of this layout whose weights may be absent
(``source.model_root``; the weights come from the file, single_file.py). The scheduler's
config decides the diffusion the UNet was trained with (:func:`diffusion_settings`):
steadydiff trains with the same betas and prediction type.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...config import ConfigError

__all__ = ["SDFolderError", "SD_PARTS", "SDXL_PARTS", "check_folder", "read_json",
           "diffusion_settings", "is_sdxl_folder", "SDParts", "load_folder_parts",
           "load_text_parts", "load_vae"]

# The parts a Stable Diffusion 1.x/2.x folder must have, and the classes that may fill them
# (model_index.json names them as [library, class]).
SD_PARTS: dict[str, tuple[str, ...]] = {
    "unet": ("UNet2DConditionModel",),
    "vae": ("AutoencoderKL",),
    "text_encoder": ("CLIPTextModel",),
    "tokenizer": ("CLIPTokenizer", "CLIPTokenizerFast"),
    "scheduler": ("PNDMScheduler", "DDPMScheduler", "DDIMScheduler", "EulerDiscreteScheduler",
                  "EulerAncestralDiscreteScheduler", "LMSDiscreteScheduler",
                  "DPMSolverMultistepScheduler", "UniPCMultistepScheduler"),
}
SD_PIPELINES = ("StableDiffusionPipeline",)
# SDXL (Podell et al. 2023): two CLIP text encoders, the second with its projection (the
# pooled embedding); the base pipeline's layout. The refiner (an Img2Img folder without
# text_encoder/, conditioned on an aesthetic score) is refused by name.
SDXL_PARTS: dict[str, tuple[str, ...]] = {
    **SD_PARTS, "text_encoder_2": ("CLIPTextModelWithProjection",),
    "tokenizer_2": ("CLIPTokenizer", "CLIPTokenizerFast"),
}
SDXL_PIPELINES = ("StableDiffusionXLPipeline", "StableDiffusionXLImg2ImgPipeline")


class SDFolderError(ConfigError):
    """A Stable Diffusion folder that cannot be used as it is (exit code 2)."""


def read_json(path: Path, what: str) -> dict[str, Any]:
    """A JSON object from ``path``; a missing, unreadable or non-object file is an
    :class:`SDFolderError` that says what the file is for (``what``)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SDFolderError(f"{path} is missing: {what}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise SDFolderError(f"{path} cannot be read ({e}): {what}") from None
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise SDFolderError(f"{path} is not valid JSON ({e.msg} at line {e.lineno}, column "
                            f"{e.colno}): {what}") from None
    if not isinstance(d, dict):
        raise SDFolderError(f"{path} holds a JSON {type(d).__name__}, expected an object: "
                            f"{what}")
    return d


def is_sdxl_folder(root: str | Path) -> bool:
    """Whether the diffusers folder ``root`` holds an SDXL pipeline (model_index.json's
    ``_class_name``; the folder is not otherwise checked)."""
    p = Path(root).expanduser() / "model_index.json"
    return p.is_file() and read_json(p, "the pipeline's index").get("_class_name") \
        in SDXL_PIPELINES


def _check_sdxl_index(root: Path, index: dict[str, Any]) -> None:
    """Refuse what an SDXL folder cannot train: the refiner (no first text encoder, an
    aesthetic-score conditioning), an Img2Img folder without both text encoders."""
    cls = index.get("_class_name")
    missing = [p for p in ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")
               if not (isinstance(index.get(p), list) and index[p][1])]
    if missing:
        refiner = " (an SDXL refiner has only text_encoder_2)" if "text_encoder" in missing \
            else ""
        raise SDFolderError(f"{root} is an SDXL {cls} folder without {', '.join(missing)}"
                            f"{refiner}; steadydiff fine-tunes the SDXL base "
                            "(StableDiffusionXLPipeline: text_encoder + text_encoder_2, "
                            "tokenizer + tokenizer_2)")
    if index.get("requires_aesthetics_score"):
        raise SDFolderError(f"{root}: requires_aesthetics_score is true (an SDXL refiner's "
                            "aesthetic-score conditioning), which steadydiff does not train; "
                            "use the SDXL base folder")


def check_folder(path: str | Path, parts: tuple[str, ...] | None = None, *,
                 weights: bool = True) -> Path:
    """Check that ``path`` is a Stable Diffusion 1.x/2.x or SDXL diffusers folder with
    ``parts`` (None: every part of its pipeline, :data:`SD_PARTS` or :data:`SDXL_PARTS`)
    and their safetensors weights unless ``weights`` is false (a single file's config).

    Raises:
        SDFolderError: the path is missing, a file (a single-file checkpoint goes through
            ``source.model_root``), has no or a broken ``model_index.json``, is an SDXL
            refiner, or lacks a part (its folder, config or safetensors weights).
    """
    root = Path(path).expanduser()
    if not root.exists():
        raise SDFolderError(f"model.pretrained: {root} does not exist; expected a diffusers "
                            "Stable Diffusion folder (model_index.json, unet/, vae/, "
                            "text_encoder/, tokenizer/, scheduler/)")
    if root.is_file():
        raise SDFolderError(f"model.pretrained: {root} is a file; expected a diffusers "
                            "Stable Diffusion folder")
    index = read_json(root / "model_index.json", "every diffusers pipeline folder has one "
                  "(written by save_pretrained); is this the right folder?")
    cls = index.get("_class_name")
    if cls in SDXL_PIPELINES:
        _check_sdxl_index(root, index)
        table = SDXL_PARTS
    elif cls in SD_PIPELINES:
        table = SD_PARTS
    else:
        raise SDFolderError(f"{root}/model_index.json: _class_name is {cls!r}; expected "
                            f"{' or '.join(SD_PIPELINES + SDXL_PIPELINES[:1])} (a Stable "
                            "Diffusion 1.x/2.x or SDXL folder)")
    parts = tuple(table) if parts is None else parts
    for part in parts:
        entry = index.get(part)
        allowed = table[part]
        if not (isinstance(entry, list) and len(entry) == 2 and entry[1] in allowed):
            raise SDFolderError(f"{root}/model_index.json: {part!r} is {entry!r}; expected "
                                f"[library, class] with class {' or '.join(allowed)}")
        sub = root / part
        if not sub.is_dir():
            raise SDFolderError(f"{sub}/ is missing: a {cls} folder needs "
                                f"{', '.join(p + '/' for p in parts)}")
        if part.startswith("tokenizer"):
            if not ((sub / "tokenizer.json").is_file()
                    or ((sub / "vocab.json").is_file() and (sub / "merges.txt").is_file())):
                raise SDFolderError(f"{sub}/ has neither tokenizer.json nor vocab.json + "
                                    "merges.txt")
            continue
        config = "scheduler_config.json" if part == "scheduler" else "config.json"
        conf = read_json(sub / config, f"the {part}'s configuration")
        if part == "unet" and table is SDXL_PARTS and \
                conf.get("addition_embed_type") != "text_time":
            raise SDFolderError(f"{sub}/config.json: addition_embed_type is "
                                f"{conf.get('addition_embed_type')!r}; an SDXL UNet has "
                                "'text_time' (the pooled text + size/crop conditioning)")
        if part == "scheduler" or not weights:
            continue
        found = list(sub.glob("*.safetensors")) + list(sub.glob("*.safetensors.index.json"))
        if not found:
            pickled = [p.name for p in sub.glob("*.bin")]
            hint = (f" (it has {', '.join(pickled)}: pickled weights, which steadydiff never "
                    "unpickles; re-save the model with save_pretrained(..., "
                    "safe_serialization=True))" if pickled else "")
            raise SDFolderError(f"{sub}/ has no .safetensors weights{hint}")
    return root


_PREDICTIONS = {"epsilon": "eps", "v_prediction": "v", "sample": "x0"}
_SCHEDULES = {"scaled_linear": "scaled_linear", "linear": "linear",
              "squaredcos_cap_v2": "cosine"}


def diffusion_settings(root: str | Path) -> dict[str, Any]:
    """The ``diffusion.*`` values the folder's scheduler config implies (SD 1.x and 2.x-base:
    eps; SD 2.x 768-v: v; ``rescale_betas_zero_snr``: zero terminal SNR).

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
        "diffusion.timesteps": int(s.get("num_train_timesteps", 1000)),
        "diffusion.schedule": _SCHEDULES[kind],
        "diffusion.prediction": _PREDICTIONS[pred],
        "diffusion.zero_terminal_snr": bool(s.get("rescale_betas_zero_snr", False)),
    }
    if kind != "squaredcos_cap_v2":
        out["diffusion.beta_start"] = float(s.get("beta_start", 0.0001))
        out["diffusion.beta_end"] = float(s.get("beta_end", 0.02))
    return out


@dataclass
class SDParts:
    """The loaded parts of a Stable Diffusion folder (frozen ones in eval mode); an SDXL
    folder's second text encoder (with projection) and tokenizer, and its pipeline's
    ``force_zeros_for_empty_prompt`` (the null condition is zeros, not the encoded "")."""

    root: Path
    unet: Any
    vae: Any
    text_encoder: Any
    tokenizer: Any
    text_encoder_2: Any = None
    tokenizer_2: Any = None
    force_zeros: bool = False


def _load(what: str, fn, sub: Path, **kw):
    try:
        return fn(sub, local_files_only=True, **kw)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise SDFolderError(f"{sub}: the {what} does not load: {type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else ''}") from None


def load_vae(path: str | Path):
    """An AutoencoderKL from ``path``: its own folder (config.json) or an SD folder's
    ``vae/``."""
    from diffusers import AutoencoderKL

    p = Path(path).expanduser()
    sub = p / "vae" if (p / "vae" / "config.json").is_file() else p
    if not (sub / "config.json").is_file():
        raise SDFolderError(f"model.vae: {p} has neither config.json nor vae/config.json; "
                            "expected a diffusers AutoencoderKL folder (save_pretrained)")
    return _load("VAE", AutoencoderKL.from_pretrained, sub, use_safetensors=True).eval()


def load_text_parts(path: str | Path):
    """(tokenizer, text encoder) from a folder with ``tokenizer/`` and ``text_encoder/``."""
    from transformers import AutoTokenizer, CLIPTextModel

    p = Path(path).expanduser()
    for part in ("tokenizer", "text_encoder"):
        if not (p / part).is_dir():
            raise SDFolderError(f"model.text_encoder: {p}/{part}/ is missing; expected a "
                                "folder with text_encoder/ (a transformers CLIPTextModel) and "
                                "tokenizer/ (an SD folder works)")
    tok = _load("tokenizer", AutoTokenizer.from_pretrained, p / "tokenizer")
    te = _load("text encoder", CLIPTextModel.from_pretrained, p / "text_encoder",
               use_safetensors=True).eval()
    return tok, te


def load_folder_parts(path: str | Path) -> SDParts:
    """Every part of the diffusers SD (or SDXL) folder at ``path`` (checked first), fp32 on
    the CPU; the caller moves them and sets their dtypes."""
    from diffusers import UNet2DConditionModel
    from transformers import AutoTokenizer, CLIPTextModelWithProjection

    root = check_folder(path)
    unet = _load("UNet", UNet2DConditionModel.from_pretrained, root / "unet",
                 use_safetensors=True)
    tok, te = load_text_parts(root)
    parts = SDParts(root, unet, load_vae(root), te, tok)
    if is_sdxl_folder(root):
        parts.tokenizer_2 = _load("tokenizer", AutoTokenizer.from_pretrained,
                                  root / "tokenizer_2")
        parts.text_encoder_2 = _load("second text encoder",
                                     CLIPTextModelWithProjection.from_pretrained,
                                     root / "text_encoder_2", use_safetensors=True).eval()
        # diffusers' StableDiffusionXLPipeline registers it (default True) in model_index
        parts.force_zeros = bool(read_json(root / "model_index.json", "the pipeline's index")
                                 .get("force_zeros_for_empty_prompt", True))
    return parts
