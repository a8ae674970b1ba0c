"""GPU telemetry: the NVML sampler, the hang watcher, power triage and calibration."""
