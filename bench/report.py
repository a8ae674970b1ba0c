"""Report speed: triage + report on 16 GPUs x 24 h x 10 Hz against a straightforward pandas pipeline.

Data. The 16-GPU day of bench/triage_accuracy.py (2 hosts x 8 B300s, long
compute with communication, data starvation and a checkpoint every ~55 min,
a hang in the last 10 minutes; wattgate.testing.synthetic_trace draws the samples),
its compute in synchronized steps with one straggler (node1:3 thermally
throttled, 30% slower, from 20% to 35% of the run, its clocks-event reasons
recorded: issue 34), written as the samplers would: one Parquet trace per
host, one time per tick with every GPU's row in index order (the sampler
stamps a tick's reads of all GPUs with one time), the SM clock, temperature
and reasons held between the sampler's 1 Hz reads, and the NVML energy
counter on every 100th sample of a GPU (the sampler reads it every 10 s). Beside it the run's files:
metrics for ~43k steps x 16 ranks (a step every 2 s, 60% data wait while
starved), heartbeats with checkpoint events, TRAINED, watcher.json (the
hang's verdict) and gate.json.

The issue's ratio (issue 14: at least 8x; issue 34, with the straggler analysis on both sides: at least
10x), each side best of --repeat runs,
each run in a fresh Python process (the first touch of 10^7-row arrays costs
page faults that a warm process does not pay again), imports not timed:
- wattgate: run_triage (read both traces a row group at a time, per-GPU
  energy, windows, every triage rule with the run's heartbeats and metrics,
  pauses, the stragglers and their causes, write phases.parquet, triage.json and the rest) then run_report (read
  phases.parquet, triage.json and the run's metrics and heartbeats; summary.json
  and index.html with every figure as Plotly JSON, plotly.js embedded compressed);
- pandas: bench/pandas_triage.py pandas_triage_and_summary on the same trace
  files (read, windowing, labelling with the package's rules written with
  groupby/rolling, per (GPU, phase) time and energy, per-GPU trapezoid energy, the stragglers with pivot,
  idxmax, rank and value_counts and their causes; its docstring lists what it leaves out), no figures and
  nothing written.
Ratio = best pandas / best (triage + report); the phase time shares of both
are printed with their largest difference.

Also, clearly separate from the ratio and run once: the summary numbers alone
(wattgate.report.summarize on the triaged run against bench/report.py's
pandas_summary: energy per GPU from counter and edges, phase time and energy
shares), as a check that both give the same numbers, with their times.

`--smoke`: a quarter of an hour, one run per side.

    python bench/report.py [--hours 24] [--repeat 2] [--keep DIR] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from benchlib import Parser, figure, positive_float, positive_int
from triage_accuracy import day_schedule  # bench/, on sys.path as the script's folder

from wattgate.artifacts import write_json_atomic
from wattgate.testing.synthetic_trace import Straggler, TraceSpec, build_trace, gpus_of, job, write_run_info
from wattgate.triage_tables import TriageSettings, shipped_table
from wattgate.power.triage import LABELS, run_triage
from wattgate.report import run_report, summarize
from wattgate.trace import schema_with_meta, trace_files

TARGET_S = 10.0  # triage + report, 16 GPUs x 24 h x 10 Hz, 2-core bench VM
TARGET_RATIO = 10.0  # issue 34: triage + report (stragglers included) at least 10x faster than the pandas baseline
COUNTER_EVERY = 100  # samples between energy counter reads (10 s at 10 Hz)
STRAGGLER = ("node1", 3)
STEP_S = 2.0
SMOKE_HOURS = 0.25

# ---------------------------------------------------------------- the run on disk


def with_energy_counter(table: pa.Table, rng: np.random.Generator) -> pa.Table:
    """Fill energy_j on every COUNTER_EVERY-th sample of each GPU with the integral of its power
    (rows arrive GPU-major from the builder; the counter starts at an arbitrary offset)."""
    gpu = table.column("gpu").to_numpy()
    t = table.column("time").to_numpy()
    p = table.column("power_w").to_numpy().astype(np.float64)
    energy = np.full(len(t), np.nan)
    bounds = np.flatnonzero(np.diff(gpu)) + 1
    for a, b in zip(np.r_[0, bounds], np.r_[bounds, len(t)]):
        pieces = np.diff(t[a:b]) * (p[a + 1 : b] + p[a : b - 1]) * 0.5
        cum = np.concatenate([[0.0], np.cumsum(pieces)]) + rng.uniform(1e8, 1e9)
        energy[a:b][::COUNTER_EVERY] = cum[::COUNTER_EVERY]
    col = pa.array(energy, pa.float64(), mask=np.isnan(energy))
    return table.set_column(table.schema.get_field_index("energy_j"), "energy_j", col)


def sampler_ticks(table: pa.Table) -> tuple[pa.Table, int]:
    """One host's rows GPU-major, each GPU's i-th sample stamped with the i-th tick's time (the earliest of its
    GPUs' jittered times: the sampler reads every GPU in a tick and stamps them with one time), and the GPUs."""
    gpu, t = table.column("gpu").to_numpy(), table.column("time").to_numpy()
    table = table.take(np.lexsort((t, gpu)))
    k = len(np.unique(gpu))
    n = table.num_rows // k
    assert n * k == table.num_rows, "every GPU needs the same number of samples"
    ticks = table.column("time").to_numpy().reshape(k, n).min(axis=0)
    return table.set_column(table.schema.get_field_index("time"), "time", pa.array(np.tile(ticks, k))), k


