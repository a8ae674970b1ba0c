"""Power triage: accuracy per phase on labelled synthetic traces, and speed on a 24 h, 16-GPU trace.

Accuracy. For each shipped table (A100, H100, H200, B200, B300), two jobs on
2 nodes x 2 GPUs built by wattgate.testing.synthetic_trace (see its docstring for the
power and utilization of each phase as a function of the table): one ends in
a hang with one rank stuck at 0% utilization, one finishes and idles. Between
long compute stretches come communication, short sync waits, data
starvation and checkpoints (one writer rank at near-idle power, its peers
waiting at low power and 100% utilization), with seeded random lengths. Each
is read three ways: the sampler's 10 Hz, 10 Hz with twice the noise and 5% of
samples dropped, and 1 Hz readings that average the second before them (what
nvidia-smi or DCGM at 1 Hz report). Accuracy is recall per true phase (the
share of its windows triage labels right), power only and with the run's
heartbeats and metrics; "all" pools the five models. A last table shows the
limit of the shipped tables: waits drawn at 1.9-2.2 x idle_w (the H100 hang
ratio taken literally) instead of inside the low band. On the calibrated H200
table idle_w is the draw with a CUDA context held (119 W), so 2.2 x idle_w
(262 W) passes low_max_w (256 W) and its waits read as communication; the
real H200 hang drew 119-121 W (real-data section), so that column is the
ratio's artifact, not something seen on the hardware.

The synthetic phases follow the rules' own picture of each phase, so these
numbers check the rules and their edge handling, not the tables: only a
calibrated table and real traces say how well the bands fit a given cluster.

Real data (tests/data/h200, one NVIDIA H200). The calibration trace's known
phases, 15 s each, scored per window against the phase that ran (majority of
its samples; setup/end and the window at each phase boundary left out), with
the calibrated H200 table and with the published-figure one it replaced,
deadlock_after_s 10; a checkpoint counts as right when it reads checkpoint or
idle (one GPU, no heartbeats: nothing but idle power to see). Then a real
106-step training run of a small, host-bound model, with its heartbeats and
metrics and power only: its steps should read compute, its checkpoint
intervals checkpoint, the init before the first step and the teardown after
"done" idle (see trace_scoring.train_parts).

Speed. triage() on a 16 GPU x 24 h x 10 Hz trace (13.8M rows, built in
memory), best and median of --repeat runs, against the target of ~3 s on the
2-core bench VM; the same with the run's heartbeats and metrics (a step every
2 s); then run_triage end to end (read two host files, triage, write
phases.parquet, the summary, triage.json and triage.md), against 10 s for
triage plus a report.

Figures: the real traces' share of windows read right with the calibrated table against the published-figure
one; the synthetic jobs' lowest pooled recall, power only against with the run's heartbeats and metrics; and
triage() on the speed trace against bench/pandas_triage.py's pandas triage of the same files, timed once.
`--smoke`: the H100 table only, 10 Hz, a quarter-hour speed trace, one run.

    python bench/triage_accuracy.py [--quick] [--smoke] [--hours 24] [--repeat 3]
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd

import pyarrow.parquet as pq

from benchlib import Parser, figure, positive_float, positive_int
from wattgate.testing.synthetic_trace import TraceSpec, accuracy, build_trace, gpus_of, job, write_run_info
from wattgate.testing.trace_scoring import PUBLISHED_H200, calibration_agreement, train_agreement
from wattgate.gpus import SHIPPED
from wattgate.power.triage import load_run_info, run_triage, triage
from wattgate.records.trace_meta import TraceMeta
from wattgate.trace import read_trace, trace_meta
from wattgate.triage_tables import shipped_table

H200_DATA = Path(__file__).resolve().parents[1] / "tests" / "data" / "h200"  # the real traces kept with the tests

DEADLOCK_AFTER_S = 60.0
TARGET_TRIAGE_S = 3.0  # triage() alone, 16 GPUs x 24 h x 10 Hz, on the 2-core bench VM
TARGET_E2E_S = 10.0  # triage plus a report, same trace
PHASE_ORDER = ["compute", "communication", "data_starvation", "checkpoint", "deadlock", "idle"]
CONDITIONS = {
    "10 Hz": TraceSpec(),
    "10 Hz, 2x noise, 5% samples dropped": TraceSpec(noise=2.0, drop_share=0.05),
    "1 Hz, 1 s averages": TraceSpec(hz=1.0, average_over=10),
}
WAITS = ("checkpoint", "deadlock", "sync_wait")
SMOKE_HOURS = 0.25

# ---------------------------------------------------------------- labelled jobs


def mixed_job(rng: np.random.Generator, ends_in_hang: bool) -> list[tuple]:
    """About an hour of training with every phase, in a seeded random order and lengths."""
    segs = [("idle", rng.uniform(30, 90))]
    events = ["communication", "sync_wait", "data_starvation", "checkpoint"] * 3
    rng.shuffle(events)
    for event in events:
        segs.append(("compute", rng.uniform(120, 400)))
        lengths = {
            "communication": (20, 60),
            "sync_wait": (5, 0.8 * DEADLOCK_AFTER_S),
            "data_starvation": (30, 120),
            "checkpoint": (DEADLOCK_AFTER_S + 15, 3 * DEADLOCK_AFTER_S),
        }[event]
        segs.append((event, rng.uniform(*lengths)))
    segs.append(("compute", rng.uniform(120, 300)))
    segs.append(("deadlock", rng.uniform(300, 600)) if ends_in_hang else ("idle", rng.uniform(60, 180)))
    return [(name, round(float(s), 1)) for name, s in segs]


def literal_hang_ratio(schedule: dict, table) -> dict:
    """Waits at 1.9-2.2 x idle_w, wherever the table's low band ends."""
    rng = np.random.default_rng(1)
    levels = {}
    out = {}
    for key, segs in schedule.items():
        new = []
        for i, seg in enumerate(segs):
            if seg[0] in WAITS:
                level = levels.setdefault(i, rng.uniform(1.9, 2.2) * table.idle_w)
                new.append((seg[0], seg[1], {"power_w": level}))
            else:
                new.append(seg)
        out[key] = new
    return out


