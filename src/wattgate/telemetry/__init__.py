"""GPU telemetry during training: the NVML sampler, the trace format, the hang watcher."""
