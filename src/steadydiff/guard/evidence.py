"""The evidence the guard gathers on an incident (and the periodic health probes): the
replay that names the first module and parameters to go non-finite (provenance), the layers
behind a spike, the attention/normalization probes. Everything here runs on incidents or
every ``guard.probe_every`` steps, never on a healthy step."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from .. import distributed, hostsync, sharding
from . import probes, provenance
from .detectors import Finding

if TYPE_CHECKING:
    from .guard import Guard


class Evidence:
    """Gathers evidence for the guard ``g`` (its model, ring, state, config, log)."""

    def __init__(self, g: "Guard"):
        self.g = g

    def gather(self, finding: Finding, rank: int | None, replay, num_micro, after_backward,
               probe_forward) -> None:
        """Attach the evidence a finding calls for: the rank where it appeared, the spike's
        layers, the provenance replay, the health probes on this batch."""
        c = self.g.cfg
        if rank is not None:
            finding.evidence["rank"] = rank  # where the bad value appeared
        if finding.severity == "spike":
            finding.evidence.update(self.spike())
        if c.provenance and finding.kind != "bad_batch":
            # replay the step with hooks: the first module that went non-finite or past the
            # fp16 range, and the first parameters whose gradients did
            finding.evidence["provenance"] = self.provenance(replay, num_micro,
                                                             after_backward)
        if probe_forward is not None and finding.kind != "bad_batch":
            # the expensive health probes run on every incident, not only every N steps
            finding.evidence["health"] = self.health(probe_forward)

    def provenance(self, replay, num_micro, after_backward) -> dict:
        """Replay this rank's micro-batches (locally: the replay must run the unwrapped
        model, no collectives) and, under DDP, merge every rank's trace: the first rank whose
        replay went bad names the module."""
        g = self.g
        nonfinite = provenance.nonfinite_grads(g.net)
        out: dict[str, Any] = {"nonfinite_grad_params": nonfinite[:5],
                               "nonfinite_grad_count": len(nonfinite)}
        if replay is not None:
            try:
                out.update(provenance.trace(g.net, replay, num_micro, after_backward,
                                            every=g.update.sharded))
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
        if g.update.sharded:  # each rank saw its own gradient shards: all of them
            bad = {n for o in ranks for n in o.get("nonfinite_grad_params", [])}
            merged["nonfinite_grad_params"] = [n for n in g.update.names if n in bad][:5]
            merged["nonfinite_grad_count"] = max(o.get("nonfinite_grad_count", 0)
                                                 for o in ranks)
        return merged

    def spike(self) -> dict[str, Any]:
        """Which layers dominate the gradient, and which weights moved most since the last
        snapshot (names the parameter behind a spike, e.g. a corrupted weight)."""
        g = self.g
        named = [(n, p) for n, p in g.net.named_parameters() if p.grad is not None]
        out: dict[str, Any] = {}
        if named:
            norms = hostsync.values(sharding.norms([p.grad for _, p in named]))
            top = sorted(zip(norms, (n for n, _ in named)), reverse=True)[:3]
            out["top_grad_layers"] = [{"param": n, "grad_norm": v} for v, n in top]
        snap = g.ring.newest()
        if snap is not None:
            pairs = [(n, p, snap.model[n]) for n, p in g.net.named_parameters()
                     if n in snap.model]
            # a snapshot holds this rank's shards (FSDP): their norms are reduced too
            now = hostsync.values(sharding.norms([p.detach() for _, p, _ in pairs])) \
                if pairs else []
            refs = hostsync.values(sharding.norms([r.float() for _, _, r in pairs],
                                                  reduce=g.update.sharded)) if pairs else []
            ratios = [(a / max(r, 1e-12), n) for a, r, (n, _, _) in zip(now, refs, pairs)]
            ratios.sort(reverse=True)
            out["weight_growth_since_snapshot"] = [{"param": n, "norm_ratio": r}
                                                   for r, n in ratios[:3]]
        return out

    def probe(self, forward: Callable[[], object]) -> None:
        """The periodic health probes: warn once per (kind, module) in a while."""
        g = self.g
        c, st = g.cfg, g.state
        stats = probes.probe(g.net, forward)
        st.last_probe_step = g.progress.step
        for f in probes.findings(stats, logit_limit=c.attn_logit_limit,
                                 entropy_min=c.attn_entropy_min, var_ratio=c.norm_var_ratio,
                                 affine_limit=c.norm_affine_limit):
            key = (f.kind, f.evidence.get("module", ""))
            last = st.warned.get(key)
            if last is not None and g.progress.step - last < 10 * max(c.probe_every, 1):
                continue  # said recently; do not flood the incident log
            st.warned[key] = g.progress.step
            st.counts["warnings"] += 1
            g.record(f, "warn")
        st.last_probe = stats

    def health(self, forward: Callable[[], object]) -> list[dict[str, Any]]:
        """Attention/normalization findings on this batch, attached to an incident."""
        c = self.g.cfg
        try:
            stats = probes.probe(self.g.net, forward)
        except Exception as e:  # a non-finite forward must not stop the recovery
            return [{"probe_error": f"{type(e).__name__}: {e}"}]
        return [{"kind": f.kind, **f.evidence} for f in probes.findings(
            stats, logit_limit=c.attn_logit_limit, entropy_min=c.attn_entropy_min,
            var_ratio=c.norm_var_ratio, affine_limit=c.norm_affine_limit)]
