"""Which samples a data finding is down to, and what happens to them: attribution (the
samples that explain a bad batch, a non-finite loss or a loss spike), naming (their files,
through the caller's ``sample_source``) and quarantine (an index implicated
``guard.quarantine_after`` times is never drawn again). The counts live in
:class:`~steadydiff.guard.state.GuardState` (``implicated``, ``quarantine``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .. import distributed, hostsync
from ..config import GuardConfig
from ..values import num
from . import findings
from .detectors import Finding
from .state import GuardState

# findings that can be the data's fault: the guard looks for the samples responsible
DATA_KINDS = frozenset({"bad_batch", "nonfinite_loss", "loss_spike"})


@dataclass
class Sample:
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


def input_amax(inputs: torch.Tensor, n: int) -> torch.Tensor:
    """(n,) max |x| of each sample of the batch (NaN/inf where a sample is not finite)."""
    return inputs.detach().reshape(n, -1).float().abs().amax(1)


def sample_rows(t: torch.Tensor | None, ps: torch.Tensor, amax: torch.Tensor | None
                ) -> torch.Tensor:
    """(B, 4) on the device, per sample: max |input| (inf where the input is not finite),
    loss, t (-1 unknown), input finite; ``amax``: :func:`input_amax` (None: no inputs).
    No host read."""
    ps = ps.detach().float().reshape(-1)
    if amax is not None and amax.numel() == ps.numel():
        fin = torch.isfinite(amax)
        amax = torch.where(fin, amax, torch.full_like(ps, math.inf))
    else:
        fin, amax = torch.ones_like(ps, dtype=torch.bool), torch.zeros_like(ps)
    tt = t.detach().float().reshape(-1) if t is not None else torch.full_like(ps, -1)
    return torch.stack([amax, ps, tt.to(ps.device), fin.float()], 1)


class Attribution:
    """Attribute data findings to samples, name them, quarantine repeat offenders.

    Args:
        cfg: the guard's config (``sample_drop_max``, ``quarantine_after``, ``t_buckets``,
            ``skip_window``).
        state: the guard's state (statistics, recent skips, implicated and quarantined).
        T: the diffusion T (to bucket a sample's t).
        sample_source: names a dataset index (its file), or None.
        record: records an incident (the quarantine's).
    """

    def __init__(self, cfg: GuardConfig, state: GuardState, T: int,
                 sample_source: Callable[[int], str | None] | None,
                 record: Callable[..., Any]):
        self.cfg, self.state, self.T = cfg, state, T
        self.sample_source = sample_source
        self._record = record

    def attribute(self, f: Finding, t: torch.Tensor | None, ps: torch.Tensor,
                  inputs: torch.Tensor | None, indices, num_micro: int, world: int,
                  step: int) -> list[dict[str, Any]] | None:
        """The samples that explain a data finding, or None when it is not down to a few of
        them (at most ``sample_drop_max`` of the batch). One extra transfer and, under DDP,
        one gather: on incidents only.

        - a batch with NaN/Inf: the samples holding them; far out of range: the samples
          beyond 10x the usual max |x|;
        - a non-finite loss: the samples whose loss (or input) is non-finite;
        - a loss spike: the fewest highest-loss samples without which the per-t-bucket
          detector would not have fired.
        """
        if not self.cfg.sample_drop_max:
            return None
        n = ps.numel()
        amax = input_amax(inputs, n) if inputs is not None and inputs.shape[0] == n else None
        return self.from_rows(f, hostsync.values(sample_rows(t, ps, amax)), indices,
                              num_micro, world, step)

    def from_rows(self, f: Finding, rows: list[list[float]], indices, num_micro: int,
                  world: int, step: int) -> list[dict[str, Any]] | None:
        """:meth:`attribute` from this rank's :func:`sample_rows`, read on the host (a
        deferred window keeps them on the device until its check fails)."""
        c = self.cfg
        if not c.sample_drop_max:
            return None
        n = len(rows)
        idx = (indices.tolist() if isinstance(indices, torch.Tensor) else
               list(indices) if indices is not None else [None] * n)
        per_rank = distributed.gather_objects((rows, idx))  # incidents only
        everyone = [Sample(r, p, None if ix[p] is None else int(ix[p]), a, lo, int(tv),
                           bool(fi))
                    for r, (rs, ix) in enumerate(per_rank)
                    for p, (a, lo, tv, fi) in enumerate(rs)]
        k_max = int(c.sample_drop_max * len(everyone))
        bad, why = self.responsible(f, everyone, k_max, step)
        if not bad or len(bad) > k_max:
            return None
        sizes = [len(rs) for rs, _ in per_rank]
        if any(sum(1 for s in bad if s.rank == r) >= n_r for r, n_r in enumerate(sizes)):
            return None  # a rank would keep no sample (and could not join the backward)
        chunk = -(-n // max(num_micro, 1))  # torch.chunk's micro-batch size
        return [s.row(s.position // chunk, self.source(s.index), why, world) for s in bad]

    def responsible(self, f: Finding, samples: list[Sample], k_max: int, now: int
                    ) -> tuple[list[Sample], str]:
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
        st, window = self.state, self.cfg.skip_window
        if any(e >= now - window for e in (*st.skips, *st.spike_drops)):
            return [], ""
        nb, stats = self.cfg.t_buckets, st.loss.stats

        def bucket(s: Sample) -> int:
            return min(max(s.t * nb // self.T, 0), nb - 1)

        def excess(s: Sample) -> float:
            b = stats[bucket(s)]
            return s.loss / math.exp(b.mean) if b.count and s.loss > 0 else 0.0

        ranked = sorted((s for s in samples if s.t >= 0), key=excess, reverse=True)
        for k in range(1, min(k_max, len(ranked)) + 1):
            sums, counts = [0.0] * nb, [0] * nb
            for s in ranked[k:]:
                sums[bucket(s)] += s.loss
                counts[bucket(s)] += 1
            means = [sm / ct if ct else None for sm, ct in zip(sums, counts)]
            if st.loss.check(means) is None:
                return ranked[:k], "loss far above its t-bucket's"
        return [], ""

    def source(self, index: int | None) -> str | None:
        """The file behind dataset ``index`` (None when unknown)."""
        if index is None or self.sample_source is None:
            return None
        try:
            src = self.sample_source(index)
        except Exception:  # naming a file must never take the recovery down
            return None
        return None if src is None else str(src)

    def implicate(self, samples: list[dict[str, Any]], step: int) -> tuple[int, ...]:
        """Count a data incident against each sample; quarantine those implicated
        ``quarantine_after`` times. Returns the newly quarantined indices."""
        c, st, new = self.cfg, self.state, []
        for x in samples:
            i = x.get("index")
            if i is None:
                continue
            steps = st.implicated.setdefault(int(i), [])
            steps.append(step)
            if c.quarantine_after and len(steps) >= c.quarantine_after \
                    and i not in st.quarantine:
                st.quarantine.add(int(i))
                st.counts["quarantined"] += 1
                new.append(int(i))
                self._record(findings.SampleQuarantined.new(
                    index=int(i), times=len(steps), steps=list(steps), source=x.get("source"),
                    why=x.get("why")), "quarantine")
        return tuple(new)
