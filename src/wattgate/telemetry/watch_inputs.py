"""What the watcher reads: each rank's heartbeat, checked field by field, each rank's first step of a phase in
this attempt (from its events file), what rank processes on this host are doing, and the last seconds of every
node's power trace (TraceTail).

A bad heartbeat (unreadable, not JSON, a field missing or of the wrong type) is that rank's missing heartbeat
for this poll: the rank keeps its last good one and the watcher keeps watching. Without power data the
watcher's signal is the ranks' CPU time: a rank blocked in a gloo collective used 0.00 of a core while a
computing one used 1.00 (bench/watch_cpu_signal.py), so a rank below WAITING_CPU_SHARE that reads and writes
nothing and is not in uninterruptible I/O is waiting; any other reading is work.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq

from wattgate.errors import InputError
from wattgate.heartbeats import HEARTBEAT_DIR, HEARTBEAT_PHASES, heartbeat_events_path
from wattgate.records.base import Where
from wattgate.records.heartbeat import Beat, PhaseEvent
from wattgate.telemetry.lag_watch import busy_from_samples
from wattgate.trace import (
    GPU,
    HOST,
    POWER_W,
    REASONS,
    SEGMENT_DIR_SUFFIX,
    TIME,
    UTIL_GPU,
    _segment_range,
    live_segments,
)

# the train loop's validation pass beats `eval`: known here whether or not run_files lists it yet
WATCH_PHASES = tuple(dict.fromkeys(HEARTBEAT_PHASES[:2] + ("eval",) + HEARTBEAT_PHASES[2:]))
COLLECTIVE_PHASES = ("train", "eval")  # phases whose every micro-batch runs collectives with the other ranks
WAITING_CPU_SHARE = 0.05  # of one core: measured 0.00 waiting in gloo; a computing rank on a loaded host >= 0.25
_RANK_FILE = re.compile(r"rank-(\d+)\.json")
_INT_FIELDS = ("step", "epoch", "micro", "micros", "total_steps", "local_rank", "pid")
_CLK_TCK = os.sysconf("SC_CLK_TCK")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def beat_problem(beat, rank: int, world: int) -> str | None:
    """Why this parsed heartbeat of rank-<rank>.json cannot be used, or None when it can."""
    if not isinstance(beat, dict):
        return f"a JSON {type(beat).__name__}, not an object"
    if rank >= world:
        return f"rank {rank} is outside the job's {world} ranks"
    for key in ("rank", "step", "phase", "time"):
        if key not in beat:
            return f"no '{key}'"
    if beat["rank"] != rank or not _is_int(beat["rank"]):
        return f"'rank' is {beat['rank']!r} in the file of rank {rank}"
    if beat["phase"] not in WATCH_PHASES:
        return f"'phase' {beat['phase']!r} is none of {', '.join(WATCH_PHASES)}"
    t = beat["time"]
    if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t):
        return f"'time' {t!r} is not a finite number"
    for key in _INT_FIELDS:
        v = beat.get(key)
        if v is not None and (not _is_int(v) or v < 0):
            return f"'{key}' {v!r} is not a whole number >= 0"
    ends = beat.get("epoch_ends")
    if ends is not None and not (isinstance(ends, list) and all(_is_int(e) for e in ends)):
        return "'epoch_ends' is not a list of steps"
    host = beat.get("host")
    if host is not None and not isinstance(host, str):
        return f"'host' {host!r} is not a string"
    return None


class BeatReader:
    """Each rank's latest good heartbeat written at or after `since`; `bad` names the files that are not."""

    def __init__(self, run: Path, world: int, since: float):
        self.run, self.world, self.since = Path(run), world, since
        self.last: dict[int, Beat] = {}
        self.bad: dict[str, str] = {}  # file name -> what is wrong with it now

    def read(self) -> dict[int, Beat]:
        self.bad = {}
        for path in sorted((self.run / HEARTBEAT_DIR).glob("rank-*.json")):
            m = _RANK_FILE.fullmatch(path.name)
            if not m:
                continue
            rank = int(m[1])
            raw, problem = _load(path)
            problem = problem or beat_problem(raw, rank, self.world)
            beat = None
            if not problem:
                try:
                    beat = Beat.from_json(raw, Where(path.name))
                except InputError as exc:
                    problem = str(exc)
            if problem:
                self.bad[path.name] = problem
                continue
            assert beat is not None  # read without a problem
            if beat.time >= self.since:  # older ones belong to an earlier attempt
                self.last[rank] = beat
        return dict(self.last)


