"""Text-to-image runs: a model family's diffusers denoiser under steadydiff's denoiser
contract, the text encoders and VAE around it, and LoRA through peft.

- :class:`SDDenoiser` wraps the family's UNet or transformer as ``model(x, t, y)`` with y
  the packed text condition (families/base.py ``Layout``; SD 1.x/2.x: the text encoder's
  last hidden state (N, L, D), as diffusers' pipelines use it), so every steadydiff
  sampler, loss and the guard work on it unchanged; its ``null_context`` buffer is the
  empty caption's encoding (classifier-free guidance). The family makes the call.
- :class:`TextToImage` is the run's "media": prompts -> conditions (the family's
  encoding), images <-> latents (the VAE's ``shift_factor`` and ``scaling_factor``), the
  frozen parts in their own dtypes (``model.vae_precision``), and the identities that key
  the latent/text cache.
- :func:`add_lora` puts a peft LoRA on the denoiser (what diffusers itself loads and
  saves), :class:`PeftLoraWeights` checkpoints only the LoRA tensors and exports them as
  ``pytorch_lora_weights.safetensors`` (``pipe.load_lora_weights(dir)`` loads it).
"""

from __future__ import annotations

import fnmatch
import re
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ...trainer import precision as prec
from ...trainer.hooks import Weights
from ...trainer.checkpoint import Checkpoint, CheckpointError
from ..families import Family, Layout, of_module
from .ldm import clip_path
from .lora_files import LORA_FILE, base_model_hashes, save_kohya
from .numbered import mark_best, numbered_files, prune, publish

__all__ = ["to_device", "SDDenoiser", "TextToImage", "Tokenize", "PeftLoraWeights",
           "FullUNetWeights", "add_lora", "LOCON_TARGETS", "lora_targets", "upcast_aware_attention",
           "lora_state_dict", "save_lora", "export_pipeline"]



# --------------------------------------------------------------------------- attention


def upcast_aware_attention(denoiser: nn.Module) -> None:
    """Give every attention layer of ``denoiser`` (a family's UNet or transformer) the
    processor that follows its ``upcast_attention`` attribute, the guard's per-layer fp16
    remedy (``Family.prepare_attention``: the UNet's q kᵀ in fp32, a transformer's whole
    joint-attention layer in fp32)."""
    of_module(denoiser).prepare_attention(denoiser)


# --------------------------------------------------------------------------- the denoiser


