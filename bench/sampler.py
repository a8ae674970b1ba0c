"""Sampler overhead: CPU time per second of `wattgate sample` at 10 Hz (target < 1% of one core).

Runs the real sample loop (fixed-rate ticks, crash-safe segment flushes,
final merge) for --seconds, and reports process CPU time / wall time:
- with NVML, on every GPU of this host (the number that matters; needs a GPU);
- with a synthetic source of --gpus GPUs (always): the same loop and write
  path with the NVML calls replaced by building rows, i.e. the write path's
  own cost. Without a GPU only this second figure is measured.
Baseline, in the same process: the same source read at the same rate with no
writing, so the ratio shows what the trace writer adds.

Clocks-event reasons (issue 34): the sampler reads the reasons bitmask on its
slow path (1 Hz). The same run measures the sampler with the reasons against
the sampler without them (`NvmlSource(reasons=False)`), each in turn, several
times, on NVML where there is a GPU. Without one, the real NvmlSource runs
against wattgate.testing.fake_nvml, whose every call spends --call-us of CPU
(default 12 us: the top of the 3-12 us measured per NVML call on an H200,
docs/architecture.md "Sampler"): what that measures is the sampler's own code
and write path with the extra call charged at that assumed cost, not a
driver's. Both ways it also times the slow-path read of one GPU with and
without the reasons directly (the difference is too small for whole-loop CPU
shares on a busy host to resolve), and gives what it adds per second at 10 Hz.

`--smoke`: half a second per run, one round, 2 GPUs.

    .venv/bin/python bench/sampler.py [--seconds 30] [--gpus 8] [--call-us 12] [--rounds 3] [--smoke]
"""

from __future__ import annotations

import random
import socket
import tempfile
import time
from pathlib import Path

from benchlib import Parser, figure, positive_float, positive_int
from wattgate.telemetry.sampler import StopFlag, sample_loop
from wattgate.trace import TraceWriter, read_trace


class SyntheticSource:
    """Rows shaped like NvmlSource.read() for `gpus` GPUs (no NVML involved)."""

    def __init__(self, gpus: int):
        self.gpus = gpus
        self.host = socket.gethostname()
        self.rng = random.Random(0)
        self.energy = [0.0] * gpus

    def read(self) -> list[dict]:
        now = time.time()
        rows = []
        for g in range(self.gpus):
            p = 300 + 100 * self.rng.random()
            self.energy[g] += p * 0.1
            rows.append(
                {
                    "time": now,
                    "host": self.host,
                    "gpu": g,
                    "power_w": p,
                    "energy_j": self.energy[g],
                    "util_gpu": 100.0,
                    "util_mem": 40.0,
                    "sm_clock_mhz": 1980.0,
                    "mem_used_mib": 70000.0,
                    "temp_c": 60.0,
                    "sm_active": 80.0,
                    "sm_occupancy": 30.0,
                    "tensor_active": 50.0,
                    "dram_active": 40.0,
                    "nvlink_tx_bps": 1e10,
                    "nvlink_rx_bps": 1e10,
                }
            )
        return rows

    def close(self) -> None:
        pass


class NullWriter:
    def add(self, row: dict) -> None:
        pass


def cpu_share(source, writer, seconds: float, interval: float) -> tuple[float, int]:
    flag = StopFlag()
    n_target = round(seconds / interval)
    c0, w0 = time.process_time(), time.monotonic()
    n = sample_loop(source, writer, interval, flag, max_samples=n_target)
    if isinstance(writer, TraceWriter):
        writer.close()
    return (time.process_time() - c0) / (time.monotonic() - w0), n


