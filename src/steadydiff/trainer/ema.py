"""Exponential moving average of the model weights (Polyak averaging).

Updated only after a real optimizer step (a step skipped by the fp16 grad scaler or by the
guard must not pull the average toward unchanged, or worse, non-finite weights).

With ``train.ema_posthoc`` the EMA also carries the post-hoc EMA's power-function profiles
(:class:`~steadydiff.trainer.posthoc.PowerProfiles`, EDM2): they are updated in
:meth:`EMA.update`, so they follow the same path as the EMA (``Update.commit``, only after the
guard verified the step), and their state is part of the EMA's everywhere it is kept.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ..config import TrainConfig
from ..sharding import local
from .posthoc import PowerProfiles, gated_weight


class EMA:
    """A frozen copy of ``model`` whose parameters track ``decay``-weighted averages.

    With ``warmup`` the effective decay is ``min(decay, (1 + n) / (10 + n))`` after ``n``
    updates, so early averages are not dominated by the random init (as in the Karras/ADM
    codebases). Buffers (e.g. fixed position embeddings) are copied, not averaged.
    """

    def __init__(self, model: nn.Module, decay: float, warmup: bool = True, start: int = 0,
                 posthoc_sigma_rels: tuple[float, ...] = ()):
        # Frozen parameters (an adapter run's base) are shared, not copied: the EMA of an
        # adapter run costs the adapter's size, not a second base model.
        frozen = {id(p): p for p in model.parameters() if not p.requires_grad}
        self.module = copy.deepcopy(model, memo=frozen).eval().requires_grad_(False)
        self.shared = {n for n, p in model.named_parameters() if not p.requires_grad}
        self.decay = decay
        self.warmup = warmup
        self.start = start
        self.num_updates = 0
        self._src: list[torch.Tensor] | None = None
        self._dst: list[torch.Tensor] | None = None
        # post-hoc EMA profiles (every update from the first, whatever ``start`` says)
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.posthoc = PowerProfiles(trainable, posthoc_sigma_rels) if posthoc_sigma_rels \
            else None

    @classmethod
    def from_config(cls, model: nn.Module, cfg: TrainConfig) -> "EMA":
        rels = cfg.ema_posthoc_sigma_rels if cfg.ema_posthoc else ()
        return cls(model, cfg.ema_decay, cfg.ema_warmup, cfg.ema_start, rels)

    def current_decay(self) -> float:
        if not self.warmup:
            return self.decay
        n = self.num_updates
        return min(self.decay, (1 + n) / (10 + n))

    @torch.no_grad()
    def update(self, model: nn.Module, step: int, gate: torch.Tensor | None = None) -> None:
        """Average ``model`` into the EMA; before ``start`` the EMA copies the model.
        ``gate`` (0-dim bool on the device): False leaves the averages as they are, without
        a host read (the speculative guard's update; the counter still advances, and the
        guard undoes the whole step when it reads the flag)."""
        if self._src is None:  # the trainable parameters only (frozen ones are shared)
            dst = dict(self.module.named_parameters())
            named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            # FSDP: the model and the EMA are sharded alike; each rank averages its shards
            self._src = [local(p) for _, p in named]
            self._dst = [local(dst[n]) for n, _ in named]
        if self.posthoc is not None:
            self.posthoc.update(self._src, gate)
        if step < self.start:
            if gate is None:
                torch._foreach_copy_(self._dst, self._src)
            else:  # lerp by 1 is an exact copy; by 0 no change
                torch._foreach_lerp_(self._dst, self._src, gate.to(self._dst[0].dtype))
            return
        d = self.current_decay()
        # ema += (1 - d) * (p - ema), one fused kernel over all tensors (a tensor weight of
        # the same value gives the same bits as the scalar one)
        torch._foreach_lerp_(self._dst, self._src, 1.0 - d if gate is None
                             else gated_weight(1.0 - d, gate, self._dst[0]))
        for b_ema, b in zip(self.module.buffers(), model.buffers()):
            b_ema.copy_(b)
        self.num_updates += 1

    def state(self) -> dict:
        """The JSON-able counters (a checkpoint's state.json; tensors are saved apart)."""
        out: dict = {"num_updates": self.num_updates}
        if self.posthoc is not None:
            out["posthoc"] = self.posthoc.meta()
        return out

    def load_state(self, state: dict) -> None:
        """Restore the counters; a post-hoc profile's tensors come with
        ``posthoc.load_tensor_dict`` (a checkpoint's posthoc.safetensors)."""
        self.num_updates = int(state["num_updates"])
        if self.posthoc is not None and state.get("posthoc"):
            self.posthoc.load_meta(state["posthoc"])
