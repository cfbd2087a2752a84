"""Base weights, adapter injection, the adapter guard and adapter checkpoints.

A fine-tuning run is an ordinary steadydiff run whose model is the base model with adapter
modules swapped in (same denoiser contract, same sampler, same loss), whose base weights
are frozen, and whose optimizer, EMA and checkpoints hold the adapter only:

    build_model -> load base weights (every key and shape checked) -> cast the base to
    adapter.base_precision, freeze it -> inject adapters (fp32, trainable)
    -> train as usual; after each applied update, |dW|/|W| per adapted module (the clamp)
    -> at each checkpoint: re-hash the frozen base (someone wrote into it: stop), write the
       adapter tensors + a reference to the base (path and sha256 of its tensors)

Resuming or sampling recomputes the base's sha256 and refuses a different base by name.
"""

from __future__ import annotations

import fnmatch
import hashlib
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from .. import hostsync
from ..config import AdapterConfig, Config, validate
from ..guard.findings import AdapterBaseModified, AdapterDeltaClamp
from ..guard.guard import GuardAbort
from ..models import build_model
from ..trainer import checkpoint as ckpt
from ..trainer.hooks import Weights
from ..trainer.optim import build_optimizer
from ..trainer.precision import DTYPES, autocast
from .layers import AdapterModule, wrap

log = logging.getLogger(__name__)

ADAPTER_KEYS = (".lora_A.", ".lora_B.", ".hyper_k.", ".hyper_v.")


HYPER_NO_MERGE = ("a hypernetwork is a nonlinear function of the attention inputs and cannot "
                  "be merged into weights; sample with the adapter applied instead "
                  "(steadydiff sample ... --adapter-scale S)")


class AdapterError(ValueError):
    """Base weights or adapter tensors that do not fit the model, or the wrong base."""


# --------------------------------------------------------------------------- tensors


def tensor_hash(sd: dict[str, torch.Tensor]) -> str:
    """sha256 over (name, dtype, shape, bytes) of every tensor, in name order: the identity
    of a set of weights independent of the file that holds them."""
    h = hashlib.sha256()
    for k in sorted(sd):
        t = sd[k].detach().cpu().contiguous()
        h.update(f"{k}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def check_tensors(expected: dict[str, torch.Tensor], given: dict[str, torch.Tensor],
                  what: str) -> None:
    """Raise :class:`AdapterError` listing missing keys, unexpected keys and shape
    mismatches (both shapes) of ``given`` against ``expected``."""
    missing = [k for k in expected if k not in given]
    unexpected = [k for k in given if k not in expected]
    shapes = [f"{k}: {what} has {tuple(given[k].shape)}, the model needs "
              f"{tuple(expected[k].shape)}"
              for k in expected if k in given and given[k].shape != expected[k].shape]
    if not (missing or unexpected or shapes):
        return

    def some(xs: list[str]) -> str:
        return ", ".join(xs[:8]) + (f" ... ({len(xs)} in all)" if len(xs) > 8 else "")

    lines = [f"{what} does not match the model:"]
    if shapes:
        lines.append("  shape mismatches (a different width, channel count or embedding "
                     "size):\n    " + "\n    ".join(shapes[:8]))
    if missing:
        lines.append(f"  missing keys: {some(missing)}")
    if unexpected:
        lines.append(f"  unexpected keys: {some(unexpected)}")
    raise AdapterError("\n".join(lines))


# --------------------------------------------------------------------------- base weights


@dataclass
class BaseWeights:
    """Base tensors as read from their source, with where they came from."""

    tensors: dict[str, torch.Tensor]
    path: str          # absolute path of the file or checkpoint directory
    source: str        # "steadydiff checkpoint (EMA)", "safetensors file", ...
    sha256: str        # tensor_hash(tensors)
    config: Config | None = None  # a steadydiff checkpoint's own config


