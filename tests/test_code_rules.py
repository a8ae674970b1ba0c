"""The package's house rules, read from its source: small signatures, one config currency past the boundary, no
silenced type errors, no history in the code (git keeps it)."""

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "wattgate"
MOST_PARAMETERS = 8


def _modules():
    return sorted(SRC.rglob("*.py"))


def _parameters(f: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = f.args
    n = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + bool(a.vararg) + bool(a.kwarg)
    return n - bool(a.args and a.args[0].arg in ("self", "cls"))


def test_no_function_takes_more_than_eight_parameters():
    """Values that travel together are a named record, so calls read as what they pass."""
    wide = [
        f"{path.relative_to(SRC)}:{f.lineno} {f.name} ({_parameters(f)})"
        for path in _modules()
        for f in ast.walk(ast.parse(path.read_text()))
        if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and _parameters(f) > MOST_PARAMETERS
    ]
    assert wide == []


def test_no_type_error_is_silenced():
    """pyrefly checks src/ in `make lint`; an error is fixed, never ignored."""
    silenced = [
        f"{path.relative_to(SRC)}:{n}"
        for path in _modules()
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"#\s*(type|pyrefly):\s*ignore", line)
    ]
    assert silenced == []


def test_the_code_names_no_issue_numbers():
    """A comment says why the code is as it is; which issue asked for it is in git's history."""
    numbered = [
        f"{path.relative_to(SRC)}:{n}"
        for path in _modules()
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"\bissues? \d+", line, re.IGNORECASE)
    ]
    assert numbered == []
