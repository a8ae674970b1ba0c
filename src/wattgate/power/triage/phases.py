"""The phases contract: phases.parquet, the output of power triage, and what reads it.

One row per GPU per window (windows.py): host, gpu, start, end, phase (one of
LABELS), mean power, mean utilization and the label's confidence. The file's
metadata (key wattgate.phases) holds the format version, the window length and
the table's GPU model; triage.json beside it holds the rest of the settings.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from wattgate.artifacts import atomic_path
from wattgate.errors import InputError
from wattgate.power.tables import PHASES
from wattgate.power.triage.settings import DEFAULT_DEADLOCK_AFTER_S, DEFAULT_WINDOW_S
from wattgate.telemetry.trace import strict_json

FORMAT_VERSION = 1
LABELS = PHASES + ("unknown",)
COMPUTE, COMMUNICATION, DATA_STARVATION, CHECKPOINT, DEADLOCK, IDLE, UNKNOWN = range(7)
WAIT, LOW_UTIL = 7, 8  # internal classes, resolved before output
ACTIVE = (COMPUTE, COMMUNICATION, DATA_STARVATION)

PHASES_SCHEMA = pa.schema([
    ("host", pa.string()),
    ("gpu", pa.int32()),
    ("start", pa.float64()),
    ("end", pa.float64()),
    ("phase", pa.string()),
    ("power_w", pa.float32()),
    ("util_gpu", pa.float32()),
    ("confidence", pa.float32()),
])


def write_phases(phases: pa.Table, path: Path, window_s: float, gpu_model: str | None) -> None:
    """phases.parquet, with the window length and the table's GPU model in its metadata."""
    meta = {b"wattgate.phases": strict_json({"format_version": FORMAT_VERSION, "window_s": window_s,
                                             "gpu_model": gpu_model},
                                            sort_keys=True).encode()}
    with atomic_path(path) as tmp:
        pq.write_table(phases.replace_schema_metadata(meta), tmp, compression="zstd")


def read_phases(path: str | Path) -> tuple[pa.Table, float, str | None, float] | None:
    """(phases, window_s, gpu_model, deadlock_after_s) of a phases.parquet (settings from its metadata, else
    the triage.json beside it, else the defaults); None if the file does not exist."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowInvalid) as exc:
        raise InputError(f"{path}: not a readable phases table ({exc})") from None
    missing = [n for n in PHASES_SCHEMA.names if n not in table.column_names]
    if missing:
        raise InputError(f"{path}: not a phases table: missing column(s) {', '.join(missing)}")
    meta = json.loads((table.schema.metadata or {}).get(b"wattgate.phases", b"{}"))
    triage_json = _read_json(path.parent / "triage.json")
    window_s = float(meta.get("window_s") or triage_json.get("window_s") or DEFAULT_WINDOW_S)
    model = meta.get("gpu_model") or (triage_json.get("table") or {}).get("gpu_model")
    deadlock_after_s = float(triage_json.get("deadlock_after_s") or DEFAULT_DEADLOCK_AFTER_S)
    return table.select(PHASES_SCHEMA.names).cast(PHASES_SCHEMA), window_s, model, deadlock_after_s


def _read_json(path: Path) -> dict:
    """triage.json as a dict ({} if it does not exist)."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise InputError(f"{path}: not readable JSON ({exc})") from None
    if not isinstance(data, dict):
        raise InputError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def phase_summary(phases: pa.Table | pd.DataFrame) -> pd.DataFrame:
    """Per (host, gpu, phase): windows, seconds, share of that GPU's time, energy_j (mean power x duration)."""
    df = phases.to_pandas() if isinstance(phases, pa.Table) else phases
    columns = ["host", "gpu", "phase", "windows", "seconds", "share", "energy_j"]
    if len(df) == 0:
        return pd.DataFrame({c: pd.Series(dtype=t) for c, t in zip(
            columns, ["object", "int32", "object", "int64", "float64", "float64", "float64"])})
    seconds = df["end"] - df["start"]
    work = pd.DataFrame({"host": df["host"], "gpu": df["gpu"], "phase": df["phase"], "seconds": seconds,
                         "energy_j": (df["power_w"].astype("float64") * seconds).fillna(0.0)})
    out = work.groupby(["host", "gpu", "phase"], sort=True).agg(
        windows=("seconds", "size"), seconds=("seconds", "sum"), energy_j=("energy_j", "sum")).reset_index()
    per_gpu = out.groupby(["host", "gpu"])["seconds"].transform("sum")
    out["share"] = out["seconds"] / per_gpu
    return out[columns]


def totals(summary: pd.DataFrame) -> dict:
    if summary.empty:
        return {}
    t = summary.groupby("phase").agg(windows=("windows", "sum"), seconds=("seconds", "sum"),
                                     energy_j=("energy_j", "sum"))
    total = float(t["seconds"].sum())
    return {ph: {"windows": int(r.windows), "seconds": round(float(r.seconds), 6),
                 "share": round(float(r.seconds) / total, 6) if total else 0.0,
                 "energy_j": round(float(r.energy_j), 3)} for ph, r in t.iterrows()}

