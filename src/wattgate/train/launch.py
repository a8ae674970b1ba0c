"""The train launcher: builds the torchrun (or srun + torchrun) command for this config, and runs it.

Local (the embedded default, and a one-node Slurm job):
`torchrun --standalone --nproc-per-node N`.
Slurm, several nodes: this launcher runs once, on the allocation's first node
(the batch host), and starts one task per node (`srun --nodes=N
--ntasks-per-node=1`), each running its node's sampler around torchrun with
`--nnodes N`, a c10d rendezvous on this host and a port derived from the job
id (two jobs at once must not share a rendezvous). c10d assigns node ranks in
join order, so the trainer reads its rank from the environment, never from
--node_rank.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from wattgate.artifacts import reserve_spare, write_json_atomic
from wattgate.run_files import (
    GATED_CONFIG,
    gate_folder_of_plan,
    read_plan,
    MARKER_HASH_FILES,
    claim_output,
    read_gate_report,
    read_marker_hashes,
    read_watcher,
)
from wattgate.heartbeats import clear_rank_failures
from wattgate.run_files import (
    ABORT_REQUEST,
    ATTEMPT_OUTCOME,
    MODEL_HASHES,
    LAUNCH_LOCK,
    STOP_REQUEST,
    STOPPED,
    TRAIN_LOCK,
    TRAINED,
    WATCHER,
    read_json_object,
)
from wattgate.identity import run_identity
from wattgate.records.attempt import Stopped
from wattgate.records.checkpoint import RunIdentity
from wattgate.train.previous_run import record_run_identity, set_aside_earlier_run
from wattgate.records.base import Where
from wattgate.records.watcher import AbortRequest, WatcherRecord
from wattgate.train.run_log import start_run_logs
from wattgate.telemetry.failures import RankFailure, finish_record, name_failure, status_text
from wattgate.telemetry.watch import COLLECTIVES
from wattgate.train.launch_stop import StopControl, ignore_usr1, stop_margin_s
from wattgate.train.run_lock import SLURM_JOB_ID, check_unlocked, hold_run_lock, renumber_held
from wattgate.errors import InputError
from wattgate.gpus import is_cpu
from wattgate.telemetry.sampler import sampler_command
from wattgate.records.run_config import RunConfig

RDZV_PORT_BASE = 20000

# glibc settings for CPU ranks. With its adaptive defaults glibc keeps freed layer-sized buffers in
# the heap, so a rank's peak grew by ~1.5x the added fp32 model per layer added (wattgate's former
# fixed 256 MB mmap threshold: 3.8x); buffers above 1 MiB mapped and unmapped on their own made it
# ~0.7x, what a sharded step needs (bench/steady_memory.py). A value already in the environment wins.
CPU_ALLOCATOR_ENV = {"MALLOC_MMAP_THRESHOLD_": "1048576"}


@dataclass(frozen=True)
class LaunchSpec:
    nodes: int
    procs_per_node: int
    launcher: str  # local | slurm
    omp_threads: int
    rendezvous_host: str | None
    job_id: str | None
    cpus_per_node: int | None = None  # Slurm: CPUs per node task (None: every CPU the job holds there)
    cpu_ranks: bool = False  # cluster.gpu_model cpu: the ranks compute on the host (CPU_ALLOCATOR_ENV)
    stop_grace_s: float = 300.0  # a repeated stop signal within this is the same request (stop_margin_s)


def resolve_launch(config: RunConfig, environ: dict | None = None) -> LaunchSpec:
    env = os.environ if environ is None else environ
    c = config.cluster
    launcher = c.launcher
    if launcher == "auto":
        # one node needs no srun: a one-node Slurm job already runs inside its node's step
        launcher = "slurm" if env.get(SLURM_JOB_ID) and c.nodes > 1 else "local"
    if launcher == "local" and c.nodes != 1:
        raise InputError(
            f"config: cluster.nodes is {c.nodes} but there is no Slurm allocation; "
            "multi-node runs go through Slurm (cluster.launcher: slurm)"
        )
    if launcher == "slurm":
        # unset: the train rule asked for one CPU per process (gpu_job in workflow/rules/common.smk),
        # though the job may hold more (--exclusive); each node's task gets them all
        cpus = c.cpus_per_node or c.gpus_per_node
    else:
        cpus = c.cpus_per_node or _usable_cpus()
    return LaunchSpec(
        nodes=c.nodes,
        procs_per_node=c.gpus_per_node,
        launcher=launcher,
        # one share of the node's cores per process: Snakemake's threads-derived value would oversubscribe
        omp_threads=max(1, cpus // c.gpus_per_node),
        # this launcher runs on the batch host, which is in the allocation (so its agent hosts the
        # c10d store) and whose hostname resolves, where Slurm node names may not
        rendezvous_host=c.rendezvous_host or (socket.gethostname() if launcher == "slurm" else None),
        job_id=env.get(SLURM_JOB_ID),
        cpus_per_node=c.cpus_per_node if launcher == "slurm" else None,
        cpu_ranks=is_cpu(c.gpu_model),
        stop_grace_s=float(c.slurm.train.stop_margin_s),
    )


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))  # inside a Slurm step: the step's CPUs, not the node's
    except AttributeError:
        return os.cpu_count() or 1


def train_args(config_path: Path, pretokenized: Path, plan: Path, out: Path) -> list[str]:
    return [
        "-m",
        "wattgate",
        "train",
        "--config",
        str(config_path),
        "--pretokenized",
        str(pretokenized),
        "--plan",
        str(plan),
        "--run-dir",
        str(out),
    ]


def build_launch_command(
    spec: LaunchSpec,
    args: list[str],
    python: str = sys.executable,
    sample: tuple[str, float] | None = None,
    run: str | os.PathLike | None = None,
) -> list[str]:
    """argv that starts every rank of the job from this (first-node or local) process.

    With `sample=(trace_path, interval_s)` each node's torchrun runs under that
    node's telemetry sampler (`{host}` in the path becomes the node's name). With `run` (the run folder) each
    node's torchrun is wattgate's (train/torchrun.py), which records every failed rank's exit status or signal there.
    """
    torchrun = [python, "-m", "torch.distributed.run"] if run is None else agent_command(run, spec.stop_grace_s, python)
    wrap = [] if sample is None else sampler_command(sample[0], sample[1], [], python)
    if spec.launcher == "local":
        return wrap + torchrun + ["--standalone", f"--nproc-per-node={spec.procs_per_node}"] + args
    if not spec.job_id:
        raise InputError("launcher slurm: SLURM_JOB_ID is not set; run inside an allocation (or launcher: local)")
    port = RDZV_PORT_BASE + int(spec.job_id) % 10000
    host = (
        shlex.quote(spec.rendezvous_host)
        if spec.rendezvous_host
        else '$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)'
    )
    inner = " ".join(
        [_quote_node_path(x) for x in wrap + torchrun]
        + [
            f"--nnodes={spec.nodes}",
            f"--nproc-per-node={spec.procs_per_node}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={host}:{port}",
            f"--rdzv-id={shlex.quote(spec.job_id)}",
        ]
        + [shlex.quote(a) for a in args]
    )
    # each task names its Slurm node in the job's log (several nodes may share one hostname)
    hello = (
        'echo "launch: node ${SLURMD_NODENAME:-?} (SLURM_NODEID ${SLURM_NODEID:-?} of '
        '${SLURM_NNODES:-?}) on $(uname -n), job ${SLURM_JOB_ID:-?}"'
    )
    # The jobstep strips SLURM_* but the job id, so srun is told the node count itself. srun does not
    # inherit the job's --cpus-per-task (Slurm >= 22.05): pass cluster.cpus_per_node when set, else
    # leave it out so each task gets every CPU the job holds on its node. --kill-on-bad-exit ends
    # every node's task when one fails instead of leaving the others waiting in a collective.
    cpus = [f"--cpus-per-task={spec.cpus_per_node}"] if spec.cpus_per_node else []
    # SIGUSR1 ignored before the exec, so the sampler and torchrun keep it ignored (they have no handler and would die
    # of a USR1 sent to every process of the step); the ranks install their own (train/launch_stop.py)
    return [
        "srun",
        f"--nodes={spec.nodes}",
        "--ntasks-per-node=1",
        *cpus,
        "--kill-on-bad-exit=1",
        f"--jobid={spec.job_id}",
        "bash",
        "-c",
        f"{hello}; trap '' USR1; exec {inner}",
    ]


def agent_command(run: str | os.PathLike, stop_grace_s: float, python: str = sys.executable) -> list[str]:
    """torchrun as wattgate starts it: torch's own, recording each failed rank's exit into the run folder and
    turning a stop signal into the run folder's stop request (train/torchrun.py)."""
    return [python, "-m", "wattgate.train.torchrun", "--run-dir", str(run), "--stop-grace-s", f"{stop_grace_s:g}"]


