"""The public stability guard: ``Guard`` wraps a model, optimizer and (optionally) an LR
scheduler, GradScaler and EMA, and decides each step whether to ``step``, ``skip``,
``rollback`` or ``abort``.

It works in our trainer and in anyone's loop. Where a plain loop has

    scaler.scale(loss).backward(); scaler.step(opt); scaler.update(); sched.step(); ema.update()

a guarded loop has

    scaler.scale(loss).backward()
    decision = guard.step(loss)          # inspects, then updates (or skips / rolls back)
    if decision.action == "abort": break

and ``guard.step`` does the clipping, the optimizer/scaler/scheduler steps and the EMA update
itself when the step is healthy. Every intervention is an :class:`Incident`, appended to
``RUN_DIR/incidents.jsonl`` with the evidence, the action and its cost.

Per step the guard costs one small host sync (loss, grad norm, per-t-bucket loss sums) and one
fused finiteness reduction over the parameters before the EMA sees them; snapshots every
``snapshot_every`` steps; probes and provenance replays only every N steps or on incidents.
Under DDP each rank's numbers are gathered before any action (one small collective per step),
so every rank decides the same; the replicas' weights are compared by fingerprint every
``rank_check_every`` steps (see docs/distributed.md).
"""

from __future__ import annotations

import json
import math
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal

import torch
import torch.distributed as dist
from torch import nn

from .. import distributed
from ..config import GuardConfig
from . import clipping, probes, provenance
from .detectors import BucketLossSpike, Divergence, Finding, GradSpike, Overflow, RunningStats
from .findings import finding_from_row
from .snapshots import Snapshot, SnapshotRing, restore_into

Action = Literal["step", "skip", "rollback", "abort"]


class GuardAbort(RuntimeError):
    """Instability persisted past the recovery budget (CLI exit code 3)."""

    def __init__(self, message: str, incident: "Incident | None" = None):
        super().__init__(message)
        self.incident = incident


@dataclass
class Incident:
    """One intervention: what was seen, what was done, what it cost."""

    step: int
    kind: str
    severity: str
    evidence: dict[str, Any]
    action: str
    cost: dict[str, Any] = field(default_factory=dict)
    diagnosis: dict[str, Any] = field(default_factory=dict)
    time: float = field(default_factory=time.time)

    def row(self) -> dict[str, Any]:
        return _jsonable(asdict(self))


@dataclass
class Decision:
    """What the guard decided for one step.

    action: ``step`` (the update was applied), ``skip`` (no update; the batch is dropped),
        ``rollback`` (state restored to a verified snapshot), ``abort`` (give up).
    step: the step counter after the decision (it moves back on a rollback).
    data_position: batches consumed; after a rollback the data continues from here.
    skipped_batches: after a rollback, the batch positions that will not be trained on.
    precision: set when the guard changed the precision (fp16 -> bf16 -> fp32).
    """

    action: Action
    step: int
    data_position: int
    loss: float | None = None
    grad_norm: float | None = None
    incident: Incident | None = None
    skipped_batches: range | None = None
    precision: str | None = None
    grad_norm_clipped: float | None = None
    loss_t: list[float | None] | None = None  # mean loss per timestep bucket (this step)


@dataclass
class Progress:
    """The counters a guard rolls back. Our trainer passes its own state (same fields)."""

    step: int = 0
    batches_consumed: int = 0


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, range)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else str(obj)
    if isinstance(obj, torch.Tensor):
        return _jsonable(obj.tolist())
    return obj


class _EMAAdapter:
    """One interface over the EMA kinds people use: ours (``update(model, step)``,
    ``.module``), torch's ``AveragedModel`` (``update_parameters``) and diffusers'
    ``EMAModel`` (``step(parameters)``, ``shadow_params``)."""

    def __init__(self, ema: Any):
        self.ema = ema

    def update(self, model: nn.Module, step: int) -> None:
        e = self.ema
        if hasattr(e, "update") and hasattr(e, "module") and hasattr(e, "num_updates"):
            e.update(model, step)
        elif hasattr(e, "update_parameters"):
            e.update_parameters(model)
        elif hasattr(e, "step") and hasattr(e, "shadow_params"):
            e.step(model.parameters())
        else:
            raise TypeError(f"unsupported EMA object {type(e).__name__}: expected steadydiff's "
                            "EMA, torch.optim.swa_utils.AveragedModel or diffusers' EMAModel")

    def tensors(self) -> list[torch.Tensor]:
        e = self.ema
        if hasattr(e, "shadow_params"):
            return list(e.shadow_params)
        module = e.module if hasattr(e, "num_updates") else e
        return [p for p in module.parameters()]

    def state(self) -> dict[str, Any]:
        e = self.ema
        if hasattr(e, "num_updates") and hasattr(e, "module"):
            shared = getattr(e, "shared", ())  # frozen parameters shared with the model
            return {"module": {k: v for k, v in e.module.state_dict().items()
                               if k not in shared}, "num_updates": e.num_updates}
        return e.state_dict()

    def load(self, state: dict[str, Any]) -> None:
        e = self.ema
        if hasattr(e, "num_updates") and hasattr(e, "module"):
            e.module.load_state_dict(state["module"], strict=not getattr(e, "shared", ()))
            e.num_updates = state["num_updates"]
        else:
            e.load_state_dict(state)


