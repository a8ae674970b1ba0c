"""Config values never run as shell code (issue 13, item 6).

Every config string that reaches a shell either has a schema `pattern` that rejects shell
metacharacters (names: run_name, cluster.gpu_model, the cluster.slurm strings, the rendezvous
host), or is a path (data.inputs, tokenizer.path, ...) that may hold spaces and is pasted into the
rules' shells quoted (`{input:q}`). The path tests take the shell commands Snakemake would run
(`snakemake -n --printshellcmds`), run them with bash against a stand-in `wattgate` that records
its argv, and check that each value arrived as one literal argument and that nothing ran.
"""

import ast
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from wattgate.config import validate_config
from wattgate.errors import InputError

from conftest import REPO, copy_workflow, write_jsonl

BIN = Path(sys.executable).parent
DOLLAR = "$(touch PWNED)"
BACKTICK = "`touch PWNED`"


# what `touch PWNED` would leave behind (an unquoted gpu_model also lands lower-cased in a path)
def pwned(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.name.lower() == "pwned"]


def fake_wattgate(folder: Path) -> Path:
    """A `wattgate` that appends its argv (JSON, one line per call) to $ARGV_LOG and exits 0."""
    folder.mkdir(parents=True, exist_ok=True)
    exe = folder / "wattgate"
    exe.write_text(
        f"#!{sys.executable}\nimport json, os, sys\n"
        "with open(os.environ['ARGV_LOG'], 'a') as f:\n"
        "    f.write(json.dumps(sys.argv[1:]) + '\\n')\n"
    )
    exe.chmod(0o755)
    return folder


def snakemake(work: Path, *args: str, path_first: Path | None = None, **env) -> subprocess.CompletedProcess:
    path = os.pathsep.join(str(p) for p in [path_first, BIN] if p) + os.pathsep + os.environ["PATH"]
    return subprocess.run(
        [str(BIN / "snakemake"), "--cores", "1", *args],
        cwd=work,
        capture_output=True,
        text=True,
        env=dict(os.environ, PATH=path, **env),
    )


# --- names: the schema rejects shell metacharacters, naming the key --------------------------------

NAMES = {  # key path -> real values the pattern must admit
    "run_name": ["demo", "qwen3-32b-b300", "run_2.1"],
    "cluster.gpu_model": ["cpu", "H100", "A100-80GB", "gb200", "B300"],
    "cluster.rendezvous_host": ["127.0.0.1", "node-01.cluster.local", "[fe80::1]"],
    "cluster.slurm.partition": ["gpu", "gpu-long", "a100,h100"],
    "cluster.slurm.cpu_partition": ["cpu"],
    "cluster.slurm.account": ["my-project", "proj_123"],
    "cluster.slurm.gres": ["gpu:8", "gpu:b300:8", "gpu:a100_80gb:4"],
    "cluster.slurm.extra": [
        "--exclusive",
        "--exclusive --exclude=gpu[01-02] --mail-user=me@site.org",
        "--begin='now + 1 hour' --signal=B:USR1@60",
    ],
}
BAD = [DOLLAR, BACKTICK, "x;touch PWNED", "x\ntouch PWNED"]


def with_key(key: str, value) -> dict:
    config: dict = {}
    *parents, last = key.split(".")
    node = config
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value
    return config


@pytest.mark.parametrize("key", NAMES)
def test_names_admit_real_values(key):
    for value in NAMES[key]:
        validate_config(with_key(key, value))


@pytest.mark.parametrize("payload", BAD, ids=["dollar", "backtick", "semicolon", "newline"])
@pytest.mark.parametrize("key", NAMES)
def test_names_reject_shell_metacharacters_naming_the_key(key, payload):
    with pytest.raises(InputError, match=rf"key '{key}'.*does not match"):
        validate_config(with_key(key, payload))


