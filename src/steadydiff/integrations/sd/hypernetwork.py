"""Stable Diffusion web-UI (A1111) hypernetworks on a diffusers UNet's cross-attention.

The design (NovelAI 2022, as AUTOMATIC1111's ``modules/hypernetworks/hypernetwork.py``
trains and loads it): per *context width* (768 for SD 1.x, 1024 for SD 2.x) two small MLPs,
``HypernetworkModule``s, transform the context that feeds the keys and the values of every
cross-attention layer of that width, queries untouched::

    k = to_k(c + s * mlp_k(c)),   v = to_v(c + s * mlp_v(c))

Each MLP is ``Linear(d*l0, d*l1), act, ..., Linear(d*l_{n-1}, d*l_n)`` for the layer
structure ``[1, hidden_mult, 1]`` (A1111's default ``1, 2, 1``), no activation after the
last layer (A1111's ``activate_output=False``), in a ``nn.Sequential`` named ``linear`` so its
tensors carry A1111's names (``linear.0.weight`` ...). One pair serves all layers of a width,
as in A1111. The scale ``s`` is A1111's multiplier (``--adapter-scale``; 1 while training).

Different from A1111, on purpose: the last Linear starts at zero (A1111: N(0, 0.01)), so the
untrained hypernetwork adds exact zeros and step 0 is the base model bit for bit.

The wrapper sits on ``attn2.to_k`` / ``attn2.to_v`` (their input is the context), so
diffusers' attention processors, SDPA and steadydiff's upcast-aware one, run unchanged.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ...adapters.core import clamp_deltas
from ...adapters.layers import AdapterModule
from ...trainer.checkpoint import Checkpoint, CheckpointError
from .model import _SDWeights, _trainable
from .numbered import mark_best, numbered_files, prune, publish

__all__ = ["ACTIVATIONS", "HypernetworkModule", "SDHypernetwork", "HyperKV",
           "add_hypernetwork", "HypernetworkWeights", "hypernetwork_file", "HYPER_FILE"]

HYPER_FILE = "hypernetwork.safetensors"

# A1111's activation names -> (module, Lipschitz constant). A1111's "swish" is Hardswish.
ACTIVATIONS: dict[str, tuple[type[nn.Module] | None, float]] = {
    "linear": (None, 1.0), "relu": (nn.ReLU, 1.0), "leakyrelu": (nn.LeakyReLU, 1.0),
    "elu": (nn.ELU, 1.0), "swish": (nn.Hardswish, 1.5), "tanh": (nn.Tanh, 1.0),
    "sigmoid": (nn.Sigmoid, 0.25), "mish": (nn.Mish, 1.1)}


class HypernetworkModule(nn.Module):
    """A1111's ``HypernetworkModule``: ``c -> c + linear(c)`` (the residual is applied by
    :class:`HyperKV`, with the scale)."""

    def __init__(self, dim: int, structure: tuple[float, ...], activation: str) -> None:
        super().__init__()
        act, self.lipschitz = ACTIVATIONS[activation]
        layers: list[nn.Module] = []
        for i in range(len(structure) - 1):
            layers.append(nn.Linear(int(dim * structure[i]), int(dim * structure[i + 1])))
            if act is not None and i < len(structure) - 2:
                layers.append(act())
        self.linear = nn.Sequential(*layers)
        lins = self.linears()
        for m in lins:  # A1111's "Normal" initialisation ...
            nn.init.normal_(m.weight, std=0.01)
            nn.init.zeros_(m.bias)
        nn.init.zeros_(lins[-1].weight)  # ... but the last layer zero: exact base at step 0
        # the last real context seen in training (one sample, detached; not state): what
        # the delta guard measures the change on
        self.probe: Tensor | None = None

    def linears(self) -> list[nn.Linear]:
        return [m for m in self.linear if isinstance(m, nn.Linear)]

    def forward(self, c: Tensor) -> Tensor:
        if self.training:
            self.probe = c.detach()[:1]
        return self.linear(c)

    @torch.no_grad()
    def change_ratio(self, c: Tensor | None = None) -> Tensor:
        """‖mlp(c)‖ / ‖c‖ (Frobenius over the context's rows), the relative change the
        hypernetwork makes to the keys' and values' input ``c + mlp(c)``, on ``c``: the
        last real context seen in training, else a fixed N(0, 1) context of 8 rows (the
        same every call). 0-dim fp32 on the weights' device, no host sync."""
        w = self.linears()[0].weight
        if c is None:
            c = self.probe
        if c is None:
            g = torch.Generator(device="cpu").manual_seed(0)
            c = torch.randn(8, w.shape[1], generator=g).to(w.device)
        c = c.reshape(-1, c.shape[-1]).to(w.device, w.dtype)
        with torch.autocast(w.device.type, enabled=False):
            out = self.linear(c).float()
        return out.norm() / c.float().norm().clamp_min(1e-12)

    @torch.no_grad()
    def gain_bound(self) -> Tensor:
        """An upper bound of |mlp(c) - mlp(0)| / |c|: the product of the Linears' Frobenius
        norms (each at least its spectral norm) x the activation's Lipschitz constant per
        hidden layer. 0-dim fp32, no host sync."""
        lins = self.linears()
        g = torch.ones((), device=lins[0].weight.device)
        for m in lins:
            g = g * m.weight.float().norm()
        return g * self.lipschitz ** (len(lins) - 1)

    def delta_ratio(self) -> Tensor:
        """What the delta guard reads: :meth:`change_ratio` on real contexts (training runs
        at scale 1). Not :meth:`gain_bound`: at A1111's N(0, 0.01) initialisation that bound
        is about 10 for a 768-wide MLP while the real change is about 0.08, so a limit of 1
        fired on every healthy step."""
        return self.change_ratio()

    @torch.no_grad()
    def shrink(self, factor: float) -> None:
        last = self.linears()[-1]
        last.weight.mul_(factor)
        last.bias.mul_(factor)


class SDHypernetwork(nn.Module):
    """The hypernetwork: ``layers[str(width)] = ModuleList([mlp_k, mlp_v])`` (A1111's
    ``hypernetwork.layers[width] = [k, v]``)."""

    def __init__(self, widths: list[int], structure: tuple[float, ...], activation: str) -> None:
        super().__init__()
        self.structure, self.activation = tuple(structure), activation
        self.layers = nn.ModuleDict({str(d): nn.ModuleList(
            [HypernetworkModule(d, structure, activation) for _ in range(2)])
            for d in sorted(set(widths))})

    def guarded(self) -> dict[str, HypernetworkModule]:
        """{"hypernetwork.768.k": mlp, ...}: what the delta guard watches and names."""
        return {f"hypernetwork.{d}.{kv}": pair[i] for d, pair in self.layers.items()
                for i, kv in enumerate("kv")}

    def a1111_tensors(self) -> dict[str, Tensor]:
        """Tensors under A1111's names: ``{width}.{0: k, 1: v}.linear.{i}.{weight|bias}``."""
        return {f"{d}.{i}.{k}": v.detach().to("cpu", torch.float32).contiguous()
                for d, pair in self.layers.items() for i, m in enumerate(pair)
                for k, v in m.state_dict().items()}


class HyperKV(AdapterModule):
    """``to_k`` / ``to_v`` of a cross-attention layer with the context transformed first:
    ``base(c + scale * mlp(c))``. The MLP is shared by every layer of its width and owned by
    :class:`SDHypernetwork` (held here unregistered, so its tensors have one name)."""

    kind = "hypernetwork"

    def __init__(self, base: nn.Linear, mlp: HypernetworkModule) -> None:
        super().__init__(base)
        object.__setattr__(self, "mlp", mlp)  # not a submodule: SDHypernetwork owns it

    def forward(self, c: Tensor) -> Tensor:
        if self.scale == 0:  # the base model exactly
            return self.base(c)
        d = self.mlp(c.to(self.mlp.linears()[0].weight.dtype)
                     if not torch.is_autocast_enabled() else c)
        return self.base(c + (d * self.scale).to(c.dtype))

    def delta_ratio(self) -> Tensor:
        return self.mlp.change_ratio() * abs(self.scale)

    def shrink(self, factor: float) -> None:
        self.mlp.shrink(factor)


def cross_attention_layers(unet: nn.Module) -> dict[str, nn.Module]:
    """{name: diffusers Attention} of the UNet's cross-attention layers (``attn2``)."""
    return {n: m for n, m in unet.named_modules()
            if getattr(m, "is_cross_attention", False) and hasattr(m, "to_k")}


def add_hypernetwork(unet: nn.Module, *, targets: tuple[str, ...], hidden_mult: float,
                     activation: str) -> tuple[SDHypernetwork, list[str]]:
    """Freeze ``unet`` and wrap ``to_k``/``to_v`` of the cross-attention layers whose names
    match ``targets`` (``adapter.targets`` globs / ``re:``). Returns the hypernetwork (to be
    registered on the denoiser) and the wrapped layers' names.

    Raises:
        ValueError: the UNet has no cross-attention, or no pattern matches one.
    """
    from ...adapters.core import _matches

    layers = cross_attention_layers(unet)
    if not layers:
        raise ValueError("adapter.kind=hypernetwork transforms the text context of the UNet's "
                         "cross-attention (attn2), but this UNet has none (no CrossAttn* "
                         "blocks); use adapter.kind=lora")
    chosen = {n: m for n, m in layers.items() if any(_matches(n, p) for p in targets)}
    unused = [p for p in targets if not any(_matches(n, p) for n in layers)]
    if unused or not chosen:
        shown = ", ".join(list(layers)[:6]) + (f" ... ({len(layers)} in all)"
                                               if len(layers) > 6 else "")
        raise ValueError(f"adapter.targets {unused or list(targets)} match none of the UNet's "
                         f"cross-attention layers (a hypernetwork's targets name attention "
                         f"layers, not projections); e.g. {shown}; '*' selects them all")
    unet.requires_grad_(False)
    net = SDHypernetwork([m.to_k.in_features for m in chosen.values()],
                         (1.0, float(hidden_mult), 1.0), activation)
    dev = next(unet.parameters()).device
    net.to(dev)
    for m in chosen.values():
        pair = net.layers[str(m.to_k.in_features)]
        m.to_k = HyperKV(m.to_k, pair[0])
        m.to_v = HyperKV(m.to_v, pair[1])
    return net, list(chosen)


def hypernetwork_file(net: SDHypernetwork, path: Path, *, name: str, step: int,
                      base: str) -> Path:
    """Write ``path`` (safetensors, never a pickle): A1111's tensor names and, as string
    metadata, the fields A1111's ``.pt`` dict holds beside them (``layer_structure``,
    ``activation_func``, ``is_layer_norm``, ``weight_initialization``, ``use_dropout``,
    ``activate_output``, ``step``, ``name``, ``sd_checkpoint_name``). Atomic."""
    from safetensors.torch import save_file

    sd = net.a1111_tensors()
    bad = [k for k, v in sd.items() if not torch.isfinite(v).all()]
    if bad:
        raise CheckpointError(f"the hypernetwork has non-finite weights ({bad[0]}): not written")
    meta = {"format": "a1111-hypernetwork", "name": name, "step": str(step),
            "layer_structure": str(list(net.structure)), "activation_func": net.activation,
            "is_layer_norm": "False", "weight_initialization": "Normal",
            "use_dropout": "False", "activate_output": "False",
            "sizes": str(sorted(int(d) for d in net.layers)), "sd_checkpoint_name": base}
    from ...files import atomic_output

    with atomic_output(path) as tmp:
        save_file(sd, str(tmp), metadata=meta)
    return path


class HypernetworkWeights(_SDWeights):
    """An SD hypernetwork run: checkpoints hold the hypernetwork (and its EMA); after each
    update the delta guard (adapter.max_delta_ratio) watches every MLP; exports write
    ``RUN/hypernetwork/hypernetwork.safetensors``."""

    def __init__(self, cfg, base: Path, layers: list[str]) -> None:
        self.cfg, self.base, self.layers = cfg, base, layers
        self.clamps, self.max_ratio, self.max_ratio_module = 0, 0.0, None
        self.last_ratios: dict[str, float] = {}

    def tensors(self, state: Any) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        own = _trainable(state.model)
        ema = dict(state.ema.module.named_parameters())
        return {n: p.detach() for n, p in own.items()}, {n: ema[n].detach() for n in own}

    def restore(self, state: Any, c: Checkpoint) -> None:
        own = _trainable(state.model)
        ema = dict(state.ema.module.named_parameters())
        for what, saved in (("model", c.model), ("EMA", c.ema)):
            if set(saved) != set(own) or any(saved[n].shape != p.shape for n, p in own.items()):
                raise CheckpointError(
                    f"{c.path}: its hypernetwork {what} tensors do not match this run's "
                    "(adapter.targets, adapter.hidden_mult, adapter.hyper_activation or "
                    "model.pretrained changed since it was written)")
        with torch.no_grad():
            for n, p in own.items():
                p.copy_(c.model[n])
                ema[n].copy_(c.ema[n])
        saved = c.state.get("adapter") or {}
        self.clamps = int(saved.get("clamps", 0))
        self.max_ratio = float(saved.get("max_delta_ratio_seen", 0.0))
        self.max_ratio_module = saved.get("max_delta_ratio_module")

    def info(self) -> dict[str, Any]:
        return {"kind": "hypernetwork", "base": str(self.base), "layers": len(self.layers),
                "hidden_mult": self.cfg.hidden_mult, "activation": self.cfg.hyper_activation,
                "clamps": self.clamps, "max_delta_ratio_seen": self.max_ratio,
                "max_delta_ratio_module": self.max_ratio_module}

    # the delta guard (adapters/core.py clamp_deltas, as for our own models' adapters)
    def reads_at(self, step: int) -> bool:
        every = self.cfg.monitor_every
        return bool(every and step % every == 0)

    def after_update(self, state: Any) -> None:
        if self.reads_at(state.step):
            model = state.model.hypernetwork.guarded()
            ema = state.ema.module.hypernetwork.guarded()
            for n, m in ema.items():  # the EMA's MLPs measured on the same real contexts
                m.probe = model[n].probe
            clamp_deltas(self, state, model, ema)

    def export(self, state: Any, root: Path, final: bool) -> Path | None:
        model = state.ema.module if state.cfg.sample.use_ema else state.model
        files = self.write(model, state.cfg, state.step, state.precision, root / "hypernetwork",
                           root.name)
        # RUN/hypernetwork/<name>-stepNNNNNNNN.safetensors, kept per adapter.keep_files
        publish(files, root / "hypernetwork", state.step)
        prune(root / "hypernetwork", set(files.values()), state.cfg.adapter.keep_files)
        return next(iter(files))

    def mark_best(self, state: Any, root: Path, info: dict[str, Any]) -> Path | None:
        folder, stems = root / "hypernetwork", self.stems(state.cfg, root.name)
        have = numbered_files(folder, stems).get(state.step)
        if not have:
            self.export(state, root, False)
            have = numbered_files(folder, stems).get(state.step, [])
        return mark_best(folder, state.step, have, info)

    @staticmethod
    def stems(cfg: Any, name: str) -> dict[str, str]:
        return {name: "a1111"}

    def write(self, model: nn.Module, cfg: Any, step: int, precision: str, out: Path,
              name: str) -> dict[Path, str]:
        """Write ``out/hypernetwork.safetensors``; returns ``{file: the numbered stem}``."""
        path = hypernetwork_file(model.hypernetwork, out / HYPER_FILE, name=name, step=step,
                                 base=self.base.name)
        return {path: name}
