"""A local diffusers model folder: its layout checked, its parts loaded.

A diffusers-format folder (what a pipeline's ``save_pretrained`` writes and the Hugging Face
hub holds) has a ``model_index.json`` naming the pipeline (``_class_name``) and its parts,
each in its own subfolder with its config and safetensors weights: for Stable Diffusion
1.x/2.x::

    model_index.json        {"_class_name": "StableDiffusionPipeline", "unet": [...], ...}
    unet/                   config.json + diffusion_pytorch_model.safetensors
    vae/                    config.json + diffusion_pytorch_model.safetensors
    text_encoder/           config.json + model.safetensors
    tokenizer/              vocab.json + merges.txt, or tokenizer.json
    scheduler/              scheduler_config.json

The pipeline names the model family (``integrations/families/``), and the family's table
says which parts the folder must have and which classes may fill them; this module checks
them the same way for every family. Every part loads with ``local_files_only=True``
(nothing is downloaded) and from safetensors only (``use_safetensors=True``: a pickled
``.bin`` is never unpickled). What is missing or wrong is an :class:`SDFolderError` that
names the file and says what would be valid. A single-file checkpoint (``model.pretrained``
a ``.safetensors`` file) takes its configs from ``model.single_file_config``, a folder of
this layout whose weights may be absent (``source.model_root``; the weights come from the
file, single_file.py). The scheduler's config decides the training recipe
(:func:`diffusion_settings`, the family's ``recipe``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from ..families import Family, Parts, SDFolderError, expected, of_index, read_json
from ..families.base import check_index_libraries, load_part

__all__ = ["SDFolderError", "check_folder", "read_json", "diffusion_settings", "family_of",
           "load_folder_parts", "load_text_parts", "load_vae", "part_reader"]


def family_of(path: str | Path) -> Family:
    """The family of the diffusers folder ``path`` (its model_index.json's ``_class_name``).

    Raises:
        SDFolderError: no or a broken model_index.json, or a pipeline no family has.
    """
    root = Path(path).expanduser()
    index = read_json(root / "model_index.json", "every diffusers pipeline folder has one "
                      "(written by save_pretrained); is this the right folder?")
    return of_index(index, root)


def check_folder(path: str | Path, parts: tuple[str, ...] | None = None, *,
                 weights: bool | tuple[str, ...] = True) -> Path:
    """Check that ``path`` is a diffusers folder of a model family with ``parts`` (None:
    every part of its family's table) and their safetensors weights unless ``weights`` is
    false (a single file's config); a tuple: the parts that may lack weights (those a
    single file of the family holds).

    Raises:
        SDFolderError: the path is missing, a file (a single-file checkpoint goes through
            ``source.model_root``), has no or a broken ``model_index.json``, names no
            family's pipeline or one the family refuses (an SDXL refiner), or lacks a part
            (its folder, config or safetensors weights).
    """
    root = Path(path).expanduser()
    if not root.exists() and is_hub_id(str(path)):
        raise SDFolderError(hub_id_message(str(path)))
    if not root.exists():
        raise SDFolderError(f"model.pretrained: {root} does not exist; expected a diffusers "
                            "model folder (model_index.json and its parts' folders, e.g. "
                            "unet/ or transformer/, vae/, text_encoder/, tokenizer/, "
                            "scheduler/)")
    if root.is_file():
        raise SDFolderError(f"model.pretrained: {root} is a file; expected a diffusers "
                            f"model folder of one of {expected()}")
    index = read_json(root / "model_index.json", "every diffusers pipeline folder has one "
                      "(written by save_pretrained); is this the right folder?")
    check_index_libraries(root, index)  # before anything imports what it names
    family = of_index(index, root)
    family.check_index(root, index)
    cls = index.get("_class_name")
    table = family.parts
    parts = tuple(table) if parts is None else parts
    for part in parts:
        entry = index.get(part)
        allowed = table[part]
        if not (isinstance(entry, list) and len(entry) == 2 and entry[1] in allowed):
            raise SDFolderError(f"{root}/model_index.json: {part!r} is {entry!r}; expected "
                                f"[library, class] with class {' or '.join(allowed)}")
        sub = root / part
        if not sub.is_dir():
            raise SDFolderError(f"{sub}/ is missing: a {cls} folder needs "
                                f"{', '.join(p + '/' for p in parts)}")
        if part.startswith("tokenizer"):
            _check_tokenizer(sub)
            continue
        config = "scheduler_config.json" if part == "scheduler" else "config.json"
        conf = read_json(sub / config, f"the {part}'s configuration")
        family.check_config(root, part, conf)
        if part == "scheduler" or weights is False or \
                (isinstance(weights, tuple) and part in weights):
            continue
        found = list(sub.glob("*.safetensors")) + list(sub.glob("*.safetensors.index.json"))
        for idx in sub.glob("*.safetensors.index.json"):
            _check_shards(idx)
        if not found:
            pickled = [p.name for p in sub.glob("*.bin")]
            hint = (f" (it has {', '.join(pickled)}: pickled weights, which steadydiff never "
                    "unpickles; re-save the model with save_pretrained(..., "
                    "safe_serialization=True))" if pickled else "")
            also = (f" (a {family.label} single file holds only "
                    f"{', '.join(family.single_file_parts or ())}: model.single_file_config "
                    "must hold the other parts' weights)" if isinstance(weights, tuple) else "")
            raise SDFolderError(f"{sub}/ has no .safetensors weights{hint}{also}")
    return root


def _check_shards(idx: Path) -> None:
    """A sharded part's index names safetensors shards of its own folder only: one
    pointing at a pickled ``.bin`` (or outside the folder) would be unpickled, or read
    from elsewhere, by the loader."""
    weight_map = read_json(idx, "the sharded weights' index").get("weight_map")
    if not isinstance(weight_map, dict):
        raise SDFolderError(f"{idx}: no weight_map object (expected tensor name -> shard file)")
    for shard in sorted(set(map(str, weight_map.values()))):
        if not shard.endswith(".safetensors") or Path(shard).name != shard:
            raise SDFolderError(
                f"{idx}: a shard is {shard!r}; shards must be .safetensors files in "
                f"{idx.parent}/ (pickled weights are never unpickled; re-save the model with "
                "save_pretrained(..., safe_serialization=True))")
        if not (idx.parent / shard).is_file():
            raise SDFolderError(f"{idx}: the shard {shard} is missing from {idx.parent}/")


# a Hugging Face hub repository id: owner/name, each of letters, digits, '-', '_', '.'
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}")


def is_hub_id(path: str) -> bool:
    """Whether ``path`` (a ``model.pretrained`` that is not on disk) reads as a hub
    repository id (``stable-diffusion-v1-5/stable-diffusion-v1-5``) rather than a path."""
    return bool(_HUB_ID.fullmatch(path)) and not path.endswith((".safetensors", ".ckpt"))


def hub_download_command(repo_id: str, local_dir: str, *, include: tuple[str, ...] = (),
                         exclude: tuple[str, ...] = ()) -> str:
    """The command that downloads hub repository ``repo_id`` (the files ``include``
    matches, less those ``exclude`` matches; globs) to ``local_dir`` with the installed
    huggingface_hub's CLI: ``hf download`` from 1.0 on (a pattern per ``--include``),
    before it ``huggingface-cli download`` (several patterns after one ``--include``)."""
    try:
        from huggingface_hub import __version__ as v
        new = int(v.split(".")[0]) >= 1
    except (ImportError, ValueError):
        new = True
    cmd = [("hf" if new else "huggingface-cli"), "download", repo_id, "--local-dir", local_dir]
    for flag, pats in (("--include", include), ("--exclude", exclude)):
        if pats and new:
            cmd += [f'{flag} "{p}"' for p in pats]
        elif pats:
            cmd += [flag, *(f'"{p}"' for p in pats)]
    return " ".join(cmd)


def hub_id_message(repo_id: str) -> str:
    """What to do with a hub id given as ``model.pretrained``: steadydiff never downloads;
    the exact command that makes a local copy (its pickled weights left out: never read),
    and the single-file alternative (a file plus a folder of the configs alone)."""
    name = repo_id.split("/")[1]
    folder = hub_download_command(repo_id, f"models/{name}",
                                  exclude=("*.bin", "*.ckpt", "*.pt", "*.pth"))
    configs = hub_download_command(repo_id, f"models/{name}-configs",
                                   include=("*.json", "*.txt"))
    return (f"model.pretrained: {repo_id!r} is not a local path; it reads as a Hugging Face "
            "hub id, and steadydiff never downloads (a run reads only local files). Make a "
            f"local copy once:\n  {folder}\nthen set model.pretrained: models/{name}. Or "
            "use a single-file checkpoint you already have (the .safetensors A1111 and "
            "ComfyUI load, e.g. v1-5-pruned-emaonly.safetensors): model.pretrained: "
            "FILE.safetensors with model.single_file_config: a local folder of the same "
            f"model's configs (a few MB):\n  {configs}\n(docs/sd.md#hub-ids)")


def _check_tokenizer(sub: Path) -> None:
    """A tokenizer folder transformers loads offline without sentencepiece: a
    ``tokenizer.json`` (fast tokenizers: CLIP, T5), or CLIP's ``vocab.json`` +
    ``merges.txt``."""
    if (sub / "tokenizer.json").is_file() or \
            ((sub / "vocab.json").is_file() and (sub / "merges.txt").is_file()):
        return
    spiece = (" (it has spiece.model only: that needs the sentencepiece package, which "
              "steadydiff does not install; save the tokenizer once where it loads, with "
              "save_pretrained, to get its tokenizer.json)"
              if (sub / "spiece.model").is_file() else "")
    raise SDFolderError(f"{sub}/ has neither tokenizer.json nor vocab.json + merges.txt"
                        f"{spiece}")


def diffusion_settings(root: str | Path) -> dict[str, Any]:
    """The config values the folder's family recipe sets (SD 1.x/2.x, SDXL: the DDPM betas
    and prediction type of its scheduler config; the flow families: the objective and the
    shift), without where each comes from (``Family.recipe``).

    Raises:
        SDFolderError: a schedule or prediction the family's recipe does not train.
    """
    return {k: s.value for k, s in family_of(root).recipe(Path(root)).items()}


def load_vae(path: str | Path):
    """An AutoencoderKL from ``path``: its own folder (config.json) or a model folder's
    ``vae/``."""
    from diffusers import AutoencoderKL

    p = Path(path).expanduser()
    sub = p / "vae" if (p / "vae" / "config.json").is_file() else p
    if not (sub / "config.json").is_file():
        raise SDFolderError(f"model.vae: {p} has neither config.json nor vae/config.json; "
                            "expected a diffusers AutoencoderKL folder (save_pretrained)")
    return load_part("VAE", AutoencoderKL.from_pretrained, sub, use_safetensors=True).eval()


def load_text_parts(path: str | Path):
    """(tokenizer, text encoder) from a folder with ``tokenizer/`` and ``text_encoder/`` (a
    CLIP text model: steadydiff's own text-conditioned models)."""
    from transformers import AutoTokenizer, CLIPTextModel

    p = Path(path).expanduser()
    for part in ("tokenizer", "text_encoder"):
        if not (p / part).is_dir():
            raise SDFolderError(f"model.text_encoder: {p}/{part}/ is missing; expected a "
                                "folder with text_encoder/ (a transformers CLIPTextModel) and "
                                "tokenizer/ (an SD folder works)")
    tok = load_part("tokenizer", AutoTokenizer.from_pretrained, p / "tokenizer")
    te = load_part("text encoder", CLIPTextModel.from_pretrained, p / "text_encoder",
                   use_safetensors=True).eval()
    return tok, te


def load_folder_parts(path: str | Path, denoiser: bool = True) -> Parts:
    """Every part of the diffusers folder at ``path`` (checked first), fp32 on the CPU;
    the caller moves them and sets their dtypes. ``denoiser`` false: all but the denoiser
    (``Parts.denoiser`` None; FSDP's meta-device init reads it shard by shard)."""
    root = check_folder(path)
    return family_of(root).load(root, denoiser=denoiser)


def part_reader(sub: Path, shapes: dict[str, tuple[int, ...]]):
    """``read(name, start, stop) -> rows [start, stop) of dim 0`` (None, None: the whole
    tensor), fp32, of a part folder's safetensors weights (one file, or the shards an
    ``*.safetensors.index.json`` lists), reading only those rows' bytes from the file (the
    FSDP meta-device init's source: :func:`steadydiff.sharding.materialize`). Checked first
    against ``shapes`` (name -> the model's shape).

    Raises:
        SDFolderError: no weights, a tensor the model has that the files lack, or of
            another shape (named).
    """
    from safetensors import safe_open

    index = sorted(sub.glob("*.safetensors.index.json"))
    if index:
        where = {k: sub / f for k, f in read_json(index[0], "the weights' index")
                 .get("weight_map", {}).items()}
    else:
        files = sorted(sub.glob("*.safetensors"))
        if not files:
            raise SDFolderError(f"{sub}/ has no .safetensors weights")
        where = {}
        for f in files:
            with safe_open(str(f), "pt") as h:
                where.update({k: f for k in h.keys()})
    for name, shape in shapes.items():
        if name not in where:
            raise SDFolderError(f"{sub}: the weights have no {name} (the config describes "
                                "another model?)")
        with safe_open(str(where[name]), "pt") as h:
            have = tuple(h.get_slice(name).get_shape())
        if have != tuple(shape):
            raise SDFolderError(f"{sub}: {name} has shape {have}; the config's model takes "
                                f"{tuple(shape)}")

    def read(name: str, start: int | None, stop: int | None):
        with safe_open(str(where[name]), "pt") as h:
            sl = h.get_slice(name)
            t = sl[:] if start is None else sl[start:stop]
        return t.float()

    return read
