"""GPU telemetry during training: the NVML sampler and the hang watcher (the trace format is wattgate/trace.py)."""