def measure(name: str, make_source, seconds: float, interval: float, folder: Path) -> None:
    src = make_source()
    base, _ = cpu_share(src, NullWriter(), seconds, interval)
    src.close()
    src = make_source()
    meta = src.meta(interval) if hasattr(src, "meta") else {"synthetic": True}
    path = folder / f"{name}.parquet"
    full, n = cpu_share(src, TraceWriter(path, meta, flush_every_s=2.0), seconds, interval)
    src.close()
    rows = len(read_trace(path))
    print(
        f"{name:>22}: read only {100 * base:.3f}% of a core | read + write {100 * full:.3f}% of a core "
        f"({n} ticks, {rows} rows) | writer adds {100 * (full - base):.3f} points | "
        f"target < 1%: {'met' if full < 0.01 else 'MISSED'}"
    )
    figure(
        "sampler",
        f"{name}: the sample loop at {1 / interval:g} Hz, read + write",
        f"{100 * full:.3f}% of a core (target < 1%)",
        f"the same source read at the same rate, nothing written {100 * base:.3f}%",
    )


def slow_read_us(source, n: int) -> float:
    """CPU microseconds of one GPU's slow-path read (power, utilization, clocks, reasons, memory, temperature)."""
    g = source.gpus[0]
    c = time.process_time()
    for _ in range(n):
        source._read_gpu(g, time.time(), True, False)
    return 1e6 * (time.process_time() - c) / n


def with_and_without_reasons(
    name: str, make_source, seconds: float, interval: float, folder: Path, rounds: int, reads: int = 2000
):
    """The sampler with the reasons against the sampler without them: whole-loop CPU shares, each in turn
    `rounds` times (so a noisy spell hits both), and the slow-path read alone."""
    shares = {True: [], False: []}
    for r in range(rounds):
        for reasons in (True, False):
            src = make_source(reasons)
            path = folder / f"{name}-{reasons}-{r}.parquet"
            full, _ = cpu_share(src, TraceWriter(path, src.meta(interval), flush_every_s=2.0), seconds, interval)
            src.close()
            shares[reasons].append(full)
            if reasons and r == 0:
                cols = read_trace(path).column("clocks_event_reasons")
                assert cols.null_count < len(cols), "the reasons column came back empty"
    on, off = min(shares[True]), min(shares[False])
    per = {reasons: [slow_read_us(make_source(reasons), reads) for _ in range(5)] for reasons in (True, False)}
    extra_us = min(per[True]) - min(per[False])
    gpus = len(make_source(True).gpus)
    print(
        f"{name:>22}: whole loop, best of {rounds}: with reasons {100 * on:.3f}% of a core, without "
        f"{100 * off:.3f}% ({100 * (on - off):+.3f} points; target < 1%: {'met' if on < 0.01 else 'MISSED'})"
    )
    print(
        f"{'':>22}  slow-path read of one GPU: {min(per[True]):.1f} us with reasons, {min(per[False]):.1f} us "
        f"without: {extra_us:+.1f} us once a second per GPU = {100 * extra_us * gpus / 1e6:+.4f}% of a core "
        f"for {gpus} GPUs"
    )
    figure(
        "sampler",
        f"{name}: the sampler with the clocks-event reasons at {1 / interval:g} Hz",
        f"{100 * on:.3f}% of a core (target < 1%); the slow-path read {min(per[True]):.1f} us per GPU",
        f"the sampler without the reasons {100 * off:.3f}%; its slow-path read {min(per[False]):.1f} us",
    )


