"""Triage tables: per GPU model, the power and utilization thresholds that separate phases.

Shipped tables (`triage_tables/<model>.yaml`) come from published caps and idle
draws and say so in their provenance; `wattgate calibrate` writes the same
format from measured phases on a real GPU, and a calibrated table given with
`--table` (or placed at `triage_tables/<model>.yaml`) takes precedence.

Power bands, in window-mean watts:
  [0, low_max_w)              low: idle, a waiting kernel (deadlock, a rank
                              waiting on a checkpointing peer), checkpoint I/O
  [low_max_w, compute_min_w)  communication (NCCL kernels move data, SMs idle)
  [compute_min_w, ...)        compute
Utilization splits the low band: >= busy_util_pct means a kernel stayed
resident (a spinning NCCL wait reads ~100%); <= idle_util_pct means none ran.

TriageSettings is the one home of triage's defaults (1 s windows, a deadlock
after 60 s) and of the order in which a table is picked: an explicit table
file, else an explicit GPU model, else the run config's telemetry.table, else
its cluster.gpu_model (when a table ships for it), else the trace's device
names. It sits at the bottom with the tables because triage, the watcher, the
gate's energy forecast and the report all pick a table the same way.
"""

from __future__ import annotations

import math
import operator
import os
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path

import yaml

from wattgate.errors import InputError
from wattgate.gpus import SHIPPED, triage_table_name
from wattgate.records.run_config import RunConfig

# The power phases triage labels a window with (not the training loop's heartbeat phases).
POWER_PHASES = ("compute", "communication", "data_starvation", "checkpoint", "deadlock", "idle")


@dataclass(frozen=True)
class TriageTable:
    gpu_model: str
    match: tuple[str, ...]  # substrings of the NVML device name that select this table
    tdp_w: float
    idle_w: float  # typical idle draw
    low_max_w: float  # top of the low-power band
    compute_min_w: float  # bottom of the compute band
    busy_util_pct: float = 85.0
    idle_util_pct: float = 5.0
    provenance: dict = field(default_factory=dict)
    phases: dict = field(default_factory=dict)  # calibrated per-phase power/util percentiles

    def to_yaml(self) -> str:
        d = _plain(asdict(self))
        d["match"] = list(self.match)
        return yaml.safe_dump(d, sort_keys=False)


def _plain(x):
    """Builtin types only (yaml.safe_dump refuses str subclasses such as torch's version string)."""
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, bool) or x is None:
        return x
    if isinstance(x, int):
        return operator.index(x)  # a plain int, as int(x): an int subclass (IntEnum) is no YAML int
    if isinstance(x, float):
        return float(x)
    return str(x)


REQUIRED = ("gpu_model", "match", "tdp_w", "idle_w", "low_max_w", "compute_min_w")
NUMBERS = ("tdp_w", "idle_w", "low_max_w", "compute_min_w", "busy_util_pct", "idle_util_pct")
PHASE_STATS = ("power_w", "util_gpu")  # per calibrated phase: percentiles of each (calibrate.power_stats)
_STAT_KEY = re.compile(r"^(n|mean|p\d{1,2})$")


def parse_table(d: dict, source: str) -> TriageTable:
    """A triage table from its mapping, every field checked: a bad one is an InputError naming source and key
    (the stages read these fields as numbers, strings and mappings and must not meet anything else)."""
    if not isinstance(d, dict):
        raise InputError(f"{source}: a triage table must be a mapping")
    missing = [k for k in REQUIRED if k not in d]
    if missing:
        raise InputError(f"{source}: triage table lacks {', '.join(missing)}")
    known = set(TriageTable.__dataclass_fields__)
    unknown = sorted(str(k) for k in d if k not in known)
    if unknown:
        raise InputError(f"{source}: unknown triage table key(s) {', '.join(unknown)}")
    t = TriageTable(
        gpu_model=_text(d["gpu_model"], source, "gpu_model"),
        match=_match(d["match"], source),
        **{k: _number(d[k], source, k) for k in NUMBERS if k in d},
        provenance=_provenance(d.get("provenance"), source),
        phases=_phases(d.get("phases"), source),
    )
    if not (0 <= t.idle_w < t.low_max_w < t.compute_min_w <= 1.5 * t.tdp_w):
        raise InputError(
            f"{source}: need 0 <= idle_w < low_max_w < compute_min_w <= 1.5 x tdp_w "
            f"(got {t.idle_w}, {t.low_max_w}, {t.compute_min_w}, tdp {t.tdp_w})"
        )
    if not (0 <= t.idle_util_pct < t.busy_util_pct <= 100):
        raise InputError(
            f"{source}: need 0 <= idle_util_pct < busy_util_pct <= 100 (got {t.idle_util_pct}, {t.busy_util_pct})"
        )
    return t


