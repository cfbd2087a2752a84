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

import math
from collections import deque
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from .. import distributed, hostsync, sharding
from ..config import GuardConfig
from ..kinds import PRECISIONS, ClipMode, Precision
from ..trainer.precision import native_support
from . import actions, checks, findings, policy
from .attribution import DATA_KINDS, Attribution
from .checks import Seen
from .detectors import Finding
from .evidence import Evidence
from .findings import finding_from_row
from .policy import History
from .records import (Decision, DecisionKind, Flush, GuardAbort, Incident, IncidentLog,
                      Rewind)
from .snapshots import Snapshot, SnapshotRing, restore_into
from .state import GuardState
from .update import Progress, ProgressLike, Update
from .window import Suspect, Window
from . import basewatch

__all__ = ["DATA_KINDS", "Decision", "DecisionKind", "Flush", "Guard", "GuardAbort",
           "Incident", "Progress", "Rewind"]


def _all_finite(tensors: list[torch.Tensor]) -> torch.Tensor:
    """0-dim bool tensor: every tensor finite (one fused norm reduction, no sync)."""
    return sharding.all_finite(tensors)  # FSDP: over every rank's shards


def _state_view(name: str) -> property:
    """``Guard.<name>``: the :class:`GuardState` field of that name (read and write)."""
    return property(lambda self: getattr(self.state, name),
                    lambda self, v: setattr(self.state, name, v),
                    doc=f"The guard state's ``{name}`` (:class:`GuardState`).")