def _quote_node_path(arg: str) -> str:
    """Shell-quote, with `{host}` (a per-node file name) becoming the task's Slurm node name."""
    return '"${SLURMD_NODENAME:-$(uname -n)}"'.join(shlex.quote(part) for part in arg.split("{host}"))


def launch_env(spec: LaunchSpec, base: dict | None = None) -> dict:
    env = dict(os.environ if base is None else base)
    env["OMP_NUM_THREADS"] = str(spec.omp_threads)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if spec.cpu_ranks:
        for name, value in CPU_ALLOCATOR_ENV.items():
            env.setdefault(name, value)
    return env


def allocator_record(environ: dict | None = None) -> dict:
    """How this rank's glibc allocator is set, for TRAINED's `allocator`: the MALLOC_* environment when it
    names an mmap threshold (launch sets one for CPU ranks), else train/distributed.py's keep_freed_memory
    thresholds (256 MiB mmap, 1 GiB trim)."""
    env = os.environ if environ is None else environ
    given = {k: env[k] for k in sorted(env) if k.startswith("MALLOC_")}
    source = "environment" if "MALLOC_MMAP_THRESHOLD_" in given else "keep_freed_memory"
    return {"source": source, **given}


def watcher_command(
    config_path: Path, out: Path, pid: int, job_id: str | None, python: str = sys.executable
) -> list[str]:
    argv = [python, "-m", "wattgate", "watch", "--config", str(config_path), "--run-dir", str(out), "--pid", str(pid)]
    return argv + (["--slurm-job", job_id] if job_id else [])