def scored(model: str, cond: TraceSpec, with_run_info: bool, tmp: Path, literal: bool = False) -> pd.DataFrame:
    """Windows and correct windows per true phase over the model's two jobs."""
    table = shipped_table(model)
    gpus = gpus_of(2, 2)
    rows = []
    for k, hang in enumerate((True, False)):
        seed = 100 * SHIPPED.index(model) + k
        rng = np.random.default_rng(seed)
        schedule = job(gpus, mixed_job(rng, hang), writer=int(rng.integers(4)), stuck=int(rng.integers(4)))
        if literal:
            schedule = literal_hang_ratio(schedule, table)
        synth = build_trace(schedule, table, seed=seed, spec=cond)
        info = None
        if with_run_info:
            run = tmp / f"{model}-{k}-{len(list(tmp.iterdir()))}"
            write_run_info(run, synth)
            info = load_run_info(run, [TraceMeta.from_json(synth.meta(h)) for h in sorted({h for h, _ in gpus})])
        phases = triage(synth.table, table, deadlock_after_s=DEADLOCK_AFTER_S, run_info=info)
        acc = accuracy(phases, synth)
        rows.append(
            pd.DataFrame(
                {"phase": acc["phase"], "windows": acc["windows"], "right": np.rint(acc["recall"] * acc["windows"])}
            )
        )
    return pd.concat(rows).groupby("phase")[["windows", "right"]].sum()


def recall_table(
    cond: TraceSpec, with_run_info: bool, tmp: Path, models: list[str], literal: bool = False
) -> pd.DataFrame:
    per = {m: scored(m, cond, with_run_info, tmp, literal) for m in models}
    table = pd.DataFrame({m: s["right"] / s["windows"] for m, s in per.items()})
    pooled = sum(s.reindex(table.index, fill_value=0) for s in per.values())
    table["all"] = pooled["right"] / pooled["windows"]
    table["windows"] = pooled["windows"].astype(int)
    return table.reindex([p for p in PHASE_ORDER + ["unknown"] if p in table.index])


def lowest_recall(t: pd.DataFrame) -> float:
    """The lowest pooled recall over the true phases of a recall table."""
    return float(t.loc[[p for p in PHASE_ORDER if p in t.index], "all"].min())