@pytest.mark.parametrize(
    "key,payload", [("cluster.gpu_model", DOLLAR), ("cluster.gpu_model", BACKTICK), ("run_name", DOLLAR)]
)
def test_snakemake_refuses_the_payload_before_any_shell_runs(tmp_path, key, payload):
    """A real run of `calibrate` (its shell gets --gpu-model, and run_name names every run folder):
    Snakemake's own validate() stops it; no shell ever sees the value."""
    work = copy_workflow(tmp_path)
    config = yaml.safe_load((work / "config/config.yaml").read_text())
    section, _, name = key.rpartition(".")
    (config.setdefault(section, {}) if section else config)[name] = payload
    (work / "config/config.yaml").write_text(yaml.safe_dump(config))
    log = tmp_path / "argv.jsonl"
    proc = snakemake(work, "calibrate", "--forceall", path_first=fake_wattgate(tmp_path / "bin"), ARGV_LOG=str(log))
    assert pwned(tmp_path) == []
    assert not log.exists(), log.read_text()
    assert proc.returncode != 0
    assert name in proc.stdout + proc.stderr and "does not match" in proc.stdout + proc.stderr


# --- cluster.slurm.extra: raw sbatch flags on purpose, re-quoted word by word ----------------------


def sbatch_flags():
    """common.smk's sbatch_flags (plain Python), without loading the workflow."""
    tree = ast.parse((REPO / "workflow/rules/common.smk").read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "sbatch_flags")
    scope = {"shlex": shlex}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), "common.smk", "exec"), scope)
    return scope["sbatch_flags"]