class SDDenoiser(nn.Module):
    """``model(x, t, y) -> out`` over a model family's diffusers denoiser (a UNet or a
    transformer), so every steadydiff sampler, loss and the guard work on it unchanged.

    Args:
        denoiser: the UNet or transformer (frozen with a LoRA, or trainable); registered
            under the family's component name (``model.unet``, ``model.transformer``), so
            checkpoints and provenance name its tensors as diffusers does.
        layout: where the family's condition sits in ``y`` (families/base.py ``Layout``).
        family: the model family (its denoiser call and text encoding).
        text_encoders: the text encoders, in the family's order, when they run in the step
            (trained with their LoRA, or encoding shuffled captions): y is then their token
            ids and the condition is computed here. Registered under their component names
            (``model.text_encoder``, ``model.text_encoder_2``); absent ones are None.
        down: the VAE's downsampling (a sample's size in pixels is the latent's x it).
        shape: (latent channels, native latent side) (``Family.latent_shape``).
        guidance: a guidance-distilled transformer's embedded guidance (FLUX.1 dev;
            ``model.guidance``); None: the family's default.

    Attributes:
        num_classes: 0 (conditioned on text, not labels). context_dim: D, the context's
        width. in_channels, image_size: the latents' C and the denoiser's native side.
        null_context: (text rows, D) buffer, the text rows of the null condition (the
        empty caption's encoding, set by the trainer; zeros under force_zeros).
    """

    num_classes = 0

    def __init__(self, denoiser: nn.Module, layout: Layout, family: Family,
                 text_encoders: list[nn.Module | None] | None = None, *,
                 down: int = 8, shape: tuple[int, int] | None = None,
                 guidance: float | None = None) -> None:
        super().__init__()
        self.family, self.layout, self.down = family, layout, down
        self.guidance = guidance
        self.add_module(family.denoiser, denoiser)
        tes = list(text_encoders or [])
        for i, spec in enumerate(family.text):
            setattr(self, spec.part, tes[i] if i < len(tes) else None)
        if any(te is not None for te in tes):
            self.register_buffer("null_ids", torch.zeros(layout.text_ids, dtype=torch.long))
        self.context_dim = layout.width
        self.in_channels, self.image_size = shape or family.latent_shape(denoiser.config, None)
        self.register_buffer("null_context", torch.zeros(layout.text_rows, layout.width))

    @property
    def denoiser(self) -> nn.Module:
        """The UNet or transformer."""
        return getattr(self, self.family.denoiser)

    @property
    def text_encoders(self) -> list[nn.Module | None]:
        """The text encoders that run in the step (None where one does not), in order."""
        return [getattr(self, spec.part) for spec in self.family.text]

    @property
    def text_encoder_count(self) -> int:
        """How many text encoders the family has (trained or not)."""
        return len(self.family.text)

    def text_encoder_of(self, name: str) -> int | None:
        """The index of the text encoder (the family's order) a parameter ``name`` of this
        module belongs to, or None (the denoiser's): ``optim.lr_text_encoder``'s groups."""
        for i, spec in enumerate(self.family.text):
            if name.startswith(spec.part + "."):
                return i
        return None

    @property
    def encodes(self) -> bool:
        """Whether the text encoders run in the step (y is token ids)."""
        return any(te is not None for te in self.text_encoders)

    def size_multiple(self) -> int:
        """What a sample's side in pixels must be a multiple of (the VAE's x the
        denoiser's down-sampling)."""
        return self.down * self.family.denoiser_multiple(dict(self.denoiser.config))

    def enable_gradient_checkpointing(self) -> str:
        """Gradient checkpointing through the libraries' own switches: diffusers' for the
        denoiser's blocks, transformers' (non-reentrant, so its LoRA gets gradients through
        the frozen embeddings) for a text encoder trained with its LoRA. Returns what was
        checkpointed (``steadydiff.models.enable_checkpointing``)."""
        den = self.denoiser
        den.enable_gradient_checkpointing()
        what = f"the {self.family.denoiser_word}'s blocks ({type(den).__name__}, diffusers)"
        for te in self.text_encoders:
            if te is None:
                continue
            on = getattr(te, "activation_checkpointing_enable", None)  # transformers 5 name
            if on is not None:
                on(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                te.gradient_checkpointing_enable(
                    gradient_checkpointing_kwargs={"use_reentrant": False})
            what += f" and the text encoder's layers ({type(te).__name__})"
        return what + " recomputed in the backward pass"

    def set_null_context(self, ctx: Tensor) -> None:
        if tuple(ctx.shape) != tuple(self.null_context.shape):
            raise ValueError(f"null context of shape {tuple(ctx.shape)}; the model expects "
                             f"{tuple(self.null_context.shape)} (tokens x width)")
        self.null_context.copy_(ctx)

    def set_null_ids(self, ids: Tensor) -> None:
        """The empty caption's token ids (text encoders that run in the step)."""
        self.null_ids.copy_(ids.reshape(-1))

    def null_condition(self, y: Tensor) -> Tensor:
        """The null condition of classifier-free guidance for ``y``: its text replaced by
        the empty caption's, its per-sample ids kept."""
        n = y.shape[0]
        null = (self.null_ids.expand(n, -1) if not y.is_floating_point()  # token ids
                else self.null_context.to(y.dtype).expand(n, -1, -1))
        return self.layout.with_null_text(null, y)

    def encode(self, ids: Tensor) -> Tensor:
        """Token ids (N, L1 + ... + ids) -> the packed condition y, through the model's own
        text encoders (the family's ``encode``)."""
        if not self.encodes:
            raise ValueError("token ids need the model's own text encoder (adapter."
                             "text_encoder=true); pass the text context (N, L, D)")
        layout = self.layout
        per, extra = layout.split_ids(ids)
        embeds, pooled = self.family.encode(self.text_encoders, per, layout)
        if layout.force_zeros:  # the empty caption's condition is zeros (diffusers')
            keep = (ids[:, :layout.text_ids] != self.null_ids).any(dim=1)  # (N,)
            embeds = embeds * keep[:, None, None].to(embeds.dtype)
            if pooled is not None:
                pooled = pooled * keep[:, None].to(pooled.dtype)
        return layout.pack(embeds, pooled, extra)

    @property
    def y_rows(self) -> int:
        """The rows of a float condition y (N, rows, D) this model reads (the family's
        layout); rows after them are another part's (a ControlNet's image)."""
        return self.layout.rows

    def forward(self, x: Tensor, t: Tensor, y: Tensor | None = None, **extra: Any) -> Tensor:
        """The denoiser's prediction; ``extra`` goes to its call (a ControlNet's
        ``down_block_additional_residuals`` / ``mid_block_additional_residual``)."""
        t, y = self._inputs(x, t, y)
        return self.family.call(self.denoiser, x, t, y, self.layout, self.down,
                                guidance=self.guidance, **extra)

    def denoiser_inputs(self, x: Tensor, t: Tensor, y: Tensor | None = None
                        ) -> tuple[Tensor, dict[str, Any]]:
        """The denoiser call's timesteps (N,) and condition keywords (the family's
        ``condition``) for ``model(x, t, y)``: what a ControlNet is called with too."""
        t, y = self._inputs(x, t, y)
        return t, self.family.condition(x, y, self.layout, self.down)

    def _inputs(self, x: Tensor, t: Tensor, y: Tensor | None) -> tuple[Tensor, Tensor]:
        n = x.shape[0]
        if y is not None and not y.is_floating_point():
            y = self.encode(y)
        if y is None:  # the null condition (+ zero id slots: the sample's own size)
            if self.encodes:
                y = self.encode(self.layout.empty(self.null_ids.expand(n, -1)))
            else:
                y = self.layout.empty(self.null_context.expand(n, -1, -1))
        if y.ndim != 3 or y.shape[0] != n or y.shape[2] != self.context_dim:
            raise ValueError(f"the {self.family.title} expects a text condition (N={n}, L, "
                             f"{self.context_dim}), got {tuple(y.shape)}")
        return (t.expand(n) if t.ndim == 0 else t), y


# --------------------------------------------------------------------------- LoRA


def lora_targets(model: nn.Module, patterns: tuple[str, ...]) -> list[str]:
    """The names of the Linear/Conv2d layers of ``model`` that match ``patterns`` (fnmatch
    globs, or ``re:`` + a regular expression, as ``adapter.targets``).

    Raises:
        ValueError: no layer matches (the message lists a few layer names to choose from).
    """
    names = [n for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d))]

    def hit(n: str, p: str) -> bool:
        return bool(re.fullmatch(p[3:], n)) if p.startswith("re:") else fnmatch.fnmatchcase(n, p)

    out = [n for n in names if any(hit(n, p) for p in patterns)]
    if not out:
        attn = [n for n in names if n.endswith(("to_q", "to_k", "to_v", "to_out.0"))][:4]
        what = type(model).__name__
        raise ValueError(f"adapter.targets {list(patterns)} match no Linear/Conv2d layer of "
                         f"the {what}; e.g. {attn or names[:4]} (a LoRA usually targets the "
                         "attention: '*.to_q', '*.to_k', '*.to_v', '*.to_out.0'; see the "
                         "family's config in configs/)")
    return out


