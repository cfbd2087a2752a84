"""The stability guard: detect, diagnose and recover from training failures.

``Guard`` (guard.py) is the public API, in rooms: state.py (its typed state), window.py (the
deferred check), checks.py (weights, updates, inputs), attribution.py (samples, quarantine),
actions.py (skip, rollback, upcast), evidence.py, records.py (decisions, incidents);
detectors.py holds the cheap per-step checks,
probes.py the periodic attention/normalization health probes, provenance.py the replay that
names the first module to go non-finite, snapshots.py the rollback ring, clipping.py the
clipping modes, faults.py the fault injection used by tests and the stability benchmark.
"""

from .guard import Decision, Guard, GuardAbort, Incident, Progress

__all__ = ["Decision", "Guard", "GuardAbort", "Incident", "Progress"]
