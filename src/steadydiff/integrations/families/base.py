"""What a model family is: the typed row of the family table (:class:`Family`), the loaded
parts of a model (:class:`Parts`), and where each piece of its condition sits in the one
tensor ``y`` the denoiser contract carries (:class:`Layout`).

A family (SD 1.x/2.x, SDXL, SD3, FLUX.1, ...) is one module of ``integrations/families/``
holding one :class:`Family` subclass: its folder layout, its encoders and how their outputs
are packed, its latent preparation, its denoiser call, its training recipe, its LoRA
targets and file names, its single-file layout and its tiny test folder. The shared
machinery (``integrations/sd/``: folder checks, single files, LoRA files, the run's setup,
the denoiser wrapper) asks the family, never "which family is this?"; the registry
(``families/__init__.py``) is the one place a family is listed, and the one place that
tells a folder, a file or a module's family.

Like diffusers' ``pipelines/<family>/`` and kohya's ``networks/lora_<family>.py``, what a
family needs lives together; unlike them, the training loop, the guard, the cache and the
file writers are shared, not copied per family.

This module and the family modules import diffusers/transformers only inside functions:
the registry costs nothing to import (``steadydiff train --help``, the dry run's header).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar

import torch
from torch import Tensor, nn

from ...config import ConfigError

__all__ = ["SDFolderError", "read_json", "load_part", "Layout", "Parts", "Family", "TextEncoder",
           "Setting"]


class SDFolderError(ConfigError):
    """A model folder or file that cannot be used as it is (exit code 2)."""


# the only libraries a model_index.json may name: diffusers imports whatever module an entry
# names (a my_module.py in the working directory ran), so anything else is refused first
INDEX_LIBRARIES = ("diffusers", "transformers")


def check_index_libraries(root: Path, index: dict[str, Any]) -> None:
    """Every ``[library, class]`` entry of ``root/model_index.json`` names diffusers or
    transformers and a class that library has (null entries are fine), checked before
    diffusers sees the folder; nothing is imported but those two libraries.

    Raises:
        SDFolderError: naming the entry and what would be valid.
    """
    import importlib

    for part, entry in index.items():
        if part.startswith("_") or not isinstance(entry, (list, tuple)):
            continue
        lib, cls = (list(entry) + [None, None])[:2]
        if lib is None and cls is None:
            continue
        if lib not in INDEX_LIBRARIES or not isinstance(cls, str) or \
                not isinstance(getattr(importlib.import_module(lib), cls, None), type):
            raise SDFolderError(
                f"{root}/model_index.json: {part!r} is {entry!r}; a component must be a class "
                f"of {' or '.join(INDEX_LIBRARIES)} (steadydiff never imports another module "
                "a model folder names: that would run its code)")


def read_json(path: Path, what: str) -> dict[str, Any]:
    """A JSON object from ``path``; a missing, unreadable or non-object file is an
    :class:`SDFolderError` that says what the file is for (``what``)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SDFolderError(f"{path} is missing: {what}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise SDFolderError(f"{path} cannot be read ({e}): {what}") from None
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise SDFolderError(f"{path} is not valid JSON ({e.msg} at line {e.lineno}, column "
                            f"{e.colno}): {what}") from None
    if not isinstance(d, dict):
        raise SDFolderError(f"{path} holds a JSON {type(d).__name__}, expected an object: "
                            f"{what}")
    return d


def load_part(what: str, fn: Callable[..., Any], sub: Path, **kw: Any) -> Any:
    """``fn(sub, local_files_only=True, **kw)`` (a ``from_pretrained``): nothing is
    downloaded; a transformers class gets ``trust_remote_code=False`` (a folder's
    ``auto_map`` Python is never run, and transformers never asks on stdin whether to); a
    failure (a damaged safetensors file included) is an :class:`SDFolderError` naming the
    folder and the part."""
    if getattr(fn, "__module__", "").startswith("transformers") or \
            getattr(getattr(fn, "__self__", None), "__module__", "").startswith("transformers"):
        kw.setdefault("trust_remote_code", False)
    try:
        return fn(sub, local_files_only=True, **kw)
    except Exception as e:  # noqa: BLE001 - OSError, ValueError, SafetensorError, ...
        raise SDFolderError(f"{sub}: the {what} does not load: {type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else ''}") from None


# --------------------------------------------------------------------------- the recipe


@dataclass(frozen=True)
class Setting:
    """One value of a family's training recipe (a config key's value).

    Attributes:
        value: the key's value.
        source: where it comes from (the folder's file and field, or the trainers whose
            default it is), printed at start.
        default: False: a property of the folder (the scheduler the model was trained
            with), always applied; True: the family's trainers' default (the timestep
            density, the loss weighting), applied only when the user did not set the key.
    """

    value: Any
    source: str
    default: bool = False


# --------------------------------------------------------------------------- the condition


@dataclass(frozen=True)
class Layout:
    """Where each part of a family's text condition sits in ``y``.

    Every sampler, the guidance null condition, the cache and the guard take the condition
    as one tensor, so a family's pieces travel packed and the denoiser unpacks them::

        y (N, L + R + E, D)   rows 0..L-1 the hidden states (the context), the next
                              R = ceil(P / D) rows the pooled embedding (zero-padded to
                              R * D; R = 0 without one), then E = 1 row whose first
                              ``extra_ids`` columns hold per-sample ids (SDXL's six
                              size/crop ids; E = 0 without them)

    and, when text encoders run in the step (trained, or shuffled captions), token ids:

        y (N, L1 + L2 + ... + extra_ids) int64   each tokenizer's ids, then the ids.

    A family with neither pooled embedding nor ids (SD 1.x/2.x) has ``y`` = the hidden
    states (N, L, D) themselves.

    Attributes:
        text_len: L, the context's length. width: D, its width.
        pooled_dim: P (0: none). extra_ids: per-sample ids after the text (0: none).
        ids_len: each tokenizer's length (token-id conditions).
        force_zeros: the null condition's text is zeros (SDXL's
            ``force_zeros_for_empty_prompt``), not the encoded empty caption.
        pad_ids: each tokenizer's pad id (an encoder that takes an attention mask).
    """

    text_len: int
    width: int
    pooled_dim: int = 0
    extra_ids: int = 0
    ids_len: tuple[int, ...] = ()
    force_zeros: bool = False
    pad_ids: tuple[int | None, ...] = ()

    @property
    def pooled_rows(self) -> int:
        return math.ceil(self.pooled_dim / self.width) if self.pooled_dim else 0

    @property
    def text_rows(self) -> int:
        """Rows of y that hold text (hidden states + pooled): what the null condition
        replaces."""
        return self.text_len + self.pooled_rows

    @property
    def rows(self) -> int:
        return self.text_rows + (1 if self.extra_ids else 0)

    @property
    def text_ids(self) -> int:
        return sum(self.ids_len)

    def pack(self, embeds: Tensor, pooled: Tensor | None = None,
             ids: Tensor | None = None) -> Tensor:
        """(N, L, D)[, (N, P)][, (N, extra_ids)] -> y (N, rows, D) float32 (ids None: the
        zero slot)."""
        if not self.pooled_rows and not self.extra_ids:
            return embeds.float()
        n, d = embeds.shape[0], self.width
        tail = self.rows - self.text_len
        rows = torch.zeros(n, tail * d, dtype=torch.float32, device=embeds.device)
        if self.pooled_dim:
            rows[:, :self.pooled_dim] = pooled.float()
        if ids is not None and self.extra_ids:
            at = self.pooled_rows * d
            rows[:, at:at + self.extra_ids] = ids.float()
        return torch.cat([embeds.float(), rows.view(n, tail, d)], dim=1)

    def unpack(self, y: Tensor) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """y (N, rows, D) -> hidden states (N, L, D), pooled (N, P) or None, ids
        (N, extra_ids) or None."""
        n = y.shape[0]
        pooled = (y[:, self.text_len:self.text_rows].reshape(n, -1)[:, :self.pooled_dim]
                  if self.pooled_dim else None)
        ids = y[:, -1, :self.extra_ids] if self.extra_ids else None
        return y[:, :self.text_len], pooled, ids

    def split_ids(self, y: Tensor) -> tuple[list[Tensor], Tensor | None]:
        """y (N, L1 + L2 + ... + extra_ids) int64 -> each tokenizer's ids, the extra ids or
        None."""
        out, at = [], 0
        for n in self.ids_len:
            out.append(y[:, at:at + n])
            at += n
        return out, (y[:, at:] if self.extra_ids else None)

    def rows_of(self, y: Tensor) -> int:
        """How many leading entries of the condition ``y`` are text (float or token ids)."""
        return self.text_rows if y.is_floating_point() else self.text_ids

    def with_null_text(self, null: Tensor, y: Tensor) -> Tensor:
        """``y`` with its text replaced by ``null`` (N, text rows[, D]), its per-sample ids
        kept (diffusers' ``negative_add_time_ids = add_time_ids``)."""
        return torch.cat([null, y[:, null.shape[1]:]], dim=1) if y.shape[1] > null.shape[1] \
            else null

    def empty(self, null: Tensor) -> Tensor:
        """The null condition ``null`` (N, text rows[, D]) with zero slots for the ids (the
        sample's own size where the family fills them in)."""
        extra = (self.rows - self.text_rows) if null.is_floating_point() else self.extra_ids
        if not extra:
            return null
        return torch.cat([null, null.new_zeros(null.shape[0], extra, *null.shape[2:])], dim=1)


# --------------------------------------------------------------------------- parts


@dataclass(frozen=True)
class TextEncoder:
    """One of a family's text encoders, as its pipeline names it.

    Attributes:
        part: the pipeline's component name (``text_encoder``, ``text_encoder_2``, ...).
        tokenizer: its tokenizer's component name.
        classes: the transformers classes that may fill it.
        lora: whether the family's trainers train a LoRA on it (``adapter.text_encoder``).
        kohya: its prefix in kohya's LoRA files (``lora_te_``, ``lora_te1_`` ...).
        fp16: whether it may run in fp16; False (T5, whose activations overflow fp16):
            bf16, or fp32 where bf16 is not available, when the frozen parts are fp16.
    """

    part: str
    tokenizer: str
    classes: tuple[str, ...]
    lora: bool = True
    kohya: str = "lora_te_"
    fp16: bool = True


@dataclass
class Parts:
    """The loaded parts of a model (frozen ones in eval mode), fp32 on the CPU.

    ``root`` is the folder or the single file they came from; ``family`` its
    :class:`Family`; ``denoiser`` the UNet or transformer; ``tokenizers`` and
    ``text_encoders`` in the family's order (:attr:`Family.text`); ``force_zeros`` the
    pipeline's ``force_zeros_for_empty_prompt``. The pipeline's own component names
    (``parts.unet``, ``parts.transformer``, ``parts.text_encoder_2``, ``parts.tokenizer``)
    read the same objects.
    """

    root: Path
    family: "Family"
    denoiser: Any
    vae: Any
    tokenizers: list[Any] = field(default_factory=list)
    text_encoders: list[Any] = field(default_factory=list)
    force_zeros: bool = False

    def __getattr__(self, name: str) -> Any:
        fam = self.__dict__.get("family")
        if fam is None:
            raise AttributeError(name)
        if name == fam.denoiser:
            return self.denoiser
        for i, te in enumerate(fam.text):
            if name == te.part:
                return self.text_encoders[i] if i < len(self.text_encoders) else None
            if name == te.tokenizer:
                return self.tokenizers[i] if i < len(self.tokenizers) else None
        raise AttributeError(f"{fam.name} parts have no {name!r}")


# --------------------------------------------------------------------------- the family


class Family:
    """One model family: the row of the family table (``families/__init__.py`` lists
    them). Class attributes are the table's data; methods are what differs in code.

    Subclasses set the data and override what their family does differently; the
    defaults here are a UNet with one CLIP text encoder, conditioned on its last hidden
    state (SD 1.x/2.x), which steadydiff's own text-conditioned models share.
    """

    #: short name (``sd``, ``sdxl``, ``sd3``, ``flux``): config values, file metadata
    name: ClassVar[str] = ""
    #: the family as users name it ("Stable Diffusion 1.x/2.x", "SDXL", "FLUX.1")
    label: ClassVar[str] = ""
    #: what the start line calls the trained network ("SDXL UNet", "FLUX.1 transformer")
    title: ClassVar[str] = ""
    #: model_index.json ``_class_name`` values of this family's folders
    pipelines: ClassVar[tuple[str, ...]] = ()
    #: the folder's parts and the classes model_index.json may name for each
    parts: ClassVar[dict[str, tuple[str, ...]]] = {}
    #: the shipped LoRA config a user of the family starts from (the tiny kit names it)
    example_config: ClassVar[str] = "configs/sd_lora.yaml"
    #: the trained network's component name (``unet`` | ``transformer``) and its word
    denoiser: ClassVar[str] = "unet"
    denoiser_word: ClassVar[str] = "UNet"
    #: the diffusers class of the denoiser
    denoiser_class: ClassVar[str] = "UNet2DConditionModel"
    #: the text encoders, in the order their outputs are packed
    text: ClassVar[tuple[TextEncoder, ...]] = ()
    #: honour the VAE config's ``force_upcast`` (run the VAE in fp32 under fp16)
    vae_force_upcast: ClassVar[bool] = False
    #: kohya's ``ss_base_model_version`` and the modelspec architecture of LoRA files
    kohya_version: ClassVar[str] = ""
    modelspec: ClassVar[str] = ""
    #: kohya's prefix for the denoiser's LoRA layers, and its network module's name
    kohya_denoiser: ClassVar[str] = "lora_unet_"
    kohya_module: ClassVar[str] = "networks.lora"
    #: the LoRA layers' key style in the diffusers file: "diffusers" (``.lora.down``, the
    #: UNet loaders' legacy names) or "peft" (``.lora_A``, the transformer loaders')
    diffusers_lora_keys: ClassVar[str] = "diffusers"
    #: the LyCORIS variants (sd/lycoris.py) the family's diffusers LoRA loader reads
    diffusers_lycoris: ClassVar[tuple[str, ...]] = ()

    # ------------------------------------------------------------------ the folder

    def check_index(self, root: Path, index: dict[str, Any]) -> None:
        """Refuse what model_index.json says this family cannot train (beyond the parts
        table, which the shared folder check applies)."""

    def check_config(self, root: Path, part: str, conf: dict[str, Any]) -> None:
        """Refuse a part's config.json that does not fit the family."""

    def describe(self, root: Path, model: Any) -> list[str]:
        """The family's recipe values that are no config key (the start line prints them
        with the config's): the VAE's shift and scaling factors, T5's length, the
        guidance embedding, the latent packing."""
        vae = read_json(root / "vae" / "config.json", "the VAE's configuration")
        out = [f"VAE scaling_factor {vae.get('scaling_factor', 0.18215)}"]
        if vae.get("shift_factor"):
            out.append(f"shift_factor {vae['shift_factor']}")
        return out

    def force_zeros(self, index: dict[str, Any]) -> bool:
        """Whether the pipeline's null condition is zeros (``force_zeros_for_empty_prompt``
        in model_index.json), not the encoded empty caption."""
        return False

    def recipe(self, root: Path) -> dict[str, Setting]:
        """The family's training recipe for the folder ``root``: config keys -> their
        :class:`Setting` (the scheduler config's objective, timesteps, schedule or shift;
        the trainers' defaults). Printed at start, saved in the run's config."""
        raise NotImplementedError

    def load(self, root: Path, denoiser: bool = True) -> Parts:
        """Every part of the (checked) diffusers folder ``root``, fp32 on the CPU, each
        through its class's ``from_pretrained`` (local files, safetensors only): the
        denoiser (unless ``denoiser`` is false: a single file brings it), the VAE, and each
        text encoder (the class model_index.json names) with its tokenizer."""
        import diffusers
        import transformers

        index = read_json(root / "model_index.json", "the pipeline's index")
        den = None
        if denoiser:
            den = load_part(self.title, getattr(diffusers, self.denoiser_class).from_pretrained,
                            root / self.denoiser, use_safetensors=True)
        vae = load_part("VAE", diffusers.AutoencoderKL.from_pretrained, root / "vae",
                        use_safetensors=True).eval()
        toks, tes = [], []
        for i, te in enumerate(self.text):
            what = "text encoder" if i == 0 else f"text encoder {i + 1} ({te.part})"
            toks.append(load_part("tokenizer", transformers.AutoTokenizer.from_pretrained,
                                  root / te.tokenizer))
            cls = getattr(transformers, index[te.part][1])
            tes.append(load_part(what, cls.from_pretrained, root / te.part,
                                 use_safetensors=True).eval())
        return Parts(root, self, den, vae, toks, tes, force_zeros=self.force_zeros(index))

    def load_single_file(self, f: Path, root: Path) -> Parts:
        """The parts of the single file ``f``, with the configs of the folder ``root``."""
        raise NotImplementedError

    #: the parts a single file of this family holds (the rest, with weights, comes from
    #: model.single_file_config); None: every part (the original SD checkpoints)
    single_file_parts: ClassVar[tuple[str, ...] | None] = None

    def single_file_keys(self) -> tuple[str, ...]:
        """Key prefixes one of which a single file of this family has (checked before
        loading, so a file of another kind is named as such)."""
        return ()

    def single_file_prefix(self, keys: list[str]) -> str:
        """The prefix of the denoiser's keys in a single file with ``keys`` (every key under
        it is the denoiser's; "": the file is the denoiser alone)."""
        return "model.diffusion_model."

    def file_reader(self, f: Path, config: Any, shapes: dict[str, tuple[int, ...]]) -> Any:
        """``read(name, start, stop)`` of the denoiser's tensors (diffusers names) from the
        single file ``f``, row slices read alone (the FSDP meta-device init of a
        single-file base: flowmatch.transformer_file_reader); None where the family's
        files are not read that way (its single files are then loaded whole)."""
        return None

    def original_state_dict(self, denoiser: nn.Module, vae: nn.Module | None,
                            text_encoders: list[nn.Module | None],
                            prefix: str | None = None) -> dict[str, Tensor]:
        """The parts in the original single-file layout (A1111/ComfyUI's); ``prefix``: the
        denoiser's key prefix where the family's files vary (None: its makers' own)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ geometry

    def denoiser_multiple(self, conf: dict[str, Any]) -> int:
        """What a latent side must be a multiple of, from the denoiser's config (a UNet:
        2 ** (levels - 1); a patchified transformer: its patch size)."""
        return 2 ** (len(conf["block_out_channels"]) - 1)

    def latent_shape(self, conf: Any, vae_conf: Any) -> tuple[int, int]:
        """(latent channels, native latent side) from the denoiser's and the VAE's
        configs."""
        side = conf.sample_size
        return int(conf.in_channels), int(side if isinstance(side, int) else side[0])

    def max_sequence_length(self, conf: Any) -> int | None:
        """T5's length for this denoiser (its config: FLUX.1 dev or schnell), None for a
        family without T5; ``model.max_sequence_length`` overrides it."""
        return None

    def build_denoiser(self, conf: dict[str, Any]) -> nn.Module:
        """The denoiser from its config (call on the meta device to count parameters)."""
        import diffusers

        return getattr(diffusers, self.denoiser_class).from_config(conf)

    def owns(self, module: nn.Module) -> bool:
        """Whether ``module`` is this family's denoiser (lora_files, given a bare UNet or
        transformer, asks the registry which family names its layers)."""
        return type(module).__name__ == self.denoiser_class

    # ------------------------------------------------------------------ text

    def layout(self, tokenizers: list[Any], encoders: list[nn.Module], force_zeros: bool,
               max_sequence_length: int | None = None) -> Layout:
        """Where the encoders' outputs sit in ``y`` (``max_sequence_length``: T5's length,
        ``model.max_sequence_length``; None: the family's pipeline's)."""
        te, tok = encoders[0], tokenizers[0]
        return Layout(text_len=int(tok.model_max_length), width=int(te.config.hidden_size),
                      ids_len=(int(tok.model_max_length),), pad_ids=(tok.pad_token_id,))

    def encode(self, encoders: list[nn.Module], ids: list[Tensor],
               layout: Layout) -> tuple[Tensor, Tensor | None]:
        """Token ids -> (hidden states (N, L, D), pooled (N, P) or None), as the family's
        pipeline's ``encode_prompt``. Default: the one encoder's last hidden state (SD
        1.x/2.x), with the attention mask where its config asks for one."""
        te = encoders[0]
        mask = None
        if getattr(te.config, "use_attention_mask", False):
            mask = (ids[0] != layout.pad_ids[0]).long().to(ids[0].device)
        return te(ids[0], attention_mask=mask)[0], None

    def identity(self, layout: Layout) -> dict[str, Any]:
        """What the cached text embeddings depend on beyond the encoders' weights (the
        packing)."""
        return {}

    def item_ids(self, dataset: Any, image_size: int, center_crop: bool) -> Tensor | None:
        """(N, extra_ids) per-item ids that ride with each item's condition (SDXL's
        size/crop ids), or None."""
        return None

    # ------------------------------------------------------------------ the denoiser

    def condition(self, x: Tensor, y: Tensor, layout: Layout, down: int) -> dict[str, Any]:
        """The denoiser call's condition keywords for latents ``x`` under the packed
        condition ``y`` (``encoder_hidden_states``, and what else the family's denoiser
        takes): what a ControlNet beside it is called with too. ``down``: the VAE's
        downsampling."""
        return {"encoder_hidden_states": y}

    def call(self, denoiser: nn.Module, x: Tensor, t: Tensor, y: Tensor, layout: Layout,
             down: int, guidance: float | None = None, **extra: Any) -> Tensor:
        """The denoiser's output for latents ``x`` (N, C, H, W) at steadydiff's timestep
        ``t`` (N,) under the packed condition ``y``. ``down``: the VAE's downsampling;
        ``guidance``: a guidance-distilled transformer's embedded guidance (FLUX.1 dev);
        ``extra`` goes to the call (a ControlNet's residuals)."""
        return denoiser(x, t, **self.condition(x, y, layout, down), **extra,
                        return_dict=False)[0]

    #: the key layout of a single-file ControlNet A1111 and ComfyUI load for this family:
    #: ``original`` (lllyasviel's ``control_model.*``, SD 1.x/2.x) or ``diffusers``;
    #: None: steadydiff trains no ControlNet for the family yet
    controlnet_file_layout: ClassVar[str | None] = None
    #: the diffusers class of the family's ControlNet
    controlnet_class: ClassVar[str] = "ControlNetModel"
    #: whether the ControlNet reads the conditioning image as VAE latents (the transformer
    #: families': diffusers' SD3/FLUX ControlNet pipelines encode it), not as pixels (the
    #: UNet ControlNets' own conditioning embedding)
    controlnet_latent: ClassVar[bool] = False

    def build_controlnet(self, denoiser: nn.Module, down: int, conditioning_channels: int,
                         layers: tuple[int | None, int | None]) -> nn.Module:
        """A new ControlNet for ``denoiser`` initialised from it (diffusers' ``from_unet`` /
        ``from_transformer``), its zero-initialised layers at zero. ``layers``: the
        ``controlnet.num_layers`` / ``num_single_layers`` (None: the family's trainers'
        default; the UNet ControlNet copies the whole encoder and takes neither)."""
        from diffusers import ControlNetModel

        from ..controlnet import embedding_widths

        if any(n is not None for n in layers):
            raise ValueError(f"a {self.label} ControlNet copies the UNet's whole encoder: "
                             "controlnet.num_layers / num_single_layers apply to the SD3 "
                             "and FLUX.1 ControlNets; remove them")
        return ControlNetModel.from_unet(denoiser, conditioning_channels=conditioning_channels,
                                         conditioning_embedding_out_channels=
                                         embedding_widths(down))

    def controlnet_residuals(self, controlnet: nn.Module, x: Tensor, t: Tensor, y: Tensor,
                             layout: Layout, down: int, cond: Tensor, scale: float,
                             guidance: float | None = None) -> dict[str, Any]:
        """The ControlNet's residuals for the denoiser call (the keywords :meth:`call`
        passes on) at latents ``x``, the denoiser's timestep ``t``, the packed condition
        ``y`` and the conditioning ``cond`` (pixels in [0, 1], or VAE latents where
        :attr:`controlnet_latent`), times ``scale``. Default: a UNet ControlNet, called
        with the denoiser's condition keywords."""
        res, mid = controlnet(x, t, controlnet_cond=cond.to(x.dtype), conditioning_scale=scale,
                              return_dict=False, **self.condition(x, y, layout, down))
        return {"down_block_additional_residuals": res, "mid_block_additional_residual": mid}

    def controlnet_input(self, controlnet: nn.Module, latents: Tensor, shift: float,
                         scale: float) -> Tensor:
        """What a latent-reading ControlNet takes for the conditioning image's VAE latents
        (``(mean - shift) * scale``, the shift and scale of the family's VAE)."""
        return latents

    def prepare_attention(self, denoiser: nn.Module) -> None:
        """Give the denoiser's attention layers the processor that follows their
        ``upcast_attention`` attribute (the guard's per-layer fp16 remedy). Default: a
        UNet's, q kᵀ in fp32 (attention.UpcastAware)."""
        from .attention import UpcastAware

        denoiser.set_attn_processor(UpcastAware())

    # ------------------------------------------------------------------ LoRA files

    def base_version(self, denoiser: nn.Module) -> str:
        """kohya's ``ss_base_model_version`` of a LoRA over ``denoiser``."""
        return self.kohya_version

    def kohya_entries(self, config: Any) -> list[Any] | None:
        """The original modules kohya's names follow when they fuse diffusers' modules
        (a transformer's ``qkv``: sd/original.py entries), or None: one kohya layer per
        LoRA layer at :meth:`kohya_path`."""
        return None

    def kohya_path(self, path: str, config: Any) -> str:
        """The module path kohya's names use for the denoiser's module ``path`` (SD 1.x:
        diffusers' own; SDXL: the original UNet's)."""
        return path

    # ------------------------------------------------------------------ the tiny folder

    def tiny(self, path: Path, *, image_size: int = 32, seed: int = 0, **kw: Any) -> Path:
        """Write a tiny folder of this family's layout (random weights) at ``path``."""
        raise NotImplementedError
