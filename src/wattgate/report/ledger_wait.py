"""What a run's report adds to the run's throughput-ledger record: the time its ranks lost to waiting for
stragglers (summary.json `stragglers`), which a later run's gate states (gate/cost.py last_run_wait)."""

from __future__ import annotations

from pathlib import Path

from wattgate.errors import InputError
from wattgate.ledger import record_wait
from wattgate.records.ledger import LedgerLine
from wattgate.records.summary import Summary
from wattgate.report.inputs import RunInputs


def record_run_wait(inputs: RunInputs, summary: Summary) -> LedgerLine | str | None:
    """Write the stragglers' cost into the ledger record of this run (ledger.record_wait): GPU-hours from power
    triage, rank-hours from the watcher's CPU time. Returns the updated record, a warning line when the ledger
    could not take it, or None when there is nothing to record (bare traces, no config, stragglers not checked,
    no ledger or no record of the run in it)."""
    st = summary.stragglers
    ledger = inputs.config.forecast.ledger if inputs.config is not None else None
    if inputs.run_dir is None or not ledger or not st.checked or not Path(ledger).is_file():
        return None
    source = st.source or ("power triage" if inputs.lag else "watcher")
    hours = (st.wait_rank_hours if source.startswith("watcher") else st.wait_gpu_hours) or 0.0
    steps = inputs.trained.steps if inputs.trained is not None else None
    try:
        return record_wait(Path(ledger), inputs.run_name, hours, source, steps)
    except InputError as exc:
        return f"the time lost to waiting for stragglers is not in the ledger: {exc}"
