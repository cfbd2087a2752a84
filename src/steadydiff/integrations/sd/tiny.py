"""A tiny Stable Diffusion model folder, built from configs (no download, random weights).

:func:`make_tiny_sd` writes a folder laid out exactly like a real diffusers Stable Diffusion
model (``model_index.json``, ``unet/``, ``vae/``, ``text_encoder/``, ``tokenizer/``,
``scheduler/``) with small blocks, through the components' own ``save_pretrained``;
:func:`make_tiny_sdxl` one laid out like the SDXL base (``text_encoder_2/`` a
``CLIPTextModelWithProjection``, ``tokenizer_2/`` padding with "!", a ``text_time`` UNet, a
``force_upcast`` VAE, an Euler scheduler). The tests, the benchmarks and the examples drive
the real loading code on them; a user can use them to check an installation offline
(``python -m steadydiff.integrations.sd.tiny OUT [--sdxl]``).

The tokenizer is a CLIP BPE tokenizer without merges over a byte-level vocabulary (every
byte, and every byte ending a word): any text tokenizes, one token per character.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Literal

import torch

__all__ = ["make_tiny_sd", "make_tiny_sdxl", "tiny_tokenizer", "tiny_text_encoder", "tiny_vae", "tiny_unet"]


def _byte_chars() -> list[str]:
    """GPT-2/CLIP's reversible byte -> unicode table (printable bytes map to themselves)."""
    keep = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
            + list(range(ord("®"), ord("ÿ") + 1)))
    out, n = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    return [out[b] for b in range(256)]


def tiny_tokenizer(max_length: int = 77, pad_token: str = "<|endoftext|>"):
    """A CLIPTokenizer with a byte-level vocabulary (515 ids) and no merges; SDXL's second
    tokenizer pads with ``pad_token="!"``."""
    from transformers import CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for c in _byte_chars():
        vocab.setdefault(c, len(vocab))
    for c in _byte_chars():
        vocab.setdefault(c + "</w>", len(vocab))
    tok = CLIPTokenizer(vocab=vocab, merges=[], model_max_length=max_length,
                        pad_token=pad_token)
    return tok


