"""Power-only verdicts: the low-power pauses of a triaged trace in words, and what a trace alone cannot say.

Built from phases windows only (phases.parquet), so `wattgate triage` and
`wattgate report` say the same whether triage ran in process or earlier.

A pause is an episode of checkpoint or deadlock windows: the runs of that
phase on every GPU (gaps of up to 2 windows do not split a run) that overlap
in time (3 windows of slack) make one. In it, a GPU whose windows average at
least 50% utilization was waiting (spinning in a collective); one below was
the idle rank (the checkpoint writer, or the stuck rank of a hang). A pause
is open when it reaches the last window of the trace: it never ended.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from wattgate.durations import clock
from wattgate.power.triage.phases import END, GPU, HOST, LABELS, POWER_W, START, UTIL_GPU, phase_codes
from wattgate.power.triage.rules import CHECKPOINT_MIN_S, LENGTH_RATIO, PERIOD_TOLERANCE, PERIODIC_MIN
from wattgate.triage_tables import DEFAULT_WINDOW_S

WAITING_UTIL = 50.0  # mean utilization in a pause above which a GPU was waiting, below which it was the idle one
RUN_GAP = 2  # windows of another label that do not split a GPU's run
EPISODE_SLACK = 3  # windows between GPUs' runs that still make one pause


@dataclass
class Pause:
    kind: str  # checkpoint | deadlock
    start: float
    end: float
    waiting: list[str]  # host:gpu spinning at low power
    idle: list[str]  # host:gpu near 0% utilization
    power_w: tuple[float, float] | None  # range of the waiting GPUs' mean power
    util_waiting: float | None
    util_idle: float | None
    open: bool  # reaches the end of the trace

    @property
    def seconds(self) -> float:
        return self.end - self.start

    def record(self, t0: float | None) -> dict:
        def r(x, d=3):
            return None if x is None else round(float(x), d)

        return {
            "kind": self.kind,
            "start": r(self.start),
            "end": r(self.end),
            "duration_s": r(self.seconds),
            "start_offset_s": r(self.start - t0) if t0 is not None else None,
            "waiting": self.waiting,
            "idle": self.idle,
            "power_w": [r(x, 1) for x in self.power_w] if self.power_w else None,
            "util_waiting": r(self.util_waiting, 1),
            "util_idle": r(self.util_idle, 1),
            "open": self.open,
        }


def pauses(phases: pa.Table | None) -> list[Pause]:
    """Checkpoint and deadlock episodes of a phases table, in time order."""
    if phases is None or phases.num_rows == 0:
        return []
    start_all = _floats(phases.column(START))
    end_all = _floats(phases.column(END))
    lengths = end_all - start_all
    lo, hi = float(lengths.min()), float(lengths.max())
    window = lo if lo == hi else float(np.median(lengths))  # one window length (triage's): no sort for its median
    last_end = float(end_all.max())
    out = []
    codes = phase_codes(phases)
    for kind in ("checkpoint", "deadlock"):
        rows = np.flatnonzero(codes == LABELS.index(kind))
        if len(rows) == 0:
            continue
        out += _episodes(kind, phases.take(pa.array(rows)), window, last_end)
    return sorted(out, key=lambda p: (p.start, p.kind))


def _episodes(kind: str, sel: pa.Table, window: float, last_end: float) -> list[Pause]:
    """The pauses of one kind from its windows (every GPU's)."""
    host = pc.dictionary_encode(pc.fill_null(sel.column(HOST).cast(pa.string()), "")).combine_chunks()
    names = [str(h) for h in host.dictionary.to_pylist()]
    rank = np.empty(len(names), np.int64)
    rank[np.argsort(np.array(names, dtype=object), kind="stable")] = np.arange(len(names))
    hosts = sorted(names)
    gpu = sel.column(GPU).to_numpy().astype(np.int64)
    width = int(gpu.max()) + 1 if len(gpu) else 1
    # GPUs as integers in (host, gpu) order; each GPU's windows in time order
    key = rank[host.indices.to_numpy(zero_copy_only=False)] * width + gpu
    s, e = _floats(sel.column(START)), _floats(sel.column(END))
    order = np.lexsort((s, key))
    key, s, e = key[order], s[order], e[order]
    power, util = _floats(sel.column(POWER_W))[order], _floats(sel.column(UTIL_GPU))[order]
    # runs of a GPU (gaps of up to RUN_GAP windows do not split one), then runs overlapping in time: episodes
    new = np.ones(len(s), dtype=bool)
    new[1:] = (key[1:] != key[:-1]) | (s[1:] - e[:-1] > RUN_GAP * window + 1e-9)
    run = np.cumsum(new) - 1
    first, last = np.flatnonzero(new), np.append(np.flatnonzero(new)[1:] - 1, len(s) - 1)
    rs, re_ = s[first], e[last]
    by_start = np.argsort(rs, kind="stable")
    reach = np.maximum.accumulate(re_[by_start])
    ep_new = np.ones(len(by_start), dtype=bool)
    ep_new[1:] = rs[by_start][1:] > reach[:-1] + EPISODE_SLACK * window
    episode = np.empty(len(by_start), np.int64)
    episode[by_start] = np.cumsum(ep_new) - 1
    nep = int(episode.max()) + 1
    ep_a, ep_b = np.full(nep, np.inf), np.full(nep, -np.inf)
    np.minimum.at(ep_a, episode, rs)
    np.maximum.at(ep_b, episode, re_)
    # a GPU's windows in one episode are one stretch of this order (its runs' episodes never go back)
    window_episode = episode[run]
    cut = np.ones(len(s), dtype=bool)
    cut[1:] = (key[1:] != key[:-1]) | (window_episode[1:] != window_episode[:-1])
    bounds = np.append(np.flatnonzero(cut), len(s))
    per: list[dict] = [{} for _ in range(nep)]
    for a, b in zip(bounds[:-1], bounds[1:]):
        pw, ut = power[a:b], util[a:b]
        k = int(key[a])
        per[int(window_episode[a])][f"{hosts[k // width]}:{k % width}"] = (
            np.nanmean(pw) if np.isfinite(pw).any() else np.nan,
            np.nanmean(ut) if np.isfinite(ut).any() else np.nan,
        )
    out = []
    for k in range(nep):
        a, b, gpus = float(ep_a[k]), float(ep_b[k]), per[k]
        # without utilization no GPU can be told waiting from idle: all count as waiting
        waiting = sorted((g for g, (_, u) in gpus.items() if not u < WAITING_UTIL), key=_gpu_order)
        idle = sorted((g for g, (_, u) in gpus.items() if u < WAITING_UTIL), key=_gpu_order)
        wp = [gpus[g][0] for g in waiting if np.isfinite(gpus[g][0])]
        out.append(
            Pause(
                kind,
                a,
                b,
                waiting,
                idle,
                (min(wp), max(wp)) if wp else None,
                _mean([gpus[g][1] for g in waiting]),
                _mean([gpus[g][1] for g in idle]),
                b >= last_end - EPISODE_SLACK * window,
            )
        )
    return out


def _floats(col) -> np.ndarray:
    """A numeric column as float64, null -> NaN."""
    return np.asarray(col.to_numpy(zero_copy_only=False), np.float64)


def _mean(xs) -> float | None:
    xs = [x for x in xs if np.isfinite(x)]
    return float(np.mean(xs)) if xs else None


def _gpu_order(label: str) -> tuple[str, int]:
    host, _, gpu = label.rpartition(":")
    return host, int(gpu) if gpu.isdigit() else -1


def span(a: float, b: float) -> str:
    """A range of durations in one unit where they share it: 25-36 s, 2:25-2:33 min."""
    lo, hi = clock(a), clock(b)
    if lo == hi:
        return lo
    unit_lo, unit_hi = lo.rsplit(" ", 1)[1], hi.rsplit(" ", 1)[1]
    return f"{lo.rsplit(' ', 1)[0]}-{hi}" if unit_lo == unit_hi else f"{lo}-{hi}"


def _gpus(labels: list[str], limit: int = 4) -> str:
    shown = ", ".join(labels[:limit])
    return shown + (f" and {len(labels) - limit} more" if len(labels) > limit else "")


def _who(p_list: list[Pause]) -> str:
    """'GPU node0:0 idle (~4% util) while 7 GPUs waited at 131-152 W, ~99% util' over a set of pauses."""
    idle = sorted({g for p in p_list for g in p.idle}, key=_gpu_order)
    waiting = {g for p in p_list for g in p.waiting}
    lo = [p.power_w[0] for p in p_list if p.power_w]
    hi = [p.power_w[1] for p in p_list if p.power_w]
    u_wait = _mean([p.util_waiting for p in p_list if p.util_waiting is not None])
    u_idle = _mean([p.util_idle for p in p_list if p.util_idle is not None])
    parts = []
    if idle:
        parts.append(f"GPU {_gpus(idle)} idle" + (f" (~{u_idle:.0f}% util)" if u_idle is not None else ""))
    if u_wait is None and u_idle is None:
        watts = f" at {min(lo):.0f}-{max(hi):.0f} W" if lo else ""
        return f"{len(waiting)} GPU(s){watts} (no utilization in the trace: waiting and idle ranks not told apart)"
    spin = f"{len(waiting)} GPU(s) waited"
    if lo:
        spin += f" at {min(lo):.0f}-{max(hi):.0f} W"
    if u_wait is not None:
        spin += f", ~{u_wait:.0f}% util"
    parts.append(spin)
    return " while ".join(parts) if idle else parts[0]


def verdict(found: list[Pause], t0: float | None, window_s: float = DEFAULT_WINDOW_S) -> list[str]:
    """One line for the checkpoints (a series when they recur), one per hang."""
    lines = []
    ck = [p for p in found if p.kind == "checkpoint"]
    if ck:
        lengths = [p.seconds for p in ck]
        text = f"{len(ck)} checkpoint pause(s), {span(min(lengths), max(lengths))} each"
        if len(ck) >= 2:
            gaps = np.diff([p.start for p in ck])
            text += f", every ~{clock(float(np.median(gaps)))}"
            if len(gaps) >= 2:
                text += f" (intervals {span(gaps.min(), gaps.max())})"
        first = f"; first at +{clock(ck[0].start - t0)}" if t0 is not None else ""
        lines.append(f"{text}{first}: {_who(ck)}. Each ended (work resumed): checkpoint, not a hang.")
    for p in found:
        if p.kind != "deadlock":
            continue
        at = f" at +{clock(p.start - t0)}" if t0 is not None else ""
        end = (
            f"{clock(p.seconds)} to the end of the trace: it never ended"
            if p.open
            else f"{clock(p.seconds)}, then no work resumed (the job was killed or died)"
        )
        lines.append(f"Deadlock{at}, {end}. {_who([p])}.")
    if not lines:
        lines.append("No low-power pause labelled checkpoint or deadlock.")
    return lines


# ---------------------------------------------------------------- what a trace alone cannot say

SIGNALS = {  # signal -> what it would have added
    "heartbeats": "heartbeats (rank progress, checkpoint events, which rank ran on which GPU)",
    "metrics": "metrics (step times, data wait, tokens, loss)",
    "util": "GPU utilization (waits told from idle by power alone)",
    "gate": "the invariant gate (were the step counts equal on every rank?)",
    "watcher": "the hang watcher's verdict (stuck ranks, when it acted)",
    "energy_counter": "the NVML energy counter (energy integrated from power samples instead)",
    "trained": "the run summary TRAINED (wall time, MFU)",
    "config": "the run config (cluster and train settings)",
}


def wait_rule(deadlock_after_s: float) -> str:
    dl = f"{deadlock_after_s:g} s"
    return (
        f"Power-only wait rule: a low-power wait at ~100% utilization (a kernel spinning in a collective) "
        f"that never ends (no compute, communication or data starvation resumes on that GPU within {dl}) "
        f"and lasts {dl} (deadlock_after_s) is a deadlock. A wait that ends is a checkpoint if it lasted "
        f"{dl}, or if it lasted at least {CHECKPOINT_MIN_S:g} s and either one GPU sat idle (near 0% "
        "utilization) through it while the others spun, coming back as they did (the rank writing the "
        f"checkpoint), or it recurs: at least {PERIODIC_MIN} pauses of similar length (within "
        f"x{LENGTH_RATIO:g}) at a regular interval (most intervals within {100 * PERIOD_TOLERANCE:.0f}% of their "
        "median). Any other wait is communication (a sync wait: a "
        f"straggler, a slow collective). So a periodic checkpoint of tens of seconds, shorter than {dl}, is "
        "a checkpoint, and a wait that never ends is a deadlock however many ranks sit idle in it."
    )


def limits(signals: dict, deadlock_after_s: float, index_inferred: bool = False) -> dict:
    """Missing signals (those in `signals` that are False) and what the triage therefore could not tell apart."""
    missing = [text for key, text in SIGNALS.items() if key in signals and not signals[key]]
    beats, metrics = signals.get("heartbeats", False), signals.get("metrics", False)
    cannot = []
    if not beats and not metrics:
        cannot.append(
            "a host-bound step (launch-bound small kernels, ~50% utilization) from a data-starved "
            "one: both read data_starvation"
        )
    if not beats:
        dl = f"{deadlock_after_s:g} s"
        cannot += [
            "a checkpoint written by the only GPU of a job from idle (no peer waits for it), and a single "
            f"checkpoint shorter than {dl} whose writer's GPU is not in the trace from a sync wait",
            f"a checkpoint from any other pause of >= {CHECKPOINT_MIN_S:g} s with one rank idle or in a regular "
            "series (a stalled data loader, evaluation on the host, a periodic upload)",
            f"a hang killed and restarted within {dl} from a long checkpoint",
            f"a hang still under {dl} when the trace ends from a sync wait (it reads communication)",
            "which rank ran on which GPU: GPUs are named host:index",
        ]
    if "util" in signals and not signals["util"]:
        cannot.append(
            "a spinning wait from an idle GPU except by power (a low-band window more than 30% of "
            "the band above idle_w counts as a wait); the waiting and the idle rank of a pause"
        )
    if index_inferred:
        cannot.append(
            "which physical GPU a row came from: the GPU index was inferred from the row order in "
            "each nvidia-smi sampling burst"
        )
    mode = "power only" if not beats and not metrics else ("no heartbeats" if not beats else "run info")
    return {"mode": mode, "missing": missing, "cannot_tell": cannot, "wait_rule": wait_rule(deadlock_after_s)}
