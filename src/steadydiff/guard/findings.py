"""Typed incident findings: one record per kind the guard writes, and the one reader of rows.

An incident row of ``incidents.jsonl`` is ``{step, kind, severity, evidence, action, cost,
diagnosis, time}`` (docs/guard.md). Its ``evidence`` differs by kind; this module is the one
place that knows each kind's keys. Every reader (the guard's :meth:`Guard.summary`, the
report's incident table, the doctor's recommendations) turns a row into a record with
:func:`finding_from_row` and asks it for :meth:`Finding.summary` (what was seen, one line)
and :meth:`Finding.recommendation` (what to do), so the three say the same thing.

The evidence dict stays the record's storage: it is the row's wire format, which must not
change, and the guard adds context to it after detection (``provenance``, ``health``,
``rank``, the spike context ``top_grad_layers`` / ``weight_growth_since_snapshot``). Each
kind's class names its keys once: a keyword constructor ``new(...)`` that writes them as the
guard does today, and the summary and recommendation that read them.

``Finding(kind, severity, evidence)`` (re-exported by detectors.py) is both the generic
record (a kind this version does not know: an old run, or a newer one, still renders) and
the base of the typed ones; constructing it directly keeps working.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from ..values import finite, fmt, module_of, num

IncidentKind = Literal[
    "nonfinite_loss", "nonfinite_grad", "lr_spike", "loss_spike", "grad_spike", "divergence",
    "bad_batch", "fp16_overflow", "attention_upcast", "nonfinite_params", "weight_jump",
    "large_update",
    "skip_budget", "out_of_memory", "rank_mismatch", "lr_too_high", "sample_quarantined",
    "transient_fault",
    "attention_logit_growth", "attention_entropy_collapse", "norm_eps_dominated",
    "norm_affine_exploded",
    "adapter_base_modified", "adapter_delta_clamp", "resolution_change",
    "base_corrupt", "encoder_fallback",
]
# What the guard did about an incident (the row's ``action``; a healthy step writes no row).
IncidentAction = Literal["skip", "rollback", "abort", "warn", "attention_upcast",
                         "precision_fallback", "microbatch_backoff", "resync", "rescale_delta",
                         "drop_samples", "quarantine", "rerun", "restart_statistics",
                         "restore_base", "reencode"]
# A finding's: fatal: state or batch unusable; spike: this update is suspect; trend: a slow
# problem; warn: a health warning only; info: a deliberate change, recorded
# (resolution_change). An incident row's (records.row_severity): ``fatal`` only when the run
# stopped (abort); a fatal finding the guard recovered from is an ``error``.
FindingSeverity = Literal["fatal", "error", "spike", "trend", "warn", "info"]

USE_BF16 = "use bf16 instead of fp16 (train.precision=bf16): fp32's range, no scaler"


# --------------------------------------------------------------------------- row context


@dataclass
class IncidentCost:
    """A row's ``cost``: what the action cost the run."""

    steps_redone: int | None = None
    batches_skipped: int | None = None
    batch_position: int | None = None          # skip: the data-stream position dropped
    skipped_batches: list[int] | None = None   # rollback (old rows): [start, stop) skipped
    skipped_positions: list[int] | None = None  # rollback: the batch positions skipped
    restored_step: int | None = None
    modules_rescaled: int | None = None        # adapter_delta_clamp
    samples_dropped: int | None = None         # drop_samples: samples left out of the step
    extra: dict[str, Any] = field(default_factory=dict)  # keys this version does not know

    @classmethod
    def from_dict(cls, d: Any) -> IncidentCost:
        if not isinstance(d, dict):
            return cls(extra={} if d is None else {"value": d})
        known = {k: d[k] for k in ("steps_redone", "batches_skipped", "batch_position",
                                   "skipped_batches", "skipped_positions", "restored_step",
                                   "modules_rescaled", "samples_dropped")
                 if k in d}
        return cls(**known, extra={k: v for k, v in d.items() if k not in known})

    def summary(self) -> str:
        out = []
        if self.steps_redone:
            out.append(f"{self.steps_redone} step(s) redone")
        if self.batches_skipped:
            out.append(f"{self.batches_skipped} batch(es) skipped")
        if self.samples_dropped:
            out.append(f"{self.samples_dropped} sample(s) dropped, the rest trained")
        if self.restored_step is not None:
            out.append(f"restored step {self.restored_step}")
        if self.modules_rescaled:
            out.append(f"{self.modules_rescaled} module(s) rescaled")
        out += [f"{k}: {fmt(v)}" for k, v in self.extra.items()]
        return ", ".join(out) or "none"


@dataclass
class IncidentDiagnosis:
    """A row's ``diagnosis``: why the guard acted as it did, and what it changed."""

    why: str | None = None                  # abort / resync
    reason: str | None = None               # rollback
    lr_factor: float | None = None          # rollback: the LR backoff now applied
    lr_restored_at_step: int | None = None
    lr_cap: float | None = None             # lr_too_high: the LR is capped at this
    new_precision: str | None = None        # precision fallback
    new_micro_batch: int | None = None      # out-of-memory backoff
    note: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: Any) -> IncidentDiagnosis:
        if not isinstance(d, dict):
            return cls(extra={} if d is None else {"value": d})
        known = {k: d[k] for k in ("why", "reason", "lr_factor", "lr_restored_at_step",
                                   "lr_cap", "new_precision", "new_micro_batch", "note")
                 if k in d}
        return cls(**known, extra={k: v for k, v in d.items() if k not in known})

    def summary(self) -> str:
        out = [str(s) for s in (self.why, self.reason) if s]
        if self.lr_factor is not None:
            out.append(f"LR ×{fmt(self.lr_factor)}" + (f" until step {self.lr_restored_at_step}"
                                                       if self.lr_restored_at_step is not None
                                                       else ""))
        if self.lr_cap is not None:
            out.append(f"LR capped at {fmt(self.lr_cap)}")
        if self.new_precision:
            out.append(f"precision -> {self.new_precision}")
        if self.new_micro_batch is not None:
            out.append(f"micro-batch -> {self.new_micro_batch}")
        if self.note:
            out.append(str(self.note))
        out += [f"{k}: {fmt(v)}" for k, v in self.extra.items()]
        return "; ".join(out)


