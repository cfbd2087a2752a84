"""ControlNet (Zhang, Rao & Agrawala 2023): a trainable copy of a Stable Diffusion UNet's
encoder that reads a conditioning image (edges, depth, pose) and adds its features to the
frozen UNet's skip connections through zero-initialised convolutions, so training starts
from the unchanged model.

Shared machinery beside the model families (integrations/families): it needs from the
base denoiser (``SDDenoiser``) only its inputs (``_inputs``: timesteps and the packed
condition), ``y_rows`` (how many rows of y are the base's), ``layout``, ``down`` (the VAE's
downsampling), ``guidance`` and guidance's ``null_condition``; from the family
(integrations/families) what is family-specific: ``controlnet_class`` and
``build_controlnet`` (diffusers' ``ControlNetModel.from_unet`` for SD 1.x/2.x and SDXL,
``SD3ControlNetModel`` / ``FluxControlNetModel.from_transformer`` for SD3 and FLUX.1),
``controlnet_latent`` and ``controlnet_input`` (the transformer ControlNets read the
conditioning image as VAE latents, FLUX's packed 2x2, as diffusers' pipelines encode it),
``controlnet_residuals`` (the ControlNet's call and the keywords its residuals reach the
denoiser by) and ``controlnet_file_layout`` (which key layout its single file has).

The condition y of a training step carries the conditioning image after the base's rows
(``data/cache.py`` ``append_rows``: C*H*W values in [0, 1] as rows of the context width,
zero-padded), so the samplers, the guard's drops and reruns, the loss and the checkpoint see
one tensor as everywhere else. At sampling the image is given once (:meth:`ControlNetDenoiser
.control`) with the scale and the fraction of steps it acts on (diffusers'
``controlnet_conditioning_scale``, ``control_guidance_start``/``end``), and guidance's
unconditional half sees the same image, as diffusers' pipeline (``guess_mode=False``).

Files: the diffusers ControlNet folder (``RUN/controlnet/``: config.json +
diffusion_pytorch_model.safetensors; ``ControlNetModel.from_pretrained`` loads it) and one
single file in the layout A1111 and ComfyUI load for the base family (``RUN/controlnet/
<run>.safetensors``): SD 1.x/2.x the original ``control_model.*`` layout of lllyasviel's
ControlNet releases (diffusers' ``ControlNetModel.from_single_file`` reads it back); SDXL,
SD3 and FLUX.1 the diffusers key layout in one file, as their ControlNets are distributed and
ComfyUI's loader recognises them (SD3: ``pos_embed_input``; FLUX.1: InstantX's
``controlnet_x_embedder``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..trainer.checkpoint import Checkpoint, CheckpointError, save_tensors_atomic
from .sd.model import _SDWeights

log = logging.getLogger(__name__)

__all__ = ["ControlNetDenoiser", "ControlLatents", "ControlNetWeights", "ControlWindow",
           "build_controlnet",
           "validation_images",
           "load_controlnet", "controlnet_keep", "original_state_dict", "save_controlnet",
           "export_controlnet", "load_control_image", "CONTROLNET_DIR"]

CONTROLNET_DIR = "controlnet"  # RUN/controlnet/: the diffusers folder and the single file
# the conditioning embedding's widths for an 8x VAE (diffusers' and the paper's default);
# a VAE of another factor gets as many as it halves (a tiny test model's 2x: the first two)
EMBEDDING_WIDTHS = (16, 32, 96, 256)


def embedding_widths(down: int) -> tuple[int, ...]:
    """``conditioning_embedding_out_channels`` for a VAE that downsamples by ``down``: the
    embedding must bring the image to the latent's size (one stride-2 stage per halving)."""
    k = int(round(math.log2(down)))
    if 2 ** k != down or not 0 <= k <= 3:
        raise ValueError(f"a ControlNet's conditioning embedding halves 0-3 times; the VAE "
                         f"downsamples by {down}")
    return EMBEDDING_WIDTHS[:k + 1] if k < 3 else EMBEDDING_WIDTHS