def print_table(title: str, t: pd.DataFrame) -> None:
    print(f"  {title}")
    cols = [c for c in t.columns if c != "windows"]
    print(
        "    "
        + f"{'phase':16s}"
        + "".join(f"{c.upper() if c != 'all' else 'all':>8s}" for c in cols)
        + f"{'windows':>9s}"
    )
    for phase, row in t.iterrows():
        print("    " + f"{phase:16s}" + "".join(f"{row[c]:8.3f}" for c in cols) + f"{int(row['windows']):9d}")
    print(f"    lowest pooled recall {lowest_recall(t):.3f}")


# ---------------------------------------------------------------- real data


def print_agreement(title: str, t: pd.DataFrame) -> float:
    """Print an agreement table; returns the share of all its windows read right."""
    print(f"  {title}")
    for name, row in t.iterrows():
        read = ", ".join(f"{k} {v}" for k, v in row["read_as"].items())
        print(f"    {name:16s}{row['agree']:8.3f}{int(row['windows']):5d} windows  read as: {read}")
    return float((t["agree"] * t["windows"]).sum() / t["windows"].sum())


def bench_real() -> None:
    tables = {
        "calibrated H200 table": shipped_table("h200"),
        "published-figure table (I 78, L 210, C 380)": PUBLISHED_H200,
    }
    print("== real data (NVIDIA H200): share of windows read right")
    trace = read_trace(H200_DATA / "calibration-trace.parquet")
    labels = pq.read_table(H200_DATA / "calibration-trace.labels.parquet").to_pandas()
    right = {}
    for name, table in tables.items():
        right[name] = print_agreement(
            f"calibration trace, {name}, power only",
            calibration_agreement(triage(trace, table, deadlock_after_s=10), labels),
        )
    run = H200_DATA / "train"
    trace = read_trace(run / "telemetry" / "vm.parquet")
    info = load_run_info(run, [trace_meta(trace)])
    for name, table in tables.items():
        for label, ri in (("with heartbeats + metrics", info), ("power only", None)):
            print_agreement(f"train run, {name}, {label}", train_agreement(triage(trace, table, run_info=ri), run))
    calibrated, published = tables
    figure(
        "triage_accuracy",
        f"the real H200 calibration trace, {calibrated}, share of windows read right",
        f"{right[calibrated]:.3f}",
        f"the {published} {right[published]:.3f}",
    )


# ---------------------------------------------------------------- speed


