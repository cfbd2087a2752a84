"""Power-function EMA profiles for post-hoc EMA (Karras et al. 2024, "Analyzing and Improving
the Training Dynamics of Diffusion Models", EDM2 §3.1 and appendix C.1).

A power-function EMA with exponent ``gamma`` averages the weights ``theta_1 .. theta_t`` of
the first ``t`` updates with weights roughly proportional to ``tau ** gamma``: its length grows
with the run, so no fixed decay is too slow for a short run. After update ``t`` it is

    ema_t = beta_t * ema_{t-1} + (1 - beta_t) * theta_t,    beta_t = (1 - 1/t) ** (gamma + 1)

(``beta_1 = 0``: the first update copies the weights). Its length is given as ``sigma_rel``,
the standard deviation of the averaging kernel relative to the run's length:
``sigma_rel^2 = (gamma + 1) / ((gamma + 2)^2 (gamma + 3))`` (EDM2 eq. 3).

:class:`PowerProfiles` keeps one such EMA per configured ``sigma_rel`` (EDM2's defaults 0.05
and 0.10) over the trainable parameters. It is updated by :meth:`steadydiff.trainer.ema.EMA.update`,
so it sees exactly the updates the EMA sees: only steps the guard let through
(``Update.commit``), never a skipped or rolled-back one; its tensors travel in the EMA state of
the guard's snapshot ring (a rollback restores them) and in every checkpoint
(``posthoc.safetensors``: exact resume). :meth:`PowerProfiles.store` writes a snapshot of all
profiles to ``RUN/posthoc/step_XXXXXXXX.safetensors`` (atomically) and records it, with its
sha256, in the profiles' state, so the checkpoint's state.json lists every snapshot the
reconstruction (:mod:`steadydiff.posthoc`) may use. The snapshot folder lives outside
``checkpoints/``: keep-last-K rotation never touches it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from . import checkpoint as ckpt

SNAPSHOT_FORMAT = 1


def gated_weight(weight: float, gate: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``weight`` where ``gate`` is True, else 0 (0-dim, ``like``'s device and dtype; no
    host-to-device copy)."""
    return torch.where(gate.to(like.device), weight, 0.0).to(like.dtype)


def sigma_rel_to_gamma(sigma_rel: float) -> float:
    """The exponent ``gamma > 0`` of the power-function EMA of relative width ``sigma_rel``.

    Solves ``sigma_rel^2 (gamma+2)^2 (gamma+3) = gamma + 1``, i.e. the cubic
    ``gamma^3 + 7 gamma^2 + (16 - s) gamma + (12 - s) = 0`` with ``s = sigma_rel^-2``, for its
    largest real root (EDM2 appendix C.1).

    Raises:
        ValueError: ``sigma_rel`` outside ``(0, sqrt(1/12))`` (no ``gamma > 0`` has it).
    """
    from ..config import SIGMA_REL_MAX

    if not 0.0 < sigma_rel < SIGMA_REL_MAX:
        raise ValueError(f"sigma_rel must be in (0, {SIGMA_REL_MAX:.4f}), got {sigma_rel:g}")
    s = sigma_rel ** -2
    roots = np.roots([1.0, 7.0, 16.0 - s, 12.0 - s])
    return float(max(r.real for r in roots if abs(r.imag) < 1e-9))


def gamma_to_sigma_rel(gamma: float) -> float:
    """``sigma_rel`` of the power-function EMA with exponent ``gamma`` (EDM2 eq. 3)."""
    return math.sqrt((gamma + 1) / ((gamma + 2) ** 2 * (gamma + 3)))


def beta(gamma: float, t: int) -> float:
    """The decay of update number ``t`` (1-based) of a power-function EMA."""
    return (1.0 - 1.0 / t) ** (gamma + 1.0)


def profile_weights(gamma: float, n: int, length: int | None = None) -> np.ndarray:
    """The exact weights ``w[tau-1]`` of ``theta_tau`` (tau = 1..n) in the power-function EMA
    after ``n`` updates: ``w_tau = (1 - beta_tau) * prod_{s=tau+1..n} beta_s`` (float64, sum 1).
    ``length`` pads with zeros up to that many updates (a snapshot taken before the end)."""
    length = n if length is None else length
    out = np.zeros(length, np.float64)
    if n < 1:
        return out
    t = np.arange(1, n + 1, dtype=np.float64)
    log_b = np.zeros(n)
    log_b[1:] = (gamma + 1.0) * np.log1p(-1.0 / t[1:])   # beta_1 = 0: log_b[0] unused
    one_minus_b = -np.expm1(log_b)
    one_minus_b[0] = 1.0
    csum = np.cumsum(log_b)                               # csum[k] = sum_{s<=k+1} log beta_s
    tail = csum[-1] - csum                                # sum_{s=tau+1..n} log beta_s
    out[:n] = one_minus_b * np.exp(tail)
    return out


