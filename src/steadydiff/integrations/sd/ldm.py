"""The original (CompVis ``ldm`` / Stability ``sgm``) layouts of a Stable Diffusion UNet,
VAE and text encoders, as diffusers module paths map onto them.

A single-file checkpoint (single_file.py) holds these layouts, and kohya's SDXL LoRA names
are the original UNet's module paths (lora_files.py): both read the one mapping here. The
family modules (``integrations/families/``) say which of them their files use.

The UNet (:func:`sgm_path`): ``input_blocks`` / ``middle_block`` / ``output_blocks``
numbered flat. The VAE (:func:`vae_to_original`): ``encoder.down.N.block.M``, ``mid.attn_1``,
the decoder's levels numbered from the bottom. CLIP (:func:`clip_path`): transformers' keys
with their ``text_model`` level. OpenCLIP (:func:`open_clip_keys`): SDXL's second text
encoder as its own code names it, q/k/v fused.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["LayoutError", "UNET", "VAE", "TEXT", "sgm_path", "clip_path", "unet_to_original",
           "vae_map", "rename", "vae_to_original", "clip_to_original", "open_clip_keys"]

UNET, VAE, TEXT = "model.diffusion_model.", "first_stage_model.", "cond_stage_model."


class LayoutError(ValueError):
    """A module with no name in the original layout."""


_TOP = {"conv_in": "input_blocks.0.0", "conv_out": "out.2", "conv_norm_out": "out.0",
        "time_embedding.linear_1": "time_embed.0", "time_embedding.linear_2": "time_embed.2",
        "add_embedding.linear_1": "label_emb.0.0", "add_embedding.linear_2": "label_emb.0.2"}
_RESNET = {"norm1": "in_layers.0", "conv1": "in_layers.2", "time_emb_proj": "emb_layers.1",
           "norm2": "out_layers.0", "conv2": "out_layers.3", "conv_shortcut": "skip_connection"}


def sgm_path(path: str, config: Any) -> str:
    """A diffusers ``UNet2DConditionModel`` module path -> the original (sgm) UNet's.

    The sgm UNet numbers its blocks flat: ``input_blocks.0`` is conv_in, then each level's
    ``layers_per_block`` (L) resnet[+transformer] pairs and its downsampler, L + 1 entries a
    level; ``output_blocks`` hold L + 1 entries a level, the upsampler inside the last one
    (after the transformer where the level has one); ``middle_block`` is resnet,
    transformer, resnet.

    Raises:
        LayoutError: a path with no sgm name, or per-level layer counts.
    """
    if path in _TOP:
        return _TOP[path]
    L = config.layers_per_block
    if not isinstance(L, int):
        raise LayoutError(f"layers_per_block={L}: the sgm names need one int")
    p = path.split(".")

    def inner(rest: list[str], resnet: bool) -> list[str]:
        if resnet and rest and rest[0] in _RESNET:
            return _RESNET[rest[0]].split(".") + rest[1:]
        return rest

    if p[0] == "down_blocks":
        b, kind, j, rest = int(p[1]), p[2], int(p[3]), p[4:]
        if kind == "downsamplers":
            head = [f"input_blocks.{(b + 1) * (L + 1)}.0"]
            rest = ["op"] + rest[1:] if rest[:1] == ["conv"] else rest
        else:
            head = [f"input_blocks.{1 + b * (L + 1) + j}.{0 if kind == 'resnets' else 1}"]
        return ".".join(head + inner(rest, kind == "resnets"))
    if p[0] == "mid_block":
        kind, j, rest = p[1], int(p[2]), p[3:]
        idx = {("resnets", 0): 0, ("attentions", 0): 1, ("resnets", 1): 2}[(kind, j)]
        return ".".join([f"middle_block.{idx}"] + inner(rest, kind == "resnets"))
    if p[0] == "up_blocks":
        b, kind, j, rest = int(p[1]), p[2], int(p[3]), p[4:]
        if kind == "upsamplers":
            attn = "CrossAttn" in config.up_block_types[b]
            head = [f"output_blocks.{b * (L + 1) + L}.{2 if attn else 1}"]
        else:
            head = [f"output_blocks.{b * (L + 1) + j}.{0 if kind == 'resnets' else 1}"]
        return ".".join(head + inner(rest, kind == "resnets"))
    raise LayoutError(f"no sgm name for the UNet module {path!r}")


def clip_path(path: str) -> str:
    """A CLIP text model's module path as in the original layout (``text_model.encoder...``):
    transformers 5 made ``CLIPTextModel`` flat (``encoder.layers...``); the files keep the
    ``text_model`` level."""
    return ("text_model." + path if path.split(".", 1)[0] in
            ("encoder", "embeddings", "final_layer_norm") else path)


def _cpu(m: nn.Module) -> dict[str, Tensor]:
    return {k: v.detach().to("cpu").contiguous() for k, v in m.state_dict().items()}


def unet_to_original(unet: nn.Module) -> dict[str, Tensor]:
    """A diffusers UNet's tensors under the original keys (``model.diffusion_model.`` +
    :func:`sgm_path`, the parameter name kept), CPU, own dtypes."""
    out = {}
    for k, v in _cpu(unet).items():
        path, _, param = k.rpartition(".")
        out[f"{UNET}{sgm_path(path, unet.config)}.{param}"] = v
    return out


def vae_map(config: dict[str, Any]) -> list[tuple[re.Pattern, Any]]:
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


def rename(sd: dict[str, Tensor], rules, prefix: str) -> dict[str, Tensor]:
    """``sd`` with each key renamed by the first of ``rules`` that matches it, under
    ``prefix``."""
    out = {}
    for k, v in sd.items():
        for pattern, fn in rules:
            m = pattern.fullmatch(k)
            if m:
                k = fn(m)
                break
        out[prefix + k] = v
    return out


def vae_to_original(vae: nn.Module, prefix: str = VAE) -> dict[str, Tensor]:
    """A diffusers AutoencoderKL in the original layout under ``prefix``. Its attention
    projections are 1x1 convolutions there (linear layers in diffusers): reshaped to
    (C, C, 1, 1)."""
    v = rename(_cpu(vae), vae_map(dict(vae.config)), prefix)
    for k, t in v.items():
        if re.search(r"\.mid\.attn_1\.(q|k|v|proj_out)\.weight$", k) and t.ndim == 2:
            v[k] = t[:, :, None, None].contiguous()
    return v


def clip_to_original(te: nn.Module, prefix: str) -> dict[str, Tensor]:
    """A transformers CLIP text model's tensors under ``prefix`` with the ``text_model``
    level the original files keep (transformers >= 5.6 flattened ``CLIPTextModel``)."""
    pre = prefix + ("" if hasattr(te, "text_model") else "text_model.")
    return {pre + k: v for k, v in _cpu(te).items()}


def open_clip_keys(te: nn.Module, prefix: str) -> dict[str, Tensor]:
    """A transformers CLIPTextModelWithProjection as OpenCLIP's text tower (SDXL's second
    text encoder in a single file): the inverse of diffusers' ``convert_open_clip_checkpoint``,
    through its own table (``DIFFUSERS_TO_LDM_MAPPING["openclip"]``); q, k, v fused into
    ``attn.in_proj_weight`` / ``in_proj_bias``, the projection transposed.

    Raises:
        LayoutError: a tensor with no OpenCLIP name.
    """
    from diffusers.loaders.single_file_utils import DIFFUSERS_TO_LDM_MAPPING

    table = DIFFUSERS_TO_LDM_MAPPING["openclip"]
    sd = {clip_path(k): v for k, v in _cpu(te).items()}
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
            raise LayoutError(f"the second text encoder's {k} has no OpenCLIP name")
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