def _number(value, source: str, key: str) -> float:
    """A finite number; a numeric string too ("7e2": YAML 1.1 reads exponents without a dot as strings)."""
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InputError(f"{source}: {key} must be a finite number (got {value!r})")
    return value


def _text(value, source: str, key: str) -> str:
    """A non-empty string; a whole number too (a model named 4090 unquoted)."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str) or not value.strip():
        raise InputError(f"{source}: {key} must be a non-empty string (got {value!r})")
    return value


def _match(value, source: str) -> tuple[str, ...]:
    """The device-name substrings: a list of strings (one string alone is a list of one, not its letters)."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list):
        raise InputError(f"{source}: match must be a list of device-name substrings (got {value!r})")
    return tuple(_text(m, source, f"match[{i}]") for i, m in enumerate(items))


def _provenance(value, source: str) -> dict:
    """Where the figures come from: a mapping of named facts; its kind, when given, a string (shown and compared)."""
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise InputError(
            f"{source}: provenance must be a mapping of named facts, e.g. kind: calibrated (got {value!r})"
        )
    if "kind" in value:
        _text(value["kind"], source, "provenance.kind")
    return value


def _phases(value, source: str) -> dict:
    """Calibrated phases: phase -> {power_w: {n, mean, p1..p99}, util_gpu: {...}, matmul_tflops (compute)}."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InputError(f"{source}: phases must be a mapping of phase -> measured figures (got {value!r})")
    out = {}
    for phase, record in value.items():
        where = f"phases.{phase}"
        if phase not in POWER_PHASES:
            raise InputError(f"{source}: {where}: not a phase (one of {', '.join(POWER_PHASES)})")
        if not isinstance(record, dict):
            raise InputError(f"{source}: {where} must be a mapping of measured figures (got {record!r})")
        out[phase] = {}
        for key, figures in record.items():
            if key == "matmul_tflops":
                out[phase][key] = _number(figures, source, f"{where}.{key}")
                if not out[phase][key] > 0:
                    raise InputError(f"{source}: {where}.{key} must be > 0 (got {figures!r})")
            elif key in PHASE_STATS:
                out[phase][key] = _stats(figures, source, f"{where}.{key}")
            else:
                raise InputError(
                    f"{source}: {where}: unknown key {key!r} (known: {', '.join(PHASE_STATS)}, matmul_tflops)"
                )
    return out


def _stats(value, source: str, where: str) -> dict:
    if not isinstance(value, dict):
        raise InputError(f"{source}: {where} must be a mapping of n, mean, p1..p99 (got {value!r})")
    out = {}
    for key, x in value.items():
        if not isinstance(key, str) or not _STAT_KEY.match(key):
            raise InputError(f"{source}: {where}: unknown figure {key!r} (known: n, mean, p1..p99)")
        out[key] = _number(x, source, f"{where}.{key}")
        if key == "n" and not (out[key] >= 0 and float(out[key]).is_integer()):
            raise InputError(f"{source}: {where}.n must be a count of samples (got {x!r})")
    return out


def load_table_file(path: str | os.PathLike) -> TriageTable:
    path = Path(path)
    try:
        d = yaml.safe_load(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise InputError(f"{path}: no such triage table") from None
    except OSError as exc:
        raise InputError(f"{path}: cannot read the triage table ({exc.strerror or exc})") from None
    except UnicodeDecodeError as exc:
        raise InputError(f"{path}: not a triage table: not UTF-8 text (byte {exc.start}); pass a YAML file") from None
    except yaml.YAMLError as exc:
        raise InputError(f"{path}: not valid YAML ({' '.join(str(exc).split())})") from None
    return parse_table(d, str(path))


def shipped_table(name: str) -> TriageTable:
    """The table that ships for GPU model `name` (any spelling gpus.model_key reads: 'h100', 'A100-80GB')."""
    key = triage_table_name(name)
    if key is None:
        raise InputError(
            f"no triage table for GPU model {name!r}; shipped: {', '.join(SHIPPED)}; "
            "pass --table FILE (e.g. from `wattgate calibrate`) "
            "or --power-cap-w W (a table derived from the cap)"
        )
    ref = resources.files("wattgate").joinpath("triage_tables", f"{key}.yaml")
    return parse_table(yaml.safe_load(ref.read_text()), f"wattgate/triage_tables/{key}.yaml")


def detect_table(device_names: list[str]) -> TriageTable | None:
    """The shipped table whose `match` strings appear in the device name (longest match wins)."""
    best, best_len = None, 0
    for key in SHIPPED:
        t = shipped_table(key)
        for name in device_names:
            for m in t.match:
                if m.lower() in name.lower() and len(m) > best_len:
                    best, best_len = t, len(m)
    return best


# Shares of the power cap at which the shipped tables put their edges (medians over A100, H100, H200, B200
# and B300: idle 0.10-0.17, low band top 0.30-0.40, compute 0.54-0.65 of tdp_w)
CAP_SHARES = {"idle_w": 0.15, "low_max_w": 0.36, "compute_min_w": 0.58}


def table_from_power_cap(cap_w: float, name: str = "") -> TriageTable:
    """A table for a GPU no table ships for (V100, L40S, MI-series, anything new), from its power cap alone:
    the shipped tables' edges as shares of their caps. Triage refines it from the run (levels.py)."""
    if not cap_w > 0:
        raise InputError(f"power cap must be > 0 W (got {cap_w})")
    label = name.strip() or f"{cap_w:g} W GPU"
    return TriageTable(
        gpu_model=label,
        match=(),
        tdp_w=float(cap_w),
        idle_w=round(CAP_SHARES["idle_w"] * cap_w, 1),
        low_max_w=round(CAP_SHARES["low_max_w"] * cap_w, 1),
        compute_min_w=round(CAP_SHARES["compute_min_w"] * cap_w, 1),
        provenance={
            "kind": "derived from the power cap",
            "basis": f"cap {cap_w:g} W x the shipped tables' median shares "
            + ", ".join(f"{k} {v:g}" for k, v in CAP_SHARES.items()),
        },
    )


