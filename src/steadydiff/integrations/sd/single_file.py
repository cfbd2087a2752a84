"""Single-file Stable Diffusion checkpoints: the one ``.safetensors`` file A1111, ComfyUI and
the model sites pass around (``v1-5-pruned-emaonly.safetensors``), read and written.

Such a file holds the original latent-diffusion layout (Rombach et al. 2022, the CompVis
``ldm`` code) in one flat state dict::

    model.diffusion_model.*   the UNet       (input_blocks / middle_block / output_blocks)
    first_stage_model.*       the VAE        (encoder.down.N.block.M, mid.attn_1, ...)
    cond_stage_model.*        the text encoder (SD 1.x: transformer.text_model.*, a HF CLIP)

and no configuration; an SDXL file has ``conditioner.embedders.0.transformer.*`` (CLIP) and
``conditioner.embedders.1.model.*`` (OpenCLIP's text tower, fused qkv) instead of
``cond_stage_model.*``. Reading goes through diffusers' own single-file loader
(``StableDiffusionPipeline.from_single_file``, or ``StableDiffusionXLPipeline``'s for an
SDXL config folder) with ``config=`` a local diffusers folder
(``model.single_file_config``) and ``local_files_only=True``: the folder supplies every
config (UNet, VAE, text encoder, tokenizer, scheduler; its weights are not needed), so
nothing is looked up on the hub. Without a local config diffusers would infer a hub
repository from the keys and download its configs, and an original ``v1-inference.yaml``
alone still makes it fetch ``openai/clip-vit-large-patch14`` for the tokenizer and text
encoder: both are refused here.

Pickled checkpoints (``.ckpt``, ``.pt``, ``.pth``, ``.bin``) are refused: unpickling runs
whatever code the file carries.

Writing (:func:`write_single_file`) maps a diffusers UNet/VAE/CLIP state dict back to that
layout (the inverse of the renaming diffusers' loader does; the round trip through that
loader is tested to give back the same tensors), checks every tensor finite and writes the
file atomically.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ...trainer.checkpoint import CheckpointError
from .folder import SDFolderError, SDParts, check_folder, is_sdxl_folder
from .lora_files import LoraFileError, is_sdxl, sgm_path

__all__ = ["PICKLES", "is_single_file", "check_single_file", "load_single_file",
           "to_original", "write_single_file", "export_single_file", "UNET", "VAE",
           "TEXT"]

UNET, VAE, TEXT = "model.diffusion_model.", "first_stage_model.", "cond_stage_model."
SDXL_TE1, SDXL_TE2 = "conditioner.embedders.0.transformer.", "conditioner.embedders.1.model."
PICKLES = (".ckpt", ".pt", ".pth", ".bin")
_CLIP_SD1 = TEXT + "transformer."  # SD 1.x: a transformers CLIPTextModel under this prefix

PICKLE_HINT = (
    "{f} is a pickle ({s}): loading it runs any code it carries, so steadydiff never "
    "unpickles it. Convert it once, in an isolated environment you trust (a throwaway "
    "container or VM), to safetensors, e.g.\n"
    "  python -c \"import torch; from safetensors.torch import save_file; "
    "sd = torch.load('{f}', map_location='cpu', weights_only=True); "
    "sd = sd.get('state_dict', sd); "
    "save_file({{k: v.contiguous() for k, v in sd.items() if isinstance(v, torch.Tensor)}}, "
    "'{stem}.safetensors')\"\n"
    "(weights_only=True refuses files that need code to load), or with diffusers' "
    "scripts/convert_original_stable_diffusion_to_diffusers.py; then set "
    "model.pretrained={stem}.safetensors (or the converted diffusers folder)")


def is_single_file(path: str | Path | None) -> bool:
    """Whether ``model.pretrained`` names a file (a single-file checkpoint) rather than a
    folder."""
    return path is not None and Path(path).expanduser().is_file()


def check_single_file(path: str | Path, config: str | Path | None) -> tuple[Path, Path]:
    """Check a single-file checkpoint and its local config folder; returns both paths.

    Raises:
        SDFolderError: a pickle (with how to convert it safely), not a safetensors file,
            no ``model.single_file_config``, a YAML or a config that is not a diffusers SD
            folder, or a file without the original layout's UNet keys.
    """
    f = Path(path).expanduser()
    suffix = f.suffix.lower()
    if suffix in PICKLES:
        raise SDFolderError("model.pretrained: " + PICKLE_HINT.format(
            f=f, s=suffix, stem=f.with_suffix("")))
    if suffix != ".safetensors":
        raise SDFolderError(f"model.pretrained: {f} is a file but not a .safetensors "
                            "checkpoint; expected a diffusers folder or a single-file "
                            "checkpoint (.safetensors, the original LDM layout)")
    if not config:
        raise SDFolderError(
            f"model.pretrained: {f} is a single-file checkpoint, which holds weights but no "
            "configuration; set model.single_file_config to a local diffusers Stable "
            "Diffusion folder of the same architecture (model_index.json, unet/, vae/, "
            "text_encoder/ config.json, tokenizer/, scheduler/; weights not needed), e.g. "
            "the stable-diffusion-v1-5 folder for an SD 1.5 fine-tune. Nothing is "
            "downloaded: without it diffusers would fetch the configs from the hub")
    c = Path(config).expanduser()
    if c.suffix.lower() in (".yaml", ".yml"):
        raise SDFolderError(
            f"model.single_file_config: {c} is an original LDM YAML; it describes the UNet "
            "and VAE but not the tokenizer or text encoder, which diffusers would then "
            "download (openai/clip-vit-large-patch14). Give a local diffusers Stable "
            "Diffusion folder of the same architecture instead (configs and tokenizer/ "
            "are enough)")
    try:
        root = check_folder(c, weights=False)
    except SDFolderError as e:
        raise SDFolderError(f"model.single_file_config: {e}") from None
    keys = _keys(f)
    if not any(k.startswith(UNET) for k in keys):
        what = ("a diffusers UNet (its diffusion_pytorch_model.safetensors)"
                if any(k.startswith(("down_blocks.", "conv_in.")) for k in keys)
                else "not a Stable Diffusion checkpoint")
        raise SDFolderError(f"model.pretrained: {f} has no {UNET}* tensors (the original "
                            f"single-file layout); it looks like {what}")
    return f, root


def _keys(f: Path) -> list[str]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(f), framework="pt") as h:
            return list(h.keys())
    except (SafetensorError, OSError) as e:
        raise SDFolderError(f"model.pretrained: {f} is not a readable safetensors file "
                            f"({e})") from None


def load_single_file(path: str | Path, config: str | Path) -> SDParts:
    """The parts of a single-file checkpoint (SD 1.x/2.x, or SDXL with an SDXL config
    folder: both text encoders), fp32 on the CPU, through diffusers' ``from_single_file``
    (``StableDiffusionPipeline``'s or ``StableDiffusionXLPipeline``'s) with the local
    ``config`` folder only.

    Raises:
        SDFolderError: see :func:`check_single_file`; or the loader failed (a file of
            another architecture than the config, or it tried to reach the network).
    """
    from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline
    from diffusers.loaders.single_file_utils import SingleFileComponentError

    f, root = check_single_file(path, config)
    xl = is_sdxl_folder(root)
    try:
        if xl:
            pipe = StableDiffusionXLPipeline.from_single_file(
                str(f), config=str(root), local_files_only=True, torch_dtype=torch.float32,
                add_watermarker=False)
        else:
            pipe = StableDiffusionPipeline.from_single_file(
                str(f), config=str(root), local_files_only=True, torch_dtype=torch.float32,
                safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    except (OSError, ValueError, KeyError, RuntimeError, SingleFileComponentError) as e:
        msg = str(e).splitlines()[0] if str(e) else ""
        offline = any(w in msg.lower() for w in ("offline", "connect", "huggingface.co",
                                                   "local_files_only", "cache"))
        hint = (" (it tried to fetch a file from the hub: steadydiff loads offline only; "
                "model.single_file_config must hold every config)" if offline else
                f" (is {root} the same architecture as the file?)")
        raise SDFolderError(f"model.pretrained: {f} does not load with "
                            f"model.single_file_config={root}: {type(e).__name__}: "
                            f"{msg}{hint}") from None
    parts = SDParts(f, pipe.unet, pipe.vae.eval(), pipe.text_encoder.eval(), pipe.tokenizer)
    if xl:
        parts.text_encoder_2, parts.tokenizer_2 = pipe.text_encoder_2.eval(), pipe.tokenizer_2
        parts.force_zeros = bool(pipe.config.get("force_zeros_for_empty_prompt", True))
    return parts


# --------------------------------------------------------------------------- writing


def _unet_keys(sd: dict[str, Tensor], config: Any) -> dict[str, Tensor]:
    """diffusers UNet2DConditionModel keys -> the original UNet's (``input_blocks``,
    ``middle_block``, ``output_blocks``): the module path through ``sgm_path``, the one
    owner of that mapping (the kohya LoRA names use it too), the parameter name kept."""
    out = {}
    for k, v in sd.items():
        path, _, param = k.rpartition(".")
        try:
            out[f"{UNET}{sgm_path(path, config)}.{param}"] = v
        except LoraFileError as e:
            raise CheckpointError(f"the UNet has no original single-file layout: {e}") from None
    return out


def _vae_map(config: dict[str, Any]) -> list[tuple[re.Pattern, Any]]:
    """diffusers AutoencoderKL key -> original ``ldm`` autoencoder key (the decoder's
    levels are numbered from the bottom there: up.{n-1-i})."""
    n = len(config["block_out_channels"])
    attn = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}

    def resnet(prefix: str, rest: str) -> str:
        return prefix + re.sub(r"^conv_shortcut\.", "nin_shortcut.", rest)

    def attention(prefix: str, rest: str) -> str:
        for a, b in attn.items():
            if rest.startswith(a + "."):
                return prefix + b + rest[len(a):]
        return prefix + rest

    return [
        (re.compile(r"encoder\.down_blocks\.(\d+)\.resnets\.(\d+)\.(.*)"),
         lambda m: resnet(f"encoder.down.{m[1]}.block.{m[2]}.", m[3])),
        (re.compile(r"encoder\.down_blocks\.(\d+)\.downsamplers\.0\.(.*)"),
         lambda m: f"encoder.down.{m[1]}.downsample.{m[2]}"),
        (re.compile(r"decoder\.up_blocks\.(\d+)\.resnets\.(\d+)\.(.*)"),
         lambda m: resnet(f"decoder.up.{n - 1 - int(m[1])}.block.{m[2]}.", m[3])),
        (re.compile(r"decoder\.up_blocks\.(\d+)\.upsamplers\.0\.(.*)"),
         lambda m: f"decoder.up.{n - 1 - int(m[1])}.upsample.{m[2]}"),
        (re.compile(r"(encoder|decoder)\.mid_block\.resnets\.(\d+)\.(.*)"),
         lambda m: resnet(f"{m[1]}.mid.block_{int(m[2]) + 1}.", m[3])),
        (re.compile(r"(encoder|decoder)\.mid_block\.attentions\.0\.(.*)"),
         lambda m: attention(f"{m[1]}.mid.attn_1.", m[2])),
        (re.compile(r"(encoder|decoder)\.conv_norm_out\.(.*)"),
         lambda m: f"{m[1]}.norm_out.{m[2]}"),
    ]


def _rename(sd: dict[str, Tensor], rules, prefix: str) -> dict[str, Tensor]:
    out = {}
    for k, v in sd.items():
        for pattern, fn in rules:
            m = pattern.fullmatch(k)
            if m:
                k = fn(m)
                break
        out[prefix + k] = v
    return out


def _open_clip_keys(te: nn.Module, prefix: str) -> dict[str, Tensor]:
    """A transformers CLIPTextModelWithProjection as OpenCLIP's text tower (SDXL's second
    text encoder in a single file): the inverse of diffusers' ``convert_open_clip_checkpoint``,
    through its own table (``DIFFUSERS_TO_LDM_MAPPING["openclip"]``); q, k, v fused into
    ``attn.in_proj_weight`` / ``in_proj_bias``, the projection transposed."""
    from diffusers.loaders.single_file_utils import DIFFUSERS_TO_LDM_MAPPING

    table = DIFFUSERS_TO_LDM_MAPPING["openclip"]
    sd = {("text_model." + k if k.split(".", 1)[0] in ("encoder", "embeddings",
                                                     "final_layer_norm") else k):
          v.detach().to("cpu").contiguous() for k, v in te.state_dict().items()}
    out: dict[str, Tensor] = {}
    for hf, ldm in table["layers"].items():
        if hf in sd:
            t = sd.pop(hf)
            out[prefix + ldm] = t.T.contiguous() if ldm == "text_projection" else t
    sd.pop("text_model.embeddings.position_ids", None)
    layer = "text_model.encoder.layers."
    fused: dict[str, dict[str, Tensor]] = {}
    for k, v in sd.items():
        if not k.startswith(layer):
            raise CheckpointError(f"the second text encoder's {k} has no OpenCLIP name")
        m = re.fullmatch(r"(\d+)\.self_attn\.([qkv])_proj\.(weight|bias)", k[len(layer):])
        if m:
            fused.setdefault(f"{m[1]}.{m[3]}", {})[m[2]] = v
            continue
        name = k
        for hf, ldm in table["transformer"].items():
            if not hf.startswith("transformer."):
                name = name.replace(hf, ldm)
        out[prefix + "transformer." + name] = v
    for key, qkv in fused.items():
        i, what = key.split(".")
        out[f"{prefix}transformer.resblocks.{i}.attn.in_proj_{what}"] = \
            torch.cat([qkv["q"], qkv["k"], qkv["v"]]).contiguous()
    return out


def to_original(unet: nn.Module, vae: nn.Module | None = None,
                text_encoder: nn.Module | None = None,
                text_encoder_2: nn.Module | None = None) -> dict[str, Tensor]:
    """The original single-file state dict of diffusers parts (CPU tensors, own dtypes).

    The VAE's attention projections are 1x1 convolutions in the original code (linear
    layers in diffusers): reshaped to (C, C, 1, 1). The text encoder is written in the
    SD 1.x layout (``cond_stage_model.transformer.text_model.*``, the transformers CLIP
    keys); an SDXL UNet's two under ``conditioner.embedders.0.transformer.`` (the same CLIP
    keys) and ``conditioner.embedders.1.model.`` (OpenCLIP's layout, :func:`_open_clip_keys`).

    Raises:
        CheckpointError: a part without an original layout (an SD 2.x OpenCLIP text
            encoder converted to transformers, a UNet with per-level layer counts).
    """
    def cpu(m: nn.Module) -> dict[str, Tensor]:
        return {k: v.detach().to("cpu").contiguous() for k, v in m.state_dict().items()}

    out = _unet_keys(cpu(unet), unet.config)
    if vae is not None:
        v = _rename(cpu(vae), _vae_map(dict(vae.config)), VAE)
        for k, t in v.items():
            if re.search(r"\.mid\.attn_1\.(q|k|v|proj_out)\.weight$", k) and t.ndim == 2:
                v[k] = t[:, :, None, None].contiguous()
        out.update(v)
    if is_sdxl(unet):
        if text_encoder is not None:
            pre = SDXL_TE1 + ("" if hasattr(text_encoder, "text_model") else "text_model.")
            out.update({pre + k: v for k, v in cpu(text_encoder).items()})
        if text_encoder_2 is not None:
            out.update(_open_clip_keys(text_encoder_2, SDXL_TE2))
        return out
    if text_encoder is not None:
        act = getattr(text_encoder.config, "hidden_act", "quick_gelu")
        if act != "quick_gelu":  # SD 1.x CLIP ViT-L uses quick_gelu; SD 2.x OpenCLIP gelu
            raise CheckpointError(
                f"the text encoder (hidden_act={act}) looks like SD 2.x's OpenCLIP, whose "
                "original layout (cond_stage_model.model.*) steadydiff does not write from "
                "a diffusers folder; train from the SD 2.x single file instead (its text "
                "encoder is then copied as it was), or use the diffusers folder RUN/model")
        # the original keys are transformers' CLIP ones of old (text_model.*); transformers
        # >= 5.6 flattened CLIPTextModel (no text_model wrapper): put the level back
        pre = _CLIP_SD1 + ("" if hasattr(text_encoder, "text_model") else "text_model.")
        out.update({pre + k: v for k, v in cpu(text_encoder).items()})
    return out


def write_single_file(out: str | Path, tensors: dict[str, Tensor],
                      metadata: dict[str, str] | None = None) -> Path:
    """Write ``tensors`` to the safetensors file ``out`` atomically (a temporary file in
    the same folder, fsynced, then renamed: a reader never sees half a file).

    Raises:
        CheckpointError: a non-finite tensor (the file is not written).
    """
    from safetensors.torch import save_file

    bad = [k for k, v in tensors.items() if v.is_floating_point() and not torch.isfinite(v).all()]
    if bad:
        raise CheckpointError(f"{len(bad)} tensors are non-finite ({bad[0]}, ...): {out} is "
                              "not written")
    out = Path(out).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata={"format": "pt", **(metadata or {})})
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def export_single_file(out: str | Path, unet: nn.Module, vae: nn.Module | None,
                       text_encoder: nn.Module | None, base_file: str | Path | None = None,
                       dtype: torch.dtype | None = None,
                       text_encoder_2: nn.Module | None = None) -> Path:
    """A fine-tuned UNet (and its VAE and text encoder) as one original-layout file.

    With ``base_file`` (the run started from a single file) only the UNet is converted:
    every other tensor of that file (VAE, text encoder in whatever layout it had, SD 2.x
    OpenCLIP included) is copied unchanged, and the UNet is written in the dtype the base
    file's UNet had. ``dtype`` (e.g. torch.float16, what most shared files use) casts every
    floating-point tensor."""
    from safetensors import safe_open

    if base_file is not None:
        tensors = to_original(unet)
        with safe_open(str(base_file), framework="pt") as h:
            for k in h.keys():
                if not k.startswith(UNET):
                    tensors[k] = h.get_tensor(k)
                elif dtype is None:  # the UNet in the dtype the base file had (fp16 often)
                    dtype = h.get_slice(k).get_dtype()
                    dtype = {"F16": torch.float16, "BF16": torch.bfloat16}.get(dtype)
    else:
        if is_sdxl(unet) and (text_encoder is None) != (text_encoder_2 is None):
            raise CheckpointError("an SDXL single file needs both text encoders or neither")
        tensors = to_original(unet, vae, text_encoder, text_encoder_2)
    if dtype is not None:
        tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    return write_single_file(out, tensors, {"written_by": "steadydiff"})
