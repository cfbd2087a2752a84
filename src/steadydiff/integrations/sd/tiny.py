"""Tiny model folders, built from configs (no download, random weights).

:func:`make_tiny` writes a folder laid out exactly like a real diffusers model of a family
(``model_index.json`` and each part's folder, through the components' own
``save_pretrained``) with small blocks: each family's ``Family.tiny`` says what its folder
holds (SD 1.x/2.x: ``unet/``, ``vae/``, ``text_encoder/``, ``tokenizer/``, ``scheduler/``;
SDXL adds ``text_encoder_2/`` a ``CLIPTextModelWithProjection`` and ``tokenizer_2/``, a
``text_time`` UNet, a ``force_upcast`` VAE, an Euler scheduler; ...). The tests, the
benchmarks and the examples drive the real loading code on them; a user can use them to
check an installation offline (``python -m steadydiff.integrations.sd.tiny OUT
[--family NAME]``).

The components they are built from (a byte-level CLIP tokenizer, small CLIP text encoders,
an AutoencoderKL, a UNet) are in tiny_parts.py and re-exported here.
"""

from __future__ import annotations

import argparse
import inspect
from pathlib import Path
from typing import Any, Literal

from .. import families
from .tiny_parts import tiny_text_encoder, tiny_tokenizer, tiny_unet, tiny_vae

__all__ = ["make_tiny", "make_tiny_sd", "make_tiny_sdxl", "captioned_digits", "tiny_tokenizer",
           "tiny_text_encoder", "tiny_vae", "tiny_unet", "main"]


def make_tiny(path: str | Path, family: str = "sd", *, image_size: int = 32, seed: int = 0,
              **kw: Any) -> Path:
    """Write a tiny folder of ``family``'s layout at ``path`` and return it.

    Args:
        family: a family's name (``families.names()``).
        image_size: the images' side; the latents are image_size / 2.
        seed: weights' seed.
        kw: the family's own options (its ``tiny``'s arguments).
    """
    return families.get(family).tiny(Path(path), image_size=image_size, seed=seed, **kw)


def make_tiny_sd(path: str | Path, *,
                 prediction: Literal["epsilon", "v_prediction"] = "epsilon",
                 image_size: int = 32, seed: int = 0, hidden: int = 32,
                 vae_widths: tuple[int, ...] = (16, 32)) -> Path:
    """A tiny SD 1.x/2.x-layout folder (:func:`make_tiny` with family ``sd``):
    ``prediction`` the scheduler's (SD 2.x 768: v_prediction), ``hidden`` the text
    encoder's width (= the UNet's cross_attention_dim), ``vae_widths`` the VAE's levels
    (four: SD's 8x downsampling)."""
    return make_tiny(path, "sd", image_size=image_size, seed=seed, hidden=hidden,
                     prediction=prediction, vae_widths=vae_widths)


def make_tiny_sdxl(path: str | Path, *, image_size: int = 32, seed: int = 0,
                   hidden: tuple[int, int] = (16, 32), pooled_dim: int = 24,
                   force_zeros_for_empty_prompt: bool = True) -> Path:
    """A tiny SDXL-base-layout folder (:func:`make_tiny` with family ``sdxl``): the two
    text encoders' widths ``hidden`` (the UNet's context is their sum), the second's
    projection ``pooled_dim``, the pipeline's ``force_zeros_for_empty_prompt``."""
    return make_tiny(path, "sdxl", image_size=image_size, seed=seed, hidden=hidden,
                     pooled_dim=pooled_dim,
                     force_zeros_for_empty_prompt=force_zeros_for_empty_prompt)


def captioned_digits(folder: str | Path, *, n: int = 40, image_size: int = 32) -> Path:
    """A folder of ``n`` captioned RGB images to train the kit on offline: scikit-learn's
    bundled 8x8 digits, enlarged to ``image_size`` and tinted per class, each with a
    kohya-style ``.txt`` caption ("a drawing of the digit 3, blue"). Refuses a folder that
    already holds files."""
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits

    out = Path(folder)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} exists and is not empty; give a new folder for the images")
    out.mkdir(parents=True, exist_ok=True)
    d = load_digits()
    colors = [("red", (255, 64, 64)), ("green", (64, 200, 64)), ("blue", (64, 96, 255))]
    for i in range(n):
        label = int(d.target[i])
        name, rgb = colors[label % len(colors)]
        gray = (d.images[i] / 16.0)[..., None]  # (8, 8, 1) in [0, 1]
        img = (gray * np.array(rgb, dtype=np.float64)).astype(np.uint8)
        Image.fromarray(img).resize((image_size, image_size), Image.NEAREST).save(
            out / f"digit_{i:03d}.png")
        (out / f"digit_{i:03d}.txt").write_text(f"a drawing of the digit {label}, {name}\n")
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="write a tiny model folder of a family's layout "
                                "(random weights, for offline checks)")
    p.add_argument("out", help="the folder to create")
    p.add_argument("--family", choices=families.names(), default="sd",
                   help="the model family whose layout to write (default: sd, Stable "
                   "Diffusion 1.x/2.x)")
    p.add_argument("--prediction", choices=("epsilon", "v_prediction"), default=None,
                   help="sd only: the scheduler's prediction type (default epsilon)")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--images", default=None, metavar="DIR",
                   help="also write 40 captioned images (the bundled digits, tinted, with a "
                        ".txt caption each) to this new folder, to train on")
    a = p.parse_args(argv)
    if a.images and Path(a.images).exists() and any(Path(a.images).iterdir()):
        p.error(f"--images {a.images} exists and is not empty; give a new folder")
    if Path(a.out).exists() and any(Path(a.out).iterdir()):
        p.error(f"{a.out} exists and is not empty; give a new folder")
    kw = {}
    if a.prediction is not None:
        if "prediction" not in inspect.signature(families.get(a.family).tiny).parameters:
            p.error(f"--prediction: the {a.family} family's scheduler has one prediction "
                    "type; leave it out")
        kw["prediction"] = a.prediction
    import diffusers.utils.logging as diffusers_log
    import transformers.utils.logging as transformers_log

    # their notes and bars say nothing here; the settings are given back afterwards (main
    # may be called in a process that goes on: a test, a script)
    before = [(lib, lib.get_verbosity(), lib.is_progress_bar_enabled())
              for lib in (diffusers_log, transformers_log)]
    for lib, _, _ in before:
        lib.set_verbosity_error()
        lib.disable_progress_bar()
    try:
        out = make_tiny(a.out, a.family, image_size=a.image_size, seed=a.seed, **kw)
    finally:
        for lib, level, bars in before:
            lib.set_verbosity(level)
            if bars:
                lib.enable_progress_bar()
    print(f"wrote a tiny {a.family} model folder (random weights, {a.image_size} px) to {out}")
    data = "YOUR_IMAGES"
    if a.images:
        data = captioned_digits(a.images, image_size=a.image_size)
        print(f"wrote 40 captioned images to {data}")
    print(f"  train a LoRA on it: steadydiff train {families.get(a.family).example_config}"
          f" --set model.pretrained={out} --set data.path={data}"
          f" --set data.image_size={a.image_size}")


if __name__ == "__main__":
    main()