def test_slurm_extra_reaches_sbatch_as_its_words_and_runs_nothing(tmp_path):
    """The executor pastes resources.slurm_extra unquoted into `sbatch ... <extra> ...` (shell=True)."""
    extra = "--exclusive --exclude=gpu[01-02]  --begin='now + 1 hour' --x='$(touch PWNED) `touch PWNED`'"
    validate_config(with_key("cluster.slurm.extra", extra))  # admitted: the payload is single-quoted
    (tmp_path / "gpu01").touch()  # an unquoted gpu[01-02] would glob to it
    words = subprocess.run(
        ["bash", "-c", f"printf '%s\\n' {sbatch_flags()(extra)}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert words == ["--exclusive", "--exclude=gpu[01-02]", "--begin=now + 1 hour", "--x=$(touch PWNED) `touch PWNED`"]
    assert pwned(tmp_path) == []


# --- paths: any characters, passed quoted ---------------------------------------------------------

PATHS = {  # key -> value; spaces and payloads, the files and folders exist
    "data.inputs": [f"my data/a {DOLLAR}.jsonl", f"my data/b {BACKTICK}.jsonl"],
    "tokenizer.path": f"my tok/tok {DOLLAR} {BACKTICK}",
    "model.path": f"my model/m {DOLLAR} {BACKTICK}",
    "train.local_cache_dir": f"scratch {DOLLAR} {BACKTICK}",
    "telemetry.table": f"tables/t {DOLLAR} {BACKTICK}.yaml",
}
# the keys the rules' shells get (the others are read from results/config/demo.yaml by Python only)
IN_A_SHELL = {"data.inputs": "--corpus", "tokenizer.path": "--tokenizer"}


@pytest.fixture(scope="module")
def dry_run_shells(tmp_path_factory, demo_docs):
    """Every shell command of the whole workflow (all, tokenizer, scaling, dataio, calibrate) for a
    config holding PATHS, run with bash against the recording `wattgate`."""
    root = tmp_path_factory.mktemp("quoting")
    (root / "wf").mkdir()
    work = copy_workflow(root / "wf")
    config = yaml.safe_load((work / "config/config.yaml").read_text())
    for key, value in PATHS.items():
        section, name = key.split(".")
        config.setdefault(section, {})[name] = value
    (work / "config/config.yaml").write_text(yaml.safe_dump(config))
    for name in PATHS["data.inputs"]:
        (work / name).parent.mkdir(parents=True, exist_ok=True)
        write_jsonl(work / name, demo_docs[:5])
    (work / PATHS["tokenizer.path"]).mkdir(parents=True)
    proc = snakemake(
        work,
        "-n",
        "--printshellcmds",
        "--forceall",
        "all",
        "results/tokenizer/demo/tokenizer.json",
        "scaling",
        "dataio",
        "calibrate",
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    commands = [
        line.split("Shell command: ", 1)[1]
        for line in (proc.stdout + proc.stderr).splitlines()
        if line.startswith("Shell command: ")
    ]
    assert len(commands) >= 15, proc.stdout
    log = root / "argv.jsonl"
    env = dict(os.environ, ARGV_LOG=str(log), PATH=f"{fake_wattgate(root / 'bin')}{os.pathsep}{os.environ['PATH']}")
    ran = []
    for command in commands:
        # the folders Snakemake would create for outputs and logs (all plain paths under results/ and logs/)
        for word in command.split():
            if word.startswith(("results/", "logs/")):
                (work / word).parent.mkdir(parents=True, exist_ok=True)
        before = log.read_text().count("\n") if log.exists() else 0
        subprocess.run(["bash", "-c", f"set -euo pipefail; {command}"], cwd=work, env=env, capture_output=True)
        after = log.read_text().splitlines() if log.exists() else []
        ran += [(command, json.loads(line)) for line in after[before:]]
    return root, ran


def _values(key):
    value = PATHS[key]
    return value if isinstance(value, list) else [value]


ALL_VALUES = {v for key in PATHS for v in _values(key)}


@pytest.mark.parametrize("key", PATHS)
def test_path_value_runs_nothing_and_is_never_split(dry_run_shells, key):
    root, ran = dry_run_shells
    assert pwned(root) == [], [c for c, _ in ran]
    assert len(ran) >= 15  # every wattgate call happened (a broken shell line would not get there)
    for value in _values(key):
        head = value.split(" ")[0]  # "my", "scratch", "tables/t": what an unquoted value splits into first
        for command, argv in ran:
            for arg in argv:
                if arg == head or arg.startswith(head + " ") or "PWNED" in arg:
                    assert arg in ALL_VALUES, (key, arg, command)


@pytest.mark.parametrize("key", IN_A_SHELL)
def test_path_with_spaces_reaches_its_shell_as_one_argument(dry_run_shells, key):
    _, ran = dry_run_shells
    flag = IN_A_SHELL[key]
    got = [argv[argv.index(flag) + 1 :] for _, argv in ran if flag in argv]
    assert got, f"no shell got {flag}"
    values = _values(key)
    for rest in got:
        assert rest[: len(values)] == values


@pytest.mark.slow
def test_pretokenize_with_spaced_payload_paths_works(tmp_path, demo_docs, tokenizer_dir):
    """One real stage: corpus and tokenizer folder with spaces and payloads in their names."""
    work = copy_workflow(tmp_path)
    corpus, tokenizer = f"my data/c {DOLLAR}.jsonl", f"my tok/t {BACKTICK}"
    (work / corpus).parent.mkdir()
    write_jsonl(work / corpus, demo_docs[:40])
    shutil.copytree(tokenizer_dir, work / tokenizer)
    config = yaml.safe_load((work / "config/config.yaml").read_text())
    config["data"]["inputs"] = [corpus]
    config["tokenizer"]["path"] = tokenizer
    config["train"]["seq_len"] = 256
    (work / "config/config.yaml").write_text(yaml.safe_dump(config))
    proc = snakemake(work, "results/pretokenized/demo/manifest.json")
    assert proc.returncode == 0, (
        proc.stdout[-3000:]
        + proc.stderr[-3000:]
        + ((work / "logs/pretokenize/demo.log").read_text() if (work / "logs/pretokenize/demo.log").exists() else "")
    )
    assert "pretokenize" in proc.stdout + proc.stderr and "train_tokenizer" not in proc.stdout + proc.stderr
    assert any((work / "results/pretokenized/demo").iterdir())
    assert pwned(tmp_path) == []
