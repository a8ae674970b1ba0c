"""Energy per GPU: the NVML energy counter where the trace has it, else integrated power.

Computed once, by triage (run_triage writes it into triage.json as "energy"), from
the samples it already holds; the report computes it from the traces when it has
no such record (power-only reports, other traces).

The sampler reads the counter only every ~10 s (each read costs milliseconds
of CPU), so most rows carry no reading. Per GPU the counter gives the energy
between its first and last reading; the seconds before the first and after
the last reading are integrated from power so that both methods cover the
GPU's whole trace and can be compared.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

COUNTER = "energy_counter"
INTEGRATED = "integrated_power"


class GpuSeries(Protocol):
    """One GPU's samples in time order (report.inputs.GpuSeries is one)."""

    host: str
    gpu: int
    time: np.ndarray  # float64
    power: np.ndarray  # NaN = missing
    energy_pos: np.ndarray  # positions (into time/power) of samples with an energy reading
    energy_j: np.ndarray  # the readings at those positions


@dataclass
class Series:
    """A GpuSeries of triage's (split_samples)."""

    host: str
    gpu: int
    time: np.ndarray
    power: np.ndarray
    energy_pos: np.ndarray
    energy_j: np.ndarray


@dataclass
class SeriesSet:
    """Every GPU's series, sorted by (host, gpu) (report.inputs.Samples is one)."""

    series: list

    @property
    def keys(self) -> list[tuple[str, int]]:
        return [(s.host, s.gpu) for s in self.series]


@dataclass
class GpuEnergy:
    keys: list[tuple[str, int]]
    first: np.ndarray  # first sample time per GPU
    last: np.ndarray  # last sample time per GPU
    integrated_j: np.ndarray  # trapezoid over the GPU's power samples
    counter_j: np.ndarray  # counter delta plus integrated edges; NaN where the counter is unusable

    @property
    def joules(self) -> np.ndarray:
        return np.where(np.isnan(self.counter_j), self.integrated_j, self.counter_j)

    @property
    def methods(self) -> list[str]:
        return [INTEGRATED if np.isnan(c) else COUNTER for c in self.counter_j]

    @property
    def method(self) -> str | None:
        found = set(self.methods)
        if not found:
            return None
        return found.pop() if len(found) == 1 else "mixed"


def trapezoids(t: np.ndarray, p: np.ndarray) -> np.ndarray:
    """Energy of each interval between consecutive samples with power (J); NaN samples are skipped over."""
    p = np.asarray(p, np.float64)
    ok = np.isfinite(p)
    if not ok.all():
        t, p = t[ok], p[ok]
    if len(t) < 2:
        return np.zeros(0)
    return np.diff(t) * (p[1:] + p[:-1]) * 0.5


def series_energy(s: GpuSeries) -> tuple[float, float]:
    """(integrated J, counter J or NaN) of one GPU."""
    pieces = trapezoids(s.time, s.power)
    integrated = float(pieces.sum())
    if len(s.energy_pos) < 2:
        return integrated, np.nan
    delta = float(s.energy_j[-1] - s.energy_j[0])
    i0, i1 = int(s.energy_pos[0]), int(s.energy_pos[-1])
    if not delta > 0 or s.time[i1] <= s.time[i0]:
        return integrated, np.nan  # a counter reset or one instant: integrate instead
    # integral between the two readings; pieces index the intervals after each (finite-power) sample
    ok = np.isfinite(s.power)
    if ok.all():
        a, b = i0, i1
    else:
        before = np.cumsum(ok)  # finite samples up to and including each position
        a, b = max(int(before[i0]) - 1, 0), max(int(before[i1]) - 1, 0)
    between = float(pieces[a:b].sum())
    return integrated, delta + integrated - between


def gpu_energy(samples) -> GpuEnergy:
    """Per GPU of `samples` (.series of GpuSeries in (host, gpu) order, .keys)."""
    n = len(samples.series)
    first, last = np.zeros(n), np.zeros(n)
    integrated, counter = np.zeros(n), np.full(n, np.nan)
    for k, s in enumerate(samples.series):
        first[k], last[k] = (s.time[0], s.time[-1]) if len(s.time) else (np.nan, np.nan)
        integrated[k], counter[k] = series_energy(s)
    return GpuEnergy(samples.keys, first, last, integrated, counter)


