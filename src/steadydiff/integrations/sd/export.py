"""``steadydiff export SOURCE --single-file OUT``: a full Stable Diffusion fine-tune (a run
or checkpoint), or a diffusers SD folder, written as one original-layout file
(single_file.py has the layout)."""

from __future__ import annotations

from pathlib import Path

import torch

from .folder import load_folder_parts
from .single_file import export_single_file, is_single_file

__all__ = ["export"]


def export(source: str | Path, out: str | Path, *, use_ema: bool = True,
           dtype: torch.dtype | None = None, force: bool = False,
           base: str | Path | None = None) -> Path:
    """``steadydiff export SOURCE --single-file OUT``: a full Stable Diffusion fine-tune, or
    a diffusers SD folder, as one original-layout ``.safetensors`` file A1111/ComfyUI read.

    Args:
        source: a run directory or checkpoint of a full fine-tune (``model.pretrained`` with
            ``adapter.kind: none``; its EMA weights unless ``use_ema`` is false), or a
            diffusers Stable Diffusion folder (e.g. ``RUN/model``).
        out: the file to write (``.safetensors``), atomically; an existing one only with
            ``force`` (never a directory, the source, or a file inside it).
        dtype: cast the floating-point tensors (torch.float16 halves the file).
        base: the run's base model (``model.pretrained``) when it moved since training; its
            identity must be the one the run recorded (integrations/sd/identity.py).

    Raises:
        ValueError: ``out`` is not a .safetensors path, or the run is not a full SD
            fine-tune (a LoRA run exports ``RUN/lora/pytorch_lora_weights.safetensors``).
        CheckpointError: non-finite weights (nothing written).
        BaseMismatchError: the base found is not the one the run was trained on.
    """
    out, src = Path(out).expanduser(), Path(source).expanduser()
    if out.suffix.lower() != ".safetensors":
        raise ValueError(f"--single-file must end in .safetensors, got {out}")
    from ...files import check_output

    check_output(out, force=force, inputs=[src], what="--single-file")
    if (src / "model_index.json").is_file():  # a diffusers folder
        p = load_folder_parts(src)
        return export_single_file(out, p.denoiser, p.vae, p.text_encoders, dtype=dtype)
    from ...loading import load  # loading builds through setup: above this module

    pipe = load(src, device="cpu", use_ema=use_ema, base=base)
    cfg = pipe.config
    if not cfg.model.pretrained:
        raise ValueError(f"{pipe.checkpoint} is not a Stable Diffusion fine-tune "
                         "(no model.pretrained): it has no single-file layout")
    if cfg.adapter.kind != "none":
        raise ValueError(f"{pipe.checkpoint} is a {cfg.adapter.kind} run: its export is the "
                         "LoRA file RUN/lora/pytorch_lora_weights.safetensors (diffusers' "
                         "load_lora_weights reads it); --single-file writes full fine-tunes")
    base = cfg.model.pretrained if is_single_file(cfg.model.pretrained) else None
    return export_single_file(out, pipe.model.denoiser, pipe.media.vae,
                              pipe.media.text_encoders, base_file=base, dtype=dtype)


def checkpoint_at(source: str | Path, step: int | None) -> Path:
    """``source`` as a checkpoint: itself (a checkpoint directory), the newest intact one of
    a run (``step`` None), or the run's checkpoint of ``step`` (a kept one, or the best
    evaluation's).

    Raises:
        CheckpointError: no checkpoint of that step is kept (the kept steps are listed).
    """
    from ...trainer import checkpoint as ckpt

    src = Path(source).expanduser()
    if step is None:
        return ckpt.resolve_checkpoint(src)
    if step < 0:
        raise ValueError(f"--step {step}: a step is >= 0")
    if ckpt.is_checkpoint_dir(src) and ckpt.step_of(src) is not None:
        raise ValueError(f"--step picks a checkpoint of a run: {src} is one checkpoint "
                         "already; pass its run directory, or drop --step")
    root = src / "checkpoints" if (src / "checkpoints").is_dir() else src
    name = ckpt.checkpoint_name(step)
    for c in (root / name, root / "best" / name):
        if c.is_dir():
            problems = ckpt.verify_checkpoint(c)
            if problems:
                raise ckpt.CheckpointError(f"{c} failed verification: " + "; ".join(problems))
            return c
    kept = sorted({s for p in ckpt.list_checkpoints(root) + ckpt.list_checkpoints(root / "best")
                   if (s := ckpt.step_of(p)) is not None})
    raise ckpt.CheckpointError(f"{src}: no checkpoint of step {step} is kept (kept: "
                               f"{kept or 'none'}; train.keep_checkpoints decides how many)")


def export_adapter(source: str | Path, step: int | None = None, *,
                   use_ema: bool | None = None) -> tuple[list[Path], list[Path]]:
    """``steadydiff export RUN --step N``: the numbered LoRA (hypernetwork, embedding) files of
    any kept checkpoint of a model.pretrained adapter run, written into the run's ``lora/``
    (``hypernetwork/``, ``embeddings/``) folder as training writes them (numbered.py names
    them), in its adapter.lora_format. Files already there are left as they are.

    Args:
        source: a run directory or one of its checkpoints.
        step: the checkpoint's step (None: ``source`` itself, or the newest).
        use_ema: the EMA weights (None: as the run exported them, sample.use_ema).

    Returns:
        ``(written, already there)``.

    Raises:
        ValueError: the run is not a Stable Diffusion adapter run (--single-file or --out
            export those).
        CheckpointError: no such checkpoint, or its tensors do not fit the adapter.
    """
    import tempfile

    from ...loading import checkpoint_config
    from ...trainer import checkpoint as ckpt
    from .embedding import EMB_FOLDER, EmbeddingWeights
    from .hypernetwork import HypernetworkWeights
    from .model import PeftLoraWeights
    from .numbered import publish
    from .setup import load_trained, model_root

    path = checkpoint_at(source, step)
    c = ckpt.load_checkpoint(path, "cpu", weights_only=True)
    cfg = checkpoint_config(c)
    kind = cfg.adapter.kind
    if not cfg.model.pretrained or kind not in ("lora", "hypernetwork", "embedding"):
        what = "a full fine-tune: --single-file OUT" if cfg.model.pretrained else \
            "steadydiff's own model: --out OUT"
        raise ValueError(f"{path} is not a Stable Diffusion LoRA, hypernetwork or embedding run "
                         f"(adapter.kind={kind}); it is {what} exports it")
    ema = cfg.sample.use_ema if use_ema is None else use_ema
    model, _ = load_trained(c, cfg, use_ema=ema)
    base = model_root(cfg.model)
    weights = PeftLoraWeights(base, list(cfg.adapter.targets), cfg.adapter.rank,
                              cfg.adapter.alpha or cfg.adapter.rank) if kind == "lora" \
        else EmbeddingWeights(cfg.adapter, base, [0] * len(model.text_encoders)) \
        if kind == "embedding" else HypernetworkWeights(cfg.adapter, base, [])
    run = path.parent.parent if path.parent.name == "checkpoints" else \
        path.parent.parent.parent if path.parent.name == "best" else path.parent
    folder = run / {"lora": "lora", "embedding": EMB_FOLDER}.get(kind, "hypernetwork")
    folder.mkdir(parents=True, exist_ok=True)
    precision = str(c.state.get("precision") or cfg.train.precision)
    with tempfile.TemporaryDirectory(dir=folder, prefix=".export-") as tmp:
        files = weights.write(model, cfg, c.step, precision, Path(tmp), run.name)
        return publish(files, folder, c.step, overwrite=False)
