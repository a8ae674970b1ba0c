"""gate.json as far as its parts hold the shapes the gate writes (docs/architecture.md, gate.json).

A JSON object whose parts are damaged (hand-edited, another tool's, an older format) costs the parts that
are: each is left out with a note naming the file and what the report cannot show, the rest is drawn.
`forecast_problem` is shared with compare, which refuses a damaged forecast instead (a table row is all
or nothing).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

FORECAST_NUMBERS = ("wall_s",)  # what every reader of a forecast needs
FORECAST_OPTIONAL_NUMBERS = ("gpu_hours", "kwh")  # kwh is null without a triage table


def is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def forecast_problem(fc) -> str | None:
    """What is wrong with gate.json's `forecast` (a dict or null), or None when compare and the report can
    use it."""
    if fc is None:
        return None
    if not isinstance(fc, dict):
        return f"'forecast' is {type(fc).__name__}, not an object"
    bad = [k for k in FORECAST_NUMBERS if not is_number(fc.get(k))]
    bad += [k for k in FORECAST_OPTIONAL_NUMBERS if fc.get(k) is not None and not is_number(fc.get(k))]
    if bad:
        return f"forecast {', '.join(bad)}: missing or not a finite number"
    tp = fc.get("throughput")
    if not isinstance(tp, dict) or not isinstance(tp.get("source"), str):
        return "forecast has no throughput.source"
    terms = fc.get("terms_s", {})
    if not isinstance(terms, dict) or not all(is_number(v) for v in terms.values()):
        return "forecast terms_s is not an object of seconds"
    return None


def usable_gate(gate: dict, path: str | Path, note: Callable[[str], None]) -> dict:
    """A copy of `gate` whose every part the report reads holds its shape; damaged parts are dropped (a
    verdict that is not true/false becomes None: not shown as passed or failed)."""
    out = dict(gate)
    if not isinstance(out.get("passed"), bool):
        note(f"{path}: 'passed' is {out.get('passed')!r:.40}, not true or false: the gate's verdict is not shown")
        out["passed"] = None
    out["checks"] = _checks(out.get("checks"), path, note)
    problem = forecast_problem(out.get("forecast"))
    if problem:
        note(f"{path}: {problem}: the forecast against actual is not shown")
        out["forecast"] = None
    failure = out.get("failure")
    if failure is not None and not (isinstance(failure, dict) and isinstance(failure.get("line", ""), str)):
        note(f"{path}: 'failure' is not an object with a line: the gate's failure cost is not shown")
        out["failure"] = None
    out["memory_estimate_phases"] = _memory_phases(out.get("memory_estimate_phases"), path, note)
    return out


def _checks(checks, path, note) -> list[dict]:
    if checks is None:
        return []
    if not isinstance(checks, list):
        note(f"{path}: 'checks' is {checks!r:.40}, not a list of checks: the gate's checks are not shown")
        return []
    good = [c for c in checks if isinstance(c, dict) and isinstance(c.get("name"), str)]
    good = [c for c in good if isinstance(c.get("passed"), bool)]
    if len(good) < len(checks):
        note(
            f"{path}: {len(checks) - len(good)} of {len(checks)} check(s) without a name and a true/false passed: "
            "those are not shown"
        )
    return good


def _memory_phases(phases, path, note) -> dict:
    if phases is None:
        return {}
    if not isinstance(phases, dict):
        note(f"{path}: 'memory_estimate_phases' is not an object: the gate's memory estimates are not shown")
        return {}
    good = {k: v for k, v in phases.items() if _memory_phase_ok(v)}
    if len(good) < len(phases):
        bad = sorted(set(phases) - set(good))
        note(f"{path}: memory_estimate_phases {', '.join(map(str, bad))}: damaged, those estimates are not shown")
    return good


def _memory_phase_ok(phase) -> bool:
    if not isinstance(phase, dict):
        return False
    numbers = all(phase.get(k) is None or is_number(phase[k]) for k in ("total_bytes", "usable_bytes"))
    terms = phase.get("terms_bytes")
    return numbers and (terms is None or (isinstance(terms, dict) and all(is_number(v) for v in terms.values())))
