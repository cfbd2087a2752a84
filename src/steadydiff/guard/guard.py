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
itself when the step is healthy, through the same :class:`~steadydiff.guard.update.Update`
the trainer uses with the guard off. One step is: inspect (one host sync) -> findings ->
:func:`steadydiff.guard.policy.decide` -> carry the action out; or, when healthy, update ->
check the weights -> commit. Every intervention is an :class:`Incident`, appended to
``RUN_DIR/incidents.jsonl`` with the evidence, the action and its cost.

Per step the guard costs one small host sync (loss, grad norm, per-t-bucket loss sums, the
weights' norms against the last verified ones) and one fused finiteness reduction over the
parameters before the EMA sees them; snapshots every
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
from typing import Any, Callable, Literal, Sequence

import torch
import torch.distributed as dist
from torch import nn

from .. import distributed, hostsync, sharding
from ..config import GuardConfig
from ..kinds import PRECISIONS, ClipMode, Precision
from ..values import jsonable, num
from ..trainer.precision import native_support
from . import policy, probes, provenance
from .detectors import (BucketLossSpike, Divergence, Finding, GradSpike, Overflow,
                        RunningStats, Trend)
from . import findings
from .findings import FindingSeverity, IncidentAction, IncidentKind, finding_from_row
from .policy import Action, History
from .snapshots import Snapshot, SnapshotRing, restore_into
from .update import Progress, ProgressLike, Update
from . import basewatch
from .window import Mark, Marks, rng_states

DecisionKind = Literal["step", "skip", "rollback", "abort"]
# findings that can be the data's fault: the guard looks for the samples responsible
DATA_KINDS = frozenset({"bad_batch", "nonfinite_loss", "loss_spike"})


class GuardAbort(RuntimeError):
    """Instability persisted past the recovery budget (CLI exit code 3).

    Attributes:
        incident: the abort incident, when there is one.
        abort_point: set by steadydiff's trainer (rank 0): what the run left to resume from
            and the suggested command, as in summary.json's ``abort`` (see docs/guard.md).
    """

    def __init__(self, message: str, incident: "Incident | None" = None):
        super().__init__(message)
        self.incident = incident
        self.abort_point: dict[str, Any] | None = None


@dataclass
class Incident:
    """One intervention: what was seen, what was done, what it cost."""

    step: int
    kind: IncidentKind
    severity: FindingSeverity
    evidence: dict[str, Any]
    action: IncidentAction
    cost: dict[str, Any] = field(default_factory=dict)
    diagnosis: dict[str, Any] = field(default_factory=dict)
    time: float = field(default_factory=time.time)

    def row(self) -> dict[str, Any]:
        return jsonable(asdict(self))


@dataclass
class Decision:
    """What the guard decided for one step.

    action: ``step`` (the update was applied), ``skip`` (no update; the batch is dropped),
        ``rollback`` (state restored to a verified snapshot), ``abort`` (give up).
    step: the step counter after the decision (it moves back on a rollback).
    data_position: batches consumed: the position of the next batch to train on (after a
        rollback the data continues from here; positions the guard skips are jumped over).
    skipped_batches: after a rollback, the batch positions that will not be trained on (the
        implicated ones; none when the data was innocent).
    dropped: the dataset indices left out of this step (the rest of the batch trained, or,
        without ``rerun``, the samples the caller should drop).
    quarantined: dataset indices quarantined by this step: never draw them again
        (:attr:`Guard.quarantine` holds them all).
    precision: set when the guard changed the precision (fp16 -> bf16 -> fp32); the progress
        object already holds it, a loop of one's own switches its autocast.
    loss, grad_norm, grad_norm_clipped: host floats when the guard inspected the step;
        ``loss_t``: the mean loss per timestep bucket (this step).
    """

    action: DecisionKind
    step: int
    data_position: int
    loss: float | None = None
    grad_norm: float | None = None
    incident: Incident | None = None
    skipped_batches: tuple[int, ...] | None = None
    precision: Precision | None = None
    grad_norm_clipped: float | None = None
    loss_t: list[float | None] | None = None
    dropped: tuple[int, ...] = ()
    quarantined: tuple[int, ...] = ()
    pending: bool = False  # a speculative step: judged at the next :meth:`Guard.flush`


@dataclass
class Rewind:
    """A window's step failed its check: the state is back at the window's start (``step``,
    data position ``batches_consumed``); the steps up to ``at`` run again and step ``at``
    is judged on its own. ``why``: what the window's check saw there."""

    step: int
    batches_consumed: int
    at: int
    why: str
    extra: Any = None  # what begin_step's ``mark`` returned at the window's start


@dataclass
class Flush:
    """What :meth:`Guard.flush` found: the host values of the window's steps (``loss``,
    ``grad_norm``, ``grad_norm_clipped``, ``loss_t`` per step, in order), or a ``rewind``
    (then ``values`` is empty: the steps will be redone)."""

    values: list[tuple[float, float, float, list[float | None] | None]]
    rewind: Rewind | None = None
    incident: Incident | None = None


@dataclass
class _Pending:
    """A speculative step, judged at the next flush."""

    step: int                 # the step counter after it
    lr_now: float
    judged_t: bool
    n_local: int
    has_inputs: bool
    rows: torch.Tensor        # (world, D): the numbers before the update, every rank's
    after: torch.Tensor       # (3,): weights finite after the update, their jump, clipped norm
    probe_forward: Callable[[], object] | None


def _all_finite(tensors: list[torch.Tensor]) -> torch.Tensor:
    """0-dim bool tensor: every tensor finite (one fused norm reduction, no sync)."""
    return sharding.all_finite(tensors)  # FSDP: over every rank's shards


@dataclass
class _Seen:
    """The step's numbers after the one host sync (every rank's, reduced)."""

    loss: float
    grad_norm: float
    input_max: float
    buckets: list[float | None]
    world: int
    judged_t: bool  # per-sample losses and timesteps were given
    n_local: int = 1             # samples in this rank's batch
    n_global: int = 1            # and in the global batch
    weights_ok: bool = True      # the weights before the forward: all finite
    weights_jump: float = 0.0    # and their largest norm ratio to the last verified ones


@dataclass
class _Sample:
    """One sample of the (global) batch, as the attribution reads it."""

    rank: int
    position: int            # in this rank's batch
    index: int | None        # dataset index (None: the caller gave none)
    max_abs_input: float
    loss: float
    t: int
    finite_input: bool

    def row(self, micro: int, source: str | None, why: str, world: int) -> dict[str, Any]:
        out = {"index": self.index, "position": self.position, "micro_batch": micro,
               "loss": self.loss, "max_abs_input": self.max_abs_input, "t": self.t,
               "why": why}
        if world > 1:
            out["rank"] = self.rank
        if source:
            out["source"] = source
        return out


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
        progress: the object that owns ``step``, ``batches_consumed``, ``precision`` and
            ``scaler`` (the guard advances and rolls them back); a fresh :class:`Progress`
            holding ``scaler`` and ``precision`` by default. steadydiff's trainer passes its
            ``TrainState`` (and ``scaler``/``precision`` are then read from it).
        device: for the precision-support check (default: the model's device).
        update: the :class:`Update` to apply (the trainer shares its own); built from the
            arguments above by default.
        sample_source: ``sample_source(index)`` names a dataset item (its file path) in the
            incidents that implicate it.
        defer: the caller can redo steps from a :class:`Rewind` (steadydiff's trainer):
            steps are then judged ``guard.check_every`` at a time, with no host read in
            between (:mod:`steadydiff.guard.window`), and the caller calls :meth:`flush`
            when :meth:`due` says so. Off (every step read and judged at once) by default.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *,
                 lr_scheduler: Any = None, scaler: torch.amp.GradScaler | None = None,
                 ema: Any = None, config: GuardConfig | dict | None = None,
                 run_dir: str | Path | None = None, clip_mode: ClipMode = "global",
                 clip: float = 1.0, num_timesteps: int = 1000, precision: Precision | None = None,
                 progress: ProgressLike | None = None, device: torch.device | None = None,
                 update: Update | None = None,
                 sample_source: Callable[[int], str | None] | None = None,
                 defer: bool = False):
        if isinstance(config, dict):
            config = GuardConfig(**config)
        self.cfg = config or GuardConfig()
        self.model = model
        self.update = update or Update(model, optimizer, clip_mode=clip_mode, clip=clip,
                                       scheduler=lr_scheduler, ema=ema)
        self.net = self.update.net
        self.optimizer = optimizer
        self.ema = self.update.ema
        self.run_dir = Path(run_dir) if run_dir is not None else None
        # the frozen base's watch (guard/basewatch.py; set by the SD path's adapter runs)
        self.frozen: Any = None
        self.T = num_timesteps
        self.progress: ProgressLike = progress if progress is not None else Progress(
            precision=precision or ("fp16" if scaler is not None else "fp32"), scaler=scaler)
        self.device = device or next(self.net.parameters()).device
        self._supported = frozenset(p for p in PRECISIONS
                                    if native_support(p, self.device))
        c = self.cfg
        self._fresh_statistics()
        self.overflow = Overflow(c.overflow_limit, c.overflow_window)
        self.ring = SnapshotRing(c.snapshots)
        self.incidents: list[Incident] = []   # this process's incidents
        self.incidents_before = 0              # incidents of the run before a resume
        self.skips: deque[int] = deque()       # steps of recent skips (escalation + budget)
        self.rollbacks: deque[int] = deque()   # steps of recent rollbacks (budget)
        self.lr_factor = 1.0  # the temporary backoff after a rollback
        self.backoff_until = -1
        self.lr_cap: float | None = None  # lr_too_high: the LR is never above this again
        self.last_factor = 1.0  # what the last step applied: backoff and cap together
        self.max_lr = 0.0   # the largest LR applied by a healthy step so far
        self.scaler_skips = 0
        self.counts = {"skips": 0, "rollbacks": 0, "steps_redone": 0, "batches_skipped": 0,
                       "warnings": 0, "samples_dropped": 0, "quarantined": 0,
                       "rewinds": 0, "steps_discarded": 0}
        self.sample_source = sample_source
        self.quarantine: set[int] = set()            # dataset indices never drawn again
        self.implicated: dict[int, list[int]] = {}   # index -> steps of its data incidents
        self.pending_skips: set[int] = set()         # batch positions not to train on
        self.skipped_positions: deque[int] = deque()  # positions skipped (since snapshots)
        self.last_rollback: tuple[int, str] | None = None  # (restored step, reason)
        self.same_rollbacks = 0
        self.transient: dict[str, int] = {}  # rank -> transient faults (re-run was finite)
        self.spike_drops: deque[int] = deque()  # steps of loss spikes pinned on samples
        self._warned: dict[tuple[str, str], int] = {}
        self.upcast: list[str] = []  # attention layers the guard switched to fp32 attention
        self.last_probe: dict | None = None
        self.last_probe_step: int | None = None  # the step the probes last ran at
        self._names, self._params = self.update.names, self.update.params
        # weights with RMS below 0.05 count as 0.05, so zero-initialised layers moving off
        # zero are not "jumps"
        self._norm_floor = torch.tensor([0.05 * math.sqrt(p.numel()) for p in self._params],
                                        device=self._params[0].device if self._params else None)
        self._prev_norms: torch.Tensor | None = None
        self._bad_rank: int | None = None  # the rank where this step's bad value appeared
        self._outlier_rank: int | None = None  # the rank with this step's largest input
        # speculative windows (defer): the steps not judged yet, the state at their start,
        # the step to judge on its own after a rewind and what the window saw there
        self.check_every = c.check_every if defer else 1
        self._pending: list[_Pending] = []
        self._mark: Mark | None = None
        self._marks = Marks()
        self._sync_at: int | None = None
        self._suspect: tuple[str, float, float] | None = None
        self._rng_at_start: tuple[torch.Tensor, list[torch.Tensor] | None] | None = None
        self._extra_at_start: Any = None
        self._state_ready = False  # every weight has its optimizer state (after step 1)
        self.snapshot()

    def _fresh_statistics(self) -> None:
        """The detectors' running statistics, empty: each warms up again over
        ``guard.warmup_steps`` before it may fire."""
        c = self.cfg
        self.grad = GradSpike(c.momentum, c.grad_z, c.warmup_steps)
        self.loss = BucketLossSpike(c.t_buckets, c.momentum, c.loss_z, c.loss_ratio,
                                    c.warmup_steps)
        self.divergence = Divergence(c.divergence_window, c.divergence_ratio, c.warmup_steps)
        self.trend = Trend(c.trend_window, c.trend_grad_ratio, c.trend_loss_ratio,
                           c.trend_lr_rise, c.warmup_steps)
        self.inputs = RunningStats(0.99)  # log max|x| of batches

    def resolution_changed(self, old: int, new: int, **context: Any) -> Incident:
        """The run goes on at another image size (``--grow-resolution``): the loss and
        gradient scales change with the resolution, so the per-timestep loss statistics,
        the grad-norm, input-range, divergence and trend statistics restart their warm-up,
        and the snapshot ring restarts from the current state. Budgets, the LR cap and
        backoff, the quarantine and the fp16 overflow window stay. Recorded as a
        ``resolution_change`` incident (action ``restart_statistics``).

        Args:
            old, new: the image side before and after.
            context: more evidence for the row (e.g. ``model``, ``resolution_shift_base``).
        """
        restarted = ["loss_per_t_bucket", "grad_norm", "inputs", "divergence", "trend",
                     "snapshots"]
        self._fresh_statistics()
        self._prev_norms = None
        self.ring.ring.clear()
        self.snapshot()
        f = findings.ResolutionChange.new(old_size=old, new_size=new, step=self.progress.step,
                                          restarted=restarted, **context)
        return self._record(f, "restart_statistics", diagnosis={
            "note": f"statistics warm up again over guard.warmup_steps={self.cfg.warmup_steps}"})

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        """The grad scaler in use (owned by the progress object)."""
        return self.progress.scaler

    @property
    def precision(self) -> Precision:
        """The runtime precision (owned by the progress object)."""
        return self.progress.precision

    # ------------------------------------------------------------------ the step

    def step(self, loss: torch.Tensor, *, t: torch.Tensor | None = None,
             per_sample_loss: torch.Tensor | None = None, inputs: torch.Tensor | None = None,
             indices: Sequence[int] | torch.Tensor | None = None,
             replay: Callable[[int], torch.Tensor] | None = None, num_micro: int = 1,
             rerun: Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor,
                                                        torch.Tensor]] | None = None,
             after_backward: Callable[[], None] | None = None,
             after_update: Callable[[], None] | None = None,
             probe_forward: Callable[[], object] | None = None,
             _retry_of: Finding | None = None) -> Decision:
        """Inspect the step whose gradients are in ``.grad`` and act on it.

        Args:
            loss: the step's loss (any shape; its mean is judged).
            t, per_sample_loss: (B,) timesteps and per-sample losses, for the per-t-bucket
                spike detector and to single out bad samples (without them only the
                grad-norm and finiteness checks run).
            inputs: the batch, to tell a corrupt batch (NaN/Inf, values far outside [-1, 1])
                from a model failure, and which of its samples is corrupt.
            indices: (B,) the dataset indices of the batch's samples: named in the incidents
                that implicate them, and quarantined after ``quarantine_after`` incidents.
            replay: ``replay(i)`` recomputes micro-batch ``i``'s loss exactly (provenance).
            num_micro: micro-batches in the step (for the replay and to name a sample's
                micro-batch).
            rerun: ``rerun(keep, n_kept)`` redoes the forward and backward of this step on
                the samples where the (B,) bool mask ``keep`` is True (``n_kept``: how many
                are kept in the whole global batch, to weight the mean) and returns its
                ``(loss, per_sample_loss, t)``. With it, a non-finite step is first run
                once more whole (finite the second time: a ``transient_fault``, whose update
                is taken), and a batch in which a few samples are bad trains on the rest;
                without it the batch is skipped and :attr:`Decision.dropped` names them.
            after_backward, after_update: test hooks (fault injection) run after a replayed
                backward and right after the optimizer step.
            probe_forward: one forward pass on real data for the periodic health probes.

        Returns:
            A :class:`Decision`.
        """
        c, prog = self.cfg, self.progress
        if _retry_of is None and self._speculating() and (self._pending or self._open()):
            return self._speculate(loss, t, per_sample_loss, inputs, after_update,
                                   probe_forward)
        if self._pending:
            raise RuntimeError("Guard.step: a per-step check with speculative steps not yet "
                               "judged; call flush() first (when due() says so)")
        suspect = self._suspect if prog.step == self._sync_at else None
        if prog.step == self._sync_at and _retry_of is None:
            self._sync_at, self._suspect = None, None
        before = self._weights_before()
        gnorm = self.update.norm(prog)
        seen = self._sync(loss, gnorm, t, per_sample_loss, inputs, before)
        factor = self._lr_factor_now()

        # ---- before the update: the weights, the batch, the loss and gradients, the LR
        finding = self._check_weights_before(seen)
        if finding is None:
            finding = self._inspect(seen, inputs is not None, replay, num_micro,
                                    after_backward)
        if finding is not None and self.frozen is not None \
                and finding.kind in basewatch.SYMPTOMS:  # a corrupt frozen base, not the LR
            d = basewatch.check(self, seen)
            if d is not None:
                return d
        lr_now = max(g["lr"] for g in self.optimizer.param_groups) * factor
        if finding is None and self.max_lr > 0 and lr_now > c.lr_jump * self.max_lr:
            # an LR far above anything applied before (warm-up and restarts stay below the
            # peak): a schedule or config bug, and it would wreck the weights in one update
            finding = findings.LrSpike.new(lr=lr_now, max_lr_so_far=self.max_lr,
                                           threshold=c.lr_jump)
        if finding is None:
            # a loss spike explains the gradient spike it causes: report it as the cause
            g_spike, l_spike = self.grad.check(seen.grad_norm), self.loss.check(seen.buckets)
            finding = l_spike or g_spike
            if l_spike and g_spike:
                l_spike.evidence["grad_norm"] = g_spike.evidence
        if finding is not None and _retry_of is not None:
            finding.evidence["rerun"] = "non-finite again when run a second time: persistent"
        elif finding is not None and rerun is not None and c.rerun_nonfinite \
                and finding.kind in ("nonfinite_loss", "nonfinite_grad"):
            # the same step again (same data, t, noise): a flaky device or a bit flip in an
            # activation does not repeat; data and weights do
            if seen.world > 1 and self._bad_rank is not None:
                finding.evidence["rank"] = self._bad_rank
            self.update.discard(prog)
            loss, ps, t = rerun(torch.ones(seen.n_local, dtype=torch.bool,
                                           device=inputs.device if inputs is not None
                                           else self.device), seen.n_global)
            return self.step(loss, t=t, per_sample_loss=ps, inputs=inputs, indices=indices,
                             replay=replay, num_micro=num_micro, rerun=rerun,
                             after_backward=after_backward, after_update=after_update,
                             probe_forward=probe_forward, _retry_of=finding)
        if finding is not None:
            samples = (self._attribute(finding, t, per_sample_loss, inputs, indices,
                                       num_micro, seen.world)
                       if finding.kind in DATA_KINDS and per_sample_loss is not None
                       else None)
            if samples and rerun is not None:
                return self._drop_samples(finding, samples, seen, rerun, inputs, indices,
                                          num_micro, after_update, probe_forward)
            if not samples and finding.kind in ("grad_spike", "loss_spike"):
                # spikes at the end of a sustained rise, or that keep coming while the LR
                # rose, are its symptom: the LR is the cause
                trend = self.trend.check()
                if trend is None and policy.escalates(self.history(), c):
                    trend = self.trend.lr_rose(lr_now, seen.grad_norm, seen.loss)
                if trend is not None:
                    trend.evidence["symptom"] = finding.kind
                    finding = trend
            if finding.kind != "fp16_overflow":
                self._gather_evidence(finding, replay, num_micro, after_backward,
                                      probe_forward)
            if samples:
                finding.evidence["samples"] = samples
            d = self._act(finding, seen)
            if samples:
                d.dropped = tuple(x["index"] for x in samples if x["index"] is not None)
                d.quarantined = self._implicate(samples)
            return d

        # ---- healthy: update, check the weights, commit (EMA, counters)
        zlimit = self.grad.clip_value() if self.update.clip_mode == "zclip" else None
        clipped = self.update.apply(prog, gnorm, lr_factor=factor, zclip=zlimit)
        if after_update is not None:
            after_update()
        finding = self._check_weights(seen.world)
        if finding is not None:
            return self._act(finding, seen)
        step_done = prog.step
        self.update.commit(prog)
        self._jump_skipped()
        transient = self._transient(_retry_of, step_done) if _retry_of is not None else None
        if transient is None and suspect is not None and suspect[0] == "nonfinite":
            # the window saw this step non-finite; run again on its own it is finite
            kind = "nonfinite_loss" if not math.isfinite(suspect[1]) else "nonfinite_grad"
            transient = self._transient(Finding(kind, "spike", evidence={
                "loss": suspect[1], "grad_norm": suspect[2]}), step_done)
        self.grad.observe(seen.grad_norm)
        self.loss.observe(seen.buckets)
        self.max_lr = max(self.max_lr, lr_now)
        self.trend.observe(step_done, lr_now, seen.grad_norm, seen.loss)
        trend = self.trend.check() or self.divergence.check_and_observe(seen.loss, step_done)
        if trend is not None:
            return self._act(trend, seen)
        mismatch = None
        if seen.world > 1 and c.rank_check_every and prog.step % c.rank_check_every == 0:
            mismatch = self.check_ranks()
        if prog.step % c.snapshot_every == 0:
            self.snapshot()
        if c.probe_every and prog.step % c.probe_every == 0 and probe_forward is not None:
            self._probe(probe_forward)
        return Decision("step", prog.step, prog.batches_consumed, seen.loss, seen.grad_norm,
                        incident=mismatch or transient,
                        grad_norm_clipped=self._clipped_value(seen.grad_norm, clipped, zlimit),
                        loss_t=seen.buckets if seen.judged_t else None)

    # ------------------------------------------------------------------ speculative windows

    def _speculating(self) -> bool:
        """Whether this step runs speculatively: deferred checks are on, this is not the step
        a rewind judges on its own, every weight has its optimizer state (the first step
        creates it), and the clipping needs no statistics of the steps before (ZClip's
        threshold is the grad-norm statistics: those steps are read every step)."""
        if self.check_every <= 1 or self.progress.step == self._sync_at \
                or self.update.clip_mode == "zclip":
            return False
        if not self._state_ready:  # once there, the state stays (a rollback reloads it)
            state = self.optimizer.state
            self._state_ready = all(state.get(p) for p in self._params)
        return self._state_ready

    def begin_step(self, mark: Callable[[], Any] | None = None) -> bool:
        """Call before a step's forward pass. When the step opens a window, the RNG states
        are kept for the window's mark (dropout must draw the same when the window runs
        again), and so is ``mark()``: the caller's own state (e.g. fault injection), handed
        back in :attr:`Rewind.extra` to restore. Returns whether a window opens."""
        if self._pending or not self._speculating():
            return False
        self._rng_at_start = rng_states()
        self._extra_at_start = mark() if mark is not None else None
        return True

    @property
    def pending(self) -> int:
        """Speculative steps not judged yet."""
        return len(self._pending)

    def due(self) -> bool:
        """Whether the steps so far must be judged now (:meth:`flush`): the window is full,
        the next step is judged on its own, or a step of the guard's own cadence ends here
        (a snapshot, a probe, a rank check: they need the verified state). A trainer also
        flushes before anything that reads the state (a checkpoint, a log row, a sample)."""
        if not self._pending:
            return False
        c, step = self.cfg, self.progress.step
        return (len(self._pending) >= self.check_every or step == self._sync_at
                or step % c.snapshot_every == 0
                or bool(c.probe_every and step % c.probe_every == 0)
                or bool(self._pending[-1].rows.shape[0] > 1 and c.rank_check_every
                        and step % c.rank_check_every == 0 and not self.update.sharded))

    def _open(self) -> bool:
        """Open a window: mark the state at its start. False (and the per-step check from
        now on) when the mark's copy does not fit on the device."""
        rng = self._rng_at_start if self._rng_at_start is not None else rng_states()
        mark = self._marks.take(self, rng)
        extra, self._rng_at_start, self._extra_at_start = self._extra_at_start, None, None
        if mark is None:
            print("warning: guard: no room on the device for the deferred check's copy of the "
                  "trainable state (more than half its free memory): checking every step "
                  "from now on, as guard.check_every=1 does")
            self.check_every = 1
            return False
        mark.extra = extra
        self._mark = mark
        return True

    def _speculate(self, loss: torch.Tensor, t: torch.Tensor | None,
                   per_sample_loss: torch.Tensor | None, inputs: torch.Tensor | None,
                   after_update: Callable[[], None] | None,
                   probe_forward: Callable[[], object] | None) -> Decision:
        """One step of a window: the per-step check's numbers stay on the device, the update
        is gated there, and the step counts as done until :meth:`flush` reads them."""
        c, prog = self.cfg, self.progress
        before = self._weights_before()
        gnorm = self.update.norm(prog)
        rows = self._rows(loss, gnorm, t, per_sample_loss, inputs, before)
        # the device's verdict: every rank's numbers finite, the weights sound before
        ok = (torch.isfinite(rows[:, :3]).all() & (rows[:, 4] > 0).all()
              & (rows[:, 5] <= c.weight_jump).all())
        factor = self._lr_factor_now()
        lr_now = max(g["lr"] for g in self.optimizer.param_groups) * factor
        clipped = self.update.apply(prog, gnorm, lr_factor=factor, gate=ok)
        if after_update is not None:
            after_update()
        check, norms = self._weights_after(rows.shape[0])
        self._prev_norms = norms
        self.update.commit(prog, gate=ok & (check[0] > 0) & (check[1] <= c.weight_jump))
        self._jump_skipped()
        self._pending.append(_Pending(
            step=prog.step, lr_now=lr_now, judged_t=t is not None and per_sample_loss is not None,
            n_local=per_sample_loss.numel() if per_sample_loss is not None else 1,
            has_inputs=inputs is not None, rows=rows,
            after=torch.cat([check, clipped.detach().float().reshape(1).to(check.device)]),
            probe_forward=probe_forward))
        return Decision("step", prog.step, prog.batches_consumed, pending=True)

    def flush(self) -> Flush:
        """Judge the window's steps: one host read of all their numbers, then, step by step,
        the same host logic as the per-step check. All healthy: the window stands (the
        guard's own cadence runs for the last step: snapshot, probe, rank check). A step that
        is not: the state goes back to the window's start and a :class:`Rewind` says where
        the caller's data must continue; the guard then speculates up to that step and
        judges it on its own."""
        pend, mark = self._pending, self._mark
        if not pend:
            return Flush([])
        host = hostsync.read(torch.cat([torch.cat([p.rows.flatten(), p.after])
                                        for p in pend]))
        values, off = [], 0
        for i, p in enumerate(pend):
            n = p.rows.numel()
            rows, after = host[off:off + n].reshape(p.rows.shape), host[off + n:off + n + 3]
            off += n + 3
            seen = self._seen(rows, p.n_local, p.judged_t)
            why = self._judge(seen, p, float(after[0]), float(after[1]))
            if why is not None:
                return self._rewind(mark, i, why, seen)
            clip = self.update.clip
            clipped = (min(seen.grad_norm, clip) if clip else seen.grad_norm) \
                if self.update.clip_mode == "global" else float(after[2])
            values.append((seen.loss, seen.grad_norm, clipped,
                           seen.buckets if p.judged_t else None))
        self._pending, self._mark = [], None
        c, step, last = self.cfg, self.progress.step, pend[-1]
        mismatch = None
        if last.rows.shape[0] > 1 and c.rank_check_every and step % c.rank_check_every == 0:
            mismatch = self.check_ranks()
        if step % c.snapshot_every == 0:
            self.snapshot()
        if c.probe_every and step % c.probe_every == 0 and last.probe_forward is not None:
            self._probe(last.probe_forward)
        return Flush(values, incident=mismatch)

    def _judge(self, seen: _Seen, p: _Pending, ok_after: float, jump_after: float
               ) -> str | None:
        """The per-step check's host logic for one step of a window, in its order: None when
        the step would have been healthy (its statistics are then observed, as the per-step
        check observes them), else what it saw."""
        c = self.cfg
        if not (seen.weights_ok and seen.weights_jump <= c.weight_jump):
            return "weights_before"
        if p.has_inputs and self._check_inputs(seen.input_max) is not None:
            return "bad_batch"
        if not (math.isfinite(seen.loss) and math.isfinite(seen.grad_norm)):
            return "nonfinite"
        if self.max_lr > 0 and p.lr_now > c.lr_jump * self.max_lr:
            return "lr_spike"
        if self.grad.check(seen.grad_norm) or self.loss.check(seen.buckets):
            return "spike"
        if not ok_after or not jump_after <= c.weight_jump:
            return "weights_after"
        self.grad.observe(seen.grad_norm)
        self.loss.observe(seen.buckets)
        self.max_lr = max(self.max_lr, p.lr_now)
        self.trend.observe(p.step, p.lr_now, seen.grad_norm, seen.loss)
        if self.trend.check() or self.divergence.check_and_observe(seen.loss, p.step):
            return "trend"
        return None

    def _rewind(self, mark: Mark, i: int, why: str, seen: _Seen) -> Flush:
        """Step ``i`` of the window failed its check: back to the window's start; steps
        before it run again speculatively, and it runs on its own. The cost: the window's
        steps computed so far (at most ``check_every``), counted in ``steps_discarded``."""
        self.counts["rewinds"] += 1
        self.counts["steps_discarded"] += len(self._pending)
        self._marks.restore(self, mark)
        self._pending, self._mark = [], None
        self._sync_at = mark.step + i
        self._suspect = (why, seen.loss, seen.grad_norm)
        return Flush([], rewind=Rewind(mark.step, mark.batches_consumed, self._sync_at, why,
                                       extra=mark.extra))

    def _transient(self, first: Finding, step: int) -> Incident:
        """The re-run of a non-finite step was finite: record the transient fault (per rank:
        many on one rank is that device's problem)."""
        e = first.evidence
        f = findings.TransientFault.new(first=first.kind, loss=e.get("loss"),
                                        grad_norm=e.get("grad_norm"))
        if e.get("rank") is not None:
            f.evidence["rank"] = e["rank"]
        key = str(e.get("rank", 0))
        self.transient[key] = self.transient.get(key, 0) + 1
        return self._record(f, "rerun", step=step,
                            cost={"steps_redone": 0, "batches_skipped": 0, "reruns": 1})

    def _lr_factor_now(self) -> float:
        """The LR multiplier of this step: the rollback backoff while it lasts, and the cap
        an ``lr_too_high`` set (the schedule's LR wins where it is lower)."""
        if self.progress.step >= self.backoff_until:
            self.lr_factor = 1.0
        factor = self.lr_factor
        if self.lr_cap is not None:
            lr = max(g["lr"] for g in self.optimizer.param_groups)
            if lr > 0:
                factor = min(factor, self.lr_cap / lr)
        self.last_factor = factor
        return factor

    # ------------------------------------------------------------------ samples

    def _attribute(self, f: Finding, t: torch.Tensor | None, ps: torch.Tensor,
                   inputs: torch.Tensor | None, indices, num_micro: int,
                   world: int) -> list[dict[str, Any]] | None:
        """The samples that explain a data finding, or None when it is not down to a few of
        them (at most ``sample_drop_max`` of the batch). One extra transfer and, under DDP,
        one gather: on incidents only.

        - a batch with NaN/Inf: the samples holding them; far out of range: the samples
          beyond 10x the usual max |x|;
        - a non-finite loss: the samples whose loss (or input) is non-finite;
        - a loss spike: the fewest highest-loss samples without which the per-t-bucket
          detector would not have fired.
        """
        c = self.cfg
        if not c.sample_drop_max:
            return None
        ps = ps.detach().float().reshape(-1)
        n = ps.numel()
        if inputs is not None and inputs.shape[0] == n:
            flat = inputs.detach().reshape(n, -1).float()
            fin = torch.isfinite(flat).all(1)
            amax = torch.where(fin, flat.abs().amax(1), torch.full_like(ps, math.inf))
        else:
            fin, amax = torch.ones(n, dtype=torch.bool, device=ps.device), torch.zeros_like(ps)
        tt = t.detach().float().reshape(-1) if t is not None else torch.full_like(ps, -1)
        rows = hostsync.values(torch.stack([amax, ps, tt.to(ps.device), fin.float()], 1))
        idx = (indices.tolist() if isinstance(indices, torch.Tensor) else
               list(indices) if indices is not None else [None] * n)
        per_rank = distributed.gather_objects((rows, idx))  # incidents only
        everyone = [_Sample(r, p, None if ix[p] is None else int(ix[p]), a, lo, int(tv),
                            bool(fi))
                    for r, (rs, ix) in enumerate(per_rank)
                    for p, (a, lo, tv, fi) in enumerate(rs)]
        k_max = int(c.sample_drop_max * len(everyone))
        bad, why = self._responsible(f, everyone, k_max)
        if not bad or len(bad) > k_max:
            return None
        sizes = [len(rs) for rs, _ in per_rank]
        if any(sum(1 for s in bad if s.rank == r) >= n_r for r, n_r in enumerate(sizes)):
            return None  # a rank would keep no sample (and could not join the backward)
        chunk = -(-n // max(num_micro, 1))  # torch.chunk's micro-batch size
        return [s.row(s.position // chunk, self._source(s.index), why, world) for s in bad]

    def _responsible(self, f: Finding, samples: list[_Sample], k_max: int
                     ) -> tuple[list[_Sample], str]:
        if f.kind == "bad_batch":
            usual = num(f.evidence.get("usual_max_abs_input"))
            if usual is None:
                return [s for s in samples if not s.finite_input], "non-finite input"
            return ([s for s in samples if s.max_abs_input > 10 * usual],
                    f"input beyond 10x the usual max |x| ({usual:.3g})")
        if f.kind == "nonfinite_loss":
            return ([s for s in samples if not (s.finite_input and math.isfinite(s.loss))],
                    "non-finite loss")
        # a loss spike: drop the worst samples until the bucket detector would stay quiet;
        # not while spikes keep coming (a skip or a sample drop for a spike within
        # skip_window): an unstable model spikes on many samples, the data is not at fault
        now, window = self.progress.step, self.cfg.skip_window
        if any(e >= now - window for e in (*self.skips, *self.spike_drops)):
            return [], ""
        nb, stats = self.cfg.t_buckets, self.loss.stats

        def bucket(s: _Sample) -> int:
            return min(max(s.t * nb // self.T, 0), nb - 1)

        def excess(s: _Sample) -> float:
            st = stats[bucket(s)]
            return s.loss / math.exp(st.mean) if st.count and s.loss > 0 else 0.0

        ranked = sorted((s for s in samples if s.t >= 0), key=excess, reverse=True)
        for k in range(1, min(k_max, len(ranked)) + 1):
            sums, counts = [0.0] * nb, [0] * nb
            for s in ranked[k:]:
                sums[bucket(s)] += s.loss
                counts[bucket(s)] += 1
            means = [sm / ct if ct else None for sm, ct in zip(sums, counts)]
            if self.loss.check(means) is None:
                return ranked[:k], "loss far above its t-bucket's"
        return [], ""

    def _source(self, index: int | None) -> str | None:
        if index is None or self.sample_source is None:
            return None
        try:
            src = self.sample_source(index)
        except Exception:  # naming a file must never take the recovery down
            return None
        return None if src is None else str(src)

    def _drop_samples(self, f: Finding, samples: list[dict[str, Any]], seen: _Seen, rerun,
                      inputs, indices, num_micro, after_update, probe_forward) -> Decision:
        """Train this step on the batch without the bad samples: record the finding, redo
        the forward and backward on the rest (every rank: DDP reduces the gradients), and
        judge that step like any other."""
        prog = self.progress
        me = dist.get_rank() if seen.world > 1 else 0
        keep = torch.ones(seen.n_local, dtype=torch.bool)
        keep[[x["position"] for x in samples if x.get("rank", 0) == me]] = False
        f.evidence["samples"] = samples
        if seen.world > 1:  # where the bad samples were
            f.evidence["rank"] = min(x["rank"] for x in samples)
        self.update.discard(prog)  # no update from the poisoned gradients
        self.counts["samples_dropped"] += len(samples)
        inc = self._record(f, "drop_samples", cost={"samples_dropped": len(samples),
                                                     "steps_redone": 0, "batches_skipped": 0,
                                                     "batch_position": prog.batches_consumed})
        quarantined = self._implicate(samples)
        if f.kind == "loss_spike":
            self.spike_drops.append(prog.step)
        keep_dev = keep.to(inputs.device if inputs is not None else self.device)
        loss, ps, t = rerun(keep_dev, seen.n_global - len(samples))
        kept_idx = (None if indices is None else
                    indices[keep_dev.to(indices.device)] if isinstance(indices, torch.Tensor)
                    else [i for i, k in zip(indices, hostsync.values(keep)) if k])
        d = self.step(loss, t=t, per_sample_loss=ps,
                      inputs=inputs[keep_dev] if inputs is not None else None,
                      indices=kept_idx, num_micro=num_micro, after_update=after_update,
                      probe_forward=probe_forward)
        d.dropped = tuple(x["index"] for x in samples if x["index"] is not None) + d.dropped
        d.quarantined = quarantined + d.quarantined
        if d.incident is None:
            d.incident = inc
        return d

    def _implicate(self, samples: list[dict[str, Any]]) -> tuple[int, ...]:
        """Count a data incident against each sample; quarantine those implicated
        ``quarantine_after`` times. Returns the newly quarantined indices."""
        c, new = self.cfg, []
        for x in samples:
            i = x.get("index")
            if i is None:
                continue
            steps = self.implicated.setdefault(int(i), [])
            steps.append(self.progress.step)
            if c.quarantine_after and len(steps) >= c.quarantine_after \
                    and i not in self.quarantine:
                self.quarantine.add(int(i))
                self.counts["quarantined"] += 1
                new.append(int(i))
                self._record(findings.SampleQuarantined.new(
                    index=int(i), times=len(steps), steps=list(steps), source=x.get("source"),
                    why=x.get("why")), "quarantine")
        return tuple(new)

    def _jump_skipped(self) -> None:
        """Move the data position past the batches a rollback decided not to train on."""
        prog = self.progress
        while prog.batches_consumed in self.pending_skips:
            self.pending_skips.discard(prog.batches_consumed)
            prog.batches_consumed += 1

    # ------------------------------------------------------------------ inspection

    def _rows(self, loss: torch.Tensor, gnorm: torch.Tensor, t: torch.Tensor | None,
              per_sample_loss: torch.Tensor | None, inputs: torch.Tensor | None,
              before: torch.Tensor) -> torch.Tensor:
        """The step's numbers on the device, every rank's: (world, D) rows of loss, grad
        norm, input range, samples, the weights' check before the forward (``before``: all
        finite, largest norm ratio), per-bucket loss sums and counts. Under DDP one
        collective (no host read): every rank decides from the same numbers, so a NaN on one
        rank makes all of them skip or roll back together."""
        ps = per_sample_loss.detach().float() if per_sample_loss is not None else None
        n_local = float(ps.numel()) if ps is not None else 1.0
        dev = loss.device
        parts = [loss.detach().float().mean().reshape(1), gnorm.float().reshape(1).to(dev)]
        parts.append((inputs.detach().float().abs().amax().reshape(1).to(dev)
                      if inputs is not None else torch.zeros(1, device=dev)))
        parts.append(torch.full((1,), n_local, device=dev))
        parts.append(before.to(dev))
        nb = self.cfg.t_buckets
        if t is not None and ps is not None:
            b = (t.long() * nb // self.T).clamp_(0, nb - 1)
            # (index_add_ of ones, not bincount: bincount's output size is read on the host)
            parts += [torch.zeros(nb, device=ps.device).index_add_(0, b, ps),
                      torch.zeros(nb, device=ps.device).index_add_(0, b, torch.ones_like(ps))]
        return distributed.gather_rows(torch.cat(parts))

    def _seen(self, rows: torch.Tensor, n_local: int, judged_t: bool) -> _Seen:
        """The host's view of one step from its rows (on the host)."""
        nb = self.cfg.t_buckets
        world = rows.shape[0]
        self._bad_rank = _first_bad_rank(rows[:, :3]) if world > 1 else None
        # a finite outlier batch: the rank holding the largest input (every value finite)
        self._outlier_rank = int(rows[:, 2].argmax()) if world > 1 else None
        # the global mean loss (ranks may hold different shares of an uneven batch)
        loss_v = float((rows[:, 0] * rows[:, 3]).sum() / rows[:, 3].sum())
        col = rows[:, 2]
        in_max = float(col.max()) if bool(torch.isfinite(col).all()) else float("nan")
        buckets: list[float | None] = [None] * nb
        if rows.shape[1] > 6:
            sums, counts = rows[:, 6:6 + nb].sum(0).tolist(), rows[:, 6 + nb:].sum(0).tolist()
            buckets = [s / n if n else None for s, n in zip(sums, counts)]
        jumps = rows[:, 5]
        return _Seen(loss_v, float(rows[:, 1].mean()), in_max, buckets, world, judged_t,
                     n_local=n_local, n_global=int(rows[:, 3].sum()),
                     weights_ok=bool((rows[:, 4] > 0).all()),
                     weights_jump=float(jumps.max()) if bool(torch.isfinite(jumps).all())
                     else math.inf)

    def _sync(self, loss: torch.Tensor, gnorm: torch.Tensor, t: torch.Tensor | None,
              per_sample_loss: torch.Tensor | None, inputs: torch.Tensor | None,
              before: torch.Tensor) -> _Seen:
        """The step's rows, read on the host (one read, the per-step check's only one)."""
        rows = hostsync.read(self._rows(loss, gnorm, t, per_sample_loss, inputs, before))
        n_local = per_sample_loss.numel() if per_sample_loss is not None else 1
        return self._seen(rows, n_local, t is not None and per_sample_loss is not None)

    def _inspect(self, seen: _Seen, has_inputs: bool, replay, num_micro,
                 after_backward) -> Finding | None:
        """The batch and the finiteness of loss and gradients. Under fp16 a non-finite
        value is first the scaler's business: gradients that overflowed (finite loss), or a
        forward pass that overflowed the fp16 range (the replay names the module)."""
        finding = self._check_inputs(seen.input_max) if has_inputs else None
        if finding is not None or (math.isfinite(seen.loss) and math.isfinite(seen.grad_norm)):
            return finding
        if self.progress.scaler is not None:
            forward = not math.isfinite(seen.loss)
            prov = (self._provenance(replay, num_micro, after_backward)
                    if forward and self.cfg.provenance else None) or {}
            # where it began: in fp16 the first inf is the first non-finite output; an
            # attention layer's softmax turns its inf logits into NaN before any output
            attn = provenance.attention_owner(self.net, prov.get("first_nonfinite_module")
                                              or prov.get("first_overflow_module"))
            if not forward or prov.get("first_overflow_module") or attn:
                return self._overflow_finding(seen, prov or None, forward, attn)
        if not math.isfinite(seen.loss):
            return findings.NonfiniteLoss.new(loss=seen.loss, grad_norm=seen.grad_norm)
        return findings.NonfiniteGrad.new(loss=seen.loss, grad_norm=seen.grad_norm)

    def _overflow_finding(self, seen: _Seen, prov: dict | None, forward: bool,
                          attn: str | None = None) -> Finding:
        """An fp16 overflow: ``routine`` (gradients, while the scale calibrates), ``spike``
        (an activation in the forward pass) or ``trend`` (repeated within the window).
        ``attn``: the attention layer where the forward overflow began, if any."""
        scale = self.progress.scaler.get_scale()
        trend = self.overflow.record(self.progress.step, scale)
        if trend is not None:
            self.overflow.clear()
            trend.evidence["precision"] = self.progress.precision
            if prov:
                trend.evidence["provenance"] = prov
            if attn:
                trend.evidence["attention_module"] = attn
            return trend
        f = findings.Fp16Overflow.forward(loss=seen.loss, loss_scale=scale, provenance=prov,
                                          attention_module=attn)
        if not forward:
            f.severity = "routine"  # gradients overflowed: the scaler's calibration, silent
        return f

    def _gather_evidence(self, finding: Finding, replay, num_micro, after_backward,
                         probe_forward) -> None:
        c = self.cfg
        rank = self._bad_rank
        if rank is None and finding.kind == "bad_batch":
            rank = self._outlier_rank  # finite but far outside the usual range
        if rank is not None:
            finding.evidence["rank"] = rank  # where the bad value appeared
        if finding.severity == "spike":
            finding.evidence.update(self._spike_evidence())
        if c.provenance and finding.kind != "bad_batch":
            # replay the step with hooks: the first module that went non-finite or past the
            # fp16 range, and the first parameters whose gradients did
            finding.evidence["provenance"] = self._provenance(replay, num_micro,
                                                              after_backward)
        if probe_forward is not None and finding.kind != "bad_batch":
            # the expensive health probes run on every incident, not only every N steps
            finding.evidence["health"] = self._health(probe_forward)

    def _check_inputs(self, in_max: float) -> Finding | None:
        """A batch with NaN/Inf, or with values far beyond the usual range (x10 the running
        max |x|), is a data problem, not a model one: skip it and say so."""
        st = self.inputs
        if not math.isfinite(in_max):
            return findings.BadBatch.new(max_abs_input=in_max)
        usual = math.exp(st.mean) if st.count else None
        if usual is not None and st.count >= 10 and in_max > 10 * usual:
            return findings.BadBatch.new(max_abs_input=in_max, usual_max_abs_input=usual)
        st.update(math.log(max(in_max, 1e-12)))
        return None

    @torch.no_grad()
    def _weights_before(self) -> torch.Tensor:
        """(ok, jump) of the weights now against the last verified ones, on the device (no
        sync; the values travel in the step's one sync): a weight that changed between two
        steps (memory corruption, an in-place edit) is named before it is blamed on a
        batch. (1, 0) when there is nothing to compare with (the first step, after a
        rollback)."""
        if self._prev_norms is None:
            dev = self._params[0].device if self._params else None
            return torch.tensor([1.0, 0.0], device=dev)
        norms = sharding.norms(self._params)
        jump = (norms / torch.maximum(self._prev_norms, self._norm_floor)).max()
        return torch.stack([torch.isfinite(norms.sum()).float(), jump])

    @torch.no_grad()
    def _check_weights_before(self, seen: _Seen) -> Finding | None:
        if seen.weights_ok and seen.weights_jump <= self.cfg.weight_jump:
            return None
        norms = sharding.norms(self._params)
        return self._weights_finding(norms, seen.world, when="before_forward")

    @torch.no_grad()
    def _weights_after(self, world: int) -> tuple[torch.Tensor, torch.Tensor]:
        """After the update, before the EMA sees the weights: one fused reduction over them,
        on the device: ``(check, norms)``, check = (all finite, largest norm jump), reduced
        over the ranks."""
        norms = sharding.norms(self._params)
        jump = (norms / torch.maximum(self._prev_norms, self._norm_floor)).max() \
            if self._prev_norms is not None else torch.zeros((), device=norms.device)
        check = torch.stack([torch.isfinite(norms.sum()).float(), jump])
        if world > 1:
            check[0] = -check[0]  # MAX of -ok == -(MIN of ok)
            dist.all_reduce(check, op=dist.ReduceOp.MAX)
            check[0] = -check[0]
        return check, norms

    def _check_weights(self, world: int) -> Finding | None:
        """The after-update check of the per-step path, read on the host."""
        check, norms = self._weights_after(world)
        ok_v, jump_v = hostsync.values(check)  # host read
        if not ok_v or jump_v > self.cfg.weight_jump:
            return self._weights_finding(norms, world)
        self._prev_norms = norms
        return None

    def _weights_finding(self, norms: torch.Tensor, world: int, **where: Any) -> Finding:
        """Name the parameters that went bad (incidents only): non-finite values
        (``nonfinite_params``), else the norms that jumped past ``weight_jump`` or
        overflowed (``weight_jump``), with each one's element count and how many of its
        elements are bad. Under DDP every rank names its own and the first rank that has
        any is the one reported (one gather)."""
        c = self.cfg
        ref = (torch.maximum(self._prev_norms, self._norm_floor)
               if self._prev_norms is not None else self._norm_floor)
        ratios = hostsync.values(norms / ref)
        nonfinite = provenance.nonfinite_params(self.net)
        jumped = sorted(((r if math.isfinite(r) else math.inf, n)
                         for r, n in zip(ratios, self._names)
                         if not math.isfinite(r) or r > c.weight_jump), reverse=True)
        mine = {"nonfinite": nonfinite, "jumped": jumped[:3],
                "top": sorted(zip(ratios, self._names), reverse=True)[:3]}
        per_rank = distributed.gather_objects(mine)
        src = next((r for r, m in enumerate(per_rank) if m["nonfinite"]), None)
        if src is not None:
            bad = per_rank[src]["nonfinite"]
            if self.update.sharded:  # each rank saw its own shards: all of them, in order
                seen_bad = {n for m in per_rank for n in m["nonfinite"]}
                bad = [n for n, _ in self.net.named_parameters() if n in seen_bad]
            f: Finding = findings.NonfiniteParams.new(params=bad[:5], count=len(bad), **where)
        else:
            src = next((r for r, m in enumerate(per_rank) if m["jumped"]), None)
            if src is None:  # nothing past the limit here: the largest jumps anywhere
                src = max(range(len(per_rank)), key=lambda r: per_rank[r]["top"][0][0])
            top = per_rank[src]["jumped"] or per_rank[src]["top"]
            f = findings.WeightJump.new(params=[n for _, n in top],
                                        norm_ratio=[r for r, _ in top],
                                        threshold=c.weight_jump, **where)
        if world > 1:
            f.evidence["rank"] = src
        named = dict(self.net.named_parameters())
        elements = []
        for name in f.params[:3]:
            p = named.get(name)
            if p is None:
                continue
            w = sharding.local(p.detach()).float()  # FSDP: this rank's shard
            i = self._names.index(name) if name in self._names else None
            rms = (float(ref[i]) / math.sqrt(max(p.numel(), 1))) if i is not None else 0.05
            ok = torch.isfinite(w)
            finite_abs = torch.where(ok, w.abs(), torch.zeros_like(w))
            counts = (int((~ok).sum()), int((finite_abs > 100 * max(rms, 1e-12)).sum()),
                      float(finite_abs.max()) if w.numel() else 0.0)
            if self.update.sharded:  # every rank's shard of it (every rank is here)
                parts = distributed.gather_objects(counts)
                counts = (sum(c[0] for c in parts), sum(c[1] for c in parts),
                          max(c[2] for c in parts))
            elements.append({"param": name, "numel": p.numel(), "nonfinite": counts[0],
                             "huge": counts[1], "max_abs": counts[2]})
        f.evidence["elements"] = elements
        return f

    def _clipped_value(self, gnorm_v: float, clipped: torch.Tensor,
                       zlimit: float | None) -> float:
        mode = self.update.clip_mode
        if mode in ("global", "zclip"):
            limit = (zlimit if zlimit is not None else self.update.clip) if mode == "zclip" \
                else self.update.clip
            return min(gnorm_v, limit) if limit else gnorm_v
        return hostsync.value(clipped)  # host read: per_layer/agc only

    # ------------------------------------------------------------------ actions

    def history(self) -> History:
        """What :func:`policy.decide` needs to know about the run so far."""
        prog = self.progress
        return History(step=prog.step, skips=tuple(self.skips), rollbacks=tuple(self.rollbacks),
                       precision=prog.precision, supported=self._supported,
                       has_snapshot=len(self.ring) > 0,
                       snapshots=tuple(sn.step for sn in self.ring.ring),
                       last_rollback=self.last_rollback, same_rollbacks=self.same_rollbacks,
                       upcast=frozenset(self.upcast))

    def _act(self, f: Finding, seen: _Seen) -> Decision:
        """Carry out the policy's action for finding ``f``."""
        a = policy.decide(f, self.history(), self.cfg)
        if a.kind == "rollback":
            return self._rollback(f, a, seen)
        if a.kind == "abort":
            self.update.discard(self.progress)
            inc = self._record(f, "abort", diagnosis={"why": a.why, "reason": a.reason})
            return Decision("abort", self.progress.step, self.progress.batches_consumed,
                            seen.loss, seen.grad_norm, inc)
        return self._skip(f, a, seen)

    def _skip(self, f: Finding, a: Action, seen: _Seen) -> Decision:
        """No update this step; the batch is dropped (a scaler skip lowers the fp16 scale)."""
        c, prog = self.cfg, self.progress
        self.update.discard(prog)
        inc = None
        if a.scaler:
            self.scaler_skips += 1
            if a.upcast:
                self.upcast_attention(a.upcast)
                inc = self._record(
                    findings.AttentionUpcast.new(module=a.upcast, loss=seen.loss,
                                                 loss_scale=f.evidence.get("loss_scale"),
                                                 provenance=f.provenance or None),
                    "attention_upcast",
                    cost={"steps_redone": 0, "batches_skipped": 1,
                          "batch_position": prog.batches_consumed},
                    diagnosis={"reason": a.reason,
                               "note": f"q kᵀ and softmax of {a.upcast} in fp32 from now on"})
            elif f.severity == "trend" or a.precision:
                inc = self._record(f, "precision_fallback" if a.precision else "skip",
                                   diagnosis={"reason": a.reason, **(
                                       {"new_precision": a.precision} if a.precision else
                                       {"note": "precision fallback disabled or not "
                                                "available"})})
                if a.precision:
                    prog.precision, prog.scaler = a.precision, None
            elif a.record:
                inc = self._record(f, "skip", cost={"steps_redone": 0, "batches_skipped": 1,
                                                    "batch_position": prog.batches_consumed})
        else:
            self.skips.append(prog.step)
            self.counts["skips"] += 1
            inc = self._record(f, "skip", cost={"steps_redone": 0, "batches_skipped": 1,
                                                "batch_position": prog.batches_consumed})
        self.skipped_positions.append(prog.batches_consumed)
        prog.batches_consumed += 1
        self._jump_skipped()
        self._trim()
        if a.budget_abort:
            b = findings.SkipBudget.new(skips=len(self.skips), max_skips=c.max_skips,
                                        window=c.budget_window)
            inc = self._record(b, "abort", diagnosis={"why": a.budget_abort})
            return Decision("abort", prog.step, prog.batches_consumed, seen.loss,
                            seen.grad_norm, inc)
        return Decision("skip", prog.step, prog.batches_consumed, seen.loss, seen.grad_norm,
                        incident=inc, precision=a.precision if a.scaler else None)

    def _rollback(self, f: Finding, a: Action, seen: _Seen) -> Decision:
        """Restore a verified snapshot (the newest, or the newest from before a trend
        began), skip the implicated batches only, back the LR off or cap it."""
        c, prog = self.cfg, self.progress
        self.update.discard(prog)
        snap = self._snapshot_before(a.restore_before)
        failure_pos, failure_step = prog.batches_consumed, prog.step
        self.restore(snap)
        self._prev_norms = None
        start = snap.batches_consumed
        skip = set(range(start, start + c.skip_batches))
        if a.skip_data == "implicated":  # the failing batch, and the ones skipped since
            skip |= {failure_pos} | {p for p in self.skipped_positions if p >= start}
        self.pending_skips = {p for p in self.pending_skips | skip if p >= start}
        skipped = tuple(sorted(self.pending_skips))
        redone = prog.step - snap.step
        prog.step, prog.batches_consumed = snap.step, start
        self._jump_skipped()
        self.skipped_positions = deque(p for p in self.skipped_positions if p < start)
        self.ring.drop_after(snap.step)
        self.last_probe_step = None  # that step is redone; its probe is stale
        diagnosis: dict[str, Any] = {"reason": a.reason}
        if a.lr_cap_fraction is not None:  # the cause is the LR: cap it for good
            stable = num(f.evidence.get("lr_start")) or max(
                g["lr"] for g in self.optimizer.param_groups)
            cap = a.lr_cap_fraction * stable
            self.lr_cap = cap if self.lr_cap is None else min(self.lr_cap, cap)
            diagnosis["lr_cap"] = self.lr_cap
        else:
            self.lr_factor = max(self.lr_factor * c.lr_backoff, 1e-4)
            self.backoff_until = prog.step + c.lr_backoff_steps
            diagnosis.update(lr_factor=self.lr_factor, lr_restored_at_step=self.backoff_until)
        if (snap.step, a.reason) == self.last_rollback:
            self.same_rollbacks += 1
        else:
            self.last_rollback, self.same_rollbacks = (snap.step, a.reason), 1
        self.rollbacks.append(prog.step)
        self.skips.clear()
        self.divergence.reset_best()
        self.trend.reset()
        self.counts["rollbacks"] += 1
        self.counts["steps_redone"] += redone
        self.counts["batches_skipped"] += len(skipped)
        if a.precision:
            prog.precision = a.precision
            diagnosis["new_precision"] = a.precision
        inc = self._record(f, "rollback", step=failure_step, cost={
            "steps_redone": redone, "batches_skipped": len(skipped),
            "skipped_positions": list(skipped), "restored_step": snap.step},
            diagnosis=diagnosis)
        self._trim()
        return Decision("rollback", prog.step, prog.batches_consumed, seen.loss,
                        seen.grad_norm, inc, skipped_batches=skipped, precision=a.precision)

    def _snapshot_before(self, step: int | None) -> Snapshot:
        """The newest snapshot at or before ``step`` (None: the newest); the oldest when
        every snapshot is newer."""
        ring = list(self.ring.ring)
        if step is None:
            return ring[-1]
        older = [sn for sn in ring if sn.step <= step]
        return older[-1] if older else ring[0]

    def _trim(self) -> None:
        """Forget skips and rollbacks older than every window that counts them."""
        c, now = self.cfg, self.progress.step
        horizon = now - max(c.skip_window, c.budget_window)
        for events in (self.skips, self.rollbacks, self.spike_drops):
            while events and events[0] < horizon:
                events.popleft()
        oldest = self.ring.oldest()  # a skipped batch matters while a rollback can reach it
        keep_from = (oldest.batches_consumed if oldest is not None
                     else self.progress.batches_consumed)
        while self.skipped_positions and self.skipped_positions[0] < keep_from:
            self.skipped_positions.popleft()

    # ------------------------------------------------------------------ OOM

    def handle_oom(self, micro_batch: int, error: BaseException) -> int | None:
        """Out of memory in the forward/backward: halve the micro-batch (the caller doubles
        gradient accumulation so the global batch stays the same, as Composer's automatic
        micro-batching does). Returns the new micro-batch size, or None to abort."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        f = findings.OutOfMemory.new(micro_batch=micro_batch, error=error)
        new, why = policy.decide_oom(micro_batch, self.cfg)
        if new is None:
            self._record(f, "abort", diagnosis={"why": why})
        else:
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
                out.update(provenance.trace(self.net, replay, num_micro, after_backward,
                                            every=self.update.sharded))
            except Exception as e:  # a replay must never take the run down
                out["replay_error"] = f"{type(e).__name__}: {e}"
        ranks = distributed.gather_objects(out)  # one collective, on incidents only
        if len(ranks) == 1:
            return out
        named = [r for r, o in enumerate(ranks)
                 if o.get("first_nonfinite_module") or o.get("first_overflow_module")]
        reproduced = [r for r, o in enumerate(ranks) if o.get("reproduced")]
        src = (named or reproduced or [0])[0]
        merged = {**ranks[src], "rank": src,
                  "ranks_reproduced": reproduced, "world_size": len(ranks)}
        if self.update.sharded:  # each rank saw its own gradient shards: all of them
            bad = {n for o in ranks for n in o.get("nonfinite_grad_params", [])}
            merged["nonfinite_grad_params"] = [n for n in self._names if n in bad][:5]
            merged["nonfinite_grad_count"] = max(o.get("nonfinite_grad_count", 0)
                                                 for o in ranks)
        return merged

    def _spike_evidence(self) -> dict[str, Any]:
        """Which layers dominate the gradient, and which weights moved most since the last
        snapshot (names the parameter behind a spike, e.g. a corrupted weight)."""
        named = [(n, p) for n, p in self.net.named_parameters() if p.grad is not None]
        out: dict[str, Any] = {}
        if named:
            norms = hostsync.values(sharding.norms([p.grad for _, p in named]))
            top = sorted(zip(norms, (n for n, _ in named)), reverse=True)[:3]
            out["top_grad_layers"] = [{"param": n, "grad_norm": g} for g, n in top]
        snap = self.ring.newest()
        if snap is not None:
            pairs = [(n, p, snap.model[n]) for n, p in self.net.named_parameters()
                     if n in snap.model]
            # a snapshot holds this rank's shards (FSDP): their norms are reduced too
            now = hostsync.values(sharding.norms([p.detach() for _, p, _ in pairs])) \
                if pairs else []
            refs = hostsync.values(sharding.norms([r.float() for _, _, r in pairs],
                                                  reduce=self.update.sharded)) if pairs else []
            ratios = [(a / max(r, 1e-12), n) for a, r, (n, _, _) in zip(now, refs, pairs)]
            ratios.sort(reverse=True)
            out["weight_growth_since_snapshot"] = [{"param": n, "norm_ratio": r}
                                                   for r, n in ratios[:3]]
        return out

    def upcast_attention(self, name: str) -> None:
        """Compute attention layer ``name``'s q kᵀ and softmax in fp32 from now on (its
        ``upcast_attention`` attribute: steadydiff's and diffusers' attention modules), in
        the model and in the EMA's copy of it (which samples), and remember it: it survives
        rollbacks (an attribute, not a weight) and resumes (:meth:`state_dict`)."""
        module = dict(self.net.named_modules()).get(name)
        if module is None or not provenance.is_attention(module):
            raise ValueError(f"no attention module {name!r} with an upcast_attention attribute")
        module.upcast_attention = True
        copy = self.ema.module() if self.ema is not None else None
        twin = dict(copy.named_modules()).get(name) if copy is not None else None
        if twin is not None and provenance.is_attention(twin):
            twin.upcast_attention = True
        if name not in self.upcast:
            self.upcast.append(name)

    def _probe(self, forward: Callable[[], object]) -> None:
        c = self.cfg
        stats = probes.probe(self.net, forward)
        self.last_probe_step = self.progress.step
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
        Under FSDP there are no replicas (each rank holds its own shards): None.
        """
        if self.update.sharded:
            return None
        tensors = list(self._params) + (self.ema.tensors() if self.ema else [])
        prints = hostsync.read(distributed.gather_rows(distributed.tensor_fingerprint(tensors)))
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
        return self._record(findings.RankMismatch.new(
            ranks_differing=odd, source_rank=src, world_size=len(keys),
            fingerprints=[list(k) for k in keys]), "resync",
            diagnosis={"why": f"rank(s) {odd} resynchronized from rank {src}"})

    # ------------------------------------------------------------------ snapshots

    def snapshot(self) -> Snapshot | None:
        """Take a snapshot if the weights and EMA are finite (else keep the older ones)."""
        tensors = list(self._params) + (self.ema.tensors() if self.ema else [])
        if not hostsync.value(_all_finite(tensors)):
            return None
        with hostsync.allowed():  # copies to host memory: after the read, the queue is empty
            return self.ring.take(step=self.progress.step,
                                  batches_consumed=self.progress.batches_consumed,
                                  model=self.net,
                                  ema_state=self.ema.state() if self.ema else None,
                                  optimizer=self.optimizer, scheduler=self.update.scheduler,
                                  scaler=self.progress.scaler)

    def restore(self, snap: Snapshot) -> None:
        """Restore model, EMA, optimizer, scheduler, scaler and RNG from ``snap``."""
        restore_into(snap, model=self.net, optimizer=self.optimizer,
                     scheduler=self.update.scheduler, scaler=self.progress.scaler)
        if self.ema is not None and snap.ema is not None:
            self.ema.load(snap.ema)

    def restore_verified(self) -> int | None:
        """Restore the newest verified snapshot (the ring's: weights and EMA were checked
        finite when it was taken) into the model, EMA, optimizer, LR scheduler, grad scaler,
        RNG and the progress (``step``, ``batches_consumed``), dropping any gradients.

        Meant for after an ``abort`` decision, so the last good state can be saved as a
        checkpoint to resume from (steadydiff's trainer does so itself, as the abort point);
        the snapshot stays in the ring.

        Returns:
            The restored step, or None when there is no snapshot (nothing was changed).
        """
        snap = self.ring.newest()
        if snap is None:
            return None
        self.optimizer.zero_grad(set_to_none=True)
        self.restore(snap)
        self.progress.step, self.progress.batches_consumed = snap.step, snap.batches_consumed
        self._jump_skipped()  # batches a rollback decided not to train on stay skipped
        self.skipped_positions = deque(p for p in self.skipped_positions
                                       if p < snap.batches_consumed)
        self._prev_norms = None
        return snap.step

    def reset_budget(self) -> None:
        """Forget the recovery budget spent so far (skips, rollbacks, repeated rollbacks to
        one snapshot) and the temporary LR backoff, e.g. for a run resumed from its abort
        point with a lower LR. The LR cap, the quarantine and the detectors' statistics
        stay."""
        self.skips.clear()
        self.rollbacks.clear()
        self.last_rollback, self.same_rollbacks = None, 0
        self.lr_factor, self.backoff_until = 1.0, -1

    # ------------------------------------------------------------------ state / report

    @property
    def num_incidents(self) -> int:
        """Incidents of the whole run (across resumes)."""
        return self.incidents_before + len(self.incidents)

    def state_dict(self) -> dict[str, Any]:
        """Detector statistics, budgets and backoff (what exact resume needs). The progress
        (step, data position, precision, scaler) belongs to its owner: the trainer saves its
        own; a guard that keeps its own :class:`Progress` saves the precision (a fallback
        must survive the resume of somebody else's loop)."""
        own = ({"precision": self.progress.precision}
               if isinstance(self.progress, Progress) else {})
        return {**own,
            "grad": self.grad.stats.state(), "loss": [s.state() for s in self.loss.stats],
            "inputs": self.inputs.state(),
            "divergence": self.divergence.state(), "overflow": list(self.overflow.events),
            "skips": list(self.skips), "rollbacks": list(self.rollbacks),
            "lr_factor": self.lr_factor, "backoff_until": self.backoff_until,
            "max_lr": self.max_lr, "lr_cap": self.lr_cap, "trend": self.trend.state(),
            "quarantine": sorted(self.quarantine),
            "implicated": {str(k): v for k, v in self.implicated.items()},
            "pending_skips": sorted(self.pending_skips),
            "skipped_positions": list(self.skipped_positions),
            "last_rollback": list(self.last_rollback) if self.last_rollback else None,
            "same_rollbacks": self.same_rollbacks, "transient": dict(self.transient),
            "spike_drops": list(self.spike_drops),
            "upcast_attention": list(self.upcast),
            "counts": dict(self.counts),
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
        # (absent from checkpoints written before issue 13: the defaults)
        self.lr_cap = s.get("lr_cap")
        self.trend.load(s.get("trend"))
        self.quarantine = {int(i) for i in s.get("quarantine", ())}
        self.implicated = {int(k): list(v) for k, v in s.get("implicated", {}).items()}
        self.pending_skips = {int(p) for p in s.get("pending_skips", ())}
        self.skipped_positions = deque(int(p) for p in s.get("skipped_positions", ()))
        last = s.get("last_rollback")
        self.last_rollback = (int(last[0]), str(last[1])) if last else None
        self.same_rollbacks = int(s.get("same_rollbacks", 0))
        self.transient = {str(k): int(v) for k, v in s.get("transient", {}).items()}
        self.spike_drops = deque(int(x) for x in s.get("spike_drops", ()))
        for name in s.get("upcast_attention", []):  # re-applied to the freshly built model
            self.upcast_attention(name)
        if isinstance(self.progress, Progress) and s.get("precision"):
            self.progress.precision = s["precision"]
            if s["precision"] != "fp16":
                self.progress.scaler = None
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
        if c["samples_dropped"] or self.quarantine:
            head += (f", {c['samples_dropped']} sample(s) dropped, {len(self.quarantine)} "
                     "quarantined")
        if self.lr_cap is not None:
            head += f", LR capped at {self.lr_cap:.3g}"
        if self.transient:
            per = ", ".join(f"rank {r}: {n}" for r, n in sorted(self.transient.items()))
            head += (f", {sum(self.transient.values())} transient fault(s)"
                     + (f" ({per})" if len(self.transient) > 1 or "0" not in self.transient
                        else ""))
        if self.scaler_skips:
            head += f", {self.scaler_skips} fp16 overflow skip(s)"
        if c.get("rewinds"):
            head += (f", {c['rewinds']} window(s) of the deferred check redone "
                     f"({c['steps_discarded']} steps discarded)")
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