@dataclass(frozen=True)
class LaunchResult:
    returncode: int
    watcher: WatcherRecord | None  # watcher.json after the job ended (None when the watcher is off)
    stopped: Stopped | None = None  # STOPPED of this attempt: a graceful stop ("stopped, resume me")
    failure: RankFailure | None = None  # the first failed rank and its cause, when a rank left a record
    hard_stop: str | None = None  # the second signal that stopped the job at once
    attempt: int = 1  # this launch's number in the run folder (launch.lock counts them)


def check_gate_marker(config: RunConfig, plan: Path, gate: Path) -> Path:
    """The gate's verdict marker for exactly this plan, or an InputError (exit 2) saying what to rerun.

    With gate.enforce true only PASSED counts; with false, UNENFORCED (the user chose to run past
    the gate) does too. Either way the marker must name the sha256 of this plan.json and packs.parquet.
    """
    from wattgate.artifacts import sha256_file

    names = ["PASSED"] if config.gate.enforce else ["PASSED", "UNENFORCED"]
    marker = next((gate / n for n in names if (gate / n).is_file()), None)
    if marker is None:
        raise InputError(
            f"{gate}: no {' or '.join(names)} marker: the gate has not passed this plan; "
            f"run `wattgate gate ... --plan {plan} --out {gate}` (or snakemake) first"
        )
    recorded = read_marker_hashes(marker)
    for name in MARKER_HASH_FILES:
        try:
            actual = sha256_file(plan / name)
        except OSError as exc:
            raise InputError(f"{plan / name}: cannot read ({exc.strerror})") from None
        if recorded[name] != actual:
            raise InputError(
                f"{marker}: the gate checked another {name} (sha256 {recorded[name]}, "
                f"this one is {actual}); rerun the gate on this plan before launching"
            )
    check_gated_config(config, marker, recorded[GATED_CONFIG])
    return marker


def check_gated_config(config: RunConfig, marker: Path, gated_sha256: str) -> None:
    """The config this job would train is the one the gate checked (the marker names its sha256), or an
    InputError naming every key that differs from the gate's copy beside the marker."""
    from wattgate.config import config_differences, config_sha256, load_run_config

    if config_sha256(config) == gated_sha256:
        return
    copy = marker.parent / GATED_CONFIG
    try:
        gated = load_run_config(copy)
    except InputError:
        gated = None
    differs = config_differences(config, gated) if gated is not None else ["(the gate's copy is missing or unreadable)"]
    raise InputError(
        f"the config differs from the one the gate checked ({copy}): {'; '.join(differs[:8])}"
        + (f"; and {len(differs) - 8} more" if len(differs) > 8 else "")
        + f"; train with --config {copy}, or rerun the gate with this config"
    )