@dataclass(frozen=True)
class RunContext:
    """What a recommendation may depend on besides the evidence: the run's settings and the
    trend before the first incident of the group (doctor's ``trend_before_first``)."""

    lr: Any = None                  # optim.lr as configured (printed as written)
    warmup_steps: int | None = None
    precision: str | None = None    # train.precision
    qk_norm: bool = False
    loss_trend: float | None = None       # last third's mean / first third's, before it
    grad_norm_trend: float | None = None

    @classmethod
    def from_config(cls, config: dict[str, Any], trend: dict[str, Any] | None = None
                    ) -> RunContext:
        """From a resolved config as a plain dict (config.yaml), and an optional trend."""
        def get(section: str, key: str, default: Any = None) -> Any:
            s = config.get(section) if isinstance(config, dict) else None
            return s.get(key, default) if isinstance(s, dict) else default

        t = trend or {}
        warm = get("optim", "warmup_steps")
        return cls(lr=get("optim", "lr"), warmup_steps=int(warm) if finite(warm) else None,
                   precision=get("train", "precision"), qk_norm=bool(get("model", "qk_norm")),
                   loss_trend=num(t.get("loss_trend")),
                   grad_norm_trend=num(t.get("grad_norm_trend")))


# --------------------------------------------------------------------------- the base record


REGISTRY: dict[str, type[Finding]] = {}   # kind -> its typed record


@dataclass
class Finding:
    """Something the guard saw: ``kind``, ``severity`` and the ``evidence`` dict.

    Constructed directly it is the generic record; the typed records below subclass it and
    add a keyword constructor ``new(...)``. Read from a row (:func:`finding_from_row`) it
    also carries the row's ``step``, ``action``, ``cost`` and ``diagnosis``.

    Class attributes (what the kind means for a post-mortem):
        instability: the optimization went unstable (the peak LR and warmup are the lever).
        lr_usual_cause: an LR too high is the usual cause even without a rising trend.
        serious: worth attention even when recovered (instabilities, bad data, precision,
            memory).
        warn_once: a single occurrence is already a warning.
    """

    kind: str
    severity: str
    evidence: dict[str, Any] = field(default_factory=dict)
    step: int | None = field(default=None, kw_only=True)
    action: str | None = field(default=None, kw_only=True)
    cost: IncidentCost = field(default_factory=IncidentCost, kw_only=True)
    diagnosis: IncidentDiagnosis = field(default_factory=IncidentDiagnosis, kw_only=True)

    KIND: ClassVar[str] = ""       # "" for the generic record
    instability: ClassVar[bool] = False
    lr_usual_cause: ClassVar[bool] = False
    serious: ClassVar[bool] = False
    warn_once: ClassVar[bool] = False

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        if cls.KIND:
            REGISTRY[cls.KIND] = cls

    def __post_init__(self) -> None:
        if self.KIND and self.kind != self.KIND:
            raise ValueError(f"{type(self).__name__} records kind {self.KIND!r}, not "
                             f"{self.kind!r}")

    # ---- reading the evidence (values may be "nan"/"inf" strings in a row)
    def _n(self, key: str) -> float | None:
        """An evidence value as a float (None when absent)."""
        return num(self.evidence.get(key))

    def _f(self, key: str) -> str:
        """An evidence value in short human form ("?" when absent)."""
        v = self.evidence.get(key)
        return "?" if v is None else fmt(v)

    def _names(self, v: Any) -> list[str]:
        """A list of names from the evidence (a list, or one name), as strings."""
        return [str(x) for x in (v if isinstance(v, list) else [v] if v else [])]

    @property
    def provenance(self) -> dict[str, Any]:
        """The replay's findings (guard/provenance.py), {} when there was no replay."""
        p = self.evidence.get("provenance")
        return p if isinstance(p, dict) else {}

    @property
    def module(self) -> str | None:
        m = self.evidence.get("module")
        return str(m) if m else None

    @property
    def params(self) -> list[str]:
        return self._names(self.evidence.get("params"))

    @property
    def bad_module(self) -> str | None:
        """The first module the replay saw go non-finite (None without a replay)."""
        m = self.provenance.get("first_nonfinite_module")
        return str(m) if m else None

    @property
    def bad_grads(self) -> list[str]:
        """The first parameters whose gradients the replay saw go non-finite."""
        return self._names(self.provenance.get("nonfinite_grad_params"))

    def where(self) -> str | None:
        """The module the finding points at: the evidence's module, else the first module
        the replay saw go non-finite, else the module of the first parameter named."""
        params = self.params or self.bad_grads
        return self.module or self.bad_module or (module_of(params[0]) if params else None)

    # ---- one line
    def summary(self) -> str:
        """What was seen, in one line: this kind's values and thresholds, then the context
        the guard attached (first bad module, largest gradient, rank, probe findings)."""
        return "; ".join(p for p in self._facts() + self._context() if p) or "(no evidence)"

    def _facts(self) -> list[str]:
        """This kind's values (the generic record: the first few scalar fields, the note)."""
        e = self.evidence
        skip = {"note", "recommendation", "provenance", "health", "rank", "top_grad_layers",
                "weight_growth_since_snapshot"}
        parts = [f"{k}={fmt(v)}" for k, v in e.items()
                 if k not in skip and not isinstance(v, dict)][:4]
        return parts + ([str(e["note"])] if e.get("note") else [])

    def _context(self) -> list[str]:
        prov, e, out = self.provenance, self.evidence, []
        if self.bad_module:
            out.append(f"first non-finite module: {self.bad_module}")
        if prov.get("first_overflow_module"):
            out.append(f"first fp16 overflow: {prov['first_overflow_module']}")
        if self.bad_grads:
            out.append("non-finite grads: " + ", ".join(self.bad_grads[:3]))
        top = e.get("top_grad_layers")
        if isinstance(top, list) and top and isinstance(top[0], dict):
            out.append(f"largest grad: {top[0].get('param')} ({fmt(top[0].get('grad_norm'))})")
        if e.get("rank") is not None:
            out.append(f"first seen on rank {e['rank']}")
        if e.get("reproduced") is False:
            out.append("not reproduced when the step ran again from the same state and data")
        for row in e.get("elements") or []:
            changed = row.get("changed") if isinstance(row, dict) else None
            if isinstance(changed, list) and changed and isinstance(changed[0], dict):
                out.append(f"{row.get('param')}: " + ", ".join(
                    f"[{c.get('index')}] {fmt(c.get('was'))} -> {fmt(c.get('value'))}"
                    for c in changed[:3]))
        samples = e.get("samples")
        if isinstance(samples, list) and samples:
            out.append("samples: " + ", ".join(_sample_name(x) for x in samples[:3])
                       + (f" (+{len(samples) - 3})" if len(samples) > 3 else ""))
        health = e.get("health")
        if isinstance(health, list):
            seen = [f"{h.get('kind')} @ {h.get('module')}" for h in health
                    if isinstance(h, dict) and h.get("kind")]
            if seen:
                out.append("probes: " + ", ".join(seen[:2])
                           + (f" (+{len(seen) - 2})" if len(seen) > 2 else ""))
        return out

    # ---- what to do
    def recommendation(self, ctx: RunContext | None = None,
                       group: Sequence[Finding] = ()) -> str:
        """What to do, concretely (the doctor's advice for this kind).

        Args:
            ctx: the run's settings and the trend before the incident (default: unknown).
            group: every finding of this kind in the run, in order, ``self`` first (some
                advice names all their steps or modules); default ``[self]``.
        """
        ctx = ctx or RunContext()
        grp = list(group) or [self]
        if grp[0].action == "precision_fallback":
            return USE_BF16
        unrep = [f for f in grp if f.evidence.get("reproduced") is False]
        if unrep:  # seen once, gone on the re-run: the machine, the storage or the loader
            rest = [f for f in grp if f.evidence.get("reproduced") is not False]
            return "; ".join([_unreproduced_advice(unrep)]
                             + ([self._advice(ctx, rest)] if rest else []))
        return self._advice(ctx, grp)

    def _advice(self, ctx: RunContext, group: list[Finding]) -> str:
        """The default: what the replay named, then the LR lever for instabilities."""
        prov, recs = self.provenance, []
        if prov.get("first_overflow_module") and ctx.precision == "fp16":
            recs.append(f"the first module to overflow fp16 was {prov['first_overflow_module']}:"
                        " use bf16 instead of fp16")
        mod = self.bad_module
        if mod:
            recs.append(f"the first module to go non-finite was {mod}"
                        + ("; raise GroupNorm eps in " + mod if "norm" in mod.split(".")[-1] else
                           "; enable QK-norm" if ".attn" in mod and not ctx.qk_norm else ""))
        elif self.bad_grads:
            recs.append("the first non-finite gradient was in " + ", ".join(self.bad_grads[:2]))
        if self.instability:
            s0 = self.step or 0
            rising_grad = (ctx.grad_norm_trend or 1) > 2
            rising = rising_grad or (ctx.loss_trend or 1) > 2
            warm = ctx.warmup_steps or 0
            early = warm == 0 or s0 < 3 * warm
            if rising or early or self.lr_usual_cause:
                lr = "" if ctx.lr is None else f"={ctx.lr}"
                ws = "" if ctx.warmup_steps is None else f"={ctx.warmup_steps}"
                recs.append(f"lower the peak LR (optim.lr{lr}) or lengthen warmup "
                            f"(optim.warmup_steps{ws})"
                            + (": the gradient norm was already rising before it"
                               if rising_grad else ""))
            recs += self._instability_advice()
        if not recs:  # a kind that carries its own advice (a newer one), else the default
            recs.append(str(self.evidence.get("recommendation") or
                            "the guard recovered; if it recurs, lower the peak LR or lengthen "
                            "warmup"))
        return "; ".join(recs)

    def _instability_advice(self) -> list[str]:
        return []


