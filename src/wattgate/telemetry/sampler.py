"""`wattgate sample`: one NVML sampler per node, writing the trace contract at a fixed rate.

Run alone (`wattgate sample --out F`, stopped by SIGTERM/SIGINT) or as a
wrapper beside a command (`wattgate sample --out F -- torchrun ...`): then it
samples while the command runs, forwards SIGTERM/SIGINT to it, and exits with
its status. Either way it finishes the trace on the way out, and a SIGKILL
still leaves every segment flushed so far.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from wattgate.telemetry.nvml import NvmlSource, NvmlUnavailable
from wattgate.trace import TraceWriter, check_trace_output, expand_host

PR_SET_PDEATHSIG = 1


def stop_with_parent(signum: int = signal.SIGTERM) -> None:
    """Linux: get `signum` when the parent dies, so a killed launcher never leaves a sampler behind."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signum)
    except (OSError, AttributeError):
        pass


class StopFlag:
    """Set by SIGTERM/SIGINT; in wrapper mode the signal is also forwarded to the command."""

    def __init__(self):
        self.stop = False
        self.signum: int | None = None
        self.child: subprocess.Popen | None = None

    def __call__(self, signum, _frame):
        self.stop, self.signum = True, signum
        self.forward()

    def forward(self) -> None:
        """Pass a stop signal on to the command; also called right after the command starts, so a signal that
        arrived between its start and `child` being set still reaches it."""
        if self.stop and self.child is not None and self.child.poll() is None:
            try:
                os.killpg(self.child.pid, self.signum or signal.SIGTERM)
            except ProcessLookupError:
                pass

    def adopt(self, child: subprocess.Popen) -> subprocess.Popen:
        self.child = child
        self.forward()
        return child

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self)


def sample_loop(source, writer: TraceWriter, interval_s: float, flag: StopFlag, max_samples: int | None = None) -> int:
    """Read every GPU on a fixed grid of times (no drift); skip ticks we fell behind on rather than burst. With a
    command, until it ends: a stop signal passed on to it starts a graceful stop whose power is part of the run."""
    t0 = time.monotonic()
    tick = n = 0
    while not flag.stop or flag.child is not None:
        for row in source.read():
            writer.add(row)
        n += 1
        if max_samples is not None and n >= max_samples:
            break
        if flag.child is not None and flag.child.poll() is not None:
            break
        tick = max(tick + 1, int((time.monotonic() - t0) / interval_s))
        delay = t0 + tick * interval_s - time.monotonic()
        if delay > 0:
            time.sleep(delay)
    return n


def run_sampler(
    out: str,
    interval_s: float = 0.1,
    flush_every_s: float = 2.0,
    command: list[str] | None = None,
    duration_s: float | None = None,
) -> int:
    path = expand_host(out)
    check_trace_output(path, "sample")
    flag = StopFlag()
    flag.install()
    stop_with_parent()
    try:
        source = NvmlSource()
    except NvmlUnavailable as exc:
        print(f"sample: no GPU telemetry on this host ({exc}); writing an empty trace to {path}", flush=True)
        TraceWriter(path, {"nvml": str(exc), "interval_s": interval_s}).close()
        return _run_plain(command, flag)
    meta = source.meta(interval_s)
    writer = TraceWriter(path, meta, flush_every_s=flush_every_s)
    names = ", ".join(sorted({g["name"] for g in meta["gpus"]}))
    print(
        f"sample: {len(meta['gpus'])} GPU(s) ({names}), power source {meta['power_source']}, "
        f"every {interval_s} s -> {path}",
        flush=True,
    )
    if command:
        flag.adopt(subprocess.Popen(command, start_new_session=True))
    max_samples = None if duration_s is None else max(1, round(duration_s / interval_s))
    try:
        sample_loop(source, writer, interval_s, flag, max_samples)
    finally:
        source.close()
        writer.close()
    if flag.child is None:
        return 0
    return _exit_status(flag.child.wait())


def _run_plain(command: list[str] | None, flag: StopFlag) -> int:
    if not command:
        return 0
    child = flag.adopt(subprocess.Popen(command, start_new_session=True))
    return _exit_status(child.wait())


def _exit_status(rc: int) -> int:
    return 128 - rc if rc < 0 else rc  # killed by signal N -> 128+N, as a shell reports it


def sampler_command(out: Path | str, interval_s: float, command: list[str], python: str = sys.executable) -> list[str]:
    """argv that runs `command` under this node's sampler."""
    return [python, "-m", "wattgate", "sample", "--out", str(out), "--interval", str(interval_s), "--"] + command
