"""Z-Image (Tongyi-MAI 2025; Z-Image and Z-Image-Turbo): a 6B single-stream diffusion
transformer (S3-DiT: text and image tokens in one sequence, QK-norm, sandwich norms, 3-axis
rotary positions) trained with rectified flow, conditioned on a Qwen3 language model's
penultimate hidden states, over FLUX.1's 16-channel VAE.

Why this family (docs/sd.md, "Z-Image"): it is what people fine-tune now. Z-Image-Turbo
draws photographs in 8 steps on a 16 GB card under an Apache-2.0 licence, and its users ask
every trainer for it (diffusers' ZImagePipeline and its LoRA loader, which reads the kohya
and ComfyUI LoRA names of the community's trainers; ai-toolkit's and musubi-tuner's Z-Image
LoRA support); and its text encoder is a chat LLM run through a chat template, the shape the
current families (Qwen-Image, FLUX.2, Lumina 2) share, which the CLIP/T5 families did not
exercise.

A diffusers folder (``ZImagePipeline.save_pretrained``; Z-Image-Turbo, Z-Image)::

    model_index.json   {"_class_name": "ZImagePipeline", ...}
    transformer/       ZImageTransformer2DModel (in_channels 16, patch 2x2, cap_feat_dim
                       2560 = Qwen3-4B's width)
    vae/               AutoencoderKL (FLUX.1's: shift_factor 0.1159, scaling_factor 0.3611)
    text_encoder/      Qwen3Model (Qwen3-4B)   tokenizer/  Qwen2Tokenizer (tokenizer.json and
                       a chat template)
    scheduler/         FlowMatchEulerDiscreteScheduler (static shift 3.0)

What the transformer is conditioned on is what ``ZImagePipeline.encode_prompt`` gives it:
each caption put through the tokenizer's chat template (a user turn, the assistant's turn
opened, ``enable_thinking=True``), padded to 512 tokens, Qwen3's penultimate hidden state
(``hidden_states[-2]``) with the attention mask, and of each caption only its own tokens
(the padding dropped: a list of (L_i, D)). They travel in ``y`` (N, 512, D) with the
padding's rows zero, and the call drops the zero rows again (a real token's hidden state is
never exactly zero). The transformer takes a list of (C, 1, H, W) latents, its timestep is
1 - σ (``(1000 - t) / 1000``) and it predicts x0 - ε: the call negates it into steadydiff's
flow target ε - x0. Classifier-free guidance in ZImagePipeline is ``pos + g (pos - neg)``:
its ``guidance_scale`` g is steadydiff's ``sample.cfg_scale`` g + 1 (Turbo: g = 0, one
pass, ``sample.cfg_scale=1``).

The recipe: rectified flow with the scheduler config's shift (static 3.0 in the released
folders; dynamic from the token count where the config asks), the pipeline's grid
``linspace(1, 1/n, n)``, the timestep density logit-normal(0, 1) and no loss weighting
(diffusers' flow-matching LoRA trainers' defaults), Qwen3 at 512 tokens, guidance 5 (the
pipeline's default; ``sample.cfg_scale`` 6).

LoRA targets (configs/zimage_lora.yaml): the attention projections of every block (the
main ``layers``, the ``noise_refiner`` and ``context_refiner``: ``attention.to_q/k/v``,
``attention.to_out.0``), optionally the SwiGLU MLPs (``feed_forward.w1/w2/w3``); not the
Qwen3 encoder. Files: diffusers' (``transformer.*`` with peft names,
``ZImagePipeline.load_lora_weights``) and kohya's names over the same modules
(``lora_unet_layers_0_attention_to_q``, what the community's Z-Image LoRAs use and
diffusers' Z-Image loader converts).

Single files: the transformer alone in Tongyi-MAI's layout (what ComfyUI loads and diffusers'
``ZImageTransformer2DModel.from_single_file`` converts, :func:`original_table`), read as a
base with ``model.single_file_config`` naming a folder for the other parts, and written by a
full fine-tune from one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from .attention import UpcastJointAttention
from .base import Family, Layout, Parts, Setting, TextEncoder
from .flowmatch import (SCHEDULER, TransformerFiles, encoder_autocast_off, flow_recipe,
                        trainer_defaults, vae_down)

__all__ = ["ZImage", "ChatTokenizer", "caption_tokens"]

#: ZImagePipeline's max_sequence_length
TOKENS = 512
#: ZImagePipeline's default guidance_scale (pos + g (pos - neg))
GUIDANCE = 5.0


class ChatTokenizer:
    """A tokenizer that puts each caption through its chat template first, as
    ``ZImagePipeline._encode_prompt`` does (a user turn, then the assistant's turn opened;
    ``enable_thinking=True``), then tokenizes as asked. Every other attribute is the
    tokenizer's (``pad_token_id``, ``model_max_length``, ``save_pretrained``).

    The template is the folder's Jinja text, rendered by transformers in its sandboxed
    environment (no code of the folder is imported or run)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def chat(self, caption: str) -> str:
        return self.tokenizer.apply_chat_template(
            [{"role": "user", "content": caption}], tokenize=False,
            add_generation_prompt=True, enable_thinking=True)

    def __call__(self, text: str | list[str], **kw: Any) -> Any:
        if isinstance(text, str):
            return self.tokenizer(self.chat(text), **kw)
        return self.tokenizer([self.chat(t) for t in text], **kw)

    def __getattr__(self, name: str) -> Any:
        try:
            tok = self.__dict__["tokenizer"]
        except KeyError:  # unpickling: no attributes yet
            raise AttributeError(name) from None
        return getattr(tok, name)


