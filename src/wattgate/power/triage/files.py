"""What the `wattgate triage` stage reads and writes: the traces (checked to be given once and to hold
different nodes), the power limits their samplers recorded, the watcher's stragglers, and phase_summary.csv,
triage.json and triage.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

from wattgate.artifacts import write_bytes_atomic, write_json_atomic
from wattgate.errors import InputError
from wattgate.power.triage.causes import COLUMNS as CAUSE_COLUMNS
from wattgate.power.triage.windows import CHUNK_ROWS, _Ingest, overlapping_files
from wattgate.run_files import read_watcher
from wattgate.records.trace_meta import TraceMeta
from wattgate.records.triage import Triage, WatcherStraggler
from wattgate.trace import ENERGY_J, GPU, HOST, POWER_W, TIME, UTIL_GPU, read_trace_chunks


# what triage reads of a trace: the windows' columns, the energy counter (energy.py) and what names a straggler's
# cause (causes.py); the last are decoded only for the chunks a straggler's windows ask for (ticks.DeferredCauses)
TRIAGE_COLUMNS = [TIME, HOST, GPU, POWER_W, UTIL_GPU, ENERGY_J, *CAUSE_COLUMNS]


def watcher_stragglers(run_dir) -> tuple[WatcherStraggler, ...]:
    """Without GPU telemetry, the stragglers the watcher named from its ranks' CPU time (watcher.json
    `stragglers`), as triage.json entries (no GPU: `gpu` null, `rank` set); none without a readable record."""
    try:
        record = read_watcher(Path(run_dir))
    except InputError:
        return ()
    return tuple(
        WatcherStraggler(
            host=s.host,
            gpu=None,
            rank=s.rank,
            lag_share=s.lag_share,
            lag_windows=s.lag_windows,
            wait_windows=s.wait_windows,
            wait_gpu_hours=s.wait_gpu_hours,
            wait_kwh=s.wait_kwh,
            wait_rank_hours=s.wait_rank_hours,
            cause=s.cause,
            evidence=s.evidence,
            first=s.first,
            last=s.last,
            source="watcher",
        )
        for s in (record.stragglers or () if record is not None else ())
        if s.signal == "cpu"
    )


def recorded_caps(metas: list[TraceMeta]) -> dict[tuple[str, int], float]:
    """(host, gpu index) -> the enforced power limit the sampler recorded (trace meta gpus[].power_limit_w)."""
    caps = {}
    for meta in metas:
        for g in meta.gpu_list:
            if g.power_limit_w and meta.host is not None and g.index is not None:
                caps[(str(meta.host), g.index)] = float(g.power_limit_w)
    return caps


def trace_chunks(paths: list) -> tuple[list[TraceMeta], list[Iterator], Callable[[], Iterator]]:
    """Each file's metadata; each file's batches (TRIAGE_COLUMNS, the cause columns deferred), from the files
    opened for the metadata; and a way to read them all again, end to end, without the cause columns
    (ingest_energy, for a file whose row groups overlap in time)."""
    if not paths:
        raise InputError("no trace files given")
    _check_given_once(paths)
    opened = [read_trace_chunks(p, TRIAGE_COLUMNS, CHUNK_ROWS, deferred=CAUSE_COLUMNS) for p in paths]
    energy_columns = [c for c in TRIAGE_COLUMNS if c not in CAUSE_COLUMNS]

    def again():
        for p in paths:
            yield from read_trace_chunks(p, energy_columns, CHUNK_ROWS)[1]

    return [meta for meta, _ in opened], [batches for _, batches in opened], again


def _check_given_once(paths: list[Path]) -> None:
    """A trace named twice (itself and through its folder) would count its samples twice."""
    seen: dict[Path, Path] = {}
    for p in paths:
        key = p.resolve()
        if key in seen:
            raise InputError(f"{p}: trace given twice (also as {seen[key]}); pass each trace once")
        seen[key] = p


def check_files_apart(acc: _Ingest, paths: list[Path], metas: list[TraceMeta]) -> None:
    """Refuse two files holding the same host's GPUs over the same time (windows.overlapping_files) when both
    took that host's name from their file names (import-trace without --host): two nodes' logs of one name.
    A host both traces name for itself (a sampler's hostname, a log's host column) is one node whose samples
    were split between files, and is summed from their rows sorted together (windows.ingest_energy)."""
    guessed = [set(m.hosts_from_file_names or ()) for m in metas]
    clash = overlapping_files(acc, lambda a, b, host: host in guessed[a] and host in guessed[b])
    if clash is None:
        return
    gpus = _ranges_text(clash.gpus)
    raise InputError(
        f"{paths[clash.first]} and {paths[clash.second]} both hold samples of host {clash.host or '(none)'!r} "
        f"(named after their log files) GPU(s) {gpus} over the same time ({clash.start:.17g} to "
        f"{clash.end:.17g} s, unix time): two nodes' logs under one host name would merge into one node's GPUs; "
        "re-import one with "
        "`wattgate import-trace --host NAME` (traces of the same GPUs that follow one another, a relaunch, "
        "are fine)"
    )


def _ranges_text(numbers: list[int]) -> str:
    """'0-7, 9' for [0, 1, ..., 7, 9] (sorted): a node's GPUs in few characters."""
    runs: list[list[int]] = []
    for n in numbers:
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


def write_texts(out_dir: Path, summary_csv: bytes, result: Triage, markdown: bytes) -> None:
    """phase_summary.csv, triage.json (`result`) and triage.md, each written whole or not at all."""
    write_bytes_atomic(out_dir / "phase_summary.csv", summary_csv)
    # strict JSON: read_trace already nulls non-finite power, so a NaN/Inf left here is a figure that could not
    # be computed (e.g. a share of zero seconds) and is written as null, deliberately
    write_json_atomic(out_dir / "triage.json", result.to_json(), nonfinite="null")
    write_bytes_atomic(out_dir / "triage.md", markdown)
