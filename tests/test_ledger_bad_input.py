"""Bad input rejected at the door, round two (issue 25, section 3): names ending in a newline, header-only and
BOM-prefixed CSV logs, and the throughput ledger."""

import copy

import pytest
import yaml

from conftest import REPO
from wattgate.config import validate_config
from wattgate.errors import InputError
from wattgate.power.importers import import_trace

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


@pytest.mark.parametrize(
    "fmt, text, columns",
    [
        ("csv", "timestamp,power_W\n", "time=timestamp,power_w=power_W"),
        ("zeus", "time,gpu0,gpu1\n", None),
    ],
)
def test_a_header_only_csv_is_an_error_like_nvidia_smi(tmp_path, fmt, text, columns):
    log = tmp_path / "h.csv"
    log.write_text(text)
    with pytest.raises(InputError, match=r"h\.csv: a header line and no sample lines"):
        import_trace(fmt, [log], columns=columns)


@pytest.mark.parametrize("gz", [False, True])
def test_a_utf8_byte_order_mark_is_not_part_of_the_first_header_name(tmp_path, gz):
    import gzip

    data = "\ufefftimestamp,power_W\n1753576485.0,70\n1753576486.0,71\n".encode()
    log = tmp_path / ("b.csv.gz" if gz else "b.csv")
    log.write_bytes(gzip.compress(data) if gz else data)
    table, _ = import_trace("csv", [log], columns="time=timestamp,power_w=power_W")
    assert table.column("power_w").to_pylist() == [70.0, 71.0]


def _ledger_record(**changes) -> dict:
    import numpy as np

    from wattgate.ledger import run_record

    rec = run_record(
        run_name="earlier",
        shape={"hidden_size": 64},
        gpu_model="cpu",
        world_size=2,
        seq_len=256,
        micro_batch_size=2,
        attn_weight=1e-5,
        step_costs=np.full(8, 1000.0),
        step_times=[1.0] * 8,
        tokens=8000,
        startup_s=2.0,
        load_s=1.0,
        checkpoints=1,
        checkpoint_s=1.0,
        checkpoint_bytes=1000,
        export_s=1.0,
        export_bytes=1000,
        job_s=20.0,
    )
    rec.update(changes)
    return rec


@pytest.mark.parametrize(
    "line, field",
    [
        ('{"cost_per_s": NaN}', "cost_per_s"),
        ('{"cost_per_s": Infinity}', "cost_per_s"),
        ('{"cost_per_s": "fast"}', "cost_per_s"),
        ('{"cost_per_s": -5}', "cost_per_s"),
        ('{"cost_per_s": true}', "cost_per_s"),
        ('{"cost_per_s": 5, "time": "yesterday"}', "time"),
        ('{"cost_per_s": 5, "time": 1e300}', "time"),
        ('{"cost_per_s": 5, "startup_s": -1e6}', "startup_s"),
        ('{"cost_per_s": 5, "load_s": "1 s"}', "load_s"),
        ('{"cost_per_s": 5, "warmup_s": 1e30}', "warmup_s"),
        ('{"cost_per_s": 5, "storage_gbps": -1}', "storage_gbps"),
        ('{"cost_per_s": 5, "world_size": 2.5}', "world_size"),
        ('{"cost_per_s": 5, "shape_key": 7}', "shape_key"),
        ('{"cost_per_s": 5, "steps": -1}', "steps"),
        ("[1, 2]", None),
    ],
)
def test_a_bad_ledger_line_is_rejected_with_file_line_and_field(tmp_path, line, field):
    import json

    from wattgate.ledger import read_ledger

    ledger = tmp_path / "throughput.jsonl"
    ledger.write_text(json.dumps(_ledger_record()) + "\n" + line + "\n")
    pattern = r"throughput\.jsonl:2: not a throughput record \("
    pattern += rf"field '{field}' is .*expected" if field else "a JSON object expected"
    with pytest.raises(InputError, match=pattern):
        read_ledger(ledger)


def test_a_negative_startup_no_longer_gives_a_forecast_that_fits(tmp_path):
    """Before: startup_s -1e6 passed and the forecast's wall time went negative."""
    import json

    from wattgate.ledger import read_ledger

    ledger = tmp_path / "throughput.jsonl"
    good = _ledger_record()
    ledger.write_text(json.dumps(good) + "\n")
    assert read_ledger(ledger) == [good]  # a record train writes is valid, every field checked
    ledger.write_text(json.dumps(_ledger_record(startup_s=-1e6)) + "\n")
    with pytest.raises(InputError, match=r"throughput\.jsonl:1: .*'startup_s' is -1000000"):
        read_ledger(ledger)