def load_base(path: str | Path, use_ema: bool = True) -> BaseWeights:
    """Read base weights from a steadydiff checkpoint or run directory (its newest intact
    checkpoint, verified) or a ``.safetensors`` file.

    Raises:
        AdapterError: the path does not exist or is neither kind.
        CheckpointError: a corrupt checkpoint.
    """

    p = Path(path).expanduser()
    if not p.exists():
        raise AdapterError(f"adapter.base: no such file or directory: {p} (expected a "
                           "steadydiff checkpoint or run directory, or a .safetensors file)")
    if p.is_dir():
        try:
            cpath = ckpt.resolve_checkpoint(p)
            c = ckpt.load_checkpoint(cpath, "cpu", weights_only=True)
        except ckpt.CheckpointError as e:
            raise AdapterError(f"adapter.base: {e} (expected a steadydiff checkpoint or run "
                               "directory, or a .safetensors file)") from None
        if (c.state.get("adapter") or {}).get("kind"):
            raise AdapterError(f"adapter.base: {cpath} is an adapter checkpoint, not base "
                               "weights; merge it first (steadydiff merge) and use the result")
        sd = c.ema if use_ema else c.model
        cfg = validate(c.state["config"], f"{cpath}/state.json config")
        return BaseWeights(sd, str(cpath.resolve()),
                           f"steadydiff checkpoint ({'EMA' if use_ema else 'raw'} weights)",
                           tensor_hash(sd), cfg)
    if p.suffix != ".safetensors":
        raise AdapterError(f"adapter.base: {p} is neither a directory (steadydiff checkpoint "
                           "or run) nor a .safetensors file")
    try:
        sd = load_file(str(p), device="cpu")
    except (SafetensorError, OSError) as e:
        raise AdapterError(f"adapter.base: {p} is not a readable safetensors file: {e}") from None
    bad = ckpt.nonfinite_tensors(sd)
    if bad:
        raise AdapterError(f"adapter.base: {p} holds non-finite values in {', '.join(bad[:5])}")
    return BaseWeights(sd, str(p.resolve()), "safetensors file", tensor_hash(sd))


def _model_diff(base_cfg: Config, cfg: Config) -> list[str]:
    keys = ("model", "data.image_size", "data.channels")
    out = []
    a, b = base_cfg.to_dict(), cfg.to_dict()
    for k in keys:
        node_a, node_b = a, b
        for part in k.split("."):
            node_a, node_b = node_a[part], node_b[part]
        if node_a != node_b:
            out.append(f"  {k}: base {node_a} vs this config {node_b}")
    return out


# --------------------------------------------------------------------------- injection


def _matches(name: str, pattern: str) -> bool:
    if pattern.startswith("re:"):
        return re.fullmatch(pattern[3:], name) is not None
    return fnmatch.fnmatchcase(name, pattern)


def inject(model: nn.Module, cfg: AdapterConfig) -> dict[str, AdapterModule]:
    """Swap adapters into ``model`` in place for every supported module whose name matches
    one of ``cfg.targets``. Returns {module name: adapter}.

    Raises:
        AdapterError: a pattern that matches no supported module (the message lists the
            names it could have matched), or an invalid regular expression.
    """
    for pat in cfg.targets:
        if pat.startswith("re:"):
            try:
                re.compile(pat[3:])
            except re.error as e:
                raise AdapterError(f"adapter.targets: {pat!r} is not a valid regular "
                                   f"expression: {e}") from None
    alpha = cfg.alpha if cfg.alpha is not None else float(cfg.rank)
    found: dict[str, AdapterModule] = {}
    supported: list[str] = []
    hits = {pat: 0 for pat in cfg.targets}
    for name, module in list(model.named_modules()):
        if not name or isinstance(module, AdapterModule) or ".base" in f".{name}.":
            continue
        adapter = wrap(module, cfg.kind, rank=cfg.rank, alpha=alpha, dropout=cfg.dropout,
                       hidden_mult=cfg.hidden_mult)
        if adapter is None:
            continue
        supported.append(name)
        matched = [pat for pat in cfg.targets if _matches(name, pat)]
        if not matched:
            continue
        for pat in matched:
            hits[pat] += 1
        adapter.to(device=next(module.parameters()).device)
        if cfg.kind == "hypernetwork":  # the adapter replaces the attention's qkv projection
            module.qkv = adapter
            found[f"{name}.qkv"] = adapter
        else:
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, leaf, adapter)
            found[name] = adapter
    unused = [pat for pat, n in hits.items() if n == 0]
    if unused:
        what = ("Linear, Conv2d and Embedding layers" if cfg.kind == "lora"
                else "attention layers")
        shown = ", ".join(supported[:12]) + (f" ... ({len(supported)} in all)"
                                             if len(supported) > 12 else "")
        raise AdapterError(f"adapter.targets {unused} match none of this model's {what}; "
                           f"patterns are fnmatch globs (or 're:' + a regex) over names such "
                           f"as: {shown}")
    return found