TEXT_ENCODER_TARGETS = ("*.q_proj", "*.k_proj", "*.v_proj", "*.out_proj")  # CLIP attention


# adapter.variant=locon: what kohya's LoCon (conv_dim) adds beside the attention, the
# layers of the UNet's ResNet blocks and down/up samplers (3x3 convolutions, their 1x1
# shortcut, the time-embedding projection)
LOCON_TARGETS = ("*.resnets.*.conv1", "*.resnets.*.conv2", "*.resnets.*.conv_shortcut",
                 "*.resnets.*.time_emb_proj", "*.downsamplers.*.conv", "*.upsamplers.*.conv")


def add_lora(unet: nn.Module, *, rank: int, alpha: float | None, dropout: float,
             targets: tuple[str, ...], dora: bool = False, variant: str = "lora",
             factor: int = -1) -> list[str]:
    """Freeze ``unet`` (or a text encoder) and add a peft LoRA (A gaussian, B zero: the model
    is unchanged at step 0) to the layers ``targets`` selects; returns their names.
    ``dora`` (or ``variant="dora"``): weight-decomposed (DoRA, Liu et al. 2024; peft's
    ``use_dora``), a magnitude per output row trained beside A and B. ``variant`` "loha" /
    "lokr": LyCORIS' LoHa / LoKr through peft (lycoris.py; ``factor``: LoKr's split)."""
    from peft import LoraConfig, inject_adapter_in_model

    from .lycoris import VARIANTS, peft_config

    names = lora_targets(unet, targets)
    unet.requires_grad_(False)
    a = alpha if alpha is not None else rank
    if variant in VARIANTS:
        config = peft_config(variant, rank=rank, alpha=a, targets=names, factor=factor)
    else:
        config = LoraConfig(r=rank, lora_alpha=a, lora_dropout=dropout,
                            init_lora_weights="gaussian", target_modules=names,
                            use_dora=dora or variant == "dora")
    if hasattr(unet, "set_adapters"):  # a diffusers model: its own peft integration
        unet.add_adapter(config)
    else:  # a transformers text encoder: peft's injection (what diffusers' loader uses)
        inject_adapter_in_model(config, unet, adapter_name="default")
    for p in unet.parameters():  # trainable parameters in fp32 whatever the base's dtype
        if p.requires_grad:
            p.data = p.data.float()
    return names


def lora_state_dict(module: nn.Module, keys: str = "diffusers", *,
                    fold_alpha: bool = False) -> dict[str, Tensor]:
    """A denoiser's (or text encoder's) LoRA as diffusers' loaders read it: peft's keys
    (``lora_A``/``lora_B``, ``keys="peft"``: the transformer families' loaders), or renamed
    to diffusers' (``keys="diffusers"``: the UNet loaders' ``lora.down``/``lora.up``).

    ``fold_alpha``: each up (``lora_B``) weight multiplied by alpha / rank, so that the
    delta is the trained one at alpha = rank, which every diffusers version assumes when a
    file carries no alpha (diffusers reads the alpha in the file's metadata only from 0.34
    on; 0.32 and 0.33 load an unfolded alpha != rank LoRA at the wrong strength)."""
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft.utils import get_peft_model_state_dict

    sd = get_peft_model_state_dict(module)
    conf = getattr(module, "peft_config", {}).get("default")
    alpha = getattr(conf, "lora_alpha", getattr(conf, "alpha", None))
    if fold_alpha and conf is not None and alpha != conf.r:
        scale = alpha / conf.r  # into the up weights (a LoKr: its first factor, lycoris.py)
        sd = {k: v * scale if k.endswith((".lokr_w1", ".lokr_w1_a")) or ".lora_B." in k
              else v for k, v in sd.items()}
    if keys == "diffusers":
        sd = convert_state_dict_to_diffusers(sd)
    return {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in sd.items()}


def _adapter_metadata(module: nn.Module, fold_alpha: bool = False) -> dict[str, Any] | None:
    """The LoraConfig diffusers records beside the tensors (read from 0.34 on), so that its
    loader scales by alpha / rank: alpha = rank where :func:`lora_state_dict` folded it."""
    conf = getattr(module, "peft_config", {}).get("default")
    if conf is None:
        return None
    if type(conf).__name__ == "LoKrConfig":  # diffusers builds LoKrConfig(**metadata)
        return {"r": conf.r, "alpha": conf.r if fold_alpha else conf.alpha,
                "target_modules": sorted(conf.target_modules),
                "decompose_factor": conf.decompose_factor,
                "decompose_both": conf.decompose_both,
                "use_effective_conv2d": conf.use_effective_conv2d}
    meta = {"r": conf.r, "lora_alpha": conf.r if fold_alpha else conf.lora_alpha,
            "target_modules": sorted(conf.target_modules)}
    if getattr(conf, "use_dora", False):  # else diffusers' LoraConfig drops the magnitudes
        meta["use_dora"] = True
    return meta


def _is_clip(module: nn.Module) -> bool:
    return type(module).__name__.startswith("CLIPText")


