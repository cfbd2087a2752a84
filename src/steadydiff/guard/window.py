"""Speculative windows: the guard's check without a host read per step.

With ``guard.check_every = K > 1`` the guard judges the steps of a *window* (up to K steps)
together. Each step of the window keeps its numbers on the device (loss, grad norm, input
range, the weights' checks, per-timestep loss sums), gates the update there (the fused
AdamW's ``found_inf``, the EMA's weight), and advances as if healthy. At the window's end the
host reads every step's numbers at once (:func:`steadydiff.hostsync.read`) and runs the
per-step host logic over them in order, exactly as it would have run step by step. When every
step passes, nothing else happens. When step *i* does not, the state goes back to the
window's start (:class:`Mark`), steps 0..i-1 run again (speculatively, and pass), and step
*i* runs with the per-step check: whatever the guard does there (skip, re-run, drop samples,
roll back, change precision) happens at the same step, from the same state, on the same data
as with ``check_every = 1``. The cost of an incident: up to K steps computed twice.

A :class:`Mark` holds the window start's device state as copies on the same device (weights,
optimizer moments, EMA, the fp16 scaler; one ``_foreach_copy_`` into buffers kept between
windows), the guard's host state (detector statistics, LR factors) and the progress counters.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

from .. import distributed, hostsync, sharding
from . import checks, findings
from .attribution import DATA_KINDS, input_amax, sample_rows
from .checks import Seen
from .detectors import Finding
from .records import Decision, Flush, Rewind

from .state import WINDOW_FIELDS as HOST_FIELDS

if TYPE_CHECKING:
    from .guard import Guard


def _ema_host(ema: Any) -> dict[str, Any]:
    """An EMA's counters (its tensors are in the device state)."""
    e = ema.ema if ema is not None else None
    out: dict[str, Any] = {}
    if e is not None and hasattr(e, "num_updates"):
        out["num_updates"] = e.num_updates
        if getattr(e, "posthoc", None) is not None:
            out["posthoc_updates"] = e.posthoc.num_updates
    return out


def _load_ema_host(ema: Any, host: dict[str, Any]) -> None:
    if not host:
        return
    e = ema.ema
    e.num_updates = host["num_updates"]
    if "posthoc_updates" in host:
        e.posthoc.num_updates = host["posthoc_updates"]


def device_tensors(params: list[torch.Tensor], optimizer: torch.optim.Optimizer, ema: Any,
                   scaler: torch.amp.GradScaler | None) -> list[torch.Tensor]:
    """Every tensor a healthy step changes: the trainable weights, their optimizer state, the
    EMA's averaged tensors, the scaler's scale and growth tracker."""
    out = list(params)
    for p in params:
        out += [v for v in optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor)]
    if ema is not None:
        out += ema.mutable_tensors()
    if scaler is not None:
        out += [t for t in (getattr(scaler, "_scale", None),
                            getattr(scaler, "_growth_tracker", None)) if t is not None]
    return [sharding.local(t) for t in out]  # FSDP: this rank's shards (views: copied into)


@dataclass
class Mark:
    """The state at a window's start."""

    step: int
    batches_consumed: int
    host: dict[str, Any]
    ema_host: dict[str, Any]
    tensors: list[torch.Tensor]       # the live tensors, in order
    copies: list[torch.Tensor]        # their values at the mark
    prev_norms: torch.Tensor | None
    rng: torch.Tensor
    cuda_rng: list[torch.Tensor] | None
    extra: Any = None  # the caller's own state (Guard.begin_step's mark)


def fits(tensors: list[torch.Tensor], fraction: float = 0.5) -> bool:
    """Whether copies of ``tensors`` take at most ``fraction`` of the free memory of each
    CUDA device they are on (always True on the CPU)."""
    need: dict[torch.device, int] = {}
    for t in tensors:
        if t.device.type == "cuda":
            need[t.device] = need.get(t.device, 0) + t.numel() * t.element_size()
    ok = all(n <= fraction * torch.cuda.mem_get_info(d)[0] for d, n in need.items())
    if distributed.active():  # every rank speculates, or none (they redo steps together)
        flag = torch.tensor([float(ok)], device=tensors[0].device if tensors else "cpu")
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
        ok = hostsync.value(flag) > 0
    return ok


def rng_states() -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    """The CPU and CUDA RNG states (host-side: no device read)."""
    return (torch.get_rng_state(),
            torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)


