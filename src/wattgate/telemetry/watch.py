"""`wattgate watch`: one watcher per job, outside the training processes.

Every `poll_s` it reads each rank's heartbeat (a bad one is that rank's missing heartbeat,
telemetry/watch_inputs.py), the last seconds of every node's power trace and, for ranks on this
host, their processes' CPU time, and asks telemetry/watch_verdicts.py what a stall means (deadlock,
slow step, an overlong checkpoint). Action `kill` stops the job (telemetry/kill.py); `warn` only
records. `watcher.json` holds the verdict either way, and claims a saving only for a confirmed deadlock. A
job that ends without a verdict ends `failed` when a rank left a failure record (telemetry/failures.py), else
`healthy`; launch then writes the final verdict from the job's exit status (`stopped`, `failed`, `healthy`). A
straggler (one rank the others keep waiting for, telemetry/lag_watch.py) is warned about once per rank and never
stops the job.
"""

from __future__ import annotations

import math
import signal
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

from wattgate.artifacts import check_file_output, write_json_atomic
from wattgate.errors import InputError
from wattgate.telemetry.failures import name_failure
from wattgate.telemetry.hang_cost import CostBasis, watcher_cost
from wattgate.telemetry.lag_watch import LagWatch, warning_line
from wattgate.triage_tables import TriageSettings
from wattgate.records.watcher import AbortRequest, JobKill, WatcherRecord, WatcherSettings, WatchWarning
from wattgate.run_files import ABORT_REQUEST, WATCHER, check_no_finding, is_watcher_record
from wattgate.telemetry.kill import _alive, stop_job
from wattgate.telemetry.watch_inputs import COLLECTIVE_PHASES, ActivityMeter, BeatReader, TraceTail, first_steps
from wattgate.telemetry.watch_verdicts import WatchedJob, assess, with_expected_collectives
from wattgate.records.gate import Collectives
from wattgate.records.run_config import RunConfig

NO_COST_BASIS = CostBasis()  # the collective timeout and the job's limit unknown (hang_cost.py's defaults)


def watch(
    run: Path,
    job: WatchedJob,
    pid: int | None = None,
    slurm_job: str | None = None,
    out: Path | None = None,
    stop: threading.Event | None = None,
    cost_basis: CostBasis = NO_COST_BASIS,
) -> WatcherRecord:
    """Poll until the job finishes (all ranks done, the watched process is gone, or `stop` is set: the
    launcher's SIGTERM once the job ended) or a verdict acts."""
    world, s, table = job.world, job.settings, job.table
    out = out or run / WATCHER
    started = time.time()
    tail = TraceTail(run / "telemetry", keep_s=max(s.hang_after_s, 10.0) * 2)
    reader, meter = BeatReader(run, world, started), ActivityMeter(s.hang_after_s)
    lag = LagWatch(table.low_max_w if table is not None else None)
    firsts: dict[int, dict[str, int]] = {}
    record = WatcherRecord(
        verdict="running",
        started=started,
        settings=s,
        world_size=world,
        table=table.gpu_model if table else None,
        pid=pid,
        slurm_job=slurm_job,
        longest_stall_s=0.0,
        warnings=(),
        warnings_total=0,
        bad_heartbeats={},
        stragglers=(),
    )
    stop = stop or threading.Event()
    collectives = read_collectives(run)
    write_watcher(out, record)
    warned_for, printed_at = None, -math.inf  # the last progress time of the stall warned about; its print
    while not stop.wait(s.poll_s):
        now = time.time()
        beats = reader.read()
        if (noted := _note_bad_heartbeats(record, reader.bad)) is not record:
            record = noted
            write_watcher(out, record)
        meter.sample(beats, now)
        for r, b in beats.items():
            if b.phase in COLLECTIVE_PHASES and b.phase not in firsts.get(r, {}):
                firsts[r] = first_steps(run, r, started)
        tail.update()
        straggler = lag.observe(beats, now, meter.samples, tail)
        if straggler is not None:  # once per rank; a straggler never stops the job
            print(f"watch: warning: {warning_line(straggler)}", file=sys.stderr, flush=True)
            record = record.replace(stragglers=lag.records())
            write_watcher(out, record)
        power = tail.window(now - s.hang_after_s)
        active = [b.time for b in beats.values() if b.phase != "done"]
        if active:
            assert record.longest_stall_s is not None  # starts at 0.0
            record = record.replace(longest_stall_s=round(max(record.longest_stall_s, now - max(active)), 3))
        verdict, warning = assess(job, beats, now, started, power, meter.activity(now), firsts)
        if warning and warned_for != max(active):  # once per stall
            warned_for = max(active)
            record, printed_at = note_warning(record, warning, now, printed_at)
            write_watcher(out, record)
        if verdict is not None:
            verdict = with_expected_collectives(verdict, beats, collectives)
            record = record.with_verdict(verdict, detected_at=now, action=s.action, stragglers=lag.records())
            write_watcher(out, record)
            print(f"watch: {verdict.reason}", file=sys.stderr, flush=True)
            if s.action == "kill":
                # every rank, on every node, ends within a second of this file (train/stop.py start_abort_watch)
                write_json_atomic(run / ABORT_REQUEST, AbortRequest(reason=verdict.reason, time=time.time()).to_json())
                record = record.replace(kill=JobKill(**stop_job(pid, slurm_job, s.kill_grace_s)), killed_at=time.time())
                record = record.replace(cost=watcher_cost(record, verdict, power, world, cost_basis, started))
                write_watcher(out, record)
                return record
            never = float("inf")
            s = replace(
                s, hang_after_s=never, checkpoint_after_s=never, startup_after_s=never, busy_stall_after_s=never
            )
            job = replace(job, settings=s)
            continue  # warn: record once and keep watching silently
        if beats and len(beats) == world and all(b.phase == "done" for b in beats.values()):
            break
        if pid is not None and not _alive(pid):
            break
    if record.verdict == "running":
        # a rank that died or failed (its records beside the heartbeats) is no healthy end; launch adds the exit status
        failure = name_failure(run, started)
        if failure is not None:
            record = record.replace(
                verdict="failed", reason=failure.line, failed_rank=failure.rank, cause=failure.cause
            )
        else:
            record = record.replace(verdict="healthy")
    # the warned ranks' counts over the whole run
    record = record.replace(ended=time.time(), stragglers=lag.records())
    write_watcher(out, record)
    return record


