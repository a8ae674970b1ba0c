"""Corpus readers: JSONL, Parquet and `datasets.save_to_disk` folders, one record at a time.

Each record is either plain text or a chat (`messages` of {role, content}).
A malformed record raises InputError naming file:line (or file:row) and the
problem, unless the policy is `skip`, in which case it is counted by reason.

Chat policy (consistent with `pretokenize.on_bad_record`):
- A role outside KNOWN_ROLES (e.g. ShareGPT's "human"/"gpt", or "developer")
  is a bad record, reason `unknown_role`: templates render unknown roles in
  different ways (some drop the content silently, some invent a header) and
  loss masking only knows "assistant", so it is never guessed.
- Turn order is NOT a bad record: the loss mask depends only on each turn's
  role (assistant content, plus its end-of-turn token, is the target), so
  "user, user" or "assistant first" train exactly what they say. Templates
  that demand alternation raise, which pretokenize already counts as
  `template_error`. Accepted irregular orders are counted in
  `BadRecordPolicy.noted` as `chat:assistant_first` (an assistant turn before
  any user turn) and `chat:consecutive_<role>` (the same user/assistant role
  twice in a row), once per record and reason.
- Every field of a turn besides role and content (`tool_calls`, `tool_call_id`, `name`, ...) is passed to
  the chat template, which renders it: a tool call is part of the assistant turn it belongs to (and of its
  loss). Content may be null beside `tool_calls` (the OpenAI form).
- A lone UTF-16 surrogate anywhere in a record (JSON's "\\ud800" escape without its pair) is a bad record,
  reason `lone_surrogate`: it is not text, and no tokenizer can encode it.
- A record longer than `Fields.max_chars` characters (text, or the sum of a
  chat's contents) is a bad record, reason `too_many_chars`: tokenizing one
  huge string costs ~100-200 bytes of RAM per character (a 50 MB document
  took 10 GB) before `pretokenize.max_doc_tokens` can cut it.
"""

from __future__ import annotations

import gzip
import json
import re
import zlib
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from wattgate.errors import InputError

JSONL_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz")
KNOWN_ROLES = ("system", "user", "assistant", "tool")
# ~100-200 bytes of tokenizer RAM per character: 8 M characters stays around 1-2 GB for one document
DEFAULT_MAX_CHARS = 8_000_000


# one document of the corpus as read (not a typed run record: those are wattgate.records.base.Record)
@dataclass(frozen=True)
class CorpusRecord:
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
    max_chars: int = DEFAULT_MAX_CHARS  # per record (text, or the sum of a chat's contents); <= 0: no limit


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


def parse_record(obj: Any, fields: Fields, where: str, check_unicode: bool = True) -> CorpusRecord:
    """Turn one decoded JSON-like object into a CorpusRecord, or raise BadRecord. `check_unicode: False` skips the
    lone-surrogate walk where none can be (`parse_raw`)."""
    if not isinstance(obj, dict):
        raise BadRecord("not_an_object", f"expected a JSON object, got {type(obj).__name__}")
    messages = obj.get(fields.messages)
    text = obj.get(fields.text)
    if messages is not None:
        if not isinstance(messages, list):
            raise BadRecord("wrong_type", f"field '{fields.messages}' must be a list, got {type(messages).__name__}")
        messages = [_message(m, i, fields) for i, m in enumerate(messages)]
        _check_length(sum(len(m["content"]) + _extra_chars(m) for m in messages), fields)
        if not any(m["content"].strip() or m.get("tool_calls") for m in messages):
            raise BadRecord("empty_document", f"field '{fields.messages}' has no non-empty content")
        if check_unicode:
            _check_unicode(messages, fields.messages)
        return CorpusRecord(where, messages=messages)
    if text is not None:
        if not isinstance(text, str):
            raise BadRecord("wrong_type", f"field '{fields.text}' must be a string, got {type(text).__name__}")
        _check_length(len(text), fields)
        if check_unicode:
            _check_unicode(text, fields.text)
        if not text.strip():
            raise BadRecord("empty_document", f"field '{fields.text}' is empty")
        return CorpusRecord(where, text=text)
    raise BadRecord("missing_field", f"missing field '{fields.text}' or '{fields.messages}'")