class Marks:
    """Takes and restores :class:`Mark` s, reusing the copy buffers between windows."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []

    def take(self, guard: Any, rng: tuple[torch.Tensor, list[torch.Tensor] | None]
             ) -> Mark | None:
        """The guard's state now; ``rng``: the RNG states from before the step's forward
        (dropout draws from them: the step must draw the same again). None when the copy
        does not fit in the accelerator's free memory (a full fine-tune of a model near the
        memory limit): the caller checks every step instead."""
        g = guard
        live = device_tensors(g.update.params, g.optimizer, g.ema, g.progress.scaler)
        bufs = self._buffers
        same = len(bufs) == len(live) and all(
            b.shape == t.shape and b.dtype == t.dtype and b.device == t.device
            for b, t in zip(bufs, live))
        if not same and not fits(live):
            return None
        if not same:
            bufs = self._buffers = [torch.empty_like(t) for t in live]
        with torch.no_grad():
            torch._foreach_copy_(bufs, live)
        return Mark(step=g.progress.step, batches_consumed=g.progress.batches_consumed,
                    host=copy.deepcopy({k: getattr(g.state, k) for k in HOST_FIELDS}),
                    ema_host=_ema_host(g.ema), tensors=live, copies=bufs,
                    prev_norms=g.weights.prev.clone() if g.weights.prev is not None else None,
                    rng=rng[0], cuda_rng=rng[1])

    @staticmethod
    def restore(guard: Any, mark: Mark) -> None:
        """Put the guard, the model, its optimizer, EMA, scaler and the progress back to
        ``mark`` (the copies stay valid: the same mark can be restored again)."""
        g = guard
        with torch.no_grad():
            torch._foreach_copy_(mark.tensors, mark.copies)
        for k, v in copy.deepcopy(mark.host).items():
            setattr(g.state, k, v)
        _load_ema_host(g.ema, mark.ema_host)
        g.weights.prev = mark.prev_norms.clone() if mark.prev_norms is not None else None
        g.optimizer.zero_grad(set_to_none=True)
        g.progress.step, g.progress.batches_consumed = mark.step, mark.batches_consumed
        torch.set_rng_state(mark.rng)
        if mark.cuda_rng is not None:
            torch.cuda.set_rng_state_all(mark.cuda_rng)


@dataclass
class Pending:
    """A speculative step, judged at the next flush."""

    step: int                 # the step counter after it
    lr_now: float
    judged_t: bool
    n_local: int
    has_inputs: bool
    rows: torch.Tensor        # (world, D): the numbers before the update, every rank's
    after: torch.Tensor       # (3,): weights finite after the update, their jump, clipped norm
    probe_forward: Callable[[], object] | None
    # what attribution needs if this step fails (references, read only then)
    per_sample: tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None] | None = None
    indices: Any = None
    num_micro: int = 1
    n_updates: int = 0        # ``after`` also holds each parameter's update ratio


@dataclass
class Suspect:
    """What a window's check saw at the step a rewind now judges on its own: ``why``, the
    numbers, and the first pass's finding with its evidence (samples and their files,
    parameters and elements, rank), kept in case the re-run does not reproduce it."""

    why: str
    loss: float
    grad_norm: float
    first: Finding | None = None


class Window:
    """The deferred check of guard ``g``: the steps not judged yet, the mark of the state at
    their start, and, after a rewind, the step to judge on its own and what the window saw
    there (:attr:`suspect`)."""

    def __init__(self, g: "Guard", check_every: int):
        self.g = g
        self.check_every = check_every
        self.pending: list[Pending] = []
        self.mark: Mark | None = None
        self.marks = Marks()
        self.sync_at: int | None = None      # the step a rewind judges on its own
        self.suspect: Suspect | None = None  # what the window saw there
        self._rng_at_start: tuple[torch.Tensor, list[torch.Tensor] | None] | None = None
        self._extra_at_start: Any = None
        self._state_ready = False  # every weight has its optimizer state (after step 1)

    def speculating(self) -> bool:
        """Whether this step runs speculatively: deferred checks are on, this is not the step
        a rewind judges on its own, every weight has its optimizer state (the first step
        creates it), and the clipping needs no statistics of the steps before (ZClip's
        threshold is the grad-norm statistics: those steps are read every step)."""
        g = self.g
        if self.check_every <= 1 or g.progress.step == self.sync_at \
                or g.update.clip_mode == "zclip":
            return False
        if not self._state_ready:  # once there, the state stays (a rollback reloads it)
            state = g.optimizer.state
            self._state_ready = all(state.get(p) for p in g.update.params)
        return self._state_ready

    def takes(self) -> bool:
        """Whether the step about to be judged goes into a window (opening one if needed)."""
        return self.speculating() and (bool(self.pending) or self.open())

    def take_suspect(self, retry: bool) -> Suspect | None:
        """At the step a rewind judges on its own: what the window saw there (and, unless
        this is a re-run of it, the rewind is done with)."""
        if self.g.progress.step != self.sync_at:
            return None
        suspect = self.suspect
        if not retry:
            self.sync_at, self.suspect = None, None
        return suspect

    def begin_step(self, mark: Callable[[], Any] | None = None) -> bool:
        """See :meth:`Guard.begin_step`."""
        if self.pending or not self.speculating():
            return False
        self._rng_at_start = rng_states()
        self._extra_at_start = mark() if mark is not None else None
        return True

    def due(self) -> bool:
        """See :meth:`Guard.due`."""
        if not self.pending:
            return False
        g = self.g
        c, step = g.cfg, g.progress.step
        return (len(self.pending) >= self.check_every or step == self.sync_at
                or step % c.snapshot_every == 0
                or bool(c.probe_every and step % c.probe_every == 0)
                or bool(self.pending[-1].rows.shape[0] > 1 and c.rank_check_every
                        and step % c.rank_check_every == 0 and not g.update.sharded))

    def open(self) -> bool:
        """Open a window: mark the state at its start. False (and the per-step check from
        now on) when the mark's copy does not fit on the device."""
        rng = self._rng_at_start if self._rng_at_start is not None else rng_states()
        mark = self.marks.take(self.g, rng)
        extra, self._rng_at_start, self._extra_at_start = self._extra_at_start, None, None
        if mark is None:
            print("warning: guard: no room on the device for the deferred check's copy of the "
                  "trainable state (more than half its free memory): checking every step "
                  "from now on, as guard.check_every=1 does")
            self.check_every = 1
            return False
        mark.extra = extra
        self.mark = mark
        return True

    def speculate(self, loss: torch.Tensor, t: torch.Tensor | None,
                  per_sample_loss: torch.Tensor | None, inputs: torch.Tensor | None,
                  after_update: Callable[[], None] | None,
                  probe_forward: Callable[[], object] | None, indices: Any = None,
                  num_micro: int = 1) -> Decision:
        """One step of a window: the per-step check's numbers stay on the device, the update
        is gated there, and the step counts as done until :meth:`flush` reads them."""
        g = self.g
        c, prog = g.cfg, g.progress
        before = g.weights.before()
        gnorm = g.update.norm(prog)
        n = per_sample_loss.numel() if per_sample_loss is not None else None
        amax = (input_amax(inputs, n) if inputs is not None and n and inputs.shape[0] == n
                else None)
        rows = checks.rows(loss, gnorm, t, per_sample_loss, inputs, before, c.t_buckets, g.T,
                           amax=amax)
        # the device's verdict: every rank's numbers finite, the weights sound before
        ok = (torch.isfinite(rows[:, :3]).all() & (rows[:, 4] > 0).all()
              & (rows[:, 5] <= c.weight_jump).all())
        factor = g.lr_factor_now()
        lr_now = max(pg["lr"] for pg in g.optimizer.param_groups) * factor
        tracking = c.update_ratio > 0 and g.weights.begin_update()
        clipped = g.update.apply(prog, gnorm, lr_factor=factor, gate=ok)
        if after_update is not None:
            after_update()
        check, norms = g.weights.after(rows.shape[0])
        ratios = [g.weights.update_ratios(norms).to(check.device)] if tracking else []
        g.weights.prev = norms
        g.update.commit(prog, gate=ok & (check[0] > 0) & (check[1] <= c.weight_jump))
        g.jump_skipped()
        self.pending.append(Pending(
            step=prog.step, lr_now=lr_now, judged_t=t is not None and per_sample_loss is not None,
            n_local=per_sample_loss.numel() if per_sample_loss is not None else 1,
            has_inputs=inputs is not None, rows=rows,
            after=torch.cat([check, clipped.detach().float().reshape(1).to(check.device),
                             *ratios]),
            probe_forward=probe_forward,
            per_sample=((t, per_sample_loss.detach(), amax) if per_sample_loss is not None
                        else None),
            indices=indices, num_micro=num_micro,
            n_updates=ratios[0].numel() if ratios else 0))
        return Decision("step", prog.step, prog.batches_consumed, pending=True)

    def flush(self) -> Flush:
        """See :meth:`Guard.flush`."""
        g = self.g
        pend, mark = self.pending, self.mark
        if not pend:
            return Flush([])
        host = hostsync.read(torch.cat([torch.cat([p.rows.flatten(), p.after])
                                        for p in pend]))
        values, off = [], 0
        for i, p in enumerate(pend):
            n, m = p.rows.numel(), 3 + p.n_updates
            rows, after = host[off:off + n].reshape(p.rows.shape), host[off + n:off + n + m]
            off += n + m
            seen = checks.seen(rows, p.n_local, p.judged_t, g.cfg.t_buckets)
            why, finding = self.judge(seen, p, float(after[0]), float(after[1]),
                                      after[3:].tolist() if p.n_updates else None)
            if why is not None:
                return self.rewind(mark, i, why, seen, self.first_pass(why, finding, p, seen, mark))
            clip = g.update.clip
            clipped = (min(seen.grad_norm, clip) if clip else seen.grad_norm) \
                if g.update.clip_mode == "global" else float(after[2])
            values.append((seen.loss, seen.grad_norm, clipped,
                           seen.buckets if p.judged_t else None))
        self.pending, self.mark = [], None
        return Flush(values, incident=g.cadence(pend[-1].rows.shape[0],
                                                pend[-1].probe_forward))

    def judge(self, seen: Seen, p: Pending, ok_after: float, jump_after: float,
              ratios: list[float] | None = None) -> tuple[str | None, Finding | None]:
        """The per-step check's host logic for one step of a window, in its order: (None,
        None) when the step would have been healthy (its statistics are then observed, as
        the per-step check observes them), else what it saw and, where the host logic makes
        one, its finding (weights are named later, from the device state)."""
        g = self.g
        c, st = g.cfg, g.state
        if not (seen.weights_ok and seen.weights_jump <= c.weight_jump):
            return "weights_before", None
        bad = checks.check_inputs(st.inputs, seen.input_max) if p.has_inputs else None
        if bad is not None:
            return "bad_batch", bad
        if not (math.isfinite(seen.loss) and math.isfinite(seen.grad_norm)):
            kind = findings.NonfiniteLoss if not math.isfinite(seen.loss) \
                else findings.NonfiniteGrad
            return "nonfinite", kind.new(loss=seen.loss, grad_norm=seen.grad_norm)
        if st.max_lr > 0 and p.lr_now > c.lr_jump * st.max_lr:
            return "lr_spike", findings.LrSpike.new(lr=p.lr_now, max_lr_so_far=st.max_lr,
                                                    threshold=c.lr_jump)
        g_spike, l_spike = st.grad.check(seen.grad_norm), st.loss.check(seen.buckets)
        if g_spike or l_spike:
            return "spike", l_spike or g_spike
        if not ok_after or not jump_after <= c.weight_jump:
            return "weights_after", None
        big = st.updates.check(ratios, p.lr_now)
        if big:
            return "large_update", g.large_update(big, ratios, p.lr_now)
        step = p.step - 1  # the step's number while it was taken, as the per-step check has it
        g.observe(seen, step, p.lr_now, ratios)
        trend = st.trend.check() or st.divergence.check_and_observe(seen.loss, step)
        if trend is not None:
            return "trend", trend
        return None, None

    def first_pass(self, why: str, finding: Finding | None, p: Pending, seen: Seen,
                   mark: Mark) -> Finding | None:
        """The failed step's finding with the evidence only this pass has, taken before the
        rewind overwrites the state (incidents only): the weights named and localised
        against the window's start (parameter, elements, values), the samples behind a data
        finding and their files, the rank where it appeared."""
        g = self.g
        step = p.step - 1  # the step's number while it was taken
        try:
            if finding is None:  # the weights, before the forward or after the update
                n = len(g.update.params)
                copies = mark.copies[:n]  # the weights verified at the window's start
                where = {"when": "before_forward"} if why == "weights_before" else {}
                finding = g.weights.finding(
                    sharding.norms(g.update.params), seen.world, g.cfg.weight_jump,
                    ref_norms=sharding.norms(copies, reduce=g.update.sharded), **where)
                g.weights.changed(finding, copies)
            if finding.kind in DATA_KINDS and p.per_sample is not None:
                t, ps, amax = p.per_sample
                samples = g.samples.from_rows(
                    finding, hostsync.values(sample_rows(t, ps, amax)), p.indices,
                    p.num_micro, seen.world, step)
                if samples:
                    finding.evidence["samples"] = samples
            rank = seen.bad_rank if seen.bad_rank is not None else (
                seen.outlier_rank if finding.kind == "bad_batch" else None)
            if rank is not None and seen.world > 1:
                finding.evidence.setdefault("rank", rank)
        except Exception as e:  # naming must never take the recovery down
            if finding is None:
                return None
            finding.evidence["evidence_error"] = f"{type(e).__name__}: {e}"
        finding.evidence["deferred_window"] = {"start": mark.step, "step": step,
                                      "check_every": self.check_every}
        return finding

    def rewind(self, mark: Mark, i: int, why: str, seen: Seen, first: Finding | None = None
               ) -> Flush:
        """Step ``i`` of the window failed its check: back to the window's start; steps
        before it run again speculatively, and it runs on its own. The cost: the window's
        steps computed so far (at most ``check_every``), counted in ``steps_discarded``."""
        g = self.g
        g.state.counts["rewinds"] += 1
        g.state.counts["steps_discarded"] += len(self.pending)
        self.marks.restore(g, mark)
        self.pending, self.mark = [], None
        self.sync_at = mark.step + i
        self.suspect = Suspect(why, seen.loss, seen.grad_norm, first)
        return Flush([], rewind=Rewind(mark.step, mark.batches_consumed, self.sync_at, why,
                                       extra=mark.extra))