def write_watcher(out: Path, record: WatcherRecord) -> None:
    write_json_atomic(out, record.to_json(), nonfinite="null")  # a GPU with no power reading: null


COLLECTIVES = "collectives.json"  # launch copies the gate's collective proof into the run folder


def read_collectives(run: Path) -> Collectives | None:
    """The gate's collective proof for this run (gate.json `collectives`, copied by launch); None without one
    (or an unreadable one: the watcher's verdicts then name no expected collective)."""
    try:
        return Collectives.read(Path(run) / COLLECTIVES)
    except InputError:
        return None


WARN_PRINT_EVERY_S = 300.0  # a run whose every step outlasts hang_after_s would print a line per step


def note_warning(record: WatcherRecord, warning: str, now: float, printed_at: float) -> tuple[WatcherRecord, float]:
    """The record keeping the last 20 slow-step warnings, and when one was last printed (one every
    WARN_PRINT_EVERY_S at most)."""
    record = record.replace(
        warnings=((*(record.warnings or ()), WatchWarning(time=now, warning=warning)))[-20:],
        warnings_total=(record.warnings_total or 0) + 1,
    )
    if now - printed_at < WARN_PRINT_EVERY_S:
        return record, printed_at
    later = f" (more within {WARN_PRINT_EVERY_S:.0f} s go to watcher.json only)"
    print(f"watch: warning: {warning}{later}", file=sys.stderr, flush=True)
    return record, now


def _note_bad_heartbeats(record: WatcherRecord, bad: dict[str, str]) -> WatcherRecord:
    """Print each heartbeat problem once; the record with them (the same record when none is new)."""
    known = record.bad_heartbeats or {}
    new = {name: why for name, why in bad.items() if known.get(name) != why}
    for name, why in new.items():
        print(f"watch: heartbeat/{name}: {why}; that rank's last good heartbeat stands", file=sys.stderr, flush=True)
    return record.replace(bad_heartbeats=known | new) if new else record


def run_watch(
    config: RunConfig, run: Path, pid: int | None = None, slurm_job: str | None = None, out: Path | None = None
) -> WatcherRecord:
    """`wattgate watch`: watch one job with the run's settings and triage table until it ends or a verdict acts.

    SIGTERM or SIGINT (the launcher's "the job has ended") finish the record instead of killing the watcher.
    """
    from wattgate.config import world_size

    run = Path(run)
    if not run.is_dir():  # a mistyped --run-dir would be watched as a job with no heartbeats, and called healthy
        raise InputError(f"{run}: no such run folder (--run-dir is the run folder the job writes into)")
    dest = Path(out) if out is not None else run / WATCHER
    check_file_output(dest, "watch", is_watcher_record)  # before the job is watched
    check_no_finding(dest)
    settings = TriageSettings.merge(config)
    table = settings.table() if settings.has_table else None
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    job = WatchedJob(world=world_size(config), settings=WatcherSettings.from_config(config.watcher), table=table)
    return watch(run, job, pid=pid, slurm_job=slurm_job, out=out, stop=stop, cost_basis=CostBasis.from_config(config))