def _load(path: Path):
    try:
        return json.loads(path.read_text()), None
    except FileNotFoundError:
        return None, "gone while reading (a relaunch clearing it)"
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        return None, f"unreadable ({str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__})"


def first_steps(run: Path, rank: int, since: float) -> dict[str, int]:
    """phase -> the step at which this rank first entered it in this attempt (its events file; bad lines skipped).

    The first step of a collective phase is start-up: compiles, first-touch allocations and warm caches."""
    try:
        lines = heartbeat_events_path(run, rank).read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return {}
    out: dict[str, int] = {}
    for line in lines:
        try:
            e = PhaseEvent.from_json(json.loads(line), "the event")
        except (ValueError, InputError, RecursionError):
            continue
        if e.time >= since and e.phase in COLLECTIVE_PHASES and e.phase not in out:
            out[e.phase] = e.step
    return out


def proc_activity(pid: int) -> tuple[float, int, str] | None:
    """(CPU seconds of all its threads, bytes it read and wrote through storage, state letter) from /proc;
    None when the process is gone or unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        cpu = (int(fields[11]) + int(fields[12])) / _CLK_TCK  # utime, stime: fields 14, 15 of proc(5)
        state = fields[0]
    except (OSError, ValueError, IndexError):
        return None
    io = 0
    try:
        with open(f"/proc/{pid}/io") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("read_bytes", "write_bytes"):
                    io += int(value)
    except (OSError, ValueError):
        pass  # /proc/<pid>/io needs the same user: CPU time alone then
    return cpu, io, state


def is_rank_process(pid: int) -> bool:
    """The pid runs wattgate (a rank is `python -m wattgate train`): a pid from another PID namespace or one the
    kernel gave to another process since must never be read as a rank waiting."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"wattgate" in f.read()
    except OSError:
        return False


def cpu_seconds(pid: int) -> float | None:
    a = proc_activity(pid)
    return a[0] if a else None


@dataclass(frozen=True)
class Activity:
    """What a rank's process on this host did over the meter's window."""

    cpu_share: float  # of one core
    io_bytes: int  # read and written through storage
    state: str  # its process state letter (proc(5)) at the end
    over_s: float  # the seconds sampled
    waiting: bool  # no CPU to speak of, no I/O, not in uninterruptible I/O: blocked in a collective


class ActivityMeter:
    """Per rank on this host, what its process did over the last `window_s` (Activity). Ranks elsewhere, gone,
    or sampled too briefly have none."""

    def __init__(self, window_s: float, host: str | None = None):
        self.window_s = window_s
        self.host = host or socket.gethostname()
        self.samples: dict[int, tuple[int, deque]] = {}  # rank -> (pid, (time, cpu, io, state) ...)

    def sample(self, beats: dict[int, Beat], now: float) -> None:
        for rank, b in beats.items():
            pid = b.pid
            if b.host != self.host or not pid:
                self.samples.pop(rank, None)
                continue
            if rank not in self.samples or self.samples[rank][0] != pid:
                self.samples[rank] = (pid, deque())
            history = self.samples[rank][1]
            reading = proc_activity(pid) if is_rank_process(pid) else None
            if reading is None:
                history.clear()
                continue
            history.append((now, *reading))
            while history and history[0][0] < now - 2 * self.window_s:
                history.popleft()

    def activity(self, now: float) -> dict[int, Activity]:
        out = {}
        for rank, (_, history) in self.samples.items():
            recent = [h for h in history if h[0] >= now - self.window_s]
            if len(recent) < 2 or recent[-1][0] - recent[0][0] < self.window_s / 2:
                continue  # too short a record to tell waiting from working
            (t0, c0, io0, _), (t1, c1, io1, state) = recent[0], recent[-1]
            share, io = (c1 - c0) / (t1 - t0), io1 - io0
            out[rank] = Activity(
                cpu_share=round(share, 3),
                io_bytes=io,
                state=state,
                over_s=round(t1 - t0, 1),
                waiting=share < WAITING_CPU_SHARE and io == 0 and state != "D",
            )
        return out


