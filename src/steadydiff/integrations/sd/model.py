"""Text-to-image runs: a diffusers UNet under steadydiff's denoiser contract, the text
encoder and VAE around it, and LoRA through peft.

- :class:`SDDenoiser` wraps a ``UNet2DConditionModel`` as ``model(x, t, y)`` with y the
  text context (N, L, D) (the frozen text encoder's last hidden state, as diffusers'
  pipelines use it), so every steadydiff sampler, loss and the guard work on it unchanged;
  its ``null_context`` buffer is the empty caption's encoding (classifier-free guidance).
- :class:`TextToImage` is the run's "media": prompts -> contexts, images <-> latents
  (x the VAE's ``scaling_factor``), the frozen parts in their own dtypes
  (``model.vae_precision``), and the identities that key the latent/text cache.
- :func:`add_lora` puts a peft LoRA on the UNet (what diffusers itself loads and saves),
  :class:`PeftLoraWeights` checkpoints only the LoRA tensors and exports them as
  ``pytorch_lora_weights.safetensors`` (``pipe.load_lora_weights(dir)`` loads it).
"""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ...trainer import precision as prec
from ...trainer.hooks import Weights
from ...trainer.checkpoint import Checkpoint, CheckpointError
from .lora_files import LORA_FILE, base_model_hashes, save_kohya
from .sdxl import TIME_IDS, SDXLLayout, encode_sdxl

__all__ = ["to_device", "SDDenoiser", "TextToImage", "PeftLoraWeights", "FullUNetWeights", "add_lora",
           "lora_targets", "upcast_aware_attention", "lora_state_dict", "save_lora",
           "export_pipeline"]



# --------------------------------------------------------------------------- attention


class _UpcastAware:
    """An attention processor that honours ``attn.upcast_attention`` at run time.

    diffusers' default processor (scaled_dot_product_attention) ignores the attribute; the
    classic ``AttnProcessor`` computes q kᵀ in fp32 when it is set. The guard's fp16 remedy
    sets it on the one layer that overflowed (``Guard.upcast_attention``), so that layer
    switches to the classic path and every other layer keeps the fast one."""

    def __init__(self) -> None:
        from diffusers.models.attention_processor import AttnProcessor, AttnProcessor2_0

        self.fast, self.exact = AttnProcessor2_0(), AttnProcessor()

    def __call__(self, attn, *args, **kwargs):
        use = self.exact if getattr(attn, "upcast_attention", False) else self.fast
        return use(attn, *args, **kwargs)


def upcast_aware_attention(unet: nn.Module) -> None:
    """Give every attention layer of ``unet`` the processor that follows its
    ``upcast_attention`` attribute (see :class:`_UpcastAware`)."""
    unet.set_attn_processor(_UpcastAware())


# --------------------------------------------------------------------------- the denoiser