def day_schedule(hours: float) -> list[tuple]:
    """`hours` of long compute with the usual interruptions, a checkpoint every ~55 min, a hang in the last 10 min."""
    block = [
        ("compute", 1500),
        ("communication", 60),
        ("compute", 600),
        ("data_starvation", 120),
        ("compute", 900),
        ("checkpoint", 120),
        ("compute", 100),
    ]
    hang = min(600.0, hours * 3600 / 6)
    work = hours * 3600 - hang
    segs = block * int(work // sum(s for _, s in block))
    rest = work - sum(s for _, s in segs)
    return segs + ([("compute", rest)] if rest > 0 else []) + [("deadlock", hang)]


def timed(fn, *args, repeat: int, **kw):
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        out = fn(*args, **kw)
        times.append(time.perf_counter() - start)
    return out, times


def bench_speed(hours: float, repeat: int, tmp: Path) -> None:
    table = shipped_table("b300")
    start = time.perf_counter()
    synth = build_trace(job(gpus_of(2, 8), day_schedule(hours)), table, spec=TraceSpec(with_truth=False))
    built = time.perf_counter() - start
    rows = synth.table.num_rows
    print(f"== speed: 16 GPUs (2 hosts x 8) x {hours:g} h x 10 Hz = {rows:,} rows (built in {built:.1f} s)")
    triage(synth.table, table)  # warm-up: lazy imports, first-touch allocations
    phases, t = timed(triage, synth.table, table, repeat=repeat)
    print(
        f"  triage()           best {min(t):6.2f} s  median {statistics.median(t):6.2f} s  ({repeat} runs, "
        f"{phases.num_rows:,} windows)"
    )
    write_run_info(tmp / "run", synth, step_s=2.0)
    info = load_run_info(tmp / "run", [TraceMeta.from_json(synth.meta(h)) for h in ("node0", "node1")])
    _, t_info = timed(triage, synth.table, table, repeat=repeat, run_info=info)
    print(
        f"  + run info         best {min(t_info):6.2f} s  median {statistics.median(t_info):6.2f} s  "
        f"(heartbeats of 16 ranks, {len(info.metrics):,} metrics rows)"
    )
    paths = synth.write(tmp / "telemetry")
    result, t_e2e = timed(run_triage, paths, tmp / "triage", repeat=repeat)
    print(
        f"  run_triage()       best {min(t_e2e):6.2f} s  median {statistics.median(t_e2e):6.2f} s  "
        "(read 2 host files, triage, write 4 artifacts)"
    )
    shares = ", ".join(f"{p} {100 * v.share:.1f}%" for p, v in sorted(result.phases.items()))
    print(f"  labels: {shares}")
    from pandas_triage import pandas_triage_and_summary  # bench/pandas_triage.py: report.py's baseline

    start = time.perf_counter()
    pandas_triage_and_summary(paths, table, 1.0)
    t_pd = time.perf_counter() - start
    figure(
        "triage_accuracy",
        f"triage() on 16 GPUs x {hours:g} h x 10 Hz ({rows:,} rows)",
        f"best {min(t):.2f} s (target <= {TARGET_TRIAGE_S:g} s for 24 h)",
        f"pandas triage + summary of the same trace (bench/pandas_triage.py), read included, once {t_pd:.2f} s",
    )
    if rows == 16 * 24 * 3600 * 10:
        print(
            f"  target triage() <= {TARGET_TRIAGE_S:.0f} s: {'PASS' if min(t) <= TARGET_TRIAGE_S else 'FAIL'}; "
            f"run_triage() <= {TARGET_E2E_S:.0f} s (leaves the rest for the report): "
            f"{'PASS' if min(t_e2e) <= TARGET_E2E_S else 'FAIL'}"
        )
    else:
        print("  target: n/a (the targets are for 24 h)")


def main() -> None:
    parser = Parser(description=__doc__.splitlines()[0], smoke=f"H100 only, 10 Hz, a {SMOKE_HOURS:g} h trace")
    parser.add_argument("--quick", action="store_true", help="a short run: H100 and B300 only, 10 Hz, a 1 h trace")
    parser.add_argument("--hours", type=positive_float, default=24.0, help="length of the speed trace")
    parser.add_argument("--repeat", type=positive_int, help="timed runs (default 3, quick and smoke 1)")
    args = parser.parse_args()
    models = ["h100"] if args.smoke else ["h100", "b300"] if args.quick else list(SHIPPED)
    conditions = dict(list(CONDITIONS.items())[:1]) if args.quick or args.smoke else CONDITIONS
    hours = SMOKE_HOURS if args.smoke else 1.0 if args.quick else args.hours
    repeat = args.repeat or (1 if args.quick or args.smoke else 3)

    with tempfile.TemporaryDirectory(prefix="wattgate-bench-triage-") as tmp:
        tmp = Path(tmp)
        bench_real()
        runs = tmp / "runs"
        runs.mkdir()
        print(f"== accuracy: recall per true phase, deadlock_after_s {DEADLOCK_AFTER_S:g}, 2 jobs x 4 GPUs per model")
        lowest = {}
        for name, cond in conditions.items():
            for with_run_info in (False, True):
                t = recall_table(cond, with_run_info, runs, models)
                print_table(f"{name}, {'with heartbeats + metrics' if with_run_info else 'power only'}", t)
                lowest.setdefault(with_run_info, []).append(lowest_recall(t))
        figure(
            "triage_accuracy",
            f"synthetic jobs ({', '.join(m.upper() for m in models)}), lowest pooled recall over the conditions, "
            "power only",
            f"{min(lowest[False]):.3f}",
            f"the same jobs with their heartbeats and metrics {min(lowest[True]):.3f}",
        )
        if not args.quick:
            t = recall_table(TraceSpec(), False, runs, models, literal=True)
            print_table("10 Hz, power only, waits at 1.9-2.2 x idle_w (limit of the shipped bands)", t)
        bench_speed(hours, repeat, tmp)


if __name__ == "__main__":
    main()
