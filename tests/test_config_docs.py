"""docs/configuration.md is generated from the config schema (scripts/config_docs.py) and `make lint` checks it."""

import subprocess
import sys

import yaml

from conftest import REPO

SCRIPT = REPO / "scripts" / "config_docs.py"
SCHEMA = REPO / "src" / "wattgate" / "schemas" / "config.schema.yaml"


def key_paths(node, prefix=""):
    for key, child in node.get("properties", {}).items():
        yield prefix + key
        yield from key_paths(child, prefix + key + ".")


def run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=60)


def test_every_key_of_the_schema_has_one_row_with_its_default(tmp_path):
    assert run("--out", tmp_path / "c.md").returncode == 0
    lines = (tmp_path / "c.md").read_text().splitlines()
    schema = yaml.safe_load(SCHEMA.read_text())
    for group, node in schema["properties"].items():  # a section per group; a group without keys is its own row
        assert lines.count(f"## `{group}`") == 1, group
        if "properties" not in node:
            assert sum(line.startswith(f"| `{group}` |") for line in lines) == 1, group
    for path in key_paths(schema):
        if "." in path:
            assert sum(line.startswith(f"| `{path}` |") for line in lines) == 1, path
    row = next(line for line in lines if line.startswith("| `train.betas` |"))
    assert "| `[0.9, 0.95]` |" in row and "exactly 2 items" in row
    row = next(line for line in lines if line.startswith("| `pack.remainder` |"))
    assert "`rebin` \\| `drop` \\| `none`" in row  # a bare | would split the table cell


def test_the_page_in_the_repo_is_current():
    assert run("--check", REPO / "docs" / "configuration.md").returncode == 0


def test_check_fails_on_a_stale_page_and_says_how_to_regenerate(tmp_path):
    page = tmp_path / "c.md"
    assert run("--out", page).returncode == 0
    page.write_text(page.read_text().replace("`rebin`", "`rebin2`", 1))
    proc = run("--check", page)
    assert proc.returncode == 1
    schema = "src/wattgate/schemas/config.schema.yaml"
    assert proc.stderr.strip() == f"{page}: stale ({schema} changed); run python scripts/config_docs.py --out {page}"
