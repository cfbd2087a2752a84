"""Doctor: the human-readable output of a :class:`Diagnosis` (``steadydiff doctor``)."""

from __future__ import annotations

from .causes import Diagnosis

MAX_SHOWN_WITH_INFO = 12   # above this many causes, info findings are hidden unless verbose


def format_diagnosis(d: Diagnosis, *, verbose: bool = False) -> str:
    """The human-readable report: verdict, then the causes, most likely first."""
    c = d.counts()
    head = {"critical": "CRITICAL", "warning": "WARNINGS", "healthy": "HEALTHY"}[d.status]
    lines = [f"steadydiff doctor: {d.path}"]
    where = []
    if d.checkpoint:
        where.append(f"checkpoint {d.checkpoint.name}")
    if d.step is not None:
        where.append(f"step {d.step}")
    if d.run_dir:
        where.append(f"run {d.run_dir}")
    if where:
        lines.append("  " + ", ".join(where))
    lines.append(f"verdict: {head} ({c['critical']} critical, {c['warning']} warning(s), "
                 f"{c['info']} info)")
    shown = [x for x in d.causes if verbose or x.severity != "info"
             or len(d.causes) <= MAX_SHOWN_WITH_INFO]
    for i, x in enumerate(shown, 1):
        lines.append("")
        lines.append(f"{i:>2}. [{x.severity}] {x.check}"
                     + (f" @ {x.where}" if x.where else ""))
        lines.append(f"    {x.summary}")
        rel = x.evidence.get("related") or []
        for r in rel[:3]:
            lines.append(f"    related: {r}")
        if x.evidence.get("explains"):
            lines.append(f"    (see above: {x.evidence['explains']})")
        lines.append(f"    -> {x.recommendation}")
    if len(shown) < len(d.causes):
        lines.append(f"\n({len(d.causes) - len(shown)} info finding(s) hidden; --verbose "
                     "or --json shows them)")
    if not d.causes:
        lines.append("\nno problems found.")
    if d.notes:
        lines.append("")
        lines += [f"note: {n}" for n in d.notes]
    return "\n".join(lines) + "\n"
