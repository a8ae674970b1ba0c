"""The watcher's straggler warning: which rank the others keep waiting for, live, once per rank, never a kill.

Each poll is an interval. Per rank in it, how busy it was: with power data, the share of its GPU's samples at
or above the triage table's low-band top (working, not waiting in a collective); without, for the ranks on the
watcher's host, the CPU time its process used per second (a rank blocked in a gloo collective uses ~0 of a
core, a computing one ~1: bench/watch_cpu_signal.py). An interval counts only while every rank with a reading
is in the same phase of `train` or `eval` within one step of the others (out of step is the hang rules' to
judge). As in triage (power/triage/stragglers.py): an interval is a **wait** when some rank was busy and at
least half of the others were busy MARGIN less; its **last** rank is the busiest when every other rank was
busy MARGIN less. When, over the last WINDOW_S, one rank was last in most of the waits (more than half), in at
least MIN_INTERVALS of them and in DOMINANCE times as many as the median other rank, the watcher warns once
for that rank: a line in train.log (`watch: warning: straggler: ...`) and an entry in watcher.json
`stragglers`, whose counts then cover the whole run. The cause: the GPU's clocks-event reasons where the trace
has them (thermal, power_cap, hw_slowdown), rank 0's own work, else unknown (triage, after the run, also reads
the SM clock, temperature, power limit and data wait).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Literal, cast

import numpy as np

from wattgate.records.heartbeat import Beat
from wattgate.records.watcher import Straggler
from wattgate.trace import REASON_CAUSES

WINDOW_S = 30.0
MIN_INTERVALS = 5
DOMINANCE = 3.0
MARGIN = {"power": 0.15, "cpu": 0.25}  # of the interval's samples; of a core
LEAST = {"power": 0.15, "cpu": 0.3}  # the last rank's own reading: it worked
MIN_INTERVAL_S = 0.2
Signal = Literal["power", "cpu"]
Cause = Literal["thermal", "power_cap", "hw_slowdown", "rank0_work", "unknown"]  # Straggler.cause
CAUSE_WORDS = {"thermal": "thermal slowdown", "power_cap": "SW power cap", "hw_slowdown": "HW slowdown / power brake"}


@dataclass
class _Interval:
    end: float
    seconds: float
    signal: Signal
    busy: dict[int, float]
    last: int | None  # the rank the others waited for, None when the wait had no single last rank
    waited: bool
    wait_s: float  # rank-seconds the others spent waiting (busy share below the last's x seconds)
    reasons: dict[int, np.ndarray] = field(default_factory=dict)  # rank -> counts [reading, thermal, power, hw]


@dataclass
class _Totals:
    waits: int = 0
    last: dict[int, int] = field(default_factory=dict)
    wait_s: dict[int, float] = field(default_factory=dict)
    first: dict[int, float] = field(default_factory=dict)
    final: dict[int, float] = field(default_factory=dict)


class LagWatch:
    """Interval by interval, who the ranks waited for; `observe` returns a new warning's record (once per rank)."""

    def __init__(self, low_max_w: float | None, window_s: float = WINDOW_S):
        self.low_max_w = low_max_w
        self.window_s = window_s
        self.recent: deque[_Interval] = deque()
        self.totals = {"power": _Totals(), "cpu": _Totals()}
        self.warned: dict[int, Straggler] = {}
        self.last_poll: float | None = None

    def observe(self, beats: dict[int, Beat], now: float, cpu: dict[int, tuple], tail=None) -> Straggler | None:
        """One poll: `cpu` is the ActivityMeter's samples (rank -> (pid, [(time, cpu s, io, state), ...])), `tail`
        the TraceTail. Returns the record of a straggler first seen now, else None."""
        since, self.last_poll = self.last_poll, now
        if since is None or now - since < MIN_INTERVAL_S or not _in_step(beats):
            return None
        busy, signal, reasons = self._power(beats, since, now, tail)
        if len(busy) < 2:
            busy, signal, reasons = _cpu_shares(cpu, since, now), "cpu", {}
        if len(busy) < 2:
            return None
        iv = _attribute(busy, signal, now, now - since, reasons)
        self.recent.append(iv)
        while self.recent and self.recent[0].end < now - self.window_s:
            self.recent.popleft()
        t = self.totals[signal]
        if iv.waited:
            t.waits += 1
        if iv.last is not None:
            r = iv.last
            t.last[r] = t.last.get(r, 0) + 1
            t.wait_s[r] = t.wait_s.get(r, 0.0) + iv.wait_s
            t.first.setdefault(r, now - iv.seconds)
            t.final[r] = now
        return self._new_warning(beats, now)

    def _power(self, beats, since, now, tail) -> tuple[dict[int, float], Signal, dict]:
        if tail is None or self.low_max_w is None or not tail.chunks:
            return {}, "power", {}
        shares = tail.busy_shares(since, now, self.low_max_w)
        out, reasons = {}, {}
        for r, b in beats.items():
            key = (b.host, int(b.local_rank or 0))
            if key in shares:
                out[r], reasons[r] = shares[key]
        return out, "power", reasons

    def _new_warning(self, beats: dict[int, Beat], now: float) -> Straggler | None:
        waits = [iv for iv in self.recent if iv.waited]
        if not waits:
            return None
        counts: dict[int, int] = {}
        for iv in waits:
            if iv.last is not None:
                counts[iv.last] = counts.get(iv.last, 0) + 1
        ranks = sorted({r for iv in waits for r in iv.busy})
        for r, n in sorted(counts.items(), key=lambda x: -x[1]):
            if r in self.warned:
                continue
            others = [counts.get(o, 0) for o in ranks if o != r]
            if (
                n >= MIN_INTERVALS
                and 2 * n > len(waits)
                and n >= DOMINANCE * (float(np.median(others)) if others else 0)
            ):
                mine = [iv for iv in waits if iv.last == r]
                self.warned[r] = self._record(r, beats.get(r), mine, len(waits), now)
                return self.warned[r]
        return None

    def _record(self, rank: int, beat: Beat | None, mine: list[_Interval], waits: int, now: float) -> Straggler:
        signal = mine[-1].signal
        me = float(np.mean([iv.busy[rank] for iv in mine]))
        peers = float(np.median([v for iv in mine for r, v in iv.busy.items() if r != rank]))
        if signal == "cpu":
            seen = f"its process used {me:.2f} of a core while the others used {peers:.2f} (blocked in collectives)"
        else:
            seen = f"its GPU busy {100 * me:.0f}% of the time while the others' were {100 * peers:.0f}% (waiting)"
        cause, why = _cause(rank, mine)
        share = len(mine) / waits
        evidence = (
            f"last in {len(mine)} of the {waits} polls in the last {self.window_s:.0f} s in which the other ranks "
            f"waited ({100 * share:.0f}%): {seen}; {why}"
        )
        return Straggler(
            rank=rank,
            host=beat.host if beat else None,
            gpu=((beat.local_rank if beat else None) or 0) if signal == "power" else None,
            signal=signal,
            detected_at=now,
            step=beat.step if beat else None,
            cause=cause,
            evidence=evidence,
            window_s=self.window_s,
        )

    def records(self) -> tuple[Straggler, ...]:
        """watcher.json's `stragglers`: each warned rank with its counts over the whole run so far."""
        out = []
        for rank, rec in sorted(self.warned.items()):
            t = self.totals[rec.signal]
            hours = t.wait_s.get(rank, 0.0) / 3600.0
            out.append(
                rec.replace(
                    lag_share=round(t.last.get(rank, 0) / max(t.waits, 1), 4),
                    lag_windows=t.last.get(rank, 0),
                    wait_windows=t.waits,
                    wait_gpu_hours=round(hours, 6) if rec.signal == "power" else None,
                    wait_rank_hours=round(hours, 6) if rec.signal == "cpu" else None,
                    wait_kwh=None,
                    first=round(t.first.get(rank, rec.detected_at), 3),
                    last=round(t.final.get(rank, rec.detected_at), 3),
                )
            )
        return tuple(out)


