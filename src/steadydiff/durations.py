"""Durations as a config holds them (``train.max_time``): read from the forms people write,
printed one short way.

Accepted (:func:`parse_duration`), all meaning seconds in the end:

- a number of seconds: ``5400``, ``90.5``, or the string ``"5400"``;
- amounts with units, in any order, spaces optional: ``"90s"``, ``"45m"``, ``"2h"``,
  ``"1.5h"``, ``"1d 2h"``, ``"1h30m"`` (units ``s``/``sec``/``second(s)``, ``m``/``min``/
  ``minute(s)``, ``h``/``hr``/``hour(s)``, ``d``/``day(s)``; each at most once);
- clock forms: ``"DD:HH:MM:SS"`` (PyTorch Lightning's ``max_time`` string), ``"HH:MM:SS"``,
  and SLURM's ``"D-HH:MM:SS"`` (``sbatch --time``), minutes and seconds below 60;
- a mapping ``{days, hours, minutes, seconds}`` (Lightning's dict form), e.g. ``{hours: 2}``.

Two-field ``"MM:SS"`` is refused on purpose: ``"1:30"`` reads as 90 minutes to some and
90 seconds to others (SLURM means the latter).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

UNITS = {"s": 1, "sec": 1, "secs": 1, "second": 1, "seconds": 1,
         "m": 60, "min": 60, "mins": 60, "minute": 60, "minutes": 60,
         "h": 3600, "hr": 3600, "hrs": 3600, "hour": 3600, "hours": 3600,
         "d": 86400, "day": 86400, "days": 86400}
FIELDS = {"days": 86400, "hours": 3600, "minutes": 60, "seconds": 1}

FORMS = ("seconds as a number (5400), amounts with units s, m, h, d ('90s', '45m', '2h', "
         "'1d 2h', '1h30m'), 'DD:HH:MM:SS' ('00:02:00:00'), 'HH:MM:SS' or 'D-HH:MM:SS', a "
         "mapping {days, hours, minutes, seconds}, or null (no time budget)")

_AMOUNT = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]+)\s*")
_CLOCK = re.compile(r"(?:(\d+)[-:])?(\d+):(\d+):(\d+(?:\.\d*)?)")


def parse_duration(value: Any) -> float:
    """``value`` in one of the accepted forms (module docstring) as seconds, > 0.

    Raises:
        ValueError: not a duration, or not positive; the message lists the valid forms.
    """
    seconds = _seconds(value)
    if seconds is None:
        hint = ""
        if isinstance(value, str) and re.fullmatch(r"\s*\d+:\d+\s*", value):
            hint = (" (two fields are ambiguous: write '1h 30m' or '01:30:00' for an hour "
                    "and a half, '1m 30s' or '00:01:30' for ninety seconds)")
        raise ValueError(f"cannot read {value!r} as a duration{hint}; valid forms: {FORMS}")
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"must be a positive duration, got {value!r} ({seconds:g} s); "
                         f"valid forms: {FORMS}")
    return seconds


def _seconds(value: Any) -> float | None:
    if isinstance(value, bool):  # YAML's true is not a duration
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, Mapping):
        if not value or set(value) - set(FIELDS) or any(
                isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0
                for v in value.values()):
            return None
        return float(sum(FIELDS[k] * v for k, v in value.items()))
    if not isinstance(value, str):
        return None
    text = value.strip().lower()
    try:
        return float(text)
    except ValueError:
        pass
    if m := _CLOCK.fullmatch(text):
        d, h, mi, s = m.groups()
        if int(mi) >= 60 or float(s) >= 60:
            return None
        return int(d or 0) * 86400 + int(h) * 3600 + int(mi) * 60 + float(s)
    total, seen, pos = 0.0, set(), 0
    for m in _AMOUNT.finditer(text):
        unit = UNITS.get(m.group(2))
        if m.start() != pos or unit is None or unit in seen:
            return None
        seen.add(unit)
        total += float(m.group(1)) * unit
        pos = m.end()
    return total if seen and pos == len(text) else None


def format_duration(seconds: float) -> str:
    """``seconds`` the short way: ``"2h"``, ``"1d 2h"``, ``"1h 30m"``, ``"45.5s"``."""
    if seconds < 60:
        return f"{seconds:.3g}s"
    out, rest = [], round(seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        n, rest = divmod(rest, size)
        if n:
            out.append(f"{n}{unit}")
    return " ".join(out)
