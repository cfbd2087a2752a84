"""What the guard checks each step, and the numbers it checks them on.

- :func:`rows` / :func:`seen`: a step's numbers on the device (loss, grad norm, input range,
  the weights' check, per-timestep-bucket loss sums; every rank's) and the host's view of
  them after the one read.
- :class:`Weights`: the trainable weights against the last verified ones — before the forward
  (a weight changed between steps) and after the update (before the EMA sees them) — and the
  finding that names the parameters, elements and values when they are not sound.
- :func:`check_inputs`: a batch with NaN/Inf or far outside its usual range.
- :func:`inspect`: the batch and the finiteness of loss and gradients (under fp16 a
  non-finite value is first the scaler's business).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from .. import distributed, hostsync, sharding
from . import findings, provenance
from .detectors import Finding, RunningStats

if TYPE_CHECKING:
    from .guard import Guard


@dataclass
class Seen:
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
    bad_rank: int | None = None      # the rank where this step's bad value appeared
    outlier_rank: int | None = None  # the rank with this step's largest input


def rows(loss: torch.Tensor, gnorm: torch.Tensor, t: torch.Tensor | None,
         per_sample_loss: torch.Tensor | None, inputs: torch.Tensor | None,
         before: torch.Tensor, t_buckets: int, T: int,
         amax: torch.Tensor | None = None) -> torch.Tensor:
    """The step's numbers on the device, every rank's: (world, D) rows of loss, grad norm,
    input range, samples, the weights' check before the forward (``before``: all finite,
    largest norm ratio), per-bucket loss sums and counts. Under DDP one collective (no host
    read): every rank decides from the same numbers, so a NaN on one rank makes all of them
    skip or roll back together. ``amax``: the inputs' per-sample max |x| when the caller
    has it (the same input range, from it)."""
    ps = per_sample_loss.detach().float() if per_sample_loss is not None else None
    n_local = float(ps.numel()) if ps is not None else 1.0
    dev = loss.device
    parts = [loss.detach().float().mean().reshape(1), gnorm.float().reshape(1).to(dev)]
    parts.append(amax.amax().reshape(1).to(dev) if amax is not None else
                 inputs.detach().float().abs().amax().reshape(1).to(dev)
                 if inputs is not None else torch.zeros(1, device=dev))
    parts.append(torch.full((1,), n_local, device=dev))
    parts.append(before.to(dev))
    nb = t_buckets
    if t is not None and ps is not None:
        b = (t.long() * nb // T).clamp_(0, nb - 1)
        # (index_add_ of ones, not bincount: bincount's output size is read on the host)
        parts += [torch.zeros(nb, device=ps.device).index_add_(0, b, ps),
                  torch.zeros(nb, device=ps.device).index_add_(0, b, torch.ones_like(ps))]
    return distributed.gather_rows(torch.cat(parts))


def seen(rows: torch.Tensor, n_local: int, judged_t: bool, t_buckets: int) -> Seen:
    """The host's view of one step from its rows (on the host)."""
    nb = t_buckets
    world = rows.shape[0]
    # the global mean loss (ranks may hold different shares of an uneven batch)
    loss_v = float((rows[:, 0] * rows[:, 3]).sum() / rows[:, 3].sum())
    col = rows[:, 2]
    in_max = float(col.max()) if bool(torch.isfinite(col).all()) else float("nan")
    buckets: list[float | None] = [None] * nb
    if rows.shape[1] > 6:
        sums, counts = rows[:, 6:6 + nb].sum(0).tolist(), rows[:, 6 + nb:].sum(0).tolist()
        buckets = [s / n if n else None for s, n in zip(sums, counts)]
    jumps = rows[:, 5]
    return Seen(loss_v, float(rows[:, 1].mean()), in_max, buckets, world, judged_t,
                n_local=n_local, n_global=int(rows[:, 3].sum()),
                weights_ok=bool((rows[:, 4] > 0).all()),
                weights_jump=float(jumps.max()) if bool(torch.isfinite(jumps).all())
                else math.inf,
                bad_rank=first_bad_rank(rows[:, :3]) if world > 1 else None,
                # a finite outlier batch: the rank holding the largest input
                outlier_rank=int(rows[:, 2].argmax()) if world > 1 else None)


def first_bad_rank(rows: torch.Tensor) -> int | None:
    """The rank where a non-finite value appeared, from the (loss, grad norm, input max)
    rows: inputs and losses are per rank, but DDP's all-reduce spreads one rank's non-finite
    gradient to every rank, so the grad norm only counts when nothing else is bad."""
    for col in (2, 0, 1):
        bad = (~torch.isfinite(rows[:, col])).nonzero()
        if len(bad):
            return int(bad[0])
    return None


