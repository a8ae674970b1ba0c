"""The phases contract: phases.parquet, the output of power triage, and what reads it.

One row per GPU per window (windows.py): host, gpu, start, end, phase (one of
LABELS), mean power, mean utilization and the label's confidence. The file's
metadata (key wattgate.phases) holds the format version, the window length and
the table's GPU model; triage.json beside it holds the rest of the settings.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import cast

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from wattgate.artifacts import atomic_path
from wattgate.codes import column_codes
from wattgate.errors import InputError
from wattgate.triage_tables import (
    DEFAULT_DEADLOCK_AFTER_S,
    DEFAULT_WINDOW_S,
    POWER_PHASES,
    positive_seconds,
    window_seconds,
)
from wattgate.records.base import Where
from wattgate.records.triage import TRIAGE_FORMAT_VERSION, Departure, Gaps, Peers, PhasesMeta, ReadVsPeers
from wattgate.trace import GPU, HOST, POWER_W, UTIL_GPU, strict_json

FORMAT_VERSION = TRIAGE_FORMAT_VERSION
LABELS = POWER_PHASES + ("unknown",)
COMPUTE, COMMUNICATION, DATA_STARVATION, CHECKPOINT, DEADLOCK, IDLE, UNKNOWN = range(7)
WAIT, LOW_UTIL = 7, 8  # internal classes, resolved before output
ACTIVE = (COMPUTE, COMMUNICATION, DATA_STARVATION)

# phases.parquet's columns: host, gpu, power_w and util_gpu (the window means) are named as the trace's
START = "start"
END = "end"
PHASE = "phase"
CONFIDENCE = "confidence"
PHASES_SCHEMA = pa.schema(
    [
        (HOST, pa.string()),
        (GPU, pa.int32()),
        (START, pa.float64()),
        (END, pa.float64()),
        (PHASE, pa.string()),
        (POWER_W, pa.float32()),
        (UTIL_GPU, pa.float32()),
        (CONFIDENCE, pa.float32()),
    ]
)
# phase_summary.csv's columns, after host, gpu and phase
WINDOWS = "windows"
SECONDS = "seconds"
SHARE = "share"
ENERGY_J = "energy_j"
SUMMARY_COLUMNS = [HOST, GPU, PHASE, WINDOWS, SECONDS, SHARE, ENERGY_J]


def contract(phases: pa.Table) -> pa.Table:
    """A phases table in PHASES_SCHEMA's types (triage holds host and phase as dictionaries until then), its
    metadata kept."""
    if phases.schema.equals(PHASES_SCHEMA):
        return phases
    return phases.cast(PHASES_SCHEMA.with_metadata(phases.schema.metadata))


def phase_codes(phases: pa.Table) -> np.ndarray:
    """The index into LABELS of every row's phase (-1: null or not a label)."""
    return _codes(phases.column(PHASE), list(LABELS))[1]


def write_phases(
    phases: pa.Table,
    path: Path,
    window_s: float,
    gpu_model: str | None,
    levels: dict | None = None,
    filled_s: float = 0.0,
) -> None:
    """phases.parquet, with the window length, the table's GPU model, the levels learned per GPU and the
    seconds of short gaps filled in its metadata."""
    meta = {
        b"wattgate.phases": strict_json(
            {
                "format_version": FORMAT_VERSION,
                "window_s": window_s,
                "gpu_model": gpu_model,
                "levels": levels or {},
                "filled_s": round(float(filled_s), 6),
            },
            sort_keys=True,
        ).encode()
    }
    # dictionary pages only where they pay (host and phase), the floats' bytes split by significance (a day's
    # window starts and ends then compress to a fifth), LZ4 (decodes in half snappy's time), no statistics: a
    # day of 16 GPUs (1.4M windows) writes in 0.06 s, reads in 0.02 s and takes 9 MB instead of 22
    with atomic_path(path) as tmp:
        pq.write_table(
            contract(phases).replace_schema_metadata(meta),
            tmp,
            compression="lz4_raw",
            use_dictionary=[HOST, PHASE],
            column_encoding={name: "BYTE_STREAM_SPLIT" for name in (START, END, POWER_W, UTIL_GPU, CONFIDENCE)},
            write_statistics=False,
        )


