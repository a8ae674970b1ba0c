"""`wattgate report`: one run's folder (plus its triage and gate outputs) -> summary.json and index.html."""

from __future__ import annotations

import os
from pathlib import Path

from wattgate.artifacts import write_bytes_atomic, write_json_atomic
from wattgate.report.figures import MAX_PANELS, render_all
from wattgate.report.html import render_page
from wattgate.report.inputs import load_inputs
from wattgate.report.summary import Analysis, analyze, step_table


def summarize(run_dir: str | os.PathLike, power_dir: str | os.PathLike | None = None,
              gate_dir: str | os.PathLike | None = None, config_path: str | os.PathLike | None = None) -> Analysis:
    """Read every input and compute the numbers (no figures, nothing written)."""
    return analyze(load_inputs(run_dir, power_dir, gate_dir, config_path))


def run_report(run_dir: str | os.PathLike, out_dir: str | os.PathLike, power_dir: str | os.PathLike | None = None,
               gate_dir: str | os.PathLike | None = None, config_path: str | os.PathLike | None = None) -> dict:
    """Write out_dir/summary.json and out_dir/index.html; return the summary."""
    analysis = summarize(run_dir, power_dir, gate_dir, config_path)
    figures = render_all(analysis, step_table(analysis.inputs.metrics))
    page = render_page(analysis.summary, figures, min(MAX_PANELS, analysis.summary["gpus"]))
    out_dir = Path(out_dir)
    write_json_atomic(out_dir / "summary.json", analysis.summary)
    write_bytes_atomic(out_dir / "index.html", page.encode("utf-8"))
    return analysis.summary
