"""The typed-record base: a frozen dataclass read from a JSON object and written back to one.

A record's fields are its JSON keys. `Record.from_json` checks every key against the field's type (and the
range its metadata gives) and raises a one-line InputError naming the file and the key path; `to_json` gives
the mapping a writer hands to `write_json_atomic`. Nothing else in the package reads a record by key.

Types a field may have: int, float (a finite number; an integer stays an integer, so a rewritten file keeps
its bytes), str, bool, a Literal of strings, a nested Record, `tuple[X, ...]`, `dict[str, X]`, `X | None`,
and `Any` (kept as read: a free-form part of a record, such as a measured figure's own table).
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Self, Union

from wattgate.errors import InputError


class _Absent:
    """The value of a field whose key the writer left out, where the key is written null when it has no value
    (so None cannot stand for "left out"): `to_json` writes no key for it."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "ABSENT"

    def __bool__(self) -> bool:
        return False


ABSENT: Any = _Absent()


def spec(
    *,
    key: str | None = None,
    minimum: float | None = None,
    maximum: float | None = None,
    omit_none: bool = False,
    default: Any = dataclasses.MISSING,
    default_factory: Any = dataclasses.MISSING,
):
    """A record field's JSON rules: its `key` when that is not a Python name, its range, and
    `omit_none` for a key the writer leaves out (rather than writing null) when there is no value.
    A field with a default is optional on read."""
    meta = {"key": key, "minimum": minimum, "maximum": maximum, "omit_none": omit_none}
    return dataclasses.field(default=default, default_factory=default_factory, metadata=meta)


@dataclass(frozen=True)
class Where:
    """Where a record came from, for its errors: the file and the stage that writes it (what to rerun)."""

    path: str
    rerun: str = ""

    def bad(self, key: str, what: str, value: Any = dataclasses.MISSING) -> InputError:
        found = ""
        if value is not dataclasses.MISSING:
            shown = json.dumps(value, default=str)
            found = f"({shown if len(shown) <= 40 else shown[:37] + '...'}) "
        return InputError(f"{self.path}: {key!r} {found}is not {what}{self._rerun()}")

    def missing(self, key: str) -> InputError:
        return InputError(f"{self.path}: missing key {key!r}{self._rerun()}")

    def _rerun(self) -> str:
        return f"; rerun {self.rerun}" if self.rerun else ""


class Record:
    """Mixin of every typed record (subclasses are `@dataclass(frozen=True, kw_only=True)`)."""

    FORMAT_VERSION: ClassVar[int | None] = None  # a top-level record's `format_version`, checked on read

    if TYPE_CHECKING:  # every subclass is a dataclass: what dataclasses.replace and fields take
        __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]

    @classmethod
    def from_json(cls, data: Any, where: Where | str = "record", prefix: str = ""):
        where = where if isinstance(where, Where) else Where(where)
        if not isinstance(data, Mapping):
            raise where.bad(prefix.rstrip(".") or "<top level>", "a JSON object", data)
        if cls.FORMAT_VERSION is not None and not prefix:
            _check_format_version(where, data, cls.FORMAT_VERSION)
        values = {}
        for f, hint in _fields(cls):
            key = f.metadata.get("key") or f.name
            if key not in data:
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    raise where.missing(prefix + key)
                continue
            values[f.name] = _convert(data[key], hint, where, prefix + key, f.metadata)
        try:
            return cls(**values)
        except ValueError as exc:  # a record's own cross-field rule (__post_init__)
            raise InputError(f"{where.path}: {prefix}{exc}{where._rerun()}") from None

    @classmethod
    def read(cls, path: str | Path, rerun: str = ""):
        """The record in a JSON file (a one-line InputError when it is missing, unreadable or wrong)."""
        path = Path(path)
        try:
            data = json.loads(path.read_bytes())
        except FileNotFoundError:
            raise InputError(f"{path}: not found{'; run ' + rerun if rerun else ''}") from None
        except OSError as exc:
            raise InputError(f"{path}: cannot read ({exc.strerror})") from None
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise InputError(f"{path}: not valid JSON ({exc}){'; rerun ' + rerun if rerun else ''}") from None
        return cls.from_json(data, Where(str(path), rerun))

    def to_json(self) -> dict:
        """The JSON object of this record: each field under its key (a nested record as its own object)."""
        out = {}
        for f, _ in _fields(type(self)):
            value = getattr(self, f.name)
            if value is ABSENT or (value is None and f.metadata.get("omit_none")):
                continue
            out[f.metadata.get("key") or f.name] = _to_json(value)
        if self.FORMAT_VERSION is not None and "format_version" not in out:
            out["format_version"] = self.FORMAT_VERSION
        return out

    def replace(self, **changes: Any) -> Self:
        return dataclasses.replace(self, **changes)