class Guard:
    """Detect, diagnose and recover from training failures, in any training loop.

    The guard's parts, each in its own module: :class:`~steadydiff.guard.state.GuardState`
    (everything it knows about the run: ``guard.state``), the deferred window
    (:class:`~steadydiff.guard.window.Window`), the checks (:mod:`.checks`: the step's
    numbers, the weights, the batch), sample attribution and quarantine
    (:class:`~steadydiff.guard.attribution.Attribution`), the policy (:mod:`.policy`,
    pure), the actions (:mod:`.actions`), the evidence (:mod:`.evidence`) and the records
    (:mod:`.records`).

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
        clip_mode, clip: gradient clipping (global | per_layer | agc | zclip). The guard
            clips: by default the global gradient norm to 1.0; ``clip=0`` disables it.
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
        # the frozen base's watch (guard/basewatch.py; set by the SD path's adapter runs)
        self.frozen: Any = None
        self.T = num_timesteps
        self.progress: ProgressLike = progress if progress is not None else Progress(
            precision=precision or ("fp16" if scaler is not None else "fp32"), scaler=scaler)
        self.device = device or next(self.net.parameters()).device
        self._supported = frozenset(p for p in PRECISIONS
                                    if native_support(p, self.device))
        self.state = GuardState(self.cfg)
        self.log = IncidentLog(run_dir)
        self.ring = SnapshotRing(self.cfg.snapshots)
        self.weights = checks.Weights(self.net, self.update.names, self.update.params,
                                      self.update.sharded)
        self.samples = Attribution(self.cfg, self.state, self.T, sample_source, self.record)
        self.evidence = Evidence(self)
        self.window = Window(self, self.cfg.check_every if defer else 1)
        self.snapshot()

    @property
    def run_dir(self) -> Path | None:
        return self.log.run_dir

    @property
    def incidents(self) -> list[Incident]:
        """This process's incidents, in order."""
        return self.log.incidents

    @property
    def check_every(self) -> int:
        """Steps judged together (1: every step read and judged at once)."""
        return self.window.check_every

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        """The grad scaler in use (owned by the progress object)."""
        return self.progress.scaler

    @property
    def precision(self) -> Precision:
        """The runtime precision (owned by the progress object)."""
        return self.progress.precision

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
        self.state.fresh_statistics()
        self.weights.forget()
        self.ring.ring.clear()
        self.snapshot()
        f = findings.ResolutionChange.new(old_size=old, new_size=new, step=self.progress.step,
                                          restarted=restarted, **context)
        return self.record(f, "restart_statistics", diagnosis={
            "note": f"statistics warm up again over guard.warmup_steps={self.cfg.warmup_steps}"})

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
        if _retry_of is None and self.window.takes():  # judged with its window, later
            return self.window.speculate(loss, t, per_sample_loss, inputs, after_update,
                                         probe_forward, indices, num_micro)
        if self.window.pending:
            raise RuntimeError("Guard.step: a per-step check with speculative steps not yet "
                               "judged; call flush() first (when due() says so)")
        suspect = self.window.take_suspect(retry=_retry_of is not None)
        # inspect: the step's numbers, in one host read
        gnorm = self.update.norm(self.progress)
        seen = self._read(loss, gnorm, t, per_sample_loss, inputs)
        factor = self.lr_factor_now()
        lr_now = max(g["lr"] for g in self.optimizer.param_groups) * factor
        # findings: the weights, the batch, loss and gradients, the LR, spikes
        finding = self._findings(seen, lr_now, inputs is not None, replay, num_micro,
                                 after_backward)
        if finding is not None and self.frozen is not None \
                and finding.kind in basewatch.SYMPTOMS:  # a corrupt frozen base, not the LR
            d = basewatch.check(self, seen)
            if d is not None:
                return d
        if finding is None:
            return self._healthy(seen, gnorm, factor, lr_now, _retry_of, suspect,
                                 after_update, probe_forward)
        if _retry_of is not None:
            finding.evidence["rerun"] = "non-finite again when run a second time: persistent"
        elif rerun is not None and self.cfg.rerun_nonfinite \
                and finding.kind in ("nonfinite_loss", "nonfinite_grad"):
            # the same step again (same data, t, noise): a flaky device or a bit flip in an
            # activation does not repeat; data and weights do
            if seen.world > 1 and seen.bad_rank is not None:
                finding.evidence["rank"] = seen.bad_rank
            self.update.discard(self.progress)
            loss, ps, t = rerun(torch.ones(seen.n_local, dtype=torch.bool,
                                           device=inputs.device if inputs is not None
                                           else self.device), seen.n_global)
            return self.step(loss, t=t, per_sample_loss=ps, inputs=inputs, indices=indices,
                             replay=replay, num_micro=num_micro, rerun=rerun,
                             after_backward=after_backward, after_update=after_update,
                             probe_forward=probe_forward, _retry_of=finding)
        # policy -> act
        return self._respond(finding, seen, lr_now, t, per_sample_loss, inputs, indices,
                             replay, num_micro, rerun, after_backward, after_update,
                             probe_forward)

    def _read(self, loss: torch.Tensor, gnorm: torch.Tensor, t: torch.Tensor | None,
              per_sample_loss: torch.Tensor | None, inputs: torch.Tensor | None) -> Seen:
        """The step's numbers (and the weights' check before the forward), read on the host
        (one read, the per-step check's only one)."""
        before = self.weights.before()
        rows = hostsync.read(checks.rows(loss, gnorm, t, per_sample_loss, inputs, before,
                                         self.cfg.t_buckets, self.T))
        n_local = per_sample_loss.numel() if per_sample_loss is not None else 1
        return checks.seen(rows, n_local, t is not None and per_sample_loss is not None,
                           self.cfg.t_buckets)

    def _findings(self, seen: Seen, lr_now: float, has_inputs: bool, replay, num_micro,
                  after_backward) -> Finding | None:
        """What is wrong with the step before its update, in order: the weights (changed
        since the last verified step), the batch, finiteness, the LR, spikes."""
        c, st = self.cfg, self.state
        finding = self.weights.check_before(seen, c.weight_jump)
        if finding is None:
            finding = checks.inspect(self, seen, has_inputs, replay, num_micro, after_backward)
        if finding is None and st.max_lr > 0 and lr_now > c.lr_jump * st.max_lr:
            # an LR far above anything applied before (warm-up and restarts stay below the
            # peak): a schedule or config bug, and it would wreck the weights in one update
            finding = findings.LrSpike.new(lr=lr_now, max_lr_so_far=st.max_lr,
                                           threshold=c.lr_jump)
        if finding is None:
            # a loss spike explains the gradient spike it causes: report it as the cause
            g_spike, l_spike = st.grad.check(seen.grad_norm), st.loss.check(seen.buckets)
            finding = l_spike or g_spike
            if l_spike and g_spike:
                l_spike.evidence["grad_norm"] = g_spike.evidence
        return finding

    def _respond(self, finding: Finding, seen: Seen, lr_now: float, t, per_sample_loss,
                 inputs, indices, replay, num_micro, rerun, after_backward, after_update,
                 probe_forward) -> Decision:
        """A finding: name the samples behind it (and train on the rest), or the LR behind
        spikes; gather the evidence; the policy decides and the action is carried out."""
        c = self.cfg
        samples = (self.samples.attribute(finding, t, per_sample_loss, inputs, indices,
                                          num_micro, seen.world, self.progress.step)
                   if finding.kind in DATA_KINDS and per_sample_loss is not None else None)
        if samples and rerun is not None:
            return self._drop_samples(finding, samples, seen, rerun, inputs, indices,
                                      num_micro, after_update, probe_forward)
        if not samples and finding.kind in ("grad_spike", "loss_spike"):
            # spikes at the end of a sustained rise, or that keep coming while the LR rose,
            # are its symptom: the LR is the cause
            trend = self.state.trend.check()
            if trend is None and policy.escalates(self.history(), c):
                trend = self.state.trend.lr_rose(lr_now, seen.grad_norm, seen.loss)
            if trend is not None:
                trend.evidence["symptom"] = finding.kind
                finding = trend
        if finding.kind != "fp16_overflow":
            rank = seen.bad_rank
            if rank is None and finding.kind == "bad_batch":
                rank = seen.outlier_rank  # finite but far outside the usual range
            self.evidence.gather(finding, rank, replay, num_micro, after_backward,
                                 probe_forward)
        if samples:
            finding.evidence["samples"] = samples
        d = actions.act(self, finding, seen)
        if samples:
            d.dropped = tuple(x["index"] for x in samples if x["index"] is not None)
            d.quarantined = self.samples.implicate(samples, self.progress.step)
        return d

    def _healthy(self, seen: Seen, gnorm: torch.Tensor, factor: float, lr_now: float,
                 retry_of: Finding | None, suspect: Suspect | None, after_update,
                 probe_forward) -> Decision:
        """A healthy step: update, check the weights, commit (EMA, counters), observe the
        statistics, run the guard's cadence (snapshot, probe, rank check)."""
        prog = self.progress
        zlimit = self.state.grad.clip_value() if self.update.clip_mode == "zclip" else None
        tracking = self.cfg.update_ratio > 0 and self.weights.begin_update()
        clipped = self.update.apply(prog, gnorm, lr_factor=factor, zclip=zlimit)
        if after_update is not None:
            after_update()
        finding, ratios = self.weights.check_after(seen.world, self.cfg.weight_jump,
                                                   updates=tracking)
        big = self.state.updates.check(ratios, lr_now) if finding is None else None
        if big:
            finding = self.large_update(big, ratios, lr_now)
        if finding is not None:
            return actions.act(self, finding, seen)
        step_done = prog.step
        self.update.commit(prog)
        self.jump_skipped()
        transient = self._transient(retry_of, step_done) if retry_of is not None else None
        if transient is None and suspect is not None and suspect.why == "nonfinite":
            # the window saw this step non-finite; run again on its own it is finite
            transient = self._unreproduced(suspect, step_done)[0]
            suspect = None
        self.observe(seen, step_done, lr_now, ratios)
        trend = self.state.trend.check() or self.state.divergence.check_and_observe(
            seen.loss, step_done)
        if trend is not None:
            return actions.act(self, trend, seen)
        quarantined: tuple[int, ...] = ()
        if transient is None and suspect is not None:
            # the window saw something at this step; run again on its own it is healthy:
            # still a fault, with what the window saw as its evidence
            transient, quarantined = self._unreproduced(suspect, step_done)
        mismatch = self.cadence(seen.world, probe_forward)
        return Decision("step", prog.step, prog.batches_consumed, seen.loss, seen.grad_norm,
                        incident=mismatch or transient,
                        grad_norm_clipped=self._clipped_value(seen.grad_norm, clipped, zlimit),
                        loss_t=seen.buckets if seen.judged_t else None,
                        quarantined=quarantined)

    def observe(self, seen: Seen, step: int, lr_now: float,
                ratios: list[float] | None = None) -> None:
        """A healthy step's numbers join the detectors' statistics."""
        st = self.state
        st.updates.observe(ratios, lr_now)
        st.grad.observe(seen.grad_norm)
        st.loss.observe(seen.buckets)
        st.max_lr = max(st.max_lr, lr_now)
        st.trend.observe(step, lr_now, seen.grad_norm, seen.loss)

    def large_update(self, big: list[tuple[int, float, float]], ratios: list[float],
                     lr: float) -> Finding:
        """The ``large_update`` finding: the parameters (largest excess first), their ratio
        and usual ratio, the step's median, and what their optimizer state says."""
        names = [self.update.names[j] for j, _, _ in big[:3]]
        return findings.LargeUpdate.new(
            params=names, ratio=[r for _, r, _ in big[:3]], usual=[u for _, _, u in big[:3]],
            median=self.state.updates.median(ratios), threshold=self.cfg.update_ratio, lr=lr,
            optimizer_state=checks.optimizer_state(
                self.optimizer, dict(self.net.named_parameters()), names))

    def cadence(self, world: int, probe_forward: Callable[[], object] | None
                ) -> Incident | None:
        """The guard's own cadence after a verified step: the rank check, the snapshot, the
        probes (each every N steps). Returns a rank mismatch's incident."""
        c, step = self.cfg, self.progress.step
        mismatch = None
        if world > 1 and c.rank_check_every and step % c.rank_check_every == 0:
            mismatch = self.check_ranks()
        if step % c.snapshot_every == 0:
            self.snapshot()
        if c.probe_every and step % c.probe_every == 0 and probe_forward is not None:
            self.evidence.probe(probe_forward)
        return mismatch

    # ------------------------------------------------------------------ speculative windows

    def begin_step(self, mark: Callable[[], Any] | None = None) -> bool:
        """Call before a step's forward pass. When the step opens a window, the RNG states
        are kept for the window's mark (dropout must draw the same when the window runs
        again), and so is ``mark()``: the caller's own state (e.g. fault injection), handed
        back in :attr:`Rewind.extra` to restore. Returns whether a window opens."""
        return self.window.begin_step(mark)

    @property
    def pending(self) -> int:
        """Speculative steps not judged yet."""
        return len(self.window.pending)

    def due(self) -> bool:
        """Whether the steps so far must be judged now (:meth:`flush`): the window is full,
        the next step is judged on its own, or a step of the guard's own cadence ends here
        (a snapshot, a probe, a rank check: they need the verified state). A trainer also
        flushes before anything that reads the state (a checkpoint, a log row, a sample)."""
        return self.window.due()

    def flush(self) -> Flush:
        """Judge the window's steps: one host read of all their numbers, then, step by step,
        the same host logic as the per-step check. All healthy: the window stands (the
        guard's own cadence runs for the last step: snapshot, probe, rank check). A step that
        is not: the state goes back to the window's start and a :class:`Rewind` says where
        the caller's data must continue; the guard then speculates up to that step and
        judges it on its own."""
        return self.window.flush()

    def _transient(self, first: Finding, step: int) -> Incident:
        """The re-run of a non-finite step was finite: record the transient fault (per rank:
        many on one rank is that device's problem)."""
        e = first.evidence
        f = findings.TransientFault.new(first=first.kind, loss=e.get("loss"),
                                        grad_norm=e.get("grad_norm"))
        f.evidence.update({k: e[k] for k in ("rank", "samples", "deferred_window")
                           if e.get(k) is not None})
        self.state.count_rank("transient", e.get("rank"))
        return self.record(f, "rerun", step=step,
                           cost={"steps_redone": 0, "batches_skipped": 0, "reruns": 1})

    def _unreproduced(self, suspect: Suspect, step: int
                      ) -> tuple[Incident | None, tuple[int, ...]]:
        """A deferred window saw step ``step`` fail (``suspect``), and the step, run again on
        its own from the same state and data, was healthy. Non-finite values: a
        ``transient_fault`` (as the per-step check's own re-run records it). Anything else —
        a bad read of the data that did not repeat, a weight changed between steps that the
        rewind restored — is recorded as a fault of its kind with the first pass's evidence
        (``reproduced: false``, action ``rerun``), counted per rank, and its samples are
        implicated like any other's (quarantined after repeats: returned)."""
        first = suspect.first
        if suspect.why == "nonfinite":
            kind = "nonfinite_loss" if not math.isfinite(suspect.loss) else "nonfinite_grad"
            # what the window's pass saw
            seen_first = {k: v for k, v in (first.evidence if first else {}).items()
                          if k in ("samples", "rank", "deferred_window")}
            return self._transient(Finding(kind, "spike", evidence={
                "loss": suspect.loss, "grad_norm": suspect.grad_norm, **seen_first}),
                step), ()
        if first is None:
            return None, ()
        first.evidence["reproduced"] = False
        self.state.count_rank("unreproduced", first.evidence.get("rank"))
        samples = first.evidence.get("samples") or []
        inc = self.record(first, "rerun", step=step, cost={
            "steps_redone": 0, "batches_skipped": 0, "reruns": 1},
            diagnosis={"note": "seen by the deferred check, not when the step ran again from "
                               "the same state and data: a fault that did not repeat"})
        return inc, self.samples.implicate(samples, step) if samples else ()

    def lr_factor_now(self) -> float:
        """The LR multiplier of this step: the rollback backoff while it lasts, and the cap
        an ``lr_too_high`` set (the schedule's LR wins where it is lower)."""
        st = self.state
        if self.progress.step >= st.backoff_until:
            st.lr_factor = 1.0
        factor = st.lr_factor
        if st.lr_cap is not None:
            lr = max(g["lr"] for g in self.optimizer.param_groups)
            if lr > 0:
                factor = min(factor, st.lr_cap / lr)
        st.last_factor = factor
        return factor

    # ------------------------------------------------------------------ samples

    def _attribute(self, f: Finding, t: torch.Tensor | None, ps: torch.Tensor,
                   inputs: torch.Tensor | None, indices, num_micro: int,
                   world: int) -> list[dict[str, Any]] | None:
        """The samples that explain a data finding (:meth:`Attribution.attribute`)."""
        return self.samples.attribute(f, t, ps, inputs, indices, num_micro, world,
                                      self.progress.step)

    def _drop_samples(self, f: Finding, samples: list[dict[str, Any]], seen: Seen, rerun,
                      inputs, indices, num_micro, after_update, probe_forward) -> Decision:
        """Train this step on the batch without the bad samples: record the finding, redo
        the forward and backward on the rest (every rank: DDP reduces the gradients), and
        judge that step like any other."""
        prog, st = self.progress, self.state
        me = dist.get_rank() if seen.world > 1 else 0
        keep = torch.ones(seen.n_local, dtype=torch.bool)
        keep[[x["position"] for x in samples if x.get("rank", 0) == me]] = False
        f.evidence["samples"] = samples
        if seen.world > 1:  # where the bad samples were
            f.evidence["rank"] = min(x["rank"] for x in samples)
        self.update.discard(prog)  # no update from the poisoned gradients
        st.counts["samples_dropped"] += len(samples)
        inc = self.record(f, "drop_samples", cost={"samples_dropped": len(samples),
                                                    "steps_redone": 0, "batches_skipped": 0,
                                                    "batch_position": prog.batches_consumed})
        quarantined = self.samples.implicate(samples, prog.step)
        if f.kind == "loss_spike":
            st.spike_drops.append(prog.step)
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

    def jump_skipped(self) -> None:
        """Move the data position past the batches a rollback decided not to train on."""
        actions.jump_skipped(self)

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
        prog, st = self.progress, self.state
        return History(step=prog.step, skips=tuple(st.skips), rollbacks=tuple(st.rollbacks),
                       precision=prog.precision, supported=self._supported,
                       has_snapshot=len(self.ring) > 0,
                       snapshots=tuple(sn.step for sn in self.ring.ring),
                       last_rollback=st.last_rollback, same_rollbacks=st.same_rollbacks,
                       upcast=frozenset(st.upcast))

    def upcast_attention(self, name: str) -> None:
        """Compute attention layer ``name``'s q kᵀ and softmax in fp32 from now on (its
        ``upcast_attention`` attribute: steadydiff's and diffusers' attention modules), in
        the model and in the EMA's copy of it (which samples), and remember it: it survives
        rollbacks (an attribute, not a weight) and resumes (:meth:`state_dict`)."""
        actions.upcast_attention(self, name)

    def probe_now(self, forward: Callable[[], object]) -> dict:
        """Run the attention/normalization probes on demand; returns the statistics."""
        self.evidence.probe(forward)
        return self.state.last_probe

    def record(self, f: Finding, action: str, cost: dict | None = None,
               diagnosis: dict | None = None, step: int | None = None) -> Incident:
        """Record an incident (also one found outside the guard's own detectors, e.g. the
        adapter guard's delta clamp) in incidents.jsonl, the report and the summary; at the
        current step unless ``step`` is given."""
        return self.log.record(f, action, self.progress.step if step is None else step,
                               cost, diagnosis)

    _record = record

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
        tensors = list(self.update.params) + (self.ema.tensors() if self.ema else [])
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
        self.weights.forget()
        self.ring.ring.clear()
        self.snapshot()
        return self.record(findings.RankMismatch.new(
            ranks_differing=odd, source_rank=src, world_size=len(keys),
            fingerprints=[list(k) for k in keys]), "resync",
            diagnosis={"why": f"rank(s) {odd} resynchronized from rank {src}"})

    # ------------------------------------------------------------------ snapshots

    def snapshot(self) -> Snapshot | None:
        """Take a snapshot if the weights and EMA are finite (else keep the older ones)."""
        tensors = list(self.update.params) + (self.ema.tensors() if self.ema else [])
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
        self.jump_skipped()  # batches a rollback decided not to train on stay skipped
        st = self.state
        st.skipped_positions = deque(
            p for p in st.skipped_positions if p < snap.batches_consumed)
        self.weights.forget()
        return snap.step

    def reset_budget(self) -> None:
        """Forget the recovery budget spent so far (skips, rollbacks, repeated rollbacks to
        one snapshot) and the temporary LR backoff, e.g. for a run resumed from its abort
        point with a lower LR. The LR cap, the quarantine and the detectors' statistics
        stay."""
        self.state.reset_budget()

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
            self.record(f, "abort", diagnosis={"why": why})
        else:
            self.record(f, "microbatch_backoff", diagnosis={"new_micro_batch": new})
        return new

    # ------------------------------------------------------------------ state / report

    @property
    def num_incidents(self) -> int:
        """Incidents of the whole run (across resumes)."""
        return self.state.incidents_before + len(self.log.incidents)

    def state_dict(self) -> dict[str, Any]:
        """Detector statistics, budgets and backoff (what exact resume needs:
        :meth:`GuardState.state_dict`). The progress (step, data position, precision,
        scaler) belongs to its owner: the trainer saves its own; a guard that keeps its own
        :class:`Progress` saves the precision (a fallback must survive the resume of
        somebody else's loop)."""
        own = ({"precision": self.progress.precision}
               if isinstance(self.progress, Progress) else {})
        return {**own, **self.state.state_dict(self.num_incidents)}

    def load_state_dict(self, s: dict[str, Any]) -> None:
        self.state.load_state_dict(s)
        upcast, self.state.upcast = list(s.get("upcast_attention", [])), []
        for name in upcast:  # re-applied to the freshly built model
            self.upcast_attention(name)
        if isinstance(self.progress, Progress) and s.get("precision"):
            self.progress.precision = s["precision"]
            if s["precision"] != "fp16":
                self.progress.scaler = None

    def summary(self) -> str:
        """A one-screen account of what the guard did."""
        n = self.num_incidents
        st = self.state
        c = st.counts
        if n == 0 and not st.scaler_skips:
            return "guard: healthy run, no incidents"
        head = (f"guard: {n} incident{'s' if n != 1 else ''}; {c['skips']} skipped step(s), "
                f"{c['rollbacks']} rollback(s) ({c['steps_redone']} steps redone, "
                f"{c['batches_skipped']} batches skipped), {c['warnings']} health warning(s)")
        if c["samples_dropped"] or st.quarantine:
            head += (f", {c['samples_dropped']} sample(s) dropped, {len(st.quarantine)} "
                     "quarantined")
        if st.lr_cap is not None:
            head += f", LR capped at {st.lr_cap:.3g}"
        if st.transient:
            per = ", ".join(f"rank {r}: {n}" for r, n in sorted(st.transient.items()))
            head += (f", {sum(st.transient.values())} transient fault(s)"
                     + (f" ({per})" if len(st.transient) > 1 or "0" not in st.transient
                        else ""))
        if st.unreproduced:
            per = ", ".join(f"rank {r}: {n}" for r, n in sorted(st.unreproduced.items()))
            head += (f", {sum(st.unreproduced.values())} fault(s) not reproduced when run "
                     "again" + (f" ({per})" if len(st.unreproduced) > 1
                                or "0" not in st.unreproduced else ""))
        if st.scaler_skips:
            head += f", {st.scaler_skips} fp16 overflow skip(s)"
        if c.get("rewinds"):
            head += (f", {c['rewinds']} window(s) of the deferred check redone "
                     f"({c['steps_discarded']} steps discarded)")
        lines = [head]
        incidents = self.log.incidents
        for inc in incidents[-12:]:
            lines.append(f"  step {inc.step:>6}  {inc.kind:<24} -> {inc.action:<18} "
                         f"{finding_from_row(inc.row()).summary()}")
        if n > len(incidents[-12:]):
            lines.insert(1, f"  ({n - len(incidents[-12:])} earlier incidents in "
                            "incidents.jsonl)")
        return "\n".join(lines)


# the state's fields, readable (and settable) on the guard as before it had rooms
for _name in ("grad", "loss", "divergence", "trend", "inputs", "overflow", "skips",
              "rollbacks", "last_rollback", "same_rollbacks", "spike_drops", "lr_factor",
              "backoff_until", "lr_cap", "last_factor", "max_lr", "quarantine", "implicated",
              "pending_skips", "skipped_positions", "upcast", "scaler_skips", "counts",
              "transient", "unreproduced", "incidents_before", "last_probe",
              "last_probe_step"):
    setattr(Guard, _name, _state_view(_name))
del _name