def copy_gate_records(gate_dir: Path, out: Path) -> None:
    """What the job reads of the gate's verdict on this plan, into the run folder (an earlier plan's is removed):
    the collective proof, for the watcher's verdict on a hang (which step class each rank was in, and the
    collective the proof expected next), and model.path's hashes, which every rank checks before the first step."""
    report = read_gate_report(gate_dir)
    proof = report.collectives if report is not None else None
    model = report.model_files if report is not None else None
    for target, record in (
        (out / COLLECTIVES, proof if proof is not None and proof.classes else None),
        (out / MODEL_HASHES, model),
    ):
        if record is not None:
            write_json_atomic(target, record.to_json())
        else:
            target.unlink(missing_ok=True)


def this_run_identity(config: RunConfig, plan: Path, pretokenized: Path) -> tuple[RunIdentity, str | None]:
    """The run identity this launch trains under (wattgate/identity.py) and its plan's packs_sha256."""
    return run_identity(config, plan, pretokenized), read_plan(plan)[0].packs_sha256


def run_launch(
    config: RunConfig, config_path: Path, pretokenized: Path, plan: Path, out: Path, gate: Path | None = None
) -> LaunchResult:
    """Start the job (under the node samplers) in its own session, with the watcher beside it.

    Refuses (InputError) a plan the gate did not pass: `gate` defaults to run_files.gate_folder_of_plan
    (results/plan/<run> -> results/gate/<run>), and a run folder another trainer holds (launch.lock). The first
    SIGTERM, SIGUSR1 or SIGINT, or the Slurm job's end drawing near, asks the ranks for a graceful stop
    (train/launch_stop.py); a second SIGTERM/SIGINT is forwarded to the job. Once the job has ended the watcher is
    stopped and watcher.json gets its final verdict: the watcher's own, else stopped, failed (naming the first
    failed rank) or healthy.
    """
    gate_dir = gate or gate_folder_of_plan(plan)
    check_gate_marker(config, plan, gate_dir)
    claim_output(out, "train")  # a folder train did not write is refused before the job starts
    reserve_spare(out / ATTEMPT_OUTCOME)  # room for how this attempt ends, should the job fill the disk
    spec = resolve_launch(config)
    attempt = hold_run_lock(out, LAUNCH_LOCK, "wattgate launch").attempt
    check_unlocked(out, TRAIN_LOCK)  # a job whose launcher was killed may still train here: clear nothing of it
    identity, packs_sha256 = this_run_identity(config, plan, pretokenized)
    earlier = set_aside_earlier_run(out, identity)  # one run per folder: a report never mixes two
    if earlier:
        attempt = renumber_held(out, LAUNCH_LOCK, 1).attempt  # a new run: its attempts count from 1
    assert attempt is not None  # hold_run_lock and renumber_held always number their holder
    start_run_logs(out)  # train.log and train.attempts.log: only now, so a refused launch never touches them
    if earlier:
        print(earlier, flush=True)
    record_run_identity(out, identity, packs_sha256)
    started = time.time()
    tel = config.telemetry
    sample = (str(out / "telemetry" / "{host}.parquet"), tel.interval_s) if tel.enabled else None
    argv = build_launch_command(spec, train_args(config_path, pretokenized, plan, out), sample=sample, run=out)
    clear_attempt_files(out)
    copy_gate_records(gate_dir, out)
    job = f"Slurm job {spec.job_id}" if spec.job_id else "no Slurm job"
    print(f"launch: attempt {attempt} at {_clock(started)}, {job}, on {socket.gethostname()}: {out}", flush=True)
    print(f"launch: {' '.join(shlex.quote(a) for a in argv)}", flush=True)
    started_procs: list[subprocess.Popen] = []

    def forward(signum):
        if control.hard_stop is not None:  # every rank's abort watch ends it, on every node (train/stop.py)
            abort = AbortRequest(reason=f"a second {control.hard_stop} to wattgate launch", time=time.time())
            try:
                write_json_atomic(out / ABORT_REQUEST, abort.to_json())
            except OSError:
                pass  # the SIGTERM below still reaches torchrun
        for p in started_procs:
            try:
                os.killpg(p.pid, signum)
            except ProcessLookupError:
                pass

    # before the job starts: a signal from now on is a stop request (the job then stops at its first step boundary)
    control = StopControl(out, forward, spec.stop_grace_s)
    control.install()
    proc = subprocess.Popen(argv, env=launch_env(spec), start_new_session=True, preexec_fn=ignore_usr1)
    started_procs.append(proc)
    watcher = None
    if config.watcher.enabled:
        # on Slurm the watched pid is the srun (its SIGTERM reaches every node); scancel is the fallback
        slurm_job = spec.job_id if spec.launcher == "slurm" else None
        watcher = subprocess.Popen(
            watcher_command(config_path, out, proc.pid, slurm_job), start_new_session=True, preexec_fn=ignore_usr1
        )
        started_procs.append(watcher)
    if control.hard_stop is not None:  # both signals came while the job was starting
        forward(signal.SIGTERM)
    if spec.job_id and stop_margin_s(config) > 0:
        control.start_slurm_timer(spec.job_id, stop_margin_s(config))
    rc = proc.wait()
    control.done.set()
    verdict = _stop_watcher(watcher, out)
    stopped = read_stopped(out)
    failure = name_failure(out) if rc != 0 else None  # records of earlier attempts were cleared before this one
    if stopped is not None and rc != 0 and failure is None:
        # torchrun given SIGTERM itself (Slurm signals every process) ends through its signal path, non-zero, after
        # its ranks stopped cleanly: STOPPED is written only once the stop checkpoint is published
        print(f"launch: the job exited with {status_text(rc)} after its graceful stop", file=sys.stderr, flush=True)
    elif rc != 0:
        stopped = None
    if verdict is not None:
        verdict = finish_record(verdict, rc, failure, stopped, hard_stop=control.hard_stop)
        try:
            write_json_atomic(out / WATCHER, verdict.to_json(), nonfinite="null")
        except OSError as exc:
            print(f"launch: WARNING: {out / WATCHER}: cannot write the final verdict ({exc.strerror})", file=sys.stderr)
    return LaunchResult(rc, verdict, stopped, failure, control.hard_stop, attempt)