def build_controlnet(unet: nn.Module, down: int, *, init_from: str | Path | None = None,
                     conditioning_channels: int = 3, family: Any = None,
                     layers: tuple[int | None, int | None] = (None, None)) -> nn.Module:
    """A ControlNet for the denoiser ``unet`` of ``family`` (None: a UNet family's): the
    family's ``build_controlnet`` (``ControlNetModel.from_unet``, ``SD3ControlNetModel`` /
    ``FluxControlNetModel.from_transformer``: the weights copied, the zero-initialised
    layers zero), or a local ControlNet (:func:`load_controlnet`) whose shape must fit the
    denoiser.

    Raises:
        ValueError: a local ControlNet of another class or architecture (naming what
            differs); layer counts the family's ControlNet does not take.
    """
    if family is None:
        from .families.base import Family

        family = Family()
    if init_from is None:
        return family.build_controlnet(unet, down, conditioning_channels, layers)
    if any(n is not None for n in layers):
        raise ValueError(f"controlnet.init_from={init_from} has its own layers: remove "
                         "controlnet.num_layers / num_single_layers")
    net = load_controlnet(init_from, family.controlnet_class)
    mine = unet.config
    for key in ("block_out_channels", "cross_attention_dim", "in_channels",
                "layers_per_block", "addition_embed_type", "attention_head_dim",
                "num_attention_heads", "joint_attention_dim", "pooled_projection_dim",
                "patch_size", "qk_norm"):
        a, b = net.config.get(key), mine.get(key)
        if a is not None and b is not None and list(a if isinstance(a, (list, tuple))
                                                    else [a]) != list(
                b if isinstance(b, (list, tuple)) else [b]):
            raise ValueError(f"controlnet.init_from={init_from}: its {key} is {a}, the base "
                             f"{family.denoiser_word}'s {b}: a ControlNet for another model")
    return net


def load_controlnet(path: str | Path, cls: str = "ControlNetModel") -> nn.Module:
    """A local ControlNet of the diffusers class ``cls`` (``ControlNetModel``,
    ``SD3ControlNetModel``, ``FluxControlNetModel``): a diffusers folder (config.json +
    weights), or a single .safetensors (diffusers layout; a UNet ControlNet's also the
    original ``control_model.*``) with a config.json beside it. Only safetensors are read
    (nothing unpickled); nothing is downloaded.

    Raises:
        ValueError: not such a folder or file (naming what is missing), or a ControlNet of
            another class (its config's ``_class_name``).
    """
    import diffusers

    p = Path(path).expanduser()
    conf = (p if p.is_dir() else p.parent) / "config.json"
    if conf.is_file():
        try:
            named = json.loads(conf.read_text()).get("_class_name")
        except (OSError, ValueError, AttributeError):
            named = None
        if named and named != cls:
            raise ValueError(f"{conf} describes a {named}; this model's ControlNet is a {cls}")
    model = getattr(diffusers, cls)
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ValueError(f"{p} is not a diffusers ControlNet folder: no config.json")
        return model.from_pretrained(p, local_files_only=True, use_safetensors=True)
    if p.suffix != ".safetensors" or not p.is_file():
        raise ValueError(f"{p}: expected a diffusers ControlNet folder or a .safetensors "
                         "file (other formats are not read: they may run code)")
    if not conf.is_file():
        raise ValueError(f"{p}: a single-file ControlNet needs its config: a config.json "
                         f"of the same architecture beside it ({conf})")
    if cls == "ControlNetModel":
        try:
            return model.from_single_file(str(p), config=str(p.parent),
                                          local_files_only=True)
        except Exception as e:  # a damaged file (SafetensorError), a config of another model
            raise ValueError(f"{p}: cannot be loaded as a ControlNet ({type(e).__name__}: "
                             f"{str(e).strip().splitlines()[0] if str(e).strip() else ''})"
                             ) from None
    # the transformer ControlNets' single file is the diffusers key layout: the config's
    # model, its tensors loaded strictly (a missing or unexpected key is named)
    from safetensors.torch import load_file

    net = model.from_config(model.load_config(p.parent, local_files_only=True))
    try:
        net.load_state_dict(load_file(str(p)), strict=True)
    except Exception as e:  # a damaged file, a missing or unexpected key
        raise ValueError(f"{p}: not a {cls} of {conf}'s architecture "
                         f"({str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__})") from None
    return net


# --------------------------------------------------------------------------- the denoiser


