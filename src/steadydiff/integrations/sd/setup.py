"""A text-to-image run's setup: what ``build_state`` and the loop call for a config with
``model.pretrained`` (a model family's folder or single file: integrations/families/) or
``model.text_encoder`` (steadydiff's own UNet/DiT with cross-attention, optionally in a
VAE's latent space).

:func:`build` loads the frozen parts in their dtypes and returns the denoiser, the weights'
owner (a peft LoRA, or the full denoiser) and the media (prompts -> conditions, latents <->
images). :func:`encode_data` turns the captioned dataset into what the model trains on:
latents and text contexts, cached (data/cache.py) and checked finite; the samples whose
latent stays non-finite are left out and named.
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import torch
from torch import nn

from ...config import Config, ConfigError
from ...data.cache import (EncodedDataset, TextResult, encode_conditioning, encode_latents,
                           encode_texts, module_identity)
from ...data import DataError, source_of
from ...data.kohya import KohyaDataset, Repeated
from ...data.captions import CaptionVariants, overflow_message, token_overflow
from ...guard.findings import SampleQuarantined
from ...guard.provenance import is_attention
from ...models import build_model
from ...trainer import precision as prec
from ...trainer.hooks import FULL_WEIGHTS, Weights
from ..controlnet import (ControlLatents, ControlNetDenoiser, ControlNetWeights,
                          build_controlnet)
from .. import families
from ..families import Family
from .identity import check_base
from .hypernetwork import HypernetworkWeights, add_hypernetwork
from .frozen import BaseModelError, FrozenWatch, check_loaded, check_module
from .source import family, load_parts, model_root
from .folder import load_text_parts, load_vae, read_json
from .model import (LOCON_TARGETS, TEXT_ENCODER_TARGETS, FullUNetWeights, PeftLoraWeights,
                    SDDenoiser,
                    TextToImage, Tokenize, add_lora, load_unet_only, to_device,
                    upcast_aware_attention)

log = logging.getLogger(__name__)

__all__ = ["apply_lora", "build", "encode_data", "is_text_config", "model_geometry", "model_root",
           "record_quarantine", "unet_parameters", "load_trained"]


def _check_lycoris_layout(den: nn.Module, text_encoders: list[nn.Module | None],
                          variant: str) -> None:
    """A LoHa/LoKr whose layers the LyCORIS file cannot hold (one layer per original module:
    a family whose kohya names fuse diffusers' q/k/v) is refused before training."""
    from .lora_files import LoraFileError, kohya_layers

    tes = [te if getattr(te, "peft_config", None) else None for te in text_encoders]
    try:
        fused = [k for k in kohya_layers(den, tes).values() if len(k.layers) > 1]
    except LoraFileError as e:
        raise ConfigError(str(e)) from None
    if fused:
        raise ConfigError(f"adapter.variant={variant}: its LyCORIS file has one layer per "
                          f"original module, and {fused[0].name} fuses {fused[0].paths} "
                          f"(and {len(fused) - 1} more): a {variant} cannot be split across "
                          "them. Leave them out of adapter.targets, write adapter.lora_format"
                          "=diffusers where diffusers reads the variant, or use "
                          "adapter.variant=lora")


def is_text_config(cfg: Config) -> bool:
    """Whether ``cfg`` trains a text-conditioned model (SD, or ours with a text encoder)."""
    return bool(cfg.model.pretrained or cfg.model.text_encoder)


def _dtype(p: str) -> torch.dtype:
    return prec.DTYPES[p]


def _json(path: Path) -> dict[str, Any]:
    return read_json(path, "a model configuration")


def model_geometry(cfg: Config) -> dict[str, int]:
    """What the denoiser sees, read from the folders' configs without loading weights:
    channels and side of its input (latents or pixels), the context width and length.

    Raises:
        ConfigError: data.image_size does not fit the VAE's downsampling or the UNet's.
    """
    m, size = cfg.model, cfg.data.image_size
    fam = None
    if m.pretrained:
        root = model_root(m)
        fam = family(m)
        vae = _json(root / "vae" / "config.json")
        unet = _json(root / fam.denoiser / "config.json")
        te = _json(root / fam.text[0].part / "config.json")
        tok = root / fam.text[0].tokenizer
    else:
        t = Path(m.text_encoder).expanduser()
        te = _json(t / "text_encoder" / "config.json") if (t / "text_encoder").is_dir() \
            else None
        if te is None:
            load_text_parts(t)  # raises, naming what is missing
        tok = t / "tokenizer"
        vae = None
        if m.vae:
            v = Path(m.vae).expanduser()
            vae = _json(v / "vae" / "config.json" if (v / "vae" / "config.json").is_file()
                        else v / "config.json")
        unet = None
    tcfg = _json(tok / "tokenizer_config.json") if (tok / "tokenizer_config.json").is_file() \
        else {}
    length = int(tcfg.get("model_max_length") or te.get("max_position_embeddings", 77))
    length = min(length, int(te.get("max_position_embeddings", length)))
    down = 2 ** (len(vae["block_out_channels"]) - 1) if vae else 1
    if size % down:
        raise ConfigError(f"data.image_size={size} is not a multiple of the VAE's "
                          f"downsampling ({down}): use e.g. {max(down, size // down * down)}")
    side = size // down
    if unet is not None:
        levels = fam.denoiser_multiple(unet)
        if side % levels:
            raise ConfigError(f"data.image_size={size} gives {side}x{side} latents, not a "
                              f"multiple of the {fam.denoiser_word}'s downsampling ({levels}): "
                              f"use a multiple of {down * levels}")
    if cfg.data.buckets:  # every bucket side is a multiple of the step
        need = down * (fam.denoiser_multiple(unet) if unet is not None else 1)
        if cfg.data.bucket_step % need:
            raise ConfigError(f"data.bucket_step={cfg.data.bucket_step} is not a multiple of "
                              f"the model's downsampling ({need}: VAE x "
                              f"{fam.denoiser_word if fam else 'UNet'}): bucket sides must be; "
                              f"use data.bucket_step="
                              f"{max(need, cfg.data.bucket_step // need * need)}")
    return {"channels": int(vae["latent_channels"]) if vae else cfg.data.channels,
            "side": side, "context_dim": int(te["hidden_size"]), "context_len": length}


def unet_parameters(root: str | Path) -> int:
    """The parameter count of a model folder's denoiser (UNet or transformer), built from
    its config on the meta device (no weights read)."""
    from .folder import family_of

    fam = family_of(root)
    conf = _json(Path(root) / fam.denoiser / "config.json")
    with torch.device("meta"):
        den = fam.build_denoiser(conf)
    return sum(p.numel() for p in den.parameters())


def text_dtypes(fam: Family, frozen: torch.dtype, device: torch.device,
                chosen: torch.dtype | None = None) -> list[torch.dtype]:
    """Each text encoder's dtype: ``chosen`` (``model.text_encoder_precision``) when set,
    else the frozen parts', except an fp16-unsafe encoder (T5, ``TextEncoder.fp16`` false)
    under fp16, which runs in bf16 where the device has it, else fp32 (T5's activations
    overflow fp16 on real prompts)."""
    if chosen is not None:
        return [chosen] * len(fam.text)
    out = []
    for spec in fam.text:
        dtype = frozen
        if frozen == torch.float16 and not spec.fp16:
            dtype = torch.bfloat16 if prec.native_support("bf16", device) else torch.float32
            log.info(f"{spec.part} ({spec.classes[0]}) runs in {dtype} (not fp16: it overflows "
                     "fp16)")
        out.append(dtype)
    return out


def build(cfg: Config, device: torch.device) -> tuple[nn.Module, Weights, TextToImage]:
    """The denoiser, the owner of its trained weights, and the media of a text run.

    Frozen parts run in ``train.precision`` (the VAE in ``model.vae_precision`` when set);
    trainable parameters are fp32 (a LoRA over an fp16 base included).
    """
    m, a = cfg.model, cfg.adapter
    frozen = _dtype(cfg.train.precision)
    vae_dtype = _dtype(m.vae_precision) if m.vae_precision else frozen
    if m.pretrained:
        # FSDP full fine-tune: the denoiser is built on the meta device (no storage) and
        # each rank reads only its shards, after sharding (meta_denoiser), from the folder
        # or from a single file the family reads in row slices (Family.file_reader)
        meta = (cfg.train.parallel == "fsdp" and a.kind == "none"
                and not cfg.controlnet.enabled)
        single = Path(m.pretrained).is_file()
        if meta and single:
            fam = family(m)
            meta = type(fam).file_reader is not Family.file_reader
        if meta and single:
            parts = fam.load(model_root(m), denoiser=False)
            parts.root = Path(m.pretrained)
        else:
            parts = load_parts(m.pretrained, m.single_file_config, denoiser=not meta)
        fam = parts.family
        # every tensor loaded, checked finite once: a broken base is named (tensor, file)
        # here, before training, not blamed later on the data or the LR (frozen.py); a
        # meta-initialised denoiser is read shard by shard later
        for note in check_loaded(parts, config_root=m.single_file_config):
            log.warning(note)
        if meta:
            parts.denoiser = meta_denoiser(fam, model_root(m))
        if fam.vae_force_upcast and not m.vae_precision and vae_dtype == torch.float16 and \
                getattr(parts.vae.config, "force_upcast", False):
            # this family's VAE overflows in fp16 (SDXL's); its config says so
            # (force_upcast) and the family's diffusers pipeline then runs it in fp32: so do
            # we, unless the user chose model.vae_precision (e.g. fp16 for the fp16-fix VAE)
            vae_dtype = torch.float32
            log.info(f"the {fam.label} VAE runs in fp32: its config has force_upcast=true "
                     "and model.vae_precision is unset")
        den = parts.denoiser
        media = TextToImage(fam, parts.tokenizers, parts.text_encoders, parts.vae, device,
                            text_dtypes(fam, frozen, device,
                                        _dtype(m.text_encoder_precision)
                                        if m.text_encoder_precision else None), vae_dtype,
                            force_zeros=parts.force_zeros,
                            max_sequence_length=(m.max_sequence_length
                                                 or fam.max_sequence_length(den.config)))
        root = Path(parts.root)
        # the fp32 fallbacks' source: the VAE and text encoders read again from the files
        media.reload = ((lambda: fam.load(root, denoiser=False)) if root.is_dir() else
                        (lambda: load_parts(m.pretrained, m.single_file_config)))
        upcast_aware_attention(den)
        if m.upcast_attention:
            for mod in den.modules():
                if is_attention(mod):
                    mod.upcast_attention = True
        weights: Weights
        in_step: list[nn.Module | None] = []  # text encoders that run in the step
        if a.kind == "lora":
            to_device(den, device, frozen)
            if m.quantize_base:  # before peft wraps the layers (it wraps int8 ones too)
                from ..quantize import quantize_base

                q = quantize_base(den, m.quantize_base, device)
                media.notes.append(
                    f"frozen {fam.denoiser_word}: {q['layers']} Linear layers stored in "
                    f"{m.quantize_base} ({q['kept']} kept in {cfg.train.precision}), "
                    f"{_size(q['bytes_before'])} -> {_size(q['bytes_after'])} "
                    "(model.quantize_base)")
            dora = a.variant == "dora"
            extra = LOCON_TARGETS if a.variant == "locon" else ()
            if extra and fam.denoiser != "unet":
                raise ConfigError(f"adapter.variant=locon adds the UNet's ResNet and sampler "
                                  f"convolutions; the {fam.label} denoiser is a transformer "
                                  "without them: use adapter.variant=lora or dora")
            try:  # the files the variant can be written in, before any training
                formats = PeftLoraWeights.formats(cfg, fam)
            except ValueError as e:
                raise ConfigError(str(e)) from None
            if a.lora_format == "both" and "diffusers" not in formats:
                media.notes.append(f"adapter.variant={a.variant}: RUN/lora/ holds LyCORIS' "
                                   f"file alone (A1111, ComfyUI, kohya's sd-scripts); "
                                   f"diffusers' {fam.label} loader reads no {a.variant}")
            targets = add_lora(den, rank=a.rank, alpha=a.alpha, dropout=a.dropout,
                               targets=tuple(a.targets) + extra, dora=dora,
                               variant=a.variant, factor=a.factor)
            if a.text_encoder:  # their LoRA trains too: the model encodes token ids itself
                # a LoRA on every encoder the family's trainers train (SDXL: both, as
                # kohya's; SD3, FLUX: the CLIPs, not T5, which runs frozen in the step)
                in_step = [te.requires_grad_(False) for te in media.text_encoders]
                for spec, te in zip(fam.text, in_step):
                    if spec.lora:
                        targets += [f"{spec.part}.{n}" for n in add_lora(
                            te, rank=a.rank, alpha=a.alpha, dropout=a.dropout,
                            targets=TEXT_ENCODER_TARGETS, dora=dora, variant=a.variant,
                            factor=a.factor)]
                media.tokens = True
            if a.variant in ("loha", "lokr") and "kohya" in formats:
                _check_lycoris_layout(den, in_step, a.variant)
            if a.init_from:  # continue a LoRA (ours, kohya's, diffusers'): rename, copy
                from .lora_files import LoraFileError, load_lora_file

                try:  # the encoders that have a LoRA, in the family's order
                    load_lora_file(a.init_from, den,
                                   [te if getattr(te, "peft_config", None) else None
                                    for te in in_step], rank=a.rank, alpha=a.alpha or a.rank)
                except LoraFileError as e:
                    raise ConfigError(f"adapter.init_from: {e}") from None
            weights = PeftLoraWeights(parts.root, targets, a.rank, a.alpha or a.rank, a)
        elif a.kind == "hypernetwork":  # A1111-style, on the cross-attention context
            to_device(den, device, frozen)
            try:
                hyper, layers = add_hypernetwork(den, targets=a.targets,
                                                 hidden_mult=a.hidden_mult,
                                                 activation=a.hyper_activation)
            except ValueError as e:
                raise ConfigError(str(e)) from None
            weights = HypernetworkWeights(a, parts.root, layers)
        elif a.kind == "embedding":  # textual inversion: only the new tokens' rows train
            from .embedding import EmbeddingWeights, add_embedding

            to_device(den, device, frozen).requires_grad_(False)
            try:
                firsts = add_embedding(media.tokenizers, media.text_encoders, token=a.token,
                                       init_token=a.init_token, num_vectors=a.num_vectors,
                                       family=fam.label)
            except ValueError as e:
                raise ConfigError(str(e)) from None
            in_step = list(media.text_encoders)  # they encode in the step, rows trained
            media.tokens = True
            media.expand = (a.token, a.num_vectors)
            weights = EmbeddingWeights(a, parts.root, firsts)
        elif cfg.controlnet.enabled:  # the UNet frozen, a ControlNet trains beside it
            if fam.controlnet_file_layout is None:
                ok = ", ".join(f.label for f in families.FAMILIES
                               if f.controlnet_file_layout is not None)
                raise ConfigError(f"controlnet.enabled: steadydiff does not train a "
                                  f"{fam.label} ControlNet yet (diffusers has no ControlNet "
                                  f"class steadydiff knows for it); it does for {ok}")
            to_device(den, device, frozen).requires_grad_(False)
            controlnet = _controlnet(cfg, den, media.down, device, fam)
            weights = ControlNetWeights(parts.root, cfg.controlnet.init_from, fam)
        else:  # a full fine-tune: the denoiser trains in fp32 under autocast
            if not meta:
                to_device(den, device, torch.float32)
            den.requires_grad_(True)
            weights = FullUNetWeights(parts.root)
            if meta and single:
                f, conf = Path(m.pretrained), den.config
                weights.meta_source = (lambda shapes: fam.file_reader(f, conf, shapes),
                                       fam.denoiser)
            elif meta:
                from functools import partial

                from .folder import part_reader

                weights.meta_source = (partial(part_reader, parts.root / fam.denoiser),
                                       fam.denoiser)
        if cfg.data.caption_shuffle and not any(te is not None for te in in_step):
            # Shuffled captions differ every epoch: encoded in the step by the frozen text
            # encoder(s) (as kohya does; caching every permutation is not possible), from
            # the token ids the data stream carries.
            in_step = [te.requires_grad_(False) for te in media.text_encoders]
            media.tokens = True
        model: nn.Module = SDDenoiser(
            den, media.layout, fam, in_step, down=media.down, guidance=m.guidance,
            shape=fam.latent_shape(den.config, parts.vae.config))
        # (a meta denoiser stays there: sharding.materialize gives it its shards' storage)
        model._apply(lambda t: t if t.is_meta else t.to(device))
        if a.kind == "hypernetwork":  # registered after the UNet: its own tensor names
            model.hypernetwork = hyper
        if model.encodes:
            model.set_null_ids(media.text_part(media.tokenize([""]))[0].to(device))
        if cfg.controlnet.enabled:
            vae = (ControlLatents(media.encode_images, media.shift, media.scale)
                   if fam.controlnet_latent else None)
            model = ControlNetDenoiser(model, controlnet, cfg.controlnet.conditioning_channels,
                                       vae)
        # the frozen weights, known by their files: a mid-run corruption is named and
        # restored from disk by the guard (guard/basewatch.py), not blamed on the LR
        weights.frozen = FrozenWatch(model, m.pretrained, m.single_file_config, fam)
    else:
        tok, te = load_text_parts(m.text_encoder)
        vae = load_vae(m.vae) if m.vae else None
        # one CLIP's last hidden state: the base family's text handling
        media = TextToImage(Family(), [tok], [te], vae, device,
                            _dtype(m.text_encoder_precision) if m.text_encoder_precision
                            else frozen, vae_dtype)
        media.reload = lambda: SimpleNamespace(
            vae=load_vae(m.vae) if m.vae else None,
            text_encoders=[load_text_parts(m.text_encoder)[1]])
        g = model_geometry(cfg)
        model = build_model(m, image_size=g["side"], channels=g["channels"],
                            context_dim=g["context_dim"], context_len=g["context_len"])
        model = model.to(device)
        weights = FULL_WEIGHTS
    with torch.no_grad():
        # the null condition's text: the empty caption encoded (SDXL's force_zeros: zeros);
        # through the model's own encoder(s) when they run in the step
        null = (model.encode(media.encode_prompts([""]).to(device))[0] if media.tokens
                else media.null_text().to(device))
        model.set_null_context(null[:model.null_context.shape[0]].float())
    return model, weights, media


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def meta_denoiser(fam: Family, root: Path) -> nn.Module:
    """The folder's denoiser built from its config on the meta device: its shape, no
    storage (no rank holds the whole model; FSDP shards it, then each rank reads its
    shards from the folder's safetensors: ``FullUNetWeights.materialize``)."""
    conf = read_json(root / fam.denoiser / "config.json", f"the {fam.denoiser}'s config")
    with torch.device("meta"):
        return fam.build_denoiser(conf).float()


def _controlnet(cfg: Config, unet: nn.Module, down: int, device: torch.device,
                fam: Family) -> nn.Module:
    """The ControlNet a run trains (fp32, the upcast-aware attention): from the base UNet,
    or ``controlnet.init_from``'s."""
    c = cfg.controlnet
    if fam.controlnet_latent and c.conditioning_channels != 3:
        raise ConfigError(f"controlnet.conditioning_channels={c.conditioning_channels}: a "
                          f"{fam.label} ControlNet reads the conditioning image through the "
                          "VAE, which takes RGB: set controlnet.conditioning_channels=3 (a "
                          "gray map is read as RGB)")
    try:
        net = build_controlnet(unet, down, init_from=c.init_from,
                               conditioning_channels=c.conditioning_channels, family=fam,
                               layers=(c.num_layers, c.num_single_layers))
    except ValueError as e:
        raise ConfigError(f"controlnet: {e}") from None
    have = int(getattr(net.config, "conditioning_channels", None) or c.conditioning_channels)
    if have != c.conditioning_channels:
        raise ConfigError(f"controlnet.init_from={c.init_from} reads {have}-channel "
                          f"conditioning images: set controlnet.conditioning_channels={have}")
    if c.init_from:  # a ControlNet to continue: its file checked finite like the base
        bad = check_module(net)
        if bad:
            raise BaseModelError(f"controlnet.init_from={c.init_from}: controlnet.{bad[0][0]} "
                                 f"has {bad[0][1]}: the file is damaged; download or copy "
                                 "it again")
    fam.prepare_attention(net)  # the guard's per-layer fp16 remedy, as in the UNet
    return to_device(net, device, torch.float32).requires_grad_(True)


def load_trained(c, cfg: Config, *, use_ema: bool = True,
                 device: torch.device | None = None) -> tuple[nn.Module, TextToImage]:
    """A text-to-image checkpoint's model (its base folder + the LoRA, or the whole
    trained model) in eval mode, frozen, and its media, on ``device`` (CPU by default).

    Raises:
        CheckpointError: the checkpoint's tensors do not fit the model its config describes
            (a LoRA of other targets or rank, a base folder that changed shape).
    """
    from ...trainer.checkpoint import CheckpointError

    if cfg.model.pretrained:  # the base it was trained on, or a refusal naming both
        check_base(c.state.get("base"), cfg, f"the checkpoint {c.path}")
    device = device or torch.device("cpu")
    # the trained LoRA over the base as released (an 8-bit training base: its fp32 weights)
    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"precision": "fp32"}),
                                 "model": cfg.model.model_copy(update={"quantize_base": None}),
                                 # the checkpoint holds the LoRA (the ControlNet): its start
                                 # file is not read
                                 "adapter": cfg.adapter.model_copy(update={"init_from": None}),
                                 "controlnet": cfg.controlnet.model_copy(
                                     update={"init_from": None})})
    model, weights, media = build(cfg, device)
    saved = c.ema if use_ema else c.model
    from .embedding import EmbeddingWeights

    if isinstance(weights, (PeftLoraWeights, HypernetworkWeights, ControlNetWeights,
                            EmbeddingWeights)):
        own = {n: p for n, p in model.named_parameters() if p.requires_grad}
        if set(own) != set(saved):
            raise CheckpointError(f"{c.path}: its adapter tensors do not match the "
                                  f"{cfg.adapter.kind} its config describes over "
                                  f"{cfg.model.pretrained}")
        with torch.no_grad():
            for n, p in own.items():
                p.copy_(saved[n])
    else:
        load_unet_only(model, saved, c.path)
    return model.eval().requires_grad_(False), media


