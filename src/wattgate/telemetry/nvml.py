"""NVML readings for one node's GPUs, one row per GPU per call.

Power: `nvmlDeviceGetPowerUsage` is a 1 s moving average on Ampere (except
A100) and newer, too slow to see a 10 Hz phase change, so the instant field
value (NVML_FI_DEV_POWER_INSTANT) is used wherever the driver supports it;
the source actually used is recorded in the trace metadata. The total energy
counter (mJ since driver load) gives exact energy regardless of sampling.
GPM metrics (Hopper and newer) are differences of two samples, so each call
reports the activity since the previous call. The clocks-event reasons (why
the SM clock is below its maximum: power cap, thermal or hardware slowdown)
are read with the clocks, on the slow path: the bitmask changes on the
driver's own slow time scale, and a straggler's cause needs it beside the SM
clock, not at 10 Hz.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, SupportsInt

from wattgate.trace import (
    CLOCKS_EVENT_REASONS,
    DRAM_ACTIVE,
    ENERGY_J,
    GPU,
    HOST,
    MEM_USED_MIB,
    NVLINK_RX_BPS,
    NVLINK_TX_BPS,
    POWER_W,
    SM_ACTIVE,
    SM_CLOCK_MHZ,
    SM_OCCUPANCY,
    TEMP_C,
    TENSOR_ACTIVE,
    TIME,
    UTIL_GPU,
    UTIL_MEM,
)

# A sample row is one trace row (wattgate/trace.py TRACE_SCHEMA), keyed by the trace's column names.
GPM_METRICS = {  # trace column -> pynvml metric constant name
    SM_ACTIVE: "NVML_GPM_METRIC_SM_UTIL",
    SM_OCCUPANCY: "NVML_GPM_METRIC_SM_OCCUPANCY",
    TENSOR_ACTIVE: "NVML_GPM_METRIC_ANY_TENSOR_UTIL",
    DRAM_ACTIVE: "NVML_GPM_METRIC_DRAM_BW_UTIL",
    NVLINK_TX_BPS: "NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC",
    NVLINK_RX_BPS: "NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC",
}
NVLINK_COLUMNS = (NVLINK_TX_BPS, NVLINK_RX_BPS)
NVLINK_SCALE = float(2**20)  # nvml.h documents the GPM NVLink rates in MiB/s; the trace stores bytes/s


class NvmlUnavailable(Exception):
    """No NVML on this host (no driver / no GPU): the sampler writes an empty trace and the run goes on."""


@dataclass
class GpuHandle:
    index: int
    handle: object
    name: str
    uuid: str
    instant_power: bool
    gpm: bool
    gpm_prev: object = None
    # the NVML call that reads this GPU's clocks-event reasons; None: not available
    reasons: Callable[[object], SupportsInt] | None = None
    info: dict = field(default_factory=dict)
    slow: dict = field(default_factory=dict)  # last slow-rate readings, repeated between refreshes


class NvmlSource:
    def __init__(
        self,
        gpm: bool = True,
        slow_every_s: float = 1.0,
        energy_every_s: float = 10.0,
        reasons: bool = True,
        nvml: Any = None,
    ):
        """`reasons`: read the clocks-event reasons; `nvml`: the module to call (default pynvml; the tests and
        bench/sampler.py pass wattgate.testing.fake_nvml on hosts without a GPU)."""
        if nvml is None:
            try:
                import pynvml as nvml
            except ImportError as exc:  # nvidia-ml-py not installed
                raise NvmlUnavailable(f"nvidia-ml-py is not installed ({exc})") from None
        # duck-typed: pynvml (its ctypes structures' fields are not typed) or an object with its functions
        self.nv: Any = nvml
        pynvml = self.nv
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise NvmlUnavailable(f"NVML unavailable: {exc}") from None
        self.host = socket.gethostname()
        self.use_reasons = reasons
        self.driver = _str(pynvml.nvmlSystemGetDriverVersion())
        self.gpus = [self._open(i) for i in range(pynvml.nvmlDeviceGetCount())]
        if not self.gpus:
            raise NvmlUnavailable("NVML found no GPU")
        self.use_gpm = gpm
        self.slow_every_s = slow_every_s
        self.last_slow = float("-inf")
        self.energy_every_s = energy_every_s
        self.last_energy = float("-inf")

    def _open(self, index: int) -> GpuHandle:
        nv = self.nv
        h = nv.nvmlDeviceGetHandleByIndex(index)
        instant = self._instant_power_mw(h) is not None
        gpm = False
        try:
            gpm = bool(nv.nvmlGpmQueryDeviceSupport(h).isSupportedDevice)
        except (nv.NVMLError, AttributeError):
            pass
        info = {}
        for key, fn in (
            ("power_limit_w", lambda: nv.nvmlDeviceGetPowerManagementLimit(h) / 1000.0),
            ("memory_total_mib", lambda: nv.nvmlDeviceGetMemoryInfo(h).total / 2**20),
            ("pci_bus_id", lambda: _str(nv.nvmlDeviceGetPciInfo(h).busId)),
        ):
            try:
                info[key] = fn()
            except nv.NVMLError:
                info[key] = None
        reasons = self._reasons_call(h) if self.use_reasons else None
        info[CLOCKS_EVENT_REASONS] = reasons is not None  # the trace metadata's GPU entry: whether they are read
        return GpuHandle(
            index,
            h,
            _str(nv.nvmlDeviceGetName(h)),
            _str(nv.nvmlDeviceGetUUID(h)),
            instant,
            gpm,
            reasons=reasons,
            info=info,
        )

    def _reasons_call(self, h):
        """The call that reads the clocks-event reasons on this driver: nvmlDeviceGetCurrentClocksEventReasons,
        else its older name ...ClocksThrottleReasons (drivers before 535, older nvidia-ml-py); None when neither
        answers, so the sampler never asks again."""
        nv = self.nv
        for name in ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"):
            fn = getattr(nv, name, None)
            if fn is None:
                continue
            try:
                fn(h)
            except nv.NVMLError:
                continue  # not in this driver's library, or not supported on this GPU
            return fn
        return None

    def _instant_power_mw(self, h) -> float | None:
        nv = self.nv
        try:
            v = nv.nvmlDeviceGetFieldValues(h, [nv.NVML_FI_DEV_POWER_INSTANT])[0]
        except (nv.NVMLError, AttributeError):
            return None
        if v.nvmlReturn != nv.NVML_SUCCESS:
            return None
        return float(v.value.uiVal)

    def meta(self, interval_s: float) -> dict:
        sources = {"instant" if g.instant_power else "average_1s" for g in self.gpus}
        return {
            "host": self.host,
            "driver": self.driver,
            "interval_s": interval_s,
            "power_source": "/".join(sorted(sources)),
            "gpus": [
                dict(index=g.index, name=g.name, uuid=g.uuid, instant_power=g.instant_power, gpm=g.gpm, **g.info)
                for g in self.gpus
            ],
        }

    def read(self) -> list[dict]:
        """Power and utilization every call (~15 us of CPU per GPU on an H200); clocks, clocks-event reasons,
        memory, temperature and GPM every `slow_every_s`; the energy counter every `energy_every_s`, because
        reading it costs ~4 ms of CPU (measured on an H200, driver 580) and it is cumulative anyway.
        Rows between energy reads carry a null energy_j."""
        now = time.time()
        slow = now - self.last_slow >= self.slow_every_s
        energy = now - self.last_energy >= self.energy_every_s
        if slow:
            self.last_slow = now
        if energy:
            self.last_energy = now
        return [self._read_gpu(g, now, slow, energy) for g in self.gpus]

    def _read_gpu(self, g: GpuHandle, now: float, slow: bool, energy: bool) -> dict:
        nv, h = self.nv, g.handle
        row: dict[str, float | int | str | None] = {TIME: now, HOST: self.host, GPU: g.index}
        power = self._instant_power_mw(h) if g.instant_power else None
        if power is None:
            power = _maybe(nv, lambda: nv.nvmlDeviceGetPowerUsage(h))
        row[POWER_W] = power / 1000.0 if power is not None else None
        if energy:
            mj = _maybe(nv, lambda: nv.nvmlDeviceGetTotalEnergyConsumption(h))
            row[ENERGY_J] = mj / 1000.0 if mj is not None else None
        util = _maybe(nv, lambda: nv.nvmlDeviceGetUtilizationRates(h))
        row[UTIL_GPU] = float(util.gpu) if util is not None else None
        row[UTIL_MEM] = float(util.memory) if util is not None else None
        if slow:
            g.slow = {
                SM_CLOCK_MHZ: _maybe(nv, lambda: float(nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM))),
                MEM_USED_MIB: _maybe(nv, lambda: nv.nvmlDeviceGetMemoryInfo(h).used / 2**20),
                TEMP_C: _maybe(nv, lambda: float(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU))),
            }
            if g.reasons is not None:
                g.slow[CLOCKS_EVENT_REASONS] = _maybe(nv, lambda: int(g.reasons(h)))
            if g.gpm and self.use_gpm:
                g.slow.update(self._gpm(g))
        row.update(g.slow)
        return row

    def _gpm(self, g: GpuHandle) -> dict:
        """Activity since the previous call (GPM metrics are computed from two samples)."""
        nv = self.nv
        try:
            sample = nv.nvmlGpmSampleAlloc()
            nv.nvmlGpmSampleGet(g.handle, sample)
        except nv.NVMLError:
            g.gpm = False  # e.g. not permitted in this container: stop trying
            return {}
        prev, g.gpm_prev = g.gpm_prev, sample
        if prev is None:
            return {}
        req = nv.c_nvmlGpmMetricsGet_t()
        req.version = nv.NVML_GPM_METRICS_GET_VERSION
        req.numMetrics = len(GPM_METRICS)
        req.sample1, req.sample2 = prev, sample
        for i, const in enumerate(GPM_METRICS.values()):
            req.metrics[i].metricId = getattr(nv, const)
        try:
            nv.nvmlGpmMetricsGet(req)
        except nv.NVMLError:
            return {}
        finally:
            nv.nvmlGpmSampleFree(prev)
        out = {}
        for i, col in enumerate(GPM_METRICS):
            m = req.metrics[i]
            if m.nvmlReturn == nv.NVML_SUCCESS:
                out[col] = float(m.value) * (NVLINK_SCALE if col in NVLINK_COLUMNS else 1.0)
        return out

    def close(self) -> None:
        for g in self.gpus:
            if g.gpm_prev is not None:
                try:
                    self.nv.nvmlGpmSampleFree(g.gpm_prev)
                except self.nv.NVMLError:
                    pass
        try:
            self.nv.nvmlShutdown()
        except self.nv.NVMLError:
            pass


def _maybe(nv, fn):
    try:
        return fn()
    except nv.NVMLError:
        return None


def _str(x) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)