def read_phases(
    path: str | Path, columns: list[str] | None = None, dictionary: bool = False
) -> tuple[pa.Table, float, str | None, float] | None:
    """(phases, window_s, gpu_model, deadlock_after_s) of a phases.parquet (settings from its metadata, else
    the triage.json beside it, else the defaults); None if the file does not exist. `columns`: read only
    these; `dictionary`: host and phase stay dictionary-encoded (a reader that groups them saves decoding a
    day's 1.4M windows to strings)."""
    path = Path(path)
    if not path.is_file():
        return None
    names = list(columns or PHASES_SCHEMA.names)
    try:
        with pq.ParquetFile(path, read_dictionary=[HOST, PHASE] if dictionary else None) as f:
            missing = [n for n in PHASES_SCHEMA.names if n not in f.schema_arrow.names]
            table = None if missing else f.read(columns=names)
    except (OSError, pa.ArrowInvalid) as exc:
        raise InputError(f"{path}: not a readable phases table ({exc})") from None
    if missing:
        raise InputError(f"{path}: not a phases table: missing column(s) {', '.join(missing)}")
    assert table is not None  # read whenever no column was missing
    meta = _metadata(path, table.schema.metadata)
    record_path = path.parent / "triage.json"
    record = _read_json(record_path)
    # `is None`, never `or`: a damaged 0 is refused, not read as the default
    window_s = _setting(("window_s", path, meta), ("window_s", record_path, record), default=DEFAULT_WINDOW_S)
    deadlock_after_s = _setting(("deadlock_after_s", record_path, record), default=DEFAULT_DEADLOCK_AFTER_S)
    model = _model(path, meta, record)
    cast = [_column(path, n, c, dictionary) for n, c in zip(names, table.columns)]
    return pa.Table.from_arrays(cast, names=names, metadata=table.schema.metadata), window_s, model, deadlock_after_s


def _metadata(path: Path, schema_meta: dict | None) -> dict:
    """phases.parquet's wattgate.phases metadata ({} if none)."""
    raw = (schema_meta or {}).get(b"wattgate.phases")
    if raw is None:
        return {}
    try:
        meta = json.loads(raw)
    except ValueError as exc:
        raise InputError(f"{path}: metadata wattgate.phases is not JSON ({exc}); run `wattgate triage` again") from None
    if not isinstance(meta, dict):
        raise InputError(f"{path}: metadata wattgate.phases is not a JSON object; run `wattgate triage` again")
    return meta


def _setting(*places: tuple[str, Path, dict], default: float) -> float:
    """The first of the places (key, file, mapping) that holds key, checked (finite, > 0); else the default."""
    for key, where, mapping in places:
        if mapping.get(key) is not None:
            return (window_seconds if key == "window_s" else positive_seconds)(mapping[key], f"{where}: {key}")
    return default


def _model(path: Path, meta: dict, record: dict) -> str | None:
    """The table's GPU model: the metadata's, else triage.json's table.gpu_model (a string or nothing)."""
    table = record.get("table")
    model = meta.get("gpu_model") or (table.get("gpu_model") if isinstance(table, dict) else None)
    if model is not None and not isinstance(model, str):
        raise InputError(f"{path}: gpu_model must be a string (got {model!r}); run `wattgate triage` again")
    return model


def _column(path: Path, name: str, col: pa.ChunkedArray, dictionary: bool) -> pa.ChunkedArray:
    """A phases column in PHASES_SCHEMA's type (a dictionary one kept as read when `dictionary`)."""
    if dictionary and pa.types.is_dictionary(col.type):
        return col
    try:
        return col.cast(PHASES_SCHEMA.field(name).type)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as exc:
        raise InputError(
            f"{path}: column {name!r} is {col.type}, not {PHASES_SCHEMA.field(name).type} "
            f"({str(exc).splitlines()[0]}); run `wattgate triage` again"
        ) from None


def phases_meta(phases: pa.Table, strict: bool = False) -> PhasesMeta:
    """What triage learned, from a phases table's metadata (nothing learned if none, or if it is damaged, unless
    `strict`: triage reading its own): levels per GPU and filled_s, from phases.parquet (wattgate.phases) or from
    triage() run in process (wattgate.triage, with the stragglers and the lag)."""
    meta = phases.schema.metadata or {}
    for key in (b"wattgate.phases", b"wattgate.triage"):
        if key in meta:
            try:
                return PhasesMeta.from_json(json.loads(meta[key]), Where(f"phases metadata {key.decode()}"))
            except (ValueError, InputError):
                if strict:
                    raise
                return PhasesMeta()
    return PhasesMeta()