def _check_format_version(where: Where, data: Mapping, known: int) -> None:
    found = data.get("format_version")
    if type(found) is not int or found != known:  # not `==`: True and 1.0 equal 1
        said = "no format_version" if found is None else f"format_version {json.dumps(found)}"
        raise InputError(
            f"{where.path}: {said}, this wattgate reads format_version {known}: written by another wattgate "
            f"version{': rerun ' + where.rerun if where.rerun else ''}"
        )


@cache
def _fields(cls) -> tuple:
    hints = typing.get_type_hints(cls)
    return tuple((f, hints[f.name]) for f in dataclasses.fields(cls))


def _to_json(value: Any) -> Any:
    if isinstance(value, Record):
        return value.to_json()
    if isinstance(value, tuple | list):
        return [_to_json(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_json(v) for k, v in value.items()}
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _describe(hint: Any) -> str:
    origin, args = _shape(hint)
    if hint is int:
        return "an integer"
    if hint is float:
        return "a finite number"
    if hint is str:
        return "a string"
    if hint is bool:
        return "true or false"
    if origin is Literal:
        return "one of " + ", ".join(json.dumps(a) for a in args)
    if origin in (Union, types.UnionType):
        kinds = [a for a in args if a is not type(None)]
        return ("null or " if len(kinds) < len(args) else "") + " or ".join(_describe(a) for a in kinds)
    if origin in (tuple, list):
        return f"a list, each entry {_describe(args[0])}"
    if origin is dict or hint is dict:
        return "a JSON object"
    if isinstance(hint, type) and issubclass(hint, Record):
        return "a JSON object"
    return "a value"


@cache
def _shape(hint: Any) -> tuple[Any, tuple]:
    """A hint's origin and arguments, looked up once per hint: a large record converts thousands of values."""
    return typing.get_origin(hint), typing.get_args(hint)


def _plain_numbers(values: list | tuple, item: Any, meta: Mapping) -> bool:
    """Whether every entry is already what `item` (int or float, without bounds) asks for: the list is taken as
    it is (a wrong entry goes the long way, which names it)."""
    if (item is not int and item is not float) or meta.get("minimum") is not None or meta.get("maximum") is not None:
        return False
    if item is int:
        return all(type(v) is int for v in values)
    return all(type(v) is int or (type(v) is float and math.isfinite(v)) for v in values)


def _convert(value: Any, hint: Any, where: Where, key: str, meta: Mapping) -> Any:
    origin, args = _shape(hint)
    if hint is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        kinds = [a for a in args if a is not type(None)]
        for kind in kinds:
            try:
                return _convert(value, kind, where, key, meta)
            except InputError:
                if len(kinds) == 1:
                    raise
        raise where.bad(key, _describe(hint), value)
    if hint is int or hint is float:
        ok = (
            _is_int(value)
            if hint is int
            else (isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value))
        )
        lo, hi = meta.get("minimum"), meta.get("maximum")
        if not ok or (lo is not None and value < lo) or (hi is not None and value > hi):
            what = _describe(hint)
            if lo is not None:
                what += f" >= {lo:g}"
            if hi is not None:
                what += f" <= {hi:g}"
            raise where.bad(key, what, value)
        return value
    if hint is str or hint is bool:
        if not isinstance(value, hint) or (hint is str and isinstance(value, bool)):
            raise where.bad(key, _describe(hint), value)
        return value
    if origin is Literal:
        if value not in args or not isinstance(value, str):
            raise where.bad(key, _describe(hint), value)
        return value
    if origin in (tuple, list):
        if not isinstance(value, list | tuple):
            raise where.bad(key, _describe(hint), value)
        item = args[0]
        if _plain_numbers(value, item, meta):  # e.g. a timeline of thousands of counts: checked in one pass
            return tuple(value) if origin is tuple else list(value)
        items = [_convert(v, item, where, f"{key}[{i}]", meta) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict or hint is dict:
        if not isinstance(value, Mapping):
            raise where.bad(key, _describe(hint), value)
        if not args:
            return dict(value)
        return {k: _convert(v, args[1], where, f"{key}.{k}", meta) for k, v in value.items()}
    if isinstance(hint, type) and issubclass(hint, Record):
        return hint.from_json(value, where, f"{key}.")
    raise TypeError(f"record field {key!r}: unsupported type {hint!r}")
