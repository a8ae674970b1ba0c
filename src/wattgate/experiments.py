"""Measurement runs derived from the run config, and their comparison tables.

- `scaling`: the train stage at each of `scaling.world_sizes`, the same global
  batch (packs per optimizer step) in every run, `scaling.steps` steps each.
  Grad accumulation absorbs the world size, so each run does the same work per
  step and throughput per GPU compares directly.
- `dataio`: the same run with `train.data_cache: shared` (read the pretokenized
  shards where they are) and `local` (copy them to node-local scratch first).

Each variant is a full config (`wattgate variant`), so its pack, gate and train
stages are the ordinary ones; `wattgate compare` turns the finished runs into
`table.csv`, `table.md` and `plot.png`. Throughput skips the first step
(allocation, compilation, cache warm-up): per step, tokens over all ranks
divided by the slowest rank's step time.
"""

from __future__ import annotations

import io
import math
import re
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from wattgate.artifacts import check_file_output, first_line_has, write_bytes_atomic
from wattgate.config import config_bytes, load_run_config, run_config, world_size
from wattgate.records.base import Where
from wattgate.records.gate import GateParts
from wattgate.records.run_config import RunConfig
from wattgate.records.trained import Trained
from wattgate.errors import InputError
from wattgate.report.gate_input import forecast_view
from wattgate.report.metrics import trusted_metrics
from wattgate.run_tables import DATA_WAIT_S, RANK, STEP, STEP_TIME_S, TIME, TOKENS
from wattgate.run_files import (
    GATE_REPORT,
    run_config_file,
    stage_folder,
    METRICS,
    TRAINED,
    check_output,
    claim_output,
    read_gate_json,
    read_metrics,
    read_trained,
)

EXPERIMENTS = ("scaling", "dataio")
DATA_CACHES = ("shared", "local")


def variant_names(config: RunConfig, experiment: str) -> list[str]:
    if experiment == "scaling":
        return [f"w{n}" for n in config.scaling.world_sizes]
    if experiment == "dataio":
        return list(DATA_CACHES)
    raise InputError(f"unknown experiment {experiment!r}; known: {', '.join(EXPERIMENTS)}")


def node_layout(world: int, gpus_per_node: int) -> tuple[int, int]:
    """(nodes, GPUs per node) for `world` GPUs on nodes of `gpus_per_node`: whole nodes, or part of one."""
    if world <= gpus_per_node:
        return 1, world
    if world % gpus_per_node:
        raise InputError(
            f"scaling.world_sizes: {world} does not fill whole nodes of cluster.gpus_per_node {gpus_per_node}"
        )
    return world // gpus_per_node, gpus_per_node


def global_batch_packs(config: RunConfig) -> int:
    t = config.train
    return config.scaling.global_batch_packs or world_size(config) * t.micro_batch_size * t.grad_accum


def variant_config(config: RunConfig, experiment: str, variant: str) -> RunConfig:
    """The run config of one variant: a validated, complete config for the ordinary stages."""
    t, cluster = config.train, config.cluster
    if experiment == "scaling":
        m = re.fullmatch(r"w(\d+)", variant)
        if not m or int(m.group(1)) not in config.scaling.world_sizes:
            raise InputError(
                f"scaling variant {variant!r}: expected w<N> for N in scaling.world_sizes "
                f"{list(config.scaling.world_sizes)}"
            )
        world = int(m.group(1))
        nodes, per_node = node_layout(world, cluster.gpus_per_node)
        batch = global_batch_packs(config)
        accum, rest = divmod(batch, world * t.micro_batch_size)
        if rest or accum < 1:
            raise InputError(
                f"scaling: a global batch of {batch} packs does not split over {world} GPU(s) x "
                f"micro_batch_size {t.micro_batch_size}; set scaling.global_batch_packs to a "
                "multiple of every world size x micro_batch_size"
            )
        cluster = cluster.replace(nodes=nodes, gpus_per_node=per_node)
        t = t.replace(grad_accum=accum)
        steps = config.scaling.steps
    elif experiment == "dataio":
        if variant not in DATA_CACHES:
            raise InputError(f"dataio variant {variant!r}: expected one of {', '.join(DATA_CACHES)}")
        t = t.replace(data_cache=variant)
        steps = config.dataio.steps
    else:
        raise InputError(f"unknown experiment {experiment!r}; known: {', '.join(EXPERIMENTS)}")
    # a measurement: only the first steps, one checkpoint at the end, no warmup longer than the run
    t = t.replace(
        max_steps=steps,
        checkpoint_every=steps,
        checkpoint_at_epoch_end=False,
        warmup_steps=min(t.warmup_steps, steps - 1),
    )
    derived = config.replace(train=t, cluster=cluster, run_name=f"{config.run_name}-{experiment}-{variant}")
    return run_config(derived.to_json())  # validated again: a derived value out of the schema's range is refused