def _unreproduced_advice(group: list[Finding]) -> str:
    """Advice for faults the deferred check saw and the re-run of the same step (same
    state, data, timesteps and noise) did not: per rank, and what recurs."""
    by_rank: dict[str, int] = {}
    for f in group:
        r = f.evidence.get("rank")
        by_rank[str(0 if r is None else r)] = by_rank.get(str(0 if r is None else r), 0) + 1
    n, kind = len(group), group[0].kind
    files = sorted({str(x.get("source") or x.get("index")) for f in group
                    for x in (f.evidence.get("samples") or []) if isinstance(x, dict)})
    where = (" (" + ", ".join(f"rank {r}: {k}" for r, k in sorted(by_rank.items())) + ")"
             if len(by_rank) > 1 or "0" not in by_rank else "")
    named = f"; the data it named: {', '.join(files[:5])}" if files else ""
    if n >= 2:
        return (f"{n} {kind} faults{where} seen once and gone when the step ran again from "
                "the same state and data: something between the storage and the step changes "
                "values: check the hardware (host/GPU memory errors, ECC), the storage (a "
                "flaky disk or network file system: re-read or checksum the files) and the "
                "data loader (worker races, a transform with hidden state)" + named)
    return ("a one-off: seen by the deferred check, gone when the step ran again from the "
            "same state and data (the step was taken); if it recurs, check the hardware, the "
            "storage and the data loader" + named)


def finding_from_row(row: dict[str, Any]) -> Finding:
    """The typed record of one incidents.jsonl row (or of a guard ``Incident.row()``).

    Never raises for odd input: an unknown kind gives the generic :class:`Finding`, a
    non-dict evidence/cost/diagnosis is kept under ``"value"``.
    """
    row = row if isinstance(row, dict) else {"evidence": row}
    kind = str(row.get("kind") or "")
    ev = row.get("evidence")
    ev = ev if isinstance(ev, dict) else ({} if ev is None else {"value": ev})
    step = num(row.get("step"))
    action = row.get("action")
    cls = REGISTRY.get(kind, Finding)
    return cls(kind, str(row.get("severity") or ""), ev,
               step=int(step) if step is not None and finite(step) else None,
               action=None if action is None else str(action),
               cost=IncidentCost.from_dict(row.get("cost")),
               diagnosis=IncidentDiagnosis.from_dict(row.get("diagnosis")))


# --------------------------------------------------------------------------- the step checks


class _NonfiniteStep(Finding):
    instability = serious = warn_once = True

    @classmethod
    def new(cls, *, loss: float, grad_norm: float) -> Finding:
        return cls(cls.KIND, "fatal", {"loss": loss, "grad_norm": grad_norm})

    def _facts(self) -> list[str]:
        return [f"loss {self._f('loss')}, grad norm {self._f('grad_norm')}"]


class NonfiniteLoss(_NonfiniteStep):
    """The step's loss is NaN/Inf (guard.step, before the update)."""

    KIND = "nonfinite_loss"


class NonfiniteGrad(_NonfiniteStep):
    """The loss is finite but the gradient norm is not (guard.step, before the update)."""

    KIND = "nonfinite_grad"


class LrSpike(Finding):
    """A learning rate far above the peak applied so far, seen before the update
    (``guard.lr_jump``): a schedule or scheduler-state bug."""

    KIND = "lr_spike"
    serious = True
    NOTE: ClassVar[str] = ("the learning rate jumped far above its peak so far: check the LR "
                           "schedule / scheduler state")

    @classmethod
    def new(cls, *, lr: float, max_lr_so_far: float, threshold: float) -> LrSpike:
        return cls(cls.KIND, "spike", {"lr": lr, "max_lr_so_far": max_lr_so_far,
                                       "ratio": lr / max_lr_so_far, "threshold": threshold,
                                       "note": cls.NOTE})

    def _facts(self) -> list[str]:
        return [f"lr {self._f('lr')} = ×{self._f('ratio')} the peak so far "
                f"({self._f('max_lr_so_far')}; threshold ×{self._f('threshold')})"]

    def _advice(self, ctx: RunContext, group: list[Finding]) -> str:
        return (f"the LR jumped to ×{self._f('ratio')} its peak so far: check the LR schedule "
                "and the scheduler state (a resumed or recreated scheduler, a restart, a "
                "per-group LR); lowering the peak LR does not fix this")


