"""The duration formatter of gate.md's forecast and failure lines and the watcher's hang cost."""

from __future__ import annotations


def fmt_hours(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"