@dataclass
class ControlWindow:
    """The control of one sampling call: the image (N0, C, H, W) in [0, 1], its scale, and
    the steps it acts on: step i of the timesteps ``ts`` keeps the control when
    ``i / len(ts) >= start`` and ``(i + 1) / len(ts) <= end`` (diffusers' ``controlnet_keep``)."""

    image: Tensor
    scale: float = 1.0
    start: float = 0.0
    end: float = 1.0
    ts: Tensor | None = None


def controlnet_keep(i: int, n: int, start: float, end: float) -> float:
    """1.0 when step ``i`` of ``n`` is inside [start, end], else 0.0 (diffusers')."""
    return 1.0 - float(i / n < start or (i + 1) / n > end)


@dataclass(frozen=True)
class ControlLatents:
    """The frozen VAE a latent-reading ControlNet's conditioning image goes through:
    ``encode`` (images in [-1, 1] -> the posterior mean, ``(mean - shift) * scale``:
    ``TextToImage.encode_images``), and the VAE's ``shift`` and ``scale``. Shared, never
    copied (the EMA's deepcopy of the model keeps the one VAE) nor saved."""

    encode: Callable[[Tensor], Tensor]
    shift: float
    scale: float

    def __deepcopy__(self, memo: dict[int, Any]) -> "ControlLatents":
        return self