VARIANT_HEADER = "# Derived by `wattgate variant`"


def write_variant_config(config: RunConfig, experiment: str, variant: str, dest: Path) -> RunConfig:
    check_file_output(dest, "variant", lambda p: first_line_has(p, VARIANT_HEADER))  # never a user's config
    derived = variant_config(config, experiment, variant)
    header = f"{VARIANT_HEADER} ({experiment}, variant {variant}) from the run config.\n"
    write_bytes_atomic(dest, header.encode() + config_bytes(derived))
    return derived


@dataclass(frozen=True, kw_only=True)
class StepThroughput:
    """What a variant's metrics measured over its steps after the first (step_throughput)."""

    steps_measured: int
    tokens: int
    seconds: float  # the measured steps' time (each the slowest rank's)
    tokens_per_s: float
    data_wait_share: float  # NaN when no step has a positive step time
    data_wait_s_per_step: float
    start: float  # unix s: the first measured step's start
    end: float  # the last measured step's end


def step_throughput(metrics: pd.DataFrame, skip: int = 1, source: str = METRICS, note=None) -> StepThroughput:
    """Tokens/s over the measured steps: per step, all ranks' tokens over the slowest rank's time. A step
    without a positive step time (0, or left out as damaged) has no throughput: it is left out, and so is a
    rank's data wait share of a step time that is not positive (`note` names both)."""
    note = note or (lambda text: None)
    # per step: all ranks' tokens, the slowest rank's step time and data wait, the step's end
    steps = metrics.groupby(STEP).agg(
        **{
            TOKENS: (TOKENS, "sum"),
            STEP_TIME_S: (STEP_TIME_S, "max"),
            DATA_WAIT_S: (DATA_WAIT_S, "max"),
            TIME: (TIME, "max"),
        }
    )
    measured = steps.iloc[skip:] if len(steps) > skip else steps
    timed = measured[STEP_TIME_S] > 0  # NaN compares False
    if not timed.any():
        raise InputError(f"{source}: no measured steps (none after the first has a positive step_time_s)")
    if not timed.all():
        note(f"{source}: {(~timed).sum()} step(s) without a positive step_time_s left out of the throughput")
        measured = measured[timed]
    positive = metrics[STEP_TIME_S] > 0
    share = (metrics[DATA_WAIT_S][positive] / metrics[STEP_TIME_S][positive]).groupby(metrics[STEP][positive])
    wait_share = float(share.mean().reindex(measured.index).mean())  # NaN (an empty cell) when none has one
    if not positive.all():
        note(f"{source}: {(~positive).sum()} row(s) without a positive step_time_s left out of data_wait_share")
    return StepThroughput(
        steps_measured=len(measured),
        tokens=int(measured[TOKENS].sum()),
        seconds=float(measured[STEP_TIME_S].sum()),
        tokens_per_s=float(measured[TOKENS].sum() / measured[STEP_TIME_S].sum()),
        data_wait_share=wait_share,
        data_wait_s_per_step=float(measured[DATA_WAIT_S].mean()),
        start=float(measured[TIME].iloc[0] - measured[STEP_TIME_S].iloc[0]),
        end=float(measured[TIME].iloc[-1]),
    )


def measured_energy_j(telemetry: Path, start: float, end: float) -> float | None:
    """Board energy over [start, end] from the node traces (integrated instant power); None without GPUs."""
    from wattgate.power.energy import trapezoids
    from wattgate import trace as T
    from wattgate.trace import read_trace, trace_files

    total, seen = 0.0, False
    for path in trace_files(telemetry):
        d = read_trace(path).select([T.TIME, T.HOST, T.GPU, T.POWER_W]).to_pandas()
        d = d[(d[T.TIME] >= start) & (d[T.TIME] <= end)]
        for _, g in d.sort_values(T.TIME).groupby([T.HOST, T.GPU]):
            pieces = trapezoids(g[T.TIME].to_numpy(), g[T.POWER_W].to_numpy())
            if len(pieces):
                seen = True
                total += float(pieces.sum())
    return total if seen else None


# the comparison table's columns that compare() and the plots read (each a VariantRow field, and the efficiency)
RUN, WORLD_SIZE, DEVICE, DATA_CACHE = "run", "world_size", "device", "data_cache"
TOKENS_PER_S, TOKENS_PER_S_PER_GPU, DATA_WAIT_SHARE = "tokens_per_s", "tokens_per_s_per_gpu", "data_wait_share"
SCALING_EFFICIENCY = "scaling_efficiency"


