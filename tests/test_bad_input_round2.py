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
