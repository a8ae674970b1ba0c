"""`wattgate watch`: one watcher per job, outside the training processes.

Every `poll_s` it reads each rank's heartbeat and the last seconds of every
node's power trace, and decides:
- deadlock: no rank has advanced for `hang_after_s` while the GPUs sit in the
  low power band with a kernel resident (or, without power data, on the
  heartbeat stall alone). Ranks that reached a later position (next epoch, a
  checkpoint or export the others never entered) are named as having run
  ahead; the rest are behind. With power data, a rank at ~0% utilization while
  its peers spin in a collective is named as the stuck one.
- a checkpoint (or init / export) that every rank announced gets its own,
  longer limit and is never called a hang (past that limit the verdict is
  `checkpoint_stalled`, etc.); a phase that only some ranks entered is a
  desynchronization and gets the plain hang limit.
- GPUs busy at high power with no heartbeat progress: a slow step, not a
  hang; only after `busy_stall_after_s` is it reported.
Action `kill` SIGTERMs then SIGKILLs the job's process tree (torchrun's
workers run in their own sessions, so a process-group kill would miss them),
or cancels the Slurm job; `warn` only records. `watcher.json` holds the
verdict either way.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from wattgate.artifacts import write_json_atomic
from wattgate.forecast import hang_cost
from wattgate.power.tables import TriageTable
from wattgate.power.triage.settings import DEFAULT_DEADLOCK_AFTER_S
from wattgate.run_files import HEARTBEAT_PHASES, WATCHER, read_heartbeats
from wattgate.telemetry.trace import SEGMENT_DIR_SUFFIX, _segment_range, live_segments

PHASE_ORDER = {phase: i for i, phase in enumerate(HEARTBEAT_PHASES)}


@dataclass(frozen=True)
class WatchSettings:
    hang_after_s: float = DEFAULT_DEADLOCK_AFTER_S
    checkpoint_after_s: float = 1800.0
    startup_after_s: float = 900.0
    busy_stall_after_s: float = 1800.0
    action: str = "kill"
    poll_s: float = 1.0
    kill_grace_s: float = 10.0

    @classmethod
    def from_config(cls, config: dict) -> WatchSettings:
        w = config["watcher"]
        return cls(**{k: w[k] for k in cls.__dataclass_fields__})


class TraceTail:
    """The last seconds of every node's power trace, read incrementally from the samplers' live segments."""

    def __init__(self, telemetry: Path, keep_s: float):
        self.telemetry = telemetry
        self.keep_s = keep_s
        self.seen: dict[Path, int] = {}  # segment folder -> highest segment number read
        self.chunks: list[tuple[np.ndarray, ...]] = []

    def update(self) -> None:
        for folder in self.telemetry.glob(f".*.parquet{SEGMENT_DIR_SUFFIX}"):
            last = self.seen.get(folder, -1)
            for seg in live_segments(folder):
                lo, hi = _segment_range(seg)
                if hi <= last:
                    continue
                try:
                    t = pq.read_table(seg, columns=["time", "host", "gpu", "power_w", "util_gpu"])
                except (OSError, ValueError):
                    continue  # merged away between listing and reading; its rows arrive in the merged file
                last = max(last, hi)
                if len(t):
                    self.chunks.append(
                        (
                            t["time"].to_numpy(),
                            np.array(t["host"].to_pylist(), dtype=object),
                            t["gpu"].to_numpy(),
                            t["power_w"].to_numpy(zero_copy_only=False),
                            t["util_gpu"].to_numpy(zero_copy_only=False),
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
        t, host, gpu, power, util = (np.concatenate(x) for x in zip(*self.chunks))
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


def position(beat: dict) -> tuple[int, int, float, int]:
    """Where a rank is, comparable across ranks: steps done, phase, share of this step's micro-batches
    started, and fewer planned micro-batches first (that rank reaches the step's gradient reduction
    while its peers still run forward passes: the collective sequences no longer match)."""
    micros = beat.get("micros") or 0
    started = beat.get("micro", 0) / micros if micros else 0.0
    return int(beat["step"]), PHASE_ORDER.get(beat["phase"], 0), started, -micros


def phase_limit(beats: dict[int, dict], s: WatchSettings) -> tuple[float, str]:
    """The stall allowed now: long only for a phase every rank announced at the same step."""
    phases = {(b["phase"], b["step"]) for b in beats.values()}
    if len(phases) == 1:
        phase = next(iter(phases))[0]
        if phase == "checkpoint":
            return s.checkpoint_after_s, "checkpoint"
        if phase in ("init", "export"):
            return s.startup_after_s, phase
    return s.hang_after_s, "train"


def describe_rank(b: dict, now: float) -> dict:
    keys = ("rank", "host", "local_rank", "gpu", "step", "micro", "micros", "epoch", "phase", "total_steps")
    return {k: b.get(k) for k in keys} | {
        "last_beat_age_s": round(now - b["time"], 3),
        "planned_epoch_end": next((e for e in b.get("epoch_ends") or [] if e >= b["step"]), None),
    }


def diagnose(
    beats: dict[int, dict],
    world: int,
    now: float,
    started: float,
    power: dict[tuple[str, int], tuple[float, float, float]],
    table: TriageTable | None,
    s: WatchSettings,
) -> dict | None:
    """A verdict dict when the job must be stopped, else None. Pure: the tests drive it with files."""
    if len(beats) == world and all(b["phase"] == "done" for b in beats.values()):
        return None
    missing = sorted(set(range(world)) - set(beats))
    if missing:
        if now - started < s.startup_after_s:
            return None
        return {
            "verdict": "stuck_ranks",
            "stuck_ranks": missing,
            "ran_ahead": sorted(beats),
            "behind": missing,
            "stalled_for_s": round(now - started, 3),
            "limit_s": s.startup_after_s,
            "limit_phase": "init",
            "reason": f"rank(s) {_list(missing)} never reported a heartbeat in {s.startup_after_s:.0f} s "
            f"while rank(s) {_list(sorted(beats))} started",
        }
    active = {r: b for r, b in beats.items() if b["phase"] != "done"}
    stalled_for = now - max(b["time"] for b in active.values())
    limit, limit_phase = phase_limit(active, s)
    if stalled_for < limit:
        return None
    gpus = _rank_power(beats, power)
    in_low_band = _low_band(gpus, table)
    if in_low_band is False:  # GPUs busy: a slow step, not a deadlock (yet)
        if stalled_for < s.busy_stall_after_s:
            return None
    positions = {r: position(b) for r, b in beats.items()}
    top = max(positions.values())
    ahead = sorted(r for r, p in positions.items() if p == top)
    behind = sorted(r for r, p in positions.items() if p != top)
    idle = sorted(r for r, g in gpus.items() if table is not None and g and g[1] <= table.idle_util_pct)
    waiting = sorted(r for r, g in gpus.items() if table is not None and g and g[1] >= table.busy_util_pct)
    stuck = idle if idle and waiting else behind
    ranks = [describe_rank(b, now) | _power_fields(gpus.get(r)) for r, b in sorted(beats.items())]
    where = "; ".join(where_is(beats[r], now) for r in sorted(beats))
    if in_low_band is None:
        signal_desc = "no power data: heartbeat stall alone"
    elif in_low_band:
        signal_desc = f"GPUs in the low power band (< {table.low_max_w:.0f} W)"
    else:
        signal_desc = f"GPUs still busy at high power for {stalled_for:.0f} s"
    verdict = "deadlock"
    if limit_phase != "train":  # every rank announced it: an overlong phase, not a collective hang
        verdict = f"{limit_phase}_stalled"
        reason = (
            f"{verdict}: every rank has been in {limit_phase} for {stalled_for:.1f} s (limit {limit:.0f} s; "
            f"{signal_desc}): {where}"
        )
    elif behind:
        reason = (
            f"deadlock: no rank advanced for {stalled_for:.1f} s ({signal_desc}); rank(s) {_list(ahead)} ran "
            f"ahead of rank(s) {_list(behind)}{_uneven_step(beats)}: {where}"
        )
    elif stuck:
        reason = (
            f"deadlock: no rank advanced for {stalled_for:.1f} s ({signal_desc}); rank(s) {_list(stuck)} idle "
            f"while the others wait in a collective: {where}"
        )
    else:
        reason = f"deadlock: no rank advanced for {stalled_for:.1f} s ({signal_desc}): {where}"
    return {
        "verdict": verdict,
        "reason": reason,
        "stalled_for_s": round(stalled_for, 3),
        "limit_s": limit,
        "limit_phase": limit_phase,
        "ran_ahead": ahead if behind else [],
        "behind": behind,
        "stuck_ranks": stuck,
        "power_signal": signal_desc,
        "ranks": ranks,
    }


def _uneven_step(beats: dict[int, dict]) -> str:
    """' (step 18 planned with 1 micro-batch on rank 0, 2 on rank 1)' when ranks in one step disagree."""
    in_step = {r: b for r, b in beats.items() if b["phase"] == "train" and b.get("micros")}
    steps = {b["step"] for b in in_step.values()}
    if len(steps) != 1 or len({b["micros"] for b in in_step.values()}) < 2:
        return ""
    plans = ", ".join(f"{b['micros']} on rank {r}" for r, b in sorted(in_step.items()))
    return f" (micro-batches planned for step {steps.pop() + 1}: {plans}; the collective sequences differ)"


def where_is(b: dict, now: float) -> str:
    """'rank 1: checkpointing after step 18, the last step of its epoch 0 (...)' for the verdict line."""
    step, phase, epoch = int(b["step"]), b["phase"], b.get("epoch")
    total = b.get("total_steps")
    end = next((e for e in b.get("epoch_ends") or [] if e >= step), None)
    if phase == "train":
        if total is not None and step >= total:
            pos = "past its last step"
        elif b.get("micros"):
            pos = f"in step {step + 1}, micro-batch {b.get('micro')} of {b['micros']}"
        else:
            pos = f"in step {step + 1}"
        if end is not None and end > step:
            pos += f" of epoch {epoch} (its epoch ends at step {end})"
    else:
        pos = {
            "init": "starting up",
            "checkpoint": f"checkpointing after step {step}",
            "export": f"exporting after step {step}",
            "done": "done",
        }.get(phase, phase)
        if phase == "checkpoint" and end == step:
            pos += f", the last step of its epoch {epoch}"
    plan = f", {total} steps planned" if total is not None else ""
    return f"rank {b['rank']}: {pos} (last heartbeat {now - b['time']:.1f} s ago{plan})"


def _list(ranks) -> str:
    return ", ".join(str(r) for r in ranks)


def _rank_power(beats: dict[int, dict], power: dict) -> dict[int, tuple[float, float, float] | None]:
    return {r: power.get((b.get("host"), int(b.get("local_rank") or 0))) for r, b in beats.items()}


def _power_fields(g) -> dict:
    return {} if not g else {"power_w": round(g[0], 1), "util_gpu": round(g[1], 1)}


def _low_band(gpus: dict, table: TriageTable | None) -> bool | None:
    """True: every GPU we have data for is in the low band; False: some GPU is busy; None: no data."""
    have = [g for g in gpus.values() if g]
    if table is None or not have:
        return None
    return all(g[0] < table.low_max_w for g in have)


def process_tree(root: int) -> list[int]:
    """Descendants of `root` (not root itself), parents before children, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def kill_tree(root: int, grace_s: float) -> dict:
    """SIGTERM every process under `root`, then SIGKILL what is left after `grace_s`."""
    pids = process_tree(root)
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    survivors = [p for p in pids if _alive(p)]
    for pid in survivors + [p for p in process_tree(root) if p not in pids]:
        _signal(pid, signal.SIGKILL)
    return {"terminated": pids, "killed_after_grace": survivors}


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def scancel(job_id: str) -> dict:
    r = subprocess.run(["scancel", str(job_id)], capture_output=True, text=True, timeout=60)
    return {"scancel": job_id, "returncode": r.returncode, "stderr": r.stderr.strip()}