def warning_line(rec: Straggler) -> str:
    return (
        f"straggler: rank {rec.rank} ({rec.where}) is the one the others wait for, cause {rec.cause}: "
        f"{rec.evidence}; a straggler never stops the job (watcher.json stragglers)"
    )


def _in_step(beats: dict[int, Beat]) -> bool:
    phases = {b.phase for b in beats.values()}
    if len(beats) < 2 or len(phases) != 1 or not phases <= {"train", "eval"}:
        return False
    steps = [b.step or 0 for b in beats.values()]
    return max(steps) - min(steps) <= 1


def _cpu_shares(cpu: dict[int, tuple], since: float, now: float) -> dict[int, float]:
    """rank -> CPU seconds per second over the last poll, for ranks sampled at both ends of it."""
    out = {}
    for rank, (_, history) in cpu.items():
        if len(history) < 2:
            continue
        (t0, c0, *_), (t1, c1, *_) = history[-2], history[-1]
        if t1 < now - 1e-6 or t0 < since - 1e-6 or t1 - t0 < MIN_INTERVAL_S:
            continue
        out[rank] = max(0.0, (c1 - c0) / (t1 - t0))
    return out


def _attribute(busy: dict[int, float], signal: Signal, now: float, seconds: float, reasons: dict) -> _Interval:
    ranks = sorted(busy, key=lambda r: -busy[r])
    top, b1 = ranks[0], busy[ranks[0]]
    b2 = busy[ranks[1]]
    margin = MARGIN[signal]
    below = sum(1 for r in ranks[1:] if busy[r] <= b1 - margin)
    waited = b1 >= LEAST[signal] and below >= 1 and 2 * below >= len(ranks) - 1
    last = top if waited and b2 <= b1 - margin else None
    scale = 1.0 if signal == "power" else 1.0 / max(b1, 1e-9)  # CPU: the busiest rank's cores are "working"
    wait_s = sum(min(1.0, (b1 - busy[r]) * scale) for r in ranks[1:]) * seconds if last is not None else 0.0
    return _Interval(now, seconds, signal, dict(busy), last, waited, wait_s, reasons)