def clear_attempt_files(out: Path) -> None:
    """An earlier attempt's verdict, last heartbeats, failure records and stop files must not be read as this
    attempt's (a stop request left behind would stop this attempt at its first step)."""
    for name in (WATCHER, STOP_REQUEST, STOPPED, ABORT_REQUEST):
        (out / name).unlink(missing_ok=True)
    for stale in (out / "heartbeat").glob("rank-*.json"):
        stale.unlink()
    clear_rank_failures(out)


def _stop_watcher(watcher: subprocess.Popen | None, out: Path) -> WatcherRecord | None:
    """Stop the watcher once the job has ended (its SIGTERM finishes the record) and read watcher.json."""
    if watcher is None:
        return None
    if watcher.poll() is None:
        watcher.send_signal(signal.SIGTERM)
    try:
        watcher.wait(timeout=60)
    except subprocess.TimeoutExpired:
        watcher.kill()
        watcher.wait()
    try:
        return read_watcher(out)
    except InputError as exc:  # the job's own exit status still stands; say why there is no verdict
        print(f"launch: WARNING: no watcher verdict: {exc}", file=sys.stderr, flush=True)
        return None


def read_stopped(out: Path) -> Stopped | None:
    """STOPPED (launch removes it before each attempt, so it is this attempt's), unless TRAINED was written after it
    (a run that finished after all). Both mtimes come from the same filesystem: no clock of another host enters."""
    path = out / STOPPED
    try:
        stopped_at = path.stat().st_mtime
    except OSError:
        return None
    try:
        if (out / TRAINED).stat().st_mtime >= stopped_at:
            return None
    except OSError:
        pass
    try:
        return Stopped.from_json(read_json_object(path, "the stop record", "train"), Where(str(path), "train"))
    except InputError as exc:
        print(f"launch: WARNING: {exc}", file=sys.stderr, flush=True)
        return Stopped(reason="STOPPED unreadable")


def _clock(t: float) -> str:
    return datetime.fromtimestamp(t).isoformat(sep=" ", timespec="seconds")
