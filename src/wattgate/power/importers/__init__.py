"""`wattgate import-trace`: other collectors' logs -> the trace contract.

- nvidia-smi CSV, as `nvidia-smi --query-gpu=<fields> --format=csv[,noheader][,nounits] -l/-lms N`
  writes it: values with or without units ("72.36 W", "0 %"), the markers
  "[N/A]" and "[Not Supported]" (null), timestamps "2025/07/27 00:34:45.155".
  Without an `index` (or `pci.bus_id`) column, nvidia-smi still writes one row
  per GPU in GPU order within each sampling burst (rows a few ms apart, bursts
  an interval apart): the GPU index is inferred from the position in the
  burst, and the trace metadata says so.
- DCGM exporter text (Prometheus exposition format): `DCGM_FI_DEV_*` and
  `DCGM_FI_PROF_*` samples with labels `gpu`, `Hostname`, `modelName`; a
  scrape's time is the samples' trailing timestamp (ms), else a comment line
  holding a time just before it (`# 2025-07-27T00:34:45Z` or `# 1753576485.1`),
  else a unix time in the file name (a file per scrape).
- Zeus power CSV: a time column plus one power column per GPU (`gpu0`,
  `GPU1`, `power_gpu2`, ...; watts, or milliwatts when the header says mW), and
  the legacy `zeus_monitor` form `Time,Power` (milliwatts, one GPU per file).
- Any CSV with a header (`--from csv --columns time=ts,power_w=power_mW:mW,...`): trace fields mapped
  to header names, each with an optional stated unit; time as unix s (or stated ms/us/ns) or ISO-8601.
  An unmapped gpu means one GPU (index 0).
A line that cannot be read is an error naming file:line and the field, or,
with `skip_bad_lines`, a counted skip. A truncated final line in a CSV-like log (fewer fields than the
header, or its last field cut off: what killing the logger leaves) is dropped and noted
(`skipped_lines: {"truncated_final_line": 1}`). ISO-8601 times with `Z` or an offset keep it; naive
times take `--tz` (nvidia-smi, csv) or UTC (Zeus).

Units are kept per value: "350.12 W", "350120 mW" and "0.35 kW" in one column
all read as 350 W. A value without a unit takes its column's unit (the header's
`[mW]`, Zeus's `(mW)`), else the trace unit. An unknown unit is a bad line.
Values that cannot be physical (NaN, +-Inf, negative power, energy, utilization,
clocks or memory; power above `MAX_POWER_W` per GPU; beyond float32 for float32
columns) become null and are counted per column in the trace metadata under
`invalid_values`.

An import is refused (one line) where it would pass silently wrong: no sample
line left to read (every line bad, with `skip_bad_lines`), a host without one
power reading (a trace without energy), or two files that would take the same
host name from their file names (two nodes merged into one) without `--host`.
"""

from __future__ import annotations

import gzip
import os
import zlib
from pathlib import Path
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import pyarrow as pa
import pyarrow.parquet as pq

from wattgate.artifacts import atomic_path
from wattgate.errors import InputError
from wattgate.power.importers import anycsv, dcgm, nvidia_smi, zeus
from wattgate.power.importers.common import ReadOptions
from wattgate.power.log_parsing import MAX_GPU_INDEX, Imported, Lines, check_ranges, log_stem
from wattgate.trace import HOST, MAX_POWER_W, POWER_W

# the readers, one module per format, one signature: read(path, imported, lines, ReadOptions)
READERS = {"nvidia-smi": nvidia_smi.read, "dcgm": dcgm.read, "zeus": zeus.read, "csv": anycsv.read}
FORMATS = tuple(READERS)
# where each format's power comes from, for the error of a log without it
POWER_FIELDS = {
    "nvidia-smi": "power.draw or power.draw.instant",
    "dcgm": "DCGM_FI_DEV_POWER_USAGE lines",
    "zeus": "per-GPU power columns",
    "csv": "the column --columns maps to power_w",
}