# process states (proc(5)) that name what is wrong with a rank by themselves, for the verdict line
ODD_STATES = {"T": "stopped", "t": "stopped by a debugger", "D": "in uninterruptible I/O", "Z": "dead, not reaped"}


def state_notes(beats: dict[int, Beat], activity: dict[int, Activity], now: float) -> list[str]:
    """'rank 1 (pid 4242) stopped (state T) at step 7 for 61 s' for each rank whose process (on this host) is in
    one of ODD_STATES: a SIGSTOP, a debugger, a hung filesystem; the time is since its last heartbeat."""
    notes = []
    for rank in sorted(activity):
        state, beat = activity[rank].state, beats.get(rank)
        if state in ODD_STATES and beat is not None:
            notes.append(
                f"rank {rank} (pid {beat.pid}) {ODD_STATES[state]} (state {state}) at step {beat.step} "
                f"for {now - beat.time:.0f} s"
            )
    return notes


def odd_state_ranks(activity: dict[int, Activity], states: str = "Tt") -> list[int]:
    return sorted(r for r, a in activity.items() if a.state in states)


class TraceTail:
    """The last seconds of every node's power trace, read incrementally from the samplers' live segments."""

    def __init__(self, telemetry: Path, keep_s: float):
        self.telemetry = telemetry
        self.keep_s = keep_s
        self.seen: dict[Path, int] = {}  # segment folder -> highest segment number read
        # (time, host, gpu, power W, util %, clocks-event reasons) of each segment read
        self.chunks: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []

    def update(self) -> None:
        for folder in self.telemetry.glob(f".*.parquet{SEGMENT_DIR_SUFFIX}"):
            last = self.seen.get(folder, -1)
            for seg in live_segments(folder):
                lo, hi = _segment_range(seg)
                if hi <= last:
                    continue
                try:
                    t = pq.read_table(seg, columns=[TIME, HOST, GPU, POWER_W, UTIL_GPU, REASONS])
                except (OSError, ValueError):
                    continue  # merged away between listing and reading; its rows arrive in the merged file
                last = max(last, hi)
                if len(t):
                    # -1: no reading (the straggler warning's cause, telemetry/lag_watch.py)
                    reasons = pc.fill_null(t[REASONS], -1).to_numpy().astype(np.int64)
                    self.chunks.append(
                        (
                            t[TIME].to_numpy(),
                            np.array(t[HOST].to_pylist(), dtype=object),
                            t[GPU].to_numpy(),
                            t[POWER_W].to_numpy(zero_copy_only=False),
                            t[UTIL_GPU].to_numpy(zero_copy_only=False),
                            reasons,
                        )
                    )
            self.seen[folder] = last
        if self.chunks:
            newest = max(c[0].max() for c in self.chunks)
            self.chunks = [c for c in self.chunks if c[0].max() >= newest - self.keep_s]

    def window(self, since: float) -> dict[tuple[str, int], tuple[float, float, float]]:
        """(host, gpu) -> (mean power W, mean util %, seconds covered) over samples newer than `since`."""
        if not self.chunks:
            return {}
        t, host, gpu, power, util = (np.concatenate(x) for x in list(zip(*self.chunks))[:5])
        sel = t >= since
        out = {}
        for key in set(zip(host[sel], gpu[sel])):
            m = sel & (host == key[0]) & (gpu == key[1])
            out[(str(key[0]), int(key[1]))] = (
                float(np.nanmean(power[m])),
                float(np.nanmean(util[m])),
                float(t[m].max() - t[m].min()),
            )
        return out

    def busy_shares(self, since: float, now: float, low_max_w: float) -> dict:
        """(host, gpu) -> (share of its samples in (since, now] at or above low_max_w, reasons counts): what the
        straggler warning reads of the interval (telemetry/lag_watch.py)."""
        recent = [c for c in self.chunks if len(c[0]) and c[0].max() > since]
        if not recent:
            return {}
        t, host, gpu, power = (np.concatenate(x) for x in list(zip(*recent))[:4])
        reasons = np.concatenate([c[5] for c in recent])
        return busy_from_samples(t, host, gpu, power.astype(np.float64), reasons, since, now, low_max_w)
