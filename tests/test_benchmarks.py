"""Every benchmark in bench/ at its smoke size, and bench/gpu_checks.sh's CPU dry run (docs/benchmarks.md).

A contract change that breaks a benchmark fails here instead of on a lent GPU's minutes. Each bench script is
found by its `__main__` block, run as a subprocess with `--smoke` (tiny inputs, the same code paths) and must
exit 0 and print its figure line: the figure, its baseline from the same run, the load average. The smoke
figures themselves are not judged. The runs start together, two at a time (most are one Python thread waiting
on imports or a torchrun start-up), and each test waits for its own.

TRL (the `bench` extra) is not in the `test` extra: without it bench/pack.py's smoke run measures our side
alone and must say that the TRL baseline was not measured; with it, the baseline is measured and checked too.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
SCRIPTS = sorted(p.stem for p in BENCH.glob("*.py") if 'if __name__ == "__main__":' in p.read_text())
RUNS = {name: [sys.executable, f"bench/{name}.py", "--smoke"] for name in SCRIPTS}
RUNS["gate-worlds"] = [sys.executable, "bench/gate.py", "--worlds", "--smoke"]
DRY_RUN = "gpu_checks-dry-run"
# the longest first, so that the two at a time end together
LONGEST = (
    DRY_RUN, "train_overhead", "gate", "gate-worlds", "collectives", "load", "loss", "steady_memory", "expert_memory",
)  # fmt: skip
CONCURRENT = 2
TIMEOUT_S = 600
LOAD = r"load average \d+\.\d\d \d+\.\d\d \d+\.\d\d"
HAS_TRL = importlib.util.find_spec("trl") is not None


def figure_lines(bench: str, output: str) -> list[str]:
    """The bench's figure lines (bench/benchlib.py figure): what, figure, baseline, load average."""
    return re.findall(rf"^figure: {re.escape(bench)}: .+?: .+; baseline: .+; {LOAD}$", output, re.MULTILINE)


def command(name: str, tmp: Path) -> list[str]:
    if name == DRY_RUN:
        return ["bash", "bench/gpu_checks.sh", "--dry-run", str(tmp / "out")]
    return RUNS[name]


def run(name: str, tmp: Path) -> subprocess.CompletedProcess:
    tmp.mkdir(parents=True)
    env = dict(os.environ, TMPDIR=str(tmp), PYTHON=sys.executable, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.pop("DRY_RUN", None)
    try:
        return subprocess.run(
            command(name, tmp), cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            timeout=TIMEOUT_S,
        )  # fmt: skip
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout or ""
        return subprocess.CompletedProcess(exc.cmd, -1, f"{out}\n(killed after {TIMEOUT_S} s)")


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """Every selected run of this module, started at once, two at a time: name -> Future of its process."""
    selected = {
        item.callspec.params["name"]
        for item in request.session.items
        if item.module is request.module and "name" in getattr(getattr(item, "callspec", None), "params", {})
    }
    order = sorted(selected, key=lambda n: (LONGEST.index(n) if n in LONGEST else len(LONGEST), n))
    root = tmp_path_factory.mktemp("benchmarks")
    pool = ThreadPoolExecutor(max_workers=CONCURRENT)
    try:
        yield {name: pool.submit(run, name, root / name) for name in order}
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def finished(runs: dict, name: str) -> str:
    proc = runs[name].result()
    assert proc.returncode == 0, f"{' '.join(map(str, proc.args))}: exit {proc.returncode}\n{proc.stdout[-6000:]}"
    return proc.stdout


def test_the_bench_scripts_are_found():
    """The runs below come from bench/*.py's `__main__` blocks (a new bench gets a smoke run without a line here)."""
    assert {"gate", "pack", "pretokenize", "report", "sampler", "train_overhead"} <= set(SCRIPTS)
    assert "benchlib" not in SCRIPTS


@pytest.mark.parametrize("name", sorted(RUNS))
def test_smoke_run_prints_its_figure_against_its_baseline(runs, name):
    bench = name.split("-")[0]
    out = finished(runs, name)
    lines = figure_lines(bench, out)
    assert lines, f"bench/{bench}.py printed no figure line:\n{out[-4000:]}"
    if name == "pack":  # TRL's baseline runs where the bench extra is installed, and says so where it is not
        baseline = "TRL pack_dataset bfd not measured: trl is not installed"
        assert all((baseline in line) != HAS_TRL for line in lines), lines
    if name == "gate-worlds":  # world 2's proof, then the proof on a 2 x 2 mesh at replicate 2, expert 2
        worlds = [re.search(r"world (\d+),", line) for line in lines]
        assert [w.group(1) for w in worlds if w] == ["2"], lines
        assert any("2 x 2 GPUs, replicate 2, expert 2" in line for line in lines), lines


@pytest.mark.parametrize("name", [DRY_RUN])
def test_gpu_checks_dry_run_walks_every_step_on_cpu_stand_ins(runs, name):
    out = finished(runs, name)
    stamps = re.findall(r"^== \[\d+ s\] (\w+)", out, re.MULTILINE)
    assert stamps == ["0", "1", "2", "3", "4", "5", "6", "7", "8", "done"], out[-4000:]
    assert "power source instant" in out  # step 1: the sampler on the stand-in NVML
    assert figure_lines("sampler", out)  # step 2: bench/sampler.py on it
    assert "calibrate: table ->" in out  # step 3
    assert "launch exit status 0" in out and '"verdict": "healthy"' in out  # step 4, under the sampler and watcher
    assert re.search(r"^AC True: .+ steady \d+ tok/s", out, re.MULTILINE)  # step 5
    assert re.search(r"^ tiny +full ", out, re.MULTILINE) and re.search(r"^ tiny +chunked ", out, re.MULTILINE)
    for mesh in ("1d", "hsdp", "ep"):  # step 7: the three meshes, each against the 1-D run
        assert re.search(rf"^{mesh}: mesh .+ steady \d+ tok/s, .+ vs 1-D: tokens/s ", out, re.MULTILINE), out[-4000:]
    for context in (1, 2):  # step 8: a row per rank and a row over two
        assert re.search(rf"^context {context}: steady \d+ tok/s, .+ vs C = 1: ", out, re.MULTILINE), out[-4000:]


@pytest.mark.parametrize(
    "args, message",
    [
        (["bench/mixture.py", "--n", "0"], "argument --n: must be at least 1, not 0"),
        (["bench/forecast_example.py", "no-such-config.yaml"], "no-such-config.yaml"),
        (["bench/pandas_triage.py"], "give trace files, or --smoke"),
    ],
)
def test_a_bad_argument_is_one_line(args, message):
    proc = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 2 and proc.stdout == "", proc
    assert proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr


def test_gpu_checks_refuses_a_bad_phase_length_in_one_line(tmp_path):
    proc = subprocess.run(
        ["bash", "bench/gpu_checks.sh", "--dry-run", str(tmp_path), "fast"], cwd=REPO, capture_output=True, text=True
    )
    assert proc.returncode == 2 and proc.stdout == "", proc
    assert proc.stderr == "gpu_checks.sh: SECONDS_PER_PHASE must be a positive number of seconds, not 'fast'\n"
