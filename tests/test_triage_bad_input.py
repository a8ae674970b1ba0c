"""Triage on bad input: two nodes' traces under one host name, triage table YAML validation, window and
hang-limit values (flags, config and triage.json), damaged phases.parquet metadata, and power no GPU draws."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from wattgate.cli import main
from wattgate.config import run_config
from wattgate.errors import InputError
from wattgate.power.energy import gpu_energy, records
from wattgate.power.triage import read_phases, run_triage
from wattgate.report.inputs import read_samples
from wattgate.testing.synthetic_trace import build_trace, gpus_of, job
from wattgate.trace import read_trace, schema_with_meta
from wattgate.triage_tables import TriageSettings, load_table_file, shipped_table

H100 = shipped_table("h100")
PHASES = [("idle", 10), ("compute", 40), ("communication", 10), ("compute", 20)]
TABLE_YAML = """gpu_model: H100
match: ["H100"]
tdp_w: 700
idle_w: 70
low_max_w: 210
compute_min_w: 380
busy_util_pct: 85
idle_util_pct: 5
provenance:
  kind: test figures
"""


def host_trace(seed: int, phases=PHASES) -> pa.Table:
    """Two GPUs of host node0, in the trace schema."""
    return build_trace(job(gpus_of(1, 2), phases), H100, seed=seed).host_table("node0")


def write(table: pa.Table, path, guessed: bool = False) -> str:
    """A trace of host node0; `guessed`: as import-trace writes it when the host is the log file's name."""
    meta = {"host": "node0", "gpus": []} | ({"hosts_from_file_names": ["node0"]} if guessed else {})
    pq.write_table(table.replace_schema_metadata(schema_with_meta(meta).metadata), path)
    return str(path)


def triage_cli(capsys, *args) -> tuple[int, str]:
    rc = main(["triage", *map(str, args)])
    return rc, capsys.readouterr().err


# ---------------------------------------------------------------- one host name, two nodes


def test_two_files_with_the_same_host_over_the_same_time_are_refused_naming_both(tmp_path, capsys):
    """Two nodes' logs imported under one host name: their GPUs would merge (windows averaged, energy halved).
    The same GPUs in two files one after the other (a relaunched job) stay allowed, joined in time."""
    a = write(host_trace(1), tmp_path / "n1.parquet", guessed=True)
    b = write(host_trace(2, [("deadlock", 80)]), tmp_path / "n2.parquet", guessed=True)
    rc, err = triage_cli(capsys, "--gpu-model", "h100", "--trace", a, b, "--out", tmp_path / "out")
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert "n1.parquet" in err and "n2.parquet" in err and "'node0'" in err and "GPU(s) 0-1" in err
    assert "--host NAME" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()  # refused before any output
    # a host both traces name for themselves (a sampler's hostname) is one node's samples split between files
    a, b = write(host_trace(1), tmp_path / "s1.parquet"), write(host_trace(2), tmp_path / "s2.parquet")
    assert triage_cli(capsys, "--gpu-model", "h100", "--trace", a, b, "--out", tmp_path / "joined")[0] == 0

    t = host_trace(3)
    middle = (pc.min(t.column("time")).as_py() + pc.max(t.column("time")).as_py()) / 2
    first = write(t.filter(pc.less(t.column("time"), middle)), tmp_path / "before.parquet")
    second = write(t.filter(pc.greater_equal(t.column("time"), middle)), tmp_path / "after.parquet")
    split = run_triage([first, second], tmp_path / "split", settings=TriageSettings(gpu_model="h100")).to_json()
    whole = run_triage(
        [write(t, tmp_path / "whole.parquet")], tmp_path / "whole", settings=TriageSettings(gpu_model="h100")
    ).to_json()
    assert split["gpus"] == 2 and split["hosts"] == ["node0"]
    assert split["phases"] == whole["phases"]