def save_lora(denoiser: nn.Module, out: str | Path,
              text_encoders: nn.Module | list[nn.Module | None] | None = None, *,
              format: str = "diffusers", kohya_name: str = "lora",
              metadata: dict[str, Any] | None = None) -> Path:
    """Write ``out/pytorch_lora_weights.safetensors`` (diffusers' LoRA format, through the
    family's pipeline's own ``save_lora_weights``: ``unet.*`` or ``transformer.*``, and
    each text encoder's LoRA under its component name) and/or ``out/<kohya_name>.safetensors``
    (kohya/A1111 format with ``metadata``, see lora_files.py), per ``format`` (diffusers |
    kohya | both), atomically: a previous file stays whole until the new one is complete.

    Args:
        text_encoders: the text encoders in the family's order (one module: the first);
            those without a LoRA are None.

    Returns:
        The diffusers file's path (the kohya file's with format=kohya).
    """
    import diffusers

    if format not in ("diffusers", "kohya", "both"):
        raise ValueError(f"LoRA format {format!r}: use diffusers, kohya or both")
    if text_encoders is None or isinstance(text_encoders, nn.Module):
        text_encoders = [text_encoders]
    family = of_module(denoiser)
    kohya = None
    if f"{kohya_name}.safetensors" == LORA_FILE:  # a run named pytorch_lora_weights: the two
        kohya_name += "_kohya"                    # files would be one, the second one winning
    if format != "diffusers":
        kohya = save_kohya(Path(out) / f"{kohya_name}.safetensors", denoiser,
                           list(text_encoders), metadata)
        if format == "kohya":
            return kohya

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    # written so that diffusers >= 0.32 loads it at the trained strength: alpha folded into
    # the up weights (metadata alpha = rank), CLIP paths with their ``text_model.`` level
    # (transformers < 5 has it; 0.32's loader fails without it; later ones strip it)
    keys = family.diffusers_lora_keys
    layers = {family.denoiser: lora_state_dict(denoiser, keys, fold_alpha=True)}
    meta = {family.denoiser: _adapter_metadata(denoiser, fold_alpha=True)}
    for spec, te in zip(family.text, text_encoders):
        if te is not None:
            sd = lora_state_dict(te, keys, fold_alpha=True)
            # a DoRA magnitude keeps its ``.weight``: transformers' load_adapter (the text
            # encoders' loader) does not add it back, as peft does for the denoiser
            sd = {k + ".weight" if k.endswith(".lora_magnitude_vector") else k: v
                  for k, v in sd.items()}
            layers[spec.part] = {clip_path(k): v for k, v in sd.items()} if _is_clip(te) else sd
            meta[spec.part] = _adapter_metadata(te, fold_alpha=True)
    bad = [k for sd in layers.values() for k, v in sd.items() if not torch.isfinite(v).all()]
    if bad:
        raise CheckpointError(f"the LoRA has non-finite weights ({bad[0]} and {len(bad) - 1} "
                              "more): not written")
    kw = {f"{part}_lora_layers": sd for part, sd in layers.items()}
    kw.update({f"{part}_lora_adapter_metadata": m for part, m in meta.items()})
    pipeline = getattr(diffusers, family.pipelines[0])
    from ...files import atomic_output

    with atomic_output(out / LORA_FILE) as tmp:  # umask's mode, fsynced, renamed, swept
        pipeline.save_lora_weights(str(tmp.parent), weight_name=tmp.name,
                                   safe_serialization=True, **kw)
    return out / LORA_FILE


def export_pipeline(denoiser: nn.Module, base: Path, out: str | Path) -> Path:
    """A full fine-tune as a diffusers folder ``out`` (``from_pretrained``-loadable): the
    trained denoiser, the base's other parts copied. Written beside and swapped in whole."""
    part = of_module(denoiser).denoiser
    from ...files import atomic_dir

    out = Path(out)
    with atomic_dir(out) as tmp:
        tmp.rmdir()
        shutil.copytree(base, tmp, ignore=shutil.ignore_patterns(part))
        denoiser.save_pretrained(tmp / part, safe_serialization=True)
    return out


def _trainable(module: nn.Module) -> dict[str, nn.Parameter]:
    return {n: p for n, p in module.named_parameters() if p.requires_grad}


class _SDWeights(Weights):
    def on_precision(self, state: Any) -> None:
        """A frozen fp16 base (LoRA) follows a precision fallback: cast to the new dtype,
        in place, so the EMA's copy (which shares the frozen parameters) follows too."""
        dtype = prec.DTYPES[state.precision]
        frozen = {n for n, p in state.model.named_parameters() if not p.requires_grad}
        for m in (state.model, state.ema.module):
            for n, p in m.named_parameters():
                if n in frozen and p.is_floating_point() and p.dtype != dtype:
                    p.data = p.data.to(dtype)
        media = getattr(state, "media", None)
        if isinstance(media, TextToImage):  # what the validation renders encode/decode with
            media.follow_precision(dtype)

    def sampling_context(self, state: Any):
        """Sample grids under the run's autocast: the frozen fp16/bf16 parts need it."""
        return prec.autocast(state.precision, state.device)


