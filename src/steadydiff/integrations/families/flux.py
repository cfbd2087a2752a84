"""FLUX.1 (Black Forest Labs 2024; dev and schnell): a 12B rectified-flow transformer of
double-stream (MMDiT) and single-stream blocks, its latents packed into 2x2 patches, its
positions rotary (3-axis ids), conditioned on T5 and a CLIP's pooled output; dev is
guidance-distilled (the guidance scale is an input, not a second pass).

A diffusers folder (``FluxPipeline.save_pretrained``; FLUX.1-dev, FLUX.1-schnell)::

    model_index.json   {"_class_name": "FluxPipeline", ...}
    transformer/       FluxTransformer2DModel (in_channels 64 = 16 latent channels x 2x2;
                       guidance_embeds true for dev, false for schnell)
    vae/               AutoencoderKL, 16 latent channels, shift_factor 0.1159,
                       scaling_factor 0.3611
    text_encoder/      CLIPTextModel (CLIP-L; its pooled output only)   tokenizer/   CLIP BPE
    text_encoder_2/    T5EncoderModel (T5-XXL, 4096)                      tokenizer_2/ T5 (tokenizer.json)
    scheduler/         FlowMatchEulerDiscreteScheduler (use_dynamic_shifting: base_shift 0.5,
                       max_shift 1.15 over 256..4096 image tokens)

The transformer call is ``FluxPipeline``'s: the latents (N, C, H, W) packed into (N, H/2 *
W/2, 4C) 2x2 patches (``_pack_latents``), their position ids (0, row, column) per patch
(``_prepare_latent_image_ids``), the text's ids zeros (L, 3); ``encoder_hidden_states`` T5's
last hidden state (N, L, 4096); ``pooled_projections`` CLIP's pooled output (N, 768); the
timestep σ (the pipeline's ``timestep / 1000``); ``guidance`` the distilled guidance scale
(dev; ``model.guidance``, 3.5 by default as the pipeline and the trainers); the output
unpacked. T5's length is 512 for dev and 256 for schnell (kohya's rule; the pipeline's
``max_sequence_length``). The null condition (caption dropout) is the encoded empty caption;
dev samples without a second, unconditional pass (no classifier-free guidance).

The recipe: rectified flow with the dynamic shift of the scheduler config (mu from the
image's token count H/16 * W/16), the timestep density logit-normal(0, 1), no loss
weighting, no caption dropout (guidance-distilled: nothing samples the null condition).

LoRA targets (configs/flux_lora.yaml): the attention projections of the double blocks'
both streams and of the single blocks (``attn.to_q/k/v``, ``attn.to_out.0``,
``attn.add_q/k/v_proj``, ``attn.to_add_out``), optionally the MLPs (``ff.net.*``,
``ff_context.net.*``, ``proj_mlp``, ``proj_out``), as diffusers' FLUX trainer; CLIP
optionally (not T5). Files: diffusers' (``transformer.*``, ``FluxPipeline.load_lora_weights``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..sd.original import Entry
from .base import Family, Layout, Setting, TextEncoder
from .flowmatch import (SCHEDULER, TransformerFiles, trainer_defaults, encoder_autocast_off,
                        flow_recipe, prepare_joint_attention, vae_down)

__all__ = ["Flux", "pack", "unpack", "image_ids", "original_table"]

#: the pipelines' (and the trainers') default distilled guidance for FLUX.1 dev
GUIDANCE = 3.5


def pack(x: Tensor) -> Tensor:
    """(N, C, H, W) latents -> (N, H/2 * W/2, 4C) 2x2 patches, as
    ``FluxPipeline._pack_latents``."""
    n, c, h, w = x.shape
    x = x.view(n, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(n, (h // 2) * (w // 2), c * 4)


def unpack(x: Tensor, h: int, w: int) -> Tensor:
    """(N, H/2 * W/2, 4C) -> (N, C, H, W), the inverse of :func:`pack`
    (``FluxPipeline._unpack_latents`` at latent size H x W)."""
    n, _, c4 = x.shape
    x = x.view(n, h // 2, w // 2, c4 // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(n, c4 // 4, h, w)


def image_ids(h: int, w: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """(h * w, 3) position ids (0, row, column) of an h x w grid of patches, as
    ``FluxPipeline._prepare_latent_image_ids``."""
    ids = torch.zeros(h, w, 3)
    ids[..., 1] = ids[..., 1] + torch.arange(h)[:, None]
    ids[..., 2] = ids[..., 2] + torch.arange(w)[None, :]
    return ids.reshape(h * w, 3).to(device=device, dtype=dtype)


def original_table(conf: Any) -> list[Entry]:
    """Black Forest Labs' FLUX.1 layout (``flux1-dev.safetensors``: ``double_blocks``,
    ``single_blocks``, fused ``qkv`` and ``linear1``) from a FluxTransformer2DModel config:
    the inverse of diffusers' ``convert_flux_transformer_checkpoint_to_diffusers``."""
    t = [Entry("time_in.in_layer", ("time_text_embed.timestep_embedder.linear_1",)),
         Entry("time_in.out_layer", ("time_text_embed.timestep_embedder.linear_2",)),
         Entry("vector_in.in_layer", ("time_text_embed.text_embedder.linear_1",)),
         Entry("vector_in.out_layer", ("time_text_embed.text_embedder.linear_2",)),
         Entry("txt_in", ("context_embedder",)), Entry("img_in", ("x_embedder",))]
    if conf.guidance_embeds:
        t += [Entry("guidance_in.in_layer", ("time_text_embed.guidance_embedder.linear_1",)),
              Entry("guidance_in.out_layer", ("time_text_embed.guidance_embedder.linear_2",))]
    for i in range(conf.num_layers):
        o, d = f"double_blocks.{i}.", f"transformer_blocks.{i}."
        a = d + "attn."
        t += [Entry(o + "img_mod.lin", (d + "norm1.linear",)),
              Entry(o + "txt_mod.lin", (d + "norm1_context.linear",)),
              Entry(o + "img_attn.qkv", (a + "to_q", a + "to_k", a + "to_v")),
              Entry(o + "txt_attn.qkv", (a + "add_q_proj", a + "add_k_proj", a + "add_v_proj")),
              Entry(o + "img_attn.norm.query_norm", (a + "norm_q",), "scale"),
              Entry(o + "img_attn.norm.key_norm", (a + "norm_k",), "scale"),
              Entry(o + "txt_attn.norm.query_norm", (a + "norm_added_q",), "scale"),
              Entry(o + "txt_attn.norm.key_norm", (a + "norm_added_k",), "scale"),
              Entry(o + "img_attn.proj", (a + "to_out.0",)),
              Entry(o + "txt_attn.proj", (a + "to_add_out",)),
              Entry(o + "img_mlp.0", (d + "ff.net.0.proj",)),
              Entry(o + "img_mlp.2", (d + "ff.net.2",)),
              Entry(o + "txt_mlp.0", (d + "ff_context.net.0.proj",)),
              Entry(o + "txt_mlp.2", (d + "ff_context.net.2",))]
    for i in range(conf.num_single_layers):
        o, d = f"single_blocks.{i}.", f"single_transformer_blocks.{i}."
        a = d + "attn."
        t += [Entry(o + "modulation.lin", (d + "norm.linear",)),
              Entry(o + "linear1", (a + "to_q", a + "to_k", a + "to_v", d + "proj_mlp")),
              Entry(o + "norm.query_norm", (a + "norm_q",), "scale"),
              Entry(o + "norm.key_norm", (a + "norm_k",), "scale"),
              Entry(o + "linear2", (d + "proj_out",))]
    t += [Entry("final_layer.linear", ("proj_out",)),
          Entry("final_layer.adaLN_modulation.1", ("norm_out.linear",), "swap")]
    return t