@dataclass(frozen=True)
class CostBasis:
    """What a hang would have cost without the watcher: the collective timeout, and the Slurm job's time limit."""

    collective_timeout_s: float | None = None
    job_limit_s: float | None = None

    @classmethod
    def from_config(cls, config: dict) -> CostBasis:
        slurm = config["cluster"]["launcher"] != "local"
        return cls(
            config["train"]["collective_timeout_s"],
            config["cluster"]["slurm"]["train"]["runtime_min"] * 60.0 if slurm else None,
        )


def _hang_cost(record: dict, verdict: dict, power: dict, world: int, basis: CostBasis, started: float) -> dict:
    """watcher.json's cost: GPU-hours and energy from the last progress to the kill, and without the watcher."""
    last_progress = record["detected_at"] - float(verdict.get("stalled_for_s") or 0.0)
    draws = [p for p, _, _ in power.values() if p == p]  # NaN: no reading
    gpus = len(power) or world
    return hang_cost(
        last_progress,
        record["killed_at"],
        gpus,
        sum(draws) if draws else None,
        basis.collective_timeout_s,
        basis.job_limit_s,
        started,
    )


def watch(
    run: Path,
    world: int,
    s: WatchSettings,
    table: TriageTable | None,
    pid: int | None = None,
    slurm_job: str | None = None,
    out: Path | None = None,
    stop: threading.Event | None = None,
    cost_basis: CostBasis = CostBasis(),
) -> dict:
    """Poll until the job finishes (all ranks done, the watched process is gone, or `stop` is set: the
    launcher's SIGTERM once the job ended) or a verdict acts."""
    out = out or run / WATCHER
    started = time.time()
    tail = TraceTail(run / "telemetry", keep_s=max(s.hang_after_s, 10.0) * 2)
    record = {
        "verdict": "running",
        "started": started,
        "settings": asdict(s),
        "world_size": world,
        "table": table.gpu_model if table else None,
        "pid": pid,
        "slurm_job": slurm_job,
        "longest_stall_s": 0.0,
    }
    stop = stop or threading.Event()
    write_json_atomic(out, record, nonfinite="null")  # a GPU with no power reading: null
    while not stop.wait(s.poll_s):
        now = time.time()
        beats = read_heartbeats(run, since=started)
        tail.update()
        power = tail.window(now - s.hang_after_s)
        active = [b["time"] for b in beats.values() if b["phase"] != "done"]
        if active:
            record["longest_stall_s"] = round(max(record["longest_stall_s"], now - max(active)), 3)
        verdict = diagnose(beats, world, now, started, power, table, s)
        if verdict is not None:
            record.update(verdict, detected_at=now, action=s.action)
            write_json_atomic(out, record, nonfinite="null")  # a GPU with no power reading: null
            print(f"watch: {verdict['reason']}", file=sys.stderr, flush=True)
            if s.action == "kill":
                record["kill"] = _stop_job(pid, slurm_job, s.kill_grace_s)
                record["killed_at"] = time.time()
                record["cost"] = _hang_cost(record, verdict, power, world, cost_basis, started)
                write_json_atomic(out, record, nonfinite="null")  # a GPU with no power reading: null
                return record
            s = WatchSettings(
                **(
                    asdict(s)
                    | {
                        "hang_after_s": float("inf"),
                        "checkpoint_after_s": float("inf"),
                        "startup_after_s": float("inf"),
                        "busy_stall_after_s": float("inf"),
                    }
                )
            )
            continue  # warn: record once and keep watching silently
        if beats and len(beats) == world and all(b["phase"] == "done" for b in beats.values()):
            break
        if pid is not None and not _alive(pid):
            break
    if record["verdict"] == "running":
        record["verdict"] = "healthy"
    record["ended"] = time.time()
    write_json_atomic(out, record, nonfinite="null")  # a GPU with no power reading: null
    return record


def run_watch(
    config: dict, run: Path, pid: int | None = None, slurm_job: str | None = None, out: Path | None = None
) -> dict:
    """`wattgate watch`: watch one job with the run's settings and triage table until it ends or a verdict acts.

    SIGTERM or SIGINT (the launcher's "the job has ended") finish the record instead of killing the watcher.
    """
    from wattgate.config import world_size
    from wattgate.power.triage.settings import TriageSettings

    settings = TriageSettings.merge(config)
    table = settings.table() if settings.has_table else None
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    return watch(
        run,
        world_size(config),
        WatchSettings.from_config(config),
        table,
        pid,
        slurm_job,
        out,
        stop,
        CostBasis.from_config(config),
    )


def _stop_job(pid: int | None, slurm_job: str | None, grace_s: float) -> dict:
    if slurm_job:
        if pid is not None:  # the inner srun: it forwards SIGTERM to every node's tasks (and their samplers)
            _signal(pid, signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline and _alive(pid):
                time.sleep(0.1)
            if not _alive(pid):
                return {"terminated": [pid]}
        return scancel(slurm_job)
    # local: everything under the node's sampler wrapper, which then finishes its trace and exits
    return kill_tree(pid, grace_s) if pid is not None else {}
