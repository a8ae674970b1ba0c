"""`wattgate report`: a run folder (plus its triage and gate outputs), or bare traces -> summary.json, index.html."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable

from wattgate.artifacts import write_bytes_atomic, write_json_atomic
from wattgate.power.triage.arrays import small_pages
from wattgate.report.figures import MAX_PANELS, render_all
from wattgate.report.html import render_page
from wattgate.report.inputs import load_inputs
from wattgate.report.ledger_wait import record_run_wait
from wattgate.report.plotly_page import start_packing_plotly_js
from wattgate.report.summary import Analysis, analyze
from wattgate.run_files import check_output, claim_output
from wattgate.records.run_config import RunConfig
from wattgate.records.summary import Summary

STAGE = "report"

PathLike = str | os.PathLike


def summarize(run_dir: PathLike | None, *sources, **options) -> Analysis:
    """Read every input and compute the numbers (no figures, nothing written); the arguments are load_inputs'
    (report/inputs.py), as run_report passes them."""
    return analyze(load_inputs(run_dir, *sources, **options))


def run_report(
    run_dir: PathLike | None,
    out_dir: PathLike,
    power_dir: PathLike | None = None,
    gate_dir: PathLike | None = None,
    config_path: PathLike | None = None,
    trace_paths: Iterable[PathLike] | None = None,
    gpu_model: str | None = None,
    table_path: PathLike | None = None,
    power_cap_w: float | None = None,
    *,
    config: RunConfig | None = None,
) -> Summary:
    """Write out_dir/summary.json and out_dir/index.html; return the summary (the record summary.json holds).

    `trace_paths` (trace files or folders of them) replace run_dir/telemetry; with run_dir None they are
    the whole input (power-only mode: no metrics, heartbeats, TRAINED or watcher; a gate or config only
    when given, phases from power_dir when given, else triage runs in process on power alone).
    `gpu_model` picks the triage table for in-process triage when the traces name no device (Zeus);
    `table_path` (a triage table YAML) is used instead of any shipped table (a GPU with none);
    `power_cap_w` derives one from the power cap for a GPU no table ships for (an imported log).
    `config` is the run config already loaded (`wattgate report --config`); without it `config_path`
    is loaded, else results/config/<run>.yaml beside the run when there is one."""
    check_output(out_dir, STAGE)  # before any work: a folder the report did not write is refused
    start_packing_plotly_js()  # on a worker thread, while the analysis runs
    with small_pages():  # power/triage/arrays.py: page faults on big arrays cost less
        analysis = summarize(
            run_dir, power_dir, gate_dir, config_path, trace_paths, gpu_model, table_path, power_cap_w, config=config
        )
        figures = render_all(analysis, analysis.steps, analysis.inputs.evals)
        page = render_page(analysis.summary, figures, min(MAX_PANELS, analysis.summary.gpus))
    out_dir = claim_output(out_dir, STAGE)
    summary = analysis.summary
    write_json_atomic(out_dir / "summary.json", summary.to_json())
    write_bytes_atomic(out_dir / "index.html", page.encode("utf-8"))
    # the run's ledger record learns what waiting for stragglers cost it: a later run's gate says so
    recorded = record_run_wait(analysis.inputs, summary)
    if isinstance(recorded, str):
        print(f"report: warning: {recorded}", file=sys.stderr, flush=True)
    return summary