class SDDenoiser(nn.Module):
    """``model(x, t, y) -> out`` over a diffusers ``UNet2DConditionModel``.

    Args:
        unet: the UNet (frozen with a LoRA, or trainable).
        context_len: L of the text context (the tokenizer's max length, 77 for CLIP).
        text_encoder: a text encoder that trains with its LoRA (or encodes shuffled
            captions): y is then its token ids and the context is computed here.
        text_encoder_2, sdxl: an SDXL UNet's second text encoder (with the first, when the
            encoders run in the step) and the layout of its packed condition
            (:class:`~steadydiff.integrations.sd.sdxl.SDXLLayout`).
        down: the VAE's downsampling (an SDXL sample's default size is the latent's x it).

    Attributes:
        num_classes: 0 (conditioned on text, not labels). context_dim: D, the UNet's
        ``cross_attention_dim``. in_channels, image_size: the latents' C and side.
        null_context: (L, D) buffer, the empty caption's encoding (set by the trainer);
        SDXL: (L + R, D), the text rows of the null condition (hidden states + pooled).
    """

    num_classes = 0

    def __init__(self, unet: nn.Module, context_len: int = 77,
                 text_encoder: nn.Module | None = None, *,
                 text_encoder_2: nn.Module | None = None, sdxl: SDXLLayout | None = None,
                 down: int = 8) -> None:
        super().__init__()
        self.unet = unet
        # a text encoder with its own LoRA trains with the UNet: y is then token ids (N, L)
        # and the context is computed here, in the step
        self.text_encoder = text_encoder
        self.text_encoder_2 = text_encoder_2
        self.sdxl, self.down = sdxl, down
        if text_encoder is not None:
            n_ids = sdxl.text_ids if sdxl is not None else context_len
            self.register_buffer("null_ids", torch.zeros(n_ids, dtype=torch.long))
        c = unet.config
        dim = c.cross_attention_dim
        self.context_dim = int(dim if isinstance(dim, int) else dim[0])
        self.in_channels = int(c.in_channels)
        self.image_size = int(c.sample_size if isinstance(c.sample_size, int)
                              else c.sample_size[0])
        rows = sdxl.text_rows if sdxl is not None else context_len
        self.register_buffer("null_context", torch.zeros(rows, self.context_dim))

    def enable_gradient_checkpointing(self) -> str:
        """Gradient checkpointing through the libraries' own switches: diffusers' for the
        UNet's blocks, transformers' (non-reentrant, so its LoRA gets gradients through the
        frozen embeddings) for a text encoder trained with its LoRA. Returns what was
        checkpointed (``steadydiff.models.enable_checkpointing``)."""
        self.unet.enable_gradient_checkpointing()
        what = f"the UNet's blocks ({type(self.unet).__name__}, diffusers)"
        for te in (self.text_encoder, self.text_encoder_2):
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
        """The empty caption's token ids (a text encoder trained with its LoRA)."""
        self.null_ids.copy_(ids.reshape(-1))

    def null_condition(self, y: Tensor) -> Tensor:
        n = y.shape[0]
        null = (self.null_ids.expand(n, -1) if not y.is_floating_point()  # token ids
                else self.null_context.to(y.dtype).expand(n, -1, -1))
        if self.sdxl is None:
            return null
        # SDXL: the text is nulled, the sample's size/crop ids are kept (diffusers'
        # negative_add_time_ids = add_time_ids)
        return torch.cat([null, y[:, null.shape[1]:]], dim=1)

    def encode(self, ids: Tensor) -> Tensor:
        """(N, L) token ids -> (N, L, D) context through the trained text encoder (SDXL:
        (N, L1 + L2 + 6) -> the packed y, see sdxl.py)."""
        if self.text_encoder is None:
            raise ValueError("token ids need the model's own text encoder (adapter."
                             "text_encoder=true); pass the text context (N, L, D)")
        if self.sdxl is None:
            return self.text_encoder(ids, return_dict=False)[0]
        ids_1, ids_2, time_ids = self.sdxl.unpack_ids(ids)
        embeds, pooled = encode_sdxl(self.text_encoder, self.text_encoder_2, ids_1, ids_2)
        if self.sdxl.force_zeros:  # the empty caption's condition is zeros (diffusers')
            keep = (ids[:, :self.sdxl.text_ids] != self.null_ids).any(dim=1)  # (N,)
            embeds = embeds * keep[:, None, None].to(embeds.dtype)
            pooled = pooled * keep[:, None].to(pooled.dtype)
        return self.sdxl.pack(embeds, pooled, time_ids)

    @property
    def y_rows(self) -> int:
        """The rows of a float condition y (N, rows, D) this model reads: the text (SDXL: +
        the time-ids row). Rows after them are another part's (a ControlNet's image)."""
        return self.null_context.shape[0] + (1 if self.sdxl is not None else 0)

    def forward(self, x: Tensor, t: Tensor, y: Tensor | None = None, **extra: Any) -> Tensor:
        """The UNet's prediction; ``extra`` goes to the UNet call (a ControlNet's
        ``down_block_additional_residuals`` / ``mid_block_additional_residual``)."""
        t, kwargs = self.unet_inputs(x, t, y)
        return self.unet(x, t, **kwargs, **extra, return_dict=False)[0]

    def unet_inputs(self, x: Tensor, t: Tensor, y: Tensor | None = None
                    ) -> tuple[Tensor, dict[str, Any]]:
        """The UNet call's timesteps (N,) and condition keywords (``encoder_hidden_states``,
        SDXL's ``added_cond_kwargs``) for ``model(x, t, y)``: what a ControlNet is called
        with too."""
        n = x.shape[0]
        if y is not None and not y.is_floating_point():
            y = self.encode(y)
        if y is None:  # the null condition (SDXL: + the zero time-ids slot, own size)
            if self.text_encoder is not None:
                ids = self.null_ids.expand(n, -1)
                if self.sdxl is not None:
                    ids = torch.cat([ids, ids.new_zeros(n, TIME_IDS)], dim=1)
                y = self.encode(ids)
            else:
                y = self.null_context.expand(n, -1, -1)
                if self.sdxl is not None:
                    y = torch.cat([y, y.new_zeros(n, 1, y.shape[2])], dim=1)
        if y.ndim != 3 or y.shape[0] != n or y.shape[2] != self.context_dim:
            raise ValueError(f"the UNet expects a text context (N={n}, L, {self.context_dim}), "
                             f"got {tuple(y.shape)}")
        t = t.expand(n) if t.ndim == 0 else t
        if self.sdxl is None:
            return t, {"encoder_hidden_states": y}
        embeds, pooled, time_ids = self.sdxl.unpack(y)
        time_ids = self.sdxl.fill_time_ids(time_ids, x.shape[-2] * self.down,
                                           x.shape[-1] * self.down)
        cond = {"text_embeds": pooled.to(embeds.dtype), "time_ids": time_ids}
        return t, {"encoder_hidden_states": embeds, "added_cond_kwargs": cond}


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
        raise ValueError(f"adapter.targets {list(patterns)} match no Linear/Conv2d layer of "
                         f"the UNet; e.g. {attn or names[:4]} (SD LoRA usually targets "
                         "'*.to_q', '*.to_k', '*.to_v', '*.to_out.0')")
    return out


