"""Config files read the same way by the CLI and the Snakefile: a key given twice in one mapping (PyYAML and
Snakemake keep the last silently, dropping a whole earlier `train:` block) and a non-UTF-8 file are one line."""

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import copy_workflow

from wattgate.cli import main
from wattgate.config import load_config
from wattgate.errors import InputError

TWICE = "train: {seq_len: 256}\nrun_name: x\ntrain: {epochs: 1}\n"


def test_a_key_given_twice_is_refused_naming_the_line(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(TWICE)
    with pytest.raises(InputError, match=r"c\.yaml:3: invalid YAML \(key 'train' given twice in one mapping"):
        load_config(cfg)
    assert main(["demo-corpus", "--config", str(cfg), "--out", str(tmp_path / "d.jsonl")]) == 2
    assert capsys.readouterr().err.count("\n") == 1 and not (tmp_path / "d.jsonl").exists()
    # the same key in two different mappings is fine
    cfg.write_text("train: {seed: 1}\npack: {seed: 2}\n")
    assert load_config(cfg)["pack"]["seed"] == 2


def test_a_config_that_is_not_utf8_is_one_line(tmp_path, capsys):
    cfg = tmp_path / "latin1.yaml"
    cfg.write_bytes(b"run_name: caf\xe9\n")
    assert main(["demo-corpus", "--config", str(cfg), "--out", str(tmp_path / "d.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err == f"wattgate demo-corpus: error: {cfg}: not UTF-8 text (byte 13); save the config as UTF-8\n"


def test_the_workflow_refuses_a_config_file_with_a_key_given_twice(tmp_path):
    work = copy_workflow(tmp_path)
    (work / "my.yaml").write_text(TWICE)
    snakemake = Path(sys.executable).parent / "snakemake"
    proc = subprocess.run(
        [str(snakemake), "-n", "--configfile", "my.yaml"], cwd=work, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode != 0
    assert "my.yaml:3: invalid YAML (key 'train' given twice in one mapping" in proc.stdout + proc.stderr
