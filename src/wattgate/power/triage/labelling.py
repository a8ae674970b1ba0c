"""Power triage's computation: every window of every GPU labelled by the rules, and the stragglers found.

triage() runs the windows (windows.py) through the rules (rules.py, smoothing.py, run_rules.py) into the phases
table (phases.py); the stragglers (stragglers.py) are found from the same windows meanwhile.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import pyarrow as pa

from wattgate.triage_tables import (
    DEFAULT_DEADLOCK_AFTER_S,
    DEFAULT_STRAGGLER_SHARE,
    DEFAULT_WINDOW_S,
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
    START,
    UNKNOWN,
    WAIT,
    contract,
)
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
from wattgate.power.triage.runinfo import RunInfo, map_ranks
from wattgate.power.triage.smoothing import SMOOTH_RADIUS, rolling_majority, rolling_median
from wattgate.power.triage.stragglers import find_stragglers
from wattgate.power.triage.windows import _Ingest, _Windows, _windows, ingest, table_batches
from wattgate.records.triage import Lagging
from wattgate.trace import GPU, HOST, POWER_W, UTIL_GPU, strict_json


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
    check_limits(window_s, deadlock_after_s)
    acc = ingest([table_batches(trace)], window_s, with_energy=False)
    return contract(
        triage_ingested(acc, table, window_s, deadlock_after_s, run_info, caps, power_cap_w, straggler_share)
    )


def check_limits(window_s: float, deadlock_after_s: float) -> None:
    """Both finite and > 0 (an infinite window has no windows; NaN compares false everywhere)."""
    window_seconds(window_s, "window_s")
    positive_seconds(deadlock_after_s, "deadlock_after_s")


def triage_ingested(
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
    # the known windows' columns: every window known, the usual case, as read-only views (the stragglers read the
    # windows meanwhile; a rule that wrote to one would raise), else gathered
    pick = _read_only if len(kpos) == len(known) else (lambda a: a[kpos])
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


def _read_only(a: np.ndarray) -> np.ndarray:
    view = a.view()
    view.flags.writeable = False
    return view


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