TEXT_ENCODER_TARGETS = ("*.q_proj", "*.k_proj", "*.v_proj", "*.out_proj")  # CLIP attention


def add_lora(unet: nn.Module, *, rank: int, alpha: float | None, dropout: float,
             targets: tuple[str, ...]) -> list[str]:
    """Freeze ``unet`` (or a text encoder) and add a peft LoRA (A gaussian, B zero: the model
    is unchanged at step 0) to the layers ``targets`` selects; returns their names."""
    from peft import LoraConfig, inject_adapter_in_model

    names = lora_targets(unet, targets)
    unet.requires_grad_(False)
    config = LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else rank,
                        lora_dropout=dropout, init_lora_weights="gaussian",
                        target_modules=names)
    if hasattr(unet, "set_adapters"):  # a diffusers model: its own peft integration
        unet.add_adapter(config)
    else:  # a transformers text encoder: peft's injection (what diffusers' loader uses)
        inject_adapter_in_model(config, unet, adapter_name="default")
    for p in unet.parameters():  # trainable parameters in fp32 whatever the base's dtype
        if p.requires_grad:
            p.data = p.data.float()
    return names


def lora_state_dict(unet: nn.Module) -> dict[str, Tensor]:
    """A UNet's (or text encoder's) LoRA in the diffusers format (the keys
    ``load_lora_weights`` reads)."""
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft.utils import get_peft_model_state_dict

    sd = convert_state_dict_to_diffusers(get_peft_model_state_dict(unet))
    return {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in sd.items()}