def _message(m: Any, i: int, fields: Fields) -> dict:
    """One chat turn as the template gets it: role and content, and every other field the turn has
    (`tool_calls`, `tool_call_id`, `name`, `reasoning_content`, ...), which templates render. Content may be
    null or absent only beside tool_calls (the OpenAI form of a pure tool call); it then renders as ""."""
    if isinstance(m, dict) and m.get("content") is None and m.get("tool_calls") and isinstance(m.get("role"), str):
        m = {**m, "content": ""}
    if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
        raise BadRecord(
            "wrong_type",
            f"field '{fields.messages}[{i}]' must be an object with string 'role' and 'content' "
            "(content may be null beside tool_calls)",
        )
    calls = m.get("tool_calls")
    if calls is not None and not (isinstance(calls, list) and all(isinstance(c, dict) for c in calls)):
        raise BadRecord("wrong_type", f"field '{fields.messages}[{i}].tool_calls' must be a list of objects")
    if m["role"] not in KNOWN_ROLES:
        raise BadRecord(
            "unknown_role",
            f"field '{fields.messages}[{i}].role' is {m['role']!r}; expected one of "
            f"{', '.join(KNOWN_ROLES)} (map other names, e.g. human/gpt, to user/assistant)",
        )
    return {"role": m["role"], "content": m["content"], **{k: v for k, v in m.items() if k not in ("role", "content")}}


def _extra_chars(m: dict) -> int:
    """Characters in a turn's other fields (tool call arguments can be long too)."""
    extra = {k: v for k, v in m.items() if k not in ("role", "content")}
    return len(json.dumps(extra, ensure_ascii=False, default=str)) if extra else 0


_SURROGATE = re.compile("[\ud800-\udfff]")
# The only way a surrogate gets into a decoded JSON string: valid UTF-8 cannot hold one, and Arrow strings are
# valid UTF-8. A `\\ud800` (an escaped backslash) also matches, which costs only the full check.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _first_surrogate(value: Any, path: str) -> tuple[str, int] | None:
    """(field path, index) of the first lone surrogate in any string inside `value`: JSON's \\ud800 escape
    decodes to one, it is not a character, and no tokenizer can encode it."""
    if isinstance(value, str):
        m = _SURROGATE.search(value)
        return (path, m.start()) if m else None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        found = _first_surrogate(v, f"{path}.{k}" if isinstance(k, str) else f"{path}[{k}]")
        if found:
            return found
    return None


def _check_unicode(value: Any, name: str) -> None:
    found = _first_surrogate(value, name)
    if found:
        raise BadRecord(
            "lone_surrogate",
            f"field '{found[0]}' holds a lone UTF-16 surrogate at character {found[1]} (a \\ud800-style escape "
            "without its pair): not text; fix the escape or drop the record",
        )


def _check_length(n: int, fields: Fields) -> None:
    if fields.max_chars > 0 and n > fields.max_chars:
        raise BadRecord(
            "too_many_chars",
            f"document has {n} characters, over the limit of {fields.max_chars} per record (tokenizing one "
            "string takes ~100-200 bytes of RAM per character); split it into smaller records",
        )


def chat_order_notes(messages: list[dict]) -> list[str]:
    """Irregular but accepted turn orders in one chat (see the module docstring), each reason once."""
    notes = []
    roles = [m["role"] for m in messages]
    first = next((r for r in roles if r in ("user", "assistant")), None)
    if first == "assistant":
        notes.append("chat:assistant_first")
    for role in ("user", "assistant"):  # assistant, tool, assistant is the tool-call loop: not consecutive
        if any(a == b == role for a, b in zip(roles, roles[1:])):
            notes.append(f"chat:consecutive_{role}")
    return notes


