import copy
import subprocess
import sys

import pytest
import yaml

from wattgate.config import config_differences, load_config, load_schema, run_config, validate_config
from wattgate.errors import InputError

from conftest import REPO


def test_embedded_default_validates_and_fills_defaults():
    config = load_config(REPO / "config" / "config.yaml")
    assert config["pack"]["remainder"] == "rebin"
    assert config["pretokenize"]["batch_size"] == 1024  # not in the file: a schema default
    assert config["cluster"]["gpu_mem_gib"] is None


def test_empty_config_gets_every_section():
    config = validate_config({})
    assert set(load_schema()["properties"]) <= set(config)
    assert config["train"]["seq_len"] == 512


def test_unknown_key_is_named_with_its_path():
    with pytest.raises(InputError, match=r"unknown key 'train.seqlen'.*allowed under 'train': .*seq_len"):
        validate_config({"train": {"seqlen": 4}})


def test_wrong_type_is_named_with_its_path():
    with pytest.raises(InputError, match=r"key 'train.micro_batch_size'.*integer"):
        validate_config({"train": {"micro_batch_size": "2"}})


def test_bad_enum_is_named():
    with pytest.raises(InputError, match=r"key 'pack.remainder'"):
        validate_config({"pack": {"remainder": "pad"}})


def test_defaults_are_not_shared_between_configs():
    a = validate_config({})
    a["data"]["inputs"].append("x")
    assert validate_config({})["data"]["inputs"] == ["results/corpus/demo.jsonl"]


def test_workflow_schema_is_the_package_schema():
    # one schema: the Snakefile's validate() and the CLI read the same file
    assert (REPO / "workflow/schemas/config.schema.yaml").resolve() == (
        REPO / "src/wattgate/schemas/config.schema.yaml"
    ).resolve()
    assert load_schema()["$schema"].endswith("2020-12/schema")


def test_invalid_yaml_names_the_line(tmp_path):
    bad = tmp_path / "c.yaml"
    bad.write_text("train:\n  seq_len: [1,\n")
    with pytest.raises(InputError, match=r"c.yaml:\d+: invalid YAML"):
        load_config(bad)


def test_cli_exits_2_with_one_line_on_bad_config(tmp_path):
    bad = tmp_path / "c.yaml"
    bad.write_text(yaml.safe_dump({"pack": {"seed": -1}}))
    proc = subprocess.run(
        [sys.executable, "-m", "wattgate", "pack", "--config", str(bad), "--pretokenized", "x", "--out", "y"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "pack.seed" in lines[0]


NAMES = [
    ("run_name",),
    ("cluster", "gpu_model"),
    ("cluster", "slurm", "partition"),
    ("cluster", "slurm", "account"),
    ("cluster", "slurm", "gres"),
]


def _with(path: tuple, value) -> dict:
    config = yaml.safe_load((REPO / "config/config.yaml").read_text())
    node = config
    for key in path[:-1]:
        if node.get(key) is None:
            node[key] = {}
        node = node[key]
    node[path[-1]] = value
    return config


@pytest.mark.parametrize("path", NAMES, ids=".".join)
def test_names_ending_in_a_newline_fail_the_schema_in_the_cli_and_in_snakemake(path):
    from snakemake.exceptions import WorkflowError
    from snakemake.utils import validate

    ok = "a100" if path[-1] == "gres" else "abc"
    validate_config(_with(path, ok))  # the same name without the newline is fine
    with pytest.raises(InputError, match=rf"key '{'.'.join(path)}'"):
        validate_config(_with(path, ok + "\n"))
    with pytest.raises(WorkflowError):
        validate(copy.deepcopy(_with(path, ok + "\n")), str(REPO / "workflow/schemas/config.schema.yaml"))


def test_config_differences_names_each_key_that_differs_between_two_configs():
    mine = run_config({"data": {"inputs": ["a.jsonl"]}, "train": {"lr": 1e-4}})
    gated = run_config({"data": {"inputs": ["a.jsonl"]}, "train": {"lr": 2e-4}})
    assert config_differences(mine, mine) == []
    assert config_differences(mine, gated) == ["train.lr: 0.0001 (gated 0.0002)"]