class LossSpike(Finding):
    """A timestep bucket's mean loss far above that bucket's own running statistics, in log
    space (detectors.BucketLossSpike)."""

    KIND = "loss_spike"
    instability = lr_usual_cause = serious = True

    @classmethod
    def new(cls, *, t_bucket: int, buckets: int, loss: float, bucket_mean: float,
            ratio: float, z: float, threshold: float, buckets_over: int) -> LossSpike:
        return cls(cls.KIND, "spike", {
            "t_bucket": t_bucket, "t_bucket_range": [t_bucket / buckets, (t_bucket + 1) / buckets],
            "loss": loss, "bucket_mean": bucket_mean, "ratio": ratio, "z": z,
            "threshold": threshold, "buckets_over": buckets_over})

    def _facts(self) -> list[str]:
        out = [f"loss {self._f('loss')} = ×{self._f('ratio')} its t-bucket "
               f"{self._f('t_bucket')} mean (z={self._f('z')})"]
        g = self.evidence.get("grad_norm")  # the gradient spike it caused, when both fired
        if isinstance(g, dict):
            out.append(f"grad norm {fmt(g.get('grad_norm'))} (z={fmt(g.get('z'))})")
        return out


class GradSpike(Finding):
    """The global gradient norm's z-score against its running EMA statistics above
    ``guard.grad_z`` (detectors.GradSpike; ZClip, Kumar et al. 2025)."""

    KIND = "grad_spike"
    instability = lr_usual_cause = serious = True

    @classmethod
    def new(cls, *, grad_norm: float, running_mean: float, running_std: float, z: float,
            threshold: float) -> GradSpike:
        return cls(cls.KIND, "spike", {"grad_norm": grad_norm, "running_mean": running_mean,
                                       "running_std": running_std, "z": z,
                                       "threshold": threshold})

    def _facts(self) -> list[str]:
        return [f"grad norm {self._f('grad_norm')} (z={self._f('z')}, threshold "
                f"{self._f('threshold')})"]


class Divergence(Finding):
    """The smoothed log-loss has risen ``guard.divergence_ratio`` above its best level
    (detectors.Divergence): the failure that looks fine step by step."""

    KIND = "divergence"
    instability = lr_usual_cause = serious = warn_once = True

    @classmethod
    def new(cls, *, smoothed_loss: float, best_smoothed_loss: float, threshold_ratio: float,
            window: int, **trend: Any) -> Divergence:
        """``trend``: ``trend_start_step`` (where it began), and from the short-window trend
        detector ``grad_norm_ratio`` / ``loss_ratio``."""
        return cls(cls.KIND, "trend", {
            "smoothed_loss": smoothed_loss, "best_smoothed_loss": best_smoothed_loss,
            "ratio": smoothed_loss / best_smoothed_loss, "threshold_ratio": threshold_ratio,
            "window": window, **trend})

    def _facts(self) -> list[str]:
        out = [f"smoothed loss {self._f('smoothed_loss')} = ×{self._f('ratio')} its best "
               f"{self._f('best_smoothed_loss')} (threshold ×{self._f('threshold_ratio')}, "
               f"window {self._f('window')} steps)"]
        if self.evidence.get("grad_norm_ratio") is not None:
            out.append(f"grad norm ×{self._f('grad_norm_ratio')} at a steady LR")
        if self.evidence.get("trend_start_step") is not None:
            out.append(f"began at step {self._f('trend_start_step')}")
        return out


class TransientFault(Finding):
    """A non-finite step that was finite when run once more with the same data, timesteps
    and noise: not the data, not the weights, but the machine (a flaky GPU, a bit flip in an
    activation) or a non-deterministic kernel. The re-run's update was taken (action
    ``rerun``)."""

    KIND = "transient_fault"
    serious = True

    @classmethod
    def new(cls, *, first: str, loss: Any, grad_norm: Any) -> TransientFault:
        return cls(cls.KIND, "spike", {"first": first, "loss": loss, "grad_norm": grad_norm})

    def _facts(self) -> list[str]:
        return [f"{self._f('first')} (loss {self._f('loss')}, grad norm "
                f"{self._f('grad_norm')}), finite when run again with the same data, "
                "timesteps and noise"]

    def _advice(self, ctx: RunContext, group: list[Finding]) -> str:
        by_rank: dict[str, int] = {}
        for g in group:
            r = g.evidence.get("rank")
            by_rank[str(0 if r is None else r)] = by_rank.get(str(0 if r is None else r), 0) + 1
        rank, n = max(by_rank.items(), key=lambda kv: kv[1])
        if n >= 3:
            where = f"rank {rank}'s device" if len(by_rank) > 1 or rank != "0" else "the device"
            return (f"{n} transient faults on {where}: suspect the hardware (GPU memory errors "
                    "/ ECC, clocks, heat) or a non-deterministic kernel; run a GPU memory test "
                    "or move the job off that node")
        return "a one-off: the step was taken on its re-run; nothing to change unless it recurs"


class LrTooHigh(Finding):
    """The gradient norm and the loss grew steadily over the trend window while the learning
    rate rose (detectors.Trend): the LR outgrew what the model can take. The guard rolls back
    to before the growth began and caps the LR (``guard.lr_cap_fraction``)."""

    KIND = "lr_too_high"
    instability = lr_usual_cause = serious = warn_once = True

    @classmethod
    def new(cls, *, lr_start: float, lr_end: float, trend_start_step: int,
            grad_norm_ratio: float, loss_ratio: float, window: int) -> LrTooHigh:
        return cls(cls.KIND, "trend", {
            "lr_start": lr_start, "lr_end": lr_end, "lr_ratio": lr_end / lr_start,
            "trend_start_step": trend_start_step, "grad_norm_ratio": grad_norm_ratio,
            "loss_ratio": loss_ratio, "window": window})

    def _facts(self) -> list[str]:
        return [f"grad norm ×{self._f('grad_norm_ratio')} and loss ×{self._f('loss_ratio')} "
                f"over {self._f('window')} steps while the LR rose {self._f('lr_start')} -> "
                f"{self._f('lr_end')} (from step {self._f('trend_start_step')})"]

    def _advice(self, ctx: RunContext, group: list[Finding]) -> str:
        cap = next((g.diagnosis.lr_cap for g in reversed(group)
                    if g.diagnosis.lr_cap is not None), None)
        safe = f" (the guard found {fmt(cap)} stable)" if cap is not None else ""
        return (f"the LR rose to {self._f('lr_end')} and training grew unstable from "
                f"{self._f('lr_start')} on: lower the peak LR (optim.lr) or check the LR "
                f"schedule / warm-up{safe}")


