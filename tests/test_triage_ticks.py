"""The sampler's layout (one time per tick, every GPU's row in one order) is reduced by runs of ticks
(power/triage/ticks.py, energy.summarize_ticks) instead of a scatter per sample: the same phases.parquet and
triage.json to the last bit as the general path, which every other layout takes."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from wattgate.power.triage import run_triage
from wattgate.power.triage import ticks as ticks_mod
from wattgate.power.triage import windows as windows_mod
from wattgate.testing.synthetic_trace import Straggler, build_trace, gpus_of, job
from wattgate.trace import schema_with_meta
from wattgate.triage_tables import shipped_table

TABLE = shipped_table("h100")


def sampler_files(synth, folder, counter_every: int = 30):
    """Each host's rows as a sampler writes them: tick by tick, one time per tick, GPUs in index order, the
    energy counter on every counter_every-th tick."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for host in sorted({h for h, _ in synth.gpus}):
        t = synth.table.filter(pc.equal(synth.table.column("host"), host))
        gpu, time_ = t.column("gpu").to_numpy(), t.column("time").to_numpy()
        t = t.take(np.lexsort((time_, gpu)))
        k = len(np.unique(gpu))
        ticks = t.column("time").to_numpy().reshape(k, -1).min(axis=0)
        t = t.set_column(t.schema.get_field_index("time"), "time", pa.array(np.tile(ticks, k)))
        p = t.column("power_w").to_numpy().astype(np.float64).reshape(k, -1)
        energy = np.cumsum(np.c_[np.zeros(k), np.diff(ticks) * p[:, 1:]], axis=1) + 1e6
        energy[:, np.arange(energy.shape[1]) % counter_every != 0] = np.nan
        e = energy.ravel()
        t = t.set_column(t.schema.get_field_index("energy_j"), "energy_j", pa.array(e, mask=np.isnan(e)))
        t = t.take(np.arange(t.num_rows).reshape(k, -1).T.ravel())
        paths.append(folder / f"{host}.parquet")
        pq.write_table(t.cast(schema_with_meta(synth.meta(host))), paths[-1], row_group_size=5000)
    return paths


@pytest.mark.parametrize("hosts, per", [(1, 4), (2, 3)])
def test_the_tick_layout_gives_the_general_paths_outputs_bit_for_bit(tmp_path, monkeypatch, hosts, per):
    gpus = gpus_of(hosts, per)
    schedule = job(gpus, [("idle", 20), ("compute", 240), ("data_starvation", 60), ("checkpoint", 40), ("compute", 90)])
    synth = build_trace(schedule, TABLE, seed=hosts, straggler=Straggler(gpus[-1], 0.3, "thermal", ((60, 200),)))
    paths = sampler_files(synth, tmp_path / "telemetry")
    assert ticks_mod.period(np.tile(np.arange(per, dtype=np.int32), 5), None) == per
    run_triage(paths, tmp_path / "ticks", gpu_model="h100")
    seen = []
    monkeypatch.setattr(windows_mod.ticks_mod, "period", lambda gpu, codes: seen.append(1) or 0)
    run_triage(paths, tmp_path / "general", gpu_model="h100")
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