def gap_summary(phases: pa.Table, window_s: float, filled_s: float = 0.0) -> Gaps:
    """Telemetry gaps: seconds of unknown windows over all GPUs, how many gaps (runs of unknown windows on a
    GPU) and the longest, and the seconds of short gaps that took the phase around them."""
    if phases.num_rows == 0:
        return Gaps(unknown_s=0.0, unknown_gaps=0, longest_gap_s=0.0, filled_s=round(filled_s, 6))
    names, host = _codes(phases.column(HOST))
    gpu = phases.column(GPU).to_numpy(zero_copy_only=False).astype(np.int64)
    start = phases.column(START).to_numpy(zero_copy_only=False).astype(np.float64)
    unknown = _codes(phases.column(PHASE), list(LABELS))[1] == UNKNOWN
    gpu_key = _gpu_key(names, host, gpu)
    order = _sorted_by(gpu_key, start)
    if order is not None:
        unknown, gpu_key, start = unknown[order], gpu_key[order], start[order]
    new = unknown.copy()
    new[1:] &= ~(unknown[:-1] & (gpu_key[1:] == gpu_key[:-1]) & np.isclose(start[1:] - start[:-1], window_s))
    run_id = np.cumsum(new)[unknown]
    lengths = np.bincount(run_id)[1:] * window_s if unknown.any() else np.zeros(0)
    return Gaps(
        unknown_s=round(float(unknown.sum() * window_s), 6),
        unknown_gaps=len(lengths),
        longest_gap_s=round(float(lengths.max()), 6) if len(lengths) else 0.0,
        filled_s=round(float(filled_s), 6),
    )


def peer_departures(phases: pa.Table, window_s: float, min_s: float = 10.0) -> Peers:
    """GPUs doing something other than their peers: in each window (matched by time over every GPU of the
    input), the label that at least half of the GPUs and two share is the peers' phase; a GPU with another
    known label there departs. GPUs departing for at least `min_s` are listed with what they read instead."""
    if phases.num_rows == 0:
        return Peers(windows_compared=0, agree_share=None, departures=())
    code = _codes(phases.column(PHASE), list(LABELS))[1]
    idx = np.rint(phases.column(START).to_numpy(zero_copy_only=False) / window_s).astype(np.int64)
    lo, span = int(idx.min()), int(idx.max()) - int(idx.min()) + 1
    if span <= 4 * len(idx) + (1 << 20):  # GPUs over the same hours: windows by offset, no sort
        grp = idx - lo
        uniq = np.flatnonzero(np.bincount(grp, minlength=span))
        if len(uniq) < span:
            lut = np.zeros(span, np.int64)
            lut[uniq] = np.arange(len(uniq))
            grp = lut[grp]
    else:
        uniq, grp = np.unique(idx, return_inverse=True)
    nl = len(LABELS)
    known = code != UNKNOWN
    votes = np.bincount(grp[known] * nl + code[known], minlength=len(uniq) * nl).reshape(len(uniq), nl)
    present = votes.sum(axis=1)
    modal, top = votes.argmax(axis=1), votes.max(axis=1)
    settled = (present >= 2) & (top >= 2) & (2 * top >= present)
    compared = known & settled[grp]
    departs = compared & (code != modal[grp])
    windows_compared = int(compared.sum())
    agree_share = round(1.0 - float(departs.sum()) / max(int(compared.sum()), 1), 6)
    if not departs.any():
        return Peers(windows_compared=windows_compared, agree_share=agree_share, departures=())
    rows = np.flatnonzero(departs)
    sel = phases.select([HOST, GPU, PHASE]).take(pa.array(rows)).to_pandas()
    who = (sel[HOST].astype(str) + ":" + sel[GPU].astype(str)).to_numpy()
    read, peers = sel[PHASE].to_numpy(), np.asarray(LABELS, dtype=object)[modal[grp[departs]]]
    d = pd.DataFrame({"who": who, "read": read, "peers": peers})
    departures = []
    for who, rows in d.groupby("who", sort=True):
        gpu = str(who)  # the "host:gpu" strings built above
        seconds = len(rows) * window_s
        if seconds >= min_s:
            pairs = rows.groupby(["read", "peers"]).size().sort_values(ascending=False)
            read_vs_peers = tuple(
                ReadVsPeers(phase=r, peers=p, seconds=round(n * window_s, 6))
                # the (read, peers) labels of the two-column groupby's index
                for (r, p), n in cast("Iterable[tuple[tuple[str, str], int]]", pairs.items())
            )
            departures.append(Departure(gpu=gpu, seconds=round(seconds, 6), read_vs_peers=read_vs_peers))
    departures.sort(key=lambda x: -x.seconds)
    return Peers(windows_compared=windows_compared, agree_share=agree_share, departures=tuple(departures))


def _codes(col, categories: list[str] | None = None) -> tuple[list, np.ndarray]:
    """(values, code per row) of a string (or dictionary) column, null -> code -1; with categories, the
    codes index them (a value not among them -> -1), as pandas.Categorical's codes."""
    values, codes = column_codes(col)
    names = categories if categories is not None else [v for v in values if v is not None]
    where = {v: i for i, v in enumerate(names)}
    lut = np.array([-1 if v is None else where.get(v, -1) for v in values] or [-1], np.int64)
    return names, lut[codes]