class PowerProfiles:
    """One power-function EMA of the trainable parameters per ``sigma_rel``.

    Args:
        named: the trainable parameters ``(name, tensor)`` the profiles average.
        sigma_rels: their relative widths (each in ``(0, 0.2886)``).
    """

    def __init__(self, named: Sequence[tuple[str, torch.Tensor]], sigma_rels: Sequence[float]):
        self.sigma_rels = tuple(float(s) for s in sigma_rels)
        self.gammas = tuple(sigma_rel_to_gamma(s) for s in self.sigma_rels)
        self.names = [n for n, _ in named]
        self.avgs = [[p.detach().clone() for _, p in named] for _ in self.sigma_rels]
        self.num_updates = 0
        self.snapshots: list[dict[str, Any]] = []  # the stored ones: {step, num_updates, file, ...}

    @torch.no_grad()
    def update(self, src: list[torch.Tensor], gate: torch.Tensor | None = None) -> None:
        """Average the current weights ``src`` (the order of ``names``) into every profile;
        ``gate`` (0-dim bool on the device): False leaves them as they are (no host read)."""
        t = self.num_updates + 1
        for g, avg in zip(self.gammas, self.avgs):
            # avg += (1 - beta_t) * (theta - avg); beta_1 = 0 copies theta exactly
            w = 1.0 - beta(g, t)
            torch._foreach_lerp_(avg, src, w if gate is None else gated_weight(w, gate, avg[0]))
        self.num_updates = t

    def tensors(self) -> list[torch.Tensor]:
        """Every profile tensor (for finiteness checks and rank fingerprints)."""
        return [p for avg in self.avgs for p in avg]

    def tensor_dict(self) -> dict[str, torch.Tensor]:
        """``{"<i>/<name>": tensor}`` for profile ``i`` (checkpoints and snapshot files)."""
        return {f"{i}/{n}": p for i, avg in enumerate(self.avgs) for n, p in zip(self.names, avg)}

    @torch.no_grad()
    def load_tensor_dict(self, sd: dict[str, torch.Tensor]) -> None:
        want = set(self.tensor_dict())
        if set(sd) != want:
            missing, extra = sorted(want - set(sd))[:3], sorted(set(sd) - want)[:3]
            raise ckpt.CheckpointError(
                f"post-hoc EMA state does not match the model's trainable parameters and "
                f"train.ema_posthoc_sigma_rels (missing {missing}, unexpected {extra})")
        for i, avg in enumerate(self.avgs):
            for n, p in zip(self.names, avg):
                p.copy_(sd[f"{i}/{n}"])

    def meta(self) -> dict[str, Any]:
        """The JSON-able part (state.json): counters and the list of stored snapshots."""
        return {"sigma_rels": list(self.sigma_rels), "num_updates": self.num_updates,
                "snapshots": [dict(s) for s in self.snapshots]}

    def load_meta(self, meta: dict[str, Any]) -> None:
        saved = tuple(float(s) for s in meta["sigma_rels"])
        if saved != self.sigma_rels:
            raise ckpt.CheckpointError(
                f"the checkpoint's post-hoc EMA profiles have sigma_rels {list(saved)}, the "
                f"config {list(self.sigma_rels)}: set train.ema_posthoc_sigma_rels="
                f"{list(saved)} to resume")
        self.num_updates = int(meta["num_updates"])
        self.snapshots = [dict(s) for s in meta["snapshots"]]

    def state(self) -> dict[str, Any]:
        """Everything (tensors and meta): what the guard's snapshot ring keeps."""
        return {"tensors": self.tensor_dict(), **self.meta()}

    def load_state(self, state: dict[str, Any]) -> None:
        self.load_meta(state)
        self.load_tensor_dict(state["tensors"])

    def store(self, folder: Path, step: int) -> Path:
        """Write a snapshot of every profile as ``folder/step_XXXXXXXX.safetensors``
        (atomically: a temporary file, fsync, rename) and record it. A snapshot of the same
        step is replaced (a rerun after a rollback or a resume writes the same step again)."""
        name = f"{ckpt.checkpoint_name(step)}.safetensors"
        # one metadata key: safetensors writes its metadata map in an order that changes
        # between processes, and a resumed run must write the same bytes
        meta = {"posthoc": json.dumps({"format": SNAPSHOT_FORMAT, "step": step,
                                       "num_updates": self.num_updates,
                                       "sigma_rels": list(self.sigma_rels)}, sort_keys=True)}
        path = ckpt.save_tensors_atomic(folder / name, self.tensor_dict(), meta)
        entry = {"step": step, "num_updates": self.num_updates, "file": name,
                 "size": path.stat().st_size, "sha256": ckpt.sha256_of(path)}
        self.snapshots = [s for s in self.snapshots if s["step"] < step] + [entry]
        return path
