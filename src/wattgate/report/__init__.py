"""Run reports: numbers (summary.json) and a self-contained page (index.html) from a run's artifacts."""

from wattgate.report.inputs import ReportSources
from wattgate.report.run import run_report, summarize

__all__ = ["ReportSources", "run_report", "summarize"]