def _gpu_key(names: list, host: np.ndarray, gpu: np.ndarray) -> np.ndarray:
    """An integer per (host, gpu) ordered as (host name, gpu) sort."""
    rank = np.empty(len(names) + 1, np.int64)
    rank[sorted(range(len(names)), key=lambda i: str(names[i]))] = np.arange(len(names))
    rank[-1] = len(names)  # a null host (code -1) sorts last, as pandas sorts a missing value
    lo, hi = (int(gpu.min()), int(gpu.max())) if len(gpu) else (0, 0)
    return rank[host] * (hi - lo + 1) + (gpu - lo)


def _sorted_by(key: np.ndarray, start: np.ndarray) -> np.ndarray | None:
    """The stable order by (key, start), None when the rows already are in it (triage writes them so)."""
    dk, ds = np.diff(key), np.diff(start)
    if bool(np.all((dk > 0) | ((dk == 0) & (ds >= 0)))):
        return None
    return np.lexsort((start, key))


def _read_json(path: Path) -> dict:
    """triage.json as a dict ({} if it does not exist)."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise InputError(f"{path}: not readable JSON ({exc})") from None
    if not isinstance(data, dict):
        raise InputError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def phase_summary(phases: pa.Table | pd.DataFrame) -> pd.DataFrame:
    """Per (host, gpu, phase), sorted by them: windows, seconds, share of that GPU's time, energy_j (mean
    power x duration). Rows without a host or phase are left out."""
    columns = SUMMARY_COLUMNS
    table = pa.Table.from_pandas(phases, preserve_index=False) if isinstance(phases, pd.DataFrame) else phases
    if table.num_rows == 0:
        return pd.DataFrame(
            {
                c: pd.Series(dtype=t)
                for c, t in zip(columns, ["object", "int32", "object", "int64", "float64", "float64", "float64"])
            }
        )
    hosts, host = _codes(table.column(HOST))
    names, phase = _codes(table.column(PHASE))
    gpu = table.column(GPU).to_numpy(zero_copy_only=False).astype(np.int64)
    keep = (host >= 0) & (phase >= 0)
    if not keep.all():
        table, host, phase, gpu = table.filter(pa.array(keep)), host[keep], phase[keep], gpu[keep]
    if table.num_rows == 0:
        return phase_summary(table)
    # one small integer per (host, gpu, phase), in their sort order (host name, gpu, phase name)
    host_order = sorted(range(len(hosts)), key=lambda i: str(hosts[i]))
    phase_order = sorted(range(len(names)), key=lambda i: str(names[i]))
    host_rank, phase_rank = np.empty(len(hosts), np.int64), np.empty(len(names), np.int64)
    host_rank[host_order], phase_rank[phase_order] = np.arange(len(hosts)), np.arange(len(names))
    lo = int(gpu.min())
    width = int(gpu.max()) - lo + 1
    key = (host_rank[host] * width + (gpu - lo)) * len(names) + phase_rank[phase]
    start = table.column(START).to_numpy(zero_copy_only=False)
    seconds = table.column(END).to_numpy(zero_copy_only=False) - start
    energy = table.column(POWER_W).to_numpy(zero_copy_only=False).astype(np.float64) * seconds
    energy[np.isnan(energy)] = 0.0
    size = len(hosts) * width * len(names)
    windows = np.bincount(key, minlength=size)
    groups = np.flatnonzero(windows)
    secs = np.bincount(key, weights=seconds, minlength=size)[groups]
    joules = np.bincount(key, weights=energy, minlength=size)[groups]
    per_gpu = groups // len(names)
    gpu_secs = np.bincount(per_gpu, weights=secs)
    return pd.DataFrame(
        {
            HOST: np.asarray([hosts[i] for i in host_order], dtype=object)[per_gpu // width],
            GPU: (per_gpu % width + lo).astype(np.int32),
            PHASE: np.asarray([names[i] for i in phase_order], dtype=object)[groups % len(names)],
            WINDOWS: windows[groups].astype(np.int64),
            SECONDS: secs,
            SHARE: secs / gpu_secs[per_gpu],
            ENERGY_J: joules,
        },
        columns=columns,
    )


def totals(summary: pd.DataFrame) -> dict:
    if summary.empty:
        return {}
    t = summary.groupby(PHASE).agg(windows=(WINDOWS, "sum"), seconds=(SECONDS, "sum"), energy_j=(ENERGY_J, "sum"))
    total = float(t[SECONDS].sum())
    return {
        ph: {
            "windows": int(r.windows),
            "seconds": round(float(r.seconds), 6),
            "share": round(float(r.seconds) / total, 6) if total else 0.0,
            "energy_j": round(float(r.energy_j), 3),
        }
        for ph, r in t.iterrows()
    }
