"""Corpus readers: JSONL, Parquet and `datasets.save_to_disk` folders, one record at a time.

Each record is either plain text or a chat (`messages` of {role, content}).
A malformed record raises InputError naming file:line (or file:row) and the
problem, unless the policy is `skip`, in which case it is counted by reason.
"""

from __future__ import annotations

import gzip
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from wattgate.errors import InputError

JSONL_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz")


@dataclass(frozen=True)
class Record:
    where: str  # "file:line" or "file:row N", for messages
    text: str | None = None
    messages: list[dict] | None = None


class BadRecord(Exception):
    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class Fields:
    text: str = "text"
    messages: str = "messages"


def input_format(path: Path) -> str:
    name = path.name.lower()
    if path.is_dir():
        if (path / "dataset_info.json").exists() or (path / "state.json").exists():
            return "datasets"
        if (path / "dataset_dict.json").exists():
            raise InputError(f"{path}: a DatasetDict with several splits; point data.inputs at one split's folder")
        raise InputError(f"{path}: folder is not a datasets.save_to_disk dataset (no dataset_info.json)")
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    raise InputError(f"{path}: unknown input format; use .jsonl/.json(.gz), .parquet or a datasets folder")


def parse_record(obj: Any, fields: Fields, where: str) -> Record:
    """Turn one decoded JSON-like object into a Record, or raise BadRecord."""
    if not isinstance(obj, dict):
        raise BadRecord("not_an_object", f"expected a JSON object, got {type(obj).__name__}")
    messages = obj.get(fields.messages)
    text = obj.get(fields.text)
    if messages is not None:
        if not isinstance(messages, list):
            raise BadRecord("wrong_type", f"field '{fields.messages}' must be a list, got {type(messages).__name__}")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise BadRecord(
                    "wrong_type",
                    f"field '{fields.messages}[{i}]' must be an object with string 'role' and 'content'",
                )
        if not any(m["content"].strip() for m in messages):
            raise BadRecord("empty_document", f"field '{fields.messages}' has no non-empty content")
        return Record(where, messages=[{"role": m["role"], "content": m["content"]} for m in messages])
    if text is not None:
        if not isinstance(text, str):
            raise BadRecord("wrong_type", f"field '{fields.text}' must be a string, got {type(text).__name__}")
        if not text.strip():
            raise BadRecord("empty_document", f"field '{fields.text}' is empty")
        return Record(where, text=text)
    raise BadRecord("missing_field", f"missing field '{fields.text}' or '{fields.messages}'")


def _jsonl_objects(path: Path) -> Iterator[tuple[str, Any]]:
    opener = gzip.open if path.name.lower().endswith(".gz") else open
    with opener(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield where, BadRecord("undecodable_bytes", f"invalid UTF-8 at byte {exc.start}")
                continue
            if not line.strip():
                continue  # blank lines hold no document
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as exc:
                yield where, BadRecord("malformed_json", f"malformed JSON ({exc.msg} at column {exc.colno})")


def _arrow_batches(path: Path, fmt: str, batch_rows: int):
    if fmt == "parquet":
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(path)
        except Exception as exc:  # pyarrow raises several types for a corrupt file
            raise InputError(f"{path}: cannot read Parquet ({exc})") from None
        return pf.schema_arrow.names, pf.iter_batches(batch_size=batch_rows)
    from datasets import load_from_disk

    try:
        ds = load_from_disk(str(path))
    except Exception as exc:
        raise InputError(f"{path}: cannot load dataset ({exc})") from None
    if not hasattr(ds, "with_format") or hasattr(ds, "keys"):
        raise InputError(f"{path}: a DatasetDict with several splits; point data.inputs at one split's folder")
    return ds.column_names, ds.with_format("arrow").iter(batch_size=batch_rows)


def _table_objects(path: Path, fmt: str, fields: Fields, batch_rows: int = 4096) -> Iterator[tuple[str, Any]]:
    names, batches = _arrow_batches(path, fmt, batch_rows)
    columns = [c for c in (fields.messages, fields.text) if c in names]
    if not columns:
        raise InputError(
            f"{path}: no column '{fields.text}' or '{fields.messages}' (columns: {', '.join(names)}); "
            "set data.text_field / data.messages_field"
        )
    row = 0
    for batch in batches:
        cols = {c: batch.column(c).to_pylist() for c in columns}
        for i in range(batch.num_rows):
            yield f"{path}:row {row}", {c: cols[c][i] for c in columns}
            row += 1


class BadRecordPolicy:
    """`error`: the first bad record stops the stage with file:line; `skip`: count it by reason."""

    def __init__(self, mode: str, dropped: Counter):
        self.mode = mode
        self.dropped = dropped

    def handle(self, where: str, bad: BadRecord) -> None:
        if self.mode != "skip":
            raise InputError(
                f"{where}: {bad.detail} [{bad.reason}]; fix the record or set pretokenize.on_bad_record: skip"
            )
        self.dropped[f"bad_record:{bad.reason}"] += 1


def read_records(paths: list[str | Path], fields: Fields, policy: BadRecordPolicy) -> Iterator[Record]:
    """Yield the records of every input in order; bad ones go to `policy`."""
    for p in paths:
        path = Path(p)
        if not path.exists():
            raise InputError(f"{path}: input not found (data.inputs)")
        fmt = input_format(path)
        objects = _jsonl_objects(path) if fmt == "jsonl" else _table_objects(path, fmt, fields)
        for where, obj in objects:
            try:
                if isinstance(obj, BadRecord):
                    raise obj
                yield parse_record(obj, fields, where)
            except BadRecord as bad:
                policy.handle(where, bad)
