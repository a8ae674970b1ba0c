"""Power triage: label every GPU's time, window by window, with the training phase its power shows.

triage() runs the windows (windows.py) through the rules (rules.py,
smoothing.py, run_rules.py); run_triage is the `wattgate triage` stage: traces
in, phases.parquet (phases.py), phase_summary.csv, triage.json and triage.md
out.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import cast

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from wattgate.artifacts import write_bytes_atomic, write_json_atomic
from wattgate.errors import InputError
from wattgate.power.triage import power_only
from wattgate.triage_tables import (
    DEFAULT_DEADLOCK_AFTER_S,
    DEFAULT_STRAGGLER_SHARE,
    DEFAULT_WINDOW_S,
    TriageSettings,
    TriageTable,
    positive_seconds,
    window_seconds,
)
from wattgate.power.triage.phases import (
    COMPUTE,
    CONFIDENCE,
    DATA_STARVATION,
    END,
    LABELS,
    LOW_UTIL,
    PHASE,
    PHASES_SCHEMA,
    SHARE,
    START,
    UNKNOWN,
    WAIT,
    contract,
    gap_summary,
    peer_departures,
    phase_summary,
    phases_meta,
    totals,
    write_phases,
)
from wattgate.power.triage.arrays import small_pages
from wattgate.power.triage.causes import COLUMNS as CAUSE_COLUMNS
from wattgate.power.triage.levels import Edges
from wattgate.power.triage.rules import (
    EDGE_MARGIN,
    KnownWindows,
    power_band,
    _classify,
    raw_power_band,
    _confidence,
    _peer_rules,
    peer_vote,
    _resolve_waits,
    _short_checkpoints,
)
from wattgate.power.triage.run_rules import _run_info_rules
from wattgate.power.triage.runinfo import RunInfo, load_run_info, map_ranks
from wattgate.power.triage.smoothing import SMOOTH_RADIUS, rolling_majority, rolling_median
from wattgate.power.triage.stragglers import find_stragglers, no_lag
from wattgate.power.triage.windows import (
    CHUNK_ROWS,
    _Ingest,
    _Windows,
    _windows,
    ingest,
    ingest_energy,
    overlapping_files,
    table_batches,
)
from wattgate.run_files import check_output, claim_output, read_watcher
from wattgate.records.base import Where
from wattgate.records.trace_meta import TraceMeta
from wattgate.records.triage import (
    STATUS_NO_TELEMETRY,
    STATUS_OK,
    Energy,
    Lagging,
    PauseRecord,
    PhaseTotal,
    PowerOnly,
    RankPlace,
    Ranks,
    Signals,
    TableUsed,
    Triage,
    WatcherStraggler,
)
from wattgate.trace import ENERGY_J, GPU, HOST, POWER_W, TIME, UTIL_GPU, read_trace_chunks, strict_json


def triage(
    trace,
    table: TriageTable,
    window_s: float = DEFAULT_WINDOW_S,
    deadlock_after_s: float = DEFAULT_DEADLOCK_AFTER_S,
    run_info: RunInfo | None = None,
    caps: dict | None = None,
    power_cap_w: float | None = None,
    straggler_share: float = DEFAULT_STRAGGLER_SHARE,
) -> pa.Table:
    """Label every window of every GPU in `trace` (a pa.Table, DataFrame or dict of columns).

    caps: (host, gpu) -> the power cap the sampler recorded (NVML's enforced limit); power_cap_w, when given,
    is every GPU's cap (an imported log records none); else the table's tdp_w. The stragglers found
    (stragglers.py) are in the table's metadata (phases.phases_meta: "stragglers", "lag")."""
    _check_limits(window_s, deadlock_after_s)
    acc = ingest([table_batches(trace)], window_s, with_energy=False)
    return contract(_triage(acc, table, window_s, deadlock_after_s, run_info, caps, power_cap_w, straggler_share))


def _check_limits(window_s: float, deadlock_after_s: float) -> None:
    """Both finite and > 0 (an infinite window has no windows; NaN compares false everywhere)."""
    window_seconds(window_s, "window_s")
    positive_seconds(deadlock_after_s, "deadlock_after_s")


def _triage(
    acc: _Ingest,
    table: TriageTable,
    window_s: float,
    deadlock_after_s: float,
    run_info: RunInfo | None,
    caps: dict | None,
    power_cap_w: float | None,
    straggler_share: float = DEFAULT_STRAGGLER_SHARE,
) -> pa.Table:
    """triage() on a trace already reduced (run_triage also takes the energy from it)."""
    if acc.empty:
        return PHASES_SCHEMA.empty_table()
    win = _windows(acc, table, window_s, caps, power_cap_w)
    # the stragglers read only the windows: found on another thread while the rules label them
    with ThreadPoolExecutor(max_workers=1) as pool:
        lagging = pool.submit(_stragglers, win, window_s, straggler_share, run_info)
        # then the phases table's columns that do not depend on the labels, while the rules still run
        columns = pool.submit(_window_columns, win, window_s)
        phases = _labelled(win, table, window_s, deadlock_after_s, run_info, columns)
        lag = lagging.result()
    # what the run taught (levels per GPU), how much of it was filled in and its stragglers, for run_triage and
    # the report
    learned = {"levels": win.levels.records(win.keys), "filled_s": float(win.filled.sum()) * window_s} | lag.to_json()
    return phases.replace_schema_metadata({b"wattgate.triage": strict_json(learned, sort_keys=True).encode()})


def _stragglers(win: _Windows, window_s: float, share: float, run_info: RunInfo | None) -> Lagging:
    rank_of = {g: r for r, g in map_ranks(run_info, win.keys).items()} if run_info is not None else {}
    return find_stragglers(win, window_s, share, run_info, rank_of)


def _labelled(
    win: _Windows,
    table: TriageTable,
    window_s: float,
    deadlock_after_s: float,
    run_info: RunInfo | None,
    columns: Future | None = None,
) -> pa.Table:
    """The phases table: every window labelled by the rules (rules.py, run_rules.py); `columns`, when given, is
    _window_columns(win, window_s) being made on another thread."""
    ngpu = len(win.keys)
    known = win.n > 0
    kpos = np.flatnonzero(known)
    # the known windows' columns, as copies (the rules may write to them; the stragglers read the windows meanwhile):
    # every window known, the usual case, copies whole columns instead of gathering them
    pick = (lambda a: a.copy()) if len(kpos) == len(known) else (lambda a: a[kpos])
    gpu, index = pick(win.gpu_id), pick(win.index)
    p, u, high, low = pick(win.power), pick(win.util), pick(win.high), pick(win.low)
    edges = Edges.of(win.levels, gpu, table)

    band = power_band(rolling_median(p, gpu, ngpu, SMOOTH_RADIUS), p, gpu, edges)
    raw, osc = _classify(p, u, high, low, band, edges)
    raw = peer_vote(raw, p, u, index, edges, gpu)
    # a window clearly in the compute band at busy utilization is compute however short (a step between waits)
    burst = np.empty(len(p), dtype=bool)
    for sl, _, lo, hi, _ in edges.spans:  # each GPU's edge a number over its slice: no per-window edge arrays
        np.greater_equal(p[sl], hi + EDGE_MARGIN * (hi - lo), out=burst[sl])
    burst &= raw == COMPUTE
    smooth = rolling_majority(raw, gpu, ngpu, SMOOTH_RADIUS, raw_power_band(p, edges), burst)
    from_wait = smooth == WAIT
    cls = _resolve_waits(smooth, index, gpu, ngpu, window_s, deadlock_after_s)
    cls = _short_checkpoints(cls, smooth, index, gpu, ngpu, window_s, deadlock_after_s)
    cls = _peer_rules(cls, from_wait, index, gpu, ngpu, window_s, deadlock_after_s)

    known_windows = KnownWindows(
        keys=win.keys,
        gpu=gpu,
        index=index,
        power=p,
        util=u,
        high=high,
        low=low,
        filled=pick(win.filled),
        edges=edges,
    )
    conf = _confidence(known_windows, osc, raw, smooth, cls)
    if run_info is not None:
        _run_info_rules(cls, conf, smooth, known_windows, run_info, window_s, deadlock_after_s)
    cls[cls == LOW_UTIL] = DATA_STARVATION

    labels = np.full(len(win.n), UNKNOWN, np.int8)
    labels[kpos] = cls
    confidence = np.zeros(len(win.n), np.float32)
    confidence[kpos] = conf
    cols = columns.result() if columns is not None else _window_columns(win, window_s)
    return _phases_table(cols, labels, confidence)


def _window_columns(win: _Windows, window_s: float) -> dict[str, pa.Array]:
    """The phases table's columns that the labels do not change: host, gpu, start, end, power_w, util_gpu."""
    hosts = sorted({h for h, _ in win.keys})
    host_of_gpu = np.array([hosts.index(h) for h, _ in win.keys], np.int32)
    gpu_of_gpu = np.array([g for _, g in win.keys], np.int32)
    start = win.index * window_s
    known = win.n > 0
    # GPU-major windows: each GPU's host and index repeated over its span (no gather per window)
    spans = np.diff(np.searchsorted(win.gpu_id, np.arange(len(win.keys) + 1)))
    # host and phase stay dictionaries until written (write_phases, contract()): the summaries read their codes
    return {
        HOST: pa.DictionaryArray.from_arrays(pa.array(np.repeat(host_of_gpu, spans)), pa.array(hosts, pa.string())),
        GPU: pa.array(np.repeat(gpu_of_gpu, spans), pa.int32()),
        START: pa.array(start, pa.float64()),
        END: pa.array((win.index + 1) * window_s, pa.float64()),
        POWER_W: pa.array(win.power.astype(np.float32), pa.float32(), mask=~known),
        UTIL_GPU: pa.array(win.util.astype(np.float32), pa.float32(), mask=~known | np.isnan(win.util)),
    }


def _phases_table(columns: dict[str, pa.Array], labels: np.ndarray, confidence: np.ndarray) -> pa.Table:
    labelled = {
        PHASE: pa.DictionaryArray.from_arrays(pa.array(labels.astype(np.int32)), pa.array(list(LABELS))),
        CONFIDENCE: pa.array(confidence, pa.float32()),
    }
    return pa.Table.from_arrays([(columns | labelled)[n] for n in PHASES_SCHEMA.names], names=PHASES_SCHEMA.names)


def _markdown(result: Triage, summary: pd.DataFrame) -> str:
    lines = ["# Power triage", ""]
    if result.status != STATUS_OK:
        found = _stragglers_md(result) if result.stragglers else []
        return "\n".join(lines + [f"{result.status}.", ""] + found + _notes_md(result))
    t = result.table
    assert t is not None  # a triage with telemetry always has its table
    kind = t.provenance.get("kind", "no provenance")
    lines += [
        f"Table: {t.gpu_model} ({result.table_source}; {kind}), "
        f"windows of {result.window_s:g} s, deadlock after {result.deadlock_after_s:g} s. "
        f"Signals: {', '.join(k for k, v in asdict(result.signals).items() if v) or 'none'}.",
        "",
        "| phase | seconds | share | energy (kJ) |",
        "|---|---:|---:|---:|",
    ]
    for ph in LABELS:
        r = result.phases.get(ph)
        if r:
            assert r.share is not None and r.energy_j is not None  # totals() computes both
            lines.append(f"| {ph} | {r.seconds:.0f} | {100 * r.share:.1f}% | {r.energy_j / 1e3:.1f} |")
    lines += [
        "",
        "Share of each GPU's time:",
        "",
        "| host | gpu | " + " | ".join(LABELS) + " |",
        "|---|---:|" + "---:|" * len(LABELS),
    ]
    pivot = summary.pivot_table(index=[HOST, GPU], columns=PHASE, values=SHARE, fill_value=0.0)
    # the pivot's index: (host, gpu)
    for (host, gpu), row in cast("Iterable[tuple[tuple[str, int], pd.Series]]", pivot.iterrows()):
        lines.append(f"| {host} | {gpu} | " + " | ".join(f"{100 * row.get(ph, 0.0):.1f}%" for ph in LABELS) + " |")
    lines += _gaps_and_peers_md(result)
    lines += _stragglers_md(result)
    po = result.power_only
    if po:
        lines += ["", f"## Power-only verdict ({po.mode})", ""] + [f"- {v}" for v in po.verdict]
        lines += [
            "",
            "Missing: " + "; ".join(po.missing) + "." if po.missing else "Missing: nothing.",
            "",
            "Could therefore not tell apart:",
            "",
        ] + [f"- {c}" for c in po.cannot_tell]
        lines += ["", po.wait_rule]
    return "\n".join(lines + _notes_md(result)) + "\n"


def _stragglers_md(result: Triage) -> list[str]:
    lag, found = result.lag, result.stragglers
    lines = ["", "## Stragglers", ""]
    if not found:
        lines.append(
            "None: no GPU ever waited for a peer long enough to count, so none was a straggler."
            if not lag.wait_windows
            else f"None: in the {lag.wait_windows} window(s) in which GPUs waited for a peer, no GPU was the one "
            f"waited for in more than {100 * lag.settings.share:.0f}% of them."
        )
        return lines
    lines += [
        "| host | gpu | rank | lag share | wait GPU-hours | wait kWh | cause | evidence |",
        "|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for e in found:
        hours = "-" if e.wait_gpu_hours is None else f"{e.wait_gpu_hours:.4g}"
        kwh = "-" if e.wait_kwh is None else f"{e.wait_kwh:.4g}"
        rank = "-" if e.rank is None else str(e.rank)
        gpu = "-" if e.gpu is None else str(e.gpu)
        share = "-" if e.lag_share is None else f"{100 * e.lag_share:.0f}%"  # None: a watcher's, without counts
        lines.append(f"| {e.host} | {gpu} | {rank} | {share} | {hours} | {kwh} | {e.cause} | {e.evidence} |")
    if lag.wait_gpu_hours:
        lines += ["", f"Waiting for them: {lag.wait_gpu_hours:.4g} GPU-hours, {lag.wait_kwh:.4g} kWh."]
    return lines


def _notes_md(result: Triage) -> list[str]:
    return ["", "## Notes", ""] + [f"- {n}" for n in result.notes] if result.notes else []


def _gaps_and_peers_md(result: Triage) -> list[str]:
    g, peers = result.gaps, result.peers
    assert g is not None  # triage computes them (gap_summary); only a record written before they were kept lacks them
    lines = [""]
    if g.unknown_s or g.filled_s:
        lines.append(
            f"Telemetry gaps: {g.unknown_s:.0f} s unknown over all GPUs ({g.unknown_gaps} gap(s), "
            f"longest {g.longest_gap_s:.0f} s); {g.filled_s:.0f} s of short gaps (a few sampling "
            "periods) took the phase around them."
        )
    else:
        lines.append("Telemetry gaps: none (every window has samples).")
    if peers.departures:
        lines += ["", "GPUs departing from their peers (the label most GPUs share in the same window):", ""]
        for d in peers.departures:
            what = ", ".join(f"{x.read} while peers read {x.peers} {x.seconds:.0f} s" for x in d.read_vs_peers[:3])
            lines.append(f"- {d.gpu}: {d.seconds:.0f} s ({what})")
    elif peers.agree_share is not None:
        lines.append(
            f"Peers: every GPU read the same as most of its peers in {100 * peers.agree_share:.1f}% "
            "of the compared windows; none departed for long."
        )
    if result.levels:
        lines += [
            "",
            "Levels learned from the run (W; the table's values where the run showed too little):",
            "",
            "| GPU | idle | wait | compute plateau | low band top | compute from | cap |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        fmt = lambda v: "-" if v is None else f"{v:.0f}"  # noqa: E731
        for gpu, lv in result.levels.items():
            lines.append(
                f"| {gpu} | {fmt(lv.idle_w)} | {fmt(lv.wait_w)} | {fmt(lv.plateau_w)} | "
                f"{fmt(lv.low_max_w)} | {fmt(lv.compute_min_w)} | {fmt(lv.cap_w)} |"
            )
    return lines


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


def _trace_chunks(paths: list) -> tuple[list[TraceMeta], list[Iterator], Callable[[], Iterator]]:
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


def _ranges_text(numbers: list[int]) -> str:
    """'0-7, 9' for [0, 1, ..., 7, 9] (sorted): a node's GPUs in few characters."""
    runs: list[list[int]] = []
    for n in numbers:
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


def _check_files_apart(acc: _Ingest, paths: list[Path], metas: list[TraceMeta]) -> None:
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


def recorded_caps(metas: list[TraceMeta]) -> dict[tuple[str, int], float]:
    """(host, gpu index) -> the enforced power limit the sampler recorded (trace meta gpus[].power_limit_w)."""
    caps = {}
    for meta in metas:
        for g in meta.gpu_list:
            if g.power_limit_w and meta.host is not None and g.index is not None:
                caps[(str(meta.host), g.index)] = float(g.power_limit_w)
    return caps


def run_triage(
    trace_paths,
    out_dir,
    table_path: str | None = None,
    gpu_model: str | None = None,
    run_dir: str | None = None,
    window_s: float = DEFAULT_WINDOW_S,
    deadlock_after_s: float = DEFAULT_DEADLOCK_AFTER_S,
    power_cap_w: float | None = None,
    straggler_share: float = DEFAULT_STRAGGLER_SHARE,
) -> Triage:
    """`wattgate triage`: traces (one per host) -> phases.parquet, phase_summary.csv, triage.json (the Triage
    record returned), triage.md."""
    with small_pages():
        return _run_triage(
            trace_paths,
            out_dir,
            table_path,
            gpu_model,
            run_dir,
            window_s,
            deadlock_after_s,
            power_cap_w,
            straggler_share,
        )


def _run_triage(
    trace_paths, out_dir, table_path, gpu_model, run_dir, window_s, deadlock_after_s, power_cap_w, straggler_share
) -> Triage:
    paths = [Path(p) for p in ([trace_paths] if isinstance(trace_paths, (str, os.PathLike)) else trace_paths)]
    out_dir = Path(out_dir)
    check_output(out_dir, "triage")  # before any work: a folder triage did not write is refused
    metas, chunks, again = _trace_chunks(paths)
    _check_limits(window_s, deadlock_after_s)
    notes: list[str] = []  # damaged heartbeat records: skipped and named (the phases there rest on power)
    with ThreadPoolExecutor(max_workers=1) as early:  # the run's own record is read while the traces are
        reading = early.submit(load_run_info, run_dir, metas, on_bad=notes.append) if run_dir else None
        acc = ingest(chunks, window_s)
    _check_files_apart(acc, paths, metas)
    names = sorted({name for m in metas for name in m.device_names()})
    empty = acc.empty
    settings = TriageSettings(table_path, gpu_model, window_s, deadlock_after_s, power_cap_w, straggler_share)
    caps = recorded_caps(metas)
    if empty and not (table_path or gpu_model):
        table, source = None, None
    else:
        table = settings.table(names, list(caps.values()))
        source = settings.table_source(table, names)
    info = reading.result() if reading is not None else None
    for note in notes:
        print(f"triage: warning: {note}", file=sys.stderr, flush=True)
    if empty:
        phases, energy = PHASES_SCHEMA.empty_table(), {}
    else:
        energy = ingest_energy(acc, again)
        assert table is not None  # chosen whenever the traces have samples
        phases = _triage(acc, table, window_s, deadlock_after_s, info, caps, power_cap_w, straggler_share)
    power_seen, util_seen = acc.power, acc.util
    del acc
    learned = phases_meta(phases, strict=True)
    claim_output(out_dir, "triage")
    # phases.parquet is written on another thread (Arrow lets go of the GIL) while the summaries are made, two of
    # them on a third (each reads the phases only); it is done before the files that describe it (the report checks
    # they are newer)
    with ThreadPoolExecutor(max_workers=2) as pool:
        written = pool.submit(
            write_phases,
            phases,
            out_dir / "phases.parquet",
            window_s,
            table.gpu_model if table else None,
            {k: lv.to_json() for k, lv in learned.levels.items()},
            learned.filled_s,
        )
        peers = pool.submit(peer_departures, phases, window_s)
        found = pool.submit(power_only.pauses, phases)
        summary = phase_summary(phases)

        where = Where(str(out_dir / "triage.json"), "triage")
        stragglers = learned.stragglers
        if empty and run_dir:
            stragglers = watcher_stragglers(run_dir)
        signals = Signals(
            power=power_seen,
            util=util_seen,
            heartbeats=bool(info and info.has_heartbeats),
            metrics=bool(info and info.has_metrics),
        )
        # without heartbeats the pauses rest on power alone (rule 4): say what was missing and how they were read
        found = found.result()
        t0 = float(pc.min(phases.column(START)).as_py()) if phases.num_rows else None
        po = None
        if not signals.heartbeats and not empty:
            inferred = any(m.gpu_index_inferred for m in metas)
            limits = power_only.limits(asdict(signals), deadlock_after_s, inferred)
            po = PowerOnly.from_json(
                limits | {"verdict": power_only.verdict(found, t0, window_s)}, where, "power_only."
            )
        ranks = None
        if info is not None and not empty:
            keys = [(h, int(g)) for h, g in summary[[HOST, GPU]].drop_duplicates().itertuples(index=False)]
            mapped = map_ranks(info, keys)
            ranks = Ranks(
                mapped={str(r): RankPlace(host=keys[g][0], gpu=keys[g][1]) for r, g in mapped.items()},
                unmapped=tuple(sorted(set(info.states) - set(mapped))),
            )
        result = Triage(
            status=STATUS_NO_TELEMETRY if empty else STATUS_OK,
            traces=tuple(sorted(str(p) for p in paths)),
            hosts=tuple(sorted(pc.unique(phases.column(HOST)).to_pylist())),
            gpus=0 if empty else len(summary[[HOST, GPU]].drop_duplicates()),
            table=_table_used(table),
            table_source=source,
            window_s=window_s,
            deadlock_after_s=deadlock_after_s,
            run_dir=str(run_dir) if run_dir else None,
            signals=signals,
            # built as computed, unchecked: a figure that could not be computed is written as null
            phases={ph: PhaseTotal(**v) for ph, v in totals(summary).items()},
            gaps=gap_summary(phases, window_s, learned.filled_s),
            levels=learned.levels,
            peers=peers.result(),
            # per GPU "host:gpu": the energy the report shows (energy.records), from the same samples
            energy={k: Energy.from_json(v, where, f"energy.{k}.") for k, v in energy.items()},
            # the GPUs everyone waited for (stragglers.py); without GPU telemetry, the watcher's rank CPU time
            stragglers=stragglers,
            lag=learned.lag or no_lag(straggler_share),
            notes=tuple(notes),
            pauses=tuple(PauseRecord.from_json(p.record(t0), where, f"pauses[{i}].") for i, p in enumerate(found)),
            power_only=po,
            ranks=ranks,
        )
        written.result()
    # every text made before any is written: a failure leaves no triage.json without its triage.md
    csv, md = summary.to_csv(index=False, float_format="%.10g").encode(), _markdown(result, summary).encode()
    write_bytes_atomic(out_dir / "phase_summary.csv", csv)
    # strict JSON: read_trace already nulls non-finite power, so a NaN/Inf left here is a figure that could not
    # be computed (e.g. a share of zero seconds) and is written as null, deliberately
    write_json_atomic(out_dir / "triage.json", result.to_json(), nonfinite="null")
    write_bytes_atomic(out_dir / "triage.md", md)
    return result


def _table_used(table: TriageTable | None) -> TableUsed | None:
    return None if table is None else TableUsed(**asdict(table))
