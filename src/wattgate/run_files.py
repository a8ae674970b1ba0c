"""Run files: what one stage writes and a later stage reads, each reader beside its writer.

The pack stage's plan (plan.json, packs.parquet), the pretokenized manifest.json, the train stage's
heartbeats (state and phase events), metrics.parquet and TRAINED, the watcher's watcher.json, the
gate's gate.json and its verdict markers (PASSED, UNENFORCED). Formats: docs/architecture.md.

One error policy for every reader: a missing file is None (or, where the caller cannot go on without
it, an InputError saying which stage to run first); a file that exists but is damaged is a one-line
InputError naming the file and the stage to rerun. A report built on a silently skipped input would
be wrong rather than incomplete.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, overload

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from wattgate.artifacts import (
    atomic_path,
    canonical_json,
    check_stage_output,
    claim_stage_output,
    sha256_file,
    write_json_atomic,
)
from wattgate.errors import InputError, first_line
from wattgate.heartbeats import HEARTBEAT_DIR
from wattgate.records.base import Where
from wattgate.records.gate import GATE_RERUN, GateReport, PlanHashes
from wattgate.records.trained import Trained
from wattgate.records.watcher import QUIET_VERDICTS as QUIET_VERDICTS, WatcherRecord

# the format_version each reader knows, re-exported: the writers (pack/plan.py, data/pretokenize.py) write the same
from wattgate.records.manifest import MANIFEST_FORMAT_VERSION as MANIFEST_FORMAT_VERSION, Manifest
from wattgate.records.plan import PLAN_FORMAT_VERSION as PLAN_FORMAT_VERSION, Plan

if TYPE_CHECKING:
    import pandas as pd

MANIFEST = "manifest.json"  # pretokenize
PLAN = "plan.json"  # pack (the commit record: carries packs_sha256)
PACKS = "packs.parquet"  # pack
METRICS = "metrics.parquet"  # train (rank 0)
EVAL = "eval.parquet"  # train (rank 0): one row per validation pass
TRAINED = "TRAINED"  # train (rank 0), the stage's declared output
TRAINED_MD = "TRAINED.md"  # train (rank 0): TRAINED for a person
WATCHER = "watcher.json"  # watch (started by launch)
GATE_REPORT = "gate.json"  # gate
EVAL_PACKS = "eval_packs.parquet"  # pack: the validation pass, published with packs.parquet
# A graceful stop (docs/architecture.md "Graceful stop"): launch (or anyone) writes STOP_REQUEST into the run
# folder; every rank also takes SIGTERM/SIGUSR1 as a request. The ranks agree at the next collective-safe
# point, publish a checkpoint, rank 0 writes STOPPED (step, checkpoint, reason) and every rank exits 0;
# launch then exits EXIT_STOPPED (wattgate.errors): "stopped, resume me".
STOP_REQUEST = "STOP_REQUESTED"
STOPPED = "STOPPED"
# The watcher's kill of a hung job: every rank's abort thread (train/stop.py) exits when it appears. A hung rank runs
# no Python signal handler (blocked in a collective), and torchrun waits ~30 s before it SIGKILLs its ranks.
ABORT_REQUEST = "ABORT_REQUESTED"
ATTEMPT_OUTCOME = "attempt-outcome.json"  # launch: how the last attempt ended (train/attempts.py)
GATED_CONFIG = "config.yaml"  # gate: its own copy of the config it checked; launch and train read this one
PROOF_CACHE = "proof-cache.json"  # gate: the collective proof and the inputs it holds for (gate/proof_reuse.py)
MODEL_HASHES = "model-hashes.json"  # train: gate.json's model_files, copied by launch for the ranks' check
RUN_IDENTITY = "run-identity.json"  # train: the identity launch trains under (train/previous_run.py)
# One trainer per run folder (train/run_lock.py): `wattgate launch` holds LAUNCH_LOCK for the whole job and rank 0 of
# `wattgate train` holds TRAIN_LOCK (ranks may be started without launch); each names its holder.
LAUNCH_LOCK = "launch.lock"
TRAIN_LOCK = "train.lock"
# launch's own logs (train/run_log.py): this attempt's output, and every attempt's appended (a rerun keeps the lines
# that named a dead rank)
TRAIN_LOG = "train.log"
ATTEMPTS_LOG = "train.attempts.log"

# The names each stage that writes into its --out in place (rather than publishing a whole folder) may
# find there of its own: such a folder without the `.wattgate-output` marker is an output of a wattgate from
# before the marker (or holds what another rank of the same launch has made by now), and is adopted.
STAGE_FILES = {
    "pack": (PLAN, PACKS, EVAL_PACKS, "history"),
    "gate": (GATE_REPORT, "gate.md", "PASSED", "UNENFORCED", GATED_CONFIG, PROOF_CACHE),
    "train": (
        TRAINED,
        TRAINED_MD,
        METRICS,
        EVAL,
        WATCHER,
        "collectives.json",
        MODEL_HASHES,
        RUN_IDENTITY,
        STOP_REQUEST,
        STOPPED,
        ABORT_REQUEST,
        ATTEMPT_OUTCOME,
        f".spare-{ATTEMPT_OUTCOME}",  # artifacts.reserve_spare: room for it on a full disk
        LAUNCH_LOCK,
        TRAIN_LOCK,
        ATTEMPTS_LOG,
        TRAIN_LOG,
        HEARTBEAT_DIR,
        "checkpoints",
        "checkpoints.stale-*",
        "checkpoints.damaged",
        "final",
        "final.tmp",
        "telemetry",
        "tensorboard",
        "nccl-trace",
    ),
    "loadcheck": ("load-check.json", "nccl-trace"),  # not final/: a folder holding only a final/ is a user's
    "triage": ("phases.parquet", "phase_summary.csv", "triage.json", "triage.md"),
    "report": ("summary.json", "index.html"),
    "compare": ("table.csv", "table.md", "plot.png"),
}


# The option naming the folder a stage writes into, where it is not --out: the run folder is --run-dir
STAGE_FLAGS = {"train": "--run-dir"}


# ---------------------------------------------------------------- the workflow's layout: results/<stage>/<run>/


def stage_folder(run_dir: str | os.PathLike, stage: str) -> Path:
    """Another stage's folder of the same run: results/train/<run> -> results/<stage>/<run> (gate, plan, power)."""
    run_dir = Path(run_dir)
    return run_dir.parent.parent / stage / run_dir.name