@dataclass(frozen=True, kw_only=True)
class ForecastColumns:
    """The gate's forecast of a variant's train job beside what its TRAINED measured (job_s), and the error."""

    forecast_source: str | None = None
    forecast_wall_s: float | None = None
    measured_wall_s: float | None = None
    forecast_error: float | None = None


@dataclass(frozen=True, kw_only=True)
class VariantRow:
    """One finished variant's row of the comparison table: its settings and measured throughput."""

    run: str
    world_size: int
    nodes: int
    device: str | None
    grad_accum: int
    micro_batch_size: int
    data_cache: str
    steps_measured: int
    tokens_per_s: float
    tokens_per_s_per_gpu: float
    gpu_hours_per_billion_tokens: float | None
    joules_per_token: float | None
    data_wait_share: float
    data_wait_s_per_step: float
    data_copy_s: float | None
    forecast_source: str | None = None  # ForecastColumns' fields, last as in table.csv
    forecast_wall_s: float | None = None
    measured_wall_s: float | None = None
    forecast_error: float | None = None


def run_row(train: Path, note=None) -> VariantRow:
    """One finished variant run (results/train/<run>; its config and gate beside it, results/config/<run>.yaml and
    results/gate/<run>): its settings and measured throughput (`note`: what was left out, and why)."""
    note = note or (lambda text: None)
    config = load_run_config(run_config_file(train))
    metrics = read_metrics(train, [STEP, RANK, TIME, TOKENS, STEP_TIME_S, DATA_WAIT_S])
    summary = read_trained(train)
    if metrics is None or summary is None:
        missing = " and ".join(name for name, found in ((METRICS, metrics), (TRAINED, summary)) if found is None)
        raise InputError(f"{train}: not a finished train run (no {missing}); rerun its train stage")
    metrics = trusted_metrics(metrics, train / METRICS, note)
    m = step_throughput(metrics, source=str(train / METRICS), note=note)
    world = world_size(config)
    energy = measured_energy_j(train / "telemetry", m.start, m.end)
    tps = m.tokens_per_s if m.tokens_per_s > 0 else None  # no tokens: no cost per token either
    return VariantRow(
        run=config.run_name,
        world_size=world,
        nodes=config.cluster.nodes,
        device=summary.device,
        grad_accum=config.train.grad_accum,
        micro_batch_size=config.train.micro_batch_size,
        data_cache=config.train.data_cache,
        steps_measured=m.steps_measured,
        tokens_per_s=m.tokens_per_s,
        tokens_per_s_per_gpu=m.tokens_per_s / world,
        gpu_hours_per_billion_tokens=world * 1e9 / tps / 3600 if tps else None,
        joules_per_token=energy / m.tokens if energy is not None and m.tokens > 0 else None,
        data_wait_share=m.data_wait_share,
        data_wait_s_per_step=m.data_wait_s_per_step,
        data_copy_s=summary.data_copy_s,
        **asdict(forecast_columns(stage_folder(train, "gate"), summary)),
    )


def forecast_columns(gate_dir: Path, trained: Trained) -> ForecastColumns:
    """The gate's forecast of the train job's wall time beside what TRAINED measured, and the error. A
    damaged forecast is refused: its row would compare with nothing."""
    raw = read_gate_json(gate_dir)
    parts = GateParts.from_json(raw, Where(str(gate_dir / GATE_REPORT))) if raw is not None else GateParts()
    fc, problem = forecast_view(parts.forecast)
    if problem:
        raise InputError(f"{gate_dir / GATE_REPORT}: {problem}; rerun this variant's gate stage")
    measured = trained.job_s if trained.job_s else None  # TRAINED without a usable job time
    if fc is None:
        return ForecastColumns(measured_wall_s=measured)
    assert fc.throughput is not None  # forecast_view returns a forecast only with its throughput
    return ForecastColumns(
        forecast_source=fc.throughput.source,
        forecast_wall_s=fc.wall_s,
        measured_wall_s=measured,
        forecast_error=fc.wall_s / measured - 1 if measured else None,
    )


FORECAST_COLUMNS = ["forecast_source", "forecast_wall_s", "measured_wall_s", "forecast_error"]
SCALING_COLUMNS = [
    "world_size",
    "nodes",
    "device",
    "grad_accum",
    "steps_measured",
    "tokens_per_s",
    "tokens_per_s_per_gpu",
    "scaling_efficiency",
    "gpu_hours_per_billion_tokens",
    "joules_per_token",
] + FORECAST_COLUMNS
DATAIO_COLUMNS = [
    "data_cache",
    "world_size",
    "device",
    "steps_measured",
    "tokens_per_s",
    "data_wait_share",
    "data_wait_s_per_step",
    "data_copy_s",
    "joules_per_token",
] + FORECAST_COLUMNS