def caption_tokens(embeds: Tensor) -> list[Tensor]:
    """(N, L, D) packed caption states (the padding's rows zero) -> each caption's own
    tokens (L_i, D), what ZImagePipeline hands the transformer. A caption whose rows are
    all zero (a zeroed condition) keeps its first row. Host sync: the lengths."""
    keep = embeds.ne(0).any(dim=-1)  # (N, L)
    keep[:, 0] |= ~keep.any(dim=1)
    return [e[k] for e, k in zip(embeds, keep)]


class _UpcastZAttention(UpcastJointAttention):
    """UpcastJointAttention with the signature of ``ZSingleStreamAttnProcessor`` (diffusers'
    ``Attention`` hands a processor only the keywords its ``__call__`` names: the rotary
    ``freqs_cis`` must be one)."""

    def __call__(self, attn: nn.Module, hidden_states: Tensor,
                 encoder_hidden_states: Tensor | None = None,
                 attention_mask: Tensor | None = None, freqs_cis: Tensor | None = None):
        return super().__call__(attn, hidden_states, encoder_hidden_states=encoder_hidden_states,
                                attention_mask=attention_mask, freqs_cis=freqs_cis)


class ZImage(TransformerFiles, Family):
    """Z-Image and Z-Image-Turbo."""

    name = "zimage"
    example_config = "configs/zimage_lora.yaml"
    label = "Z-Image"
    title = "Z-Image transformer"
    pipelines = ("ZImagePipeline",)
    parts = {
        "transformer": ("ZImageTransformer2DModel",),
        "vae": ("AutoencoderKL",),
        "text_encoder": ("Qwen3Model",),
        "tokenizer": ("Qwen2Tokenizer", "Qwen2TokenizerFast"),
        "scheduler": SCHEDULER,
    }
    denoiser = "transformer"
    denoiser_word = "transformer"
    denoiser_class = "ZImageTransformer2DModel"
    # Qwen3 is trained in bf16; its activations are not kept inside fp16's range
    text = (TextEncoder("text_encoder", "tokenizer", ("Qwen3Model",), lora=False,
                        kohya="lora_te_", fp16=False),)
    kohya_version = "zimage"
    modelspec = "z-image/lora"
    diffusers_lora_keys = "peft"
    diffusers_lycoris = ("lokr",)  # ZImageLoraLoaderMixin reads peft-named LoKr factors
    kohya_module = "networks.lora_zimage"

    # ------------------------------------------------------------------ the folder

    def check_index(self, root: Path, index: dict[str, Any]) -> None:
        """The tokenizer must carry its chat template (every caption goes through it)."""
        from .base import SDFolderError, read_json

        tok = root / "tokenizer"
        if not tok.is_dir() or (tok / "chat_template.jinja").is_file():
            return  # a missing folder: the shared check names it
        conf = tok / "tokenizer_config.json"
        if not (conf.is_file() and read_json(conf, "the tokenizer's configuration")
                .get("chat_template")):
            raise SDFolderError(f"{tok}/ has no chat template (chat_template.jinja, or "
                                "chat_template in tokenizer_config.json): ZImagePipeline puts "
                                "every caption through it; save the tokenizer with its "
                                "template (Qwen3's) from the Z-Image folder it came with")

    def recipe(self, root: Path) -> dict[str, Setting]:
        trainers = "diffusers' flow-matching LoRA trainers' default"
        return flow_recipe(root, {
            **trainer_defaults(trainers),
            # the dynamic shift (where the config asks) counts 2x2 patches of latents
            "diffusion.flow.token_pixels": Setting(
                2 * vae_down(root), f"{root.name}/vae/config.json: x{vae_down(root)} "
                "downsampling, then the transformer's 2x2 patches"),
            "diffusion.flow.grid_end": Setting("steps", "ZImagePipeline's grid, "
                                               "linspace(1, 1/n, n)"),
            "sample.sampler": Setting("euler", "ZImagePipeline's FlowMatchEulerDiscrete"
                                      "Scheduler", default=True),
            "sample.cfg_scale": Setting(GUIDANCE + 1, f"ZImagePipeline's guidance_scale "
                                        f"{GUIDANCE} (pos + g (pos - neg)); Turbo: 1",
                                        default=True),
        })

    def describe(self, root: Path, model: Any) -> list[str]:
        return super().describe(root, model) + [
            f"Qwen3 {model.max_sequence_length or TOKENS} tokens through the chat template, "
            "penultimate hidden states, each caption's own tokens",
            "timestep 1 - sigma, output negated (x0 - noise)"]

    def load(self, root: Path, denoiser: bool = True) -> Parts:
        parts = super().load(root, denoiser)
        parts.tokenizers = [ChatTokenizer(t) for t in parts.tokenizers]
        return parts

    # ------------------------------------------------------------------ geometry

    def denoiser_multiple(self, conf: dict[str, Any]) -> int:
        return int(max(conf.get("all_patch_size") or (2,)))

    def latent_shape(self, conf: Any, vae_conf: Any) -> tuple[int, int]:
        # rotary positions, no native size: the pipeline draws 1024 px by default
        if vae_conf is None:
            return int(conf.in_channels), 128
        down = 2 ** (len(vae_conf.block_out_channels) - 1)
        return int(conf.in_channels), int(vae_conf.sample_size) // down

    def max_sequence_length(self, conf: Any) -> int | None:
        return TOKENS

    # ------------------------------------------------------------------ text

    def layout(self, tokenizers: list[Any], encoders: list[nn.Module], force_zeros: bool,
               max_sequence_length: int | None = None) -> Layout:
        n = int(max_sequence_length or TOKENS)
        return Layout(text_len=n, width=int(encoders[0].config.hidden_size), ids_len=(n,),
                      pad_ids=(tokenizers[0].pad_token_id,))

    def encode(self, encoders: list[nn.Module], ids: list[Tensor],
               layout: Layout) -> tuple[Tensor, Tensor | None]:
        """As ``ZImagePipeline._encode_prompt``: Qwen3's penultimate hidden state under the
        padding mask (run outside an fp16 autocast), the padding's rows zeroed."""
        mask = ids[0] != layout.pad_ids[0]
        with encoder_autocast_off(ids[0].device):
            h = encoders[0](input_ids=ids[0], attention_mask=mask,
                            output_hidden_states=True).hidden_states[-2]
        return h.float() * mask[..., None], None

    def identity(self, layout: Layout) -> dict[str, Any]:
        return {"zimage": "qwen3-chat-penultimate-masked/1", "layout": repr(layout)}

    # ------------------------------------------------------------------ the denoiser

    def prepare_attention(self, denoiser: nn.Module) -> None:
        """Each attention layer's processor wrapped so the guard can run that layer in fp32
        (the transformer has no ``set_attn_processor``: set per layer)."""
        for m in denoiser.modules():
            if hasattr(m, "set_processor") and getattr(m, "processor", None) is not None:
                if "upcast_attention" not in vars(m):
                    m.upcast_attention = False
                if not isinstance(m.processor, _UpcastZAttention):
                    m.set_processor(_UpcastZAttention(m.processor))

    def call(self, denoiser: nn.Module, x: Tensor, t: Tensor, y: Tensor, layout: Layout,
             down: int, guidance: float | None = None) -> Tensor:
        embeds = layout.unpack(y)[0]
        out = denoiser(list(x.unsqueeze(2).unbind(0)), 1 - t / 1000, caption_tokens(embeds),
                       return_dict=False)[0]
        return -torch.stack(out).squeeze(2)

    # ------------------------------------------------------------------ files

    @staticmethod
    def original_table(config: Any) -> list[Any]:  # the function is defined below the class
        return original_table(config)

    def single_file_keys(self) -> tuple[str, ...]:
        return ("cap_embedder.", "model.diffusion_model.cap_embedder.")

    # ------------------------------------------------------------------ the tiny folder

    def tiny(self, path: Path, *, image_size: int = 32, seed: int = 0, **kw: Any) -> Path:
        """A tiny Z-Image-layout folder: a ZImageTransformer2DModel of two main layers and
        one noise and one context refiner (32 wide, 2x2 patches over 4 latent channels), a
        2-layer Qwen3 (32 wide) with a byte-level Qwen2 tokenizer (a tokenizer.json built
        with ``tokenizers``, a Qwen-style chat template), FLUX.1's VAE factors, the
        released folders' scheduler (static shift 3.0)."""
        from diffusers import (FlowMatchEulerDiscreteScheduler, ZImagePipeline,
                               ZImageTransformer2DModel)

        from ..sd.tiny_parts import tiny_qwen2_tokenizer, tiny_qwen3, tiny_vae

        path = Path(path)
        tok = tiny_qwen2_tokenizer(TOKENS)
        torch.manual_seed(seed)
        transformer = ZImageTransformer2DModel(
            all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=32, n_layers=2,
            n_refiner_layers=1, n_heads=2, n_kv_heads=2, cap_feat_dim=32,
            axes_dims=[4, 6, 6], axes_lens=[1024, 64, 64])
        sched = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0,
                                                use_dynamic_shifting=False)
        pipe = ZImagePipeline(
            transformer=transformer, scheduler=sched,
            vae=tiny_vae(sample_size=image_size, seed=seed, scaling_factor=0.3611,
                         shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False),
            text_encoder=tiny_qwen3(32, vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                                    seed=seed + 1),
            tokenizer=tok)
        pipe.save_pretrained(path, safe_serialization=True)
        return path