def check_inputs(stats: RunningStats, in_max: float) -> Finding | None:
    """A batch with NaN/Inf, or with values far beyond the usual range (x10 the running max
    |x|), is a data problem, not a model one: skip it and say so. A batch in range updates
    ``stats``."""
    if not math.isfinite(in_max):
        return findings.BadBatch.new(max_abs_input=in_max)
    usual = math.exp(stats.mean) if stats.count else None
    if usual is not None and stats.count >= 10 and in_max > 10 * usual:
        return findings.BadBatch.new(max_abs_input=in_max, usual_max_abs_input=usual)
    stats.update(math.log(max(in_max, 1e-12)))
    return None


def inspect(g: "Guard", seen: Seen, has_inputs: bool, replay, num_micro,
            after_backward) -> Finding | None:
    """The batch and the finiteness of loss and gradients. Under fp16 a non-finite value is
    first the scaler's business: gradients that overflowed (finite loss), or a forward pass
    that overflowed the fp16 range (the replay names the module)."""
    finding = check_inputs(g.state.inputs, seen.input_max) if has_inputs else None
    if finding is not None or (math.isfinite(seen.loss) and math.isfinite(seen.grad_norm)):
        return finding
    if g.progress.scaler is not None:
        forward = not math.isfinite(seen.loss)
        prov = (g.evidence.provenance(replay, num_micro, after_backward)
                if forward and g.cfg.provenance else None) or {}
        # where it began: in fp16 the first inf is the first non-finite output; an
        # attention layer's softmax turns its inf logits into NaN before any output
        attn = provenance.attention_owner(g.net, prov.get("first_nonfinite_module")
                                          or prov.get("first_overflow_module"))
        if not forward or prov.get("first_overflow_module") or attn:
            return overflow_finding(g, seen, prov or None, forward, attn,
                                    locate=lambda: grad_origin(g, replay, num_micro,
                                                               after_backward))
    if not math.isfinite(seen.loss):
        return findings.NonfiniteLoss.new(loss=seen.loss, grad_norm=seen.grad_norm)
    return findings.NonfiniteGrad.new(loss=seen.loss, grad_norm=seen.grad_norm)


def overflow_finding(g: "Guard", seen: Seen, prov: dict | None, forward: bool,
                     attn: str | None = None, locate=None) -> Finding:
    """An fp16 overflow: ``routine`` (gradients, while the scale calibrates), ``spike`` (an
    activation in the forward pass) or ``trend`` (repeated within the window). ``attn``: the
    attention layer where the forward overflow began, if any.

    Gradients that keep overflowing while the loss stays finite (a forward kept in range by
    a fused attention kernel, its backward not) are located before any global fallback:
    ``locate()`` (:func:`grad_origin`) names the module where the non-finite gradient
    began; inside an attention layer not upcast yet, that layer is upcast (a ``spike`` as
    for a forward overflow, the fallback waits: it comes if the overflows go on); anywhere
    else the fallback names the layer."""
    scale = g.progress.scaler.get_scale()
    trend = g.state.overflow.record(g.progress.step, scale)
    if trend is not None and not forward and locate is not None:
        origin = locate()
        where = provenance.attention_owner(g.net, origin.get("first_nonfinite_grad_module"))
        if where and where not in g.state.upcast:
            g.state.overflow.clear()
            return findings.Fp16Overflow.backward(loss=seen.loss, loss_scale=scale,
                                                  provenance=origin, attention_module=where)
        prov = {**(prov or {}), **origin}
    if trend is not None:
        g.state.overflow.clear()
        trend.evidence["precision"] = g.progress.precision
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


def grad_origin(g: "Guard", replay, num_micro: int, after_backward) -> dict[str, Any]:
    """Where this step's non-finite gradient began (incidents only): the replay's gradient
    hooks list the parameters in the order backward reached them, and the first non-finite
    one is nearest the overflow (backward runs from the loss towards the input; without a
    replay, the last non-finite parameter in registration order, the forward's order).
    ``first_nonfinite_grad`` and its module ``first_nonfinite_grad_module``."""
    if replay is not None and g.cfg.provenance:
        out = g.evidence.provenance(replay, num_micro, after_backward)
        first = next(iter(out.get("nonfinite_grad_params") or []), None)
    else:
        bad = provenance.nonfinite_grads(g.net)
        out = {"nonfinite_grad_params": bad[::-1][:5], "nonfinite_grad_count": len(bad)}
        first = bad[-1] if bad else None
    if first:
        out["first_nonfinite_grad"] = first
        out["first_nonfinite_grad_module"] = first.rsplit(".", 1)[0]
    return out


