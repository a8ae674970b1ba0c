"""Energy per GPU: the NVML energy counter where the trace has it, else integrated power.

The sampler reads the counter only every ~10 s (each read costs milliseconds
of CPU), so most rows carry no reading. Per GPU the counter gives the energy
between its first and last reading; the seconds before the first and after
the last reading are integrated from power so that both methods cover the
GPU's whole trace and can be compared.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from wattgate.report.inputs import GpuSeries, Samples

COUNTER = "energy_counter"
INTEGRATED = "integrated_power"


@dataclass
class GpuEnergy:
    keys: list[tuple[str, int]]
    first: np.ndarray         # first sample time per GPU
    last: np.ndarray          # last sample time per GPU
    integrated_j: np.ndarray  # trapezoid over the GPU's power samples
    counter_j: np.ndarray     # counter delta plus integrated edges; NaN where the counter is unusable

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


def gpu_energy(samples: Samples) -> GpuEnergy:
    n = len(samples.series)
    first, last = np.zeros(n), np.zeros(n)
    integrated, counter = np.zeros(n), np.full(n, np.nan)
    for k, s in enumerate(samples.series):
        first[k], last[k] = (s.time[0], s.time[-1]) if len(s.time) else (np.nan, np.nan)
        integrated[k], counter[k] = series_energy(s)
    return GpuEnergy(samples.keys, first, last, integrated, counter)
