"""A stand-in for the `pynvml` module, for `bench/gpu_checks.sh --dry-run` only: the dry run puts this folder
first on PYTHONPATH, so every process it starts (`wattgate sample`, launch's samplers, calibrate,
bench/sampler.py) finds one NVIDIA "GPU" here instead of a driver.

It is wattgate.testing.fake_nvml's FakeNvml for one GPU, as module functions, with two additions: the energy
field id bench/sampler.py names, and a power and utilization that the dry run's CPU stand-ins for calibrate's
phases set (`set_load`, bench/dry_run/cuda_cli.py), so that a calibration of the stand-in yields bands. The
readings are made up; only their types, ranges and the calls are the driver's.
"""

from __future__ import annotations

from types import SimpleNamespace

from wattgate.testing.fake_nvml import FakeNvml, NVMLError, NVMLError_FunctionNotFound  # noqa: F401

NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION = 83  # nvml.h's id; the stand-in's field values ignore ids


class StandInNvml(FakeNvml):
    """FakeNvml whose power and utilization follow `set_load`."""

    power_mw, util_pct = 350_000, 100

    def nvmlDeviceGetFieldValues(self, h, fields):
        self._spend("nvmlDeviceGetFieldValues")
        return [SimpleNamespace(nvmlReturn=0, value=SimpleNamespace(uiVal=self.power_mw)) for _ in fields]

    def nvmlDeviceGetPowerUsage(self, h) -> int:
        self._spend("nvmlDeviceGetPowerUsage")
        return self.power_mw

    def nvmlDeviceGetUtilizationRates(self, h):
        self._spend("nvmlDeviceGetUtilizationRates")
        return SimpleNamespace(gpu=self.util_pct, memory=40)


_nvml = StandInNvml(gpus=1)


def set_load(power_w: float, util_pct: float) -> None:
    """What the stand-in GPU reads from now on."""
    _nvml.power_mw, _nvml.util_pct = int(power_w * 1000), util_pct


def __getattr__(name: str):
    return getattr(_nvml, name)
