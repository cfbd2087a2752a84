"""SDXL (Podell et al. 2023): the SD UNet grown, two CLIP text encoders, and the image's
size and crop as micro-conditioning (§2.1-2.2).

The base pipeline's folder is SD's plus ``text_encoder_2/`` (a ``CLIPTextModelWithProjection``,
its pooled projection) and ``tokenizer_2/``; the UNet has ``addition_embed_type:
"text_time"``. The refiner (an Img2Img folder without ``text_encoder/``, conditioned on an
aesthetic score) is refused by name.

The UNet takes three conditions, as ``StableDiffusionXLPipeline`` builds them
(``encode_prompt``, ``_get_add_time_ids``):

- ``encoder_hidden_states`` (N, L, D1 + D2): the penultimate hidden state
  (``hidden_states[-2]``) of each text encoder, concatenated on the feature axis
  (CLIPTextModel 768 + CLIPTextModelWithProjection 1280 = 2048);
- ``text_embeds`` (N, P): the second encoder's projected pooled output (1280);
- ``time_ids`` (N, 6): the micro-conditioning ``original (h, w), crop top-left (top, left),
  target (h, w)`` of each image (``steadydiff.data.buckets.Crop.time_ids``).

They travel packed in ``y`` (base.Layout: the hidden states, the pooled rows, one row with
the six time ids). A time-ids slot of zeros (a target size of 0 cannot be real) means "this
sample's own size, uncropped": the family fills in ``(H, W, 0, 0, H, W)`` from the latent's
shape, which is what the pipeline uses when it draws at a size (validation prompts,
``steadydiff sample``). The null condition of classifier-free guidance replaces the text rows
only and keeps the sample's time ids, as diffusers does (``negative_add_time_ids =
add_time_ids``); with ``force_zeros_for_empty_prompt`` (the base's) its text is zeros.

Files: kohya's LoRA names for SDXL are the original (sgm) UNet's module paths
(``input_blocks.4.1``, sd-scripts train SDXL on that UNet) and ``lora_te1_`` / ``lora_te2_``;
a single file holds ``conditioner.embedders.0.transformer.`` (CLIP) and
``conditioner.embedders.1.model.`` (OpenCLIP's text tower, fused qkv).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..sd.ldm import clip_to_original, open_clip_keys, sgm_path, unet_to_original, \
    vae_to_original
from .base import Layout, Parts, SDFolderError, TextEncoder
from .sd import SD, single_file_error

__all__ = ["SDXL", "TIME_IDS", "default_time_ids", "item_time_ids"]

TIME_IDS = 6  # original (h, w), crop (top, left), target (h, w)
TE1, TE2 = "conditioner.embedders.0.transformer.", "conditioner.embedders.1.model."


def default_time_ids(h: int, w: int, n: int, device: torch.device | str) -> Tensor:
    """(n, 6) float32 ``(h, w, 0, 0, h, w)``: an uncropped image drawn at its own size.
    Filled on ``device`` (no host-to-device copy: it runs in every step)."""
    out = torch.zeros(n, TIME_IDS, device=device)
    for col, v in ((0, h), (1, w), (4, h), (5, w)):
        out[:, col] = v
    return out


def fill_time_ids(time_ids: Tensor, h: int, w: int) -> Tensor:
    """``time_ids`` (N, 6) with every zero slot (target size 0) replaced by
    :func:`default_time_ids` at (h, w); no host sync (a select, not a branch)."""
    unset = (time_ids[:, 4:6] == 0).all(dim=1, keepdim=True)  # (N, 1)
    return torch.where(unset, default_time_ids(h, w, time_ids.shape[0], time_ids.device),
                       time_ids.float())


def item_time_ids(dataset, image_size: int, center_crop: bool) -> Tensor:
    """(N, 6) float32: each item's ``add_time_ids`` from the crop the data pipeline made.

    A bucketed dataset (``data.buckets``): its recorded crop
    (:func:`steadydiff.data.buckets.time_ids`). Otherwise, for an item with an image file:
    its size (EXIF rotation applied) and the ``data.center_crop`` the folder does (the
    shorter side resized to S and the centre square kept: :func:`plan_crop` onto S x S, the
    same arithmetic), or, squashed to S x S without a crop, ``(h, w, 0, 0, S, S)``. An item
    without a file (a user's in-memory dataset): ``(S, S, 0, 0, S, S)``. Reads image
    headers only (~0.1 ms a file), once, before training.
    """
    from ...data import ImageFolderDataset, source_of
    from ...data.buckets import bucket_layout, plan_crop, time_ids

    n = len(dataset)
    if bucket_layout(dataset) is not None:
        return time_ids(dataset, range(n))
    s = image_size
    rows = []
    for i in range(n):
        path = source_of(dataset, i)
        if path is None:
            rows.append((s, s, 0, 0, s, s))
            continue
        w, h = ImageFolderDataset._size(Path(path))
        rows.append(plan_crop(w, h, (s, s)).time_ids() if center_crop else (h, w, 0, 0, s, s))
    return torch.tensor(rows, dtype=torch.float32).reshape(n, TIME_IDS)


class SDXL(SD):
    """The SDXL base."""

    name = "sdxl"
    label = "SDXL"
    title = "SDXL UNet"
    pipelines = ("StableDiffusionXLPipeline", "StableDiffusionXLImg2ImgPipeline")
    # SDXL ControlNets are shared, and loaded by A1111/ComfyUI, with diffusers' keys
    controlnet_file_layout = "diffusers"
    parts = {
        **SD.parts, "text_encoder_2": ("CLIPTextModelWithProjection",),
        "tokenizer_2": ("CLIPTokenizer", "CLIPTokenizerFast"),
    }
    text = (TextEncoder("text_encoder", "tokenizer", ("CLIPTextModel",), kohya="lora_te1_"),
            TextEncoder("text_encoder_2", "tokenizer_2", ("CLIPTextModelWithProjection",),
                        kohya="lora_te2_"))
    # the SDXL VAE overflows in fp16; its config says so (force_upcast) and diffusers' SDXL
    # pipeline then runs it in fp32
    vae_force_upcast = True
    kohya_version = "sdxl_base_v1-0"
    modelspec = "stable-diffusion-xl-v1-base/lora"

    def owns(self, module: nn.Module) -> bool:
        return type(module).__name__ == self.denoiser_class and \
            getattr(module.config, "addition_embed_type", None) == "text_time"

    def base_version(self, denoiser: nn.Module) -> str:
        return self.kohya_version

    # ------------------------------------------------------------------ the folder

    def check_index(self, root: Path, index: dict[str, Any]) -> None:
        """Refuse what an SDXL folder cannot train: the refiner (no first text encoder, an
        aesthetic-score conditioning), an Img2Img folder without both text encoders."""
        cls = index.get("_class_name")
        missing = [p for p in ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")
                   if not (isinstance(index.get(p), list) and index[p][1])]
        if missing:
            refiner = " (an SDXL refiner has only text_encoder_2)" \
                if "text_encoder" in missing else ""
            raise SDFolderError(f"{root} is an SDXL {cls} folder without {', '.join(missing)}"
                                f"{refiner}; steadydiff fine-tunes the SDXL base "
                                "(StableDiffusionXLPipeline: text_encoder + text_encoder_2, "
                                "tokenizer + tokenizer_2)")
        if index.get("requires_aesthetics_score"):
            raise SDFolderError(f"{root}: requires_aesthetics_score is true (an SDXL refiner's "
                                "aesthetic-score conditioning), which steadydiff does not "
                                "train; use the SDXL base folder")

    def check_config(self, root: Path, part: str, conf: dict[str, Any]) -> None:
        if part == "unet" and conf.get("addition_embed_type") != "text_time":
            raise SDFolderError(f"{root / part}/config.json: addition_embed_type is "
                                f"{conf.get('addition_embed_type')!r}; an SDXL UNet has "
                                "'text_time' (the pooled text + size/crop conditioning)")

    def force_zeros(self, index: dict[str, Any]) -> bool:
        # diffusers' StableDiffusionXLPipeline registers it (default True) in model_index
        return bool(index.get("force_zeros_for_empty_prompt", True))

    # ------------------------------------------------------------------ text

    def layout(self, tokenizers: list[Any], encoders: list[nn.Module], force_zeros: bool,
               max_sequence_length: int | None = None) -> Layout:
        length = int(tokenizers[0].model_max_length)
        return Layout(text_len=length,
                      width=sum(int(te.config.hidden_size) for te in encoders),
                      pooled_dim=int(encoders[1].config.projection_dim), extra_ids=TIME_IDS,
                      ids_len=(length, int(tokenizers[1].model_max_length)),
                      force_zeros=force_zeros)

    def encode(self, encoders: list[nn.Module], ids: list[Tensor],
               layout: Layout) -> tuple[Tensor, Tensor | None]:
        """Both encoders' penultimate hidden states concatenated (N, L, D1 + D2) and the
        second encoder's pooled projection (N, P), as ``StableDiffusionXLPipeline
        .encode_prompt`` (no attention mask, clip_skip None)."""
        h1 = encoders[0](ids[0], output_hidden_states=True).hidden_states[-2]
        out2 = encoders[1](ids[1], output_hidden_states=True)
        return torch.cat([h1, out2.hidden_states[-2]], dim=-1), out2[0]

    def identity(self, layout: Layout) -> dict[str, Any]:
        return {"sdxl": "penultimate+pooled/1", "layout": repr(layout)}

    def item_ids(self, dataset: Any, image_size: int, center_crop: bool) -> Tensor | None:
        return item_time_ids(dataset, image_size, center_crop)

    # ------------------------------------------------------------------ the denoiser

    def condition(self, x: Tensor, y: Tensor, layout: Layout, down: int) -> dict[str, Any]:
        embeds, pooled, time_ids = layout.unpack(y)
        time_ids = fill_time_ids(time_ids, x.shape[-2] * down, x.shape[-1] * down)
        cond = {"text_embeds": pooled.to(embeds.dtype), "time_ids": time_ids}
        return {"encoder_hidden_states": embeds, "added_cond_kwargs": cond}

    # ------------------------------------------------------------------ files

    def kohya_path(self, path: str, config: Any) -> str:
        return sgm_path(path, config)

    def load_single_file(self, f: Path, root: Path) -> Parts:
        from diffusers import StableDiffusionXLPipeline
        from diffusers.loaders.single_file_utils import SingleFileComponentError

        try:
            pipe = StableDiffusionXLPipeline.from_single_file(
                str(f), config=str(root), local_files_only=True, torch_dtype=torch.float32,
                add_watermarker=False)
        except (OSError, ValueError, KeyError, RuntimeError, SingleFileComponentError) as e:
            raise single_file_error(e, f, root) from None
        return Parts(f, self, pipe.unet, pipe.vae.eval(), [pipe.tokenizer, pipe.tokenizer_2],
                     [pipe.text_encoder.eval(), pipe.text_encoder_2.eval()],
                     force_zeros=bool(pipe.config.get("force_zeros_for_empty_prompt", True)))

    def original_state_dict(self, denoiser: nn.Module, vae: nn.Module | None,
                            text_encoders: list[nn.Module | None],
                            prefix: str | None = None) -> dict[str, Tensor]:
        """UNet, VAE, the CLIP under ``conditioner.embedders.0.transformer.`` and the
        OpenCLIP under ``conditioner.embedders.1.model.`` (both or neither)."""
        from ..sd.ldm import LayoutError

        tes = list(text_encoders) + [None] * (2 - len(text_encoders))
        if (tes[0] is None) != (tes[1] is None):
            raise LayoutError("an SDXL single file needs both text encoders or neither")
        out = unet_to_original(denoiser)
        if vae is not None:
            out.update(vae_to_original(vae))
        if tes[0] is not None:
            out.update(clip_to_original(tes[0], TE1))
            out.update(open_clip_keys(tes[1], TE2))
        return out

    # ------------------------------------------------------------------ tiny

    def tiny(self, path: Path, *, image_size: int = 32, seed: int = 0,
             hidden: tuple[int, int] = (16, 32), pooled_dim: int = 24,
             force_zeros_for_empty_prompt: bool = True, **kw: Any) -> Path:
        """A tiny SDXL-base-layout folder: ``text_encoder_2/`` a
        ``CLIPTextModelWithProjection`` (width ``hidden[1]``, projection ``pooled_dim``),
        ``tokenizer_2/`` padding with "!", a ``text_time`` UNet whose context is
        ``sum(hidden)`` wide, a ``force_upcast`` VAE, the base's Euler scheduler."""
        from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline

        from ..sd.tiny_parts import tiny_text_encoder, tiny_tokenizer, tiny_vae

        path = Path(path)
        # the SDXL base's scheduler_config.json
        sched = EulerDiscreteScheduler(num_train_timesteps=1000, beta_start=0.00085,
                                       beta_end=0.012, beta_schedule="scaled_linear",
                                       prediction_type="epsilon", steps_offset=1,
                                       timestep_spacing="leading", interpolation_type="linear",
                                       use_karras_sigmas=False)
        pipe = StableDiffusionXLPipeline(
            vae=tiny_vae(sample_size=image_size, seed=seed, scaling_factor=0.13025,
                         force_upcast=True),
            text_encoder=tiny_text_encoder(hidden[0], seed=seed),
            text_encoder_2=tiny_text_encoder(hidden[1], seed=seed + 1, projection=pooled_dim),
            tokenizer=tiny_tokenizer(), tokenizer_2=tiny_tokenizer(pad_token="!"),
            unet=tiny_sdxl_unet(sum(hidden), pooled_dim, sample_size=image_size // 2,
                                seed=seed),
            scheduler=sched, force_zeros_for_empty_prompt=force_zeros_for_empty_prompt,
            add_watermarker=False)
        pipe.save_pretrained(path, safe_serialization=True)
        return path


def tiny_sdxl_unet(cross_attention_dim: int = 48, pooled_dim: int = 24,
                   time_embed_dim: int = 8, sample_size: int = 16, seed: int = 0):
    """A 2-level SDXL-shaped UNet2DConditionModel: no attention at the first level (as
    SDXL's), two transformer blocks at the second, linear projections, and the
    ``text_time`` added embedding of the pooled text (``pooled_dim``) and the six size/crop
    ids (``time_embed_dim`` each): ``projection_class_embeddings_input_dim = pooled_dim +
    6 * time_embed_dim``, as SDXL's 2816 = 1280 + 6 * 256."""
    from diffusers import UNet2DConditionModel

    torch.manual_seed(seed)
    return UNet2DConditionModel(
        sample_size=sample_size, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=(32, 64), down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), transformer_layers_per_block=(1, 2),
        cross_attention_dim=cross_attention_dim, attention_head_dim=8, norm_num_groups=8,
        use_linear_projection=True, addition_embed_type="text_time",
        addition_time_embed_dim=time_embed_dim,
        projection_class_embeddings_input_dim=pooled_dim + 6 * time_embed_dim)
