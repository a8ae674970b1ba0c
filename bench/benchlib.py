"""What every benchmark in bench/ shares: its figure lines, its `--smoke` flag and one-line refusals.

A benchmark ends with one or more figure lines, each the figure its issue names, the baseline it is
measured against in the same run, and the load average while it ran:

    figure: <bench>: <what>: <figure>; baseline: <the baseline and its figure>; load average 1.02 0.88 0.61

`--smoke` runs the same code paths on tiny inputs in seconds and prints the same lines; tests/test_benchmarks.py
runs every bench's smoke size in the test suite. A smoke figure says nothing about the targets.

bench/ scripts import this as `benchlib` (a script's own folder is first on sys.path).
"""

from __future__ import annotations

import argparse
import os
import sys

FIGURE = "figure:"


def load_average() -> str:
    """The machine's 1, 5 and 15 minute load averages (os.getloadavg)."""
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} {five:.2f} {fifteen:.2f}"


def figure(bench: str, what: str, value: str, baseline: str) -> None:
    """Print one figure line: `what` measured as `value`, against `baseline` (its name and figure, from this run)."""
    print(f"{FIGURE} {bench}: {what}: {value}; baseline: {baseline}; {load_average()}", flush=True)


class Parser(argparse.ArgumentParser):
    """argparse with the benches' conventions: `--smoke`, and a bad argument refused in one line (exit 2)."""

    def __init__(self, *args, smoke: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        if smoke is not None:
            self.add_argument(
                "--smoke",
                action="store_true",
                help=f"tiny inputs, seconds ({smoke}): the same code paths and figure lines, not the target's size",
            )

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message}\n")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive finite number, not {text}")
    return value


def fail(bench: str, message: str, status: int = 2):
    """Stop with one line naming the bench."""
    print(f"{bench}: {message}", file=sys.stderr, flush=True)
    raise SystemExit(status)


def print_steady_figures(work: str, runs: dict[str, str], warm: int, baseline: str, with_mesh: bool = False) -> None:
    """One line per finished `wattgate train` run (label -> its run folder under `work`): steady tokens/s (every
    token once, over the steps' slowest rank) and the steady peak per rank, each against the first run's
    (`baseline` names it); bench/gpu_checks.sh's mesh and long-row steps. The dry run's CPU ranks have no CUDA peak:
    DRY_RUN=1 reads the host peak."""
    import json
    from pathlib import Path

    import pyarrow.parquet as pq

    peak_key = "host_peak_gib" if os.environ.get("DRY_RUN") == "1" else "cuda_peak_gib"
    figures = {}
    for label, folder in runs.items():
        run = Path(work) / folder
        try:
            trained = json.loads((run / "TRAINED").read_text())
        except OSError as exc:
            print(f"{label}: no result ({exc})")
            continue
        m = pq.read_table(run / "metrics.parquet").to_pandas()
        steady = m[m.step > warm]
        tps = steady.tokens.sum() / steady.groupby("step").step_time_s.max().sum()
        mesh = f"mesh {trained.get('mesh') or {'dp_shard': trained['world_size']}}, " if with_mesh else ""
        figures[label] = (tps, trained["memory"]["max_over_ranks"]["steady"][peak_key], mesh)
    base = figures.get(next(iter(runs)))
    for label, (tps, peak, mesh) in figures.items():
        vs = f"; vs {baseline}: tokens/s {tps / base[0]:.3f}x, peak {peak / base[1]:.3f}x" if base else ""
        print(f"{label}: {mesh}steady {tps:.0f} tok/s, steady peak {peak:.2f} GiB per rank ({peak_key}){vs}")