def _base_name(name: str, adapters: dict[str, AdapterModule]) -> str:
    """Parameter name in the wrapped model -> its name in the plain model."""
    for prefix in adapters:
        if name.startswith(prefix + ".base."):
            return prefix + "." + name[len(prefix) + 6:]
    return name


def is_adapter_key(name: str) -> bool:
    return any(k in f".{name}" for k in ADAPTER_KEYS)


def adapter_modules(model: nn.Module) -> dict[str, AdapterModule]:
    return {n: m for n, m in model.named_modules() if isinstance(m, AdapterModule)}


def adapter_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's own tensors, by their names in the wrapped model."""
    return {k: v.detach() for k, v in model.state_dict().items() if is_adapter_key(k)}


def base_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The frozen base tensors, by their names in the plain model."""
    mods = adapter_modules(model)
    return {_base_name(k, mods): v.detach() for k, v in model.state_dict().items()
            if not is_adapter_key(k)}


def set_scale(model: nn.Module, scale: float) -> None:
    """Apply every adapter of ``model`` at ``scale`` (0: the base model)."""
    for m in adapter_modules(model).values():
        m.scale = float(scale)


# --------------------------------------------------------------------------- build


def attach(model: nn.Module, cfg: Config, base: BaseWeights, *,
           dtype: torch.dtype) -> dict[str, AdapterModule]:
    """Load ``base`` into ``model`` (checked), freeze it in ``dtype``, inject the adapters."""
    if base.config is not None:
        diff = _model_diff(base.config, cfg)
        expected = {k: v for k, v in model.state_dict().items()}
        try:
            check_tensors(expected, base.tensors, f"base {base.path}")
        except AdapterError as e:
            raise AdapterError(f"{e}\nthe base checkpoint was trained with a different model:\n"
                               + "\n".join(diff) + "\ncopy the base's model section into this "
                               "config") from None
    else:
        check_tensors(model.state_dict(), base.tensors, f"base {base.path}")
    model.load_state_dict(base.tensors)
    model.requires_grad_(False)
    for p in model.parameters():
        p.data = p.data.to(dtype)
    adapters = inject(model, cfg.adapter)
    return adapters


@dataclass
class AdapterRun(Weights):
    """The adapter side of a training run (``TrainState.weights``): the trainer saves,
    restores and checks the adapter's tensors through it."""

    cfg: AdapterConfig
    modules: dict[str, AdapterModule]
    base: BaseWeights
    frozen_hash: str
    clamps: int = 0
    max_ratio: float = 0.0
    max_ratio_module: str | None = None
    last_ratios: dict[str, float] = field(default_factory=dict)

    # ..................................................................... setup

    @classmethod
    def prepare(cls, cfg: Config, model: nn.Module) -> "AdapterRun":
        """Turn a freshly built ``model`` into base + adapter for ``cfg.adapter``."""
        base = load_base(cfg.adapter.base, cfg.adapter.use_ema_base)
        device = next(model.parameters()).device
        modules = attach(model, cfg, base, dtype=DTYPES[cfg.adapter.base_precision])
        model.to(device)
        run = cls(cfg.adapter, modules, base, tensor_hash(base_tensors(model)))
        base.tensors = {}  # the model holds them now; do not keep a second copy
        n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
        n_all = sum(p.numel() for p in model.parameters())
        print(f"adapter: {cfg.adapter.kind} on {len(modules)} modules, {n_train:,} trainable "
              f"of {n_all:,} parameters ({100 * n_train / n_all:.2f}%); base {base.path} "
              f"({base.source}, {cfg.adapter.base_precision}, sha256 {base.sha256[:12]})")
        return run

    def info(self) -> dict[str, Any]:
        """What state.json records about the adapter and its base."""
        return {"kind": self.cfg.kind, "base_path": self.base.path,
                "base_source": self.base.source, "base_sha256": self.base.sha256,
                "frozen_sha256": self.frozen_hash, "modules": sorted(self.modules),
                "clamps": self.clamps, "max_delta_ratio_seen": self.max_ratio,
                "max_delta_ratio_module": self.max_ratio_module}

    # ..................................................................... checkpoints

    def tensors(self, state: Any) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(model, EMA) tensors a checkpoint holds: the adapter's only."""
        return adapter_tensors(state.model), adapter_tensors(state.ema.module)

    def restore(self, state: Any, c: ckpt.Checkpoint) -> None:
        """Load an adapter checkpoint into ``state`` after checking it was trained on this
        very base."""
        check_base(c, self.base.sha256, self.base.path)
        load_adapter(state.model, c.model, f"{c.path}/model.safetensors")
        load_adapter(state.ema.module, c.ema, f"{c.path}/ema.safetensors")
        saved = c.state.get("adapter") or {}
        self.clamps = int(saved.get("clamps", 0))
        self.max_ratio = float(saved.get("max_delta_ratio_seen", 0.0))
        self.max_ratio_module = saved.get("max_delta_ratio_module")

    def verify(self, state: Any) -> None:
        """Before a checkpoint: re-hash the frozen base; a change is an incident that stops
        the run."""
        now = tensor_hash(base_tensors(state.model))
        if now == self.frozen_hash:
            return
        f = AdapterBaseModified.new(expected_sha256=self.frozen_hash, found_sha256=now)
        inc = state.guard.record(f, "abort") if state.guard is not None else None
        raise GuardAbort(f"the frozen base weights changed at step {state.step} (sha256 "
                         f"{self.frozen_hash[:12]} -> {now[:12]}); something wrote into them. "
                         "The run stops so no checkpoint pairs this adapter with a base it "
                         "was not trained on", inc)

    # ..................................................................... the guard

    def reads_at(self, step: int) -> bool:
        every = self.cfg.monitor_every
        return bool(every and step % every == 0 and self.modules)

    def after_update(self, state: Any) -> None:
        """After an applied update: |dW|/|W| per adapted module; rescale any delta past
        ``max_delta_ratio`` (model and EMA) and record it as an incident. One host sync."""
        if self.reads_at(state.step):
            clamp_deltas(self, state, self.modules, adapter_modules(state.ema.module))

    def sampling_context(self, state: Any):
        """Autocast for in-training sample grids when the base is not fp32."""
        return autocast(self.cfg.base_precision, state.device)


