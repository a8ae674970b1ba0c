"""The report's numbers from arrays: per-step and per-rank groups, phase windows and the readers behind them.

Each array version is checked against the pandas (or string-column) way it replaced, on tables with the awkward
parts a real run can have: NaN keys and values, rows out of order, duplicate (step, rank) rows, one rank,
missing optional columns, null hosts and phases, and a phases file whose row groups have different dictionaries.
"""

import json
import warnings

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from wattgate.testing.synthetic_trace import build_trace, gpus_of, job, write_run_info
from wattgate.errors import InputError
from wattgate.triage_tables import TriageSettings, shipped_table
from wattgate.power.triage import LABELS, run_triage
from wattgate.power.triage.phases import read_phases
from wattgate.power.triage.runinfo import load_run_info
from wattgate.report import anomalies as an
from wattgate.report.inputs import METRICS_OPTIONAL, METRICS_REQUIRED, PHASE_COLUMNS, ReportSources, load_inputs
from wattgate.run_files import read_metrics
from wattgate.report.phases import phase_windows, totals
from wattgate.report.steps import step_table
from wattgate.trace import trace_files

# ---------------------------------------------------------------- the pandas versions they replaced


def pandas_step_table(m: pd.DataFrame) -> pd.DataFrame:
    cols = {"time": ("time", "max")}
    if "step_time_s" in m:
        cols["step_time_s"] = ("step_time_s", "max")
    if "data_wait_s" in m:
        cols["data_wait_s"] = ("data_wait_s", "mean")
    if "tokens" in m:
        cols["tokens"] = ("tokens", "sum")
    if "loss" in m:
        weight = m["loss_tokens"] if "loss_tokens" in m else pd.Series(1.0, index=m.index)
        m = m.assign(_wl=m["loss"] * weight, _w=weight)
        cols["_wl"], cols["_w"] = ("_wl", "sum"), ("_w", "sum")
    cols["ranks"] = ("rank", "nunique")
    per = m.groupby("step", sort=True).agg(**cols)
    if "_wl" in per:
        per["loss"] = per["_wl"] / per["_w"].where(per["_w"] > 0)
        per = per.drop(columns=["_wl", "_w"])
    return per.reset_index()


def pandas_stragglers(m: pd.DataFrame) -> list[tuple]:
    m = m.assign(compute=m["step_time_s"] - m["data_wait_s"], begin=m["time"] - m["step_time_s"])
    per = m.groupby("rank").agg(compute=("compute", "median"), begin=("begin", "min"), end=("time", "max"))
    if len(per) < 2:
        return []
    typical = float(per["compute"].median())
    if not typical > 0:
        return []
    slow = per[per["compute"] >= an.STRAGGLER_RATIO * typical]
    return [
        (f"rank {r}", float(x.begin), float(x.end), round(float(x.compute / typical), 4)) for r, x in slow.iterrows()
    ]


def pandas_starved_runs(m: pd.DataFrame) -> list[tuple]:
    m = m[["rank", "step", "time", "step_time_s", "data_wait_s"]].dropna()
    m = m[(m["step_time_s"] > 0) & (m["data_wait_s"] >= an.STARVED_STEP_SHARE * m["step_time_s"])]
    m = m.sort_values(["rank", "step"], kind="stable")
    rank, step = m["rank"].to_numpy(), m["step"].to_numpy()
    new = np.ones(len(m), bool)
    new[1:] = (rank[1:] != rank[:-1]) | (step[1:] != step[:-1] + 1)
    g = m.assign(run=np.cumsum(new), begin=m["time"] - m["step_time_s"]).groupby("run")
    agg = g.agg(rank=("rank", "first"), begin=("begin", "min"), end=("time", "max"), steps=("time", "size"))
    return [(int(r.rank), float(r.begin), float(r.end), int(r.steps)) for r in agg.itertuples()]