def run_folder_beside(out: str | os.PathLike, run_name: str) -> Path:
    """The run folder a stage's --out serves (pack and gate look there for the run's checkpoints): the workflow's
    results/train/<run_name> for results/<stage>/<run>, else train/<run_name> beside --out (work/plan ->
    work/train/<run_name>)."""
    out = Path(out)
    results = out.parent.parent if out.parent.name in ("plan", "gate") and out.name == run_name else out.parent
    return results / "train" / run_name


def gate_folder_of_plan(plan_dir: str | os.PathLike) -> Path:
    """The gate's folder that must have passed a plan folder: results/gate/<run> for the workflow's
    results/plan/<run>, else gate/ beside the plan folder (a layout of one's own, e.g. work/plan and work/gate)."""
    plan_dir = Path(plan_dir)
    return stage_folder(plan_dir, "gate") if plan_dir.parent.name == "plan" else plan_dir.parent / "gate"


def run_config_file(run_dir: str | os.PathLike) -> Path:
    """The run's resolved config as the workflow writes it: results/train/<run> -> results/config/<run>.yaml."""
    run_dir = Path(run_dir)
    return run_dir.parent.parent / "config" / f"{run_dir.name}.yaml"


def check_output(out: str | os.PathLike, stage: str, also: Sequence[str] = ()) -> None:
    """Refuse (InputError) an --out (train: --run-dir) that `stage` may not write into (artifacts.check_stage_output);
    `also`: more names that belong there (compare's variant folders)."""
    check_stage_output(out, stage, (*STAGE_FILES[stage], *also), STAGE_FLAGS.get(stage, "--out"))