class BadBatch(Finding):
    """A batch holding NaN/Inf (fatal), or values far beyond the usual range (spike): a data
    problem, skipped and never escalated."""

    KIND = "bad_batch"
    serious = warn_once = True

    @classmethod
    def new(cls, *, max_abs_input: float, usual_max_abs_input: float | None = None) -> BadBatch:
        if usual_max_abs_input is None:  # NaN/Inf in the batch
            return cls(cls.KIND, "fatal", {
                "max_abs_input": max_abs_input, "note": "the batch itself holds NaN/Inf "
                "values: check the data (a corrupt image, a bad transform)"})
        return cls(cls.KIND, "spike", {
            "max_abs_input": max_abs_input, "usual_max_abs_input": usual_max_abs_input,
            "note": f"the batch has values up to {max_abs_input:.3g}, "
                    f"{max_abs_input / usual_max_abs_input:.3g}x the usual range: check the data"})

    def _facts(self) -> list[str]:
        out = f"max |x| of the batch = {self._f('max_abs_input')}"
        mx, usual = self._n("max_abs_input"), self._n("usual_max_abs_input")
        if mx is not None and usual:
            out += f" (×{fmt(mx / usual)} the usual {fmt(usual)})"
        return [out]

    def _advice(self, ctx: RunContext, group: list[Finding]) -> str:
        steps = ", ".join(str(g.step) for g in group[:5])
        pos = ", ".join(str(g.cost.batch_position) for g in group[:5])
        return (f"check the data: the batch at step {steps} had values outside [-1, 1] "
                f"(max |x| = {self._f('max_abs_input')}; data-stream batch position {pos}): "
                "look for a corrupt image, or a transform that yields NaN/Inf or values "
                "outside [-1, 1]")


class Fp16Overflow(Finding):
    """fp16: a forward pass that overflowed the fp16 range (spike, skipped; the replay names
    the module), or scaler skips piling up in a window (trend: the precision falls back)."""

    KIND = "fp16_overflow"
    serious = True

    @classmethod
    def forward(cls, *, loss: float, loss_scale: float, provenance: dict[str, Any] | None,
                attention_module: str | None = None) -> Fp16Overflow:
        """``attention_module``: the attention layer the overflowing module belongs to
        (provenance.attention_owner), whose attention the policy may upcast first."""
        return cls(cls.KIND, "spike", {
            "loss": loss, "loss_scale": loss_scale, "provenance": provenance,
            "note": "an activation exceeded the fp16 range in the forward pass",
            **({"attention_module": attention_module} if attention_module else {})})

    @classmethod
    def backward(cls, *, loss: float, loss_scale: float, provenance: dict[str, Any] | None,
                 attention_module: str | None = None) -> Fp16Overflow:
        """Gradients that kept overflowing the fp16 range while the loss stayed finite,
        located (``provenance['first_nonfinite_grad_module']``) in ``attention_module``."""
        return cls(cls.KIND, "spike", {
            "loss": loss, "loss_scale": loss_scale, "provenance": provenance, "in": "backward",
            "note": "the gradients kept overflowing the fp16 range in the backward pass "
                    "(the loss finite)",
            **({"attention_module": attention_module} if attention_module else {})})

    @classmethod
    def repeated(cls, *, overflows_in_window: int, window: int, limit: int,
                 loss_scale: float) -> Fp16Overflow:
        """(The guard then adds ``precision``, the precision that overflowed, and
        ``provenance``.)"""
        return cls(cls.KIND, "trend", {"overflows_in_window": overflows_in_window,
                                       "window": window, "limit": limit,
                                       "loss_scale": loss_scale})

    def _facts(self) -> list[str]:
        if "overflows_in_window" in self.evidence:
            return [f"{self._f('overflows_in_window')} fp16 overflows within "
                    f"{self._f('window')} steps (limit {self._f('limit')}); loss scale "
                    f"{self._f('loss_scale')}"]
        if self.evidence.get("in") == "backward":
            began = self.provenance.get("first_nonfinite_grad")
            return [f"the gradients kept overflowing the fp16 range (loss {self._f('loss')}, "
                    f"loss scale {self._f('loss_scale')})"
                    + (f"; the first non-finite gradient: {began}" if began else "")]
        return [f"an activation exceeded the fp16 range in the forward pass (loss "
                f"{self._f('loss')}, loss scale {self._f('loss_scale')})"]

    def _advice(self, ctx: RunContext, group: list[Finding]) -> str:
        return USE_BF16


class AttentionUpcast(Finding):
    """fp16: a forward overflow that began in an attention layer; the step was skipped and
    that layer's q kᵀ and softmax run in fp32 from then on (action ``attention_upcast``, the
    first precision remedy; the global fallback comes only if it overflows again)."""

    KIND = "attention_upcast"
    serious = True
    NOTE: ClassVar[str] = ("the attention logits of this layer exceeded the fp16 range: its "
                           "q kᵀ and softmax now run in fp32, the rest of the model stays fp16")

    @classmethod
    def new(cls, *, module: str, loss: float, loss_scale: float,
            provenance: dict[str, Any] | None) -> AttentionUpcast:
        return cls(cls.KIND, "spike", {"module": module, "loss": loss,
                                       "loss_scale": loss_scale, "provenance": provenance,
                                       "note": cls.NOTE})

    def _facts(self) -> list[str]:
        return [f"fp16 overflow in the attention of {self.module}: its q kᵀ and softmax now "
                "run in fp32"]

    def _advice(self, ctx: RunContext, group: list[Finding]) -> str:
        mods = sorted({str(g.module) for g in group if g.module})
        return (f"set model.upcast_attention=true from the start (the guard upcast "
                f"{', '.join(mods[:3]) or 'an attention layer'} after an overflow; with a "
                "diffusers UNet: upcast_attention=True in its config)"
                + ("; QK-norm (model.qk_norm=true) keeps the logits small in the first place"
                   if not ctx.qk_norm else ""))


class NonfiniteParams(Finding):
    """Parameters non-finite right after the update, before the EMA sees them: rolled back."""

    KIND = "nonfinite_params"
    instability = serious = warn_once = True
    NOTE: ClassVar[str] = "parameters became non-finite during or right after the update"

    @classmethod
    def new(cls, *, params: list[str], count: int, **where: Any) -> NonfiniteParams:
        """``where``: ``when`` (``before_forward``: the weights changed between two steps;
        absent: right after the update) and ``elements`` (per parameter named: its element
        count and how many are bad)."""
        note = cls.NOTE if where.get("when") != "before_forward" else _BETWEEN
        return cls(cls.KIND, "fatal", {"params": params, "count": count, **where,
                                       "note": note})

    def _facts(self) -> list[str]:
        ps, count = self.params, self._n("count")
        return [f"non-finite params: {', '.join(ps[:3])}"
                + (f" ({int(count)} in all)" if count is not None and count > min(len(ps), 3)
                   else "")] + _where_facts(self.evidence)

    def _instability_advice(self) -> list[str]:
        return [f"look at {self.params[0]}: it went bad first"] if self.params else []


