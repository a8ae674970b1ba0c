"""A stand-in for the `pynvml` module, for the sampler's tests and bench/sampler.py on hosts without a GPU.

It answers every NVML call telemetry/nvml.py makes, for `gpus` GPUs, with steady made-up readings, and
spends `call_us` microseconds of CPU in each call (a busy wait), so that a bench can charge the calls a
cost of the order measured on a real GPU (bench/sampler.py says which figure it used). It is not a model of
a GPU: the readings only have the right types and ranges.

`reasons`: which clocks-event reasons call the fake driver has: "event" (nvmlDeviceGetCurrentClocksEventReasons,
drivers from 535), "throttle" (only the older ...ClocksThrottleReasons), or None (neither).
"""

from __future__ import annotations

import time
from types import SimpleNamespace


class NVMLError(Exception):
    pass


class NVMLError_FunctionNotFound(NVMLError):  # noqa: N801 (pynvml's own name)
    pass


class FakeNvml:
    NVML_SUCCESS = 0
    NVML_FI_DEV_POWER_INSTANT = 186
    NVML_CLOCK_SM = 1
    NVML_TEMPERATURE_GPU = 0
    NVMLError = NVMLError

    def __init__(self, gpus: int = 8, call_us: float = 0.0, reasons: str | None = "event", reason_bits: int = 0x4):
        self.gpus = gpus
        self.call_us = call_us
        self.reason_bits = reason_bits
        self.calls: dict[str, int] = {}
        if reasons == "event":
            self.nvmlDeviceGetCurrentClocksEventReasons = self._reasons
        if reasons in ("event", "throttle"):
            self.nvmlDeviceGetCurrentClocksThrottleReasons = self._reasons

    def _spend(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1
        if self.call_us:
            end = time.perf_counter() + self.call_us * 1e-6
            while time.perf_counter() < end:
                pass

    # -------------------------------------------------- what telemetry/nvml.py calls

    def nvmlInit(self) -> None:
        self._spend("nvmlInit")

    def nvmlShutdown(self) -> None:
        self._spend("nvmlShutdown")

    def nvmlSystemGetDriverVersion(self) -> str:
        return "fake"

    def nvmlDeviceGetCount(self) -> int:
        return self.gpus

    def nvmlDeviceGetHandleByIndex(self, i: int):
        return i

    def nvmlDeviceGetName(self, h) -> str:
        return "NVIDIA H200 (fake)"

    def nvmlDeviceGetUUID(self, h) -> str:
        return f"GPU-fake-{h}"

    def nvmlGpmQueryDeviceSupport(self, h):
        return SimpleNamespace(isSupportedDevice=0)

    def nvmlDeviceGetPowerManagementLimit(self, h) -> int:
        return 700_000

    def nvmlDeviceGetMemoryInfo(self, h):
        self._spend("nvmlDeviceGetMemoryInfo")
        return SimpleNamespace(total=141 << 30, used=70 << 30)

    def nvmlDeviceGetPciInfo(self, h):
        return SimpleNamespace(busId=f"00000000:{h:02x}:00.0")

    def nvmlDeviceGetFieldValues(self, h, fields):
        self._spend("nvmlDeviceGetFieldValues")
        return [SimpleNamespace(nvmlReturn=0, value=SimpleNamespace(uiVal=350_000 + 1000 * h)) for _ in fields]

    def nvmlDeviceGetPowerUsage(self, h) -> int:
        self._spend("nvmlDeviceGetPowerUsage")
        return 350_000

    def nvmlDeviceGetTotalEnergyConsumption(self, h) -> int:
        self._spend("nvmlDeviceGetTotalEnergyConsumption")
        return int(time.time() * 350_000)

    def nvmlDeviceGetUtilizationRates(self, h):
        self._spend("nvmlDeviceGetUtilizationRates")
        return SimpleNamespace(gpu=100, memory=40)

    def nvmlDeviceGetClockInfo(self, h, kind) -> int:
        self._spend("nvmlDeviceGetClockInfo")
        return 1980

    def nvmlDeviceGetTemperature(self, h, kind) -> int:
        self._spend("nvmlDeviceGetTemperature")
        return 60

    def _reasons(self, h) -> int:
        self._spend("clocks_event_reasons")
        return self.reason_bits
