"""Triage computes each GPU's energy once (triage.json "energy"), the same numbers the report computes from
the traces; read_trace(columns=) reads only what triage needs."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from wattgate.testing.synthetic_trace import build_trace, gpus_of, job
from wattgate.errors import InputError
from wattgate.power.energy import gpu_energy, records
from wattgate.triage_tables import TriageSettings, shipped_table
from wattgate.power.triage import run_triage
from wattgate.report.inputs import read_samples
from wattgate.trace import TRACE_SCHEMA, read_trace, schema_with_meta

PHASES = [("idle", 20), ("compute", 60), ("communication", 10), ("compute", 40)]


def with_counter(table: pa.Table, rng, every: int = 37) -> pa.Table:
    """An NVML-like energy counter on every `every`-th row (cumulative power per GPU), some power NaN."""
    n = table.num_rows
    power = table.column("power_w").to_numpy().astype(np.float64)
    power[rng.random(n) < 0.01] = np.nan
    energy = np.full(n, np.nan)
    energy[::every] = np.arange(len(energy[::every])) * 100.0 + 5e6
    arrays = [
        pa.array(power, pa.float32(), from_pandas=True)
        if f.name == "power_w"
        else pa.array(energy, pa.float64(), from_pandas=True)
        if f.name == "energy_j"
        else table.column(f.name)
        for f in TRACE_SCHEMA
    ]
    return pa.Table.from_arrays(arrays, schema=TRACE_SCHEMA)


def assert_same_energy(got: dict, want: dict) -> None:
    """The same records, numbers to rounding (sums taken in pieces associate differently)."""
    assert got.keys() == want.keys()
    for key in want:
        for field, value in want[key].items():
            if isinstance(value, float):
                assert got[key][field] == pytest.approx(value, rel=1e-12), (key, field)
            else:
                assert got[key][field] == value, (key, field)


def write(table: pa.Table, path, host: str) -> None:
    pq.write_table(table.replace_schema_metadata(schema_with_meta({"host": host, "gpus": []}).metadata), path)


@pytest.mark.parametrize("layout", ["periodic", "shuffled", "restarted"])
def test_triage_json_energy_is_what_the_report_computes(tmp_path, layout):
    rng = np.random.default_rng(3)
    synth = build_trace(job(gpus_of(2, 2), PHASES), shipped_table("h100"), seed=3)
    table = with_counter(synth.table, rng)
    paths = []
    for host in ("node0", "node1"):
        t = table.filter(pa.compute.equal(table.column("host"), host))
        if layout == "shuffled":  # rows of a tick in any order, and not quite in time order
            t = t.take(pa.array(rng.permutation(t.num_rows)[np.argsort(np.arange(t.num_rows) // 7, kind="stable")]))
        if layout == "restarted" and host == "node1":  # a restarted sampler: the GPU in two files
            half = t.num_rows // 2
            write(t.slice(half), tmp_path / "node1b.parquet", host)
            paths.append(tmp_path / "node1b.parquet")
            t = t.slice(0, half)
        write(t, tmp_path / f"{host}.parquet", host)
        paths.append(tmp_path / f"{host}.parquet")
    result = run_triage(paths, tmp_path / "out", settings=TriageSettings(gpu_model="h100")).to_json()
    on_disk = json.loads((tmp_path / "out" / "triage.json").read_text())["energy"]

    samples = read_samples([read_trace(p).select(["time", "host", "gpu", "power_w", "energy_j"]) for p in paths])
    expected = records(gpu_energy(samples), [len(s.energy_pos) for s in samples.series])
    assert result["energy"] == expected
    assert on_disk == expected
    assert sorted(expected) == ["node0:0", "node0:1", "node1:0", "node1:1"]
    first = expected["node0:0"]
    assert set(first) == {"first", "last", "integrated_j", "counter_j", "energy_j", "method", "readings", "gap_s"}
    assert first["method"] == "energy_counter" and first["readings"] > 2 and first["energy_j"] == first["counter_j"]


def test_triage_json_energy_without_a_counter_is_integrated(tmp_path):
    synth = build_trace(job(gpus_of(1, 2), PHASES), shipped_table("h100"), seed=1)
    e = run_triage(synth.write(tmp_path / "t"), tmp_path / "out", settings=TriageSettings(gpu_model="h100")).to_json()[
        "energy"
    ]
    assert {v["method"] for v in e.values()} == {"integrated_power"}
    assert all(
        v["counter_j"] is None and v["readings"] == 0 and v["energy_j"] == v["integrated_j"] > 0 for v in e.values()
    )


def test_read_trace_columns_reads_only_those_with_a_dictionary_host(tmp_path):
    synth = build_trace(job(gpus_of(1, 2), PHASES), shipped_table("h100"), seed=1)
    t = synth.table
    power = t.column("power_w").to_numpy().copy()
    power[:3] = [np.nan, -1.0, np.inf]
    util = t.column("util_gpu").to_numpy().copy()
    util[5] = np.nan
    t = t.set_column(t.schema.get_field_index("power_w"), "power_w", pa.array(power, pa.float32()))
    t = t.set_column(t.schema.get_field_index("util_gpu"), "util_gpu", pa.array(util, pa.float32()))
    write(t.drop_columns(["sm_active", "nvlink_tx_bps"]), tmp_path / "n.parquet", "node0")

    full = read_trace(tmp_path / "n.parquet")
    part = read_trace(tmp_path / "n.parquet", columns=["time", "host", "gpu", "power_w", "sm_active"])
    assert part.column_names == ["time", "host", "gpu", "power_w", "sm_active"]
    assert pa.types.is_dictionary(part.schema.field("host").type)
    assert part.column("host").cast(pa.string()).equals(full.column("host"))
    for name in ("time", "gpu", "power_w", "sm_active"):
        assert part.column(name).equals(full.column(name)), name
    meta = json.loads(part.schema.metadata[b"wattgate.trace"])
    assert meta["host"] == "node0" and meta["invalid_values"] == {"power_w": 3}  # util_gpu was not read
    assert json.loads(full.schema.metadata[b"wattgate.trace"])["invalid_values"] == {"power_w": 3, "util_gpu": 1}


def test_read_trace_columns_still_refuses_a_foreign_table(tmp_path):
    pq.write_table(pa.table({"time": [1.0], "host": ["a"], "gpu": [0], "power_w": [1.0]}), tmp_path / "f.parquet")
    with pytest.raises(InputError, match="missing column"):
        read_trace(tmp_path / "f.parquet", columns=["time", "power_w"])


def test_run_triage_takes_a_finished_trace_and_a_killed_samplers_segments_together(tmp_path):
    from wattgate.trace import TraceWriter, segment_dir

    synth = build_trace(job(gpus_of(2, 1), PHASES), shipped_table("h100"), seed=2)
    paths = synth.write(tmp_path / "t")
    w = TraceWriter(tmp_path / "t" / "live.parquet", synth.meta("node1"), flush_every_s=1e9)
    for row in synth.host_table("node1").slice(0, 500).to_pylist():
        w.add(row | {"host": "node2"})
    w.flush()  # killed: segments only
    assert segment_dir(tmp_path / "t" / "live.parquet").is_dir()
    part = read_trace(tmp_path / "t" / "live.parquet", columns=["time", "host", "gpu"])
    assert pa.types.is_dictionary(part.schema.field("host").type)
    result = run_triage(
        paths + [tmp_path / "t" / "live.parquet"], tmp_path / "out", settings=TriageSettings(gpu_model="h100")
    ).to_json()
    assert sorted(result["energy"]) == ["node0:0", "node1:0", "node2:0"] and result["hosts"] == [
        "node0",
        "node1",
        "node2",
    ]


def test_interleaved_files_of_one_gpu_are_summed_from_their_rows_sorted_together(tmp_path):
    """Two files holding alternate samples of the same GPUs overlap in time: their summaries cannot be joined,
    so triage reads those GPUs' rows again and sorts them; the energy is the report's."""
    rng = np.random.default_rng(5)
    synth = build_trace(job(gpus_of(1, 2), PHASES), shipped_table("h100"), seed=5)
    table = with_counter(synth.table, rng, every=11)
    odd = np.arange(table.num_rows) % 2 == 1
    paths = [tmp_path / "a.parquet", tmp_path / "b.parquet"]
    write(table.filter(pa.array(~odd)), paths[0], "node0")
    write(table.filter(pa.array(odd)), paths[1], "node0")
    got = run_triage(paths, tmp_path / "out", settings=TriageSettings(gpu_model="h100")).to_json()["energy"]
    samples = read_samples([read_trace(p).select(["time", "host", "gpu", "power_w", "energy_j"]) for p in paths])
    expected = records(gpu_energy(samples), [len(s.energy_pos) for s in samples.series])
    assert_same_energy(got, expected)
    assert got["node0:0"]["method"] == "energy_counter"


def test_reading_a_trace_in_small_row_groups_changes_nothing(tmp_path, monkeypatch):
    """Triage reduces a trace chunk by chunk: chunks that cut a tick, a window or a GPU's run anywhere give
    the same phases, and the same energy to rounding."""
    from wattgate.power.triage import files

    rng = np.random.default_rng(9)
    synth = build_trace(job(gpus_of(1, 3), PHASES), shipped_table("h100"), seed=9)
    table = with_counter(synth.table, rng, every=23)
    table = table.take(pa.compute.sort_indices(table, [("time", "ascending")]))  # the sampler's order
    whole, parts = tmp_path / "whole" / "node0.parquet", tmp_path / "parts" / "node0.parquet"
    for path in (whole, parts):
        path.parent.mkdir()
    write(table, whole, "node0")
    pq.write_table(
        table.replace_schema_metadata(schema_with_meta({"host": "node0", "gpus": []}).metadata),
        parts,
        row_group_size=997,
    )
    a = run_triage([whole], tmp_path / "a", settings=TriageSettings(gpu_model="h100")).to_json()
    monkeypatch.setattr(files, "CHUNK_ROWS", 331)  # batches smaller than the row groups, cut anywhere
    b = run_triage([parts], tmp_path / "b", settings=TriageSettings(gpu_model="h100")).to_json()
    assert pq.read_metadata(parts).num_row_groups == 4  # and 12 batches of at most 331 rows
    assert (tmp_path / "a" / "phases.parquet").read_bytes() == (tmp_path / "b" / "phases.parquet").read_bytes()
    assert a["phases"] == b["phases"]
    assert_same_energy(b["energy"], a["energy"])


def test_one_core_or_two_give_the_same_files(tmp_path, monkeypatch):
    """With a second core triage decodes and sums energy on it; with one it does the same in turn."""
    synth = build_trace(job(gpus_of(2, 2), PHASES), shipped_table("h100"), seed=4)
    table = with_counter(synth.table, np.random.default_rng(4))
    paths = []
    for host in ("node0", "node1"):
        paths.append(tmp_path / f"{host}.parquet")
        write(table.filter(pa.compute.equal(table.column("host"), host)), paths[-1], host)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1}, raising=False)
    two = run_triage(paths, tmp_path / "two", settings=TriageSettings(gpu_model="h100")).to_json()
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0}, raising=False)
    one = run_triage(paths, tmp_path / "one", settings=TriageSettings(gpu_model="h100")).to_json()
    assert one == two
    for name in ("phases.parquet", "triage.json", "triage.md", "phase_summary.csv"):
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes(), name
