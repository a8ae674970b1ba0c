"""The shape of a JSON record a stage reads (plan.json, manifest.json): its format version and each field's
kind, the first wrong one an InputError naming the file and the key (run_files' readers use these)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from wattgate.errors import InputError


def check_format_version(path: Path, record: dict, known: int, rerun: str) -> None:
    """Refuse a record another wattgate wrote in a form this one does not know (one line, exit 2)."""
    found = record.get("format_version")
    if type(found) is not int or found != known:  # not `==`: True and 1.0 equal 1
        said = "no format_version" if found is None else f"format_version {json.dumps(found)}"
        raise InputError(
            f"{path}: {said}, this wattgate reads format_version {known}: written by another wattgate "
            f"version: rerun {rerun}"
        )


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def count(minimum: int | None):
    """An integer (not a bool) of at least `minimum` (None: any)."""
    what = "an integer" if minimum is None else f"an integer >= {minimum}"
    return (lambda v: is_int(v) and (minimum is None or v >= minimum)), what


def finite(minimum: float):
    ok = lambda v: isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v >= minimum  # noqa: E731
    return ok, f"a finite number >= {minimum:g}"


TEXT = (lambda v: isinstance(v, str)), "a string"
OBJECT = (lambda v: isinstance(v, dict)), "a JSON object"


def nullable(kind):
    test, what = kind
    return (lambda v: v is None or test(v)), f"null or {what}"


def list_of(kind):
    test, what = kind
    return (lambda v: isinstance(v, list) and all(test(x) for x in v)), f"a list, each entry {what}"


class Shape:
    """Checks fields of one JSON file; the first wrong one is an InputError naming the file and the key."""

    def __init__(self, path: Path, rerun: str):
        self.path, self.rerun = path, rerun

    def bad(self, key: str, what: str, found: str = "") -> InputError:
        return InputError(f"{self.path}: {key!r} {found}is not {what}; rerun {self.rerun}")

    def field(self, record: dict, key: str, kind, where: str = "", *, required: bool = True):
        """record[key] after checking it is of `kind` ((test, description)); None when absent and not required."""
        test, what = kind
        if key not in record:
            if required:
                raise InputError(f"{self.path}: missing key {where + key!r}; rerun {self.rerun}")
            return None
        value = record[key]
        if not test(value):
            shown = json.dumps(value)
            raise self.bad(where + key, what, f"({shown if len(shown) <= 40 else shown[:37] + '...'}) ")
        return value