@torch.no_grad()
def clamp_deltas(owner: Any, state: Any, modules: dict[str, Any], ema_modules: dict[str, Any]
                 ) -> None:
    """The adapter delta guard: ``delta_ratio()`` of every module of ``modules`` (one host
    sync); those past ``owner.cfg.max_delta_ratio`` (NaN included) are shrunk to the limit,
    with their namesakes in ``ema_modules``, and one ``adapter_delta_clamp`` incident names
    the worst. ``owner`` keeps the counters (clamps, max_ratio, max_ratio_module,
    last_ratios): an :class:`AdapterRun`, or the SD hypernetwork's weights."""
    if not modules:
        return
    names = list(modules)
    ratios = hostsync.values(torch.stack([modules[n].delta_ratio() for n in names]))
    owner.last_ratios = dict(zip(names, ratios))
    worst = max(range(len(names)), key=lambda i: ratios[i])
    if ratios[worst] > owner.max_ratio:
        owner.max_ratio, owner.max_ratio_module = ratios[worst], names[worst]
    limit = owner.cfg.max_delta_ratio
    over = [i for i, r in enumerate(ratios) if limit and not r <= limit]  # NaN is over too
    if not over:
        return
    ema_mods = ema_modules
    for i in over:
        r = ratios[i]
        factor = limit / r if r == r and r != float("inf") else 0.0
        modules[names[i]].shrink(factor)
        e = ema_mods.get(names[i])
        if e is not None:
            er = float(e.delta_ratio())
            if not er <= limit:
                e.shrink(limit / er if er == er and er != float("inf") else 0.0)
    owner.clamps += 1
    msg = (f"adapter: step {state.step}: |dW|/|W| of {names[worst]} reached "
           f"{ratios[worst]:.3g} > adapter.max_delta_ratio={limit:g}; rescaled "
           f"{len(over)} module(s) to the limit")
    if state.guard is not None:
        f = AdapterDeltaClamp.new(module=names[worst], ratio=ratios[worst],
                                  max_delta_ratio=limit, modules=[names[i] for i in over],
                                  ratios=[ratios[i] for i in over])
        state.guard.record(f, "rescale_delta", cost={"modules_rescaled": len(over)})
    log.warning(msg)