def test_the_same_trace_given_twice_is_refused_one_file_out_of_order_is_not(tmp_path):
    folder = tmp_path / "telemetry"
    folder.mkdir()
    path = write(host_trace(4), folder / "node0.parquet")
    with pytest.raises(InputError, match="given twice"):
        run_triage(
            [path, folder / ".." / "telemetry" / "node0.parquet"],
            tmp_path / "out",
            settings=TriageSettings(gpu_model="h100"),
        )

    # rows of one file out of time order across its chunks are not two files: summed from the rows sorted
    # together, as the report sums them
    from wattgate.power.triage import files

    t = host_trace(5)
    odd = np.arange(t.num_rows) % 2 == 1
    shuffled = write(pa.concat_tables([t.filter(pa.array(~odd)), t.filter(pa.array(odd))]), tmp_path / "mixed.parquet")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(files, "CHUNK_ROWS", t.num_rows // 2 + 1)  # the halves in separate chunks
        got = run_triage([shuffled], tmp_path / "mixed", settings=TriageSettings(gpu_model="h100")).to_json()["energy"]
    samples = read_samples([read_trace(shuffled).select(["time", "host", "gpu", "power_w", "energy_j"])])
    want = records(gpu_energy(samples), [len(s.energy_pos) for s in samples.series])
    assert got.keys() == want.keys()
    for key in want:
        assert got[key]["integrated_j"] == pytest.approx(want[key]["integrated_j"], rel=1e-9)


# ---------------------------------------------------------------- triage table YAML


@pytest.mark.parametrize(
    "old, new, key",
    [
        ('match: ["H100"]', "match: 5", "match"),
        ("busy_util_pct: 85", "busy_util_pct: high", "busy_util_pct"),
        ("provenance:\n  kind: test figures\n", "provenance: calibrated\n", "provenance"),
        ("provenance:\n  kind: test figures\n", "provenance:\n  kind: [a]\n", "provenance.kind"),
        ("tdp_w: 700", "tdp_w: .inf", "tdp_w"),
        ("idle_w: 70", "idle_w: [70]", "idle_w"),
        ("idle_w: 70", "idle_w: true", "idle_w"),
        ("gpu_model: H100", "gpu_model: {a: 1}", "gpu_model"),
        ("gpu_model: H100", "gpu_model: ''", "gpu_model"),
        ('match: ["H100"]', 'match: ["H100", null]', "match[1]"),
        ("provenance:", "phases:\n  compte: {}\nprovenance:", "phases.compte"),
        ("provenance:", "phases:\n  compute: 5\nprovenance:", "phases.compute"),
        ("provenance:", "phases:\n  compute:\n    power_w: {p50: abc}\nprovenance:", "phases.compute.power_w.p50"),
        ("provenance:", "phases:\n  compute:\n    power_w: {n: 2.5}\nprovenance:", "phases.compute.power_w.n"),
        ("provenance:", "phases:\n  compute:\n    matmul_tflops: fast\nprovenance:", "phases.compute.matmul_tflops"),
        ("provenance:", "phases:\n  compute:\n    matmul_tflops: 0\nprovenance:", "phases.compute.matmul_tflops"),
        ("provenance:", "phases:\n  compute:\n    power: {}\nprovenance:", "phases.compute"),
        ("provenance:", "7: x\nprovenance:", "7"),
    ],
)
def test_a_bad_table_field_is_one_error_naming_the_file_and_key(tmp_path, capsys, old, new, key):
    assert old in TABLE_YAML
    path = tmp_path / "bad.yaml"
    path.write_text(TABLE_YAML.replace(old, new, 1))
    with pytest.raises(InputError) as exc:
        load_table_file(path)
    message = str(exc.value)
    assert str(path) in message and key in message and "\n" not in message
    trace = write(host_trace(6), tmp_path / "node0.parquet")
    rc, err = triage_cli(capsys, "--trace", trace, "--table", path, "--out", tmp_path / "out")
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "out").exists()  # validated before any output


def test_a_table_that_is_not_utf8_text_is_refused(tmp_path):
    path = tmp_path / "bin.yaml"
    path.write_bytes(b"\xff\xfe" + TABLE_YAML.encode("utf-16-le"))
    with pytest.raises(InputError, match="not UTF-8"):
        load_table_file(path)


def test_numbers_written_as_numeric_strings_are_numbers(tmp_path, capsys):
    """YAML 1.1 reads 7e2 (an exponent without a dot) as a string: it is ordinary notation for 700."""
    path = tmp_path / "sci.yaml"
    path.write_text(TABLE_YAML.replace("tdp_w: 700", "tdp_w: 7e2").replace("idle_w: 70", "idle_w: '7.0e1'"))
    table = load_table_file(path)
    assert table.tdp_w == 700.0 and table.idle_w == 70.0 and isinstance(table.tdp_w, float)
    trace = write(host_trace(7), tmp_path / "node0.parquet")
    rc, err = triage_cli(capsys, "--trace", trace, "--table", path, "--out", tmp_path / "out")
    assert rc == 0, err
    assert json.loads((tmp_path / "out" / "triage.json").read_text())["table"]["tdp_w"] == 700.0
    assert (tmp_path / "out" / "triage.md").is_file()


def test_a_single_match_string_is_one_substring_not_its_letters(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text(TABLE_YAML.replace('match: ["H100"]', "match: H100"))
    assert load_table_file(path).match == ("H100",)


# ---------------------------------------------------------------- window and hang limit


@pytest.mark.parametrize("flag", ["--window", "--hang-after"])
@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "-inf"])
def test_a_window_or_hang_limit_that_is_not_a_positive_finite_number_is_refused(tmp_path, capsys, flag, value):
    trace = write(host_trace(8), tmp_path / "node0.parquet")
    rc, err = triage_cli(capsys, "--gpu-model", "h100", "--trace", trace, f"{flag}={value}", "--out", tmp_path / "out")
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert flag in err
    assert not (tmp_path / "out").exists()