def random_metrics(rng: np.random.Generator) -> pd.DataFrame:
    ranks, steps = int(rng.integers(1, 6)), int(rng.integers(1, 30))
    step = np.repeat(np.arange(1, steps + 1), ranks) * int(rng.choice([1, 3, 1000]))  # dense or sparse steps
    rank = np.tile(np.arange(ranks), steps) + int(rng.choice([0, 8]))
    n = len(step)
    m = pd.DataFrame(
        {
            "step": step,
            "rank": rank.astype(np.int32),
            "time": 1e9 + step * 2.0 + rng.random(n),
            "loss": rng.random(n) * 5,
            "tokens": rng.integers(0, 1000, n),
            "loss_tokens": rng.integers(0, 4, n),
            "step_time_s": rng.random(n) * 2,
            "data_wait_s": rng.random(n) * rng.choice([0.1, 1.0]),
        }
    )
    if rng.random() < 0.2:  # a resumed run writes some (step, rank) rows twice
        m = pd.concat([m, m.iloc[: n // 3]], ignore_index=True)
    if rng.random() < 0.5:
        m = m.sample(frac=1, random_state=int(rng.integers(1 << 30))).reset_index(drop=True)
    if rng.random() < 0.4:  # a nullable column read from Parquet is float with NaN
        for c in m.columns:
            if rng.random() < 0.4:
                v = m[c].to_numpy().astype(float)
                v[rng.random(len(v)) < 0.2] = np.nan
                m[c] = v
    if rng.random() < 0.3:
        m = m.drop(columns=[c for c in ("loss_tokens", "tokens", "data_wait_s", "loss") if rng.random() < 0.5])
    if rng.random() < 0.3 and "step_time_s" in m:  # a straggler
        m.loc[m["rank"] == m["rank"].iloc[0], "step_time_s"] *= 1.5
    return m


def same(rows: list[tuple], want: list[tuple]) -> bool:
    """Equal, NaN equal to NaN (a rank whose every time is NaN starts and ends at NaN)."""

    def key(x):
        return "nan" if isinstance(x, float) and np.isnan(x) else x

    return [tuple(map(key, r)) for r in rows] == [tuple(map(key, r)) for r in want]


# ---------------------------------------------------------------- per-step and per-rank groups


@pytest.mark.parametrize("seed", range(4))
def test_step_table_is_pandas_groupby(seed):
    rng = np.random.default_rng(seed)
    for _ in range(50):
        m = random_metrics(rng)
        if m["step"].isna().all():
            continue
        got, want = step_table(m), pandas_step_table(m)
        assert list(got.columns) == list(want.columns)
        for c in want.columns:
            assert got[c].dtype == want[c].dtype, c
            if c in ("loss", "data_wait_s"):  # sums without pandas' compensation: the last bit may differ
                np.testing.assert_allclose(got[c], want[c], rtol=1e-13, equal_nan=True, err_msg=c)
            else:
                np.testing.assert_array_equal(got[c], want[c], err_msg=c)


def test_step_table_of_no_metrics():
    assert step_table(None) is None
    assert step_table(pd.DataFrame({"step": [], "rank": [], "time": []})) is None


@pytest.mark.parametrize("seed", range(4))
def test_stragglers_and_starved_steps_are_the_pandas_groups(seed):
    rng = np.random.default_rng(100 + seed)
    warnings.simplefilter("ignore", RuntimeWarning)
    for _ in range(50):
        m = random_metrics(rng)
        if not {"step_time_s", "data_wait_s"} <= set(m.columns):
            assert an.stragglers(m, {}) == [] and an.starved_steps(m) == []
            continue
        got = [(e.facts["straggler"].split(":")[0], e.start, e.end, e.facts["ratio"]) for e in an.stragglers(m, {})]
        assert same(got, pandas_stragglers(m))
        got = [(min(e.ranks), e.start, e.end, e.facts["starved steps"]) for e in an.starved_steps(m)]
        assert same(got, pandas_starved_runs(m))


def test_one_rank_is_no_straggler_and_a_float_rank_is_named_as_pandas_names_it():
    m = pd.DataFrame({"step": [1, 2], "rank": [0, 0], "time": [1.0, 2.0], "step_time_s": [1.0, 9.0]})
    assert an.stragglers(m.assign(data_wait_s=0.0), {}) == []
    m = pd.DataFrame(
        {
            "step": [1, 1, 1, 2, 2, 2],
            "rank": [0.0, 1.0, np.nan, 0.0, 1.0, 2.0],  # a null rank: its row is in no rank's group
            "time": [1.0, 1.0, 1.0, 2.0, 2.0, 2.0],
            "step_time_s": [1.0, 1.0, 9.0, 1.0, 1.0, 3.0],
            "data_wait_s": 0.0,
        }
    )
    (slow,) = an.stragglers(m, {2: "node0:2"})
    assert slow.facts["straggler"].startswith("rank 2.0:") and slow.gpus == {"node0:2"} and slow.ranks == {2}


def test_group_codes_are_the_sorted_distinct_values():
    for values in (
        np.array([5, 3, 5, 9], np.int32),
        np.array([10**12, 3, 10**12]),  # too wide for a lookup table
        np.array([2.0, np.nan, -1.5, 2.0]),
        np.array([3, 1], np.uint64),
    ):
        codes, uniq = an.group_codes(values)
        want = np.unique(values[~np.isnan(values.astype(float))])
        np.testing.assert_array_equal(uniq, want)
        assert uniq.dtype == values.dtype
        ok = codes >= 0
        np.testing.assert_array_equal(uniq[codes[ok]], values[ok])
        assert (~ok == np.isnan(values.astype(float))).all()


# ---------------------------------------------------------------- phase windows


def phase_table(rng: np.random.Generator, dictionary: bool) -> pa.Table:
    """Windows of a few GPUs, some rows shuffled, some values null, in two chunks (two row groups)."""
    rows = []
    for host in ["b", "a", "c"][: int(rng.integers(1, 4))]:
        for gpu in range(int(rng.integers(1, 4))):
            t = 100.0
            for _ in range(int(rng.integers(1, 40))):
                label = str(rng.choice(["compute", "idle", "deadlock", "data_starvation", "unknown", "bogus"]))
                rows.append([host, gpu, t, t + 1.0, label, float(rng.random() * 300)])
                t += 1.0 if rng.random() < 0.9 else 7.0
    if rng.random() < 0.5:
        rng.shuffle(rows)
    for r in rows:
        if rng.random() < 0.05:
            r[0] = None
        if rng.random() < 0.05:
            r[4] = None
        if rng.random() < 0.05:
            r[5] = None
    half = len(rows) // 2
    types = [pa.string(), pa.int32(), pa.float64(), pa.float64(), pa.string(), pa.float32()]
    names = ["host", "gpu", "start", "end", "phase", "power_w"]

    def chunk(values, t):
        a = pa.array(values, t)
        return a.dictionary_encode() if dictionary and t == pa.string() else a

    cols = [[r[i] for r in rows] for i in range(len(names))]
    return pa.table(
        {n: pa.chunked_array([chunk(c[:half], t), chunk(c[half:], t)]) for n, c, t in zip(names, cols, types)}
    )


def test_phase_windows_of_dictionary_columns_are_those_of_strings():
    rng = np.random.default_rng(7)
    for _ in range(40):
        seed = int(rng.integers(1 << 30))
        a = phase_windows(phase_table(np.random.default_rng(seed), dictionary=False))
        b = phase_windows(phase_table(np.random.default_rng(seed), dictionary=True))
        assert a.keys == b.keys and all(isinstance(g, int) for _, g in b.keys)
        for name in ("gid", "start", "end", "code", "power", "seconds", "energy_j"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
            assert getattr(a, name).dtype == getattr(b, name).dtype
        # order by (host, gpu, start); a null host sorts as "", a null or foreign label is unknown
        assert (np.diff(b.gid) >= 0).all()
        assert set(b.code) <= set(range(len(LABELS)))
        secs, joules = totals(b, b.gid, len(b.keys))
        assert secs.sum() == pytest.approx(b.seconds.sum()) and joules.sum() == pytest.approx(np.nansum(b.energy_j))


def test_phase_windows_of_nothing():
    w = phase_windows(None)
    assert len(w) == 0 and w.keys == [] and w.gid.dtype == np.int64


# ---------------------------------------------------------------- readers


@pytest.fixture(scope="module")
def triaged(tmp_path_factory):
    """A run folder, its phases.parquet and triage.json."""
    root = tmp_path_factory.mktemp("triaged")
    run = root / "results" / "train" / "r"
    synth = build_trace(
        job(gpus_of(2, 2), [("compute", 120), ("checkpoint", 60), ("compute", 60)]), shipped_table("h100"), seed=3
    )
    synth.write(run / "telemetry")
    write_run_info(run, synth)
    power = root / "results" / "power" / "r"
    run_triage(trace_files(run / "telemetry"), power, run_dir=run, settings=TriageSettings(gpu_model="h100"))
    return run, power


def read_dictionary_phases(path):
    return read_phases(path, PHASE_COLUMNS, dictionary=True)


def test_read_phases_with_dictionaries_gives_the_same_settings_and_rows(triaged, tmp_path):
    _, power = triaged
    table, *settings = read_dictionary_phases(power / "phases.parquet")
    strings, *want = read_phases(power / "phases.parquet")
    assert settings == want
    assert "confidence" not in table.column_names and pa.types.is_dictionary(table.schema.field("phase").type)
    assert table.schema.metadata == strings.schema.metadata
    for name in table.column_names:
        assert table.column(name).cast(strings.schema.field(name).type).equals(strings.column(name)), name
    assert read_dictionary_phases(tmp_path / "phases.parquet") is None


@pytest.mark.parametrize("dictionary", [False, True])
def test_read_phases_errors_name_the_file(triaged, tmp_path, dictionary):
    _, power = triaged
    bad = tmp_path / "phases.parquet"
    bad.write_bytes(b"PAR1 nope")
    read = read_dictionary_phases if dictionary else read_phases
    with pytest.raises(InputError, match="phases.parquet: not a readable phases table"):
        read(bad)
    pq.write_table(pq.read_table(power / "phases.parquet").drop_columns(["confidence"]), bad)
    with pytest.raises(InputError, match="phases.parquet: not a phases table: missing column.s. confidence"):
        read(bad)
    pq.write_table(pq.read_table(power / "phases.parquet"), bad)
    (tmp_path / "triage.json").write_text("[1]")
    with pytest.raises(InputError, match="triage.json: expected a JSON object"):
        read(bad)
    (tmp_path / "triage.json").write_text("{ nope")
    with pytest.raises(InputError, match="triage.json: not readable JSON"):
        read(bad)


def test_read_metrics_reads_what_the_report_needs(tmp_path):
    path = tmp_path / "metrics.parquet"
    assert read_metrics(tmp_path, METRICS_REQUIRED, METRICS_OPTIONAL) is None
    pq.write_table(
        pa.table({"step": [1, 2], "rank": [0, 0], "time": [1.0, 2.0], "lr": [0.1, 0.1], "loss": [3.0, 2.0]}), path
    )
    m = read_metrics(tmp_path, METRICS_REQUIRED, METRICS_OPTIONAL)
    assert list(m.columns) == ["step", "rank", "time", "loss"]
    pq.write_table(pa.table({"step": [1], "time": [1.0]}), path)
    with pytest.raises(InputError, match="metrics.parquet: not a metrics table: missing column.s. rank; rerun train"):
        read_metrics(tmp_path, METRICS_REQUIRED, METRICS_OPTIONAL)
    path.write_bytes(b"{ not parquet")
    with pytest.raises(InputError, match="metrics.parquet"):
        read_metrics(tmp_path, METRICS_REQUIRED, METRICS_OPTIONAL)


def test_run_info_from_metrics_already_read_is_the_same(triaged):
    run, power = triaged
    inputs = load_inputs(run, ReportSources(power_dir=power))
    full = load_run_info(run, inputs.trace_metas)
    mine = load_run_info(run, inputs.trace_metas, inputs.metrics)
    pd.testing.assert_frame_equal(mine.events, full.events)
    assert (mine.states, mine.gpu_uuids, mine.source, mine.has_heartbeats) == (
        full.states,
        full.gpu_uuids,
        full.source,
        full.has_heartbeats,
    )
    assert inputs.run_info.states == full.states
    with pytest.raises(InputError, match="metrics.parquet: not a metrics table: missing column.s. data_wait_s"):
        load_run_info(run, inputs.trace_metas, inputs.metrics.drop(columns=["data_wait_s"]))


def test_pauses_and_gaps_from_a_dictionary_phases_table_without_triage_json_record(triaged, tmp_path):
    """triage.json without pauses and gaps: they are computed from the dictionary-encoded phases as from strings."""
    import shutil

    from wattgate.power.triage import power_only
    from wattgate.power.triage.phases import gap_summary

    run, power = triaged
    copy = tmp_path / "power"
    shutil.copytree(power, copy)
    record = json.loads((copy / "triage.json").read_text())
    for key in ("pauses", "gaps"):
        record.pop(key, None)
    (copy / "triage.json").write_text(json.dumps(record))
    inputs = load_inputs(run, ReportSources(power_dir=copy))
    assert inputs.pause_records is None and inputs.gaps is None
    strings = read_phases(copy / "phases.parquet")[0]
    assert [p.record(None) for p in power_only.pauses(inputs.phases)] == [
        p.record(None) for p in power_only.pauses(strings)
    ]
    assert gap_summary(inputs.phases, inputs.window_s) == gap_summary(strings, inputs.window_s)


def test_a_resumed_runs_throughput_is_its_steps_over_every_attempt_not_its_last_attempts():
    """A forced rerun that resumed at the last step wrote TRAINED with 0 s and 0 tok/s: the report said so."""
    import pandas as pd

    from wattgate.records.trained import Trained
    from wattgate.report.inputs import RunInputs
    from wattgate.report.steps import step_table, throughput

    rows = [
        {"step": s, "rank": r, "time": 100.0 + s, "step_time_s": 1.0 + 0.5 * r, "tokens": 100, "loss": 2.0}
        for s in range(1, 11)
        for r in range(2)
    ]
    metrics = pd.DataFrame(rows)
    last_attempt = Trained(steps=10, resumed_from_step=10, world_size=2, wall_s=0.0, tokens_per_s=0.0)
    inputs = RunInputs(run_dir=None, run_name="r", trained=last_attempt, metrics=metrics)
    t = throughput(inputs, step_table(metrics), gpus=2)
    assert t.wall_s == 15.0 and t.tokens_per_s == round(2000 / 15.0, 3) and t.tokens == 2000, t
    assert "over the run's attempts" in t.wall_source
    evals = pd.DataFrame({"step": [5, 10], "seconds": [0.5, 1.5]})  # the validation passes count too
    t = throughput(
        RunInputs(run_dir=None, run_name="r", trained=last_attempt, metrics=metrics, evals=evals),
        step_table(metrics),
        gpus=2,
    )
    assert t.wall_s == 17.0 and "every validation pass" in t.wall_source, t
    straight = RunInputs(
        run_dir=None,
        run_name="r",
        trained=last_attempt.replace(resumed_from_step=0, wall_s=16.0, tokens_per_s=125.0),
        metrics=metrics,
    )
    t = throughput(straight, step_table(metrics), gpus=2)
    assert t.wall_s == 16.0 and t.tokens_per_s == 125.0 and t.wall_source == "TRAINED"