class Flux(TransformerFiles, Family):
    """FLUX.1 dev and schnell."""

    name = "flux"
    example_config = "configs/flux_lora.yaml"
    label = "FLUX.1"
    title = "FLUX.1 transformer"
    pipelines = ("FluxPipeline",)
    parts = {
        "transformer": ("FluxTransformer2DModel",),
        "vae": ("AutoencoderKL",),
        "text_encoder": ("CLIPTextModel",),
        "tokenizer": ("CLIPTokenizer", "CLIPTokenizerFast"),
        "text_encoder_2": ("T5EncoderModel",),
        "tokenizer_2": ("T5Tokenizer", "T5TokenizerFast"),
        "scheduler": SCHEDULER,
    }
    denoiser = "transformer"
    denoiser_word = "transformer"
    denoiser_class = "FluxTransformer2DModel"
    text = (TextEncoder("text_encoder", "tokenizer", ("CLIPTextModel",), kohya="lora_te1_"),
            TextEncoder("text_encoder_2", "tokenizer_2", ("T5EncoderModel",), lora=False,
                        kohya="lora_te2_", fp16=False))
    kohya_version = "flux1"
    modelspec = "flux-1-dev/lora"
    diffusers_lora_keys = "peft"
    kohya_module = "networks.lora_flux"

    def recipe(self, root: Path) -> dict[str, Setting]:
        trainers = "the FLUX.1 trainers' default (diffusers train_dreambooth_lora_flux.py)"
        return flow_recipe(root, {
            **trainer_defaults(trainers),
            "diffusion.cfg_dropout": Setting(
                0.0, "FLUX.1 is guidance-distilled: no unconditional pass samples the null "
                "condition", default=True),
            # the dynamic shift counts FluxPipeline's tokens: 2x2 patches of latents
            "diffusion.flow.token_pixels": Setting(
                2 * vae_down(root), f"{root.name}/vae/config.json: x{vae_down(root)} "
                "downsampling, then 2x2 packing"),
            "diffusion.flow.grid_end": Setting("steps", "FluxPipeline's grid, "
                                               "linspace(1, 1/n, n)"),
            "sample.sampler": Setting("euler", "FluxPipeline's FlowMatchEulerDiscreteScheduler",
                                      default=True),
            "sample.cfg_scale": Setting(1.0, "guidance-distilled: the guidance is embedded "
                                        "(model.guidance), no unconditional pass",
                                        default=True),
        })

    def describe(self, root: Path, model: Any) -> list[str]:
        from .base import read_json

        conf = read_json(root / "transformer" / "config.json", "the transformer's config")
        dev = bool(conf.get("guidance_embeds"))
        t5 = model.max_sequence_length or (512 if dev else 256)
        return super().describe(root, model) + [
            f"T5 {t5} tokens", "CLIP-L pooled", "latents packed 2x2 with (0, row, col) ids",
            (f"guidance embedding {GUIDANCE if model.guidance is None else model.guidance} "
             "(dev)") if dev else "no guidance embedding (schnell)"]

    def denoiser_multiple(self, conf: dict[str, Any]) -> int:
        return 2  # the 2x2 packing

    def latent_shape(self, conf: Any, vae_conf: Any) -> tuple[int, int]:
        # the transformer has no native size (its positions are rotary); the pipeline draws
        # at the VAE's sample size (1024 px: 128 latents, its default_sample_size)
        if vae_conf is None:
            return int(conf.in_channels) // 4, 128  # FluxPipeline's default_sample_size
        down = 2 ** (len(vae_conf.block_out_channels) - 1)
        return int(conf.in_channels) // 4, int(vae_conf.sample_size) // down

    def max_sequence_length(self, transformer_config: Any) -> int | None:
        """T5's length: 512 for dev (guidance-distilled), 256 for schnell (kohya's
        ``t5xxl_max_token_length`` rule; the pipelines' ``max_sequence_length``)."""
        return 512 if getattr(transformer_config, "guidance_embeds", False) else 256

    # ------------------------------------------------------------------ text

    def layout(self, tokenizers: list[Any], encoders: list[nn.Module], force_zeros: bool,
               max_sequence_length: int | None = None) -> Layout:
        t5 = int(max_sequence_length or 512)
        return Layout(text_len=t5, width=int(encoders[1].config.d_model),
                      pooled_dim=int(encoders[0].config.hidden_size),
                      ids_len=(int(tokenizers[0].model_max_length), t5),
                      pad_ids=tuple(t.pad_token_id for t in tokenizers))

    def encode(self, encoders: list[nn.Module], ids: list[Tensor],
               layout: Layout) -> tuple[Tensor, Tensor | None]:
        """As ``FluxPipeline.encode_prompt``: T5's last hidden state (run outside an fp16
        autocast) and CLIP's pooled output."""
        pooled = encoders[0](ids[0], output_hidden_states=False).pooler_output.float()
        with encoder_autocast_off(ids[1].device):
            embeds = encoders[1](ids[1], output_hidden_states=False)[0].float()
        return embeds, pooled

    def identity(self, layout: Layout) -> dict[str, Any]:
        return {"flux": "t5+clip-pooled/1", "layout": repr(layout)}

    # ------------------------------------------------------------------ the denoiser

    def prepare_attention(self, denoiser: nn.Module) -> None:
        prepare_joint_attention(denoiser)

    def call(self, denoiser: nn.Module, x: Tensor, t: Tensor, y: Tensor, layout: Layout,
             down: int, guidance: float | None = None, **extra: Any) -> Tensor:
        n, _, h, w = x.shape
        embeds, pooled, _ = layout.unpack(y)
        dtype = embeds.dtype
        g = None
        if denoiser.config.guidance_embeds:
            g = torch.full((n,), GUIDANCE if guidance is None else guidance,
                           device=x.device, dtype=torch.float32)
        out = denoiser(hidden_states=pack(x), timestep=t / 1000, guidance=g,
                       pooled_projections=pooled.to(dtype), encoder_hidden_states=embeds,
                       txt_ids=torch.zeros(embeds.shape[1], 3, device=x.device, dtype=dtype),
                       img_ids=image_ids(h // 2, w // 2, x.device, dtype),
                       return_dict=False, **extra)[0]
        return unpack(out, h, w)

    # ------------------------------------------------------------------ ControlNet

    controlnet_file_layout = "diffusers"  # ComfyUI's InstantX FLUX ControlNet loader's keys
    controlnet_class = "FluxControlNetModel"
    controlnet_latent = True
    #: diffusers train_controlnet_flux.py: --num_double_layers 4, --num_single_layers 4
    controlnet_layers = (4, 4)

    def build_controlnet(self, denoiser: nn.Module, down: int, conditioning_channels: int,
                         layers: tuple[int | None, int | None]) -> nn.Module:
        """``FluxControlNetModel.from_transformer``: the first ``controlnet.num_layers``
        double and ``num_single_layers`` single blocks (default 4 and 4, as diffusers'
        trainer; at most the base's), the base's heads, the embedders copied, the
        conditioning embedder and the output linears zero."""
        from diffusers import FluxControlNetModel

        conf = denoiser.config
        double = min(self.controlnet_layers[0] if layers[0] is None else layers[0],
                     int(conf.num_layers))
        single = min(self.controlnet_layers[1] if layers[1] is None else layers[1],
                     int(conf.num_single_layers))
        return FluxControlNetModel.from_transformer(
            denoiser, num_layers=double, num_single_layers=single,
            attention_head_dim=int(conf.attention_head_dim),
            num_attention_heads=int(conf.num_attention_heads))

    def controlnet_input(self, controlnet: nn.Module, latents: Tensor, shift: float,
                         scale: float) -> Tensor:
        return pack(latents)  # FluxControlNetPipeline packs the control latents 2x2

    def controlnet_residuals(self, controlnet: nn.Module, x: Tensor, t: Tensor, y: Tensor,
                             layout: Layout, down: int, cond: Tensor, scale: float,
                             guidance: float | None = None) -> dict[str, Any]:
        """As FluxControlNetPipeline: the packed latents and the same ids, timestep and
        condition as the transformer's; its own guidance embedding when its config has
        one; the double and single block samples go to the transformer."""
        n, _, h, w = x.shape
        embeds, pooled, _ = layout.unpack(y)
        dtype = embeds.dtype
        g = None
        if controlnet.config.guidance_embeds:
            g = torch.full((n,), GUIDANCE if guidance is None else guidance,
                           device=x.device, dtype=torch.float32)
        double, single = controlnet(
            hidden_states=pack(x), controlnet_cond=cond.to(x.dtype), conditioning_scale=scale,
            timestep=t / 1000, guidance=g, pooled_projections=pooled.to(dtype),
            encoder_hidden_states=embeds,
            txt_ids=torch.zeros(embeds.shape[1], 3, device=x.device, dtype=dtype),
            img_ids=image_ids(h // 2, w // 2, x.device, dtype), return_dict=False)
        return {"controlnet_block_samples": double, "controlnet_single_block_samples": single}

    # ------------------------------------------------------------------ files

    def kohya_entries(self, config: Any) -> list[Entry] | None:
        return original_table(config)

    original_table = staticmethod(original_table)

    def single_file_keys(self) -> tuple[str, ...]:
        return ("double_blocks.", "model.diffusion_model.double_blocks.")

    # ------------------------------------------------------------------ tiny

    def tiny(self, path: Path, *, image_size: int = 32, seed: int = 0,
             guidance_embeds: bool = True, **kw: Any) -> Path:
        """A tiny FLUX.1-layout folder: a FluxTransformer2DModel of one double and two
        single blocks (``guidance_embeds`` true: dev; false: schnell) over 4-channel
        latents packed 2x2 (in_channels 16), CLIP-L (16 wide) for the pooled output, a
        2-layer T5 (48 wide, a tokenizer.json built with ``tokenizers``), the FLUX VAE's
        shift and scaling factors, the scheduler FLUX ships (dynamic shifting)."""
        from diffusers import (FlowMatchEulerDiscreteScheduler, FluxPipeline,
                               FluxTransformer2DModel)

        from ..sd.tiny_parts import (tiny_t5, tiny_t5_tokenizer, tiny_text_encoder,
                                     tiny_tokenizer, tiny_vae)

        path = Path(path)
        torch.manual_seed(seed)
        transformer = FluxTransformer2DModel(
            patch_size=1, in_channels=16, num_layers=1, num_single_layers=2,
            attention_head_dim=8, num_attention_heads=2, joint_attention_dim=48,
            pooled_projection_dim=16, guidance_embeds=guidance_embeds, axes_dims_rope=(2, 2, 4))
        sched = FlowMatchEulerDiscreteScheduler(
            num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5,
            max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096)
        pipe = FluxPipeline(
            transformer=transformer,
            vae=tiny_vae(sample_size=image_size, seed=seed, scaling_factor=0.3611,
                         shift_factor=0.1159, use_quant_conv=False,
                         use_post_quant_conv=False),
            text_encoder=tiny_text_encoder(16, seed=seed), tokenizer=tiny_tokenizer(),
            text_encoder_2=tiny_t5(48, seed=seed + 2),
            tokenizer_2=tiny_t5_tokenizer(512 if guidance_embeds else 256),
            scheduler=sched)
        pipe.save_pretrained(path, safe_serialization=True)
        return path