MIN_UPDATE_NUMEL = 64  # (see Weights.counted)


class Weights:
    """The trainable weights against the last verified ones (their norms, kept on the
    device): ``prev`` is None when there is nothing to compare with (the first step, after a
    rollback)."""

    def __init__(self, net: torch.nn.Module, names: list[str], params: list[torch.Tensor],
                 sharded: bool):
        self.net, self.names, self.params, self.sharded = net, names, params, sharded
        # weights with RMS below 0.05 count as 0.05, so zero-initialised layers moving off
        # zero are not "jumps"
        self.floor = torch.tensor([0.05 * math.sqrt(p.numel()) for p in params],
                                  device=params[0].device if params else None)
        # the update-size check counts parameters of MIN_UPDATE_NUMEL values or more: Adam's
        # step on a handful of numbers (a one-channel output bias) swings 10x from one step
        # to the next as its gradient's sign settles or flips (the digits UNet's out.conv.bias
        # did, at step 110 of a healthy eps run), where a layer's thousands average out
        self.counted = torch.tensor([float(p.numel() >= MIN_UPDATE_NUMEL) for p in params],
                                    device=params[0].device if params else None)
        self.prev: torch.Tensor | None = None
        self.delta: list[torch.Tensor] | None = None  # the weights before this update
        self.delta_off = False  # no room for the copy, or the check is disabled

    def begin_update(self) -> bool:
        """Keep the weights before the update (one copy into a buffer kept between steps),
        for :meth:`update_ratios`. False when the copy does not fit on the device (more
        than half its free memory): the update-size check is then off."""
        if self.delta_off:
            return False
        live = [sharding.local(p.detach()) for p in self.params]
        if self.delta is None:
            from .window import fits  # (window imports this module)
            if not fits(live):
                print("warning: guard: no room on the device for the update-size check's "
                      "copy of the trainable weights: guard.update_ratio is off")
                self.delta_off = True
                return False
            self.delta = [torch.empty_like(t) for t in live]
        with torch.no_grad():
            torch._foreach_copy_(self.delta, live)
        return True

    @torch.no_grad()
    def update_ratios(self, norms: torch.Tensor) -> torch.Tensor:
        """(n,) |applied update| / |weight| per parameter, on the device (no read); ``norms``:
        the weights' norms after the update. Call after :meth:`begin_update` and the
        update."""
        torch._foreach_sub_(self.delta, [sharding.local(p.detach()) for p in self.params])
        moved = sharding.norms(self.delta, reduce=self.sharded)
        return moved / torch.maximum(norms, self.floor) * self.counted

    def forget(self) -> None:
        """Nothing verified to compare with (after a rollback, a resync, a restore)."""
        self.prev = None

    @torch.no_grad()
    def before(self) -> torch.Tensor:
        """(ok, jump) of the weights now against the last verified ones, on the device (no
        sync; the values travel in the step's one sync): a weight that changed between two
        steps (memory corruption, an in-place edit) is named before it is blamed on a
        batch. (1, 0) when there is nothing to compare with."""
        if self.prev is None:
            dev = self.params[0].device if self.params else None
            return torch.tensor([1.0, 0.0], device=dev)
        norms = sharding.norms(self.params)
        jump = (norms / torch.maximum(self.prev, self.floor)).max()
        return torch.stack([torch.isfinite(norms.sum()).float(), jump])

    @torch.no_grad()
    def check_before(self, seen: Seen, limit: float) -> Finding | None:
        """The finding for weights that were not sound before the forward (on the host)."""
        if seen.weights_ok and seen.weights_jump <= limit:
            return None
        return self.finding(sharding.norms(self.params), seen.world, limit,
                            when="before_forward")

    @torch.no_grad()
    def after(self, world: int) -> tuple[torch.Tensor, torch.Tensor]:
        """After the update, before the EMA sees the weights: one fused reduction over them,
        on the device: ``(check, norms)``, check = (all finite, largest norm jump), reduced
        over the ranks."""
        norms = sharding.norms(self.params)
        jump = (norms / torch.maximum(self.prev, self.floor)).max() \
            if self.prev is not None else torch.zeros((), device=norms.device)
        check = torch.stack([torch.isfinite(norms.sum()).float(), jump])
        if world > 1:
            check[0] = -check[0]  # MAX of -ok == -(MIN of ok)
            dist.all_reduce(check, op=dist.ReduceOp.MAX)
            check[0] = -check[0]
        return check, norms

    def check_after(self, world: int, limit: float, updates: bool = False
                    ) -> tuple[Finding | None, list[float] | None]:
        """The after-update check of the per-step path, read on the host (with ``updates``,
        the update ratios in the same read); sound weights become the verified ones."""
        check, norms = self.after(world)
        ratios = self.update_ratios(norms) if updates else None
        got = hostsync.values(check if ratios is None else torch.cat([check, ratios]))
        ok_v, jump_v = got[:2]  # host read
        if not ok_v or jump_v > limit:
            return self.finding(norms, world, limit), None
        self.prev = norms
        return None, (got[2:] if ratios is not None else None)

    def finding(self, norms: torch.Tensor, world: int, limit: float,
                ref_norms: torch.Tensor | None = None, **where: Any) -> Finding:
        """Name the parameters that went bad (incidents only): non-finite values
        (``nonfinite_params``), else the norms that jumped past ``limit`` or overflowed
        (``weight_jump``), with each one's element count and how many of its elements are
        bad. Under DDP every rank names its own and the first rank that has any is the one
        reported (one gather). ``ref_norms``: the verified norms to compare with (default:
        the last verified ones)."""
        prev = ref_norms if ref_norms is not None else self.prev
        ref = torch.maximum(prev, self.floor) if prev is not None else self.floor
        ratios = hostsync.values(norms / ref)
        nonfinite = provenance.nonfinite_params(self.net)
        jumped = sorted(((r if math.isfinite(r) else math.inf, n)
                         for r, n in zip(ratios, self.names)
                         if not math.isfinite(r) or r > limit), reverse=True)
        mine = {"nonfinite": nonfinite, "jumped": jumped[:3],
                "top": sorted(zip(ratios, self.names), reverse=True)[:3]}
        per_rank = distributed.gather_objects(mine)
        src = next((r for r, m in enumerate(per_rank) if m["nonfinite"]), None)
        if src is not None:
            bad = per_rank[src]["nonfinite"]
            if self.sharded:  # each rank saw its own shards: all of them, in order
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
                                        threshold=limit, **where)
        if world > 1:
            f.evidence["rank"] = src
        f.evidence["elements"] = self.elements(f.params[:3], ref)
        return f

    def elements(self, names: list[str], ref: torch.Tensor) -> list[dict[str, Any]]:
        """Per named parameter: its element count, how many elements are non-finite or huge
        (beyond 100x its verified RMS), the largest finite |value|."""
        named = dict(self.net.named_parameters())
        out = []
        for name in names:
            p = named.get(name)
            if p is None:
                continue
            w = sharding.local(p.detach()).float()  # FSDP: this rank's shard
            i = self.names.index(name) if name in self.names else None
            rms = (float(ref[i]) / math.sqrt(max(p.numel(), 1))) if i is not None else 0.05
            ok = torch.isfinite(w)
            finite_abs = torch.where(ok, w.abs(), torch.zeros_like(w))
            counts = (int((~ok).sum()), int((finite_abs > 100 * max(rms, 1e-12)).sum()),
                      float(finite_abs.max()) if w.numel() else 0.0)
            if self.sharded:  # every rank's shard of it (every rank is here)
                parts = distributed.gather_objects(counts)
                counts = (sum(c[0] for c in parts), sum(c[1] for c in parts),
                          max(c[2] for c in parts))
            out.append({"param": name, "numel": p.numel(), "nonfinite": counts[0],
                        "huge": counts[1], "max_abs": counts[2]})
        return out

    @torch.no_grad()
    def changed(self, f: Finding, copies: list[torch.Tensor], most: int = 5) -> None:
        """Localise a weight finding against ``copies`` (the weights at a deferred window's
        start, in :attr:`params` order; FSDP: this rank's shards): for each parameter the
        finding names, the elements that differ most from their copy — flat index, value
        now, value then — in ``evidence["elements"][i]["changed"]``. Read from the live
        state before a rewind overwrites it (incidents only)."""
        index = {n: i for i, n in enumerate(self.names)}
        for row in f.evidence.get("elements", []):
            i = index.get(row.get("param"))
            if i is None or i >= len(copies):
                continue
            now = sharding.local(self.params[i].detach()).float().reshape(-1)
            then = copies[i].float().reshape(-1)
            if now.numel() != then.numel() or not now.numel():
                continue
            diff = (now - then).abs()
            diff = torch.where(torch.isfinite(diff), diff, torch.full_like(diff, math.inf))
            k = min(most, diff.numel())
            at = diff.topk(k).indices
            top = hostsync.values(torch.stack([at.double(), now[at].double(),
                                               then[at].double()], 1))
            largest = abs(top[0][1] - top[0][2]) if top else 0.0
            # the elements that changed most, not an ordinary update's drift beside them
            row["changed"] = [{"index": int(ix), "value": v, "was": w}
                              for ix, v, w in top
                              if v != w and not abs(v - w) < 0.01 * largest]


