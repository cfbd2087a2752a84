"""LoRA files the rest of the ecosystem loads: kohya's / A1111's format, written and read.

A kohya-format LoRA is one ``.safetensors`` file with, per adapted layer ``NAME``:
``NAME.lora_down.weight`` (r, in[, k, k]), ``NAME.lora_up.weight`` (out, r[, 1, 1]) and
``NAME.alpha`` (a 0-dim tensor; the delta is scaled by alpha / r), where ``NAME`` is
the family's prefixes (``lora_unet_``; each text encoder's, e.g. ``lora_te_``, or SDXL's
``lora_te1_``, ``lora_te2_``) + the layer's module path with ``.`` replaced by ``_``. The
module path is the one the family's sd-scripts trainer sees (``Family.kohya_path``): the
diffusers UNet's for SD 1.x/2.x, the original (sgm/LDM) UNet's for SDXL (``input_blocks.4.1``,
``middle_block.1``, ``output_blocks.0.1``: sd-scripts train SDXL on that UNet). The metadata (``ss_network_dim``, ``ss_network_alpha``, ``ss_base_model_version``,
``sshs_model_hash``, ...) is what A1111 and ComfyUI show and key on.

peft's LoRA layers hold exactly these tensors (``lora_A`` = down, ``lora_B`` = up,
``lora_alpha``), so saving and loading are renames, bit-exact both ways. The names are
derived here from the model's own module paths, in both directions, so that loading maps
every key to one layer or names it as unknown; diffusers' loader
(``_convert_non_diffusers_lora_to_diffusers``, used by ``pipe.load_lora_weights``) reads
what we write, and the tests check that it maps our names back to the same layers.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..families import of_module
from . import lycoris
from .ldm import LayoutError, clip_path, sgm_path
from .original import fuse_lora, split_lora

LORA_FILE = "pytorch_lora_weights.safetensors"  # diffusers' name for a saved LoRA

__all__ = ["sgm_path", "kohya_names", "kohya_layers", "KohyaLayer", "kohya_state_dict",
           "save_kohya", "LoraFile",
           "read_lora_file", "load_lora_file", "base_model_hashes", "LoraFileError"]

PICKLES = (".ckpt", ".pt", ".pth", ".bin", ".pkl")
# a diffusers LoRA file's prefixes: the denoiser's (a UNet's, a transformer's) and the text
# encoders' (the pipelines' component names)
_DENOISERS = ("unet.", "transformer.")
_TEXT = ("text_encoder.", "text_encoder_2.", "text_encoder_3.")
_DIFFUSERS = _DENOISERS + _TEXT


class LoraFileError(ValueError):
    """A LoRA file that cannot be read or does not fit the model (the message says why)."""


# --------------------------------------------------------------------------- names


def _lora_layers(module: nn.Module) -> dict[str, nn.Module]:
    """The peft LoRA (LoHa, LoKr) layers of ``module`` by module path (adapter 'default')."""
    return {n: m for n, m in module.named_modules()
            if (isinstance(getattr(m, "lora_A", None), nn.ModuleDict) and "default" in m.lora_A)
            or lycoris.algo_of(m)}


@dataclass
class KohyaLayer:
    """One layer of a kohya LoRA file and the peft LoRA layers it holds: one (a plain
    rename), or several stacked block-diagonally (an original module diffusers splits:
    a transformer's fused ``qkv``; original.py ``fuse_lora``).

    Attributes:
        name: its kohya name (``lora_unet_double_blocks_0_img_attn_qkv``).
        layers: the peft LoRA layer of each part (None: a part without a LoRA).
        paths: each part's module path in its model.
        out_dims: each part's output width. swap: the original swaps the output halves.
    """

    name: str
    layers: list[nn.Module | None]
    paths: list[str]
    out_dims: list[int]
    swap: bool = False


def kohya_layers(denoiser: nn.Module, text_encoders: list[nn.Module | None] = ()
                 ) -> dict[str, KohyaLayer]:
    """Every LoRA layer of ``denoiser`` and the text encoders (in the family's order; None
    where one has no LoRA), grouped into the layers of a kohya file, by kohya name.

    Raises:
        LoraFileError: a LoRA layer with no kohya name, or more text encoders than the
            family has.
    """
    family = _family(denoiser)
    out: dict[str, KohyaLayer] = {}
    lora = _lora_layers(denoiser)
    entries = family.kohya_entries(denoiser.config)
    if entries is None:  # one kohya layer per LoRA layer, at the family's module path
        for n, m in lora.items():
            try:
                path = family.kohya_path(n, denoiser.config)
            except LayoutError as e:
                raise LoraFileError(str(e)) from None
            name = family.kohya_denoiser + path.replace(".", "_")
            out[name] = KohyaLayer(name, [m], [n], [m.out_features])
    else:  # the original modules, each made of one or more diffusers modules
        mods = dict(denoiser.named_modules())
        covered: set[str] = set()
        for e in entries:
            if e.how not in ("cat", "swap") or not any(p in lora for p in e.parts):
                continue
            name = family.kohya_denoiser + e.original.replace(".", "_")
            out[name] = KohyaLayer(name, [lora.get(p) for p in e.parts], list(e.parts),
                                   [int(mods[p].out_features) for p in e.parts],
                                   e.how == "swap")
            covered.update(e.parts)
        left = sorted(set(lora) - covered)
        if left:
            raise LoraFileError(f"the LoRA on {left[:3]} has no kohya name (no original "
                                f"{family.label} module holds it): leave it out of "
                                "adapter.targets, or write adapter.lora_format=diffusers")
    tes = list(text_encoders)
    if len([t for t in tes if t is not None]) and len(tes) > len(family.text):
        raise LoraFileError(f"{len(tes)} text encoders for a {family.title} that takes "
                            f"{len(family.text)}")
    for spec, te in zip(family.text, tes):
        if te is None:
            continue
        for n, m in _lora_layers(te).items():
            name = spec.kohya + clip_path(n).replace(".", "_")
            out[name] = KohyaLayer(name, [m], [n], [m.out_features])
    return out


def kohya_names(unet: nn.Module, text_encoders: list[nn.Module | None] = ()
                ) -> dict[str, tuple[nn.Module, str]]:
    """Every LoRA layer of ``unet`` and the text encoders, by its kohya name:
    ``{kohya name: (peft layer, its module path)}`` (the families whose kohya layers are
    one LoRA layer each: SD 1.x/2.x, SDXL; a fused layer names its first part)."""
    return {k: (next(m for m in v.layers if m is not None),
                next(p for m, p in zip(v.layers, v.paths) if m is not None))
            for k, v in kohya_layers(unet, text_encoders).items()}


def _family(denoiser: nn.Module):
    try:
        return of_module(denoiser)
    except ValueError as e:
        raise LoraFileError(str(e)) from None


def _peft_tensors(m: nn.Module | None) -> tuple[Tensor, Tensor, float] | None:
    if m is None:
        return None
    return (m.lora_A["default"].weight.detach().to("cpu", torch.float32),
            m.lora_B["default"].weight.detach().to("cpu", torch.float32),
            float(m.lora_alpha["default"]))


def _magnitude(m: nn.Module | None) -> nn.Parameter | None:
    """A DoRA layer's magnitude (peft's ``lora_magnitude_vector``: (out,) for a Linear,
    (1, out, 1, 1) for a Conv2d), None for a plain LoRA layer."""
    mags = getattr(m, "lora_magnitude_vector", None)
    if not isinstance(mags, nn.ModuleDict) or "default" not in mags:
        return None
    return mags["default"].weight


def kohya_state_dict(unet: nn.Module, text_encoders: list[nn.Module | None] = ()
                     ) -> dict[str, Tensor]:
    """The LoRA tensors as kohya writes them (fp32, CPU): down, up and alpha per layer (a
    fused layer's parts stacked block-diagonally, its alpha x the parts: the same delta);
    a DoRA layer's magnitude as LyCORIS' ``dora_scale`` (out, 1[, 1, 1]): the norm taken
    per output row, which ComfyUI and diffusers read from its shape.

    Raises:
        LoraFileError: a DoRA on a fused layer (kohya's format has one magnitude per
            original module, ours one per part: write adapter.lora_format=diffusers).
    """
    sd: dict[str, Tensor] = {}
    for name, k in kohya_layers(unet, text_encoders).items():
        algo = next((a for a in map(lycoris.algo_of, k.layers) if a), None)
        if algo:  # LoHa / LoKr: LyCORIS' names (lycoris.py)
            if len(k.layers) > 1:
                raise LoraFileError(f"{name}: a {lycoris.algo_name(algo)} on the parts of a "
                                    f"fused module ({', '.join(k.paths)}) cannot be written "
                                    "as one LyCORIS layer: leave them out of adapter.targets "
                                    "or use adapter.variant=lora")
            t, alpha = lycoris.file_tensors(k.layers[0])
            sd.update({f"{name}.{n}": v for n, v in t.items()})
            sd[f"{name}.alpha"] = torch.tensor(float(alpha))
            continue
        down, up, alpha = fuse_lora([_peft_tensors(m) for m in k.layers], k.out_dims, k.swap)
        sd[f"{name}.lora_down.weight"] = down
        sd[f"{name}.lora_up.weight"] = up
        sd[f"{name}.alpha"] = torch.tensor(float(alpha))
        mags = [_magnitude(m) for m in k.layers]
        if any(g is not None for g in mags):
            if len(k.layers) > 1:
                raise LoraFileError(f"{name}: a DoRA on the parts of a fused module cannot be "
                                    "written in kohya's format (one magnitude per module): "
                                    "set adapter.lora_format=diffusers")
            g = mags[0].detach().reshape(-1)
            sd[f"{name}.dora_scale"] = g.reshape(g.shape[0], *([1] * (down.ndim - 1)))
    return {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in sd.items()}


# --------------------------------------------------------------------------- metadata


_HASHES: dict[tuple[str, int, int], tuple[str, str]] = {}


def base_model_hashes(folder: str | Path, part: str = "unet") -> dict[str, str]:
    """``ss_sd_model_hash`` (A1111's legacy 8-hex hash: 64 KiB at 1 MiB) and
    ``ss_new_sd_model_hash`` (sha256) of the base's denoiser weights file (``part``: the
    family's denoiser folder). A diffusers folder has no single checkpoint file, so these
    identify the base, but do not equal A1111's hash of the same model as one file.
    Computed once per file (a multi-GB read)."""
    unet = Path(folder) / part
    files = sorted(unet.glob("*.safetensors")) or sorted(unet.glob("*.bin"))
    if not files:
        return {}
    f = files[0]
    st = f.stat()
    key = (str(f.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _HASHES:
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            fh.seek(0x100000)
            legacy = hashlib.sha256(fh.read(0x10000)).hexdigest()[:8]
            fh.seek(0)
            for chunk in iter(lambda: fh.read(1 << 24), b""):
                h.update(chunk)
        _HASHES[key] = (legacy, h.hexdigest())
    legacy, full = _HASHES[key]
    return {"ss_sd_model_hash": legacy, "ss_new_sd_model_hash": full}


def base_model_version(denoiser: nn.Module) -> str:
    """``ss_base_model_version`` as sd-scripts spell it."""
    return _family(denoiser).base_version(denoiser)


def _tensor_hash(blob: bytes) -> str:
    """sha256 of a safetensors file's tensor data (after its header): the LoRA's own hash
    (``sshs_model_hash``), unchanged by the metadata."""
    n = int.from_bytes(blob[:8], "little")
    return hashlib.sha256(blob[8 + n:]).hexdigest()


# --------------------------------------------------------------------------- save


def save_kohya(path: str | Path, unet: nn.Module, text_encoders: list[nn.Module | None] = (),
               metadata: dict[str, Any] | None = None) -> Path:
    """Write the LoRA of ``unet`` (and of the text encoders) as one kohya-format file,
    atomically (a temporary file fsynced, then renamed over ``path``).

    Args:
        metadata: extra ``ss_*`` entries (values become strings); dim, alpha, the network
            module, the base model version and the tensors' hash are filled in here.

    Raises:
        LoraFileError: the model has no LoRA layers, or their ranks or alphas differ.
        CheckpointError: a tensor is non-finite (nothing is written).
    """
    from safetensors.torch import save

    from ...trainer.checkpoint import CheckpointError

    sd = kohya_state_dict(unet, text_encoders)
    if not sd:
        raise LoraFileError("the model has no LoRA layers to save")
    bad = [k for k, v in sd.items() if not torch.isfinite(v).all()]
    if bad:
        raise CheckpointError(f"the LoRA has non-finite weights ({bad[0]} and {len(bad) - 1} "
                              "more): not written")
    family = _family(unet)
    layers = kohya_layers(unet, text_encoders)
    lyco = [m for k in layers.values() for m in k.layers if lycoris.algo_of(m)]
    parts = [t for k in layers.values() for m in k.layers if not lycoris.algo_of(m)
             for t in [_peft_tensors(m)] if t is not None]
    ranks = {int(d.shape[0]) for d, _, _ in parts}  # the LoRA's own (a fused layer: k x it)
    alphas = {a for _, _, a in parts}
    ranks |= {lycoris.rank_alpha(m)[0] for m in lyco}
    alphas |= {lycoris.rank_alpha(m)[1] for m in lyco}
    args: dict[str, Any] = {} if len(ranks) == len(alphas) == 1 else \
        {"note": "per-layer rank/alpha: see each .alpha"}
    if any(len(k.layers) > 1 for k in layers.values()):
        args["split_qkv"] = "True"  # kohya's name for fused layers stored block-diagonally
    module = family.kohya_module
    convs = [int(d.shape[0]) for d, _, _ in parts if d.ndim == 4] + \
        [lycoris.rank_alpha(m)[0] for m in lyco
         if isinstance(m.get_base_layer(), nn.Conv2d)]
    if convs:  # LoCon: kohya's conv_dim / conv_alpha (the LoRA's own rank and alpha)
        args.update(conv_dim=str(max(convs)), conv_alpha=_num(max(alphas)))
    algos = {lycoris.algo_of(m) for m in lyco}
    if algos:  # LyCORIS' network module, its algo (one per file here) and LoKr's factor
        module = "lycoris.kohya"
        args.update(algo=sorted(algos)[0])
        if "lokr" in algos:
            conf = next(iter(getattr(unet, "peft_config", {}).values()), None)
            args["factor"] = str(getattr(conf, "decompose_factor", -1))
    if any(k.endswith(".dora_scale") for k in sd):  # LyCORIS' name for a DoRA LoRA
        module = "lycoris.kohya"
        args.update(algo="lora", dora_wd="True")
    meta = {"ss_network_module": module,
            "ss_network_dim": str(max(ranks)), "ss_network_alpha": _num(max(alphas)),
            "ss_base_model_version": base_model_version(unet),
            "ss_v2": str(base_model_version(unet) == "sd_v2"),
            "ss_network_args": json.dumps(args),
            "modelspec.sai_model_spec": "1.0.0",
            "modelspec.architecture": family.modelspec,
            "modelspec.implementation": "diffusers",
            "ss_training_finished_at": str(time.time())}
    meta.update({k: str(v) for k, v in (metadata or {}).items() if v is not None})
    meta["sshs_model_hash"] = _tensor_hash(save(sd))
    blob = save(sd, metadata=meta)
    from ...files import atomic_output

    path = Path(path)
    with atomic_output(path) as tmp:
        tmp.write_bytes(blob)
    return path


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


# --------------------------------------------------------------------------- read / load


@dataclass
class LoraFile:
    """A LoRA file read into ``{kohya-style layer name: (down, up, alpha | None)}``.

    ``format`` is "kohya" (names as in the file) or "diffusers" (names
    ``unet.<path>`` / ``text_encoder.<path>``, alpha from diffusers' adapter metadata)."""

    path: Path
    format: str
    layers: dict[str, tuple[Tensor, Tensor, float | None]]
    metadata: dict[str, str] = field(default_factory=dict)
    magnitudes: dict[str, Tensor] = field(default_factory=dict)  # DoRA: per layer name
    #: LoHa / LoKr layers (lycoris.py): ``{name: (algo, {factor name: tensor}, scale)}``, the
    #: scale the file's loaders apply to each
    lyco: dict[str, tuple[str, dict[str, Tensor], float]] = field(default_factory=dict)

    def ranks(self) -> set[int]:
        return {int(d.shape[0]) for d, _, _ in self.layers.values()}

    def alphas(self) -> set[float]:
        return {a for _, _, a in self.layers.values() if a is not None}


def _file_of(path: Path) -> Path:
    if path.is_dir():
        f = path / LORA_FILE
        if not f.is_file():
            found = sorted(p.name for p in path.glob("*.safetensors"))[:4]
            raise LoraFileError(f"{path}: no {LORA_FILE} in the folder (found {found}); point "
                                "at the .safetensors file itself")
        return f
    if path.suffix.lower() in PICKLES:
        raise LoraFileError(
            f"{path}: a {path.suffix} file is a Python pickle (loading it can run code): not "
            "read. Convert it once, where you trust it, e.g. python -c \"import torch, "
            "safetensors.torch as s; s.save_file({k: v.contiguous() for k, v in torch.load("
            "'IN', weights_only=True).items()}, 'OUT.safetensors')\"")
    if path.suffix.lower() != ".safetensors":
        raise LoraFileError(f"{path}: expected a .safetensors LoRA file or a diffusers LoRA "
                            "folder")
    if not path.is_file():
        raise LoraFileError(f"{path}: no such file")
    return path


def read_lora_file(path: str | Path) -> LoraFile:
    """Read a kohya-format ``.safetensors`` or a diffusers LoRA (folder or file).

    Raises:
        LoraFileError: a pickle, an unknown key layout, a layer without its down/up/alpha,
            or down/up shapes that do not chain (down (r, in), up (out, r)).
    """
    from safetensors import safe_open

    f = _file_of(Path(path).expanduser())
    try:
        with safe_open(f, "pt") as fh:
            meta = dict(fh.metadata() or {})
            sd = {k: fh.get_tensor(k) for k in fh.keys()}
    except Exception as e:  # SafetensorError: a damaged file, or not safetensors at all
        raise LoraFileError(f"{f}: not a readable .safetensors file ({type(e).__name__}: "
                            f"{str(e).strip().splitlines()[0] if str(e).strip() else ''})"
                            ) from None
    if not sd:
        raise LoraFileError(f"{f}: no tensors")
    mags: dict[str, Tensor] = {}
    lyco: dict[str, tuple[str, dict[str, Tensor], float]] = {}
    if all(k.startswith(("lora_unet_", "lora_te")) for k in sd):
        mags = {k.rsplit(".", 1)[0]: sd.pop(k) for k in list(sd) if k.endswith(".dora_scale")}
        lyco = _lycoris_layers(f, sd, None)
        layers = _kohya_layers(f, sd)
        fmt = "kohya"
    elif all(k.startswith(_DIFFUSERS) for k in sd):
        lyco = _lycoris_layers(f, sd, meta)
        layers = _diffusers_layers(f, sd, meta, mags)
        fmt = "diffusers"
    else:
        odd = [k for k in sd if not k.startswith(("lora_unet_", "lora_te") + _DIFFUSERS)][:3]
        raise LoraFileError(f"{f}: neither kohya (lora_unet_*/lora_te*) nor diffusers "
                            f"(unet.*/transformer.*/text_encoder*.*) LoRA keys, e.g. {odd}")
    for name, (d, u, _) in layers.items():
        if d.ndim < 2 or u.ndim < 2 or u.shape[1] != d.shape[0]:
            raise LoraFileError(f"{f}: {name}: lora_down {tuple(d.shape)} and lora_up "
                                f"{tuple(u.shape)} do not chain (down (r, in), up (out, r))")
    odd = sorted(set(mags) - set(layers))[:3]
    if odd:
        raise LoraFileError(f"{f}: DoRA magnitudes without their LoRA layer: {odd}")
    return LoraFile(f, fmt, layers, meta, mags, lyco)


def _lycoris_layers(f: Path, sd: dict[str, Tensor], meta: dict[str, str] | None
                    ) -> dict[str, tuple[str, dict[str, Tensor], float]]:
    """The LoHa/LoKr layers of a file, taken out of ``sd`` (with their ``.alpha``): a kohya
    (LyCORIS) file's, scaled as LyCORIS does; a diffusers file's (``transformer.<path>.
    lokr_w1``, peft's names), scaled by its adapter metadata's alpha / r as peft does."""
    out: dict[str, tuple[str, dict[str, Tensor], float]] = {}
    names = sorted({k.rsplit(".", 1)[0] for k in sd
                    if k.rsplit(".", 1)[-1].startswith(lycoris.PREFIXES)})
    confs: dict[str, dict[str, Any]] = {}
    if meta is not None and "lora_adapter_metadata" in meta:
        for k, v in json.loads(meta["lora_adapter_metadata"]).items():
            part, _, key = k.partition(".")
            confs.setdefault(part, {})[key] = v
    for n in names:
        t = {k.rsplit(".", 1)[1]: sd.pop(k) for k in list(sd) if k.rsplit(".", 1)[0] == n}
        alpha_t = t.pop("alpha", None)
        algo = "loha" if any(k.startswith("hada_") for k in t) else "lokr"
        odd = sorted(k for k in t if k not in lycoris.ALGOS[algo] + lycoris.TUCKER)
        if odd:
            raise LoraFileError(f"{f}: layer {n} mixes {odd} with {lycoris.algo_name(algo)} "
                                "factors")
        why = lycoris.check_layer(n, algo, t)
        if why:
            raise LoraFileError(f"{f}: {why}")
        if meta is None:
            alpha = None if alpha_t is None else float(alpha_t)
            scale = lycoris.file_scale(algo, t, alpha)
        else:  # peft's scaling (diffusers without metadata: alpha baked in, scale 1)
            conf = confs.get(n.split(".", 1)[0], {})
            scale = lycoris.file_scale(algo, t, conf.get("alpha"),
                                       peft_rank=int(conf.get("r") or 1))
        out[n] = (algo, t, scale)
    return out


def _kohya_layers(f: Path, sd: dict[str, Tensor]) -> dict[str, tuple[Tensor, Tensor, float]]:
    names = {k.split(".", 1)[0] for k in sd}
    layers = {}
    for n in sorted(names):
        parts = {k.split(".", 1)[1] for k in sd if k.split(".", 1)[0] == n}
        missing = {"lora_down.weight", "lora_up.weight", "alpha"} - parts
        extra = parts - {"lora_down.weight", "lora_up.weight", "alpha"}
        if missing:
            raise LoraFileError(f"{f}: layer {n} has no {sorted(missing)} (a kohya LoRA layer "
                                "has lora_down.weight, lora_up.weight and alpha)")
        if extra:
            raise LoraFileError(f"{f}: layer {n} has {sorted(extra)}, which a LoRA, DoRA, "
                                "LoHa or LoKr does not (LyCORIS' IA3, OFT, GLoRA and full "
                                "layers are not read)")
        a = sd[f"{n}.alpha"]
        if a.numel() != 1:
            raise LoraFileError(f"{f}: {n}.alpha has shape {tuple(a.shape)}, not a scalar")
        layers[n] = (sd[f"{n}.lora_down.weight"], sd[f"{n}.lora_up.weight"], float(a))
    return layers


def _diffusers_layers(f: Path, sd: dict[str, Tensor], meta: dict[str, str],
                      mags: dict[str, Tensor] | None = None
                      ) -> dict[str, tuple[Tensor, Tensor, float | None]]:
    from diffusers.utils import convert_state_dict_to_peft, convert_unet_state_dict_to_peft

    def to_peft(part: dict[str, Tensor], convert) -> dict[str, Tensor]:
        # the transformer loaders' files hold peft's names already (.lora_A/.lora_B)
        if not part or all(".lora_A." in k or ".lora_B." in k for k in part):
            return part
        return convert(part)

    # diffusers' own renames to peft's: the UNet's .lora.down/up, the text encoder's
    # .lora_linear_layer.down/up -> .lora_A/.lora_B
    peft: dict[str, Tensor] = {}
    for prefix in _DENOISERS:
        peft.update(to_peft({k: v for k, v in sd.items() if k.startswith(prefix)},
                            convert_unet_state_dict_to_peft))
    for prefix in _TEXT:
        te = {k: v for k, v in sd.items() if k.startswith(prefix)}
        # CLIP paths with their text_model level, whichever transformers wrote the file
        peft.update({prefix + clip_path(k[len(prefix):]): v
                     for k, v in to_peft(te, convert_state_dict_to_peft).items()})
    alphas: dict[str, float] = {}
    if "lora_adapter_metadata" in meta:  # diffusers' record of each LoraConfig
        for k, conf in json.loads(meta["lora_adapter_metadata"]).items():
            if k.endswith("lora_alpha"):
                alphas[k.split(".", 1)[0]] = float(conf)
    for k in [k for k in peft if ".lora_magnitude_vector" in k]:  # DoRA
        v = peft.pop(k)
        if mags is not None:
            mags[k.split(".lora_magnitude_vector", 1)[0]] = v
    names = {k.rsplit(".lora_", 1)[0] for k in peft}
    layers = {}
    for n in sorted(names):
        d, u = peft.get(f"{n}.lora_A.weight"), peft.get(f"{n}.lora_B.weight")
        if d is None or u is None:
            raise LoraFileError(f"{f}: layer {n} has no {'lora_A/down' if d is None else 'lora_B/up'} "
                                "weight")
        layers[n] = (d, u, alphas.get(n.split(".", 1)[0]))
    return layers


def load_lora_file(path: str | Path, unet: nn.Module,
                   text_encoders: list[nn.Module | None] = (), *, rank: int,
                   alpha: float) -> dict[str, int]:
    """Copy a LoRA file's tensors into the peft LoRA layers already on ``unet`` (the
    denoiser, UNet or transformer) and the text encoders (the family's order, None where
    one has no LoRA): training then continues from it. A kohya layer of a fused original
    module (a transformer's ``qkv``) is split into its parts (block-diagonal: kohya's
    ``split_qkv`` and ours; or one down shared by the parts: a LoRA trained on the fused
    module); a part the file leaves at zero keeps ours.

    Args:
        rank, alpha: the run's adapter.rank and alpha (adapter.alpha, or the rank).

    Returns:
        ``{"loaded": layers set from the file, "fresh": our layers the file does not have}``.

    Raises:
        LoraFileError: a key naming no LoRA layer of the model (a few are listed), a rank
            other than the run's, a kohya file's alpha other than the run's (a diffusers
            file's is rescaled to the run's: the same delta), or a shape that does not fit
            the layer.
    """
    lf = read_lora_file(path)
    family = _family(unet)
    if lf.format == "kohya":
        groups = kohya_layers(unet, text_encoders)
        ours = {k: g for k, g in groups.items()}
    else:  # diffusers: the denoiser's and each text encoder's, by its component name
        ours = {f"{family.denoiser}.{n}": KohyaLayer(n, [m], [n], [m.out_features])
                for n, m in _lora_layers(unet).items()}
        for spec, te in zip(family.text, text_encoders):
            if te is not None:
                ours.update({f"{spec.part}.{clip_path(n)}": KohyaLayer(n, [m], [n],
                                                                        [m.out_features])
                             for n, m in _lora_layers(te).items()})
    lyco = _lycoris_variant(ours)
    _check_variant(lf, lyco)
    unknown = sorted((set(lf.layers) | set(lf.lyco)) - set(ours))
    if unknown:
        te = any(k.startswith(("lora_te", "text_encoder")) for k in unknown)
        hint = ("the file has a text encoder LoRA: set adapter.text_encoder=true" if te and
                not any(t is not None for t in text_encoders) else
                "adapter.targets must cover every layer the file adapts")
        raise LoraFileError(f"{lf.path}: {len(unknown)} of its {len(lf.layers) + len(lf.lyco)} "
                            "layers name no "
                            f"LoRA layer of this model, e.g. {unknown[:3]} ({hint}; this "
                            f"model's are e.g. {sorted(ours)[:2]})")
    if lf.lyco:
        return _load_lycoris(lf, ours)
    # each file layer as the parts of ours it fills: (name, our layer, down, up, alpha)
    fills: list[tuple[str, nn.Module, Tensor, Tensor, float | None]] = []
    for n, (d, u, a) in lf.layers.items():
        g = ours[n]
        if len(g.layers) == 1:
            fills.append((n, g.layers[0], d, u, a))
            continue
        try:
            pieces = split_lora(d, u, a if a is not None else rank, g.out_dims, rank, g.swap)
        except ValueError as e:
            raise LoraFileError(f"{lf.path}: {n}: {e} (adapter.rank is {rank}: set it to the "
                                "file's rank)") from None
        for m, path_, piece in zip(g.layers, g.paths, pieces):
            if piece is None:
                continue
            if m is None:
                raise LoraFileError(f"{lf.path}: {n} adapts {path_}, which adapter.targets "
                                    "does not cover: add it (or a pattern matching it)")
            fills.append((f"{n} ({path_})", m, *piece))
    ranks = {int(d.shape[0]) for _, _, d, _, _ in fills}
    if ranks != {rank}:
        raise LoraFileError(f"{lf.path}: its LoRA has rank {sorted(ranks)} "
                            f"(ss_network_dim={lf.metadata.get('ss_network_dim')}); the run's "
                            f"adapter.rank is {rank}: set adapter.rank={max(ranks)}")
    if lf.format == "diffusers":
        # a diffusers file's alpha is its metadata's (ours: rank, alpha folded into the up
        # weights), else diffusers' default, the rank: the same delta at the run's alpha
        # is the up weights times file alpha / run alpha (exact: not a bit-exact copy)
        fills = [(n, m, d, u if (a if a is not None else rank) == alpha
                  else u * ((a if a is not None else rank) / alpha), alpha)
                 for n, m, d, u, a in fills]
    alphas = {a for *_, a in fills if a is not None}
    bad_alpha = {a for a in alphas if abs(a - alpha) > 1e-6 * max(1.0, alpha)}
    if bad_alpha:
        raise LoraFileError(f"{lf.path}: its LoRA has alpha {sorted(alphas)}; the run's "
                            f"is {_num(alpha)}: set adapter.alpha={_num(max(alphas))}")
    # DoRA: the file's magnitudes into the layers' (a plain LoRA run refuses a DoRA file
    # and the other way round: the delta would not be the trained one)
    dora = {id(m) for _, m, *_ in fills if _magnitude(m) is not None}
    if lf.magnitudes and not dora:
        raise LoraFileError(f"{lf.path}: a DoRA (dora_scale / lora_magnitude_vector "
                            "tensors): set adapter.variant=dora")
    if dora and not lf.magnitudes:
        raise LoraFileError(f"{lf.path}: a plain LoRA (no dora_scale); this run is a DoRA: "
                            "set adapter.variant=lora (or locon)")
    by_layer = {n: lf.magnitudes[n] for n in lf.layers if n in lf.magnitudes}
    with torch.no_grad():
        for n, m, d, u, _ in fills:
            g = _magnitude(m)
            if g is not None:
                if n not in by_layer:
                    raise LoraFileError(f"{lf.path}: {n} has no DoRA magnitude")
                src = by_layer[n]
                if src.numel() != g.numel():
                    raise LoraFileError(f"{lf.path}: {n}'s magnitude has {src.numel()} values;"
                                        f" the layer takes {g.numel()}")
                g.copy_(src.reshape(g.shape).to(g.dtype))
            for what, dst, src in (("lora_down", m.lora_A["default"].weight, d),
                                   ("lora_up", m.lora_B["default"].weight, u)):
                if tuple(dst.shape) != tuple(src.shape):
                    raise LoraFileError(f"{lf.path}: {n}.{what} has shape {tuple(src.shape)}; "
                                        f"the layer takes {tuple(dst.shape)} (another base "
                                        "model?)")
                dst.copy_(src.to(dst.dtype))
    loaded = {id(m) for _, m, *_ in fills}
    total = sum(1 for g in ours.values() for m in g.layers if m is not None)
    return {"loaded": len(loaded), "fresh": total - len(loaded)}


def _lycoris_variant(ours: dict[str, KohyaLayer]) -> str | None:
    return next((a for g in ours.values() for m in g.layers if m is not None
                 for a in [lycoris.algo_of(m)] if a), None)


def _check_variant(lf: LoraFile, run: str | None) -> None:
    """A LoHa/LoKr file needs a LoHa/LoKr run and a LoRA file a LoRA run (the kind of each
    layer is then checked as it is copied: lycoris.load_into)."""
    if lf.lyco and not run:
        algo = next(iter(lf.lyco.values()))[0]
        raise LoraFileError(f"{lf.path}: a LyCORIS {lycoris.algo_name(algo)} "
                            f"({', '.join(lycoris.ALGOS[algo][:2])}, ... factors); this run "
                            f"trains a LoRA: set adapter.variant={algo}")
    if run and (lf.layers or not lf.lyco):
        raise LoraFileError(f"{lf.path}: {len(lf.layers)} plain LoRA layers (lora_down/"
                            f"lora_up); this run trains a {lycoris.algo_name(run)}: set "
                            "adapter.variant=lora (or dora, locon)")


def _load_lycoris(lf: LoraFile, ours: dict[str, KohyaLayer]) -> dict[str, int]:
    """A LoHa/LoKr file into a LoHa/LoKr run (load_lora_file's contract)."""
    loaded: set[int] = set()
    for n, (_, t, scale) in lf.lyco.items():
        g = ours[n]
        mods = [m for m in g.layers if m is not None]
        if len(g.layers) != 1 or not mods:
            raise LoraFileError(f"{lf.path}: {n} adapts a fused module ({', '.join(g.paths)}),"
                                " whose parts this model holds apart: a LoHa/LoKr over it "
                                "cannot be split")
        try:
            lycoris.load_into(mods[0], t, scale, f"{lf.path}: {n}")
        except ValueError as e:
            raise LoraFileError(str(e)) from None
        loaded.add(id(mods[0]))
    total = sum(1 for g in ours.values() for m in g.layers if m is not None)
    return {"loaded": len(loaded), "fresh": total - len(loaded)}