def tiny_text_encoder(hidden: int = 32, layers: int = 2, vocab_size: int = 514,
                      max_length: int = 77, seed: int = 0, projection: int | None = None):
    """A 2-layer CLIPTextModel of width ``hidden`` (random weights from ``seed``); with
    ``projection``, a CLIPTextModelWithProjection whose pooled output is that wide (SDXL's
    second text encoder)."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    cfg = CLIPTextConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=max(1, hidden // 16),
                         max_position_embeddings=max_length, bos_token_id=0, eos_token_id=1,
                         pad_token_id=1, projection_dim=projection or hidden)
    torch.manual_seed(seed)
    return (CLIPTextModelWithProjection(cfg) if projection else CLIPTextModel(cfg)).eval()


def tiny_vae(channels: int = 3, latent_channels: int = 4, widths: tuple[int, ...] = (16, 32),
             sample_size: int = 32, seed: int = 0, **config):
    """An AutoencoderKL with ``len(widths)`` levels (downsampling 2**(len-1)); ``config``:
    more of its config (SDXL's ``scaling_factor``, ``force_upcast``)."""
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    n = len(widths)
    return AutoencoderKL(in_channels=channels, out_channels=channels,
                         down_block_types=("DownEncoderBlock2D",) * n,
                         up_block_types=("UpDecoderBlock2D",) * n, block_out_channels=widths,
                         latent_channels=latent_channels, norm_num_groups=8, layers_per_block=1,
                         sample_size=sample_size, **config).eval()


def tiny_unet(cross_attention_dim: int = 32, sample_size: int = 16, in_channels: int = 4,
              widths: tuple[int, int] = (32, 64), seed: int = 0):
    """A 2-level UNet2DConditionModel with cross-attention at the first level."""
    from diffusers import UNet2DConditionModel

    torch.manual_seed(seed)
    return UNet2DConditionModel(
        sample_size=sample_size, in_channels=in_channels, out_channels=in_channels,
        layers_per_block=1, block_out_channels=widths,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=cross_attention_dim, attention_head_dim=8, norm_num_groups=8)


def make_tiny_sd(path: str | Path, *, prediction: Literal["epsilon", "v_prediction"] = "epsilon",
                 image_size: int = 32, seed: int = 0, hidden: int = 32,
                 vae_widths: tuple[int, ...] = (16, 32)) -> Path:
    """Write a tiny SD 1.x/2.x-layout model folder at ``path`` and return it.

    Args:
        prediction: the scheduler's ``prediction_type`` (SD 1.x and 2.x-base: epsilon;
            SD 2.x 768: v_prediction).
        image_size: the images' side; the latents are image_size / 2 (with ``vae_widths``
            of k levels, image_size / 2**(k-1): four give SD's 8x).
        seed: weights' seed. hidden: the text encoder's width (= cross_attention_dim).
    """
    from diffusers import PNDMScheduler, StableDiffusionPipeline

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


def make_tiny_sdxl(path: str | Path, *, image_size: int = 32, seed: int = 0,
                   hidden: tuple[int, int] = (16, 32), pooled_dim: int = 24,
                   force_zeros_for_empty_prompt: bool = True) -> Path:
    """Write a tiny SDXL-base-layout folder at ``path`` and return it.

    Args:
        image_size: the images' side; the latents are image_size / 2.
        seed: weights' seed.
        hidden: the two text encoders' widths; the UNet's context is their sum (SDXL:
            768 + 1280 = 2048).
        pooled_dim: the second encoder's projection width (SDXL: 1280).
        force_zeros_for_empty_prompt: the pipeline's null condition (SDXL base: True).
    """
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline

    path = Path(path)
    # the SDXL base's scheduler_config.json
    sched = EulerDiscreteScheduler(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012,
                                   beta_schedule="scaled_linear", prediction_type="epsilon",
                                   steps_offset=1, timestep_spacing="leading",
                                   interpolation_type="linear", use_karras_sigmas=False)
    pipe = StableDiffusionXLPipeline(
        vae=tiny_vae(sample_size=image_size, seed=seed, scaling_factor=0.13025,
                     force_upcast=True),
        text_encoder=tiny_text_encoder(hidden[0], seed=seed),
        text_encoder_2=tiny_text_encoder(hidden[1], seed=seed + 1, projection=pooled_dim),
        tokenizer=tiny_tokenizer(), tokenizer_2=tiny_tokenizer(pad_token="!"),
        unet=tiny_sdxl_unet(sum(hidden), pooled_dim, sample_size=image_size // 2, seed=seed),
        scheduler=sched, force_zeros_for_empty_prompt=force_zeros_for_empty_prompt,
        add_watermarker=False)
    pipe.save_pretrained(path, safe_serialization=True)
    return path


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="write a tiny Stable Diffusion model folder "
                                "(random weights, for offline checks)")
    p.add_argument("out", help="the folder to create")
    p.add_argument("--prediction", choices=("epsilon", "v_prediction"), default="epsilon")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sdxl", action="store_true", help="an SDXL-base-layout folder "
                   "(two text encoders, size/crop conditioning; --prediction is epsilon)")
    a = p.parse_args(argv)
    if Path(a.out).exists() and any(Path(a.out).iterdir()):
        p.error(f"{a.out} exists and is not empty; give a new folder")
    if a.sdxl:
        if a.prediction != "epsilon":
            p.error("--sdxl: the SDXL base predicts epsilon; leave --prediction out")
        print(make_tiny_sdxl(a.out, image_size=a.image_size, seed=a.seed))
        return
    print(make_tiny_sd(a.out, prediction=a.prediction, image_size=a.image_size, seed=a.seed))


if __name__ == "__main__":
    main()