def apply_lora(model: nn.Module, media: TextToImage, path: str | Path, scale: float) -> None:
    """Fuse the LoRA file ``path`` (diffusers' or kohya's format, read by diffusers' own
    ``load_lora_weights`` on the family's pipeline) into ``model``'s denoiser and
    ``media``'s text encoders at ``scale``: the sampling copy of a run (LoRA + ControlNet
    together).

    Raises:
        ValueError: diffusers cannot load the file (its message, naming the file).
    """
    import inspect

    import diffusers

    p = Path(path).expanduser()
    if not p.exists():
        raise ValueError(f"--lora {p}: no such file or folder")
    fam = media.family
    parts: dict[str, Any] = {fam.denoiser: model.denoiser, "vae": media.vae,
                             "scheduler": diffusers.DDIMScheduler(steps_offset=1,
                                                                  clip_sample=False)}
    for spec, te, tok in zip(fam.text, media.text_encoders, media.tokenizers):
        parts[spec.part], parts[spec.tokenizer] = te, tok
    cls = getattr(diffusers, fam.pipelines[0])
    for name, prm in inspect.signature(cls.__init__).parameters.items():
        if name not in parts and name != "self" and prm.default is inspect.Parameter.empty:
            parts[name] = None  # safety_checker, feature_extractor: not ours
    if "requires_safety_checker" in inspect.signature(cls.__init__).parameters:
        parts["requires_safety_checker"] = False
    pipe = cls(**parts)
    kw = {"weight_name": p.name} if p.is_file() else {}
    try:
        pipe.load_lora_weights(str(p.parent if p.is_file() else p), **kw,
                               adapter_name="sample")
        pipe.fuse_lora(lora_scale=scale, adapter_names=["sample"])
        pipe.unload_lora_weights()  # the fused weights stay; the peft layers go
    except (ValueError, KeyError, RuntimeError, OSError) as e:
        raise ValueError(f"--lora {p}: diffusers cannot load it for this model ({e})") from None


