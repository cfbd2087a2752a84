"""Stable Diffusion 3 / 3.5 (Esser et al. 2024): a multimodal diffusion transformer (MMDiT)
trained with rectified flow, conditioned on two CLIP encoders and T5.

A diffusers folder (``StableDiffusion3Pipeline.save_pretrained``; stable-diffusion-3-medium,
-3.5-medium, -3.5-large)::

    model_index.json   {"_class_name": "StableDiffusion3Pipeline", ...}
    transformer/       SD3Transformer2DModel (SD3.5: qk_norm "rms_norm"; 3.5 medium:
                       dual_attention_layers, MMDiT-X)
    vae/               AutoencoderKL, 16 latent channels, shift_factor 0.0609,
                       scaling_factor 1.5305
    text_encoder/      CLIPTextModelWithProjection (CLIP-L, 768)     tokenizer/    CLIP BPE
    text_encoder_2/    CLIPTextModelWithProjection (CLIP-G, 1280)    tokenizer_2/  CLIP BPE
    text_encoder_3/    T5EncoderModel (T5-XXL, 4096)                  tokenizer_3/  T5 (tokenizer.json)
    scheduler/         FlowMatchEulerDiscreteScheduler (shift 3.0)

What the transformer is conditioned on is what ``StableDiffusion3Pipeline.encode_prompt``
gives it (§5.2 of the paper): ``encoder_hidden_states`` (N, 77 + L_T5, 4096), the two CLIPs'
penultimate hidden states concatenated on the feature axis (768 + 1280), zero-padded to T5's
width, then T5's last hidden state along the sequence; ``pooled_projections`` (N, 2048), both
CLIPs' projected pooled outputs. They travel packed in ``y`` (base.Layout: the hidden states,
then the pooled rows). Its timestep is σ·1000 (the scheduler's timesteps). The null condition
is the encoded empty caption (the pipeline's negative prompt "").

The recipe: rectified flow with the scheduler's static shift (3.0), the timestep density
logit-normal(0, 1) and no loss weighting (diffusers' ``train_dreambooth_lora_sd3.py``
defaults; the paper's rf/lognorm(0.00, 1.00)), T5 at the pipeline's 256 tokens.

LoRA targets (configs/sd3_lora.yaml): the joint attention's projections of both streams
(``attn.to_q/k/v``, ``attn.to_out.0``, ``attn.add_q/k/v_proj``, ``attn.to_add_out``), as
diffusers' SD3 trainer; the CLIP text encoders optionally (not T5). Files: diffusers'
(``transformer.*``, peft key names, ``StableDiffusion3Pipeline.load_lora_weights``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..sd.original import Entry
from .base import Family, Layout, SDFolderError, Setting, TextEncoder
from .flowmatch import (SCHEDULER, TransformerFiles, encoder_autocast_off, flow_recipe,
                        prepare_joint_attention, trainer_defaults)

__all__ = ["SD3", "original_table"]

_CLIP_TOK = ("CLIPTokenizer", "CLIPTokenizerFast")
_T5_TOK = ("T5Tokenizer", "T5TokenizerFast")


def original_table(conf: Any) -> list[Entry]:
    """Stability's MMDiT layout (``sd3_medium.safetensors``, under ``model.diffusion_model.``:
    ``joint_blocks.N.x_block`` / ``context_block``, fused ``qkv``) from an
    SD3Transformer2DModel config: the inverse of diffusers'
    ``convert_sd3_transformer_checkpoint_to_diffusers``."""
    t = [Entry("pos_embed", ("pos_embed.pos_embed",), "param"),
         Entry("x_embedder.proj", ("pos_embed.proj",)),
         Entry("t_embedder.mlp.0", ("time_text_embed.timestep_embedder.linear_1",)),
         Entry("t_embedder.mlp.2", ("time_text_embed.timestep_embedder.linear_2",)),
         Entry("context_embedder", ("context_embedder",)),
         Entry("y_embedder.mlp.0", ("time_text_embed.text_embedder.linear_1",)),
         Entry("y_embedder.mlp.2", ("time_text_embed.text_embedder.linear_2",))]
    last = conf.num_layers - 1
    for i in range(conf.num_layers):
        o, d = f"joint_blocks.{i}.", f"transformer_blocks.{i}."
        x, c, a = o + "x_block.", o + "context_block.", d + "attn."
        t += [Entry(x + "attn.qkv", (a + "to_q", a + "to_k", a + "to_v")),
              Entry(c + "attn.qkv", (a + "add_q_proj", a + "add_k_proj", a + "add_v_proj")),
              Entry(x + "attn.proj", (a + "to_out.0",)),
              Entry(x + "adaLN_modulation.1", (d + "norm1.linear",)),
              Entry(c + "adaLN_modulation.1", (d + "norm1_context.linear",),
                    "swap" if i == last else "cat"),
              Entry(x + "mlp.fc1", (d + "ff.net.0.proj",)),
              Entry(x + "mlp.fc2", (d + "ff.net.2",))]
        if conf.qk_norm:
            t += [Entry(x + "attn.ln_q", (a + "norm_q",)), Entry(x + "attn.ln_k", (a + "norm_k",)),
                  Entry(c + "attn.ln_q", (a + "norm_added_q",)),
                  Entry(c + "attn.ln_k", (a + "norm_added_k",))]
        if i != last:
            t += [Entry(c + "attn.proj", (a + "to_add_out",)),
                  Entry(c + "mlp.fc1", (d + "ff_context.net.0.proj",)),
                  Entry(c + "mlp.fc2", (d + "ff_context.net.2",))]
        if i in tuple(conf.dual_attention_layers or ()):
            a2 = d + "attn2."
            t += [Entry(x + "attn2.qkv", (a2 + "to_q", a2 + "to_k", a2 + "to_v")),
                  Entry(x + "attn2.proj", (a2 + "to_out.0",))]
            if conf.qk_norm:
                t += [Entry(x + "attn2.ln_q", (a2 + "norm_q",)),
                      Entry(x + "attn2.ln_k", (a2 + "norm_k",))]
    t += [Entry("final_layer.linear", ("proj_out",)),
          Entry("final_layer.adaLN_modulation.1", ("norm_out.linear",), "swap")]
    return t


class SD3(TransformerFiles, Family):
    """Stable Diffusion 3 and 3.5 (medium, large)."""

    name = "sd3"
    example_config = "configs/sd3_lora.yaml"
    label = "SD3/SD3.5"
    title = "SD3 transformer"
    pipelines = ("StableDiffusion3Pipeline",)
    parts = {
        "transformer": ("SD3Transformer2DModel",),
        "vae": ("AutoencoderKL",),
        "text_encoder": ("CLIPTextModelWithProjection",),
        "tokenizer": _CLIP_TOK,
        "text_encoder_2": ("CLIPTextModelWithProjection",),
        "tokenizer_2": _CLIP_TOK,
        "text_encoder_3": ("T5EncoderModel",),
        "tokenizer_3": _T5_TOK,
        "scheduler": SCHEDULER,
    }
    denoiser = "transformer"
    denoiser_word = "transformer"
    denoiser_class = "SD3Transformer2DModel"
    text = (TextEncoder("text_encoder", "tokenizer", ("CLIPTextModelWithProjection",),
                        kohya="lora_te1_"),
            TextEncoder("text_encoder_2", "tokenizer_2", ("CLIPTextModelWithProjection",),
                        kohya="lora_te2_"),
            TextEncoder("text_encoder_3", "tokenizer_3", ("T5EncoderModel",), lora=False,
                        kohya="lora_te3_", fp16=False))
    kohya_version = "sd3"
    modelspec = "stable-diffusion-v3-medium/lora"
    diffusers_lora_keys = "peft"
    kohya_module = "networks.lora_sd3"
    #: T5's length in StableDiffusion3Pipeline (max_sequence_length=256)
    t5_length = 256

    # ------------------------------------------------------------------ the folder

    def check_index(self, root: Path, index: dict[str, Any]) -> None:
        if isinstance(index.get("text_encoder_3"), list) and not index["text_encoder_3"][1]:
            raise SDFolderError(f"{root}/model_index.json: text_encoder_3 is null (an SD3 "
                                "folder saved without T5); steadydiff trains SD3 with its "
                                "three text encoders: use the folder with text_encoder_3/ "
                                "and tokenizer_3/")

    def recipe(self, root: Path) -> dict[str, Setting]:
        trainers = "the SD3 trainers' default (diffusers train_dreambooth_lora_sd3.py)"
        return flow_recipe(root, {
            **trainer_defaults(trainers),
            # StableDiffusion3Pipeline samples the scheduler's own grid (no sigmas passed)
            "diffusion.flow.grid_end": Setting("table", "StableDiffusion3Pipeline's grid (the "
                                               "scheduler's, to shift(1/1000))"),
            "sample.sampler": Setting("euler", "StableDiffusion3Pipeline's "
                                      "FlowMatchEulerDiscreteScheduler", default=True),
            "sample.cfg_scale": Setting(7.0, "StableDiffusion3Pipeline's guidance_scale",
                                        default=True),
        })

    def describe(self, root: Path, model: Any) -> list[str]:
        from .base import read_json

        conf = read_json(root / "transformer" / "config.json", "the transformer's config")
        return super().describe(root, model) + [
            f"T5 {model.max_sequence_length or self.t5_length} tokens after CLIP-L+G's 77",
            f"pooled projections {conf.get('pooled_projection_dim')} (CLIP-L+G)",
            f"qk_norm {conf.get('qk_norm')}",
            f"{conf.get('patch_size', 2)}x{conf.get('patch_size', 2)} patches"]

    def denoiser_multiple(self, conf: dict[str, Any]) -> int:
        return int(conf.get("patch_size", 2))

    def latent_shape(self, conf: Any, vae_conf: Any) -> tuple[int, int]:
        return int(conf.in_channels), int(conf.sample_size)

    def max_sequence_length(self, conf: Any) -> int | None:
        return self.t5_length

    # ------------------------------------------------------------------ text

    def layout(self, tokenizers: list[Any], encoders: list[nn.Module], force_zeros: bool,
               max_sequence_length: int | None = None) -> Layout:
        clip = int(tokenizers[0].model_max_length)
        t5 = int(max_sequence_length or self.t5_length)  # the pipeline's default
        return Layout(text_len=clip + t5, width=int(encoders[2].config.d_model),
                      pooled_dim=sum(int(te.config.projection_dim) for te in encoders[:2]),
                      ids_len=(clip, int(tokenizers[1].model_max_length), t5),
                      pad_ids=tuple(t.pad_token_id for t in tokenizers))

    def encode(self, encoders: list[nn.Module], ids: list[Tensor],
               layout: Layout) -> tuple[Tensor, Tensor | None]:
        """As ``StableDiffusion3Pipeline.encode_prompt`` (clip_skip None): each CLIP's
        penultimate hidden state and projected pooled output, T5's last hidden state (run
        outside an fp16 autocast); the CLIP states zero-padded to T5's width."""
        hidden, pooled = [], []
        for te, i in zip(encoders[:2], ids[:2]):
            out = te(i, output_hidden_states=True)
            hidden.append(out.hidden_states[-2].float())
            pooled.append(out[0].float())
        with encoder_autocast_off(ids[2].device):
            t5 = encoders[2](ids[2])[0].float()
        clip = torch.cat(hidden, dim=-1)
        clip = torch.nn.functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
        return torch.cat([clip, t5], dim=-2), torch.cat(pooled, dim=-1)

    def identity(self, layout: Layout) -> dict[str, Any]:
        return {"sd3": "clip-penultimate+t5/1", "layout": repr(layout)}

    # ------------------------------------------------------------------ the denoiser

    def prepare_attention(self, denoiser: nn.Module) -> None:
        prepare_joint_attention(denoiser)

    def call(self, denoiser: nn.Module, x: Tensor, t: Tensor, y: Tensor, layout: Layout,
             down: int, guidance: float | None = None, **extra: Any) -> Tensor:
        embeds, pooled, _ = layout.unpack(y)
        dtype = embeds.dtype
        return denoiser(hidden_states=x, timestep=t, encoder_hidden_states=embeds,
                        pooled_projections=pooled.to(dtype), return_dict=False, **extra)[0]

    # ------------------------------------------------------------------ ControlNet

    controlnet_file_layout = "diffusers"  # ComfyUI's SD3 (mmdit) ControlNet loader's keys
    controlnet_class = "SD3ControlNetModel"
    controlnet_latent = True
    #: diffusers train_controlnet_sd3.py: ``from_transformer``'s 12 joint blocks
    controlnet_layers = 12

    def build_controlnet(self, denoiser: nn.Module, down: int, conditioning_channels: int,
                         layers: tuple[int | None, int | None]) -> nn.Module:
        """``SD3ControlNetModel.from_transformer``: the first ``controlnet.num_layers``
        joint blocks (default 12; at most all but the base's last, whose context stream
        ends there: ``context_pre_only``), the embedders copied, the input projection and
        the output linears zero; no extra conditioning channels (diffusers' trainer's
        default)."""
        from diffusers import SD3ControlNetModel

        if layers[1] is not None:
            raise ValueError("controlnet.num_single_layers applies to FLUX.1 ControlNets; an "
                             "SD3 ControlNet has joint blocks only (controlnet.num_layers)")
        most = max(1, int(denoiser.config.num_layers) - 1)
        if layers[0] is not None and layers[0] > most:
            raise ValueError(f"controlnet.num_layers={layers[0]}: an SD3 ControlNet copies at "
                             f"most {most} of this transformer's "
                             f"{denoiser.config.num_layers} joint blocks (not the last, "
                             "whose context stream ends there)")
        n = min(layers[0] or self.controlnet_layers, most)
        return SD3ControlNetModel.from_transformer(denoiser, num_layers=n,
                                                   num_extra_conditioning_channels=0)

    def controlnet_input(self, controlnet: nn.Module, latents: Tensor, shift: float,
                         scale: float) -> Tensor:
        # StableDiffusion3ControlNetPipeline: a ControlNet whose config has
        # force_zeros_for_pooled_projection (InstantX's, and from_transformer's default)
        # reads its latents unshifted
        if controlnet.config.force_zeros_for_pooled_projection:
            return latents + shift * scale
        return latents

    def controlnet_residuals(self, controlnet: nn.Module, x: Tensor, t: Tensor, y: Tensor,
                             layout: Layout, down: int, cond: Tensor, scale: float,
                             guidance: float | None = None) -> dict[str, Any]:
        """As StableDiffusion3ControlNetPipeline: the prompt embeds (when the ControlNet
        has a context embedder), the pooled projections (zeros under
        ``force_zeros_for_pooled_projection``); its block samples go to the transformer
        as ``block_controlnet_hidden_states``."""
        embeds, pooled, _ = layout.unpack(y)
        pooled = pooled.to(embeds.dtype)
        if controlnet.config.force_zeros_for_pooled_projection:
            pooled = torch.zeros_like(pooled)
        blocks = controlnet(hidden_states=x, controlnet_cond=cond.to(x.dtype),
                            conditioning_scale=scale, timestep=t,
                            encoder_hidden_states=(embeds if controlnet.config.joint_attention_dim
                                                   is not None else None),
                            pooled_projections=pooled, return_dict=False)[0]
        return {"block_controlnet_hidden_states": blocks}

    # ------------------------------------------------------------------ files

    def kohya_entries(self, config: Any) -> list[Entry] | None:
        return original_table(config)

    file_prefix = "model.diffusion_model."
    original_table = staticmethod(original_table)

    def single_file_keys(self) -> tuple[str, ...]:
        return ("model.diffusion_model.joint_blocks.", "joint_blocks.")

    # ------------------------------------------------------------------ tiny

    def tiny(self, path: Path, *, image_size: int = 32, seed: int = 0,
             qk_norm: str | None = None, **kw: Any) -> Path:
        """A tiny SD3-layout folder: a 2-block SD3Transformer2DModel (``qk_norm``
        "rms_norm": SD3.5's) over 4-channel latents (image_size / 2, patch 2), CLIP-L and
        CLIP-G with projections (16 and 24 wide), a 2-layer T5 (48 wide, a tokenizer.json
        built with ``tokenizers``), the SD3 VAE's shift and scaling factors, the scheduler
        SD3 ships (shift 3.0)."""
        from diffusers import (FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel,
                               StableDiffusion3Pipeline)

        from ..sd.tiny_parts import (tiny_t5, tiny_t5_tokenizer, tiny_text_encoder,
                                     tiny_tokenizer, tiny_vae)

        path = Path(path)
        heads, head_dim, t5_dim = 2, 8, 48
        torch.manual_seed(seed)
        transformer = SD3Transformer2DModel(
            sample_size=image_size // 2, patch_size=2, in_channels=4, num_layers=2,
            attention_head_dim=head_dim, num_attention_heads=heads,
            joint_attention_dim=t5_dim, caption_projection_dim=heads * head_dim,
            pooled_projection_dim=16 + 24, out_channels=4, pos_embed_max_size=32,
            qk_norm=qk_norm)
        pipe = StableDiffusion3Pipeline(
            transformer=transformer,
            vae=tiny_vae(sample_size=image_size, seed=seed, scaling_factor=1.5305,
                         shift_factor=0.0609, use_quant_conv=False,
                         use_post_quant_conv=False),
            text_encoder=tiny_text_encoder(16, seed=seed, projection=16),
            tokenizer=tiny_tokenizer(),
            text_encoder_2=tiny_text_encoder(24, seed=seed + 1, projection=24),
            tokenizer_2=tiny_tokenizer(pad_token="!"),
            text_encoder_3=tiny_t5(t5_dim, seed=seed + 2), tokenizer_3=tiny_t5_tokenizer(),
            scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0))
        pipe.save_pretrained(path, safe_serialization=True)
        return path