def check_base(c: ckpt.Checkpoint, sha256: str, path: str) -> None:
    """Refuse an adapter checkpoint whose recorded base differs from the one loaded."""
    rec = c.state.get("adapter") or {}
    if rec.get("base_sha256") != sha256:
        raise AdapterError(
            f"{c.path} was trained on a different base: it records base {rec.get('base_path')} "
            f"with tensor sha256 {str(rec.get('base_sha256'))[:12]}..., but {path} has "
            f"{sha256[:12]}...; point adapter.base (or --base) at the base it was trained on")


def load_adapter(model: nn.Module, tensors: dict[str, torch.Tensor], what: str) -> None:
    """Load adapter ``tensors`` into a wrapped model; every key and shape checked."""
    expected = adapter_tensors(model)
    check_tensors(expected, tensors, what)
    model.load_state_dict(tensors, strict=False)


def share_frozen_memo(model: nn.Module) -> dict[int, Any]:
    """A deepcopy memo under which copies of ``model`` share its frozen parameters (the
    EMA of an adapter run holds the adapter only, not a second copy of the base)."""
    return {id(p): p for p in model.parameters() if not p.requires_grad}


# --------------------------------------------------------------------------- merge


@torch.no_grad()
def merge_into_base(model: nn.Module) -> nn.Module:
    """Bake every LoRA delta (at its current scale) into its base layer and put the plain
    layers back, in place; the result has the base model's structure and key names, fp32.

    Raises:
        AdapterError: hypernetwork adapters (nonlinear: there is no weight to bake them into).
    """
    mods = adapter_modules(model)
    if any(m.kind == "hypernetwork" for m in mods.values()):
        raise AdapterError(HYPER_NO_MERGE)
    for name, m in mods.items():
        base = m.base
        w = m.merged_weight()
        base.weight = nn.Parameter(w, requires_grad=False)
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, base)
    return model.float()


# --------------------------------------------------------------------------- loading / merge


def build_adapted(c: ckpt.Checkpoint, cfg: Config, *, use_ema: bool = True,
                  base: str | Path | None = None) -> nn.Module:
    """The model of adapter checkpoint ``c`` (base + adapter, fp32, on the CPU, scale 1).

    Args:
        c: a loaded adapter checkpoint.
        cfg: its config.
        use_ema: the EMA adapter weights (else the raw ones).
        base: the base weights' path, when they moved since training (default: the path
            the checkpoint records); their sha256 must match the recorded one.
    """

    rec = c.state.get("adapter") or {}
    path = base or rec.get("base_path") or cfg.adapter.base
    try:
        weights = load_base(path, cfg.adapter.use_ema_base)
    except AdapterError as e:
        raise AdapterError(f"{c.path} is an adapter checkpoint and needs its base weights: "
                           f"{e}; pass the base's new location (--base PATH)") from None
    check_base(c, weights.sha256, weights.path)
    model = build_model(cfg.model, image_size=cfg.data.image_size, channels=cfg.data.channels)
    attach(model, cfg, weights, dtype=torch.float32)
    load_adapter(model, c.ema if use_ema else c.model,
                 f"{c.path}/{'ema' if use_ema else 'model'}.safetensors")
    return model.eval().requires_grad_(False)


