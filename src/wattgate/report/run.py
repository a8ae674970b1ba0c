"""`wattgate report`: a run folder (plus its triage and gate outputs), or bare traces -> summary.json, index.html."""

from __future__ import annotations

import os
import sys

from wattgate.artifacts import write_bytes_atomic, write_json_atomic
from wattgate.power.triage.arrays import small_pages
from wattgate.report.figures import MAX_PANELS, render_all
from wattgate.report.html import render_page
from wattgate.report.inputs import RUN_FOLDER_ONLY, ReportSources, load_inputs
from wattgate.report.ledger_wait import record_run_wait
from wattgate.report.plotly_page import start_packing_plotly_js
from wattgate.report.summary import Analysis, analyze
from wattgate.run_files import check_output, claim_output
from wattgate.records.summary import Summary

STAGE = "report"

PathLike = str | os.PathLike


def summarize(run_dir: PathLike | None, sources: ReportSources = RUN_FOLDER_ONLY) -> Analysis:
    """Read every input and compute the numbers (no figures, nothing written): load_inputs' (report/inputs.py)."""
    return analyze(load_inputs(run_dir, sources))


def run_report(run_dir: PathLike | None, out_dir: PathLike, sources: ReportSources = RUN_FOLDER_ONLY) -> Summary:
    """Write out_dir/summary.json and out_dir/index.html; return the summary (the record summary.json holds).

    `sources` (report/inputs.py ReportSources) add to or replace what the run folder holds; with run_dir None its
    trace files are the whole input (power-only mode: no metrics, heartbeats, TRAINED or watcher; a gate or config
    only when given, phases from its power folder when given, else triage runs in process on power alone)."""
    check_output(out_dir, STAGE)  # before any work: a folder the report did not write is refused
    start_packing_plotly_js()  # on a worker thread, while the analysis runs
    with small_pages():  # power/triage/arrays.py: page faults on big arrays cost less
        analysis = summarize(run_dir, sources)
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