class WeightJump(Finding):
    """A parameter whose norm jumped ``guard.weight_jump``x in one update: corrupted or
    exploded weights, rolled back."""

    KIND = "weight_jump"
    instability = serious = True
    NOTE: ClassVar[str] = "a parameter's norm jumped in one step: corrupted or exploded weights"

    @classmethod
    def new(cls, *, params: list[str], norm_ratio: list[float], threshold: float,
            **where: Any) -> WeightJump:
        """``where``: as for :meth:`NonfiniteParams.new`."""
        note = cls.NOTE if where.get("when") != "before_forward" else _BETWEEN
        return cls(cls.KIND, "fatal", {"params": params, "norm_ratio": norm_ratio,
                                       "threshold": threshold, **where, "note": note})

    def _facts(self) -> list[str]:
        ratios = self.evidence.get("norm_ratio")
        ratios = ratios if isinstance(ratios, list) else [ratios]
        pairs = list(zip(self.params[:3], ratios))
        limit = self._n("threshold")  # the guard lists the top 3; name the ones past the limit
        over = [(p, r) for p, r in pairs if limit is None or (num(r) or 0) > limit]
        jumps = [f"{p} ×{fmt(r)}" for p, r in over or pairs[:1]]
        return [f"param norm jump in one step: {', '.join(jumps)} (threshold "
                f"×{self._f('threshold')})"] + _where_facts(self.evidence)

    def _instability_advice(self) -> list[str]:
        return [f"look at {self.params[0]}: it went bad first"] if self.params else []


class LargeUpdate(Finding):
    """An applied update far larger than its parameter's usual one: |update|/|weight| per
    unit LR ``guard.update_ratio``x its own running mean and the step's median over the
    parameters (checks.UpdateSize). The optimizer state is named when it explains it (Adam's
    second moment tiny: the step divides by its square root). The state after such an update
    is suspect: rolled back (the optimizer state with it)."""

    KIND = "large_update"
    serious = warn_once = True

    @classmethod
    def new(cls, *, params: list[str], ratio: list[float], usual: list[float],
            median: float, threshold: float, lr: float,
            optimizer_state: list[dict[str, Any]] | None = None) -> LargeUpdate:
        e: dict[str, Any] = {"params": params, "ratio": ratio, "usual": usual,
                             "median": median, "threshold": threshold, "lr": lr,
                             "note": "an update far larger than this parameter's usual one"}
        if optimizer_state:
            e["optimizer_state"] = optimizer_state
        return cls(cls.KIND, "fatal", e)

    def _facts(self) -> list[str]:
        ratios, usual = self.evidence.get("ratio") or [], self.evidence.get("usual") or []
        parts = [f"{p}: |update|/|weight| {fmt(r)} vs its usual {fmt(u)} (×{fmt(_div(r, u))})"
                 for p, r, u in list(zip(self.params, ratios, usual))[:3]]
        out = ["update far above its usual size: " + "; ".join(parts)
               + f" (step median {self._f('median')}, threshold ×{self._f('threshold')})"]
        for st in self.evidence.get("optimizer_state") or []:
            if isinstance(st, dict) and st.get("explains"):
                out.append(f"optimizer state of {st.get('param')}: {st.get('explains')}")
        return out

    def _advice(self, ctx: RunContext, group: list[Finding]) -> str:
        states = [st for f in group for st in (f.evidence.get("optimizer_state") or [])
                  if isinstance(st, dict) and st.get("explains")]
        if states:
            return (f"the optimizer state of {states[0].get('param')} was corrupt "
                    f"({states[0].get('explains')}): the guard rolled back past it; if it "
                    "recurs, check the hardware (memory errors) and anything that edits the "
                    "optimizer state (a resume from a mismatched checkpoint)")
        return (f"{self.params[0] if self.params else 'a parameter'} took an update far above "
                "its usual size: lower the peak LR (optim.lr) or raise AdamW's eps if it "
                "recurs; look for code that edits the weights or optimizer state")


def _div(a: Any, b: Any) -> float | None:
    x, y = num(a), num(b)
    return x / y if x is not None and y else None


class SkipBudget(Finding):
    """More than ``guard.max_skips`` skipped steps within ``guard.budget_window``: abort."""

    KIND = "skip_budget"
    instability = serious = True

    @classmethod
    def new(cls, *, skips: int, max_skips: int, window: int) -> SkipBudget:
        return cls(cls.KIND, "fatal", {"skips": skips, "max_skips": max_skips,
                                       "window": window})

    def _facts(self) -> list[str]:
        return [f"{self._f('skips')} skipped steps within {self._f('window')} (at most "
                f"{self._f('max_skips')})"]


class OutOfMemory(Finding):
    """Out of memory in the forward/backward: the micro-batch halves (or the run aborts)."""

    KIND = "out_of_memory"
    serious = True

    @classmethod
    def new(cls, *, micro_batch: int, error: BaseException | str) -> OutOfMemory:
        return cls(cls.KIND, "fatal", {"micro_batch": micro_batch,
                                       "error": str(error).splitlines()[0][:200]})

    def _facts(self) -> list[str]:
        new = self.diagnosis.new_micro_batch
        return [f"out of memory at micro-batch {self._f('micro_batch')}"
                + (f" -> {new}" if new is not None else "")]

    def _advice(self, ctx: RunContext, group: list[Finding]) -> str:
        return "lower train.batch_size or raise train.grad_accum (the global batch stays)"


class RankMismatch(Finding):
    """torchrun: the replicas' weights differ bitwise across ranks; every rank takes the
    majority's state (action ``resync``)."""

    KIND = "rank_mismatch"
    serious = True
    NOTE: ClassVar[str] = (
        "the replicas' weights differ bitwise across ranks: a rank applied a different update "
        "(memory corruption, a non-deterministic or local operation outside DDP)")

    @classmethod
    def new(cls, *, ranks_differing: list[int], source_rank: int, world_size: int,
            fingerprints: list[list[int]]) -> RankMismatch:
        return cls(cls.KIND, "fatal", {"ranks_differing": ranks_differing,
                                       "source_rank": source_rank, "world_size": world_size,
                                       "fingerprints": fingerprints, "note": cls.NOTE})

    def _facts(self) -> list[str]:
        return [f"rank(s) {self._f('ranks_differing')} differ bitwise from rank "
                f"{self._f('source_rank')} (world size {self._f('world_size')})"]

    def _advice(self, ctx: RunContext, group: list[Finding]) -> str:
        return ("the ranks were resynchronized; if it recurs, look for an operation outside "
                "DDP that differs by rank (a rank-local edit, a non-deterministic kernel) or "
                "for faulty memory on the odd rank's GPU")


_BETWEEN = ("the weights changed between two steps, outside the update (memory corruption, "
            "an in-place edit, a bad all-gather): no batch is to blame")