def _prep(cfg: Config) -> str:
    d = cfg.data
    return (f"size={d.image_size},channels={d.channels},center_crop={d.center_crop},"
            f"dataset={d.dataset},pad_to={d.pad_to}")


def encode_data(media: TextToImage, data, cfg: Config, cache_dir: Path,
                say: Callable[[str], None] = print,
                stop: Callable[[], bool] | None = None) -> EncodedDataset:
    """Latents (latent-space runs) and text contexts of every item of the captioned
    ``data``, from the cache or encoded now (and cached). A latent non-finite in the VAE's
    dtype is encoded again in fp32; still non-finite, the sample is left out (the returned
    dataset's ``quarantined`` names it; :func:`record_quarantine` puts it in incidents).
    ``stop`` is asked before each item is encoded: True raises
    :class:`~steadydiff.data.cache.CachingStopped` (a stop signal; what is cached stays)."""
    captions = list(data.captions)
    fallbacks: list[Any] = []  # encoder_fallback findings, recorded by record_quarantine
    if media.expand is not None:  # textual inversion: only captions with the token train it
        token = media.expand[0]
        have = sum(token in c for c in captions)
        if not have:
            raise ConfigError(f"adapter.token={token!r} is in none of the {len(captions)} "
                              "captions, so its embedding would never train: set "
                              f"data.trigger={token!r} (put first in every caption) or write "
                              "it into the captions")
        say(f"textual inversion: {token!r} in {have} of {len(captions)} captions")
    over = caption_overflow(media, data, captions)
    if over:
        say(f"warning: {overflow_message(over, media.context_len, len(captions))}")
    if media.tokens:  # the text encoder trains: its inputs, not its outputs, are fixed
        texts = token_ids(media, captions)
        fallbacks.append(_in_step_tokens(media, data, captions, texts, say))
    else:
        # the text rows (hidden states + pooled); per-item ids (SDXL's) are added per item
        fp32 = torch.float32
        texts = encode_texts(captions, lambda p: media.text_part(media.encode_prompts(p)),
                             encoder_id=media.text_identity(), cache_dir=cache_dir,
                             fallback=((lambda p: media.encode_prompts_in(p, fp32))
                                       if any(d != fp32 for d in media.text_dtypes) else None),
                             blame=media.blame_tokens, stop=stop)
        fallbacks.append(_text_fallback(media, data, captions, texts, say))
        if media.force_zeros:  # caption dropout trains the null condition guidance uses
            texts.null = torch.zeros_like(texts.null)
    latents = None
    if not media.latent and texts is not None and getattr(texts, "bad", None):
        c, why = next(iter(texts.bad.items()))
        raise DataError(f"the text encoder's embedding of caption {c!r:.80} is {why} (pixel "
                        "space: no latent cache to leave its items out of); fix or remove "
                        "the captions, or download the text encoder again")
    if media.latent:
        vae_id = module_identity(media.vae, {"dtype": str(media.vae_dtype)})
        fallback = ((lambda x: media.encode_images(x, torch.float32))
                    if media.vae_dtype != torch.float32 else None)
        latents = encode_latents(data, media.encode_images, encoder_id=vae_id,
                                 prep=_prep(cfg),
                                 cache_dir=cache_dir if cfg.data.cache_latents else None,
                                 fallback=fallback,
                                 device=media.device, stop=stop)
        if texts is not None and getattr(texts, "bad", None):
            latents = latents.without(_text_quarantine(data, captions, texts))
        if latents.reencoded:
            fallbacks.append(_vae_fallback(media, latents, len(data), say))
        say(f"latents: {latents.hits} from the cache, {latents.misses} encoded"
            + (f", {len(latents.reencoded)} re-encoded in fp32" if latents.reencoded else "")
            + (f", {len(latents.quarantined)} left out (non-finite)"
               if latents.quarantined else "")
            + (f" ({cache_dir})" if cfg.data.cache_latents else " (in memory only)"))
    variants = CaptionVariants.from_config(  # a kohya TOML's subsets may differ
        cfg.data, cfg.train.seed,
        data.caption_settings() if isinstance(data, KohyaDataset) else None)
    # per-item ids the family conditions on (SDXL: each image's size/crop, from its crop)
    extra = media.family.item_ids(data, cfg.data.image_size, cfg.data.center_crop) \
        if media.layout.extra_ids else None
    if extra is not None:
        extra = extra.round().long() if media.tokens else extra.to(texts.contexts.dtype)
    conditioning = None
    if cfg.controlnet.enabled:  # pixels, not latents: uint8, cached (data/cache.py)
        conditioning = encode_conditioning(
            data, prep=f"{_prep(cfg)},conditioning={cfg.controlnet.conditioning_channels}",
            cache_dir=cache_dir if cfg.data.cache_latents else None, stop=stop)
        if conditioning.keys is not None:
            say(f"conditioning images: {conditioning.hits} from the cache, "
                f"{conditioning.misses} prepared"
                + (f", {len(conditioning.quarantined)} left out (undecodable)"
                   if conditioning.quarantined else "") + f" ({cache_dir})")
        else:
            say("conditioning images: read from the dataset as each item is drawn")
    out = EncodedDataset(data, latents, texts, variants=variants,
                         tokenize=Tokenize(media.tokenizers, media.layout.ids_len, media.expand),
                         extra=extra, conditioning=conditioning)
    out.caption_overflow = len(over)
    for note in media.notes:  # what build did to the model that the start should say
        say(note)
    out.fallbacks = [f for f in fallbacks if f is not None]
    if cfg.model.offload_text_encoders and not media.tokens:
        media.offload()
        say("text encoders moved to the CPU after caching (model.offload_text_encoders): "
            "validation prompts encode there")
    if out.variants is not None:
        d = cfg.data
        say("captions: " + ", ".join(
            (["tags shuffled every epoch as each subset of the dataset TOML says, encoded in "
              "the step"] if out.variants.per_source is not None and out.variants.shuffle
             else [f"tags shuffled every epoch (first {d.keep_tokens} kept), encoded in the "
                   "step"] if d.caption_shuffle else [])
            + ([f"dropped to the empty caption with p={d.caption_dropout:g}"]
               if d.caption_dropout else [])))
    if isinstance(data, KohyaDataset):  # each image encoded once; the repeats are positions
        out = Repeated(out, data.repeats, data.loss_weights)
    return out