def merge_checkpoint(checkpoint: str | Path, out: str | Path, *, scale: float = 1.0,
                     base: str | Path | None = None) -> Path:
    """Bake a LoRA checkpoint into its base weights and write a full steadydiff checkpoint
    (model = base + raw adapter, EMA = base + EMA adapter, both at ``scale``) under
    ``out/checkpoints/``; ``steadydiff sample`` and :func:`steadydiff.load` read it like any
    run. Refuses an existing ``out``. Returns the checkpoint directory."""

    out = Path(out)
    if out.exists():
        raise AdapterError(f"--out {out} already exists; choose a new directory (nothing is "
                           "overwritten)")
    path = ckpt.resolve_checkpoint(checkpoint)
    c = ckpt.load_checkpoint(path, "cpu", weights_only=True)
    cfg = validate(c.state["config"], f"{path}/state.json config")
    if cfg.model.pretrained and cfg.adapter.kind == "lora":
        # peft's LoRA over a diffusers model: already in the ecosystem's format, which the
        # ecosystem's own tools fuse; a steadydiff checkpoint holds no SD base to bake into
        raise AdapterError(
            f"{path} is a Stable Diffusion LoRA run (model.pretrained="
            f"{cfg.model.pretrained}); `steadydiff merge` bakes steadydiff's own UNet/DiT "
            f"adapters. This run's LoRA is already written for the ecosystem: "
            f"RUN/lora/pytorch_lora_weights.safetensors. To bake it into the base, load it "
            f"with diffusers (pipe.load_lora_weights('RUN/lora'); pipe.fuse_lora(); "
            f"pipe.save_pretrained(NEW)); `steadydiff sample RUN` applies it as it is")
    if cfg.adapter.kind == "hypernetwork":
        raise AdapterError(f"{path}: {HYPER_NO_MERGE}")
    if cfg.adapter.kind == "none":
        raise AdapterError(f"{path} is not an adapter checkpoint (its adapter.kind is none); "
                           "there is nothing to merge")
    merged = {}
    for which in ("model", "ema"):
        m = build_adapted(c, cfg, use_ema=which == "ema", base=base)
        set_scale(m, scale)
        merged[which] = merge_into_base(m)
    rec = c.state.get("adapter") or {}
    plain = validate({**cfg.to_dict(), "adapter": AdapterConfig().model_dump(mode="json")})
    state = {"step": c.step, "batches_consumed": 0, "images_seen": 0,
             "ema": {"num_updates": c.state.get("ema", {}).get("num_updates", 0)},
             "scaler": None, "precision": "fp32", "grad_accum": cfg.train.grad_accum,
             "bad_images": [], "guard": None, "config": plain.to_dict(),
             "torch": torch.__version__,
             "merged_from": {"adapter_checkpoint": str(path.resolve()), "scale": scale,
                             "base_path": rec.get("base_path"),
                             "base_sha256": rec.get("base_sha256")}}
    from ..files import atomic_dir
    from ..rundir import RunDir

    # the whole run folder is written beside --out and renamed into place: a full disk or a
    # kill leaves no half run (and no temporary: see files.atomic_output)
    with atomic_dir(out) as tmp:
        written = ckpt.save_checkpoint(tmp / "checkpoints", c.step, model=merged["model"],
                                       ema=merged["ema"],
                                       optimizer=build_optimizer(
                                           merged["model"].requires_grad_(True), cfg.optim),
                                       state=state, keep=1)
        (tmp / "config.yaml").write_text(plain.to_yaml())
        RunDir(tmp).mark()
    return out / written.relative_to(tmp)