class ControlNetDenoiser(nn.Module):
    """``model(x, t, y)`` over a frozen base denoiser and a trainable ControlNet.

    Args:
        base: the base family's denoiser (``SDDenoiser``: UNet, text conditioning).
        controlnet: a diffusers ``ControlNetModel`` for its UNet.
        channels: the conditioning image's channels.

    y is the base's condition followed by the conditioning image's rows (training), or the
    base's alone inside :meth:`control` (sampling).
    """

    num_classes = 0

    def __init__(self, base: nn.Module, controlnet: nn.Module, channels: int = 3,
                 vae: "ControlLatents | None" = None) -> None:
        super().__init__()
        self.base = base
        self.controlnet = controlnet
        self.channels = channels
        # a latent-reading ControlNet (the family's controlnet_latent): the frozen VAE
        self._vae = vae
        self._window: ControlWindow | None = None

    def __getattr__(self, name: str) -> Any:
        """What the trainer, the samplers and guidance read from a text denoiser
        (``context_dim``, ``null_context``, ``layout``, ``encode``, ``unet``, ...) is the
        base's."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "base":
                raise
            return getattr(self.base, name)

    def enable_gradient_checkpointing(self) -> str:
        self.controlnet.enable_gradient_checkpointing()
        return (self.base.enable_gradient_checkpointing()
                + "; the ControlNet's blocks (diffusers) too")

    def null_condition(self, y: Tensor) -> Tensor:
        """Guidance's null condition: the base's null text, the same control image."""
        rows = self.base.y_rows
        return torch.cat([self.base.null_condition(y[:, :rows]), y[:, rows:]], dim=1)

    def split(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        """y -> (the base's condition, the conditioning image (N, C, H, W)), H and W the
        latent's x the VAE's downsampling.

        Raises:
            ValueError: y holds no (or another size of) conditioning image.
        """
        n, rows = x.shape[0], self.base.y_rows
        h, w = x.shape[-2] * self.down, x.shape[-1] * self.down
        need = self.channels * h * w
        flat = y[:, rows:].reshape(n, -1)
        if flat.shape[1] < need or flat.shape[1] - need >= y.shape[-1]:
            raise ValueError(f"the condition holds {flat.shape[1]} values after the text, "
                             f"not a {self.channels}x{h}x{w} conditioning image (a "
                             f"{x.shape[-2]}x{x.shape[-1]} latent's): each image needs its "
                             f"conditioning image of its own size")
        return y[:, :rows], flat[:, :need].reshape(n, self.channels, h, w)

    def _scale(self, t: Tensor) -> float:
        """The control's scale at timestep t inside :meth:`control` (one host read per
        model call, at sampling only)."""
        win = self._window
        if win is None:
            return 1.0
        if win.ts is None or (win.start <= 0 and win.end >= 1):
            return win.scale
        tv = float(t.reshape(-1)[0])
        hits = (win.ts.to(torch.float64) - tv).abs().argmin()
        return win.scale * controlnet_keep(int(hits), len(win.ts), win.start, win.end)

    def forward(self, x: Tensor, t: Tensor, y: Tensor | None = None) -> Tensor:
        n = x.shape[0]
        win = self._window
        if win is not None:  # sampling: the image given once, repeated over guidance's rows
            cond = win.image.to(x.device, x.dtype)
            cond = cond.repeat(-(-n // cond.shape[0]), 1, 1, 1)[:n]
            rest = y
            scale = self._scale(t)
        else:
            if y is None:
                raise ValueError("a ControlNet step needs its conditioning image in y")
            rest, cond = self.split(x, y)
            scale = 1.0
        if scale == 0.0:
            return self.base(x, t, rest)
        base = self.base
        fam = base.family
        if fam.controlnet_latent:  # the image through the frozen VAE, as the pipelines
            if self._vae is None:
                raise ValueError(f"a {fam.label} ControlNet reads VAE latents: build the "
                                 "ControlNetDenoiser with the VAE (ControlLatents)")
            v = self._vae
            with torch.no_grad():
                z = v.encode(cond.float() * 2 - 1).to(x.device)
            cond = fam.controlnet_input(self.controlnet, z, v.shift, v.scale)
        t_in, y_in = base._inputs(x, t, rest)
        extra = fam.controlnet_residuals(self.controlnet, x, t_in, y_in, base.layout,
                                         base.down, cond, scale, guidance=base.guidance)
        return base(x, t, rest, **extra)

    @contextlib.contextmanager
    def control(self, image: Tensor, scale: float = 1.0, start: float = 0.0,
                end: float = 1.0, ts: Tensor | None = None) -> Iterator[None]:
        """Sample with the conditioning ``image`` (N, C, H, W) in [0, 1] (one per sample, or
        one for all): every call inside sees it at ``scale``, on the steps of ``ts`` (the
        sampler's timesteps) between the fractions ``start`` and ``end``."""
        old = self._window
        self._window = ControlWindow(image, scale, start, end,
                                     ts.detach().cpu() if ts is not None else None)
        try:
            yield
        finally:
            self._window = old


def load_control_image(path: str | Path, width: int, height: int, channels: int = 3
                       ) -> Tensor:
    """A conditioning image file as (1, C, height, width) float in [0, 1], resized as
    diffusers' ``VaeImageProcessor`` (no normalisation) does: Pillow, Lanczos, to the size.

    Raises:
        ValueError: the file cannot be read (naming it).
    """
    import numpy as np
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as im:
            im = im.convert("RGB" if channels == 3 else "L")
            im = im.resize((width, height), Image.Resampling.LANCZOS)
            a = np.asarray(im, dtype=np.float32) / 255.0
    except (OSError, UnidentifiedImageError, ValueError) as e:
        raise ValueError(f"control image {path}: cannot be read ({e})") from None
    x = torch.from_numpy(a.copy())
    x = x.unsqueeze(0) if x.ndim == 2 else x.permute(2, 0, 1)
    return x.unsqueeze(0)


def validation_images(cfg: Any, data: Any, prompts: Sequence[Any]) -> list[Tensor]:
    """Each validation prompt's conditioning image (C, height, width) in [0, 1]:
    ``controlnet.control_images`` cycled over the prompts, else the conditioning image of
    dataset item j for prompt j (the prompts are then the first items' captions, or
    ``sample.prompts`` beside the first items' images), resized to the prompt's size.

    Raises:
        ConfigError: a control image that cannot be read (naming the key and the file).
    """
    from ..config import ConfigError
    from ..data.pairs import conditioning_of

    c = cfg.controlnet
    out = []
    for j, p in enumerate(prompts):
        if c.control_images:
            f = c.control_images[j % len(c.control_images)]
            try:
                out.append(load_control_image(f, p.width, p.height,
                                              c.conditioning_channels)[0])
            except ValueError as e:
                raise ConfigError(f"controlnet.control_images.{j % len(c.control_images)}: "
                                  f"{e}") from None
            continue
        img = conditioning_of(data, j % len(data)).float()
        if tuple(img.shape[-2:]) != (p.height, p.width):
            img = torch.nn.functional.interpolate(img[None], size=(p.height, p.width),
                                                  mode="bilinear", antialias=True,
                                                  align_corners=False)[0].clamp(0, 1)
        out.append(img)
    return out


# --------------------------------------------------------------------------- files


def _finite(sd: dict[str, Tensor]) -> None:
    bad = [k for k, v in sd.items() if v.is_floating_point() and not torch.isfinite(v).all()]
    if bad:
        raise CheckpointError(f"the ControlNet has non-finite weights ({bad[0]} and "
                              f"{len(bad) - 1} more): not written")


def _block_map(config: dict[str, Any]) -> list[tuple[str, str]]:
    """(diffusers prefix, original prefix) of the ControlNet's encoder, the original UNet's
    input_blocks numbering (as ``convert_controlnet_checkpoint`` reads it back)."""
    layers = int(config["layers_per_block"])
    n_levels = len(config["block_out_channels"])
    out = [("conv_in.", "input_blocks.0.0.")]
    k = 1
    for b in range(n_levels):
        for j in range(layers):
            out.append((f"down_blocks.{b}.resnets.{j}.", f"input_blocks.{k}.0."))
            out.append((f"down_blocks.{b}.attentions.{j}.", f"input_blocks.{k}.1."))
            k += 1
        if b < n_levels - 1:
            out.append((f"down_blocks.{b}.downsamplers.0.conv.", f"input_blocks.{k}.0.op."))
            k += 1
    for i in range(k):
        out.append((f"controlnet_down_blocks.{i}.", f"zero_convs.{i}.0."))
    out += [("mid_block.resnets.0.", "middle_block.0."), ("mid_block.attentions.0.",
                                                          "middle_block.1."),
            ("mid_block.resnets.1.", "middle_block.2."), ("controlnet_mid_block.",
                                                          "middle_block_out.0."),
            ("time_embedding.linear_1.", "time_embed.0."),
            ("time_embedding.linear_2.", "time_embed.2."),
            ("add_embedding.linear_1.", "label_emb.0.0."),
            ("add_embedding.linear_2.", "label_emb.0.2."),
            ("class_embedding.linear_1.", "label_emb.0.0."),
            ("class_embedding.linear_2.", "label_emb.0.2."),
            ("controlnet_cond_embedding.conv_in.", "input_hint_block.0.")]
    n_emb = 2 * (len(config["conditioning_embedding_out_channels"]) - 1)
    for i in range(n_emb):
        out.append((f"controlnet_cond_embedding.blocks.{i}.", f"input_hint_block.{2 * (i + 1)}."))
    out.append(("controlnet_cond_embedding.conv_out.", f"input_hint_block.{2 * (n_emb + 1)}."))
    return out


# inside a resnet / a transformer: diffusers -> original names (the inverse of diffusers'
# update_unet_resnet_ldm_to_diffusers / update_unet_attention_ldm_to_diffusers)
_RESNET = (("norm1.", "in_layers.0."), ("conv1.", "in_layers.2."),
           ("time_emb_proj.", "emb_layers.1."), ("norm2.", "out_layers.0."),
           ("conv2.", "out_layers.3."), ("conv_shortcut.", "skip_connection."))


def original_state_dict(state: dict[str, Tensor], config: dict[str, Any]) -> dict[str, Tensor]:
    """A diffusers ControlNet's tensors in the original layout (``control_model.`` +
    ``input_blocks``/``zero_convs``/``input_hint_block``/``middle_block_out``...), what
    A1111 and ComfyUI load for SD 1.x/2.x.

    Raises:
        ValueError: a tensor the mapping does not place (a ControlNet of a layout this
            writer does not know; nothing is written).
    """
    prefixes = sorted(_block_map(config), key=lambda p: -len(p[0]))
    out: dict[str, Tensor] = {}
    for k, v in state.items():
        for new, old in prefixes:
            if k.startswith(new):
                rest = k[len(new):]
                if new.split(".")[0] in ("down_blocks", "mid_block") and ".resnets." in new:
                    for a, b in _RESNET:
                        if rest.startswith(a):
                            rest = b + rest[len(a):]
                            break
                out["control_model." + old + rest] = v
                break
        else:
            raise ValueError(f"the ControlNet tensor {k!r} has no place in the original "
                             f"layout: write the diffusers folder only")
    if len(out) != len(state):
        raise ValueError("two ControlNet tensors map to one original name")
    return out


def save_controlnet(controlnet: nn.Module, out: str | Path, *, single_file: str | None,
                    original: bool) -> Path:
    """Write ``out/`` as a diffusers ControlNet folder (``from_pretrained`` loads it) and,
    given ``single_file`` (a file name), that file in the original layout (``original``:
    SD 1.x/2.x) or diffusers' keys (SDXL), each replaced atomically; refused whole when a
    weight is non-finite. Returns the folder."""
    out = Path(out)
    state = {k: v.detach().to("cpu", torch.float32).contiguous()
             for k, v in controlnet.state_dict().items()}
    _finite(state)
    out.mkdir(parents=True, exist_ok=True)
    config = dict(controlnet.config)
    weights = out / "diffusion_pytorch_model.safetensors"
    save_tensors_atomic(weights, state, metadata={"format": "pt"})
    tmp = out / ".config.json.tmp"
    tmp.write_text(json.dumps({"_class_name": type(controlnet).__name__,
                               **{k: (list(v) if isinstance(v, tuple) else v)
                                  for k, v in config.items() if not k.startswith("_")}},
                              indent=2, sort_keys=True))
    tmp.replace(out / "config.json")
    if single_file:
        sd = original_state_dict(state, config) if original else state
        save_tensors_atomic(out / single_file, sd, metadata={
            "format": "pt", "modelspec.architecture": "controlnet",
            "steadydiff.layout": "original" if original else "diffusers"})
    return out


def export_controlnet(controlnet: nn.Module, run_root: Path, name: str, family: Any) -> Path:
    """``RUN/controlnet/`` (:func:`save_controlnet`) with ``<name>.safetensors`` in the
    layout A1111/ComfyUI load for ``family`` (its ``controlnet_file_layout``)."""
    return save_controlnet(controlnet, run_root / CONTROLNET_DIR,
                           single_file=f"{name}.safetensors",
                           original=family.controlnet_file_layout == "original")


# --------------------------------------------------------------------------- weights


class ControlNetWeights(_SDWeights):
    """What a ControlNet run trains, saves and exports: the ControlNet's tensors (and
    their EMA); the base UNet, text encoders and VAE stay frozen and out of checkpoints."""

    prefix = "controlnet."

    def __init__(self, base: Path, init_from: str | None, family: Any,
                 recipe: dict[str, Any] | None = None) -> None:
        self.base, self.init_from, self.family, self.recipe = base, init_from, family, recipe

    def _own(self, model: nn.Module) -> dict[str, Tensor]:
        return {n: p for n, p in model.named_parameters() if n.startswith(self.prefix)}

    def tensors(self, state: Any) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        ema = self._own(state.ema.module)
        return ({n: p.detach() for n, p in self._own(state.model).items()},
                {n: p.detach() for n, p in ema.items()})

    def restore(self, state: Any, c: Checkpoint) -> None:
        for what, m, saved in (("model", state.model, c.model),
                               ("EMA", state.ema.module, c.ema)):
            own = self._own(m)
            missing, extra = sorted(set(own) - set(saved)), sorted(set(saved) - set(own))
            if missing or extra:
                raise CheckpointError(
                    f"{c.path}: its ControlNet {what} tensors do not match this run's "
                    f"ControlNet (missing {missing[:2]}, unexpected {extra[:2]}): "
                    "model.pretrained or controlnet.init_from changed since it was written")
            with torch.no_grad():
                for n, p in own.items():
                    p.copy_(saved[n])

    def info(self) -> dict[str, Any]:
        return {"kind": "controlnet", "via": "diffusers", "base": str(self.base),
                "family": self.family.name, "init_from": self.init_from,
                "conditioning": self.recipe}

    def export(self, state: Any, root: Path, final: bool) -> Path | None:
        model = state.ema.module if state.cfg.sample.use_ema else state.model
        return export_controlnet(model.controlnet, root, root.name, self.family)


def controlnet_module_names(model: nn.Module) -> Sequence[str]:
    """The ControlNet's zero-initialised output layers (a UNet ControlNet's
    ``controlnet_down_blocks``/``controlnet_mid_block``; SD3's and FLUX.1's
    ``controlnet_blocks``/``controlnet_single_blocks``): what provenance names when their
    output explodes."""
    return [n for n, _ in model.named_modules()
            if re.search(r"controlnet\.(controlnet_down_blocks\.\d+|controlnet_mid_block|"
                         r"controlnet_blocks\.\d+|controlnet_single_blocks\.\d+)$", n)]