def caption_overflow(media: TextToImage, data, captions: list[str]) -> list[tuple[str, int]]:
    """The items whose caption (trigger included) has more tokens than the first text
    encoder takes (``model_max_length``, 77 for CLIP): ``[(file, tokens)]``."""
    return _overflow(media.tokenizer, media.context_len, data, captions)


def _overflow(tokenizer, limit: int, data, captions: list[str]) -> list[tuple[str, int]]:
    def count(texts: list[str]) -> list[int]:
        # verbose=False: the tokenizer's own "longer than the maximum" warning names no file
        return [len(ids) for ids in tokenizer(texts, truncation=False, verbose=False)["input_ids"]]

    names = [source_of(data, i) or f"item {i}" for i in range(len(captions))]
    return token_overflow(captions, count, limit, names)


def caption_length_warning(cfg: Config, data) -> str | None:
    """The caption-length warning a run prints at its start (:func:`caption_overflow`), made
    from the first tokenizer alone, no weights loaded: ``train --dry-run`` makes the check
    the run makes. None when every caption fits (or the data has no captions)."""
    from transformers import AutoTokenizer

    from ..families.base import load_part

    captions = getattr(data, "captions", None)
    if not captions:
        return None
    m = cfg.model
    if m.pretrained:
        tok_dir = model_root(m) / family(m).text[0].tokenizer
    else:
        tok_dir = Path(m.text_encoder).expanduser() / "tokenizer"
    tokenizer = load_part("tokenizer", AutoTokenizer.from_pretrained, tok_dir)
    limit = model_geometry(cfg)["context_len"]
    over = _overflow(tokenizer, limit, data, list(captions))
    return overflow_message(over, limit, len(captions)) if over else None


