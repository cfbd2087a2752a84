"""DreamBooth's class images (Ruiz et al. 2023, prior preservation): generated from the base
model with ``data.class_prompt`` before training, as diffusers' ``train_dreambooth.py``
does (``--num_class_images``), and cached in ``data.reg_path``.

The folder is counted first: when it holds fewer than ``data.num_class_images`` images, the
missing ones are drawn from the base model (the run's model before any training: its
adapter starts at zero; ``adapter.init_from`` is not applied) with the run's sampler
settings (``sample.sampler``, ``sample.steps``, ``sample.cfg_scale``) at
``data.image_size``, seeded by ``train.seed`` and the image's number, and written as
``class_00000.png`` ... beside whatever is there (nothing is overwritten). A manifest,
``steadydiff_class_images.json``, records the prompt, the base and the settings; a later run
with another class prompt over the same folder is refused instead of training on images of
the old one. The regularization images then train like given ones (data/kohya.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import torch

from ...data import IMAGE_EXTENSIONS, DataError

__all__ = ["MANIFEST", "ensure_class_images"]

MANIFEST = "steadydiff_class_images.json"


def _images(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file()
                  and p.suffix.lower() in IMAGE_EXTENSIONS and not p.name.startswith("."))


def ensure_class_images(cfg: Any, device: torch.device,
                        say: Callable[[str], None] = print) -> list[Path]:
    """Make ``data.reg_path`` hold ``data.num_class_images`` images, generating the missing
    ones from the base model with ``data.class_prompt``. Returns the files written (none
    when the folder already holds enough).

    Raises:
        DataError: the folder's earlier generated images were drawn with another prompt or
            base model (the manifest says which).
    """
    from PIL import Image

    d = cfg.data
    folder = Path(d.reg_path).expanduser()
    want = int(d.num_class_images)
    recipe = {"prompt": d.class_prompt, "base": str(cfg.model.pretrained),
              "sampler": cfg.sample.sampler, "steps": cfg.sample.steps,
              "cfg_scale": cfg.sample.cfg_scale, "image_size": d.image_size,
              "seed": cfg.train.seed}
    manifest = folder / MANIFEST
    old = json.loads(manifest.read_text()) if manifest.is_file() else None
    if old is not None and (old.get("prompt"), old.get("base")) != (recipe["prompt"],
                                                                    recipe["base"]):
        raise DataError(f"{folder}: its generated class images were drawn with prompt "
                        f"{old.get('prompt')!r} from {old.get('base')} ({MANIFEST}); this run's "
                        f"data.class_prompt is {d.class_prompt!r} from {cfg.model.pretrained}: "
                        "use another data.reg_path, or delete the files the manifest lists")
    have = _images(folder) if folder.is_dir() else []
    if len(have) >= want:
        say(f"class images: {len(have)} in {folder} (data.num_class_images={want}): none "
            "generated")
        return []
    missing = want - len(have)
    say(f"class images: {len(have)} in {folder}, generating {missing} from the base model "
        f"with {d.class_prompt!r} ({cfg.sample.sampler}, {cfg.sample.steps} steps, "
        f"guidance {cfg.sample.cfg_scale:g})")
    pipe = _base_pipeline(cfg, device)
    folder.mkdir(parents=True, exist_ok=True)
    taken = {p.name for p in folder.iterdir()}
    written: list[Path] = list(map(Path, (old or {}).get("files", [])))
    new: list[Path] = []
    k = 0
    while len(new) < missing:
        n = min(4, missing - len(new))
        x, _ = pipe.sample(n, prompt=d.class_prompt, seed=cfg.train.seed * 1000003 + k)
        for img in x:  # (C, H, W) in [-1, 1]
            while f"class_{k:05d}.png" in taken:
                k += 1
            path = folder / f"class_{k:05d}.png"
            taken.add(path.name)
            arr = ((img.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
            arr = arr.permute(1, 2, 0).cpu().numpy()
            Image.fromarray(arr[..., 0] if arr.shape[-1] == 1 else arr).save(path)
            new.append(path)
            k += 1
    tmp = manifest.with_name(f".{MANIFEST}.tmp")
    tmp.write_text(json.dumps({**recipe, "files": sorted({p.name for p in written}
                                                          | {p.name for p in new})},
                              indent=1) + "\n")
    tmp.replace(manifest)
    del pipe  # the training model is built next: free this one first
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return new


def _base_pipeline(cfg: Any, device: torch.device):
    """The base model as a sampling pipeline (the adapter at zero: the base exactly)."""
    from ...config import replace
    from ...diffusion import make_schedule
    from ...loading import Pipeline
    from .setup import build

    base = replace(cfg, {"adapter.init_from": None})
    model, _, media = build(base, device)
    model.eval().requires_grad_(False)
    return Pipeline(model, make_schedule(base.diffusion, base.data.image_size), base, device,
                    Path(str(cfg.model.pretrained)), 0, media=media)