def resolve_table(
    table_path: str | os.PathLike | None,
    gpu_model: str | None,
    device_names: list[str],
    power_cap_w: float | None = None,
) -> TriageTable:
    """--table FILE, else --gpu-model NAME, else detection from the trace's device names; when no table ships
    for the model, one derived from the power cap (--power-cap-w, or the limit the sampler recorded)."""
    if table_path:
        return load_table_file(table_path)
    if gpu_model:
        try:
            return shipped_table(gpu_model)
        except InputError:
            if not power_cap_w:
                raise
            return table_from_power_cap(power_cap_w, gpu_model)
    t = detect_table(device_names)
    if t is None:
        if power_cap_w:
            return table_from_power_cap(power_cap_w, ", ".join(sorted(set(device_names))))
        seen = ", ".join(sorted(set(device_names))) or "no device names in the trace"
        raise InputError(
            f"cannot tell the GPU model ({seen}) and no power cap is recorded; pass --gpu-model "
            f"{'|'.join(SHIPPED)}, --table FILE, or --power-cap-w W (a table derived from the cap)"
        )
    return t


DEFAULT_WINDOW_S = 1.0
DEFAULT_DEADLOCK_AFTER_S = 60.0
# a GPU is a straggler when its peers waited for it in more than this share of the windows they waited
# (telemetry.straggler_share; power/triage/stragglers.py)
DEFAULT_STRAGGLER_SHARE = 0.3


# the shortest window: GPUs update their power reading every 20-100 ms, and unix time over a window of
# picoseconds overflows the window index
MIN_WINDOW_S = 1e-3


