"""Power triage: label every GPU's time, window by window, with the training phase its power shows.

phases.py: the phases.parquet contract; runinfo.py: what the run recorded;
windows.py: samples into windows; levels.py: each GPU's band edges; rules.py:
the rules; smoothing.py: their per-GPU rolling median and majority filter;
run_rules.py: rule 6, the run's record over power; arrays.py: shared array
helpers; power_only.py: the low-power pauses in words when no heartbeats came;
labelling.py: triage(), the computation; stage.py: the `wattgate triage` stage,
its inputs read and outputs written by files.py, triage.md rendered by
markdown.py. The table, window and hang-limit settings live below every stage,
in wattgate/triage_tables.py.

The public names below load their module on first use, so that importing the
package does not load pandas and the algorithm.
"""

from __future__ import annotations

import importlib

_HOMES = {
    "LABELS": "phases",
    "PHASES_SCHEMA": "phases",
    "phase_summary": "phases",
    "read_phases": "phases",
    "RunInfo": "runinfo",
    "load_run_info": "runinfo",
    "map_ranks": "runinfo",
    "run_triage": "stage",
    "triage": "labelling",
}


def __getattr__(name: str):
    if name in _HOMES:
        return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOMES))
