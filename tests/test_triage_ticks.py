"""The sampler's layout (one time per tick, every GPU's row in one order) is reduced by runs of ticks
(power/triage/ticks.py, energy.summarize_ticks) instead of a scatter per sample: the same phases.parquet and
triage.json to the last bit as the general path, which every other layout takes."""

import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from wattgate.power.triage import run_triage
from wattgate.power.triage import ticks as ticks_mod
from wattgate.power.triage import windows as windows_mod
from wattgate.testing.synthetic_trace import Straggler, TraceSpec, build_trace, gpus_of, job
from wattgate.triage_tables import TriageSettings, shipped_table

from support.traces import sampler_files

TABLE = shipped_table("h100")


@pytest.mark.parametrize("hosts, per", [(1, 4), (2, 3)])
def test_the_tick_layout_gives_the_general_paths_outputs_bit_for_bit(tmp_path, monkeypatch, hosts, per):
    gpus = gpus_of(hosts, per)
    schedule = job(gpus, [("idle", 20), ("compute", 240), ("data_starvation", 60), ("checkpoint", 40), ("compute", 90)])
    synth = build_trace(
        schedule, TABLE, seed=hosts, spec=TraceSpec(straggler=Straggler(gpus[-1], 0.3, "thermal", ((60, 200),)))
    )
    paths = sampler_files(synth, tmp_path / "telemetry")
    assert ticks_mod.period(np.tile(np.arange(per, dtype=np.int32), 5), None) == per
    run_triage(paths, tmp_path / "ticks", settings=TriageSettings(gpu_model="h100"))
    seen = []
    monkeypatch.setattr(windows_mod.ticks_mod, "period", lambda gpu, codes: seen.append(1) or 0)
    run_triage(paths, tmp_path / "general", settings=TriageSettings(gpu_model="h100"))
    assert seen  # the general path ran
    a, b = (pq.read_table(tmp_path / d / "phases.parquet") for d in ("ticks", "general"))
    assert a.equals(b)
    ja, jb = (json.loads((tmp_path / d / "triage.json").read_text()) for d in ("ticks", "general"))
    assert {k: v for k, v in ja.items()} == jb
    assert ja["stragglers"] and ja["energy"]


def test_a_chunk_out_of_the_layout_takes_the_general_path():
    assert ticks_mod.period(np.array([0, 1, 0, 2], np.int32), None) == 0  # another GPU in the second tick
    assert ticks_mod.period(np.array([0, 1, 1, 0], np.int32), None) == 0  # another order
    assert ticks_mod.period(np.array([0, 1, 0], np.int32), None) == 0  # a tick cut short
    t = np.array([10.0, 10.0, 10.1, 10.2])  # the second tick's rows carry two times (a logger's burst)
    assert not ticks_mod.shared_times(t, 2, np.ones(4, np.float32))
    p = np.array([1, np.nan, 1, 1], np.float32)  # a missing reading
    assert not ticks_mod.shared_times(np.repeat([10.0, 10.1], 2), 2, p)
    assert ticks_mod.shared_times(np.repeat([10.0, 10.1], 2), 2, np.ones(4, np.float32))