class UpdateSize:
    """The size of each applied update against its parameter's own history (issue 27).

    Per parameter ``x = |update| / |weight| / lr`` (per unit LR, so warm-up and decay do
    not move it; |weight| floored at RMS 0.05) and a running mean of ``log x`` over the
    healthy steps (momentum 0.9: the last ten or so; a parameter that has not moved yet, a
    zero-initialised layer behind a zero output, is not counted until it does). After
    ``warmup`` steps, a parameter whose excess ``x / its usual x`` is above ``ratio`` *and*
    ``ratio`` times the step's median excess over the parameters took an update far larger
    than usual — alone (a step that moves every parameter more, as an LR change does, moves
    the median too): a corrupt optimizer state (Adam divides by the square root of a second
    moment gone tiny), an edit of the gradients. Host side: the ratios travel in the step's
    (or the window's) one read."""

    MOMENTUM = 0.9

    def __init__(self, ratio: float, momentum: float, warmup: int):
        self.ratio, self.warmup = ratio, warmup
        self.momentum = min(momentum, self.MOMENTUM)
        self.mean: list[float | None] | None = None
        self.count = 0

    def check(self, ratios: list[float] | None, lr: float
              ) -> list[tuple[int, float, float]] | None:
        """The parameters far above their usual update: (index, ratio, usual ratio) at
        this LR, largest excess first; None when none is (or the check cannot tell yet)."""
        if not ratios or not self.ratio or lr <= 0 or self.mean is None \
                or self.count < self.warmup or len(ratios) != len(self.mean):
            return None
        excess = [(j, r / lr / math.exp(m)) for j, (r, m) in enumerate(zip(ratios, self.mean))
                  if m is not None and math.isfinite(r) and r > 0]
        if not excess:
            return None
        med = sorted(e for _, e in excess)[len(excess) // 2]
        bad = [(j, ratios[j], math.exp(self.mean[j]) * lr) for j, e in excess
               if e > self.ratio and e > self.ratio * med]
        bad.sort(key=lambda b: b[1] / max(b[2], 1e-30), reverse=True)
        return bad or None

    @staticmethod
    def median(ratios: list[float]) -> float:
        return sorted(ratios)[len(ratios) // 2] if ratios else 0.0

    def observe(self, ratios: list[float] | None, lr: float) -> None:
        """A healthy step's ratios join the statistics."""
        if not ratios or lr <= 0 or not all(math.isfinite(r) for r in ratios):
            return
        if self.mean is None or len(self.mean) != len(ratios):
            self.mean, self.count = [None] * len(ratios), 0
        a = self.momentum
        self.mean = [m if r <= 0 else math.log(r / lr) if m is None
                     else a * m + (1 - a) * math.log(r / lr)
                     for m, r in zip(self.mean, ratios)]
        self.count += 1

    def state(self) -> dict[str, Any]:
        return {"mean": self.mean, "count": self.count}

    def load(self, s: dict[str, Any] | None) -> None:
        if s:
            self.mean, self.count = s.get("mean"), int(s.get("count", 0))


def optimizer_state(optimizer: torch.optim.Optimizer, named: dict[str, torch.Tensor],
                    names: list[str]) -> list[dict[str, Any]]:
    """For each parameter named, what its optimizer state says about a large update (one
    read per parameter; incidents only): Adam's second moment ``exp_avg_sq`` — its smallest
    element against its median; ``explains`` when that element is below 1e-2x the median
    (the update there is divided by its square root)."""
    out = []
    for name in names:
        p = named.get(name)
        st = optimizer.state.get(p, {}) if p is not None else {}
        v = st.get("exp_avg_sq") if isinstance(st, dict) else None
        if not isinstance(v, torch.Tensor) or not v.numel():
            continue
        flat = sharding.local(v.detach()).float().reshape(-1)
        i = int(flat.argmin())
        lo, med = hostsync.values(torch.stack([flat[i], flat.median()]))
        row: dict[str, Any] = {"param": name, "state": "exp_avg_sq", "min": lo,
                               "min_index": i, "median": med}
        if med > 0 and lo < 1e-2 * med:
            row["explains"] = (f"exp_avg_sq[{i}] = {lo:.3g}, far below its median {med:.3g}: "
                               "Adam divides the update by its square root")
        out.append(row)
    return out