def _all_finite(tensors: list[torch.Tensor]) -> torch.Tensor:
    """0-dim bool tensor: every tensor finite (one fused norm reduction, no sync)."""
    if not tensors:
        return torch.tensor(True)
    return torch.isfinite(torch.stack(torch._foreach_norm(tensors)).sum())


class Guard:
    """Detect, diagnose and recover from training failures, in any training loop.

    Args:
        model: the model being trained (DDP-wrapped is fine).
        optimizer: its optimizer.
        lr_scheduler: optional; stepped by the guard after each applied update.
        scaler: optional ``torch.amp.GradScaler`` (fp16); the guard unscales, steps and
            updates it.
        ema: optional EMA (steadydiff's, ``AveragedModel`` or diffusers' ``EMAModel``);
            updated only after an applied update whose parameters were checked finite.
        config: a :class:`GuardConfig` (or a dict of its fields).
        run_dir: where ``incidents.jsonl`` is written (None: kept in memory only).
        clip_mode, clip: gradient clipping (global | per_layer | agc | zclip; 0 disables).
        num_timesteps: the diffusion T, to bucket per-sample losses by timestep.
        precision: the autocast precision the loop uses (for the fp16 fallback chain).
        progress: an object with ``step`` and ``batches_consumed`` the guard keeps (and
            rolls back); a fresh :class:`Progress` by default.
        device: for the precision-support check (default: the model's device).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *,
                 lr_scheduler: Any = None, scaler: torch.amp.GradScaler | None = None,
                 ema: Any = None, config: GuardConfig | dict | None = None,
                 run_dir: str | Path | None = None, clip_mode: str = "global",
                 clip: float = 1.0, num_timesteps: int = 1000, precision: str | None = None,
                 progress: Any = None, device: torch.device | None = None):
        if isinstance(config, dict):
            config = GuardConfig(**config)
        self.cfg = config or GuardConfig()
        self.model = model
        # unwrap DDP/DataParallel (not any model that happens to have a .module attribute)
        wrapped = isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel))
        self.net = model.module if wrapped else model
        self.optimizer = optimizer
        self.scheduler = lr_scheduler
        self.scaler = scaler
        self.ema = _EMAAdapter(ema) if ema is not None else None
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.clip_mode, self.clip = clip_mode, clip
        self.T = num_timesteps
        self.precision = precision or ("fp16" if scaler is not None else "fp32")
        self.progress = progress if progress is not None else Progress()
        self.device = device or next(self.net.parameters()).device
        c = self.cfg
        self.grad = GradSpike(c.momentum, c.grad_z, c.warmup_steps)
        self.loss = BucketLossSpike(c.t_buckets, c.momentum, c.loss_z, c.loss_ratio,
                                    c.warmup_steps)
        self.divergence = Divergence(c.divergence_window, c.divergence_ratio, c.warmup_steps)
        self.overflow = Overflow(c.overflow_limit, c.overflow_window)
        self.inputs = RunningStats(0.99)  # log max|x| of batches
        self.ring = SnapshotRing(c.snapshots)
        self.incidents: list[Incident] = []   # this process's incidents
        self.incidents_before = 0              # incidents of the run before a resume
        self.skips: deque[int] = deque()       # steps of recent skips (escalation + budget)
        self.rollbacks: deque[int] = deque()   # steps of recent rollbacks (budget)
        self.lr_factor = 1.0
        self.backoff_until = -1
        self.max_lr = 0.0   # the largest LR applied by a healthy step so far
        self.scaler_skips = 0
        self.counts = {"skips": 0, "rollbacks": 0, "steps_redone": 0, "batches_skipped": 0,
                       "warnings": 0}
        self._warned: dict[tuple[str, str], int] = {}
        named = [(n, p) for n, p in self.net.named_parameters() if p.requires_grad]
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        # weights with RMS below 0.05 count as 0.05, so zero-initialised layers moving off
        # zero are not "jumps"
        self._norm_floor = torch.tensor([0.05 * math.sqrt(p.numel()) for p in self._params],
                                        device=self._params[0].device if self._params else None)
        self._prev_norms: torch.Tensor | None = None
        self._probe_forward: Callable[[], object] | None = None
        self._bad_rank: int | None = None  # the rank where this step's bad value appeared
        self.snapshot()

    # ------------------------------------------------------------------ the step

    def step(self, loss: torch.Tensor, *, t: torch.Tensor | None = None,
             per_sample_loss: torch.Tensor | None = None, inputs: torch.Tensor | None = None,
             replay: Callable[[int], torch.Tensor] | None = None, num_micro: int = 1,
             after_backward: Callable[[], None] | None = None,
             after_update: Callable[[], None] | None = None,
             probe_forward: Callable[[], object] | None = None) -> Decision:
        """Inspect the step whose gradients are in ``.grad`` and act on it.

        Args:
            loss: the step's loss (any shape; its mean is judged).
            t, per_sample_loss: (B,) timesteps and per-sample losses, for the per-t-bucket
                spike detector (without them only the grad-norm and finiteness checks run).
            inputs: the batch, to tell a corrupt batch (NaN/Inf, values far outside [-1, 1])
                from a model failure.
            replay: ``replay(i)`` recomputes micro-batch ``i``'s loss exactly (provenance).
            num_micro: micro-batches in the step (for the replay).
            after_backward, after_update: test hooks (fault injection) run after a replayed
                backward and right after the optimizer step.
            probe_forward: one forward pass on real data for the periodic health probes.

        Returns:
            A :class:`Decision`.
        """
        c, prog = self.cfg, self.progress
        self._probe_forward = probe_forward
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        gnorm = clipping.total_norm(self._params)

        # ---- one host sync: loss, grad norm, input range, per-bucket loss sums/counts.
        # Under DDP every rank's row is gathered (one collective) and every rank decides from
        # the same numbers: a NaN on one rank makes all of them skip or roll back together.
        ps = per_sample_loss.detach().float() if per_sample_loss is not None else None
        n_local = float(ps.numel()) if ps is not None else 1.0
        parts = [loss.detach().float().mean().reshape(1), gnorm.float().reshape(1).to(loss.device)]
        parts.append((inputs.detach().float().abs().amax().reshape(1).to(loss.device)
                      if inputs is not None else torch.zeros(1, device=loss.device)))
        parts.append(torch.full((1,), n_local, device=loss.device))
        nb = c.t_buckets
        if t is not None and ps is not None:
            b = (t.long() * nb // self.T).clamp_(0, nb - 1)
            parts += [torch.zeros(nb, device=ps.device).index_add_(0, b, ps),
                      torch.bincount(b, minlength=nb).float()]
        rows = distributed.gather_rows(torch.cat(parts)).cpu()  # host sync, once per step
        world = rows.shape[0]
        self._bad_rank = _first_bad_rank(rows[:, :3]) if world > 1 else None
        # the global mean loss (ranks may hold different shares of an uneven batch)
        loss_v = float((rows[:, 0] * rows[:, 3]).sum() / rows[:, 3].sum())
        gnorm_v = float(rows[:, 1].mean())
        col = rows[:, 2]
        in_max = float(col.max()) if bool(torch.isfinite(col).all()) else float("nan")
        buckets: list[float | None] = [None] * nb
        if rows.shape[1] > 4:
            sums, counts = rows[:, 4:4 + nb].sum(0).tolist(), rows[:, 4 + nb:].sum(0).tolist()
            buckets = [s / n if n else None for s, n in zip(sums, counts)]

        # ---- detection (cheap, host side)
        finding = self._check_inputs(in_max) if inputs is not None else None
        if finding is None and not (math.isfinite(loss_v) and math.isfinite(gnorm_v)):
            if self.scaler is not None:
                # under fp16 a non-finite value is first the scaler's business: gradients
                # that overflowed (finite loss), or a forward pass that overflowed the fp16
                # range (the replay names the module); repeated, it is a precision problem
                prov = (self._provenance(replay, num_micro, after_backward)
                        if not math.isfinite(loss_v) and c.provenance else None)
                if math.isfinite(loss_v) or (prov or {}).get("first_overflow_module"):
                    return self._scaler_skip(loss_v, gnorm_v, prov, forward=not
                                             math.isfinite(loss_v))
            finding = Finding("nonfinite_loss" if not math.isfinite(loss_v) else "nonfinite_grad",
                              "fatal", {"loss": loss_v, "grad_norm": gnorm_v})
        lr_now = max(g["lr"] for g in self.optimizer.param_groups) * self.lr_factor
        if finding is None and self.max_lr > 0 and lr_now > c.lr_jump * self.max_lr:
            # an LR far above anything applied before (warm-up and restarts stay below the
            # peak): a schedule or config bug, and it would wreck the weights in one update
            finding = Finding("lr_spike", "spike", {
                "lr": lr_now, "max_lr_so_far": self.max_lr, "ratio": lr_now / self.max_lr,
                "threshold": c.lr_jump,
                "note": "the learning rate jumped far above its peak so far: check the LR "
                        "schedule / scheduler state"})
        if finding is None:
            # a loss spike explains the gradient spike it causes: report it as the cause
            g_spike, l_spike = self.grad.check(gnorm_v), self.loss.check(buckets)
            finding = l_spike or g_spike
            if l_spike and g_spike:
                l_spike.evidence["grad_norm"] = g_spike.evidence

        if finding is not None:
            if self._bad_rank is not None:
                finding.evidence["rank"] = self._bad_rank  # where the bad value appeared
            if finding.severity == "spike":
                finding.evidence.update(self._spike_evidence())
            if c.provenance and finding.kind != "bad_batch":
                # replay the step with hooks: the first module that went non-finite or past
                # the fp16 range, and the first parameters whose gradients did
                finding.evidence["provenance"] = self._provenance(replay, num_micro,
                                                                  after_backward)
            if probe_forward is not None and finding.kind != "bad_batch":
                # the expensive health probes run on every incident, not only every N steps
                finding.evidence["health"] = self._health(probe_forward)
            escalate = self._recent(self.skips, c.skip_window) + 1 >= c.skips_before_rollback
            if escalate and finding.kind != "bad_batch":
                return self._rollback(finding, loss_v, gnorm_v, reason="repeated incidents")
            return self._skip(finding, loss_v, gnorm_v)

        # ---- healthy: clip, update, check, EMA
        zlimit = self.grad.clip_value() if self.clip_mode == "zclip" else None
        clipped = clipping.clip(self._params, self.clip_mode, self.clip, gnorm, zclip_value=zlimit)
        if prog.step >= self.backoff_until:
            self.lr_factor = 1.0
        self._apply_update()
        if after_update is not None:
            after_update()
        # one fused reduction over the weights: all finite? any weight's norm jumped?
        norms = torch.stack(torch._foreach_norm(self._params)).float()
        jump = (norms / torch.maximum(self._prev_norms, self._norm_floor)).max() \
            if self._prev_norms is not None else torch.zeros((), device=norms.device)
        check = torch.stack([torch.isfinite(norms.sum()).float(), jump])
        if world > 1:
            check[0] = -check[0]  # MAX of -ok == -(MIN of ok)
            dist.all_reduce(check, op=dist.ReduceOp.MAX)
            check[0] = -check[0]
        ok_v, jump_v = check.cpu().tolist()  # host sync (before the EMA can see the weights)
        if not ok_v:
            bad = provenance.nonfinite_params(self.net)
            f = Finding("nonfinite_params", "fatal", {
                "params": bad[:5], "count": len(bad),
                "note": "parameters became non-finite during or right after the update"})
            return self._rollback(f, loss_v, gnorm_v, reason="state unusable")
        if jump_v > c.weight_jump:
            ratios = (norms / torch.maximum(self._prev_norms, self._norm_floor)).cpu().tolist()
            top = sorted(zip(ratios, self._names), reverse=True)[:3]
            f = Finding("weight_jump", "fatal", {
                "params": [n for _, n in top], "norm_ratio": [r for r, _ in top],
                "threshold": c.weight_jump,
                "note": "a parameter's norm jumped in one step: corrupted or exploded weights"})
            return self._rollback(f, loss_v, gnorm_v, reason="state unusable")
        self._prev_norms = norms
        if self.ema is not None:
            self.ema.update(self.net, prog.step)
        self.optimizer.zero_grad(set_to_none=True)
        prog.step += 1
        prog.batches_consumed += 1
        self.grad.observe(gnorm_v)
        self.loss.observe(buckets)
        self.max_lr = max(self.max_lr, lr_now)
        trend = self.divergence.check_and_observe(loss_v)
        if trend is not None:
            return self._rollback(trend, loss_v, gnorm_v, reason="slow divergence",
                                  oldest=True)
        mismatch = None
        if world > 1 and c.rank_check_every and prog.step % c.rank_check_every == 0:
            mismatch = self.check_ranks()
        if prog.step % c.snapshot_every == 0:
            self.snapshot()
        if c.probe_every and prog.step % c.probe_every == 0 and probe_forward is not None:
            self._probe(probe_forward)
        if self.clip_mode in ("global", "zclip"):
            limit = (zlimit if zlimit is not None else self.clip) if self.clip_mode == "zclip" \
                else self.clip
            clipped_v = min(gnorm_v, limit) if limit else gnorm_v
        else:
            clipped_v = float(clipped)  # host sync: per_layer/agc only
        return Decision("step", prog.step, prog.batches_consumed, loss_v, gnorm_v,
                        incident=mismatch, grad_norm_clipped=clipped_v,
                        loss_t=buckets if t is not None and per_sample_loss is not None else None)

    # ------------------------------------------------------------------ actions

    def _check_inputs(self, in_max: float) -> Finding | None:
        """A batch with NaN/Inf, or with values far beyond the usual range (x10 the running
        max |x|), is a data problem, not a model one: skip it and say so."""
        st = self.inputs
        if not math.isfinite(in_max):
            return Finding("bad_batch", "fatal", {
                "max_abs_input": in_max, "note": "the batch itself holds NaN/Inf values: "
                "check the data (a corrupt image, a bad transform)"})
        usual = math.exp(st.mean) if st.count else None
        if usual is not None and st.count >= 10 and in_max > 10 * usual:
            return Finding("bad_batch", "spike", {
                "max_abs_input": in_max, "usual_max_abs_input": usual,
                "note": f"the batch has values up to {in_max:.3g}, {in_max / usual:.3g}x the "
                        "usual range: check the data"})
        st.update(math.log(max(in_max, 1e-12)))
        return None

    def _apply_update(self) -> None:
        groups = self.optimizer.param_groups
        if self.lr_factor != 1.0:
            saved = [g["lr"] for g in groups]
            for g in groups:
                g["lr"] = g["lr"] * self.lr_factor
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        if self.lr_factor != 1.0:
            for g, lr in zip(groups, saved):
                g["lr"] = lr
        if self.scheduler is not None:
            self.scheduler.step()

    def _scaler_skip(self, loss_v: float, gnorm_v: float, prov: dict | None = None,
                     forward: bool = False) -> Decision:
        """fp16 overflow: the scaler's normal job (lower the scale, skip the step). Gradient
        overflows while the scale calibrates are routine and silent; a forward pass that
        overflowed is an incident (the replay names the module); either kind repeated within
        the window is a precision problem (fall back fp16 -> bf16 -> fp32)."""
        prog = self.progress
        scale = self.scaler.get_scale()
        self.scaler.update()  # sees the inf recorded by unscale_, halves the scale
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler_skips += 1
        f = self.overflow.record(prog.step, scale)
        if f is None:
            inc = None
            if forward:
                inc = self._record(Finding("fp16_overflow", "spike", {
                    "loss": loss_v, "loss_scale": scale, "provenance": prov,
                    "note": "an activation exceeded the fp16 range in the forward pass"}),
                    "skip", cost={"steps_redone": 0, "batches_skipped": 1,
                                  "batch_position": prog.batches_consumed})
            prog.batches_consumed += 1
            return Decision("skip", prog.step, prog.batches_consumed, loss_v, gnorm_v, inc)
        prog.batches_consumed += 1
        self.overflow.clear()
        new = self._fallback_precision()
        f.evidence["precision"] = self.precision
        if prov:
            f.evidence["provenance"] = prov
        inc = self._record(f, "precision_fallback" if new else "skip",
                           diagnosis={"new_precision": new} if new else
                           {"note": "precision fallback disabled or not available"})
        if new:
            self.precision = new
            self.scaler = None
        return self._budget_check(Decision("skip", prog.step, prog.batches_consumed, loss_v,
                                           gnorm_v, incident=inc, precision=new))

    def _fallback_precision(self) -> str | None:
        if not self.cfg.precision_fallback:
            return None
        from ..trainer.precision import native_support
        chain = {"fp16": ["bf16", "fp32"], "bf16": ["fp32"]}.get(self.precision, [])
        for p in chain:
            if native_support(p, self.device):
                return p
        return None

    def _skip(self, f: Finding, loss_v: float, gnorm_v: float) -> Decision:
        prog = self.progress
        self.optimizer.zero_grad(set_to_none=True)
        if self.scaler is not None:
            self.scaler.update()  # unscale_ was called: close the scaler's step
        self.skips.append(prog.step)
        self.counts["skips"] += 1
        inc = self._record(f, "skip", cost={"steps_redone": 0, "batches_skipped": 1,
                                            "batch_position": prog.batches_consumed})
        prog.batches_consumed += 1
        return self._budget_check(Decision("skip", prog.step, prog.batches_consumed, loss_v,
                                           gnorm_v, incident=inc))

    def _rollback(self, f: Finding, loss_v: float, gnorm_v: float, *, reason: str,
                  oldest: bool = False) -> Decision:
        c, prog = self.cfg, self.progress
        self.optimizer.zero_grad(set_to_none=True)
        if self.scaler is not None:
            try:
                self.scaler.update()
            except (AssertionError, RuntimeError):
                pass  # the scaler already stepped this iteration
        snap: Snapshot | None = self.ring.oldest() if oldest else self.ring.newest()
        failure_pos, failure_step = prog.batches_consumed, prog.step
        if snap is None or self._recent(self.rollbacks, c.budget_window) >= c.max_rollbacks:
            why = ("no verified snapshot to roll back to" if snap is None else
                   f"{c.max_rollbacks} rollbacks within {c.budget_window} steps already")
            inc = self._record(f, "abort", diagnosis={"why": why, "reason": reason})
            return Decision("abort", prog.step, prog.batches_consumed, loss_v, gnorm_v, inc)
        self.restore(snap)
        self._prev_norms = None
        new_pos = max(failure_pos + 1, snap.batches_consumed + c.skip_batches)
        redone = prog.step - snap.step
        skipped = range(snap.batches_consumed, new_pos)
        prog.step, prog.batches_consumed = snap.step, new_pos
        self.ring.drop_after(snap.step)
        self.lr_factor = max(self.lr_factor * c.lr_backoff, 1e-4)
        self.backoff_until = prog.step + c.lr_backoff_steps
        self.rollbacks.append(prog.step)
        self.skips.clear()
        self.divergence.reset_best()
        self.counts["rollbacks"] += 1
        self.counts["steps_redone"] += redone
        self.counts["batches_skipped"] += len(skipped)
        new_precision = None
        prov = f.evidence.get("provenance") or {}
        if (self.precision == "bf16" and prov.get("first_nonfinite_module")
                and self.cfg.precision_fallback):
            new_precision = self._fallback_precision()
            if new_precision:
                self.precision = new_precision
        inc = self._record(f, "rollback", step=failure_step, cost={
            "steps_redone": redone, "batches_skipped": len(skipped),
            "skipped_batches": [skipped.start, skipped.stop], "restored_step": snap.step},
            diagnosis={"reason": reason, "lr_factor": self.lr_factor,
                       "lr_restored_at_step": self.backoff_until,
                       **({"new_precision": new_precision} if new_precision else {})})
        return Decision("rollback", prog.step, prog.batches_consumed, loss_v, gnorm_v, inc,
                        skipped_batches=skipped, precision=new_precision)

    def _budget_check(self, d: Decision) -> Decision:
        c = self.cfg
        if self._recent(self.skips, c.budget_window) > c.max_skips:
            f = Finding("skip_budget", "fatal", {"skips": len(self.skips),
                                                 "max_skips": c.max_skips,
                                                 "window": c.budget_window})
            inc = self._record(f, "abort", diagnosis={"why": f"more than {c.max_skips} skipped "
                                                             f"steps within {c.budget_window}"})
            return Decision("abort", d.step, d.data_position, d.loss, d.grad_norm, inc)
        return d

    def _recent(self, events: deque[int], window: int) -> int:
        now = self.progress.step
        while events and events[0] < now - window:
            events.popleft()
        return len(events)

    # ------------------------------------------------------------------ OOM

    def handle_oom(self, micro_batch: int, error: BaseException) -> int | None:
        """Out of memory in the forward/backward: halve the micro-batch (the caller doubles
        gradient accumulation so the global batch stays the same, as Composer's automatic
        micro-batching does). Returns the new micro-batch size, or None to abort."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        f = Finding("out_of_memory", "fatal", {"micro_batch": micro_batch,
                                               "error": str(error).splitlines()[0][:200]})
        if not self.cfg.oom_backoff or micro_batch <= 1:
            self._record(f, "abort", diagnosis={"why": "out of memory at micro-batch 1" if
                                                micro_batch <= 1 else "oom_backoff disabled"})
            return None
        new = micro_batch // 2
        self._record(f, "microbatch_backoff", diagnosis={"new_micro_batch": new})
        return new

    # ------------------------------------------------------------------ evidence

    def _provenance(self, replay, num_micro, after_backward) -> dict:
        """Replay this rank's micro-batches (locally: the replay must run the unwrapped
        model, no collectives) and, under DDP, merge every rank's trace: the first rank whose
        replay went bad names the module."""
        nonfinite = provenance.nonfinite_grads(self.net)
        out: dict[str, Any] = {"nonfinite_grad_params": nonfinite[:5],
                               "nonfinite_grad_count": len(nonfinite)}
        if replay is not None:
            try:
                out.update(provenance.trace(self.net, replay, num_micro, after_backward))
            except Exception as e:  # a replay must never take the run down
                out["replay_error"] = f"{type(e).__name__}: {e}"
        ranks = distributed.gather_objects(out)  # one collective, on incidents only
        if len(ranks) == 1:
            return out
        named = [r for r, o in enumerate(ranks)
                 if o.get("first_nonfinite_module") or o.get("first_overflow_module")]
        reproduced = [r for r, o in enumerate(ranks) if o.get("reproduced")]
        src = (named or reproduced or [0])[0]
        return {**ranks[src], "rank": src,
                "ranks_reproduced": reproduced, "world_size": len(ranks)}

    def _spike_evidence(self) -> dict[str, Any]:
        """Which layers dominate the gradient, and which weights moved most since the last
        snapshot (names the parameter behind a spike, e.g. a corrupted weight)."""
        named = [(n, p) for n, p in self.net.named_parameters() if p.grad is not None]
        out: dict[str, Any] = {}
        if named:
            norms = torch.stack(torch._foreach_norm([p.grad for _, p in named])).cpu().tolist()
            top = sorted(zip(norms, (n for n, _ in named)), reverse=True)[:3]
            out["top_grad_layers"] = [{"param": n, "grad_norm": g} for g, n in top]
        snap = self.ring.newest()
        if snap is not None:
            ratios = []
            for n, p in self.net.named_parameters():
                ref = snap.model.get(n)
                if ref is None:
                    continue
                a, b = p.detach().float().norm().item(), ref.float().norm().item()
                ratios.append((a / max(b, 1e-12), n))
            ratios.sort(reverse=True)
            out["weight_growth_since_snapshot"] = [{"param": n, "norm_ratio": r}
                                                   for r, n in ratios[:3]]
        return out

    def _probe(self, forward: Callable[[], object]) -> None:
        c = self.cfg
        stats = probes.probe(self.net, forward)
        for f in probes.findings(stats, logit_limit=c.attn_logit_limit,
                                 entropy_min=c.attn_entropy_min, var_ratio=c.norm_var_ratio,
                                 affine_limit=c.norm_affine_limit):
            key = (f.kind, f.evidence.get("module", ""))
            last = self._warned.get(key)
            if last is not None and self.progress.step - last < 10 * max(c.probe_every, 1):
                continue  # said recently; do not flood the incident log
            self._warned[key] = self.progress.step
            self.counts["warnings"] += 1
            self._record(f, "warn")
        self.last_probe = stats

    def _health(self, forward: Callable[[], object]) -> list[dict[str, Any]]:
        """Attention/normalization findings on this batch, attached to an incident."""
        c = self.cfg
        try:
            stats = probes.probe(self.net, forward)
        except Exception as e:  # a non-finite forward must not stop the recovery
            return [{"probe_error": f"{type(e).__name__}: {e}"}]
        return [{"kind": f.kind, **f.evidence} for f in probes.findings(
            stats, logit_limit=c.attn_logit_limit, entropy_min=c.attn_entropy_min,
            var_ratio=c.norm_var_ratio, affine_limit=c.norm_affine_limit)]

    def probe_now(self, forward: Callable[[], object]) -> dict:
        """Run the attention/normalization probes on demand; returns the statistics."""
        self._probe(forward)
        return self.last_probe

    def record(self, f: Finding, action: str, cost: dict | None = None,
               diagnosis: dict | None = None) -> Incident:
        """Record an incident found outside the guard's own detectors (e.g. the adapter
        guard's delta clamp) in incidents.jsonl, the report and the summary."""
        return self._record(f, action, cost, diagnosis)

    def _record(self, f: Finding, action: str, cost: dict | None = None,
                diagnosis: dict | None = None, step: int | None = None) -> Incident:
        inc = Incident(step=self.progress.step if step is None else step, kind=f.kind, severity=f.severity,
                       evidence=f.evidence, action=action, cost=cost or {},
                       diagnosis=diagnosis or {})
        self.incidents.append(inc)
        if self.run_dir is not None and _is_main():
            self.run_dir.mkdir(parents=True, exist_ok=True)
            with open(self.run_dir / "incidents.jsonl", "a") as fh:
                fh.write(json.dumps(inc.row()) + "\n")
        return inc

    # ------------------------------------------------------------------ rank consistency

    def check_ranks(self) -> Incident | None:
        """Compare a bitwise fingerprint of the weights (and EMA) across ranks (one small
        gather). DDP keeps replicas identical only if every rank applies identical updates;
        a rank that drifted (a bit flip, a non-deterministic kernel, a local change) is an
        incident: every rank takes the majority's state (the lowest rank holding it), the
        snapshot ring restarts from it, and training goes on. Returns the incident or None.
        """
        tensors = list(self._params) + (self.ema.tensors() if self.ema else [])
        prints = distributed.gather_rows(distributed.tensor_fingerprint(tensors)).cpu()
        keys = [tuple(r.tolist()) for r in prints]
        if len(set(keys)) == 1:
            return None
        votes = {k: keys.count(k) for k in keys}
        best = max(votes.values())
        src = next(r for r, k in enumerate(keys) if votes[k] == best)
        odd = [r for r, k in enumerate(keys) if k != keys[src]]
        distributed.broadcast_tensors(tensors + distributed.optimizer_tensors(self.optimizer),
                                      src=src)
        self._prev_norms = None
        self.ring.ring.clear()
        self.snapshot()
        return self._record(Finding("rank_mismatch", "fatal", {
            "ranks_differing": odd, "source_rank": src, "world_size": len(keys),
            "fingerprints": [list(k) for k in keys],
            "note": "the replicas' weights differ bitwise across ranks: a rank applied a "
                    "different update (memory corruption, a non-deterministic or local "
                    "operation outside DDP)"}), "resync",
            diagnosis={"why": f"rank(s) {odd} resynchronized from rank {src}"})

    # ------------------------------------------------------------------ snapshots

    def snapshot(self) -> Snapshot | None:
        """Take a snapshot if the weights and EMA are finite (else keep the older ones)."""
        tensors = list(self._params) + (self.ema.tensors() if self.ema else [])
        if not bool(_all_finite(tensors)):
            return None
        return self.ring.take(step=self.progress.step,
                              batches_consumed=self.progress.batches_consumed,
                              model=self.net,
                              ema_state=self.ema.state() if self.ema else None,
                              optimizer=self.optimizer, scheduler=self.scheduler,
                              scaler=self.scaler)

    def restore(self, snap: Snapshot) -> None:
        """Restore model, EMA, optimizer, scheduler, scaler and RNG from ``snap``."""
        restore_into(snap, model=self.net, optimizer=self.optimizer, scheduler=self.scheduler,
                     scaler=self.scaler)
        if self.ema is not None and snap.ema is not None:
            self.ema.load(snap.ema)

    # ------------------------------------------------------------------ state / report

    @property
    def num_incidents(self) -> int:
        """Incidents of the whole run (across resumes)."""
        return self.incidents_before + len(self.incidents)

    def state_dict(self) -> dict[str, Any]:
        """Detector statistics, budgets and backoff (what exact resume needs)."""
        return {
            "grad": self.grad.stats.state(), "loss": [s.state() for s in self.loss.stats],
            "inputs": self.inputs.state(),
            "divergence": self.divergence.state(), "overflow": list(self.overflow.events),
            "skips": list(self.skips), "rollbacks": list(self.rollbacks),
            "lr_factor": self.lr_factor, "backoff_until": self.backoff_until,
            "max_lr": self.max_lr,
            "precision": self.precision, "counts": dict(self.counts),
            "scaler_skips": self.scaler_skips, "incidents": self.num_incidents,
        }

    def load_state_dict(self, s: dict[str, Any]) -> None:
        self.grad.stats.load(s["grad"])
        self.inputs.load(s["inputs"])
        for st, v in zip(self.loss.stats, s["loss"]):
            st.load(v)
        self.divergence.load(s["divergence"])
        self.overflow.events = deque(s["overflow"])
        self.skips, self.rollbacks = deque(s["skips"]), deque(s["rollbacks"])
        self.lr_factor, self.backoff_until = s["lr_factor"], s["backoff_until"]
        self.max_lr = float(s.get("max_lr", 0.0))
        self.precision = s["precision"]
        self.counts.update(s["counts"])
        self.scaler_skips = s.get("scaler_skips", 0)
        self.incidents_before = int(s.get("incidents", 0))

    def summary(self) -> str:
        """A one-screen account of what the guard did."""
        n = self.num_incidents
        c = self.counts
        if n == 0 and not self.scaler_skips:
            return "guard: healthy run, no incidents"
        head = (f"guard: {n} incident{'s' if n != 1 else ''}; {c['skips']} skipped step(s), "
                f"{c['rollbacks']} rollback(s) ({c['steps_redone']} steps redone, "
                f"{c['batches_skipped']} batches skipped), {c['warnings']} health warning(s)")
        if self.scaler_skips:
            head += f", {self.scaler_skips} fp16 overflow skip(s)"
        lines = [head]
        for inc in self.incidents[-12:]:
            lines.append(f"  step {inc.step:>6}  {inc.kind:<24} -> {inc.action:<18} "
                         f"{finding_from_row(inc.row()).summary()}")
        if n > len(self.incidents[-12:]):
            lines.insert(1, f"  ({n - len(self.incidents[-12:])} earlier incidents in "
                            "incidents.jsonl)")
        return "\n".join(lines)


def _first_bad_rank(rows: torch.Tensor) -> int | None:
    """The rank where a non-finite value appeared, from the (loss, grad norm, input max)
    rows: inputs and losses are per rank, but DDP's all-reduce spreads one rank's non-finite
    gradient to every rank, so the grad norm only counts when nothing else is bad."""
    for col in (2, 0, 1):
        bad = (~torch.isfinite(rows[:, col])).nonzero()
        if len(bad):
            return int(bad[0])
    return None


_is_main = distributed.is_main
