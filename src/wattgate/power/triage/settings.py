"""Triage's settings: the table, the window length and the hang limit, from a run config and the command line.

The one home of the defaults (1 s windows, a deadlock after 60 s) and of the
order in which a triage table is picked: an explicit table file, else an
explicit GPU model, else the run config's telemetry.table, else its
cluster.gpu_model (when a table ships for it), else the trace's device names.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from wattgate.gpus import triage_table_name
from wattgate.power.tables import TriageTable, resolve_table

DEFAULT_WINDOW_S = 1.0
DEFAULT_DEADLOCK_AFTER_S = 60.0


@dataclass(frozen=True)
class TriageSettings:
    table_path: str | os.PathLike | None = None  # a triage table file
    gpu_model: str | None = None  # a shipped table's GPU model
    window_s: float = DEFAULT_WINDOW_S
    deadlock_after_s: float = DEFAULT_DEADLOCK_AFTER_S
    power_cap_w: float | None = None  # every GPU's power cap (an imported log records none)

    @classmethod
    def merge(
        cls,
        config: dict | None,
        table_path: str | os.PathLike | None = None,
        gpu_model: str | None = None,
        window_s: float | None = None,
        deadlock_after_s: float | None = None,
        power_cap_w: float | None = None,
    ) -> TriageSettings:
        """A run config's telemetry.table, cluster.gpu_model, telemetry.window_s and watcher.hang_after_s,
        each overridden by the command-line flag when given (a table file or GPU model given on the command
        line replaces the config's table choice as a whole)."""
        cfg = config or {}
        if not (table_path or gpu_model):
            table_path = (cfg.get("telemetry") or {}).get("table") or None
            if not table_path:
                gpu_model = triage_table_name(str((cfg.get("cluster") or {}).get("gpu_model", "")))
        window_s = window_s or (cfg.get("telemetry") or {}).get("window_s") or DEFAULT_WINDOW_S
        deadlock_after_s = (
            deadlock_after_s or (cfg.get("watcher") or {}).get("hang_after_s") or DEFAULT_DEADLOCK_AFTER_S
        )
        return cls(table_path, gpu_model, window_s, deadlock_after_s, power_cap_w)

    @property
    def has_table(self) -> bool:
        """A table was named (file or GPU model), so device names are not needed to pick one."""
        return bool(self.table_path or self.gpu_model)

    def table(self, device_names: list[str] = (), recorded_caps: list[float] = ()) -> TriageTable:
        """The table file, else the GPU model's shipped table, else detection from the device names; for a
        GPU no table ships for, one derived from the power cap (--power-cap-w, else the limit the sampler
        recorded)."""
        return resolve_table(self.table_path, self.gpu_model, list(device_names), self.cap_w(recorded_caps))

    def cap_w(self, recorded_caps: list[float] = ()) -> float | None:
        """--power-cap-w, else the largest enforced limit the sampler recorded, else None."""
        caps = [float(c) for c in recorded_caps if c]
        return self.power_cap_w or (max(caps) if caps else None)

    def table_source(self, table: TriageTable, device_names: list[str] = ()) -> str:
        """How table() picked it, in words (triage.json's table_source)."""
        if not table.match and (table.provenance or {}).get("kind") == "derived from the power cap":
            how = "--power-cap-w" if self.power_cap_w else "the power limit the sampler recorded"
            return f"derived from the {table.tdp_w:g} W power cap ({how})"
        return (
            f"--table {self.table_path}"
            if self.table_path
            else f"--gpu-model {self.gpu_model}"
            if self.gpu_model
            else f"detected from device names: {', '.join(device_names)}"
        )
