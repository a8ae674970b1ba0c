"""The throughput ledger on bad input (issue 25, section 3): every line is checked field by field (type,
finiteness, range) and a bad one is refused with file, line and field; a ledger that is not UTF-8 text or is a
folder is one line too."""

import json

import pytest

from wattgate.errors import InputError
from wattgate.ledger import append_ledger, read_ledger
from wattgate.records.ledger import LedgerLine


def _ledger_record(**changes) -> dict:
    import numpy as np

    from wattgate.ledger import MeasuredSteps, RunShape, StorageWrites, run_record

    rec = run_record(
        run_name="earlier",
        run=RunShape(
            shape={"hidden_size": 64}, gpu_model="cpu", world_size=2, seq_len=256, micro_batch_size=2, attn_weight=1e-5
        ),
        steps=MeasuredSteps(costs=np.full(8, 1000.0), times=[1.0] * 8, tokens=8000),
        writes=StorageWrites(checkpoints=1, checkpoint_s=1.0, checkpoint_bytes=1000, export_s=1.0, export_bytes=1000),
        startup_s=2.0,
        load_s=1.0,
        job_s=20.0,
    )
    return rec.to_json() | changes


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
    assert [r.to_json() for r in read_ledger(ledger)] == [good]  # a record train writes is valid, every field checked
    ledger.write_text(json.dumps(_ledger_record(startup_s=-1e6)) + "\n")
    with pytest.raises(InputError, match=r"throughput\.jsonl:1: .*'startup_s' is -1000000"):
        read_ledger(ledger)


def test_a_non_utf8_ledger_is_an_input_error_naming_the_line(tmp_path):
    ledger = tmp_path / "throughput.jsonl"
    ledger.write_bytes(json.dumps({"cost_per_s": 1.0}).encode() + b"\n\xff\n")
    with pytest.raises(InputError, match=r"throughput\.jsonl:2: the throughput ledger is not UTF-8 text"):
        read_ledger(ledger)


def test_a_ledger_that_is_a_folder_is_an_input_error(tmp_path):
    folder = tmp_path / "ledger"
    folder.mkdir()
    with pytest.raises(InputError, match=r"ledger: forecast\.ledger is not a file"):
        read_ledger(folder)
    with pytest.raises(InputError, match=r"ledger: forecast\.ledger is not a file"):
        append_ledger(folder, LedgerLine(cost_per_s=1.0))
    assert read_ledger(tmp_path / "missing.jsonl") == []


def test_a_damaged_ledger_line_is_one_clear_error(tmp_path):
    ledger = tmp_path / "throughput.jsonl"
    ledger.write_text('{"cost_per_s": 5.0}\nnot json\n')
    with pytest.raises(InputError, match=r"throughput.jsonl:2: not a throughput record .*delete that line"):
        read_ledger(ledger)