def _cause(rank: int, mine: list[_Interval]) -> tuple[Cause, str]:
    counts = np.sum([iv.reasons[rank] for iv in mine if rank in iv.reasons], axis=0) if mine else None
    peers = [c for iv in mine for r, c in iv.reasons.items() if r != rank]
    theirs = np.sum(peers, axis=0) if peers else np.zeros(4)
    if counts is not None and np.ndim(counts) and counts[0] > 0:
        share = counts[1:] / counts[0]
        other = theirs[1:] / theirs[0] if theirs[0] > 0 else np.zeros(3)
        best = int(np.argmax(share - other))
        if share[best] >= 0.5 and share[best] - other[best] >= 0.3:
            group = cast(Cause, list(REASON_CAUSES)[best])  # REASON_CAUSES's keys are causes, typed str
            return group, f"clocks-event reasons: {CAUSE_WORDS[group]} in {100 * share[best]:.0f}% of its samples"
    if rank == 0:
        return "rank0_work", "it is rank 0: work only rank 0 does (logging, evaluation, a save)"
    return "unknown", "nothing the watcher reads says why (triage reads the clocks, temperature and data wait)"


def busy_from_samples(time_, host, gpu, power, reasons, since: float, now: float, low_max_w: float) -> dict:
    """(host, gpu) -> (share of its samples in (since, now] at or above low_max_w, reasons counts [reading,
    thermal, power_cap, hw_slowdown]) from a trace tail's sample arrays."""
    sel = (time_ > since) & (time_ <= now) & np.isfinite(power)
    out = {}
    if not sel.any():
        return out
    h, g, p = host[sel], gpu[sel], power[sel]
    r = reasons[sel] if reasons is not None else None
    for key in set(zip(h.tolist(), g.tolist())):
        m = (h == key[0]) & (g == key[1])
        counts = np.zeros(4)
        if r is not None:
            rr = r[m]
            ok = rr >= 0
            counts[0] = ok.sum()
            for i, bits in enumerate(REASON_CAUSES.values(), start=1):
                counts[i] = (ok & ((rr & bits) != 0)).sum()
        share = float((p[m] >= low_max_w).mean())
        out[(str(key[0]), int(key[1]))] = (share if math.isfinite(share) else 0.0, counts)
    return out