def profile_nvml_calls(n: int = 200) -> None:
    """CPU time per NVML call on GPU 0 (each is an ioctl; some are far dearer than others)."""
    import pynvml as nv

    nv.nvmlInit()
    h = nv.nvmlDeviceGetHandleByIndex(0)
    calls = {
        "field values (power instant + energy)": lambda: nv.nvmlDeviceGetFieldValues(
            h, [nv.NVML_FI_DEV_POWER_INSTANT, nv.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION]
        ),
        "field value (power instant)": lambda: nv.nvmlDeviceGetFieldValues(h, [nv.NVML_FI_DEV_POWER_INSTANT]),
        "GetPowerUsage": lambda: nv.nvmlDeviceGetPowerUsage(h),
        "GetTotalEnergyConsumption": lambda: nv.nvmlDeviceGetTotalEnergyConsumption(h),
        "GetUtilizationRates": lambda: nv.nvmlDeviceGetUtilizationRates(h),
        "GetClockInfo(SM)": lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM),
        "GetMemoryInfo": lambda: nv.nvmlDeviceGetMemoryInfo(h),
        "GetTemperature": lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU),
    }
    for name in ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"):
        fn = getattr(nv, name, None)
        if fn is not None:
            calls[name[len("nvmlDeviceGet") :]] = lambda fn=fn: fn(h)
            break
    for name, fn in calls.items():
        c = time.process_time()
        w = time.perf_counter()
        for _ in range(n):
            fn()
        print(
            f"  {name:>40}: {1e6 * (time.process_time() - c) / n:8.1f} us CPU, "
            f"{1e6 * (time.perf_counter() - w) / n:8.1f} us wall per call"
        )
    nv.nvmlShutdown()


def main() -> None:
    ap = Parser(description=__doc__.splitlines()[0], smoke="0.5 s per run, one round, 2 GPUs")
    ap.add_argument("--seconds", type=positive_float, default=None, help="seconds per run (default 30)")
    ap.add_argument("--interval", type=positive_float, default=0.1)
    ap.add_argument("--gpus", type=positive_int, default=None, help="synthetic and fake-NVML GPUs (default 8)")
    ap.add_argument("--call-us", type=float, default=12.0, help="CPU per call of the fake NVML (no GPU here)")
    ap.add_argument("--rounds", type=positive_int, default=None, help="with/without-reasons runs of each (3)")
    args = ap.parse_args()
    args.seconds = args.seconds or (0.5 if args.smoke else 30.0)
    args.gpus = args.gpus or (2 if args.smoke else 8)
    args.rounds = args.rounds or (1 if args.smoke else 3)
    if not 0 <= args.call_us < float("inf"):
        ap.error(f"argument --call-us: must be a finite number of microseconds >= 0, not {args.call_us:g}")
    reads = 200 if args.smoke else 2000
    with tempfile.TemporaryDirectory() as tmp:
        # one-time start-up (pyarrow's Parquet writer initializes on first use: ~0.25 s CPU) is not per-second cost
        warm = TraceWriter(Path(tmp) / "warm.parquet", {})
        warm.add(SyntheticSource(1).read()[0])
        warm.close()
        try:
            from wattgate.telemetry.nvml import NvmlSource, NvmlUnavailable

            probe = NvmlSource()
            names = sorted({g.name for g in probe.gpus})
            count = len(probe.gpus)
            probe.close()
            print(f"NVML: {count} GPU(s): {', '.join(names)}")
            profile_nvml_calls()
            measure(f"nvml x{count}", NvmlSource, args.seconds, args.interval, Path(tmp))
            measure(f"nvml x{count} (no GPM)", lambda: NvmlSource(gpm=False), args.seconds, args.interval, Path(tmp))
            with_and_without_reasons(
                f"nvml x{count}",
                lambda reasons: NvmlSource(reasons=reasons),
                args.seconds,
                args.interval,
                Path(tmp),
                args.rounds,
                reads,
            )
        except NvmlUnavailable as exc:
            from wattgate.testing.fake_nvml import FakeNvml

            print(
                f"NVML: not available here ({exc}); the sampler's reasons measured against a fake NVML whose "
                f"every call costs {args.call_us:g} us of CPU (an assumed figure, not a driver's)"
            )
            with_and_without_reasons(
                f"fake nvml x{args.gpus}",
                lambda reasons: NvmlSource(reasons=reasons, nvml=FakeNvml(args.gpus, args.call_us)),
                args.seconds,
                args.interval,
                Path(tmp),
                args.rounds,
                reads,
            )
        measure(f"synthetic x{args.gpus}", lambda: SyntheticSource(args.gpus), args.seconds, args.interval, Path(tmp))


if __name__ == "__main__":
    main()