class PeftLoraWeights(_SDWeights):
    """A peft LoRA over a model family's denoiser (and text encoders): checkpoints hold the
    LoRA (and its EMA) alone, plus the base folder's path; exports write diffusers' LoRA
    file and/or kohya's."""

    def __init__(self, base: Path, targets: list[str], rank: int, alpha: float,
                 cfg: Any = None) -> None:
        self.base, self.targets, self.rank, self.alpha = base, targets, rank, alpha
        self._hashes: dict[str, str] | None = None
        self._started = time.time()  # ss_training_started_at (this process's start)
        # the |dW|/|W| guard (lora_guard.py; adapter.max_delta_ratio, adapter.monitor_every)
        self.cfg = cfg
        self.clamps, self.max_ratio, self.max_ratio_module = 0, 0.0, None
        self.last_ratios: dict[str, float] = {}
        self._deltas: Any = None

    def reads_at(self, step: int) -> bool:
        every = self.cfg.monitor_every if self.cfg is not None else 0
        return bool(every and step % every == 0)

    def after_update(self, state: Any) -> None:
        """After an applied update: ‖dW‖/‖W‖ of every LoRA layer (one host sync); a layer
        past ``adapter.max_delta_ratio`` is rescaled to it, with an incident."""
        if self.reads_at(state.step) and not getattr(state, "sharded", None):
            # (FSDP: each rank holds shards of A and B; the ratio needs whole ones: off)
            from ...adapters.core import clamp_deltas
            from .lora_guard import watched

            model, ema = watched(self, state.model, state.ema.module)
            clamp_deltas(self, state, model, ema)

    def tensors(self, state: Any) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        names = _trainable(state.model)
        ema = dict(state.ema.module.named_parameters())
        return ({n: p.detach() for n, p in names.items()},
                {n: ema[n].detach() for n in names})

    def restore(self, state: Any, c: Checkpoint) -> None:
        own = _trainable(state.model)
        ema = dict(state.ema.module.named_parameters())
        for what, saved in (("model", c.model), ("EMA", c.ema)):
            missing = sorted(set(own) - set(saved))
            extra = sorted(set(saved) - set(own))
            if missing or extra:
                raise CheckpointError(
                    f"{c.path}: its LoRA {what} tensors do not match this run's LoRA "
                    f"(missing {missing[:2]}, unexpected {extra[:2]}); adapter.targets, "
                    "adapter.rank or model.pretrained changed since it was written")
        with torch.no_grad():
            for n, p in own.items():
                p.copy_(c.model[n])
                ema[n].copy_(c.ema[n])
        saved = c.state.get("adapter") or {}
        self.clamps = int(saved.get("clamps", 0))
        self.max_ratio = float(saved.get("max_delta_ratio_seen", 0.0))
        self.max_ratio_module = saved.get("max_delta_ratio_module")

    def info(self) -> dict[str, Any]:
        return {"kind": "lora", "via": "peft", "base": str(self.base), "rank": self.rank,
                "alpha": self.alpha, "targets": len(self.targets), "clamps": self.clamps,
                "max_delta_ratio_seen": self.max_ratio,
                "max_delta_ratio_module": self.max_ratio_module}

    def export(self, state: Any, root: Path, final: bool) -> Path | None:
        model = state.ema.module if state.cfg.sample.use_ema else state.model
        files = self.write(model, state.cfg, state.step, state.precision, root / "lora",
                           root.name)
        publish(files, root / "lora", state.step)  # RUN/lora/<name>-stepNNNNNNNN.safetensors
        prune(root / "lora", set(files.values()), state.cfg.adapter.keep_files)
        return next(iter(files))

    def mark_best(self, state: Any, root: Path, info: dict[str, Any]) -> Path | None:
        """Evaluation's best step: its numbered files (written now if this step saved
        none) marked in ``RUN/lora/best.json``, which the keep policy never removes."""
        folder = root / "lora"
        stems = self.stems(state.cfg, root.name, state.model.family)
        have = numbered_files(folder, stems).get(state.step)
        if not have:
            self.export(state, root, False)
            have = numbered_files(folder, stems).get(state.step, [])
        return mark_best(folder, state.step, have, info)

    @staticmethod
    def formats(cfg: Any, family: Any) -> tuple[str, ...]:
        """The files a save writes ("diffusers", "kohya"): adapter.lora_format, less a
        format that cannot hold adapter.variant (lycoris.formats_for)."""
        from .lycoris import formats_for

        return formats_for(cfg.adapter.variant, family, cfg.adapter.lora_format)

    @classmethod
    def stems(cls, cfg: Any, name: str, family: Any) -> dict[str, str]:
        """The files a save writes, ``{file name stem: format}``."""
        f = cls.formats(cfg, family)
        return {**({Path(LORA_FILE).stem: "diffusers"} if "diffusers" in f else {}),
                **({name: "kohya"} if "kohya" in f else {})}

    def write(self, model: nn.Module, cfg: Any, step: int, precision: str, out: Path,
              name: str) -> dict[Path, str]:
        """Write ``model``'s LoRA into ``out`` in adapter.lora_format (diffusers' file and/or
        ``<name>.safetensors``, kohya's); returns ``{file: its stem}``."""
        # a frozen text encoder in the model (shuffled captions) has no LoRA to save
        tes = [t if getattr(t, "peft_config", None) else None for t in model.text_encoders]
        f = self.formats(cfg, model.family)
        save_lora(model.denoiser, out, tes, format=f[0] if len(f) == 1 else "both",
                  kohya_name=name,
                  metadata=self._kohya_metadata(cfg, step, precision, name,
                                                model.family.denoiser, f))
        return {out / f"{stem}.safetensors": stem
                for stem in self.stems(cfg, name, model.family)}

    def _kohya_metadata(self, cfg: Any, step: int, precision: str, name: str,
                        part: str, formats: tuple[str, ...]) -> dict[str, Any]:
        """The sd-scripts ``ss_*`` entries a run knows (A1111/ComfyUI show them)."""
        if "kohya" not in formats:
            return {}
        if self._hashes is None:  # the base's denoiser file read once a run
            self._hashes = base_model_hashes(self.base, part)
        return {**self._hashes, "ss_sd_model_name": self.base.name, "ss_output_name": name,
                "ss_steps": step, "ss_max_train_steps": cfg.train.steps,
                "ss_learning_rate": cfg.optim.lr, "ss_unet_lr": cfg.optim.lr,
                "ss_text_encoder_lr": _text_encoder_lr(cfg),
                "ss_train_batch_size": cfg.train.batch_size,
                "ss_resolution": f"({cfg.data.image_size}, {cfg.data.image_size})",
                "ss_enable_bucket": cfg.data.buckets,
                "ss_mixed_precision": precision, "ss_seed": cfg.train.seed,
                "ss_network_dropout": cfg.adapter.dropout,
                "ss_training_started_at": self._started,
                "ss_training_comment": "trained with steadydiff"}


def _text_encoder_lr(cfg: Any) -> Any:
    """``ss_text_encoder_lr``: the text encoders' LR (kohya writes one, or a list for
    SDXL's two), None where they are not trained."""
    if not cfg.adapter.text_encoder:
        return None
    te = cfg.optim.lr_text_encoder
    return cfg.optim.lr if te is None else te


