"""A telemetry trace's metadata (Parquet key `wattgate.trace`, JSON), as its readers take it: the host, the
driver and power source, each GPU's index, name, UUID and enforced power limit, and from the importers what
they skipped, nulled or guessed. Format: docs/architecture.md, "Telemetry trace".

Written by the sampler and the importers as a mapping (trace.schema_with_meta); read by `trace.trace_meta`,
which checks its shape first (one error naming the file) and gives this record. Every key is optional: a
foreign or older trace may lack any of them. Name, UUID, driver and the like are kept as read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from wattgate.records.base import Record


@dataclass(frozen=True, kw_only=True, slots=True)
class GpuMeta(Record):
    """One GPU of the trace's host (metadata `gpus[]`)."""

    index: int | None = None
    name: Any = None
    uuid: Any = None
    power_limit_w: float | None = None  # NVML's enforced limit (W)


@dataclass(frozen=True, kw_only=True, slots=True)
class TraceMeta(Record):
    """The `wattgate.trace` metadata (nothing when the trace has none)."""

    host: Any = None
    driver: Any = None
    nvml: Any = None
    power_source: Any = None  # the sampler's power field, or "imported"
    source: Any = None  # an importer's log format
    gpus: tuple[GpuMeta, ...] | None = None
    notes: tuple[Any, ...] | None = None
    skipped_lines: dict[str, int] | None = None
    invalid_values: dict[str, int] | None = None  # readings nulled as not readings, per column
    gpu_index_inferred: Any = None  # the importer guessed the GPU index from the row order
    hosts_from_file_names: tuple[Any, ...] | None = None  # hosts named after their log files (no --host)
    hosts: tuple[Any, ...] | None = None  # an importer's: every host of the trace
    files: tuple[Any, ...] | None = None  # an importer's: the logs it read

    @property
    def gpu_list(self) -> tuple[GpuMeta, ...]:
        return self.gpus or ()

    def device_names(self) -> list[str]:
        """The GPUs' device names (those it has)."""
        return [str(g.name) for g in self.gpu_list if g.name]