def claim_output(out: str | os.PathLike, stage: str, also: Sequence[str] = ()) -> Path:
    """check_output, then create --out (train: --run-dir) and mark it as `stage`'s, before the stage writes anything
    there."""
    return claim_stage_output(out, stage, (*STAGE_FILES[stage], *also), STAGE_FLAGS.get(stage, "--out"))


# packs.parquet's contract (docs/architecture.md); a reader takes any integer width, never a float or a null
PACKS_TYPES = {
    **{c: pa.int32() for c in ("epoch", "step", "micro", "rank", "slot")},
    "doc_ids": pa.list_(pa.int64()),
    "doc_lengths": pa.list_(pa.int32()),
    "num_tokens": pa.int32(),
}
PACKS_COLUMNS = tuple(PACKS_TYPES)


# ---------------------------------------------------------------- the error policy


def _missing(path: Path, what: str, stage: str, exc: OSError | None = None) -> InputError:
    reason = exc.strerror if exc is not None and exc.strerror else "not found"
    return InputError(f"{path}: cannot read {what} ({reason}); run {stage} first")


def read_json_object(path: str | os.PathLike, what: str, rerun: str, *, required: bool = False) -> dict | None:
    """A JSON object; None if the file is missing (InputError "run <rerun> first" if `required`)."""
    found = read_json_bytes(path, what, rerun, required=required)
    return found[0] if found is not None else None


