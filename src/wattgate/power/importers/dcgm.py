"""DCGM exporter scrapes (Prometheus text): DCGM_FI_DEV_* and DCGM_FI_PROF_* samples."""

from __future__ import annotations

import datetime as dt
import re
from pathlib import Path

from wattgate.errors import InputError
from wattgate.power.importers.common import ReadOptions
from wattgate.power.log_parsing import (
    Imported,
    BadLine,
    Lines,
    open_log,
)
from wattgate.trace import (
    ENERGY_J,
    MEM_USED_MIB,
    POWER_W,
    REASONS,
    SM_CLOCK_MHZ,
    TEMP_C,
    UTIL_GPU,
    UTIL_MEM,
)


GPU_LABEL, HOST_LABEL, MODEL_LABEL = "gpu", "Hostname", "modelName"  # the exporter's labels of a sample
POWER_W_INSTANT = "power_w_instant"  # the instant reading, which wins over the average (power_w)
DCGM_FIELDS = {  # metric -> (trace column, scale)
    "DCGM_FI_DEV_POWER_USAGE": (POWER_W, 1.0),
    "DCGM_FI_DEV_POWER_USAGE_INSTANT": (POWER_W_INSTANT, 1.0),
    "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": (ENERGY_J, 1e-3),  # mJ
    "DCGM_FI_DEV_GPU_UTIL": (UTIL_GPU, 1.0),
    "DCGM_FI_DEV_MEM_COPY_UTIL": (UTIL_MEM, 1.0),
    "DCGM_FI_DEV_SM_CLOCK": (SM_CLOCK_MHZ, 1.0),
    "DCGM_FI_DEV_FB_USED": (MEM_USED_MIB, 1.0),
    "DCGM_FI_DEV_GPU_TEMP": (TEMP_C, 1.0),
    # the clocks-event reasons bitmask, under its current name and the one before it
    "DCGM_FI_DEV_CLOCKS_EVENT_REASONS": (REASONS, 1.0),
    "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS": (REASONS, 1.0),
    "DCGM_FI_PROF_SM_ACTIVE": ("sm_active", 100.0),  # ratios 0..1 -> %
    "DCGM_FI_PROF_SM_OCCUPANCY": ("sm_occupancy", 100.0),
    "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": ("tensor_active", 100.0),
    "DCGM_FI_PROF_DRAM_ACTIVE": ("dram_active", 100.0),
    "DCGM_FI_PROF_NVLINK_TX_BYTES": ("nvlink_tx_bps", 1.0),
    "DCGM_FI_PROF_NVLINK_RX_BYTES": ("nvlink_rx_bps", 1.0),
}
SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{(.*)\})?\s+(\S+)(?:\s+(-?\d+))?\s*$")
LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')
TIME_IN_NAME = re.compile(r"(\d{10}(?:\.\d+)?)")


def comment_time(text: str) -> float | None:
    """`# 2025-07-27T00:34:45Z`, `# 2025-07-27 00:34:45.1`, `# 1753576485.1`, `# time=...` -> unix s."""
    s = text.lstrip("#").strip()
    s = s.split("=", 1)[1].strip() if "=" in s and not s.startswith(("HELP", "TYPE")) else s
    if re.fullmatch(r"\d{9,10}(\.\d+)?", s):
        return float(s)
    try:
        t = dt.datetime.fromisoformat(s.replace("Z", "+00:00"))
    except ValueError:
        return None
    return (t if t.tzinfo else t.replace(tzinfo=dt.timezone.utc)).timestamp()


def read(path: Path, imported: Imported, lines: Lines, o: ReadOptions) -> None:
    read_dcgm(path, imported, lines, o.explicit_host, o.host)


def read_dcgm(path: Path, imported: Imported, lines: Lines, host: str | None, file_host: str) -> None:
    """`host`: --host, which wins over the samples' Hostname label; `file_host`: the name where neither is."""
    name_time = TIME_IN_NAME.search(path.name)
    block_time = float(name_time.group(1)) if name_time else None
    samples: dict[tuple, dict] = {}
    first_line: dict[tuple, int] = {}  # the sample's first line, for the range check's file:line
    seen_in_block: set = set()
    block = 0
    with open_log(path) as f:
        for lineno, line in enumerate(f, start=1):
            line = line.strip()
            if not line:
                continue
            if line.startswith("#"):
                t = comment_time(line)
                if t is not None:
                    block_time, seen_in_block, block = t, set(), block + 1
                continue
            m = SAMPLE.match(line)
            if not m:
                lines.bad(path, lineno, BadLine("line", line, "not a Prometheus sample"))
                continue
            metric, labels, value, stamp = m.group(1), dict(LABEL.findall(m.group(3) or "")), m.group(4), m.group(5)
            if metric not in DCGM_FIELDS:
                continue
            try:
                if GPU_LABEL not in labels:
                    raise BadLine(GPU_LABEL, m.group(2) or "", "no gpu label")
                gpu = int(labels[GPU_LABEL])
                v = float(value)  # Prometheus also writes NaN, +Inf, -Inf: the range check nulls and counts them
                if stamp is not None:
                    t = int(stamp) / 1000.0
                elif block_time is not None:
                    key = (metric, gpu, labels.get(HOST_LABEL))
                    if key in seen_in_block:  # the same series again: the next scrape (no time of its own)
                        raise BadLine("timestamp", line, "a second scrape without a time line before it")
                    seen_in_block.add(key)
                    t = block_time
                else:
                    raise BadLine(
                        "timestamp",
                        line,
                        "no trailing timestamp, no time comment before the scrape, no unix time in the file name",
                    )
            except (BadLine, ValueError) as exc:
                lines.bad(path, lineno, exc if isinstance(exc, BadLine) else BadLine(metric, value))
                continue
            h = host or labels.get(HOST_LABEL) or file_host
            col, scale = DCGM_FIELDS[metric]
            samples.setdefault((h, gpu, t), {})[col] = v * scale
            first_line.setdefault((h, gpu, t), lineno)
            if labels.get(MODEL_LABEL):
                imported.names[(h, gpu)] = labels[MODEL_LABEL]
    if not samples:
        raise InputError(f"{path}: no DCGM samples (needs DCGM_FI_DEV_POWER_USAGE lines with a gpu label)")
    for (h, gpu, t), cols in samples.items():
        power = cols.pop(POWER_W_INSTANT, None)
        if power is not None:
            cols[POWER_W] = power
        imported.add(dict(cols, time=t, host=h, gpu=gpu), path, first_line[(h, gpu, t)])