def records(energy: GpuEnergy, readings: list[int] | None = None) -> dict:
    """triage.json's "energy": "host:gpu" -> first, last (sample times), integrated_j, counter_j (null where
    the counter is unusable), energy_j and method (what the report uses), readings (counter readings)."""

    def num(x):
        return None if not np.isfinite(x) else float(x)

    out = {}
    for k, ((h, g), a, b, i, c, j, m) in enumerate(
        zip(
            energy.keys, energy.first, energy.last, energy.integrated_j, energy.counter_j, energy.joules, energy.methods
        )
    ):
        out[f"{h}:{g}"] = {
            "first": num(a),
            "last": num(b),
            "integrated_j": num(i),
            "counter_j": num(c),
            "energy_j": num(j),
            "method": m,
            "readings": int(readings[k]) if readings else 0,
        }
    return out


# ---------------------------------------------------------------- triage's samples split by GPU


def in_time_order(t: np.ndarray, p: np.ndarray, pos: np.ndarray, e: np.ndarray) -> tuple[np.ndarray, ...]:
    """A GPU's samples (and its readings' positions) sorted by time, stably; as they are when already so."""
    if len(t) < 2 or not np.any(t[1:] < t[:-1]):
        return t, p, pos, e
    order = np.argsort(t, kind="stable")
    rank = np.empty(len(order), np.int64)
    rank[order] = np.arange(len(order))
    new_pos = rank[pos]
    by = np.argsort(new_pos, kind="stable")
    return t[order], p[order], new_pos[by], e[by]


def _part_series(keys, gid, time_, power, valid, readings) -> list[Series]:
    """One file's rows (all with a GPU and a finite time; gid: index into keys, (host, gpu) sorted) split by
    GPU in file order: strided views when rows cycle through the GPUs (the sampler reads every GPU each
    tick), else a stable sort."""
    if len(gid) == 0:
        return []
    present = np.flatnonzero(np.bincount(gid, minlength=len(keys)))
    groups = [keys[k] for k in present]
    pos = np.flatnonzero(valid) if valid is not None else np.zeros(0, np.int64)
    k = len(present)
    out = []
    if len(gid) % k == 0 and bool((gid[:k] == present).all()) and bool((gid.reshape(-1, k) == gid[:k]).all()):
        for j, (h, g) in enumerate(groups):
            mine = pos % k == j
            parts = (time_[j::k], power[j::k], pos[mine] // k, readings[mine] if valid is not None else np.zeros(0))
            out.append(Series(h, g, *in_time_order(*parts)))
        return out
    # each GPU's rows in file order (what a stable sort by GPU gives), one GPU at a time: small arrays only
    for j, (h, g) in enumerate(groups):
        rows = np.flatnonzero(gid == present[j])
        if valid is not None:  # the readings of this GPU, at their positions in its rows
            mine = np.flatnonzero(gid[pos] == present[j])
            epos, evals = np.searchsorted(rows, pos[mine]), readings[mine]
        else:
            epos, evals = np.zeros(0, np.int64), np.zeros(0)
        out.append(Series(h, g, *in_time_order(time_[rows], power[rows], epos, evals)))
    return out


def split_samples(
    keys: list[tuple[str, int]],
    gid: np.ndarray,
    time_: np.ndarray,
    power: np.ndarray,
    valid: np.ndarray | None,
    readings: np.ndarray | None,
    file_rows: list[int],
) -> SeriesSet:
    """Every GPU's samples in time order, sorted by (host, gpu), from the rows of one or more files laid end
    to end (file_rows rows each; gid: each row's index into keys, the (host, gpu) sorted; valid: the rows
    with an energy reading, readings: those readings in row order). A GPU found in two files (a restarted
    sampler) is joined in time order."""
    by_key: dict[tuple[str, int], list[Series]] = {}
    a = r = 0
    for n in file_rows:
        v = valid[a : a + n] if valid is not None else None
        nr = int(np.count_nonzero(v)) if v is not None else 0
        sl = slice(a, a + n)
        for s in _part_series(
            keys, gid[sl], time_[sl], power[sl], v if nr else None, readings[r : r + nr] if nr else None
        ):
            by_key.setdefault((s.host, s.gpu), []).append(s)
        a, r = a + n, r + nr
    return SeriesSet(join_parts(by_key, Series))


def join_parts(by_key: dict, make) -> list:
    """One series per (host, gpu), in key order: a GPU found in several files (a restarted sampler) is joined in
    time order. `make(host, gpu, time, power, energy_pos, energy_j)` builds the series (report or energy type)."""
    series = []
    for key in sorted(by_key):
        parts = by_key[key]
        if len(parts) == 1:
            series.append(parts[0])
            continue
        offsets = np.cumsum([0] + [len(p.time) for p in parts[:-1]])
        series.append(
            make(
                key[0],
                key[1],
                *in_time_order(
                    np.concatenate([p.time for p in parts]),
                    np.concatenate([p.power for p in parts]),
                    np.concatenate([p.energy_pos + o for p, o in zip(parts, offsets)]),
                    np.concatenate([p.energy_j for p in parts]),
                ),
            )
        )
    return series
