"""What the rectified-flow transformer families (SD3/SD3.5, FLUX.1) share: the recipe read
from a ``FlowMatchEulerDiscreteScheduler`` config, the T5 encoder's handling, and the
upcast-aware attention processor for their joint attention. Not a family itself.

The recipe (:func:`flow_recipe`): the folder's scheduler decides the objective (rectified
flow, Liu et al. 2022; the network predicts ε - x0), the number of training timesteps (the
network's time scale: t = σ·1000) and the shift of the noise levels: static (``shift``,
SD3 paper eq. 23) or dynamic from the image's token count (``use_dynamic_shifting``: FLUX's
``base_shift``..``max_shift`` over ``base_image_seq_len``..``max_image_seq_len``). The
timestep density and the loss weighting are the family's trainers' defaults, kept when the
user sets their own.

T5 (Raffel et al. 2020) overflows in fp16 on real prompts (its feed-forward activations
exceed 65504; transformers keeps ``wo`` in fp32 for that reason, diffusers' and kohya's
trainers run T5 in bf16/fp32): a family lists it with ``fp16=False`` and steadydiff runs it
in bf16 (fp32 where bf16 is not available) when the frozen parts are fp16, and outside any
fp16 autocast of the training step (:func:`encoder_autocast_off`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from .attention import UpcastJointAttention, autocast_off
from .base import SDFolderError, Setting, read_json

__all__ = ["SCHEDULER", "flow_recipe", "vae_down", "encoder_autocast_off", "prepare_joint_attention",
           "transformer_prefix", "load_transformer_file", "transformer_state"]

SCHEDULER = ("FlowMatchEulerDiscreteScheduler",)

# scheduler options that change the noise levels in ways steadydiff's flow sampler does not
# reproduce: refused by name rather than sampled differently from the pipeline
_REFUSED = {"invert_sigmas": False, "shift_terminal": None, "use_karras_sigmas": False,
            "use_exponential_sigmas": False, "use_beta_sigmas": False,
            "time_shift_type": "exponential", "stochastic_sampling": False}


def trainer_defaults(trainers: str) -> dict[str, Setting]:
    """What the flow-matching LoRA trainers (diffusers' SD3, FLUX.1, Z-Image scripts) set
    alike: logit-normal timesteps (mean 0, std 1) and no loss weighting; ``trainers`` names
    them in the start line."""
    return {
        "diffusion.timestep_sampling": Setting("logit_normal", trainers, default=True),
        "diffusion.logit_mean": Setting(0.0, trainers, default=True),
        "diffusion.logit_std": Setting(1.0, trainers, default=True),
        "diffusion.loss_weighting": Setting("uniform", trainers + ": weighting none",
                                            default=True),
    }


def flow_recipe(root: Path, defaults: dict[str, Setting]) -> dict[str, Setting]:
    """The rectified-flow recipe of the folder ``root`` (its ``scheduler_config.json``)
    and the family's ``defaults`` (the trainers' timestep density, loss weighting, caption
    dropout, ...).

    Raises:
        SDFolderError: a scheduler option steadydiff does not sample with (named).
    """
    path = Path(root) / "scheduler" / "scheduler_config.json"
    s = read_json(path, "the scheduler's configuration")
    for key, ok in _REFUSED.items():
        if s.get(key, ok) != ok:
            raise SDFolderError(f"{path}: {key}={s[key]!r} is not a flow-match setting "
                                f"steadydiff samples with (expected {ok!r}); the "
                                "FlowMatchEulerDiscreteScheduler defaults are supported")
    src = f"{Path(root).name}/scheduler/scheduler_config.json"
    out: dict[str, Setting] = {
        "diffusion.objective": Setting("flow", f"{src}: FlowMatchEulerDiscreteScheduler"),
        "diffusion.timesteps": Setting(int(s.get("num_train_timesteps", 1000)),
                                       f"{src}: num_train_timesteps"),
    }
    if s.get("use_dynamic_shifting", False):
        out["diffusion.flow.dynamic_shift"] = Setting(True, f"{src}: use_dynamic_shifting")
        out["diffusion.flow.base_shift"] = Setting(float(s.get("base_shift", 0.5)),
                                                   f"{src}: base_shift")
        out["diffusion.flow.max_shift"] = Setting(float(s.get("max_shift", 1.15)),
                                                  f"{src}: max_shift")
        out["diffusion.flow.base_seq_len"] = Setting(int(s.get("base_image_seq_len", 256)),
                                                     f"{src}: base_image_seq_len")
        out["diffusion.flow.max_seq_len"] = Setting(int(s.get("max_image_seq_len", 4096)),
                                                    f"{src}: max_image_seq_len")
    else:
        out["diffusion.flow.shift"] = Setting(float(s.get("shift", 1.0)), f"{src}: shift")
    out.update(defaults)
    return out


def vae_down(root: Path) -> int:
    """The VAE's downsampling (2 ** (levels - 1)) from the folder's vae/config.json."""
    conf = read_json(Path(root) / "vae" / "config.json", "the VAE's configuration")
    return 2 ** (len(conf["block_out_channels"]) - 1)


def encoder_autocast_off(device: torch.device):
    """A context in which an fp16-unsafe encoder (T5) runs in its own weights' dtype (bf16
    or fp32), not in the fp16 of an enclosing autocast (the training step's)."""
    return autocast_off(device)


def prepare_joint_attention(denoiser: nn.Module) -> None:
    """Wrap each joint-attention processor of a transformer in
    :class:`~.attention.UpcastJointAttention`, and give every attention layer an
    ``upcast_attention`` attribute (FLUX's ``FluxAttention`` has none of its own), so the
    guard can upcast the one that overflowed."""
    for name, m in denoiser.named_modules():
        if hasattr(m, "set_processor") and hasattr(m, "processor") and \
                "upcast_attention" not in vars(m):
            m.upcast_attention = False
    denoiser.set_attn_processor({name: proc if isinstance(proc, UpcastJointAttention)
                                 else UpcastJointAttention(proc)
                                 for name, proc in denoiser.attn_processors.items()})


# --------------------------------------------------------------------------- single files


def transformer_prefix(keys: list[str]) -> str:
    """The denoiser's key prefix in a transformer family's single file: ComfyUI's
    all-in-one checkpoints put it under ``model.diffusion_model.``; Stability's and Black
    Forest Labs' transformer files have no prefix (every key is the transformer's)."""
    return "model.diffusion_model." if any(k.startswith("model.diffusion_model.")
                                           for k in keys) else ""


def load_transformer_file(family: Any, f: Path, root: Path, table_of: Any) -> Any:
    """The parts of a transformer family's single file ``f``: its transformer, read through
    the family's original-layout table (``table_of(config)``; the inverse of what
    ``Family.original_state_dict`` writes), into the class the config folder ``root``
    names, fp32; every other part (VAE, text encoders, tokenizers) from ``root``, which
    must hold their weights.

    Raises:
        SDFolderError: the file does not fit the config's transformer (another model, or
            another size), naming the first tensors that differ.
    """
    from safetensors.torch import load_file

    from ..sd.original import from_original

    parts = family.load(root, denoiser=False)
    conf = read_json(root / family.denoiser / "config.json", "the transformer's configuration")
    with torch.device("meta"):
        den = family.build_denoiser(conf)
    shapes = {k: v.shape for k, v in den.state_dict().items()}
    sd = load_file(str(f))
    prefix = transformer_prefix(list(sd))
    try:
        state = from_original(sd, table_of(den.config), shapes, prefix)
    except KeyError as e:
        raise SDFolderError(f"model.pretrained: {f} is not a {family.label} transformer of "
                            f"the shape {root / family.denoiser}/config.json describes: "
                            f"{e.args[0]}") from None
    bad = [k for k, v in state.items() if tuple(v.shape) != tuple(shapes[k])]
    if bad:
        k = bad[0]
        raise SDFolderError(f"model.pretrained: {f}: {k} has shape {tuple(state[k].shape)}; "
                            f"the transformer of {root} takes {tuple(shapes[k])} (another "
                            "size of the model?)")
    den.load_state_dict({k: v.float() for k, v in state.items()}, assign=True)
    parts.root, parts.denoiser = f, den
    return parts


def transformer_file_reader(f: Path, table_of: Any, config: Any,
                            shapes: dict[str, tuple[int, ...]]) -> Any:
    """``read(name, start, stop) -> rows [start, stop) of dim 0`` (None, None: the whole
    tensor), fp32, of the diffusers tensor ``name`` from a transformer family's
    original-layout single file ``f``, reading only those rows' bytes: a fused original
    tensor (``cat``: the parts' rows one after another; ``swap``: its halves swapped) is
    sliced where the part lies. The FSDP meta-device init's source for a single-file base
    (:func:`steadydiff.sharding.materialize`), as ``folder.part_reader`` is a folder's.
    Checked first against ``shapes`` (the model's).

    Raises:
        SDFolderError: a tensor the model has that the file lacks, or of another shape.
    """
    from safetensors import safe_open

    with safe_open(str(f), "pt") as h:
        have = {k: tuple(h.get_slice(k).get_shape()) for k in h.keys()}
    prefix = transformer_prefix(list(have))
    # diffusers name -> (file key, its first row in the file's tensor, the file tensor's
    # rows, swapped halves)
    src: dict[str, tuple[str, int, int, bool]] = {}
    for e in table_of(config):
        if e.how == "skip":
            continue
        if e.how in ("param", "scale"):
            name = e.parts[0] if e.how == "param" else f"{e.parts[0]}.weight"
            key = prefix + e.original + (".scale" if e.how == "scale" else "")
            src[name] = (key, 0, shapes[name][0] if shapes.get(name) else 0, False)
            continue
        for what in ("weight", "bias"):
            keys = [f"{p}.{what}" for p in e.parts]
            if keys[0] not in shapes:
                continue
            total, off = sum(shapes[k][0] for k in keys), 0
            for k in keys:
                src[k] = (f"{prefix}{e.original}.{what}", off, total, e.how == "swap")
                off += shapes[k][0]
    for name, shape in shapes.items():
        if name not in src or src[name][0] not in have:
            raise SDFolderError(f"model.pretrained: {f} has no "
                                f"{src[name][0] if name in src else name} (the transformer "
                                "of model.single_file_config is another model?)")
        key, _, total, _ = src[name]
        want = (total, *shape[1:]) if shape else ()
        if have[key] != want:
            raise SDFolderError(f"model.pretrained: {f}: {key} has shape {have[key]}; the "
                                f"config's transformer takes {want} (another size?)")

    def read(name: str, start: int | None, stop: int | None) -> torch.Tensor:
        key, off, total, swap = src[name]
        with safe_open(str(f), "pt") as h:
            sl = h.get_slice(key)
            if not shapes[name]:
                return sl[:].float()
            a, b = (0, shapes[name][0]) if start is None else (start, stop)
            if not swap:
                return sl[off + a:off + b].float()
            # the file holds [second half, first half]: row r of ours is (r + half) % total
            half = total // 2
            lo, hi = (off + a + half) % total, (off + b - 1 + half) % total + 1
            t = sl[lo:hi] if lo < hi else torch.cat([sl[lo:total], sl[0:hi]])
            return t.float()

    return read


def transformer_state(table_of: Any, denoiser: nn.Module, prefix: str) -> dict[str, Any]:
    """A transformer's tensors in its family's original layout, keys under ``prefix``."""
    from ..sd.original import to_original

    sd = {k: v.detach().to("cpu").contiguous() for k, v in denoiser.state_dict().items()}
    return to_original(sd, table_of(denoiser.config), prefix)


class TransformerFiles:
    """The single-file side of a transformer family (SD3, FLUX.1, Z-Image): the file holds
    the transformer alone in its makers' layout, the family's ``original_table(config)``
    (:mod:`steadydiff.integrations.sd.original` entries), its keys under ``file_prefix``
    when written (read with or without ComfyUI's ``model.diffusion_model.``). A family
    mixes it in before :class:`~.base.Family` and gives the table and its key prefixes."""

    single_file_parts = ("transformer",)
    #: the prefix the makers' transformer files put its keys under
    file_prefix = ""

    @staticmethod
    def original_table(config: Any) -> list[Any]:
        raise NotImplementedError

    def single_file_prefix(self, keys: list[str]) -> str:
        return transformer_prefix(keys)

    def load_single_file(self, f: Path, root: Path) -> Any:
        return load_transformer_file(self, f, root, self.original_table)

    def file_reader(self, f: Path, config: Any, shapes: dict[str, tuple[int, ...]]) -> Any:
        return transformer_file_reader(f, self.original_table, config, shapes)

    def original_state_dict(self, denoiser: nn.Module, vae: nn.Module | None,
                            text_encoders: list[nn.Module | None],
                            prefix: str | None = None) -> dict[str, Any]:
        """The transformer alone in the original layout (what its makers distribute; the
        VAE and text encoders stay diffusers folders: ``model.single_file_config``)."""
        return transformer_state(self.original_table, denoiser,
                                 self.file_prefix if prefix is None else prefix)
