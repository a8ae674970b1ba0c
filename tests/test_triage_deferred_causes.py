"""Triage decodes a trace's straggler cause columns (SM clock, temperature, clocks-event reasons) only for the
chunks whose windows a straggler's cause asks for (trace.read_trace_chunks' deferred columns,
ticks.DeferredCauses): a day of 16 GPUs names one straggler from a few chunks. The outputs are those of
reading every column at once, to the last bit."""

import json
import math

import pyarrow.parquet as pq

from support.traces import sampler_files
from wattgate import trace as trace_mod
from wattgate.power.triage import run_triage
from wattgate.power.triage import files as files_mod
from wattgate.testing.synthetic_trace import Straggler, TraceSpec, build_trace, gpus_of, job
from wattgate.trace import read_trace_chunks
from wattgate.triage_tables import TriageSettings, shipped_table

TABLE = shipped_table("h100")

CHUNK = 4000  # rows: 1000 ticks of 4 GPUs, so the test's traces come in several chunks


def counted_reads(monkeypatch) -> list:
    reads = []
    real = trace_mod._trace_rows
    monkeypatch.setattr(trace_mod, "_trace_rows", lambda *a: reads.append(a[2:]) or real(*a))
    return reads


def test_cause_columns_are_decoded_only_for_the_chunks_a_stragglers_windows_ask_for(tmp_path, monkeypatch):
    gpus = gpus_of(1, 4)
    schedule = job(gpus, [("idle", 20), ("compute", 900), ("checkpoint", 40), ("compute", 600)])
    straggler = Straggler(gpus[-1], 0.3, "thermal", ((100, 300),), True)
    synth = build_trace(schedule, TABLE, seed=5, spec=TraceSpec(straggler=straggler))
    paths = sampler_files(synth, tmp_path / "telemetry")
    monkeypatch.setattr(files_mod, "CHUNK_ROWS", CHUNK)
    reads = counted_reads(monkeypatch)
    run_triage(paths, tmp_path / "deferred", settings=TriageSettings(gpu_model="h100"))
    chunks = math.ceil(synth.table.num_rows / CHUNK)
    assert 0 < len(reads) < chunks / 2, (len(reads), chunks)

    monkeypatch.setattr(files_mod, "CAUSE_COLUMNS", ())  # every column read with its chunk
    run_triage(paths, tmp_path / "at_once", settings=TriageSettings(gpu_model="h100"))
    a, b = (pq.read_table(tmp_path / d / "phases.parquet") for d in ("deferred", "at_once"))
    assert a.equals(b)
    ja, jb = (json.loads((tmp_path / d / "triage.json").read_text()) for d in ("deferred", "at_once"))
    assert {k: v for k, v in ja.items() if k != "traces"} == {k: v for k, v in jb.items() if k != "traces"}
    (e,) = ja["stragglers"]
    assert (e["gpu"], e["cause"]) == (3, "thermal")


def test_a_balanced_run_decodes_no_cause_column(tmp_path, monkeypatch):
    gpus = gpus_of(1, 4)
    synth = build_trace(job(gpus, [("idle", 20), ("compute", 600), ("checkpoint", 40)]), TABLE, seed=6)
    paths = sampler_files(synth, tmp_path / "telemetry")
    monkeypatch.setattr(files_mod, "CHUNK_ROWS", CHUNK)
    reads = counted_reads(monkeypatch)
    result = run_triage(paths, tmp_path / "p", settings=TriageSettings(gpu_model="h100")).to_json()
    assert result["stragglers"] == [] and reads == []


def test_deferred_columns_read_later_are_the_rows_read_at_once(tmp_path):
    """Across row groups that do not line up with the batches, and for a column the trace lacks (nulls)."""
    gpus = gpus_of(1, 4)
    synth = build_trace(job(gpus, [("compute", 300)]), TABLE, seed=7)
    (path,) = sampler_files(synth, tmp_path / "t")
    table = pq.read_table(path)
    table = table.drop_columns(["clocks_event_reasons"]).replace_schema_metadata(table.schema.metadata)
    pq.write_table(table, path, row_group_size=1500)
    columns = ["time", "gpu", "power_w", "sm_clock_mhz", "temp_c", "clocks_event_reasons"]
    deferred = ("sm_clock_mhz", "temp_c", "clocks_event_reasons")
    _, whole = read_trace_chunks(path, columns, 4000)
    _, split = read_trace_chunks(path, columns, 4000, deferred=deferred)
    n = 0
    for full, (batch, fetch) in zip(whole, split, strict=True):
        later = fetch()
        assert batch.schema.names == ["time", "gpu", "power_w"]
        for name in batch.schema.names:
            assert batch.column(name).equals(full.column(name))
        for name in deferred:
            assert later.column(name).equals(full.column(name)), name
        assert later.column("clocks_event_reasons").null_count == later.num_rows
        n += full.num_rows
    assert n == table.num_rows