class FullUNetWeights(_SDWeights):
    """A full fine-tune of a model family's denoiser (UNet or transformer): checkpoints hold
    the whole denoiser; the final export is a diffusers folder ``RUN/model`` (base parts +
    the trained denoiser), or, for a run from a single-file checkpoint, the single file
    ``RUN/model.safetensors`` (the base file with its denoiser replaced)."""

    def __init__(self, base: Path) -> None:
        self.base = base
        #: (``reader(shapes) -> read(name, start, stop)``, the denoiser's name in the model)
        #: when the denoiser was built on the meta device (FSDP): :meth:`materialize` reads
        #: each rank's shards through it (folder.part_reader over the base folder's
        #: safetensors, or the family's file_reader over a single file)
        self.meta_source: tuple[Any, str] | None = None

    def materialize(self, model: nn.Module, device: torch.device) -> int:
        """Give a sharded meta-device model (or its EMA) its denoiser's weights: each rank
        reads its own shards from the base folder's safetensors or single file (never the
        whole tensor of a sharded parameter). Returns the bytes this rank read."""
        from ... import sharding

        reader, name = self.meta_source
        den = getattr(model, name)
        read = reader({k: tuple(t.shape) for k, t in
                       list(den.named_parameters()) + list(den.named_buffers())})
        return sharding.materialize(den, device, read)

    # A full fine-tune never trains the text encoder; with shuffled captions the frozen one
    # sits in the model (it encodes in the step) and stays out of checkpoints (~0.5 GB for
    # SD 1.x): it is the base folder's.
    def tensors(self, state: Any) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        return unet_only(state.model), unet_only(state.ema.module)

    def restore(self, state: Any, c: Checkpoint) -> None:
        for m, saved in ((state.model, c.model), (state.ema.module, c.ema)):
            load_unet_only(m, saved, c.path)

    def info(self) -> dict[str, Any]:
        return {"kind": "full", "base": str(self.base)}

    def export(self, state: Any, root: Path, final: bool) -> Path | None:
        if not final:  # a multi-GB copy: once, at the end
            return None
        model = state.ema.module if state.cfg.sample.use_ema else state.model
        den = model.denoiser
        if state.sharded:  # FSDP: every rank's shards gathered on rank 0's CPU, once
            den = _consolidated(model)
            if den is None:
                return None  # not rank 0: it only gave its shards
        if self.base.is_file():
            from .single_file import export_single_file

            return export_single_file(root / "model.safetensors", den, None, None,
                                      base_file=self.base)
        return export_pipeline(den, self.base, root / "model")


