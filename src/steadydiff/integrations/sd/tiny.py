"""A tiny Stable Diffusion model folder, built from configs (no download, random weights).

:func:`make_tiny_sd` writes a folder laid out exactly like a real diffusers Stable Diffusion
model (``model_index.json``, ``unet/``, ``vae/``, ``text_encoder/``, ``tokenizer/``,
``scheduler/``) with small blocks, through the components' own ``save_pretrained``. The
tests, the benchmarks and the examples drive the real loading code on it; a user can use it
to check an installation offline (``python -m steadydiff.integrations.sd.tiny OUT``).

The tokenizer is a CLIP BPE tokenizer without merges over a byte-level vocabulary (every
byte, and every byte ending a word): any text tokenizes, one token per character.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Literal

import torch

__all__ = ["make_tiny_sd", "tiny_tokenizer", "tiny_text_encoder", "tiny_vae", "tiny_unet"]


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


def tiny_tokenizer(max_length: int = 77):
    """A CLIPTokenizer with a byte-level vocabulary (515 ids) and no merges."""
    from transformers import CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for c in _byte_chars():
        vocab.setdefault(c, len(vocab))
    for c in _byte_chars():
        vocab.setdefault(c + "</w>", len(vocab))
    tok = CLIPTokenizer(vocab=vocab, merges=[], model_max_length=max_length)
    return tok


def tiny_text_encoder(hidden: int = 32, layers: int = 2, vocab_size: int = 514,
                      max_length: int = 77, seed: int = 0):
    """A 2-layer CLIPTextModel of width ``hidden`` (random weights from ``seed``)."""
    from transformers import CLIPTextConfig, CLIPTextModel

    cfg = CLIPTextConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=max(1, hidden // 16),
                         max_position_embeddings=max_length, bos_token_id=0, eos_token_id=1,
                         pad_token_id=1, projection_dim=hidden)
    torch.manual_seed(seed)
    return CLIPTextModel(cfg).eval()


def tiny_vae(channels: int = 3, latent_channels: int = 4, widths: tuple[int, ...] = (16, 32),
             sample_size: int = 32, seed: int = 0):
    """An AutoencoderKL with ``len(widths)`` levels (downsampling 2**(len-1))."""
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    n = len(widths)
    return AutoencoderKL(in_channels=channels, out_channels=channels,
                         down_block_types=("DownEncoderBlock2D",) * n,
                         up_block_types=("UpDecoderBlock2D",) * n, block_out_channels=widths,
                         latent_channels=latent_channels, norm_num_groups=8, layers_per_block=1,
                         sample_size=sample_size).eval()


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
                 image_size: int = 32, seed: int = 0, hidden: int = 32) -> Path:
    """Write a tiny SD 1.x/2.x-layout model folder at ``path`` and return it.

    Args:
        prediction: the scheduler's ``prediction_type`` (SD 1.x and 2.x-base: epsilon;
            SD 2.x 768: v_prediction).
        image_size: the images' side; the latents are image_size / 2.
        seed: weights' seed. hidden: the text encoder's width (= cross_attention_dim).
    """
    from diffusers import PNDMScheduler, StableDiffusionPipeline

    path = Path(path)
    # SD 1.x/2.x ship a PNDM scheduler config with these values
    sched = PNDMScheduler(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012,
                          beta_schedule="scaled_linear", prediction_type=prediction,
                          set_alpha_to_one=False, skip_prk_steps=True, steps_offset=1)
    pipe = StableDiffusionPipeline(
        unet=tiny_unet(hidden, image_size // 2, seed=seed),
        vae=tiny_vae(sample_size=image_size, seed=seed),
        text_encoder=tiny_text_encoder(hidden, seed=seed), tokenizer=tiny_tokenizer(),
        scheduler=sched, safety_checker=None, feature_extractor=None,
        requires_safety_checker=False)
    pipe.save_pretrained(path, safe_serialization=True)
    return path


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="write a tiny Stable Diffusion model folder "
                                "(random weights, for offline checks)")
    p.add_argument("out", help="the folder to create")
    p.add_argument("--prediction", choices=("epsilon", "v_prediction"), default="epsilon")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if Path(a.out).exists() and any(Path(a.out).iterdir()):
        p.error(f"{a.out} exists and is not empty; give a new folder")
    print(make_tiny_sd(a.out, prediction=a.prediction, image_size=a.image_size, seed=a.seed))


if __name__ == "__main__":
    main()