def _where_facts(e: dict[str, Any]) -> list[str]:
    out = []
    if e.get("when") == "before_forward":
        out.append("found before the forward pass (changed between steps)")
    els = e.get("elements")
    if isinstance(els, list) and els and isinstance(els[0], dict):
        x = els[0]
        bad = [f"{fmt(x[k])} non-finite" if k == "nonfinite" else
               f"{fmt(x[k])} huge (max |w| {fmt(x.get('max_abs'))})"
               for k in ("nonfinite", "huge") if x.get(k)]
        if bad:
            out.append(f"{x.get('param')}: {' and '.join(bad)} of {fmt(x.get('numel'))} "
                       "elements")
    return out


def _sample_name(x: Any) -> str:
    """One implicated sample, as the evidence lists it: its file, else its index."""
    if not isinstance(x, dict):
        return str(x)
    name = x.get("source") or f"index {x.get('index')}"
    return f"{name} ({x.get('why')})" if x.get("why") else str(name)


class SampleQuarantined(Finding):
    """A sample implicated in ``guard.quarantine_after`` data incidents: never drawn again
    this run (the set is saved in the checkpoint)."""

    KIND = "sample_quarantined"
    serious = warn_once = True

    @classmethod
    def new(cls, *, index: int, times: int, steps: list[int], source: str | None = None,
            why: str | None = None) -> SampleQuarantined:
        return cls(cls.KIND, "warn", {"index": index, "source": source, "times": times,
                                      "steps": steps, "why": why})

    def _facts(self) -> list[str]:
        name = self.evidence.get("source") or f"dataset index {self._f('index')}"
        return [f"{name} implicated {self._f('times')} times (steps {self._f('steps')}"
                + (f"; {self.evidence['why']}" if self.evidence.get("why") else "")
                + "): never drawn again"]

    def _advice(self, ctx: RunContext, group: list[Finding]) -> str:
        names = [str(g.evidence.get("source") or f"index {g.evidence.get('index')}")
                 for g in group]
        return (f"fix or remove the quarantined sample(s): {', '.join(names[:5])}"
                + (f" (+{len(names) - 5} more)" if len(names) > 5 else "")
                + "; they hold NaN/Inf or far out-of-range values, or make the loss explode")


# --------------------------------------------------------------------------- the probes


class _Probe(Finding):
    """A periodic attention/normalization probe warning (guard/probes.py, action ``warn``)."""

    RECOMMENDATION: ClassVar[str] = ""   # written into the evidence, as the probes do

    def _facts(self) -> list[str]:
        return [f"{self.module}: " + self._values()]

    def _values(self) -> str:
        return ""


class AttentionLogitGrowth(_Probe):
    """Max attention logit above ``guard.attn_logit_limit`` (or non-finite): logit growth
    precedes entropy collapse (Dehghani et al. 2023; the cure is QK-norm)."""

    KIND = "attention_logit_growth"
    RECOMMENDATION = "enable model.qk_norm (QK-norm bounds the logits), or lower the peak LR"

    @classmethod
    def new(cls, *, module: str, max_logit: float, limit: float) -> AttentionLogitGrowth:
        return cls(cls.KIND, "warn", {"module": module, "max_logit": max_logit, "limit": limit,
                                      "recommendation": cls.RECOMMENDATION})

    def _values(self) -> str:
        return f"max attention logit {self._f('max_logit')} (limit {self._f('limit')})"

    def _advice(self, ctx: RunContext, group: list[Finding]) -> str:
        return ("lower the peak LR or lengthen warmup" if ctx.qk_norm else
                "enable QK-norm (model.qk_norm=true)")


class AttentionEntropyCollapse(_Probe):
    """Mean attention entropy below ``guard.attn_entropy_min`` nats: each query attends to a
    single key."""

    KIND = "attention_entropy_collapse"
    RECOMMENDATION = "enable model.qk_norm; attention collapsed onto single keys"

    @classmethod
    def new(cls, *, module: str, entropy: float, min: float) -> AttentionEntropyCollapse:
        return cls(cls.KIND, "warn", {"module": module, "entropy": entropy, "min": min,
                                      "recommendation": cls.RECOMMENDATION})

    def _values(self) -> str:
        return f"attention entropy {self._f('entropy')} nats (min {self._f('min')})"

    def _advice(self, ctx: RunContext, group: list[Finding]) -> str:
        return "enable QK-norm (model.qk_norm=true); attention collapsed onto single keys"


class NormEpsDominated(_Probe):
    """A normalization layer's median input variance below ``guard.norm_var_ratio``·eps: it no
    longer normalizes (output std ≈ sqrt(var / (var + eps)))."""

    KIND = "norm_eps_dominated"

    @classmethod
    def new(cls, *, module: str, median_input_var: float, eps: float,
            var_ratio: float) -> NormEpsDominated:
        return cls(cls.KIND, "warn", {
            "module": module, "median_input_var": median_input_var, "eps": eps,
            "recommendation": f"the input variance is below {var_ratio}x eps: the layer no "
                              "longer normalizes; raise its eps or check the preceding layer"})

    def _values(self) -> str:
        return f"median input variance {self._f('median_input_var')} against eps {self._f('eps')}"

    def _advice(self, ctx: RunContext, group: list[Finding]) -> str:
        mods = sorted({str(g.module) for g in group})
        return (f"raise GroupNorm eps in {', '.join(mods[:3])} (model.*.norm_eps), or check "
                "the layer before it: its output is nearly constant")


class NormAffineExploded(_Probe):
    """A normalization layer's scale/shift above ``guard.norm_affine_limit``."""

    KIND = "norm_affine_exploded"
    RECOMMENDATION = ("normalization scale/shift parameters exploded; lower the LR or exclude "
                      "them from weight-decay-free groups")

    @classmethod
    def new(cls, *, module: str, affine_max: float, limit: float) -> NormAffineExploded:
        return cls(cls.KIND, "warn", {"module": module, "affine_max": affine_max,
                                      "limit": limit, "recommendation": cls.RECOMMENDATION})

    def _values(self) -> str:
        return f"scale/shift up to |{self._f('affine_max')}| (limit {self._f('limit')})"

    def _advice(self, ctx: RunContext, group: list[Finding]) -> str:
        return "lower the peak LR; normalization gains/shifts exploded"


# --------------------------------------------------------------------------- adapters