def share_value(value, name: str) -> float:
    """A share in [0, 1) (a straggler share of 1 could never be exceeded), or an InputError naming `name`."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        v = math.nan
    if isinstance(value, bool) or not 0.0 <= v < 1.0:
        raise InputError(f"{name}: {value!r} is not a share from 0 up to (not including) 1")
    return v


def positive_seconds(value, name: str, least: float = 0.0) -> float:
    """value as a finite number of seconds > 0 (and >= least), else an InputError naming `name` (a flag or a
    config key): a window of 0 or inf s, or a deadlock after NaN s, has no meaning (and crashed the windowing)."""
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise InputError(f"{name} must be a number of seconds > 0 (got {value!r})") from None
    if isinstance(value, bool) or not (seconds > 0 and math.isfinite(seconds)):
        raise InputError(f"{name} must be a finite number of seconds > 0 (got {value!r})")
    if seconds < least:
        raise InputError(f"{name} must be at least {least:g} s (got {value!r}): GPUs read power every 20-100 ms")
    return seconds


def window_seconds(value, name: str) -> float:
    """A triage window length: positive_seconds, at least MIN_WINDOW_S."""
    return positive_seconds(value, name, MIN_WINDOW_S)


@dataclass(frozen=True)
class TriageSettings:
    table_path: str | os.PathLike | None = None  # a triage table file
    gpu_model: str | None = None  # a shipped table's GPU model
    window_s: float = DEFAULT_WINDOW_S
    deadlock_after_s: float = DEFAULT_DEADLOCK_AFTER_S
    power_cap_w: float | None = None  # every GPU's power cap (an imported log records none)
    straggler_share: float = DEFAULT_STRAGGLER_SHARE

    @classmethod
    def merge(
        cls,
        config: RunConfig | None,
        table_path: str | os.PathLike | None = None,
        gpu_model: str | None = None,
        window_s: float | None = None,
        deadlock_after_s: float | None = None,
        power_cap_w: float | None = None,
        straggler_share: float | None = None,
    ) -> TriageSettings:
        """A run config's telemetry.table, cluster.gpu_model, telemetry.window_s and watcher.hang_after_s,
        each overridden by the command-line flag when given (a table file or GPU model given on the command
        line replaces the config's table choice as a whole)."""
        telemetry = config.telemetry if config is not None else None
        if not (table_path or gpu_model):
            table_path = telemetry.table if telemetry is not None else None
            if not table_path:
                gpu_model = triage_table_name(config.cluster.gpu_model if config is not None else "")
        # `is None`, never `or`: a 0 given is refused, not replaced by the default
        if window_s is None:
            window_s = telemetry.window_s if telemetry is not None else DEFAULT_WINDOW_S
        if deadlock_after_s is None:
            deadlock_after_s = config.watcher.hang_after_s if config is not None else DEFAULT_DEADLOCK_AFTER_S
        if straggler_share is None:
            straggler_share = telemetry.straggler_share if telemetry is not None else DEFAULT_STRAGGLER_SHARE
        window_s = window_seconds(window_s, "window_s")
        deadlock_after_s = positive_seconds(deadlock_after_s, "deadlock_after_s")
        share = share_value(straggler_share, "straggler_share")
        return cls(table_path, gpu_model, window_s, deadlock_after_s, power_cap_w, share)

    @property
    def has_table(self) -> bool:
        """A table was named (file or GPU model), so device names are not needed to pick one."""
        return bool(self.table_path or self.gpu_model)

    def table(self, device_names: Sequence[str] = (), recorded_caps: Sequence[float] = ()) -> TriageTable:
        """The table file, else the GPU model's shipped table, else detection from the device names; for a
        GPU no table ships for, one derived from the power cap (--power-cap-w, else the limit the sampler
        recorded)."""
        return resolve_table(self.table_path, self.gpu_model, list(device_names), self.cap_w(recorded_caps))

    def cap_w(self, recorded_caps: Sequence[float] = ()) -> float | None:
        """--power-cap-w, else the largest enforced limit the sampler recorded, else None."""
        caps = [float(c) for c in recorded_caps if c]
        return self.power_cap_w or (max(caps) if caps else None)

    def table_source(self, table: TriageTable, device_names: Sequence[str] = ()) -> str:
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