def token_ids(media: TextToImage, captions: list[str]) -> TextResult:
    """The captions as token ids, one row per distinct caption (a text encoder that trains
    with its LoRA encodes them in the step)."""
    distinct = list(dict.fromkeys(captions))
    row = {c: i for i, c in enumerate(distinct)}
    return TextResult(contexts=media.text_part(media.tokenize(distinct)), captions=distinct,
                      caption_index=torch.tensor([row[c] for c in captions]),
                      null=media.text_part(media.tokenize([""]))[0])


def _fp32_source(media: TextToImage) -> str:
    return ("the weights on disk, read again in fp32" if media.reload is not None
            else media.fallback_source)


def _text_fallback(media: TextToImage, data, captions: list[str], texts: Any,
                   say: Callable[[str], None]) -> Any:
    """Say what the text fallback did (captions re-encoded in fp32, captions still
    non-finite and their items left out, the tokens to blame) and return its
    ``encoder_fallback`` finding (None when there was nothing to do)."""
    from ...guard.findings import EncoderFallback

    redo, bad = list(getattr(texts, "reencoded", [])), dict(getattr(texts, "bad", {}))
    if not redo and not bad:
        return None
    dtype = str(media.text_dtype).removeprefix("torch.")
    items = [i for i, c in enumerate(captions) if c in bad]
    tokens = sorted({t for c in list(bad) + redo for t in _tokens_of(media.blame_tokens(c))})
    msg = (f"text: {len(redo) + len(bad)} caption(s) had a non-finite embedding in {dtype}; "
           f"encoded again in fp32 from {_fp32_source(media)}: {len(redo)} finite (kept)"
           + (f", {len(bad)} still non-finite: their {len(items)} item(s) left out "
              f"(quarantined)" if bad else "")
           + (f"; to blame: {', '.join(tokens[:5])}" if tokens else "")
           + ". Set model.text_encoder_precision=fp32 to encode in fp32 from the start")
    log.warning(msg)
    say(f"warning: {msg}")
    return EncoderFallback.new(
        part="text_encoder", dtype=dtype, count=len(redo) + len(bad), total=len(set(captions)),
        key="model.text_encoder_precision",
        sources=[source_of(data, i) or f"item {i}" for i in items],
        why="the embedding overflowed or a token's embedding row is broken",
        quarantined=len(items), tokens=tokens or None)