@overload
def read_json_bytes(
    path: str | os.PathLike, what: str, rerun: str, *, required: Literal[True] = True
) -> tuple[dict, bytes]: ...
@overload
def read_json_bytes(path: str | os.PathLike, what: str, rerun: str, *, required: bool) -> tuple[dict, bytes] | None: ...
def read_json_bytes(
    path: str | os.PathLike, what: str, rerun: str, *, required: bool = True
) -> tuple[dict, bytes] | None:
    """A JSON object and the bytes it was parsed from (for a hash of exactly what was read)."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError as exc:
        if required:
            raise _missing(path, what, rerun, exc) from None
        return None
    except OSError as exc:
        raise InputError(f"{path}: cannot read {what} ({exc.strerror or first_line(exc)}); rerun {rerun}") from None
    try:
        obj = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        where = f":{exc.lineno}" if isinstance(exc, json.JSONDecodeError) else ""
        msg = exc.msg if isinstance(exc, json.JSONDecodeError) else "not UTF-8"
        raise InputError(f"{path}{where}: invalid JSON in {what} ({msg}); rerun {rerun}") from None
    if not isinstance(obj, dict):
        raise InputError(f"{path}: {what} is not a JSON object (found {type(obj).__name__}); rerun {rerun}")
    return obj, raw


def read_parquet(
    path: str | os.PathLike, columns: Sequence[str] | None = None, rerun: str = "the stage that wrote it", rank=None
) -> pa.Table:
    """A Parquet table, or with `rank` only its rows whose `rank` column equals it (InputError naming the file and
    `rerun` if it cannot be read). Read through ParquetFile: pq.read_table imports pyarrow.dataset (0.1 s of each
    of the proof's dry runs)."""
    wanted = None if columns is None else list(columns)
    try:
        with pq.ParquetFile(path) as f:
            if rank is None:
                return f.read(columns=wanted)
            return _rank_rows(f, rank, wanted)
    except FileNotFoundError as exc:
        raise _missing(Path(path), "table", rerun, exc) from None
    except (OSError, pa.ArrowException, KeyError, ValueError) as exc:
        raise InputError(f"{path}: cannot read ({first_line(exc)}); rerun {rerun}") from None


def _rank_rows(f: pq.ParquetFile, rank: int, columns: list[str] | None) -> pa.Table:
    """The rows of `rank`, in file order, from only the row groups whose statistics can hold it."""
    meta = f.metadata
    at = next((j for j in range(meta.num_columns) if meta.row_group(0).column(j).path_in_schema == "rank"), None)
    if meta.num_row_groups and at is None:
        raise KeyError("no column named rank")
    groups = []
    for i in range(meta.num_row_groups):
        stats = meta.row_group(i).column(at).statistics
        if stats is None or not stats.has_min_max or stats.min <= rank <= stats.max:
            groups.append(i)
    read = None if columns is None else [*columns, *(["rank"] if "rank" not in columns else [])]
    table = f.read_row_groups(groups, columns=read)
    table = table.filter(pc.is_in(table["rank"], value_set=_integer_array(table["rank"].type, rank)))
    return table if columns is None else table.select(columns)


def _integer_array(kind: pa.DataType, value: int) -> pa.Array:
    """[value] as an Arrow array of `kind`, built from its bytes: pa.scalar, pa.array and to_numpy import pandas
    (0.1-0.2 s of a dry run's fresh start) to ask whether their argument is a pandas object."""
    if not pa.types.is_integer(kind):
        raise ValueError(f"its rank column is {kind}, not integers")
    raw = np.array([value], dtype=np.dtype(kind.to_pandas_dtype())).tobytes()
    return pa.Array.from_buffers(kind, 1, [None, pa.py_buffer(raw)])


def parquet_columns(path: str | os.PathLike, rerun: str) -> list[str]:
    """The column names of a Parquet file (its schema alone)."""
    try:
        return pq.read_schema(path).names
    except FileNotFoundError as exc:
        raise _missing(Path(path), "table", rerun, exc) from None
    except (OSError, pa.ArrowException, ValueError) as exc:
        raise InputError(f"{path}: cannot read ({first_line(exc)}); rerun {rerun}") from None


# ---------------------------------------------------------------- pretokenize: manifest.json


def read_manifest(pretokenized: str | os.PathLike) -> tuple[Manifest, bytes]:
    """The pretokenized manifest and its bytes (the content hash every later stage records). Required.

    Every key a reader uses is checked here, once (records/manifest.py): a wrong one is one line naming the file
    and the key."""
    path = Path(pretokenized) / MANIFEST
    manifest, raw = read_json_bytes(path, "pretokenized manifest", "pretokenize")
    return Manifest.from_json(manifest, Where(str(path), "pretokenize")), raw


# ---------------------------------------------------------------- pack: plan.json, packs.parquet


def read_plan(plan_dir: str | os.PathLike) -> tuple[Plan, bytes]:
    """plan.json and its bytes. Required: without it the pack stage has not run.

    Its shape is checked here, once, for every reader (records/plan.py): each key they use, its type and range (a
    hand-edited plan would otherwise crash a check, or be planned on, far from the key that is wrong)."""
    path = Path(plan_dir) / PLAN
    plan, raw = read_json_bytes(path, "plan", "pack")
    return Plan.from_json(plan, Where(str(path), "pack")), raw


# Arrow's own to_numpy imports pandas (a third of a second, more than a proof-reusing gate's checks take): numeric
# columns without nulls are read as a view of their data buffer instead
_NUMPY_TYPES = {
    pa.int8(): np.int8,
    pa.int16(): np.int16,
    pa.int32(): np.int32,
    pa.int64(): np.int64,
    pa.uint8(): np.uint8,
    pa.uint16(): np.uint16,
    pa.uint32(): np.uint32,
    pa.uint64(): np.uint64,
    pa.float32(): np.float32,
    pa.float64(): np.float64,
}


def arrow_numpy(values: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """An Arrow column as a (read-only) numpy array, without importing pandas where the type allows."""
    array = values.combine_chunks() if isinstance(values, pa.ChunkedArray) else values
    dtype = _NUMPY_TYPES.get(array.type)
    if dtype is None or array.null_count:
        return array.to_numpy(zero_copy_only=False)
    return np.frombuffer(array.buffers()[1], dtype=dtype, count=array.offset + len(array))[array.offset :]


@dataclass(frozen=True)
class PackRows:
    """packs.parquet as arrays: one entry per row, documents flattened with row offsets."""

    epoch: np.ndarray
    step: np.ndarray
    micro: np.ndarray
    rank: np.ndarray
    slot: np.ndarray
    num_tokens: np.ndarray
    doc_ids: np.ndarray
    doc_lengths: np.ndarray
    offsets: np.ndarray  # row r holds doc_ids[offsets[r]:offsets[r + 1]]
    length_offsets: np.ndarray  # the same for doc_lengths; must equal `offsets` (checked, not assumed)

    def __len__(self) -> int:
        return len(self.epoch)

    @property
    def docs_per_row(self) -> np.ndarray:
        return np.diff(self.offsets)

    def row_of_doc(self) -> np.ndarray:
        return np.repeat(np.arange(len(self)), self.docs_per_row)

    def sum_per_row(self, per_entry: np.ndarray) -> np.ndarray:
        """Sum of a per-document-entry array over each row (rows may be empty)."""
        totals = np.zeros(len(per_entry) + 1, dtype=np.result_type(per_entry.dtype, np.int64))
        np.cumsum(per_entry, out=totals[1:])
        return totals[self.offsets[1:]] - totals[self.offsets[:-1]]

    @classmethod
    def from_table(cls, t: pa.Table) -> PackRows:
        ids, lengths = t.column("doc_ids").combine_chunks(), t.column("doc_lengths").combine_chunks()

        def offsets_of(lists) -> np.ndarray:
            o = arrow_numpy(lists.offsets).astype(np.int64)
            return o - o[0]

        offsets = offsets_of(ids)
        return cls(
            **{
                c: arrow_numpy(t.column(c)).astype(np.int64)
                for c in ("epoch", "step", "micro", "rank", "slot", "num_tokens")
            },
            doc_ids=arrow_numpy(pc.list_flatten(ids)).astype(np.int64),
            doc_lengths=arrow_numpy(pc.list_flatten(lengths)).astype(np.int64),
            offsets=offsets,
            length_offsets=offsets_of(lengths),
        )


def read_packs(path: str | os.PathLike) -> PackRows:
    """A packs.parquet (the current one, or an archived segment's under history/) as PackRows.

    Its columns are checked against the contract (PACKS_TYPES, integers without nulls) and every row's doc_lengths
    against its doc_ids, so no reader meets a float rank or a list it would index past."""
    names = parquet_columns(path, "pack")
    missing = [c for c in PACKS_COLUMNS if c not in names]
    if missing:
        raise InputError(f"{path}: missing column(s) {', '.join(missing)}; rerun pack")
    table = read_parquet(path, PACKS_COLUMNS, "pack")
    for column in PACKS_COLUMNS:
        if problem := _packs_column_problem(table.column(column), PACKS_TYPES[column]):
            raise InputError(f"{path}: column '{column}' {problem}; rerun pack")
    try:
        rows = PackRows.from_table(table)
    except (pa.ArrowException, KeyError, TypeError, ValueError, AttributeError) as exc:
        raise InputError(f"{path}: malformed columns ({first_line(exc)}); rerun pack") from None
    if not np.array_equal(rows.offsets, rows.length_offsets):
        r = int(np.flatnonzero(np.diff(rows.offsets) != np.diff(rows.length_offsets))[0])
        raise InputError(
            f"{path}: column 'doc_lengths' holds {int(np.diff(rows.length_offsets)[r])} entries in row {r}, "
            f"'doc_ids' {int(np.diff(rows.offsets)[r])}; rerun pack"
        )
    return rows


def _packs_column_problem(column: pa.ChunkedArray, contract: pa.DataType) -> str | None:
    """What is wrong with one packs.parquet column (an integer type, or a list of integers, and no nulls)."""
    kind = column.type
    is_list = pa.types.is_list(kind) or pa.types.is_large_list(kind)
    if is_list != pa.types.is_list(contract) or not pa.types.is_integer(kind.value_type if is_list else kind):
        return f"is {kind}, the contract says {contract}"
    if column.null_count:
        return f"holds {column.null_count} null(s)"
    if is_list and (nulls := sum(chunk.flatten().null_count for chunk in column.chunks)):
        return f"holds {nulls} null entries in its lists"
    return None


def read_rank_packs(plan_dir: str | os.PathLike, rank: int, columns: Sequence[str], name: str = PACKS) -> pa.Table:
    """One rank's rows of packs.parquet, or of the validation pass's eval_packs.parquet (never the others')."""
    return read_parquet(Path(plan_dir) / name, columns, "pack", rank=rank)


# ---------------------------------------------------------------- train: metrics, TRAINED (heartbeats: heartbeats.py)


def check_columns(path: Path, have, needed: Sequence[str], what: str, rerun: str) -> None:
    """InputError naming the file when a table lacks any of `needed`."""
    missing = [c for c in needed if c not in have]
    if missing:
        raise InputError(f"{path}: not a {what} table: missing column(s) {', '.join(missing)}; rerun {rerun}")


def read_metrics_table(
    path: Path, columns: Sequence[str] | None = None, optional: Sequence[str] = ()
) -> pa.Table | None:
    if not path.is_file():
        return None
    names = parquet_columns(path, "train")
    check_columns(path, names, columns or (), "metrics", "train")
    wanted = None if columns is None else [*columns, *(c for c in optional if c in names)]
    return read_parquet(path, wanted, "train")


def read_metrics(
    run: str | os.PathLike, columns: Sequence[str] | None = None, optional: Sequence[str] = ()
) -> pd.DataFrame | None:
    """metrics.parquet (rows per step and rank): `columns` must be there, `optional` are read if there
    (columns None: all). None without the file."""
    table = read_metrics_table(Path(run) / METRICS, columns, optional)
    # one block per column: consolidating them into one 2-D block copies every value (most of the read's time)
    return table.to_pandas(split_blocks=True) if table is not None else None


def read_trained(run: str | os.PathLike, *, required: bool = False) -> Trained | None:
    """TRAINED, the train stage's summary (None: the run did not finish)."""
    path = Path(run) / TRAINED
    found = read_json_object(path, "the train summary", "train", required=required)
    return Trained.from_json(found, Where(str(path), "train")) if found is not None else None


# ---------------------------------------------------------------- watch, gate


def read_watcher(run: str | os.PathLike) -> WatcherRecord | None:
    """watcher.json, the hang watcher's verdict (None: no watcher ran)."""
    path, rerun = Path(run) / WATCHER, "launch (its watcher)"
    data = read_json_object(path, "the watcher's verdict", rerun)
    return WatcherRecord.from_json(data, Where(str(path), rerun)) if data is not None else None


def is_watcher_record(path: Path) -> bool:
    """Whether `path` is a watcher.json (an earlier watcher's verdict, which a new watcher may replace)."""
    record = json.loads(Path(path).read_text())
    return isinstance(record, dict) and {"verdict", "started", "settings", "world_size"} <= record.keys()


def check_no_finding(dest: Path) -> None:
    """Refuse to replace a watcher.json whose verdict found something (a deadlock, a stall, missing ranks,
    killed or only warned about): a standalone watch would overwrite the one record of what happened.
    (launch removes its run's watcher.json itself before a new attempt starts.)"""
    try:
        data = json.loads(dest.read_text())
    except (OSError, ValueError):
        return  # missing (check_file_output vouched for the rest)
    record = WatcherRecord.from_json(data, Where(str(dest)))
    if record.quiet:
        return
    acted = {"kill": "the job was killed", "warn": "it was warned about"}.get(record.action or "", "")
    raise InputError(
        f"{dest}: holds an earlier watcher's verdict '{record.verdict}'{f' ({acted})' if acted else ''}; a new watch "
        "would replace it: pass --out elsewhere, or move or remove that file first"
    )


def read_gate_json(gate_dir: str | os.PathLike) -> dict | None:
    """gate.json as parsed, for the one reader that draws what is left of a damaged one (report/gate_input.py);
    None: the gate has not run."""
    return read_json_object(Path(gate_dir) / GATE_REPORT, "the gate report", GATE_RERUN)


def read_gate_report(gate_dir: str | os.PathLike) -> GateReport | None:
    """gate.json, the gate's checks and forecast (None: the gate has not run)."""
    data = read_gate_json(gate_dir)
    if data is None:
        return None
    return GateReport.from_json(data, Where(str(Path(gate_dir) / GATE_REPORT), GATE_RERUN))


def write_gate_report(gate_dir: str | os.PathLike, report: GateReport) -> None:
    write_json_atomic(Path(gate_dir) / GATE_REPORT, report.to_json())


MARKER_HASH_FILES = (PLAN, PACKS)


def marker_text(first_line: str, plan_sha256: PlanHashes | None, config_sha256: str | None = None) -> bytes:
    """A verdict marker: one line for people, then the sha256 of the plan files and of the config it is about.

    `wattgate launch` refuses a plan whose files do not hash to what the marker names, and a config other than
    the one the gate checked, so a pass can never be carried over to a plan or a config the gate did not see.
    """
    digests = (plan_sha256.plan, plan_sha256.packs) if plan_sha256 is not None else ("unknown", "unknown")
    lines = [first_line] + [f"{name} sha256 {digest}" for name, digest in zip(MARKER_HASH_FILES, digests)]
    if config_sha256:
        lines.append(f"{GATED_CONFIG} sha256 {config_sha256}")
    return ("\n".join(lines) + "\n").encode()


def read_marker_hashes(marker: Path) -> dict[str, str]:
    """{file name: sha256} from a PASSED/UNENFORCED marker: the plan files' and the config's under GATED_CONFIG
    (the sha256 of its canonical text, wattgate.config.config_sha256). A marker missing any of them is refused in
    one line (InputError)."""
    hashes = {}
    for line in marker.read_text(errors="replace").splitlines()[1:]:
        name, _, digest = line.partition(" sha256 ")
        if name in (*MARKER_HASH_FILES, GATED_CONFIG) and digest:
            hashes[name] = digest.strip()
    for name in (*MARKER_HASH_FILES, GATED_CONFIG):
        if name not in hashes:
            raise InputError(f"{marker}: names no {name} sha256; rerun the gate")
    return hashes


# ---------------------------------------------------------------- the writers


def write_manifest(folder: str | os.PathLike, manifest: Manifest) -> None:
    write_json_atomic(Path(folder) / MANIFEST, manifest.to_json())


def publish_plan(
    out: Path,
    plan: Plan,
    write_packs_to: Callable[[Path], object],
    write_eval_to: Callable[[Path], object] | None = None,
) -> Plan:
    """Publish packs.parquet and plan.json as one set: plan.json is the commit record.

    Both are written in full under temporary names first. Then the old plan.json is removed,
    packs.parquet is renamed into place, and plan.json (carrying packs_sha256) last. A kill at
    any point leaves the old pair, or no plan.json (the stage reads as not run: rerun pack), or
    the new pair: never a plan.json beside packs it does not describe. The folder itself is not
    swapped, since it also holds files that are not this plan's (the history of a continued plan).
    eval_packs.parquet (the validation pass, `write_eval_to`) is published with packs.parquet;
    a plan without validation removes an earlier plan's.
    """
    claim_output(out, "pack")
    plan_path = out / PLAN
    with atomic_path(plan_path) as plan_tmp:
        with contextlib.ExitStack() as files:
            packs_tmp = files.enter_context(atomic_path(out / PACKS))
            write_packs_to(packs_tmp)
            plan = plan.replace(packs_sha256=sha256_file(packs_tmp))
            if write_eval_to is not None:
                eval_tmp = files.enter_context(atomic_path(out / EVAL_PACKS))
                write_eval_to(eval_tmp)
                assert plan.validation is not None  # pack passes an eval writer only with the plan's validation
                plan = plan.replace(validation=plan.validation.replace(packs_sha256=sha256_file(eval_tmp)))
            plan_tmp.write_bytes(canonical_json(plan.to_json()).encode())
            plan_path.unlink(missing_ok=True)  # retire the old commit record before its packs change
            if write_eval_to is None:
                (out / EVAL_PACKS).unlink(missing_ok=True)  # an earlier plan's pass: never beside this plan
        # packs.parquet (and eval_packs.parquet) are in place here; plan.json follows as this block ends
    return plan
