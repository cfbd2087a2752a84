"""What a Stable Diffusion run tells its user once: at start, the defaults that differ from
a kohya sd-scripts recipe and a resolution below the family's native one; at the end, what
to load where (the LoRA files for ComfyUI, A1111 and diffusers, the base, the rank, the
trigger). The console lines come from here so that the CLI and the API say the same."""

from __future__ import annotations

from pathlib import Path

from ...config import Config
from .folder import read_json
from .source import family, model_root

__all__ = ["start_notes", "native_side", "load_hints", "upscale_warning"]

UPSCALE = 4  # a side enlarged this many times or more (16x the pixels) is warned about
_SAMPLED = 512  # image headers read for the check (evenly spread over the dataset)


def native_side(cfg: Config) -> int | None:
    """The family's native image side in pixels: the denoiser config's ``sample_size``
    (latent) x the VAE's downsampling; None where the configs do not say."""
    root = model_root(cfg.model)
    fam = family(cfg.model)
    try:
        vae = read_json(root / "vae" / "config.json", "the VAE's configuration")
        den = read_json(root / fam.denoiser / "config.json", "the denoiser's configuration")
    except Exception:  # noqa: BLE001 - a folder problem is reported by the folder checks
        return None
    side = den.get("sample_size")
    side = side[0] if isinstance(side, list) else side
    if not isinstance(side, int):
        return None
    return side * 2 ** (len(vae.get("block_out_channels", [0])) - 1)


def start_notes(cfg: Config) -> list[str]:
    """The lines printed once at the start of a ``model.pretrained`` run: the defaults that
    differ from kohya's (as ``note:``), and a resolution below the family's native size
    (as ``warning:``)."""
    if not cfg.model.pretrained:
        return []
    d, t = cfg.diffusion, cfg.train
    unlike = []
    if d.cfg_dropout > 0:
        unlike.append(f"diffusion.cfg_dropout={d.cfg_dropout:g} ({d.cfg_dropout:.0%} of "
                      "captions trained empty, for guidance; kohya: 0 unless "
                      "--caption_dropout_rate)")
    if d.loss_weighting == "min_snr":
        unlike.append(f"diffusion.loss_weighting=min_snr, gamma {d.min_snr_gamma:g} (kohya: "
                      "off unless --min_snr_gamma)")
    if cfg.sample.use_ema and t.ema_decay > 0:
        what = "LoRA" if cfg.adapter.kind == "lora" else "weights"
        unlike.append(f"train.ema_decay={t.ema_decay:g} with sample.use_ema=true (the "
                      f"exported {what} is the EMA's; kohya keeps no EMA)")
    notes = []
    if unlike:
        notes.append("note: defaults unlike a kohya sd-scripts recipe (set them to match "
                     "one): " + "; ".join(unlike))
    side = native_side(cfg)
    size = cfg.data.image_size
    if side and size < side:
        notes.append(f"warning: data.image_size={size} is below the {family(cfg.model).label}"
                     f"'s native {side} px (its denoiser's sample_size x the VAE's "
                     f"downsampling): the LoRA learns a size the base draws badly, and "
                     f"samples at {side} px may not show it; train at {side} unless you "
                     "mean to")
    return notes


def upscale_warning(data, image_size: int) -> str | None:
    """A warning when images of ``data`` (an image folder: its ``paths`` and ``_size``, the
    headers only) have their short side enlarged ``UPSCALE`` times or more to
    ``image_size``: they train on blur. Up to ``_SAMPLED`` headers are read."""
    paths = list(getattr(data, "paths", None) or [])
    size_of = getattr(data, "_size", None) or \
        getattr(getattr(data, "folder", None), "_size", None)  # a captioned folder's images
    if not paths or size_of is None:
        return None
    step = max(1, len(paths) // _SAMPLED)
    seen = paths[::step]
    small = []
    for p in seen:
        try:
            w, h = size_of(p)
        except (OSError, ValueError):
            continue
        if min(w, h) * UPSCALE <= image_size:
            small.append((min(w, h), p, w, h))
    if not small:
        return None
    side, p, w, h = min(small, key=lambda t: t[0])
    return (f"warning: {len(small)} of {len(seen)} images{' (sampled)' if step > 1 else ''} "
            f"are upscaled {UPSCALE}x or more to data.image_size={image_size} (the smallest: "
            f"{p}, {w}x{h}, {image_size / side:.0f}x): they train on blur; use larger images, "
            "or a smaller data.image_size")


def load_hints(cfg: Config, run_dir: str | Path) -> list[str]:
    """The end-of-run lines saying what to load where (a ``model.pretrained`` run's
    exports, those that exist)."""
    if not cfg.model.pretrained:
        return []
    run = Path(run_dir)
    a = cfg.adapter
    base = f"base: {cfg.model.pretrained}"
    lines = []
    if a.kind == "lora":
        kohya = run / "lora" / f"{run.name}.safetensors"
        diffusers = run / "lora" / "pytorch_lora_weights.safetensors"
        alpha = a.alpha if a.alpha is not None else a.rank
        kind = {"loha": "LoHa (LyCORIS)", "lokr": "LoKr (LyCORIS)", "dora": "DoRA",
                "locon": "LoCon"}.get(a.variant, "LoRA")
        lines.append(f"{kind} rank {a.rank}, alpha {alpha:g}"
                     + (", on the text encoders too" if a.text_encoder else "") + f"; {base}")
        if kohya.is_file():
            lines.append(f"  ComfyUI: copy {kohya} to models/loras/ (LoraLoader)")
            lines.append(f"  A1111:   copy it to models/Lora/, prompt <lora:{run.name}:1>")
        if diffusers.is_file():
            lines.append(f"  diffusers: pipe.load_lora_weights(\"{run / 'lora'}\")")
    elif a.kind == "hypernetwork":
        f = run / "hypernetwork" / "hypernetwork.safetensors"
        if f.is_file():
            lines.append(f"hypernetwork: {f} -> A1111 models/hypernetworks/; {base}")
    elif a.kind == "embedding":
        f = run / "embeddings" / f"{a.token}.safetensors"
        if f.is_file():
            lines.append(f"embedding {a.token} ({a.num_vectors} vector(s)); {base}")
            lines.append(f"  ComfyUI: copy {f} to models/embeddings/, prompt "
                         f"embedding:{a.token}")
            lines.append(f"  A1111:   copy it to embeddings/, prompt {a.token}")
            lines.append(f"  diffusers: pipe.load_textual_inversion(\"{f.parent}/"
                         "learned_embeds.safetensors\")")
    elif (run / "model").is_dir():
        lines.append(f"model: {run / 'model'} (a diffusers folder: "
                     "DiffusionPipeline.from_pretrained)")
    if lines and cfg.data.trigger:
        lines.append(f"  trigger: put \"{cfg.data.trigger}\" in the prompt")
    return lines