def _in_step_tokens(media: TextToImage, data, captions: list[str], texts: Any,
                    say: Callable[[str], None]) -> Any:
    """Text encoders that run in the step (shuffled captions, a text-encoder LoRA): their
    token-embedding rows that are non-finite in the run's dtype. Finite on disk in fp32 (a
    row beyond fp16's range): that encoder runs in fp32 from now on (its rows copied from
    disk). Non-finite on disk too: the items whose captions use them are left out
    (``texts.bad``; quarantined by the caller) naming the token, before any step."""
    from ...guard.findings import EncoderFallback
    from .frozen import nonfinite_token_rows

    fp32, moved, dead = torch.float32, [], {}
    for i, (te, tok) in enumerate(zip(media.text_encoders, media.tokenizers)):
        rows = nonfinite_token_rows(te)
        if not rows:
            continue
        disk = media._from_disk()
        src = disk.text_encoders[i] if disk is not None else None
        on_disk = set(nonfinite_token_rows(src)) if src is not None else set(rows)
        if set(rows) - on_disk and src is not None:  # fp16 made them inf: run in fp32
            emb = te.get_input_embeddings()
            te.to(fp32)
            with torch.no_grad():
                emb.weight.copy_(src.get_input_embeddings().weight.to(emb.weight.device))
            media.text_dtypes[i] = fp32
            moved.append(f"text encoder {i + 1}")
        for j in on_disk & set(rows):
            dead[j] = f"token {tok.convert_ids_to_tokens(j)!r} (id {j}) of text encoder {i + 1}"
    media.text_dtype = media.text_dtypes[0]
    if not moved and not dead:
        return None
    bad_caps = {}
    if dead:
        ids = Tokenize(media.tokenizers, media.layout.ids_len)
        for c in dict.fromkeys(captions):
            hit = [dead[j] for j in dict.fromkeys(ids([c])[0].tolist()) if j in dead]
            if hit:
                bad_caps[c] = ("a token's embedding row is non-finite in the text encoder "
                               "(on disk too): " + ", ".join(hit))
        texts.bad.update(bad_caps)
    items = [i for i, c in enumerate(captions) if c in bad_caps]
    msg = ("text (encoded in the step): "
           + (f"{', '.join(moved)} run(s) in fp32 (token-embedding rows beyond fp16's "
              "range, finite on disk)" if moved else "")
           + ("; " if moved and dead else "")
           + (f"{len(items)} item(s) left out: their captions use " + ", ".join(sorted(
               set(dead.values()))[:5]) + " (non-finite on disk: download the text encoder "
              "again)" if dead else "")
           + ". Set model.text_encoder_precision=fp32 to run the text encoders in fp32")
    log.warning(msg)
    say(f"warning: {msg}")
    return EncoderFallback.new(
        part="text_encoder", dtype="float16" if moved else str(media.text_dtype)
        .removeprefix("torch."), count=len(moved) + len(bad_caps), total=len(set(captions)),
        key="model.text_encoder_precision",
        sources=[source_of(data, i) or f"item {i}" for i in items],
        why="token-embedding rows non-finite in the run's dtype", quarantined=len(items),
        tokens=sorted(set(dead.values())) or None)