# (diffusers name, Tongyi-MAI name): diffusers' from_single_file applies them the other way
_RENAMES = (("all_final_layer.2-1.", "final_layer."), ("all_x_embedder.2-1.", "x_embedder."),
            (".attention.to_out.0.", ".attention.out."),
            (".attention.norm_q.", ".attention.q_norm."),
            (".attention.norm_k.", ".attention.k_norm."))


def original_table(config: Any) -> list[Any]:
    """The Z-Image transformer's diffusers tensors in Tongyi-MAI's layout: each attention's
    ``to_q``/``to_k``/``to_v`` one fused ``qkv``, ``to_out.0`` ``out``, ``norm_q``/``norm_k``
    ``q_norm``/``k_norm``, the patch embedder and final layer without diffusers' ``2-1``
    (patch 2, frame patch 1) level; every other tensor under its own name. The released
    files also hold ``norm_final.weight``, which the diffusers model has no place for
    (diffusers' converter drops it): read past, not written. Built from the config on the
    meta device (the model's own key list)."""
    from diffusers import ZImageTransformer2DModel

    from ..sd.original import Entry

    with torch.device("meta"):
        keys = list(ZImageTransformer2DModel.from_config(dict(config)).state_dict())
    table: list[Any] = [Entry("norm_final.weight", (), "skip")]
    fused = sorted({k.rsplit(".to_q.", 1)[0] for k in keys if ".attention.to_q." in k})
    for a in fused:
        table.append(Entry(f"{a}.qkv", (f"{a}.to_q", f"{a}.to_k", f"{a}.to_v")))
    done = {f"{a}.{p}.{w}" for a in fused for p in ("to_q", "to_k", "to_v")
            for w in ("weight", "bias")}
    for k in keys:
        if k in done:
            continue
        name = k
        for ours, theirs in _RENAMES:
            name = name.replace(ours, theirs)
        table.append(Entry(name, (k,), "param"))
    return table
