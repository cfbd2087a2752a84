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
(the family's pipeline's ``from_single_file``: ``StableDiffusionPipeline``'s,
``StableDiffusionXLPipeline``'s, ...) with ``config=`` a local diffusers folder
(``model.single_file_config``) and ``local_files_only=True``: the folder supplies every
config (UNet, VAE, text encoder, tokenizer, scheduler; its weights are not needed), so
nothing is looked up on the hub. Without a local config diffusers would infer a hub
repository from the keys and download its configs, and an original ``v1-inference.yaml``
alone still makes it fetch ``openai/clip-vit-large-patch14`` for the tokenizer and text
encoder: both are refused here.

Pickled checkpoints (``.ckpt``, ``.pt``, ``.pth``, ``.bin``) are refused: unpickling runs
whatever code the file carries.

The config folder names the family (its model_index.json); the family says which layout
its files have (``Family.original_state_dict``, through the maps of ldm.py).

Writing (:func:`write_single_file`) maps the diffusers parts back to that layout (the
inverse of the renaming diffusers' loader does; the round trip through that loader is
tested to give back the same tensors), checks every tensor finite and writes the file
atomically.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from ...trainer.checkpoint import CheckpointError
from ..families import Parts, of_module
from .folder import SDFolderError, check_folder, family_of
from .ldm import UNET, VAE, LayoutError, rename, vae_map

__all__ = ["PICKLES", "is_single_file", "check_single_file", "load_single_file",
           "to_original", "write_single_file", "export_single_file", "UNET", "VAE"]

PICKLES = (".ckpt", ".pt", ".pth", ".bin")

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
            no ``model.single_file_config``, a YAML or a config that is not a diffusers
            model folder, or a file without its family's original-layout keys.
    """
    f = Path(path).expanduser()
    suffix = f.suffix.lower()
    if suffix in PICKLES:
        raise SDFolderError("model.pretrained: " + PICKLE_HINT.format(
            f=f, s=suffix, stem=f.with_suffix("")))
    if suffix != ".safetensors":
        raise SDFolderError(f"model.pretrained: {f} is a file but not a .safetensors "
                            "checkpoint; expected a diffusers folder or a single-file "
                            "checkpoint (.safetensors, the original layout)")
    if not config:
        raise SDFolderError(
            f"model.pretrained: {f} is a single-file checkpoint, which holds weights but no "
            "configuration; set model.single_file_config to a local diffusers folder of the "
            "same architecture (model_index.json, the parts' config.json, tokenizer/, "
            "scheduler/; weights not needed), e.g. the stable-diffusion-v1-5 folder for an "
            "SD 1.5 fine-tune. Nothing is downloaded: without it diffusers would fetch the "
            "configs from the hub")
    c = Path(config).expanduser()
    if c.suffix.lower() in (".yaml", ".yml"):
        raise SDFolderError(
            f"model.single_file_config: {c} is an original LDM YAML; it describes the UNet "
            "and VAE but not the tokenizer or text encoder, which diffusers would then "
            "download (openai/clip-vit-large-patch14). Give a local diffusers folder of "
            "the same architecture instead (configs and tokenizer/ are enough)")
    try:
        root = check_folder(c, weights=False)
        family = family_of(root)
        if family.single_file_parts is not None:  # the other parts' weights: the folder's
            check_folder(c, weights=family.single_file_parts)
    except SDFolderError as e:
        raise SDFolderError(f"model.single_file_config: {e}") from None
    keys = _keys(f)
    want = family.single_file_keys()
    if want and not any(k.startswith(want) for k in keys):
        what = ("a diffusers UNet (its diffusion_pytorch_model.safetensors)"
                if any(k.startswith(("down_blocks.", "conv_in.")) for k in keys)
                else "a diffusers transformer (its diffusion_pytorch_model.safetensors)"
                if any(k.startswith("transformer_blocks.") for k in keys)
                else f"not a {family.label} checkpoint")
        raise SDFolderError(f"model.pretrained: {f} has no {' or '.join(w + '*' for w in want)}"
                            f" tensors (the original single-file layout of {family.label}); "
                            f"it looks like {what}")
    return f, root


def _keys(f: Path) -> list[str]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(f), framework="pt") as h:
            return list(h.keys())
    except (SafetensorError, OSError) as e:
        raise SDFolderError(f"model.pretrained: {f} is not a readable safetensors file "
                            f"({e})") from None


def load_single_file(path: str | Path, config: str | Path) -> Parts:
    """The parts of a single-file checkpoint, fp32 on the CPU, through diffusers'
    ``from_single_file`` of the family the local ``config`` folder names, with that
    folder's configs only.

    Raises:
        SDFolderError: see :func:`check_single_file`; or the loader failed (a file of
            another architecture than the config, or it tried to reach the network).
    """
    f, root = check_single_file(path, config)
    return family_of(root).load_single_file(f, root)


# --------------------------------------------------------------------------- writing


def _unet_keys(sd: dict[str, Tensor], config) -> dict[str, Tensor]:
    """diffusers UNet2DConditionModel keys -> the original UNet's (ldm.sgm_path)."""
    from .ldm import sgm_path

    out = {}
    for k, v in sd.items():
        path, _, param = k.rpartition(".")
        try:
            out[f"{UNET}{sgm_path(path, config)}.{param}"] = v
        except LayoutError as e:
            raise CheckpointError(f"the UNet has no original single-file layout: {e}") from None
    return out


_rename, _vae_map = rename, vae_map  # the tests' names for the maps (ldm.py owns them)


def to_original(denoiser: nn.Module, vae: nn.Module | None = None,
                *text_encoders: nn.Module | None, prefix: str | None = None
                ) -> dict[str, Tensor]:
    """The original single-file state dict of diffusers parts (CPU tensors, own dtypes),
    in the layout of the family whose denoiser ``denoiser`` is (a transformer family's:
    the transformer alone, its keys under ``prefix``, None: its makers' own).

    Raises:
        CheckpointError: a part without an original layout (an SD 2.x OpenCLIP text
            encoder converted to transformers, a UNet with per-level layer counts).
    """
    family = of_module(denoiser)
    try:
        return family.original_state_dict(denoiser, vae, list(text_encoders), prefix=prefix)
    except (LayoutError, ValueError, KeyError) as e:
        raise CheckpointError(f"no original single-file layout: {e}") from None


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
    from ...files import atomic_output

    out = Path(out).expanduser()
    with atomic_output(out) as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt", **(metadata or {})})
    return out


def export_single_file(out: str | Path, denoiser: nn.Module, vae: nn.Module | None,
                       text_encoders: list[nn.Module | None] | nn.Module | None = None,
                       base_file: str | Path | None = None,
                       dtype: torch.dtype | None = None) -> Path:
    """A fine-tuned denoiser (and its VAE and text encoders) as one original-layout file.

    With ``base_file`` (the run started from a single file) only the denoiser is
    converted: every other tensor of that file (VAE, text encoders in whatever layout they
    had, SD 2.x OpenCLIP included) is copied unchanged, and the denoiser is written in the
    dtype the base file's had. ``dtype`` (e.g. torch.float16, what most shared files use)
    casts every floating-point tensor."""
    from safetensors import safe_open

    if not isinstance(text_encoders, (list, tuple)):
        text_encoders = [text_encoders]
    if base_file is not None:
        with safe_open(str(base_file), framework="pt") as h:
            keys = list(h.keys())
            # the denoiser's keys in the base file: under its prefix ("": all of them)
            own = of_module(denoiser).single_file_prefix(keys)
            tensors = to_original(denoiser, prefix=own)
            for k in keys:
                if own and not k.startswith(own):
                    tensors[k] = h.get_tensor(k)
                elif dtype is None:  # the denoiser in the dtype the base file had (fp16 often)
                    dtype = h.get_slice(k).get_dtype()
                    dtype = {"F16": torch.float16, "BF16": torch.bfloat16}.get(dtype)
    else:
        tensors = to_original(denoiser, vae, *text_encoders)
    if dtype is not None:
        tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    return write_single_file(out, tensors, {"written_by": "steadydiff"})