def time_major(table: pa.Table, k: int) -> pa.Table:
    """Sampler order: every GPU's reading of one tick, in index order, before the next tick."""
    return table.take(np.arange(table.num_rows).reshape(k, -1).T.ravel())


def write_traces(synth, folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(7)
    paths = []
    for host in sorted({h for h, _ in synth.gpus}):
        t, k = sampler_ticks(synth.table.filter(pc.equal(synth.table.column("host"), host)))
        t = time_major(with_energy_counter(t, rng), k).cast(schema_with_meta(synth.meta(host)))
        paths.append(folder / f"{host}.parquet")
        pq.write_table(t, paths[-1], row_group_size=1 << 20)
    return paths


def shape_metrics(run: Path) -> int:
    """A falling loss and noisy step times instead of write_run_info's constants."""
    m = pq.read_table(run / "metrics.parquet")
    step = m.column("step").to_numpy().astype(np.float64)
    rng = np.random.default_rng(3)
    loss = 2.0 + 8.0 * np.exp(-step / 4000.0) + rng.normal(0, 0.05, len(step))
    step_time = STEP_S * rng.uniform(0.97, 1.03, len(step))
    for name, values in (("loss", loss), ("step_time_s", step_time)):
        m = m.set_column(m.schema.get_field_index(name), name, pa.array(values, pa.float64()))
    pq.write_table(m, run / "metrics.parquet")
    return int(step.max())


def write_run(tmp: Path, hours: float) -> tuple[Path, list[Path], int]:
    table = shipped_table("b300")
    straggler = Straggler(STRAGGLER, 0.3, "thermal", ((0.2 * hours * 3600, 0.35 * hours * 3600),), True)
    synth = build_trace(
        job(gpus_of(2, 8), day_schedule(hours)), table, spec=TraceSpec(with_truth=False, straggler=straggler)
    )
    run = tmp / "results" / "train" / "bench"
    paths = write_traces(synth, run / "telemetry")
    write_run_info(run, synth, step_s=STEP_S)
    steps = shape_metrics(run)
    hang = synth.segments[synth.segments["phase"] == "deadlock"]
    t_hang, t_end = float(hang["start"].min()), float(hang["end"].max())
    write_json_atomic(
        run / "TRAINED",
        {
            "device": "cuda",
            "world_size": 16,
            "steps": steps,
            "wall_s": t_hang - float(synth.segments["start"].min()),
            "tokens_per_s": 16 * 4096 / STEP_S,
            "first_loss": 10.0,
            "final_loss": 2.1,
            "mfu": 0.41,
            "peak_memory_gib": 201.5,
        },
    )
    detected = t_hang + 60.0
    write_json_atomic(
        run / "watcher.json",
        {
            "verdict": "deadlock",
            "detected_at": detected,
            "stalled_for_s": 60.0,
            "action": "kill",
            "reason": "deadlock: no rank advanced for 60.0 s (GPUs in the low power band (< 400 W))",
            "stuck_ranks": [0],
            "behind": [0],
            "ran_ahead": list(range(1, 16)),
            "started": synth.segments["start"].min(),
            "ended": min(detected + 5.0, t_end),
        },
    )
    write_json_atomic(
        tmp / "results" / "gate" / "gate.json",
        {
            "passed": True,
            "enforce": True,
            "elapsed_s": 2.7,
            "checks": [
                {"name": n, "passed": True, "detail": "ok"}
                for n in (
                    "equal_steps",
                    "pack_contents",
                    "conservation",
                    "launch",
                    "provenance",
                    "fit",
                    "checkpoint_space",
                    "balance",
                    "schedule",
                )
            ],
        },
    )
    return run, paths, synth.table.num_rows


# ---------------------------------------------------------------- the pandas baseline


def pandas_summary(trace_paths: list[Path], phases_path: Path, window_s: float) -> dict:
    """Energy per GPU (counter plus integrated edges, else integrated), phase time and energy shares."""
    df = pd.concat(
        [pd.read_parquet(p, columns=["time", "host", "gpu", "power_w", "energy_j"]) for p in trace_paths],
        ignore_index=True,
    )
    df["host"] = df["host"].astype(str)
    df = df.sort_values(["host", "gpu", "time"], kind="stable", ignore_index=True)
    by_gpu = df.groupby(["host", "gpu"], sort=True)
    prev_t = by_gpu["time"].shift()
    piece = (df["time"] - prev_t) * (df["power_w"].astype("float64") + by_gpu["power_w"].shift()) / 2
    integrated = piece.groupby([df["host"], df["gpu"]]).sum()
    read_at = df["time"].where(df["energy_j"].notna())
    first_read = read_at.groupby([df["host"], df["gpu"]]).transform("min")
    last_read = read_at.groupby([df["host"], df["gpu"]]).transform("max")
    edge = piece.where((df["time"] <= first_read) | (prev_t >= last_read), 0.0)
    readings = df[df["energy_j"].notna()].groupby(["host", "gpu"])["energy_j"]
    counter = (readings.last() - readings.first()) + edge.groupby([df["host"], df["gpu"]]).sum()
    energy = counter.reindex(integrated.index).fillna(integrated)

    df["window"] = np.floor(df["time"] / window_s)
    means = df.groupby(["host", "gpu", "window"])["power_w"].mean().rename("mean_w").reset_index()
    phases = pd.read_parquet(phases_path)
    phases["host"] = phases["host"].astype(str)
    phases["window"] = np.floor(phases["start"] / window_s)
    merged = phases.merge(means, on=["host", "gpu", "window"], how="left")
    seconds = merged["end"] - merged["start"]
    merged["energy_j"] = (merged["mean_w"] * seconds).fillna(0.0)
    merged["seconds"] = seconds
    per = merged.groupby("phase")[["seconds", "energy_j"]].sum()
    return {
        "energy_kwh": float(energy.sum()) / 3.6e6,
        "time_share": (per["seconds"] / per["seconds"].sum()).to_dict(),
        "energy_share": (per["energy_j"] / per["energy_j"].sum()).to_dict(),
    }


def ours(summary) -> dict:
    """The numbers pandas_summary gives, from wattgate's Summary record."""
    by = summary.phases.by_phase
    return {
        "energy_kwh": summary.energy.kwh,
        "time_share": {p: v.time_share for p, v in by.items()},
        "energy_share": {p: v.energy_share for p, v in by.items()},
    }


def agree(a: dict, b: dict) -> list[str]:
    """Differences beyond tolerance (shares 1e-4 absolute, energy 1e-4 relative); empty if none."""
    bad = []
    if abs(a["energy_kwh"] / b["energy_kwh"] - 1) > 1e-4:
        bad.append(f"energy {a['energy_kwh']:.6f} vs {b['energy_kwh']:.6f} kWh")
    for key in ("time_share", "energy_share"):
        for p in LABELS:
            x, y = a[key].get(p, 0.0), b[key].get(p, 0.0)
            if abs(x - y) > 1e-4:
                bad.append(f"{key} {p}: {x:.6f} vs {y:.6f}")
    return bad


# ---------------------------------------------------------------- timing


def child(args: argparse.Namespace) -> None:
    """One timed side in this fresh process; prints one JSON line."""
    run, power, out = args.run, args.run.parents[1] / "power" / "bench", args.run.parents[1] / "report" / "bench"
    paths = trace_files(run / "telemetry")
    if args.child == "wattgate":
        t0 = time.perf_counter()
        run_triage(paths, power, run_dir=run, settings=TriageSettings(gpu_model="b300"))
        t1 = time.perf_counter()
        summary = run_report(run, out).to_json()
        t2 = time.perf_counter()
        shares = {p: v["time_share"] for p, v in summary["phases"]["by_phase"].items()}
        found = [
            {"gpu": f"{e['host']}:{e['gpu']}", "cause": e["cause"], "lag_share": e["lag_share"]}
            for e in summary["stragglers"]["entries"]
        ]
        print(json.dumps({"triage_s": t1 - t0, "report_s": t2 - t1, "shares": shares, "stragglers": found}))
    else:
        from pandas_triage import pandas_triage_and_summary

        table = shipped_table("b300")
        t0 = time.perf_counter()
        _, shares, energy, lagging = pandas_triage_and_summary(paths, table, 1.0)
        found = [{"gpu": e["gpu"], "cause": e["cause"], "lag_share": e["lag_share"]} for e in lagging]
        kwh = sum(energy.values()) / 3.6e6
        print(json.dumps({"seconds": time.perf_counter() - t0, "shares": shares, "kwh": kwh, "stragglers": found}))


def fresh(side: str, run: Path) -> dict:
    done = subprocess.run(
        [sys.executable, __file__, "--child", side, "--run", str(run)],
        capture_output=True,
        text=True,
        env=dict(os.environ),
    )
    if done.returncode:
        raise SystemExit(f"{side} run failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def timed(fn, repeat: int):
    times, out = [], None
    for _ in range(repeat):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return out, times


def line(name: str, t: list[float], extra: str = "") -> str:
    return f"  {name:34s} best {min(t):6.2f} s  median {statistics.median(t):6.2f} s{extra}"


def main() -> None:
    parser = Parser(description=__doc__.splitlines()[0], smoke=f"{SMOKE_HOURS:g} h, one run per side")
    parser.add_argument("--hours", type=positive_float, default=None, help="length of the trace (default 24)")
    parser.add_argument("--repeat", type=positive_int, default=None, help="runs per side (default 2)")
    parser.add_argument(
        "--keep",
        type=Path,
        help="build the run here and keep it (to open index.html); a run already there (same --hours) is reused",
    )
    parser.add_argument("--child", choices=["wattgate", "pandas"], help=argparse.SUPPRESS)
    parser.add_argument("--run", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    args.hours = args.hours or (SMOKE_HOURS if args.smoke else 24.0)
    args.repeat = args.repeat or (1 if args.smoke else 2)
    tmp = Path(tempfile.mkdtemp(prefix="wattgate-bench-report-")) if args.keep is None else args.keep
    try:
        start = time.perf_counter()
        run = tmp / "results" / "train" / "bench"
        stamp = tmp / "bench-hours.json"
        if args.keep is not None and stamp.is_file() and json.loads(stamp.read_text()) == {"hours": args.hours}:
            paths = trace_files(run / "telemetry")
            rows = sum(pq.read_metadata(p).num_rows for p in paths)
            how = "reused from --keep"
        else:
            run, paths, rows = write_run(tmp, args.hours)
            stamp.write_text(json.dumps({"hours": args.hours}))
            how = f"written in {time.perf_counter() - start:.1f} s"
        m = pq.read_metadata(run / "metrics.parquet").num_rows
        print(
            f"== report: 16 GPUs (2 hosts x 8) x {args.hours:g} h x 10 Hz = {rows:,} trace rows, "
            f"{m:,} metrics rows ({how})"
        )
        power, out = tmp / "results" / "power" / "bench", tmp / "results" / "report" / "bench"

        load_before = os.getloadavg()[0]
        ours_runs, pandas_runs = [], []
        for _ in range(args.repeat):  # interleaved, so that a noisy spell hits both sides
            ours_runs.append(fresh("wattgate", run))
            pandas_runs.append(fresh("pandas", run))
        split = [(r["triage_s"], r["report_s"]) for r in ours_runs]
        t_e2e = [a + b for a, b in split]
        t_pd = [r["seconds"] for r in pandas_runs]
        best = int(np.argmin(t_e2e))
        ratio = min(t_pd) / min(t_e2e)
        print(
            f"  each side in a fresh process, best of {args.repeat} (load average {load_before:.1f} before, "
            f"{os.getloadavg()[0]:.1f} after: other work on the machine slows both sides, unevenly):"
        )
        print(line("wattgate: run_triage + run_report", t_e2e))
        print(
            f"    best run: triage {split[best][0]:.2f} s + report {split[best][1]:.2f} s; index.html "
            f"{(out / 'index.html').stat().st_size / 1e6:.2f} MB"
        )
        print(line("pandas: triage + summary", t_pd))
        print(
            f"  ratio (pandas / wattgate, best of each): {ratio:.1f}x   target >= {TARGET_RATIO:g}x: "
            f"{'PASS' if ratio >= TARGET_RATIO else 'FAIL'}"
        )
        figure(
            "report",
            f"triage + report, 16 GPUs x {args.hours:g} h x 10 Hz ({rows:,} rows)",
            f"best {min(t_e2e):.2f} s, pandas / wattgate {ratio:.1f}x (target >= {TARGET_RATIO:g}x)",
            f"the same labels, summary numbers and stragglers in pandas, best {min(t_pd):.2f} s",
        )
        mine, theirs = ours_runs[-1]["shares"], pandas_runs[-1]["shares"]
        diff = max(abs(mine.get(p, 0.0) - theirs.get(p, 0.0)) for p in LABELS)
        print(
            "    phase time shares, wattgate: "
            + ", ".join(f"{p} {100 * mine.get(p, 0):.1f}%" for p in LABELS if mine.get(p, 0) or theirs.get(p, 0))
        )
        print(
            "                         pandas: "
            + ", ".join(f"{p} {100 * theirs.get(p, 0):.1f}%" for p in LABELS if mine.get(p, 0) or theirs.get(p, 0))
            + f"  (largest difference {100 * diff:.2f} points)"
        )
        for side, r in (("wattgate", ours_runs[-1]), ("pandas", pandas_runs[-1])):
            named = ", ".join(
                f"{e['gpu']} ({e['cause']}, lag share {100 * e['lag_share']:.0f}%)" for e in r["stragglers"]
            )
            print(f"    stragglers, {side}: {named or 'none'} (injected: {STRAGGLER[0]}:{STRAGGLER[1]} thermal)")
        if rows == 16 * 24 * 3600 * 10:
            print(f"  target triage + report <= {TARGET_S:.0f} s: {'PASS' if t_e2e[best] <= TARGET_S else 'FAIL'}")
        else:
            print("  targets: for 24 h only (the ratio above is for this shorter run)")

        summary = json.loads((out / "summary.json").read_text())
        window_s = json.loads((power / "triage.json").read_text())["window_s"]
        theirs, t_pd = timed(lambda: pandas_summary(paths, power / "phases.parquet", window_s), 1)
        analysis, t_ours = timed(lambda: summarize(run), 1)
        print(
            "  check, not the issue's ratio: the summary numbers alone, in this process, once "
            f"(wattgate.report.summarize {t_ours[0]:.2f} s, pandas_summary {t_pd[0]:.2f} s)"
        )
        mine = ours(analysis.summary)
        bad = agree(mine, theirs)
        print(
            f"    same numbers: {'yes' if not bad else 'NO: ' + '; '.join(bad)} (energy {mine['energy_kwh']:.3f} "
            f"kWh by {analysis.summary.energy.method}; pandas {theirs['energy_kwh']:.3f} kWh)"
        )
        print(
            "    anomalies: "
            + ", ".join(
                f"{k} {sum(a['kind'] == k for a in summary['anomalies'])}"
                for k in sorted({a["kind"] for a in summary["anomalies"]})
            )
        )
    finally:
        if args.keep is None:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