class AdapterBaseModified(Finding):
    """Adapter runs: the frozen base weights changed during training (re-hashed at every
    checkpoint): abort, so no checkpoint pairs the adapter with the wrong base."""

    KIND = "adapter_base_modified"
    serious = True
    NOTE: ClassVar[str] = (
        "the frozen base weights changed during training: something wrote into them (an "
        "optimizer over all parameters, an in-place edit); the adapter no longer matches its "
        "recorded base")

    @classmethod
    def new(cls, *, expected_sha256: str, found_sha256: str) -> AdapterBaseModified:
        return cls(cls.KIND, "fatal", {"expected_sha256": expected_sha256,
                                       "found_sha256": found_sha256, "note": cls.NOTE})

    def _facts(self) -> list[str]:
        exp = str(self.evidence.get("expected_sha256") or "?")[:12]
        got = str(self.evidence.get("found_sha256") or "?")[:12]
        return [f"the frozen base weights changed: sha256 {exp} -> {got}"]

    def _advice(self, ctx: RunContext, group: list[Finding]) -> str:
        return ("something writes into the frozen base: give the optimizer only the adapter's "
                "parameters and look for in-place edits of base weights; resume from the last "
                "checkpoint (its base sha256 still matches)")


class AdapterDeltaClamp(Finding):
    """Adapter runs: an adapter delta past ‖ΔW‖/‖W‖ = ``adapter.max_delta_ratio``, rescaled
    to it (action ``rescale_delta``)."""

    KIND = "adapter_delta_clamp"
    RECOMMENDATION: ClassVar[str] = (
        "the adapter's delta outgrew the frozen weight: lower optim.lr or adapter.alpha, or "
        "raise adapter.max_delta_ratio if the change is intended")

    @classmethod
    def new(cls, *, module: str, ratio: float, max_delta_ratio: float, modules: list[str],
            ratios: list[float]) -> AdapterDeltaClamp:
        return cls(cls.KIND, "warn", {"module": module, "ratio": ratio,
                                      "max_delta_ratio": max_delta_ratio, "modules": modules,
                                      "ratios": ratios, "recommendation": cls.RECOMMENDATION})

    def _facts(self) -> list[str]:
        mods = self.evidence.get("modules")
        n = len(mods) if isinstance(mods, list) else 1
        return [f"|dW|/|W| of {self.module} = {self._f('ratio')} > adapter.max_delta_ratio="
                f"{self._f('max_delta_ratio')}; {n} module(s) rescaled"]

    def _advice(self, ctx: RunContext, group: list[Finding]) -> str:
        return self.RECOMMENDATION


class BaseCorrupt(Finding):
    """A frozen (base) weight of a LoRA/adapter/ControlNet run turned non-finite during
    training (integrations/sd/frozen.py ``FrozenWatch``): corruption of the base model,
    not an LR problem. Restored from the files on disk (action ``restore_base``), or the
    run stops naming the file to download again (``abort``)."""

    KIND = "base_corrupt"
    serious = True

    @classmethod
    def new(cls, *, parameter: str, parameters: list[str], count: int, part: str,
            values: str, file: str, repaired: bool, why: str | None = None) -> BaseCorrupt:
        return cls(cls.KIND, "fatal", {"parameter": parameter, "parameters": parameters,
                                       "count": count, "part": part, "values": values,
                                       "file": file, "repaired": repaired,
                                       **({"why": why} if why else {})})

    def _facts(self) -> list[str]:
        n = self._n("count") or 1
        fix = ("restored from " + str(self.evidence.get("file"))
               if self.evidence.get("repaired") else
               f"not repaired: {self.evidence.get('why')}")
        return [f"frozen base weight {self.evidence.get('parameter')} non-finite "
                f"({self.evidence.get('values')}; {int(n)} tensor(s)); {fix}"]

    def _advice(self, ctx: RunContext, group: list[Finding]) -> str:
        f = self.evidence.get("file")
        if self.evidence.get("repaired"):
            return (f"a frozen base weight was corrupted in memory and restored from {f}: not "
                    "the LR or the data. If it recurs, test the device's memory (a hardware "
                    "fault) or look for code that writes into the base's weights")
        return (f"the base model's file is damaged: download or copy {f} again, then rerun "
                "the same command (not the LR, not the data; no LR change needed)")


class EncoderFallback(Finding):
    """A frozen encoder's output was non-finite in its run dtype and was computed again in
    fp32 from the weights on disk (integrations/sd: the VAE's latents, the text encoders'
    embeddings); action ``reencode``. Items still non-finite in fp32 are quarantined."""

    KIND = "encoder_fallback"

    @classmethod
    def new(cls, *, part: str, dtype: str, count: int, total: int, key: str,
            sources: list[str], why: str, quarantined: int = 0,
            tokens: list[str] | None = None) -> EncoderFallback:
        return cls(cls.KIND, "warn", {"part": part, "dtype": dtype, "count": count,
                                      "total": total, "key": key, "sources": sources[:20],
                                      "why": why, "quarantined": quarantined,
                                      **({"tokens": tokens} if tokens else {})})

    def _facts(self) -> list[str]:
        return [f"{self.evidence.get('part')}: {int(self._n('count') or 0)} of "
                f"{int(self._n('total') or 0)} item(s) non-finite in "
                f"{self.evidence.get('dtype')}, re-encoded in fp32 ({self.evidence.get('why')})"
                + (f"; {int(self._n('quarantined') or 0)} still non-finite, left out"
                   if self._n("quarantined") else "")
                + (f"; token(s) to blame: {', '.join(self.evidence['tokens'][:5])}"
                   if self.evidence.get("tokens") else "")]

    def _advice(self, ctx: RunContext, group: list[Finding]) -> str:
        key = self.evidence.get("key")
        return (f"set {key}=fp32 to encode in fp32 from the start (no fallback); the "
                f"{self.evidence.get('part')}'s {self.evidence.get('dtype')} outputs overflow"
                + ("; the token(s) named have broken embedding rows in the base's text "
                   "encoder: download it again" if self.evidence.get("tokens") else ""))


# --------------------------------------------------------------------------- deliberate changes


class ResolutionChange(Finding):
    """The run went on at a larger ``data.image_size`` (``--grow-resolution``): weights, EMA
    and optimizer state carried over; the guard's statistics restarted their warm-up and the
    snapshot ring restarted from the grown state (action ``restart_statistics``).
    Informational: nothing went wrong (docs/resolution.md)."""

    KIND = "resolution_change"

    @classmethod
    def new(cls, *, old_size: int, new_size: int, step: int, restarted: list[str],
            **context: Any) -> ResolutionChange:
        return cls(cls.KIND, "info", {"old_size": old_size, "new_size": new_size,
                                      "step": step, "restarted": list(restarted), **context})

    def _facts(self) -> list[str]:
        shift = self.evidence.get("resolution_shift_base")
        restarted = self._names(self.evidence.get("restarted"))
        return [f"image size {self._f('old_size')} -> {self._f('new_size')} at step "
                f"{self._f('step')}"
                + (f"; log-SNR shifted for base {fmt(shift)}" if shift else "")
                + (f"; restarted: {', '.join(restarted)}" if restarted else "")]

    def _advice(self, ctx: RunContext, group: list[Finding]) -> str:
        return ("nothing to fix: a deliberate resolution change; the guard's detectors warm up "
                "again over guard.warmup_steps, so compare losses only within one resolution "
                "(docs/resolution.md)")
