"""The layer contracts in pyproject.toml (docs/architecture.md, "Layers"): kept by the package, and broken by an
upward import even when it hides inside a function, and by a circle between sibling modules."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def lint_imports() -> str:
    exe = Path(sys.executable).with_name("lint-imports")
    found = str(exe) if exe.exists() else shutil.which("lint-imports")
    if found is None:
        pytest.fail("lint-imports not installed: pip install -e '.[test]' (import-linter is in the test extra)")
    return found


def run_lint(cwd: Path, src: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(src))
    return subprocess.run([lint_imports(), "--no-cache"], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def copy_of_the_package(tmp_path: Path) -> Path:
    """src/wattgate and pyproject.toml under tmp_path, to break on purpose."""
    shutil.copytree(
        ROOT / "src" / "wattgate", tmp_path / "src" / "wattgate", ignore=shutil.ignore_patterns("__pycache__")
    )
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path / "src"


def add_function(path: Path, body: str) -> None:
    path.write_text(path.read_text() + "\n\ndef _reaches_up():\n" + body + "\n")


def test_the_package_keeps_its_layer_contracts():
    r = run_lint(ROOT, ROOT / "src")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Stages import only downward KEPT" in r.stdout and "No circles" in r.stdout and "0 broken" in r.stdout


def test_a_function_level_import_of_a_higher_layer_breaks_the_layers(tmp_path):
    src = copy_of_the_package(tmp_path)
    add_function(
        src / "wattgate" / "pack" / "bfd.py", "    from wattgate.gate.run import run_gate\n\n    return run_gate"
    )
    r = run_lint(tmp_path, src)
    assert r.returncode == 1, r.stdout
    assert "wattgate.pack is not allowed to import wattgate.gate" in r.stdout
    assert "wattgate.pack.bfd -> wattgate.gate.run" in r.stdout


def test_a_bottom_module_importing_a_stage_breaks_the_layers(tmp_path):
    src = copy_of_the_package(tmp_path)
    add_function(src / "wattgate" / "schedule.py", "    from wattgate.train import loop\n\n    return loop")
    r = run_lint(tmp_path, src)
    assert r.returncode == 1, r.stdout
    assert "wattgate.schedule -> wattgate.train.loop" in r.stdout


def test_a_circle_between_sibling_modules_is_refused(tmp_path):
    src = copy_of_the_package(tmp_path)
    add_function(src / "wattgate" / "pack" / "planner.py", "    from wattgate.pack import plan\n\n    return plan")
    r = run_lint(tmp_path, src)
    assert r.returncode == 1, r.stdout
    assert "No cycles are allowed in wattgate.pack" in r.stdout