def _adapter_metadata(module: nn.Module) -> dict[str, Any] | None:
    """The LoraConfig diffusers records beside the tensors, so that its loader scales by
    our alpha / rank (without it, it assumes alpha = rank)."""
    conf = getattr(module, "peft_config", {}).get("default")
    return {"r": conf.r, "lora_alpha": conf.lora_alpha,
            "target_modules": sorted(conf.target_modules)} if conf is not None else None


def save_lora(unet: nn.Module, out: str | Path, text_encoder: nn.Module | None = None, *,
              text_encoder_2: nn.Module | None = None, format: str = "diffusers",
              kohya_name: str = "lora", metadata: dict[str, Any] | None = None) -> Path:
    """Write ``out/pytorch_lora_weights.safetensors`` (diffusers' LoRA format; with the text
    encoders' LoRA too when given: SDXL's second as ``text_encoder_2.*``, as
    ``StableDiffusionXLPipeline.save_lora_weights`` writes) and/or
    ``out/<kohya_name>.safetensors`` (kohya/A1111 format with ``metadata``, see
    lora_files.py), per ``format`` (diffusers | kohya | both), atomically: a previous file
    stays whole until the new one is complete. Returns the diffusers file's path (the kohya
    file's with format=kohya)."""
    from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline

    from .lora_files import is_sdxl

    if format not in ("diffusers", "kohya", "both"):
        raise ValueError(f"LoRA format {format!r}: use diffusers, kohya or both")
    kohya = None
    if format != "diffusers":
        kohya = save_kohya(Path(out) / f"{kohya_name}.safetensors", unet,
                           [text_encoder, text_encoder_2], metadata)
        if format == "kohya":
            return kohya

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    sd = lora_state_dict(unet)
    te = lora_state_dict(text_encoder) if text_encoder is not None else None
    te2 = lora_state_dict(text_encoder_2) if text_encoder_2 is not None else None
    bad = [k for k, v in {**sd, **(te or {}), **(te2 or {})}.items()
           if not torch.isfinite(v).all()]
    if bad:
        raise CheckpointError(f"the LoRA has non-finite weights ({bad[0]} and {len(bad) - 1} "
                              "more): not written")
    meta = {"unet_lora_adapter_metadata": _adapter_metadata(unet),
            "text_encoder_lora_adapter_metadata": (_adapter_metadata(text_encoder)
                                                   if te else None)}
    with tempfile.TemporaryDirectory(dir=out, prefix=".lora-") as tmp:
        if is_sdxl(unet):  # diffusers' own SDXL writer: unet / text_encoder / text_encoder_2
            StableDiffusionXLPipeline.save_lora_weights(
                tmp, unet_lora_layers=sd, text_encoder_lora_layers=te,
                text_encoder_2_lora_layers=te2, safe_serialization=True, **meta,
                text_encoder_2_lora_adapter_metadata=(_adapter_metadata(text_encoder_2)
                                                      if te2 else None))
        else:
            StableDiffusionPipeline.save_lora_weights(tmp, unet_lora_layers=sd,
                                                      text_encoder_lora_layers=te,
                                                      safe_serialization=True, **meta)
        with open(Path(tmp) / LORA_FILE, "rb") as f:
            os.fsync(f.fileno())
        os.replace(Path(tmp) / LORA_FILE, out / LORA_FILE)
    return out / LORA_FILE


def export_pipeline(unet: nn.Module, base: Path, out: str | Path) -> Path:
    """A full fine-tune as a diffusers folder ``out`` (``from_pretrained``-loadable): the
    trained UNet, the base's other parts copied. Written beside and swapped in whole."""
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(base, tmp, ignore=shutil.ignore_patterns("unet"))
    unet.save_pretrained(tmp / "unet", safe_serialization=True)
    old = out.with_name(f".{out.name}.old")
    if out.exists():
        os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)
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

    def sampling_context(self, state: Any):
        """Sample grids under the run's autocast: the frozen fp16/bf16 parts need it."""
        return prec.autocast(state.precision, state.device)