def compare(experiment: str, run_dirs: list[Path], out: Path, note=None) -> pd.DataFrame:
    """table.csv, table.md and plot.png of the finished variant runs; `note` gets what was left out and why
    (default: printed to stderr), and table.md lists it too."""
    out = Path(out)
    check_output(out, "compare")
    notes: list[str] = []
    rows = [run_row(Path(d), notes.append) for d in run_dirs]
    table = pd.DataFrame([asdict(r) for r in rows])
    if experiment == "scaling":
        table = table.sort_values(WORLD_SIZE).reset_index(drop=True)
        base = table[TOKENS_PER_S_PER_GPU].iloc[0]
        table[SCALING_EFFICIENCY] = table[TOKENS_PER_S_PER_GPU] / base if base > 0 else math.nan
        table = _finite_cells(table, notes.append)[SCALING_COLUMNS]
        figure = _scaling_plot(table)
    elif experiment == "dataio":
        table = table.sort_values(DATA_CACHE, key=lambda c: c.map(DATA_CACHES.index)).reset_index(drop=True)
        table = _finite_cells(table, notes.append)[DATAIO_COLUMNS]
        figure = _dataio_plot(table)
    else:
        raise InputError(f"unknown experiment {experiment!r}; known: {', '.join(EXPERIMENTS)}")
    claim_output(out, "compare")
    write_bytes_atomic(out / "table.csv", table.to_csv(index=False, float_format="%.6g").encode())
    write_bytes_atomic(out / "table.md", _markdown(table, notes).encode())
    write_bytes_atomic(out / "plot.png", figure)
    for text in notes:
        (note or _print_note)(text)
    return table


def _print_note(text: str) -> None:
    print(f"compare: note: {text}", file=sys.stderr)


def _finite_cells(table: pd.DataFrame, note) -> pd.DataFrame:
    """The table with every infinite number an empty cell, named in `note`: an input's infinity (JSON's
    Infinity parses) is no measurement, and table.csv holds measurements."""
    numeric = table.select_dtypes("number")
    infinite = [c for c in numeric.columns if np.isinf(numeric[c].to_numpy(dtype=float)).any()]
    if not infinite:
        return table
    for c in infinite:
        runs = table.loc[np.isinf(table[c].to_numpy(dtype=float)), RUN].tolist()
        note(f"{c}: infinite for {', '.join(map(str, runs))}: left empty")
    return table.replace([np.inf, -np.inf], np.nan)


def _markdown(table: pd.DataFrame, notes: Sequence[str] = ()) -> str:
    def cell(v):
        if v is None or (isinstance(v, float) and math.isnan(v)):
            return "n/a"
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(table.columns) + " |", "|" + "---|" * len(table.columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in table.itertuples(index=False)]
    lines += ["", "Notes:", *(f"- {text}" for text in notes)] if notes else []
    return "\n".join(lines) + "\n"


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, metadata={"Software": None})
    return buf.getvalue()


def _scaling_plot(table: pd.DataFrame) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    w = table[WORLD_SIZE].to_numpy()
    ax.plot(w, table[TOKENS_PER_S], "o-", label="measured")
    ax.plot(w, table[TOKENS_PER_S].iloc[0] * w / w[0], "--", color="grey", label="linear")
    for x, y, e in zip(w, table[TOKENS_PER_S], table[SCALING_EFFICIENCY]):
        ax.annotate(f"{100 * e:.0f}%", (x, y), textcoords="offset points", xytext=(5, -12))
    device = table[DEVICE].iloc[0]
    ax.set_xlabel(f"GPUs ({device} processes)" if device == "cpu" else "GPUs")
    ax.set_ylabel("tokens/s")
    ax.set_xticks(w)
    ax.set_ylim(bottom=0)
    ax.set_title("Strong scaling, same global batch (labels: efficiency per GPU)", fontsize=10)
    ax.legend()
    fig.tight_layout()
    data = _png(fig)
    plt.close(fig)
    return data


def _dataio_plot(table: pd.DataFrame) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(8, 3.5))
    a.bar(table[DATA_CACHE], table[TOKENS_PER_S], color=["tab:blue", "tab:orange"][: len(table)])
    a.set_ylabel("tokens/s")
    b.bar(table[DATA_CACHE], 100 * table[DATA_WAIT_SHARE], color=["tab:blue", "tab:orange"][: len(table)])
    b.set_ylabel("data wait, % of step time")
    fig.suptitle("Data path: shared folder vs node-local copy")
    fig.tight_layout()
    data = _png(fig)
    plt.close(fig)
    return data