def _consolidated(model: nn.Module) -> nn.Module | None:
    """An FSDP-sharded :class:`SDDenoiser`'s denoiser whole, as a plain module in rank 0's
    CPU memory (a collective: every rank calls it; None on the others)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from ... import distributed

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                cpu_offload=True))
    if distributed.rank() != 0:
        return None
    part = model.family.denoiser
    den = type(model.denoiser).from_config(model.denoiser.config)
    den.load_state_dict({k[len(part) + 1:]: v for k, v in full.items()
                         if k.startswith(part + ".")})
    return den


def _text_encoder_key(k: str) -> bool:
    """Whether a state-dict key of :class:`SDDenoiser` is a text encoder's
    (``text_encoder.*``, ``text_encoder_2.*``, ...)."""
    return k.split(".", 1)[0].startswith("text_encoder")


def unet_only(model: nn.Module) -> dict[str, Tensor]:
    """``model``'s state dict without a frozen text encoder's tensors."""
    return {k: v for k, v in model.state_dict().items() if not _text_encoder_key(k)}


def load_unet_only(model: nn.Module, saved: dict[str, Tensor], path: Any) -> None:
    """Load ``saved`` (:func:`unet_only`) into ``model``, whose text encoder, if any, comes
    from the base folder; any other missing or unexpected tensor is a CheckpointError."""
    try:
        missing, extra = model.load_state_dict(saved, strict=False)
    except RuntimeError as e:
        raise CheckpointError(f"{path}: weights do not match the model its config describes: "
                              f"{e}") from None
    missing = [k for k in missing if not _text_encoder_key(k)]
    if missing or extra:
        raise CheckpointError(f"{path}: weights do not match the model its config describes "
                              f"(missing {missing[:2]}, unexpected {list(extra)[:2]})")


# --------------------------------------------------------------------------- media


def to_device(m: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """Move ``m``; cast only when its dtype differs (diffusers warns on every cast)."""
    m = m.to(device)
    p = next(m.parameters(), None)
    return m.to(dtype) if p is not None and p.dtype != dtype else m


class Tokenize:
    """``list[str] -> (B, L1 + L2 + ...)`` token ids: each tokenizer's, padded to its length
    and truncated (as the pipelines' ``encode_prompt``), concatenated; small enough to send
    to DataLoader workers. :meth:`TextToImage.tokenize` is this plus the per-sample ids'
    zero slot.

    Args:
        tokenizers: a tokenizer, or the family's tokenizers in order.
        lengths: each one's length (one int for one tokenizer).
        expand: a textual-inversion token and its vector count (embedding.py): the token
            in a prompt becomes its vectors' tokens first.
    """

    def __init__(self, tokenizers: Any, lengths: int | tuple[int, ...],
                 expand: tuple[str, int] | None = None) -> None:
        self.tokenizers = list(tokenizers) if isinstance(tokenizers, (list, tuple)) \
            else [tokenizers]
        self.lengths = (lengths,) if isinstance(lengths, int) else tuple(lengths)
        self.expand = expand

    def __call__(self, prompts: list[str]) -> torch.Tensor:
        if self.expand is not None:
            from .embedding import expand_prompt

            prompts = [expand_prompt(p, *self.expand) for p in prompts]
        return torch.cat([t(list(prompts), padding="max_length", truncation=True,
                            max_length=n, return_tensors="pt").input_ids
                          for t, n in zip(self.tokenizers, self.lengths)], dim=1)


class TextToImage:
    """Prompts -> text conditions, images <-> latents, for a text-conditioned run.

    Args:
        family: the model family (how its encoders' outputs are packed); steadydiff's own
            text-conditioned models use the base :class:`Family` (one CLIP's last hidden
            state).
        tokenizers, text_encoders: the family's tokenizers and text encoders (frozen), in
            its order.
        vae: a diffusers AutoencoderKL (frozen) or None (pixel space).
        device: where they run. text_dtype, vae_dtype: their dtypes (``text_dtype`` a list:
            each encoder's; an fp16-unsafe T5 runs in bf16/fp32).
        force_zeros: the pipeline's ``force_zeros_for_empty_prompt`` (the null condition is
            zeros).
        max_sequence_length: T5's token length (None: the family's default).

    Attributes:
        layout: where the condition's pieces sit (families/base.py ``Layout``).
        tokens: True when the model encodes token ids itself (its text encoders train, or
            shuffled captions): :meth:`encode_prompts` then returns the ids.
    """

    text = True

    def __init__(self, family: Family, tokenizers: list[Any], text_encoders: list[nn.Module],
                 vae: nn.Module | None, device: torch.device,
                 text_dtype: torch.dtype | list[torch.dtype] = torch.float32,
                 vae_dtype: torch.dtype = torch.float32, *, force_zeros: bool = False,
                 max_sequence_length: int | None = None) -> None:
        self.family = family
        self.tokenizers = list(tokenizers)
        dtypes = text_dtype if isinstance(text_dtype, list) else [text_dtype] * len(text_encoders)
        self.text_dtypes = dtypes
        self.text_encoders = [to_device(te, device, d).eval().requires_grad_(False)
                              for te, d in zip(text_encoders, dtypes)]
        self.vae = to_device(vae, device, vae_dtype).eval().requires_grad_(False) if vae else None
        self.device, self.text_dtype, self.vae_dtype = device, dtypes[0], vae_dtype
        self.text_device = device  # where the text encoders are (offload: the CPU)
        self.notes: list[str] = []  # what setup.build did to the model, said at the start
        self.tokens = False  # True: prompts become token ids (the model encodes them)
        self.expand: tuple[str, int] | None = None  # a textual-inversion token, its vectors
        self.layout: Layout = family.layout(self.tokenizers, self.text_encoders, force_zeros,
                                            max_sequence_length)
        self.force_zeros = force_zeros  # the null condition is zeros, not the encoded ""
        self.context_len = self.layout.text_len
        self.context_dim = self.layout.width
        self.latent = vae is not None
        self._other_vaes: dict[torch.dtype, nn.Module] = {}
        self._other_tes: dict[torch.dtype, list[nn.Module]] = {}
        # () -> the frozen parts read again from disk, fp32 on the CPU (families ``Parts``;
        # set by setup.build): the fallbacks' source. None: a cast copy of the loaded ones
        self.reload: Any = None
        self._reloaded: Any = None
        self.fallback_source = "a cast of the loaded weights"
        if vae is not None:
            self.scale = float(getattr(vae.config, "scaling_factor", 0.18215))
            self.shift = float(getattr(vae.config, "shift_factor", None) or 0.0)
            self.down = 2 ** (len(vae.config.block_out_channels) - 1)
            self.latent_channels = int(vae.config.latent_channels)

    @property
    def tokenizer(self):
        """The first tokenizer (the one caption-length checks count with)."""
        return self.tokenizers[0]

    @property
    def text_encoder(self) -> nn.Module:
        return self.text_encoders[0]

    def follow_precision(self, dtype: torch.dtype) -> list[str]:
        """A precision fallback (fp16 -> bf16/fp32): every frozen part that ran in fp16
        (the text encoders, the VAE) moves to ``dtype`` with the model, so the step and
        the validation renders never mix dtypes. Parts in another dtype (an fp32 VAE from
        ``model.vae_precision``, a T5 kept out of fp16) stay. Returns what moved."""
        moved = []
        for i, te in enumerate(self.text_encoders):
            if self.text_dtypes[i] == torch.float16 and dtype != torch.float16:
                self.text_encoders[i] = te.to(dtype)
                self.text_dtypes[i] = dtype
                moved.append(f"text encoder {i + 1}")
        self.text_dtype = self.text_dtypes[0] if self.text_dtypes else self.text_dtype
        if self.vae is not None and self.vae_dtype == torch.float16 and dtype != torch.float16:
            self.vae = self.vae.to(dtype)
            self.vae_dtype = dtype
            moved.append("VAE")
        return moved

    # -- text
    def tokenize(self, prompts: list[str]) -> Tensor:
        """(B, L1 + L2 + ... + ids) long: each tokenizer's ids, padded to its length and
        truncated (as diffusers), then the zero slot of the per-sample ids (SDXL's)."""
        ids = Tokenize(self.tokenizers, self.layout.ids_len, self.expand)(list(prompts))
        if self.layout.extra_ids:
            ids = torch.cat([ids, ids.new_zeros(len(prompts), self.layout.extra_ids)], dim=1)
        return ids

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> Tensor:
        """The packed condition (B, rows, D) float32 of the family's pipeline's
        ``encode_prompt`` (SD 1.x/2.x: the text encoder's last hidden state (B, L, D); SDXL:
        both encoders' penultimate states, the pooled embedding and the zero time-ids slot,
        the drawn size); with ``tokens`` (the model runs its own text encoders) the token
        ids it encodes itself. :meth:`text_part` is its text (what the cache holds: each
        sample's own ids are added per item)."""
        ids = self.tokenize(prompts)
        if self.tokens:
            return ids.to(self.device)
        per, extra = self.layout.split_ids(ids.to(self.text_device))
        embeds, pooled = self.family.encode(self.text_encoders, per, self.layout)
        return self.layout.pack(embeds, pooled, extra).to(self.device)

    def offload(self) -> None:
        """Move the frozen text encoders to the CPU (``model.offload_text_encoders``): the
        captions are cached; what is encoded from now on (validation prompts, sampling) is
        encoded there and sent to the device."""
        cpu = torch.device("cpu")
        self.text_encoders = [te.to(cpu) for te in self.text_encoders]
        self.text_device = cpu

    def text_part(self, y: Tensor) -> Tensor:
        """The text of a condition from :meth:`encode_prompts` or :meth:`tokenize` (without
        the per-sample ids' slot)."""
        rows = self.layout.rows_of(y)
        return y if y.shape[1] == rows else y[:, :rows]

    def null_text(self) -> Tensor:
        """(text rows, D) float32, the text rows of the null condition: the empty caption's
        encoding, or zeros for a pipeline with ``force_zeros_for_empty_prompt``."""
        null = self.text_part(self.encode_prompts([""]))[0].float()
        return torch.zeros_like(null) if self.force_zeros and null.is_floating_point() \
            else null

    def text_identity(self) -> str:
        """What the cached text conditions are a function of (``module_identity``): the text
        encoders, their dtype and the family's packing."""
        from ...data.cache import module_identity

        extra: dict[str, Any] = {"dtype": str(self.text_dtype)}
        extra.update(self.family.identity(self.layout))
        for i, (te, d) in enumerate(zip(self.text_encoders[1:], self.text_dtypes[1:]), start=2):
            extra[f"text_encoder_{i}"] = module_identity(te)
            if d != self.text_dtype:
                extra[f"text_encoder_{i}_dtype"] = str(d)
        return module_identity(self.text_encoders[0], extra)

    # -- latents
    @torch.no_grad()
    def encode_images(self, x: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        """Latents (B, c, h, w) float32 of images x in [-1, 1]: the posterior mean, shifted
        and scaled as diffusers' training scripts scale samples (deterministic, so a cached
        latent equals a recomputed one)."""
        dtype = dtype or self.vae_dtype
        vae = self.vae if dtype == self.vae_dtype else self._vae_in(dtype)
        z = vae.encode(x.to(self.device, dtype)).latent_dist.mean
        return ((z.float() - self.shift) * self.scale)

    def _from_disk(self) -> Any:
        """The frozen parts read again from the files (fp32, CPU), once; None without a
        ``reload``."""
        if self._reloaded is None and self.reload is not None:
            self._reloaded = self.reload()
        return self._reloaded

    def _vae_in(self, dtype: torch.dtype) -> nn.Module:
        """The VAE in another dtype (the fp32 re-encode of a latent fp16 made non-finite),
        made once, on the first sample that needs it: read again from the weights on disk
        (an fp16 copy cast up keeps fp16's rounding, and a weight beyond fp16's range stays
        inf), else a copy of the loaded one."""
        import copy

        if dtype not in self._other_vaes:
            parts = self._from_disk()
            vae = parts.vae if parts is not None else copy.deepcopy(self.vae)
            self._other_vaes[dtype] = to_device(vae, self.device, dtype).eval() \
                .requires_grad_(False)
        return self._other_vaes[dtype]

    def _text_encoders_in(self, dtype: torch.dtype) -> list[nn.Module]:
        """The text encoders in ``dtype`` (the fp32 re-encode of a non-finite caption), read
        again from disk as :meth:`_vae_in` does, made once."""
        import copy

        if dtype not in self._other_tes:
            parts = self._from_disk()
            tes = list(parts.text_encoders) if parts is not None else \
                [copy.deepcopy(te) for te in self.text_encoders]
            self._other_tes[dtype] = [to_device(te, self.text_device, dtype).eval()
                                      .requires_grad_(False) for te in tes]
        return self._other_tes[dtype]

    @torch.no_grad()
    def encode_prompts_in(self, prompts: list[str], dtype: torch.dtype) -> Tensor:
        """:meth:`encode_prompts`' text part with the text encoders in ``dtype`` (the fp32
        fallback of the text cache)."""
        ids = self.tokenize(prompts)
        per, extra = self.layout.split_ids(ids.to(self.text_device))
        embeds, pooled = self.family.encode(self._text_encoders_in(dtype), per, self.layout)
        return self.text_part(self.layout.pack(embeds.float(), None if pooled is None
                                               else pooled.float(), extra))

    def blame_tokens(self, caption: str) -> str:
        """The tokens of ``caption`` whose input-embedding row is non-finite in a text
        encoder as loaded (in its run dtype: a row beyond fp16's range is inf there)."""
        from .frozen import nonfinite_token_rows

        out = []
        for i, (te, tok) in enumerate(zip(self.text_encoders, self.tokenizers)):
            rows = set(nonfinite_token_rows(te))
            if not rows:
                continue
            n = self.layout.ids_len[i] if i < len(self.layout.ids_len) else 77
            ids = tok([caption], truncation=True, max_length=n)["input_ids"][0]
            hit = [j for j in dict.fromkeys(ids) if j in rows]
            out += [f"token {tok.convert_ids_to_tokens(j)!r} (id {j}) of text encoder {i + 1}"
                    for j in hit]
        return ("the token(s) to blame: " + ", ".join(out)) if out else \
            "no token's embedding row is non-finite: the encoder's activations overflow"

    @torch.no_grad()
    def decode(self, z: Tensor) -> Tensor:
        """Images in [-1, 1] from latents (pixel space: the input, clamped)."""
        if self.vae is None:
            return z.clamp(-1, 1)
        x = self.vae.decode((z / self.scale + self.shift).to(self.device, self.vae_dtype)).sample
        return x.float().clamp(-1, 1)

