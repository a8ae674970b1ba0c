"""Durations in words, in two styles that the artifacts already use: fmt_hours (gate.md's forecast and
failure lines, the watcher's hang cost: 90 s, 2.5 min, 1.2 h) and clock (triage's pauses and the report's
page: 42 s, 2:05 min, 1:02:03 h; `duration`, the page's cells, gives tenths of a second under two minutes).
Kept as they are so every written file stays as it was."""

from __future__ import annotations


def fmt_hours(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def clock(s: float) -> str:
    """Seconds as 42 s, 2:05 min or 1:02:03 h."""
    s = float(s)
    if s < 100:
        return f"{s:.0f} s"
    h, rem = divmod(round(s), 3600)
    m, sec = divmod(rem, 60)
    return f"{h}:{m:02d}:{sec:02d} h" if h else f"{m}:{sec:02d} min"


def duration(s) -> str:
    if s is None:
        return "n/a"
    return f"{float(s):.1f} s" if float(s) < 120 else clock(s)
