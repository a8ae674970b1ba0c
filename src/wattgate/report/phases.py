"""Phase windows as arrays: time and energy per phase (per GPU, per node, overall) and runs of a phase."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from wattgate.codes import column_codes
from wattgate.power.triage.phases import END, GPU, HOST, LABELS, PHASE, POWER_W, START

PHASE_COLORS = {
    "compute": "#2ca02c",
    "communication": "#1f77b4",
    "data_starvation": "#ff7f0e",
    "checkpoint": "#9467bd",
    "deadlock": "#d62728",
    "idle": "#8c8c8c",
    "unknown": "#e0e0e0",
}


@dataclass
class PhaseWindows:
    keys: list[tuple[str, int]]  # (host, gpu), sorted
    gid: np.ndarray  # index into keys per window, non-decreasing
    start: np.ndarray
    end: np.ndarray
    code: np.ndarray  # index into LABELS
    power: np.ndarray  # window mean W, NaN where unknown

    @cached_property  # totals, the summary and the figures each ask for it
    def seconds(self) -> np.ndarray:
        return self.end - self.start

    @cached_property
    def energy_j(self) -> np.ndarray:
        joules = self.power * self.seconds
        return joules if np.isfinite(joules).all() else np.nan_to_num(joules, copy=False)

    def __len__(self) -> int:
        return len(self.start)


def _codes(column: pa.ChunkedArray, names: list[str] | None = None) -> tuple[np.ndarray, list[str]]:
    """Integer codes of a string or dictionary column (null as ""), indexing `names`: by default the sorted
    values found; when given, a value not among them takes the last name."""
    values, codes = column_codes(column)
    text = ["" if v is None else str(v) for v in values]
    found = sorted(set(text))
    if names is None:
        names = found
    where = {x: names.index(x) if x in names else len(names) - 1 for x in found}
    return np.array([where[x] for x in text] or [0], np.int64)[codes], names


def _floats(column: pa.ChunkedArray) -> np.ndarray:
    """float64, null -> NaN."""
    if column.null_count:
        return pc.fill_null(column.cast(pa.float64()), np.nan).to_numpy()
    return column.to_numpy().astype(np.float64, copy=False)


def phase_windows(table: pa.Table) -> PhaseWindows:
    """Arrays of a phases table, ordered by (host, gpu, start) whatever the file's row order.

    A day of 16 GPUs is 1.4M windows: in a fresh process every new array of them costs its page faults
    (more than the arithmetic), so the host codes become the keys and then the GPU indices in place."""
    if table is None or table.num_rows == 0:
        e = np.zeros(0)
        return PhaseWindows([], np.zeros(0, np.int64), e, e, np.zeros(0, np.int64), e)
    key, hosts = _codes(table.column(HOST))
    code, _ = _codes(table.column(PHASE), list(LABELS))
    gpu = table.column(GPU).to_numpy()
    if gpu.dtype.kind not in "iu":
        gpu = gpu.astype(np.int64)
    start, end = _floats(table.column(START)), _floats(table.column(END))
    power = _floats(table.column(POWER_W))
    width = int(gpu.max()) + 1
    key *= width
    key += gpu
    if len(hosts) * width <= 1 << 20 and gpu.min() >= 0:  # small keys: a lookup table, not np.unique's sort
        present = np.flatnonzero(np.bincount(key, minlength=len(hosts) * width))
        lut = np.zeros(len(hosts) * width, np.int64)
        lut[present] = np.arange(len(present))
        gid = np.take(lut, key, out=key, mode="clip")  # element by element: each key is read before its slot is written
    else:
        present, gid = np.unique(key, return_inverse=True)
        gid = gid.reshape(-1)
    if len(gid) > 1 and not np.all((gid[1:] > gid[:-1]) | ((gid[1:] == gid[:-1]) & (start[1:] >= start[:-1]))):
        order = np.lexsort((start, gid))
        gid, start, end, code, power = gid[order], start[order], end[order], code[order], power[order]
    keys = [(hosts[k // width], int(k % width)) for k in present]
    return PhaseWindows(keys, gid, start, end, code, power)


def totals(w: PhaseWindows, group: np.ndarray, ngroups: int) -> tuple[np.ndarray, np.ndarray]:
    """(seconds, energy J) per (group, phase), shape (ngroups, len(LABELS))."""
    nl = len(LABELS)
    idx = group * nl
    idx += w.code
    secs = np.bincount(idx, weights=w.seconds, minlength=ngroups * nl).reshape(ngroups, nl)
    joules = np.bincount(idx, weights=w.energy_j, minlength=ngroups * nl).reshape(ngroups, nl)
    return secs, joules


def runs(w: PhaseWindows, phase: str, max_gap_s: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(gid, start, end) of runs of `phase` windows on each GPU; gaps up to max_gap_s (unknown windows,
    a blip of another phase) do not split a run."""
    idx = np.flatnonzero(w.code == LABELS.index(phase))
    if len(idx) == 0:
        return np.zeros(0, np.int64), np.zeros(0), np.zeros(0)
    g, s, e = w.gid[idx], w.start[idx], w.end[idx]
    new = np.ones(len(idx), bool)
    new[1:] = (g[1:] != g[:-1]) | (s[1:] - e[:-1] > max_gap_s + 1e-9)
    first = np.flatnonzero(new)
    last = np.append(first[1:] - 1, len(idx) - 1)
    return g[first], s[first], e[last]