def test_a_window_too_short_to_index_is_refused(tmp_path, capsys):
    """1e-12 s windows over unix time overflowed the window index."""
    trace = write(host_trace(8), tmp_path / "node0.parquet")
    rc, err = triage_cli(capsys, "--gpu-model", "h100", "--trace", trace, "--window", "1e-12", "--out", tmp_path / "o")
    assert rc == 2 and "--window must be at least 0.001 s" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "config, key",
    [
        ({"telemetry": {"window_s": 0}}, "telemetry.window_s"),
        ({"telemetry": {"window_s": float("nan")}}, "telemetry.window_s"),
        ({"telemetry": {"window_s": 1e-9}}, "telemetry.window_s"),
        ({"watcher": {"hang_after_s": 0}}, "watcher.hang_after_s"),
        ({"watcher": {"hang_after_s": float("inf")}}, "watcher.hang_after_s"),
        ({"watcher": {"hang_after_s": "soon"}}, "watcher.hang_after_s"),
    ],
)
def test_config_values_are_refused_by_their_key_not_replaced_by_the_default(config, key):
    with pytest.raises(InputError, match=key.replace(".", r"\.")):
        TriageSettings.merge(run_config(config))


def test_settings_take_the_value_given_and_refuse_a_zero_given():
    s = TriageSettings.merge(run_config({"telemetry": {"window_s": 2.0}, "watcher": {"hang_after_s": 90}}))
    assert (s.window_s, s.deadlock_after_s) == (2.0, 90.0)
    assert TriageSettings.merge(None, window_s=0.5).window_s == 0.5
    with pytest.raises(InputError, match="window_s"):
        TriageSettings.merge(None, window_s=0)
    with pytest.raises(InputError, match="deadlock_after_s"):
        TriageSettings.merge(None, deadlock_after_s=0.0)


# ---------------------------------------------------------------- damaged phases.parquet


@pytest.fixture
def phases_dir(tmp_path):
    run_triage(
        [write(host_trace(9), tmp_path / "node0.parquet")],
        tmp_path / "power",
        settings=TriageSettings(gpu_model="h100"),
    )
    return tmp_path / "power"


def rewrite_phases(folder, meta: bytes | None = None, column: tuple | None = None) -> None:
    path = folder / "phases.parquet"
    t = pq.read_table(path)
    if column is not None:
        name, array = column
        t = t.set_column(t.schema.get_field_index(name), name, array(t.num_rows))
    if meta is not None:
        t = t.replace_schema_metadata({b"wattgate.phases": meta})
    pq.write_table(t, path)


@pytest.mark.parametrize(
    "meta, column, said",
    [
        (b'{"window_s": 1', None, "not JSON"),
        (b"[1, 2]", None, "not a JSON object"),
        (b'{"window_s": 0}', None, "window_s must be a finite number"),
        (b'{"window_s": "abc"}', None, "window_s must be a number"),
        (b'{"gpu_model": 5}', None, "gpu_model must be a string"),
        (None, ("start", lambda n: pa.array(["x"] * n)), "column 'start'"),
    ],
)
def test_damaged_phases_metadata_or_columns_are_one_error(phases_dir, meta, column, said):
    rewrite_phases(phases_dir, meta, column)
    with pytest.raises(InputError, match=said) as exc:
        read_phases(phases_dir / "phases.parquet")
    assert "phases.parquet" in str(exc.value)


def test_a_zero_hang_limit_in_triage_json_is_refused_not_read_as_the_default(phases_dir):
    record = json.loads((phases_dir / "triage.json").read_text())
    (phases_dir / "triage.json").write_text(json.dumps(record | {"deadlock_after_s": 0}))
    with pytest.raises(InputError, match=r"triage\.json: deadlock_after_s"):
        read_phases(phases_dir / "phases.parquet")


def test_a_sampler_reading_above_any_gpus_power_is_not_a_reading(tmp_path):
    """read_trace nulls power above trace.MAX_POWER_W; triage's own fast reader must agree (same energy and
    phases as the trace with those readings null)."""
    t = host_trace(6)
    power = t.column("power_w").to_numpy(zero_copy_only=False).copy()
    spikes = np.arange(10, len(power), 97)
    power[spikes] = 9000.0
    i = t.schema.get_field_index("power_w")
    spiked = write(t.set_column(i, t.schema.field(i), pa.array(power, pa.float32())), tmp_path / "spiked.parquet")
    nulled = pa.array([None if k in set(spikes.tolist()) else float(v) for k, v in enumerate(power)], pa.float32())
    clean = write(t.set_column(i, t.schema.field(i), nulled), tmp_path / "clean.parquet")
    got = run_triage([spiked], tmp_path / "a", settings=TriageSettings(gpu_model="h100")).to_json()
    want = run_triage([clean], tmp_path / "b", settings=TriageSettings(gpu_model="h100")).to_json()
    assert got["phases"] == want["phases"]
    assert {k: v["integrated_j"] for k, v in got["energy"].items()} == {
        k: v["integrated_j"] for k, v in want["energy"].items()
    }