class PeftLoraWeights(_SDWeights):
    """A peft LoRA over a Stable Diffusion UNet: checkpoints hold the LoRA (and its EMA)
    alone, plus the base folder's path; exports write diffusers' LoRA file."""

    def __init__(self, base: Path, targets: list[str], rank: int, alpha: float) -> None:
        self.base, self.targets, self.rank, self.alpha = base, targets, rank, alpha
        self._hashes: dict[str, str] | None = None
        self._started = time.time()  # ss_training_started_at (this process's start)

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

    def info(self) -> dict[str, Any]:
        return {"kind": "lora", "via": "peft", "base": str(self.base), "rank": self.rank,
                "alpha": self.alpha, "targets": len(self.targets)}

    def export(self, state: Any, root: Path, final: bool) -> Path | None:
        model = state.ema.module if state.cfg.sample.use_ema else state.model
        cfg = state.cfg
        # a frozen text encoder in the model (shuffled captions) has no LoRA to save
        te, te2 = (t if getattr(t, "peft_config", None) else None
                   for t in (model.text_encoder, model.text_encoder_2))
        return save_lora(model.unet, root / "lora", te, text_encoder_2=te2,
                         format=cfg.adapter.lora_format, kohya_name=root.name,
                         metadata=self._kohya_metadata(state, root))

    def _kohya_metadata(self, state: Any, root: Path) -> dict[str, Any]:
        """The sd-scripts ``ss_*`` entries a run knows (A1111/ComfyUI show them)."""
        if state.cfg.adapter.lora_format == "diffusers":
            return {}
        if self._hashes is None:  # the base's UNet file read once a run
            self._hashes = base_model_hashes(self.base)
        cfg = state.cfg
        return {**self._hashes, "ss_sd_model_name": self.base.name, "ss_output_name": root.name,
                "ss_steps": state.step, "ss_max_train_steps": cfg.train.steps,
                "ss_learning_rate": cfg.optim.lr, "ss_unet_lr": cfg.optim.lr,
                "ss_text_encoder_lr": cfg.optim.lr if cfg.adapter.text_encoder else None,
                "ss_train_batch_size": cfg.train.batch_size,
                "ss_resolution": f"({cfg.data.image_size}, {cfg.data.image_size})",
                "ss_enable_bucket": cfg.data.buckets,
                "ss_mixed_precision": state.precision, "ss_seed": cfg.train.seed,
                "ss_network_dropout": cfg.adapter.dropout,
                "ss_training_started_at": self._started,
                "ss_training_comment": "trained with steadydiff"}


class FullUNetWeights(_SDWeights):
    """A full fine-tune of a Stable Diffusion UNet: checkpoints hold the whole UNet; the
    final export is a diffusers folder ``RUN/model`` (base parts + the trained UNet), or,
    for a run from a single-file checkpoint, the single file ``RUN/model.safetensors``
    (the base file with its UNet replaced)."""

    def __init__(self, base: Path) -> None:
        self.base = base

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
        if state.sharded:  # FSDP: every rank's shards gathered on rank 0's CPU, once
            model = _consolidated(model)
            if model is None:
                return None  # not rank 0: it only gave its shards
        if self.base.is_file():
            from .single_file import export_single_file

            return export_single_file(root / "model.safetensors", model.unet, None, None,
                                      base_file=self.base)
        return export_pipeline(model.unet, self.base, root / "model")


def _consolidated(model: nn.Module) -> nn.Module | None:
    """An FSDP-sharded :class:`SDDenoiser`'s UNet whole, as a plain module in rank 0's CPU
    memory (a collective: every rank calls it; None on the others)."""
    from diffusers import UNet2DConditionModel
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from ... import distributed

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                cpu_offload=True))
    if distributed.rank() != 0:
        return None
    unet = UNet2DConditionModel.from_config(model.unet.config)
    unet.load_state_dict({k[len("unet."):]: v for k, v in full.items()
                          if k.startswith("unet.")})
    return nn.ModuleDict({"unet": unet})