def import_trace(
    fmt: str,
    files: list[Path],
    host: str | None = None,
    skip_bad_lines: bool = False,
    fields: list[str] | None = None,
    tz_name: str = "UTC",
    gpu_index: int = 0,
    columns: str | None = None,
) -> tuple[pa.Table, dict]:
    """`columns`: the `--columns` mapping of `--from csv` (FIELD=HEADER[:UNIT],...)."""
    if fmt not in FORMATS:
        raise InputError(f"unknown format {fmt!r}; known: {', '.join(FORMATS)}")
    if columns and fmt != "csv":
        raise InputError(f"--columns is for --from csv; --from {fmt} reads its own header")
    if not 0 <= gpu_index <= MAX_GPU_INDEX:
        raise InputError(f"--gpu-index {gpu_index}: a GPU index is 0..{MAX_GPU_INDEX}")
    mapping = anycsv.parse_columns(columns) if fmt == "csv" else None
    try:
        tz = ZoneInfo(tz_name)
    except (ZoneInfoNotFoundError, ValueError):
        raise InputError(f"--tz {tz_name!r}: not a time zone name (e.g. UTC, Europe/Berlin)") from None
    imported = Imported()
    lines = Lines(imported, skip_bad_lines)
    named_by: dict[str, Path] = {}  # host name taken from a file's name -> that file
    for path in map(Path, files):
        if not path.is_file():
            raise InputError(f"{path}: no such file")
        options = ReadOptions(host or log_stem(path), host, tz, fields, gpu_index, mapping)
        first_row = len(imported.row_file)
        try:
            READERS[fmt](path, imported, lines, options)
        except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
            raise InputError(f"{path}: damaged gzip stream ({exc}); re-copy or re-compress the log") from None
        if host is None and options.host in set(imported.columns[HOST][first_row:]):
            claim_file_host(named_by, options.host, path)
    check_ranges(imported, lines)
    check_power(fmt, imported)
    if imported.invalid:
        imported.notes.append(
            f"values that cannot be readings (NaN, Inf, negative, power above {MAX_POWER_W:.0f} W) set to null: "
            + ", ".join(f"{name} {n}" for name, n in sorted(imported.invalid.items()))
        )
    hosts = sorted(set(imported.columns[HOST]))
    meta = {
        "source": fmt,
        "files": [os.fspath(f) for f in files],
        "hosts": hosts,
        "gpus": [{"host": h, "index": g, "name": n} for (h, g), n in sorted(imported.names.items())],
        "gpu_index_inferred": imported.index_inferred,
        "skipped_lines": dict(imported.skipped),
        "invalid_values": dict(sorted(imported.invalid.items())),
        "notes": imported.notes,
        "power_source": "imported",
        # hosts named after their file (no --host, no host in the log): a guess, so triage refuses two traces
        # whose guessed host is the same over the same time (two nodes' gpu.csv), see triage/files.py
        "hosts_from_file_names": sorted(named_by),
    }
    return imported.table(meta), meta


def claim_file_host(named_by: dict[str, Path], name: str, path: Path) -> None:
    """A host name from a file name is that file's: two files of one name (node1/gpu.csv, node2/gpu.csv) would
    otherwise merge two nodes' GPUs into one host, and a hung node's silence would vanish under the other's."""
    other = named_by.setdefault(name, path)
    if other == path:
        return
    raise InputError(
        f"{other} and {path} would both be host {name!r} (from the file name), merging two nodes into one; "
        "import each with --host NAME (or rename the files)"
    )


def check_power(fmt: str, imported: Imported) -> None:
    """Refuse an import that would give a trace without energy: no rows left (every line bad or out of range),
    or a host none of whose rows holds a power reading."""
    hosts, power = imported.columns[HOST], imported.columns[POWER_W]
    if not hosts:
        raise InputError(f"{', '.join(map(str, imported.files))}: no readable sample lines")
    powered = {h for h, p in zip(hosts, power) if p is not None}
    unpowered = sorted(set(hosts) - powered, key=str)
    if not unpowered:
        return
    h = unpowered[0]
    files = sorted({str(imported.files[f]) for f, row_host in zip(imported.row_file, hosts) if row_host == h})
    nulled = imported.invalid.get(POWER_W, 0)
    why = f"; {nulled} nulled as not readings (NaN, Inf, negative, above {MAX_POWER_W:.0f} W)" if nulled else ""
    raise InputError(
        f"{', '.join(files)}: no power reading for host {h!r} in {hosts.count(h)} sample row(s){why}; "
        f"a trace needs power ({POWER_FIELDS[fmt]})"
    )


def write_trace(table: pa.Table, out: Path) -> None:
    with atomic_path(out) as tmp:
        pq.write_table(table, tmp)
