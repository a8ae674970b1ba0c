"""gate.json as far as its parts hold the shapes the gate writes (docs/architecture.md, gate.json).

A JSON object whose parts are damaged (hand-edited, another tool's, an older format) costs the parts that
are: each is left out with a note naming the file and what the report cannot show, the rest is drawn.
`forecast_view` is shared with compare, which refuses a damaged forecast instead (a table row is all
or nothing).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from wattgate.errors import InputError
from wattgate.records.base import Where
from wattgate.records.gate import FailureView, ForecastView, GateCheck, GateParts, PhaseEstimate


@dataclass(frozen=True)
class UsableGate:
    """The parts of gate.json the report draws, each as far as it holds its shape: `passed` None when the
    verdict is damaged, a damaged forecast or failure None, damaged checks and memory phases left out."""

    passed: bool | None
    enforce: bool | None
    checks: tuple[GateCheck, ...]
    forecast: ForecastView | None
    failure: FailureView | None
    memory_estimate_phases: dict[str, PhaseEstimate]


def forecast_view(fc) -> tuple[ForecastView | None, str | None]:
    """gate.json's `forecast` (an object or null) as compare and the report use it, or (None, what is wrong
    with it)."""
    if fc is None:
        return None, None
    try:
        view = ForecastView.from_json(fc, Where("forecast"))
    except InputError as exc:
        return None, str(exc)
    if view.throughput is None:
        return None, "forecast has no throughput.source"
    return view, None


def usable_gate(gate: dict, path: str | Path, note: Callable[[str], None]) -> UsableGate:
    """The parts of `gate` the report reads that hold their shape; damaged parts are dropped, each with a note
    (a verdict that is not true/false becomes None: not shown as passed or failed)."""
    parts = GateParts.from_json(gate, Where(str(path)))
    passed = parts.passed
    if not isinstance(passed, bool):
        note(f"{path}: 'passed' is {passed!r:.40}, not true or false: the gate's verdict is not shown")
        passed = None
    forecast, problem = forecast_view(parts.forecast)
    if problem:
        note(f"{path}: {problem}: the forecast against actual is not shown")
    failure = None
    if parts.failure is not None:
        try:
            failure = FailureView.from_json(parts.failure, Where(str(path)), "failure.")
        except InputError:
            note(f"{path}: 'failure' is not an object with a line: the gate's failure cost is not shown")
    return UsableGate(
        passed=passed,
        enforce=parts.enforce if isinstance(parts.enforce, bool) else None,
        checks=_checks(parts.checks, path, note),
        forecast=forecast,
        failure=failure,
        memory_estimate_phases=_memory_phases(parts.memory_estimate_phases, path, note),
    )


def _parsed(record, value, path):
    try:
        return record.from_json(value, Where(str(path)))
    except InputError:
        return None


def _checks(checks, path, note) -> tuple[GateCheck, ...]:
    if checks is None:
        return ()
    if not isinstance(checks, list):
        note(f"{path}: 'checks' is {checks!r:.40}, not a list of checks: the gate's checks are not shown")
        return ()
    good = tuple(c for c in (_parsed(GateCheck, c, path) for c in checks) if c is not None)
    if len(good) < len(checks):
        note(
            f"{path}: {len(checks) - len(good)} of {len(checks)} check(s) without a name, a true/false passed and "
            "a detail: those are not shown"
        )
    return good


def _memory_phases(phases, path, note) -> dict[str, PhaseEstimate]:
    if phases is None:
        return {}
    if not isinstance(phases, dict):
        note(f"{path}: 'memory_estimate_phases' is not an object: the gate's memory estimates are not shown")
        return {}
    parsed = {k: _parsed(PhaseEstimate, v, path) for k, v in phases.items()}
    good = {k: v for k, v in parsed.items() if v is not None}
    if len(good) < len(phases):
        bad = sorted(set(phases) - set(good))
        note(f"{path}: memory_estimate_phases {', '.join(map(str, bad))}: damaged, those estimates are not shown")
    return good