def _tokens_of(blame: str) -> list[str]:
    head = "the token(s) to blame: "
    return blame[len(head):].split(", ") if blame.startswith(head) else []


def _text_quarantine(data, captions: list[str], texts: Any) -> dict[int, dict[str, Any]]:
    """The items whose caption's embedding stayed non-finite: quarantine records."""
    return {i: {"index": i, "source": source_of(data, i),
                "why": f"caption {c!r:.60}: {texts.bad[c]}"}
            for i, c in enumerate(captions) if c in texts.bad}


def _vae_fallback(media: TextToImage, latents: Any, total: int,
                  say: Callable[[str], None]) -> Any:
    """Say that latents were re-encoded in fp32 (why, how many, from what, the key to set)
    and return the ``encoder_fallback`` finding."""
    from ...guard.findings import EncoderFallback

    dtype = str(media.vae_dtype).removeprefix("torch.")
    n, q = len(latents.reencoded), len(latents.quarantined)
    msg = (f"latents: {n} of {total} image(s) gave a non-finite latent in {dtype} (the VAE "
           f"overflows {dtype}); encoded again in fp32 from {_fp32_source(media)}"
           + (f"; {q} still non-finite, left out" if q else "")
           + ". Set model.vae_precision=fp32 to encode in fp32 from the start")
    log.warning(msg)
    say(f"warning: {msg}")
    return EncoderFallback.new(
        part="vae", dtype=dtype, count=n, total=total, key="model.vae_precision",
        sources=[r.get("source") or f"item {r.get('index')}" for r in latents.reencoded],
        why=f"the VAE's {dtype} encode overflowed", quarantined=q)


def record_quarantine(guard, encoded: EncodedDataset) -> None:
    """One ``encoder_fallback`` incident per frozen encoder that fell back to fp32 and one
    ``sample_quarantined`` incident per sample whose latent (or caption's embedding)
    stayed non-finite."""
    if guard is None:
        return
    for f in getattr(encoded, "fallbacks", []):
        guard.record(f, "reencode", cost={"items_reencoded": f.evidence["count"]})
    for i, q in sorted(getattr(encoded, "quarantined", {}).items()):
        guard.record(SampleQuarantined.new(index=int(i), times=1, steps=[0],
                                           source=q.get("source"), why=q.get("why")),
                     "quarantine")