def _decode_line(raw: bytes) -> Any:
    """One JSONL line -> a decoded object, None for a blank line, or a BadRecord."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return BadRecord("undecodable_bytes", f"invalid UTF-8 at byte {exc.start}")
    if not line.strip():
        return None  # blank lines hold no document
    try:
        return json.loads(line)
    except json.JSONDecodeError as exc:
        return BadRecord("malformed_json", f"malformed JSON ({exc.msg} at column {exc.colno})")
    except RecursionError:
        return BadRecord("too_deeply_nested", "JSON nested too deeply to decode (arrays/objects inside each other)")
    except ValueError as exc:  # e.g. an integer literal over Python's 4300-digit limit
        return BadRecord("malformed_json", f"malformed JSON ({str(exc).split(';')[0]})")


def _jsonl_lines(path: Path) -> Iterator[tuple[str, bytes]]:
    gz = path.name.lower().endswith(".gz")
    lineno: int = 0  # the last line read (the loop sets it)
    try:
        with (gzip.open if gz else open)(path, "rb") as f:
            for lineno, raw in enumerate(f, start=1):
                yield f"{path}:{lineno}", raw
    except (EOFError, zlib.error, gzip.BadGzipFile) as exc:
        if lineno == 0 and isinstance(exc, gzip.BadGzipFile) and "Not a gzipped file" in str(exc):
            raise InputError(f"{path}: not a gzip file; rename it without .gz or compress it with gzip") from None
        raise InputError(
            f"{path}:{lineno + 1}: truncated or corrupt gzip after {lineno} complete line(s) ({exc}); "
            "re-download or re-compress the file"
        ) from None
    except OSError as exc:
        at = f"{path}:{lineno + 1}" if lineno else str(path)
        raise InputError(f"{at}: cannot read: {exc.strerror or exc}; check the file and its permissions") from None


def _arrow_batches(path: Path, fmt: str, batch_rows: int):
    if fmt == "parquet":
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(path)
        except Exception as exc:  # pyarrow raises several types for a corrupt file
            raise InputError(f"{path}: cannot read Parquet ({exc})") from None
        return pf.schema_arrow.names, pf.iter_batches(batch_size=batch_rows)
    from datasets import Dataset, load_from_disk

    try:
        ds = load_from_disk(str(path))
    except Exception as exc:
        raise InputError(f"{path}: cannot load dataset ({exc})") from None
    if not hasattr(ds, "with_format") or hasattr(ds, "keys"):
        raise InputError(f"{path}: a DatasetDict with several splits; point data.inputs at one split's folder")
    assert isinstance(ds, Dataset)  # load_from_disk gives a Dataset or a DatasetDict (refused above)
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
    it = iter(batches)
    while True:
        try:
            batch = next(it, None)
        except (OSError, ValueError) as exc:  # pyarrow: OSError for a damaged page, ArrowInvalid (a ValueError)
            raise InputError(
                f"{path}:row {row}: cannot read the rows from here on ({exc}); re-create or re-download the file"
            ) from None
        if batch is None:
            break
        cols = {c: batch.column(c).to_pylist() for c in columns}
        for i in range(batch.num_rows):
            yield f"{path}:row {row}", {c: cols[c][i] for c in columns}
            row += 1


class BadRecordPolicy:
    """`error`: the first bad record stops the stage with file:line; `skip`: count it by reason.

    `noted` counts records that were kept but are irregular (reason -> records, e.g.
    `chat:assistant_first`); it is not part of `dropped`.
    """

    def __init__(self, mode: str, dropped: Counter, noted: Counter | None = None):
        self.mode = mode
        self.dropped = dropped
        self.noted = Counter() if noted is None else noted

    def handle(self, where: str, bad: BadRecord) -> None:
        if self.mode != "skip":
            raise InputError(
                f"{where}: {bad.detail} [{bad.reason}]; fix the record or set pretokenize.on_bad_record: skip"
            )
        self.dropped[f"bad_record:{bad.reason}"] += 1


def raw_records(paths: Iterable[str | Path], fields: Fields, source: str = "data.inputs") -> Iterator[tuple[str, Any]]:
    """(where, raw) for every record of every input in order, undecoded: a JSONL line's bytes or a table row's
    object. Reading is all the reader does; `parse_raw` (on whichever process encodes) does the rest. `source`
    names where the paths came from (a config key or a command-line option) in the error for a missing one."""
    for p in paths:
        path = Path(p)
        if not path.exists():
            raise InputError(f"{path}: input not found ({source})")
        fmt = input_format(path)
        yield from _jsonl_lines(path) if fmt == "jsonl" else _table_objects(path, fmt, fields)


def parse_raw(raw: Any, fields: Fields, where: str) -> CorpusRecord | None:
    """One raw record -> a CorpusRecord, None for a blank line, or raise BadRecord."""
    if not isinstance(raw, bytes):  # a table row: Arrow strings are UTF-8, so no surrogate can be in them
        return parse_record(raw, fields, where, check_unicode=False)
    obj = _decode_line(raw)
    if isinstance(obj, BadRecord):
        raise obj
    return None if obj is None else parse_record(obj, fields, where, _SURROGATE_ESCAPE.search(raw) is not None)


def read_records(
    paths: Iterable[str | Path], fields: Fields, policy: BadRecordPolicy, source: str = "data.inputs"
) -> Iterator[CorpusRecord]:
    """Yield the records of every input in order; bad ones go to `policy`."""
    for where, raw in raw_records(paths, fields, source):
        try:
            record = parse_raw(raw, fields, where)
        except BadRecord as bad:
            policy.handle(where, bad)
            continue
        if record is None:
            continue
        if record.messages is not None:
            policy.noted.update(chat_order_notes(record.messages))
        yield record
