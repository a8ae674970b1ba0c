"""How a wattgate process under torchrun ends: with the stage's exit status, after Python's exit handlers (logging,
thread pools, TensorBoard), and without the interpreter's teardown, during which gloo's worker threads can still be
dropping their last collective's tensors and abort the rank (SIGABRT) after the stage succeeded."""

import os
import subprocess
import sys
import textwrap

# an exit handler and an object that only the interpreter's teardown destroys, around a stage refused for bad input
PROGRAM = textwrap.dedent(
    """
    import atexit, sys

    class FreedAtTeardown:
        def __del__(self):
            print("teardown ran", flush=True)

    kept = FreedAtTeardown()
    atexit.register(print, "exit handlers ran", flush=True)
    from wattgate.cli import main

    sys.exit(main(["triage", "--trace", "missing/trace.parquet", "--out", "power"]))
    """
)


def run_program(tmp_path, env_extra: dict) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TORCHELASTIC_RUN_ID"} | env_extra
    return subprocess.run(
        [sys.executable, "-c", PROGRAM], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )


def test_a_torchrun_rank_exits_with_its_status_after_exit_handlers_and_without_teardown(tmp_path):
    proc = run_program(tmp_path, {"TORCHELASTIC_RUN_ID": "job"})
    assert proc.returncode == 2, proc.stderr
    assert "no such trace" in proc.stderr
    assert proc.stdout.splitlines() == ["exit handlers ran"]


def test_outside_torchrun_the_interpreter_ends_as_usual(tmp_path):
    proc = run_program(tmp_path, {})
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout.splitlines() == ["exit handlers ran", "teardown ran"]