TEXT_ENCODERS = ("text_encoder.", "text_encoder_2.")  # SDDenoiser's text encoders' prefixes


def unet_only(model: nn.Module) -> dict[str, Tensor]:
    """``model``'s state dict without a frozen text encoder's tensors."""
    return {k: v for k, v in model.state_dict().items() if not k.startswith(TEXT_ENCODERS)}


def load_unet_only(model: nn.Module, saved: dict[str, Tensor], path: Any) -> None:
    """Load ``saved`` (:func:`unet_only`) into ``model``, whose text encoder, if any, comes
    from the base folder; any other missing or unexpected tensor is a CheckpointError."""
    try:
        missing, extra = model.load_state_dict(saved, strict=False)
    except RuntimeError as e:
        raise CheckpointError(f"{path}: weights do not match the model its config describes: "
                              f"{e}") from None
    missing = [k for k in missing if not k.startswith(TEXT_ENCODERS)]
    if missing or extra:
        raise CheckpointError(f"{path}: weights do not match the model its config describes "
                              f"(missing {missing[:2]}, unexpected {list(extra)[:2]})")


# --------------------------------------------------------------------------- media


def to_device(m: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """Move ``m``; cast only when its dtype differs (diffusers warns on every cast)."""
    m = m.to(device)
    p = next(m.parameters(), None)
    return m.to(dtype) if p is not None and p.dtype != dtype else m


class TextToImage:
    """Prompts -> text contexts, images <-> latents, for a text-conditioned run.

    Args:
        tokenizer, text_encoder: a transformers tokenizer and CLIP text model (frozen).
        vae: a diffusers AutoencoderKL (frozen) or None (pixel space).
        device: where they run. text_dtype, vae_dtype: their dtypes.
        tokenizer_2, text_encoder_2: SDXL's second tokenizer and CLIPTextModelWithProjection;
            the contexts are then SDXL's packed condition (:attr:`sdxl`, sdxl.py).
        force_zeros: SDXL's ``force_zeros_for_empty_prompt`` (the null condition is zeros).
    """

    text = True

    def __init__(self, tokenizer, text_encoder: nn.Module, vae: nn.Module | None,
                 device: torch.device, text_dtype: torch.dtype = torch.float32,
                 vae_dtype: torch.dtype = torch.float32, *, tokenizer_2=None,
                 text_encoder_2: nn.Module | None = None, force_zeros: bool = False) -> None:
        self.tokenizer = tokenizer
        self.text_encoder = to_device(text_encoder, device, text_dtype).eval().requires_grad_(False)
        self.vae = to_device(vae, device, vae_dtype).eval().requires_grad_(False) if vae else None
        self.device, self.text_dtype, self.vae_dtype = device, text_dtype, vae_dtype
        self.context_len = int(tokenizer.model_max_length)
        self.tokens = False  # True: prompts become token ids (the model encodes them)
        self.context_dim = int(text_encoder.config.hidden_size)
        self.tokenizer_2, self.text_encoder_2 = tokenizer_2, None
        self.sdxl: SDXLLayout | None = None
        self.force_zeros = False  # the null condition is zeros (SDXL), not the encoded ""
        if text_encoder_2 is not None:
            self.text_encoder_2 = to_device(text_encoder_2, device,
                                            text_dtype).eval().requires_grad_(False)
            self.context_dim += int(text_encoder_2.config.hidden_size)
            self.force_zeros = force_zeros
            self.sdxl = SDXLLayout(
                text_len=self.context_len, width=self.context_dim,
                pooled_dim=int(text_encoder_2.config.projection_dim),
                ids_len=(self.context_len, int(tokenizer_2.model_max_length)),
                force_zeros=force_zeros)
        self.latent = vae is not None
        self._other_vaes: dict[torch.dtype, nn.Module] = {}
        if vae is not None:
            self.scale = float(getattr(vae.config, "scaling_factor", 0.18215))
            self.shift = float(getattr(vae.config, "shift_factor", None) or 0.0)
            self.down = 2 ** (len(vae.config.block_out_channels) - 1)
            self.latent_channels = int(vae.config.latent_channels)

    # -- text
    def tokenize(self, prompts: list[str]) -> Tensor:
        """(B, L) long token ids, padded to the max length and truncated (as diffusers);
        SDXL: (B, L1 + L2 + 6) both tokenizers' ids and the zero time-ids slot."""
        ids = self.tokenizer(list(prompts), padding="max_length", truncation=True,
                             max_length=self.context_len, return_tensors="pt").input_ids
        if self.sdxl is None:
            return ids
        ids_2 = self.tokenizer_2(list(prompts), padding="max_length", truncation=True,
                                 max_length=self.sdxl.ids_len[1], return_tensors="pt").input_ids
        return torch.cat([ids, ids_2, torch.zeros(len(ids), TIME_IDS, dtype=ids.dtype)], dim=1)

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> Tensor:
        """(B, L, D) float32: the text encoder's last hidden state, as diffusers'
        StableDiffusionPipeline conditions the UNet; with ``tokens`` (the model trains its
        own text encoder) the (B, L) token ids it encodes itself. SDXL: the packed
        condition (B, L + R + 1, D) of ``StableDiffusionXLPipeline.encode_prompt`` with the
        zero time-ids slot (the drawn size); :meth:`text_part` is its text (what the cache
        holds: each sample's own time ids are added per item)."""
        ids = self.tokenize(prompts).to(self.device)
        if self.tokens:
            return ids
        if self.sdxl is not None:
            ids_1, ids_2, _ = self.sdxl.unpack_ids(ids)
            return self.sdxl.pack(*encode_sdxl(self.text_encoder, self.text_encoder_2, ids_1,
                                               ids_2))
        mask = None
        if getattr(self.text_encoder.config, "use_attention_mask", False):
            mask = (ids != self.tokenizer.pad_token_id).long().to(self.device)
        out = self.text_encoder(ids, attention_mask=mask)[0]
        return out.float()

    def text_part(self, y: Tensor) -> Tensor:
        """The text of a condition from :meth:`encode_prompts` or :meth:`tokenize` (SDXL:
        without the time-ids slot; else ``y`` itself)."""
        return y if self.sdxl is None else y[:, :self.sdxl.rows_of(y)]

    def null_text(self) -> Tensor:
        """(L, D) float32, the text rows of the null condition: the empty caption's
        encoding, or zeros for an SDXL pipeline with ``force_zeros_for_empty_prompt``."""
        null = self.text_part(self.encode_prompts([""]))[0].float()
        return torch.zeros_like(null) if self.force_zeros and null.is_floating_point() \
            else null

    def text_identity(self) -> str:
        """What the cached text contexts are a function of (``module_identity``): the text
        encoder and its dtype; SDXL: both encoders and the packing."""
        from ...data.cache import module_identity

        extra: dict[str, Any] = {"dtype": str(self.text_dtype)}
        if self.sdxl is not None:
            extra.update(sdxl="penultimate+pooled/1", layout=repr(self.sdxl),
                         text_encoder_2=module_identity(self.text_encoder_2))
        return module_identity(self.text_encoder, extra)

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

    def _vae_in(self, dtype: torch.dtype) -> nn.Module:
        """The VAE in another dtype (the fp32 re-encode of a latent fp16 made non-finite),
        made once, on the first sample that needs it."""
        import copy

        if dtype not in self._other_vaes:
            self._other_vaes[dtype] = to_device(copy.deepcopy(self.vae), self.device, dtype)
        return self._other_vaes[dtype]

    @torch.no_grad()
    def decode(self, z: Tensor) -> Tensor:
        """Images in [-1, 1] from latents (pixel space: the input, clamped)."""
        if self.vae is None:
            return z.clamp(-1, 1)
        x = self.vae.decode((z / self.scale + self.shift).to(self.device, self.vae_dtype)).sample
        return x.float().clamp(-1, 1)

