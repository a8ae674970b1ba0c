"""Power triage: labels on synthetic traces of every shipped table, the hard cases, and the stage's files."""

import json

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from wattgate.testing.synthetic_trace import T0, TraceSpec, accuracy, build_trace, gpus_of, job, write_run_info
from wattgate.errors import InputError
from wattgate.triage_tables import SHIPPED, TriageSettings, TriageTable, shipped_table
from wattgate.power.triage import PHASES_SCHEMA, load_run_info, map_ranks, phase_summary, run_triage, triage
from wattgate.records.trace_meta import TraceMeta
from wattgate.trace import TRACE_SCHEMA, TraceWriter

DL = 30.0  # deadlock_after_s in these tests: keeps the traces short
MIXED = [
    ("idle", 30),
    ("compute", 200),
    ("communication", 30),
    ("compute", 90),
    ("sync_wait", 12),
    ("compute", 80),
    ("data_starvation", 50),
    ("compute", 60),
    ("checkpoint", 60),
    ("compute", 150),
    ("communication", 25),
    ("data_starvation", 40),
    ("compute", 90),
    ("checkpoint", 45),
    ("compute", 60),
    ("deadlock", 150),
]
GPUS = gpus_of(2, 2)


def phases_of(synth, **kw) -> np.ndarray:
    return (
        triage(synth.table, synth.triage_table, deadlock_after_s=DL, **kw)
        .column("phase")
        .to_numpy(zero_copy_only=False)
    )


def run_info(tmp_path, synth, **kw):
    write_run_info(tmp_path / "run", synth, **kw)
    return load_run_info(
        tmp_path / "run", [TraceMeta.from_json(synth.meta(h)) for h in sorted({h for h, _ in synth.gpus})]
    )


def gpu_rows(synth, phases: pa.Table, key) -> np.ndarray:
    df = phases.select(["host", "gpu"]).to_pandas()
    return ((df["host"] == key[0]) & (df["gpu"] == key[1])).to_numpy()


# ---------------------------------------------------------------- accuracy per table


@pytest.mark.parametrize("model", SHIPPED)
@pytest.mark.parametrize("with_run_info", [False, True], ids=["power-only", "heartbeats"])
def test_every_label_on_a_long_mixed_trace(tmp_path, model, with_run_info):
    table = shipped_table(model)
    synth = build_trace(job(GPUS, MIXED, writer=1, stuck=2), table, seed=SHIPPED.index(model))
    info = run_info(tmp_path, synth) if with_run_info else None
    phases = triage(synth.table, table, deadlock_after_s=DL, run_info=info)
    acc = accuracy(phases, synth).set_index("phase")
    assert set(acc.index) == {"compute", "communication", "data_starvation", "checkpoint", "deadlock", "idle"}
    assert (acc["recall"] >= 0.95).all(), acc
    assert (acc["precision"] >= 0.95).all(), acc


def test_schema_windows_and_confidence():
    table = shipped_table("h100")
    synth = build_trace(job(GPUS, MIXED[:6]), table)
    phases = triage(synth.table, table, deadlock_after_s=DL)
    assert phases.schema == PHASES_SCHEMA
    df = phases.to_pandas()
    assert (df["end"] - df["start"] == 1.0).all()
    assert (df["start"] == np.floor(df["start"])).all()
    assert df["confidence"].between(0, 1).all()
    # every GPU has every window of its span, once, in order
    for _, g in df.groupby(["host", "gpu"]):
        assert (np.diff(g["start"]) == 1.0).all()
    assert df[["host", "gpu", "start"]].equals(df.sort_values(["host", "gpu", "start"])[["host", "gpu", "start"]])


def test_dataframe_and_dict_inputs_match_arrow():
    table = shipped_table("a100")
    synth = build_trace(job(GPUS[:2], MIXED[:8]), table, seed=3)
    ref = triage(synth.table, table, deadlock_after_s=DL)
    df = synth.table.to_pandas()
    assert triage(df, table, deadlock_after_s=DL).equals(ref)
    assert triage({c: df[c].to_numpy() for c in df.columns}, table, deadlock_after_s=DL).equals(ref)


# ---------------------------------------------------------------- hang vs checkpoint


def test_long_wait_that_resumes_is_checkpoint_one_that_never_ends_is_deadlock():
    table = shipped_table("h100")
    ckpt = build_trace(job(GPUS, [("compute", 60), ("checkpoint", 80), ("compute", 60)], writer=0), table)
    hang = build_trace(job(GPUS, [("compute", 60), ("deadlock", 140)]), table)
    killed = build_trace(job(GPUS, [("compute", 60), ("deadlock", 80), ("idle", 60)]), table)
    for synth in (ckpt, hang, killed):
        got, truth = phases_of(synth), synth.truth_for(triage(synth.table, table, deadlock_after_s=DL))
        assert (got == truth).mean() >= 0.97, pd.crosstab(truth, got)
    # same power, same utilization: only what follows the wait tells them apart
    assert "deadlock" not in set(phases_of(ckpt)) and "checkpoint" not in set(phases_of(hang))


def test_short_wait_is_communication():
    table = shipped_table("b200")
    synth = build_trace(job(GPUS, [("compute", 60), ("sync_wait", DL - 5), ("compute", 60)]), table)
    got = phases_of(synth)
    assert (got == synth.truth_for(triage(synth.table, table, deadlock_after_s=DL))).mean() >= 0.98


def test_heartbeats_turn_a_short_checkpoint_into_checkpoint(tmp_path):
    """Shorter than deadlock_after_s, once, with the writer's GPU not in the trace (its node's log is
    missing): no idle rank and no series, so power alone calls the peers' wait communication; heartbeats know."""
    table = shipped_table("h200")
    synth = build_trace(job(GPUS, [("compute", 60), ("checkpoint", 20), ("compute", 60)], writer=0), table)
    synth.table = synth.table.filter(~gpu_rows(synth, synth.table, GPUS[0]))
    truth = synth.truth_for(triage(synth.table, table, deadlock_after_s=DL))
    alone = phases_of(synth)
    assert (alone[truth == "checkpoint"] == "checkpoint").mean() < 0.5
    phases = triage(synth.table, table, deadlock_after_s=DL, run_info=run_info(tmp_path, synth))
    got = phases.column("phase").to_numpy(zero_copy_only=False)
    assert (got[truth == "checkpoint"] == "checkpoint").mean() >= 0.95
    assert (phases.column("confidence").to_numpy()[got == "checkpoint"] == 1.0).all()


def test_heartbeats_tell_a_hang_killed_and_restarted_from_a_checkpoint(tmp_path):
    """Wait, short idle, work again: power alone reads a checkpoint; no checkpoint event and no progress: a hang."""
    table = shipped_table("h100")
    sched = job(GPUS, [("compute", 60), ("deadlock", 90), ("idle", 10), ("compute", 60)])
    synth = build_trace(sched, table)
    truth = synth.truth_for(triage(synth.table, table, deadlock_after_s=DL))
    assert (phases_of(synth)[truth == "deadlock"] == "checkpoint").mean() > 0.9
    got = phases_of(synth, run_info=run_info(tmp_path, synth))
    assert (got[truth == "deadlock"] == "deadlock").mean() >= 0.95
    assert (got == truth).mean() >= 0.97


def test_checkpoint_on_a_single_gpu_needs_heartbeats(tmp_path):
    table = shipped_table("a100")
    one = [("node0", 0)]
    synth = build_trace(job(one, [("compute", 60), ("checkpoint", 60), ("compute", 60)], writer=0), table)
    truth = synth.truth_for(triage(synth.table, table, deadlock_after_s=DL))
    assert (phases_of(synth)[truth == "checkpoint"] == "checkpoint").mean() < 0.5  # looks idle, no peers
    got = phases_of(synth, run_info=run_info(tmp_path, synth))
    assert (got == truth).mean() >= 0.98


def test_unmapped_ranks_apply_checkpoints_to_every_gpu(tmp_path):
    table = shipped_table("b300")
    synth = build_trace(job(GPUS, [("compute", 60), ("checkpoint", 20), ("compute", 60)], writer=0), table)
    info = run_info(tmp_path, synth, use_uuid=False, heartbeat_host="elsewhere")
    got = phases_of(synth, run_info=info)
    truth = synth.truth_for(triage(synth.table, table, deadlock_after_s=DL))
    assert (got[truth == "checkpoint"] == "checkpoint").mean() >= 0.95


def test_ranks_map_by_uuid_even_when_local_rank_differs(tmp_path):
    table = shipped_table("h100")
    synth = build_trace(job(GPUS, [("compute", 30), ("data_starvation", 30), ("compute", 30)]), table)
    # ranks in a different order than the GPUs: UUIDs still put each rank on its GPU
    info = run_info(tmp_path, synth, ranks=list(reversed(synth.gpus)))
    mapped = map_ranks(info, synth.gpus)
    assert {r: synth.gpus[g] for r, g in mapped.items()} == dict(enumerate(reversed(synth.gpus)))


# ---------------------------------------------------------------- the stuck rank


@pytest.mark.parametrize("with_run_info", [False, True], ids=["power-only", "heartbeats"])
def test_single_rank_stuck_idle_while_peers_wait(tmp_path, with_run_info):
    table = shipped_table("h100")
    gpus = gpus_of(1, 4)
    sched = job(gpus, [("compute", 90), ("deadlock", 150)], stuck=3)
    sched[("node0", 4)] = [("idle", 240)]  # a GPU the job never used: it stays idle
    synth = build_trace(sched, table)
    info = None
    if with_run_info:
        write_run_info(tmp_path / "run", synth, ranks=gpus)
        info = load_run_info(tmp_path / "run", [TraceMeta.from_json(synth.meta("node0"))])
    phases = triage(synth.table, table, deadlock_after_s=DL, run_info=info)
    got, truth = phases.column("phase").to_numpy(zero_copy_only=False), synth.truth_for(phases)
    stuck = gpu_rows(synth, phases, ("node0", 3))
    assert (got[stuck & (truth == "deadlock")] == "deadlock").mean() >= 0.95
    unused = gpu_rows(synth, phases, ("node0", 4))
    assert (got[unused] == "idle").all()
    assert (got == truth).mean() >= 0.97


def test_metrics_alone_still_place_a_hang(tmp_path):
    """No heartbeats: ranks cannot be placed, but the run-wide stop of progress still backs the hang."""
    table = shipped_table("b200")
    synth = build_trace(job(GPUS, [("compute", 90), ("deadlock", 30), ("idle", 5), ("compute", 60)]), table)
    write_run_info(tmp_path / "run", synth)
    for f in (tmp_path / "run" / "heartbeat").iterdir():
        f.unlink()
    info = load_run_info(tmp_path / "run")
    assert not info.has_heartbeats and info.has_metrics
    phases = triage(synth.table, table, deadlock_after_s=DL - 5, run_info=info)
    got, truth = phases.column("phase").to_numpy(zero_copy_only=False), synth.truth_for(phases)
    assert (got[truth == "deadlock"] == "deadlock").mean() >= 0.9
    assert (phases.column("confidence").to_numpy()[got == "deadlock"] == 1.0).mean() >= 0.9


def test_empty_run_folder_is_no_signal(tmp_path):
    table = shipped_table("a100")
    synth = build_trace(job(GPUS[:1], [("compute", 20)]), table)
    (tmp_path / "run").mkdir()
    result = run_triage(synth.write(tmp_path / "t"), tmp_path / "out", run_dir=str(tmp_path / "run")).to_json()
    assert result["signals"]["heartbeats"] is False and result["signals"]["metrics"] is False
    assert set(result["phases"]) == {"compute"}


def test_finished_job_then_idle_is_not_a_deadlock(tmp_path):
    table = shipped_table("a100")
    synth = build_trace(job(GPUS, [("compute", 90), ("idle", 120)]), table)
    for info in (None, run_info(tmp_path, synth)):
        got = phases_of(synth, run_info=info)
        assert "deadlock" not in set(got)


@pytest.mark.parametrize(
    "variant,util", [("data_starvation", None), ("communication", (40, 60))], ids=["bursts", "mid-power"]
)
def test_metrics_tell_a_host_bound_step_from_a_data_starved_one(tmp_path, variant, util):
    """Bursts between gaps, or mid power at ~50% utilization: power alone cannot say whether the host or
    the loader held the GPU back. Steps whose data wait is 1% are the step's own work: compute."""
    table = shipped_table("h200")
    over = {"phase": "compute", **({"util": util} if util else {})}
    synth = build_trace(job(GPUS[:2], [("compute", 40), (variant, 60, over), ("compute", 40)]), table)
    alone = triage(synth.table, table, deadlock_after_s=DL)
    truth, start = synth.truth_for(alone), alone.column("start").to_numpy()
    host_bound = (start >= T0 + 42) & (start < T0 + 98)
    assert (alone.column("phase").to_numpy(zero_copy_only=False)[host_bound] == "data_starvation").mean() >= 0.9
    got = phases_of(synth, run_info=run_info(tmp_path, synth))
    assert (got == truth).mean() >= 0.97


def test_quiet_windows_after_done_are_idle(tmp_path):
    """Teardown after the last step (freeing memory, destroying the process group) reads low-util."""
    table = shipped_table("b200")
    teardown = {"power_w": table.idle_w + 0.5 * (table.low_max_w - table.idle_w), "util": (30, 50)}
    synth = build_trace(job(GPUS[:2], [("compute", 60), ("idle", 30, teardown)]), table)
    assert (phases_of(synth)[62:90] == "data_starvation").mean() >= 0.9
    phases = triage(synth.table, table, deadlock_after_s=DL, run_info=run_info(tmp_path, synth))
    got, truth = phases.column("phase").to_numpy(zero_copy_only=False), synth.truth_for(phases)
    assert (got == truth).mean() >= 0.97


@pytest.mark.parametrize("model", SHIPPED)
def test_light_work_at_idle_power_is_idle(model):
    """Host copies of a checkpoint on the only GPU: idle power, a few % utilization, no peer waiting."""
    table = shipped_table(model)
    synth = build_trace({("n", 0): [("compute", 30), ("idle", 40, {"util": (0, 8)}), ("compute", 30)]}, table)
    assert (phases_of(synth)[32:68] == "idle").all()


# ---------------------------------------------------------------- noise and gaps


@pytest.mark.parametrize("model", ["a100", "b300"])
def test_noise_at_band_edges_does_not_flap(model):
    table = shipped_table(model)
    mid = table.compute_min_w - table.low_max_w
    sd = 0.15 * mid  # per sample; a 1 s mean at 10 Hz still moves by ~5% of the band
    segs = [
        ("compute", 30),
        ("compute", 240, {"power_w": table.compute_min_w, "power_sd": sd}),
        ("compute", 30),
        ("communication", 240, {"power_w": table.low_max_w + 0.02 * mid, "power_sd": sd}),
        ("compute", 30),
    ]
    synth = build_trace({("node0", 0): segs}, table, seed=7)
    got = phases_of(synth)
    edge_c, edge_l = got[30:270], got[300:540]
    assert set(edge_c) <= {"compute", "communication"}
    assert (edge_c[1:] != edge_c[:-1]).sum() <= 4
    assert (edge_l[1:] != edge_l[:-1]).sum() <= 4
    assert (edge_l == "communication").mean() >= 0.9  # a mean 2% above low_max_w stays communication


def test_hang_just_below_low_max_stays_a_deadlock():
    table = shipped_table("h100")
    low = table.low_max_w - table.idle_w
    segs = [("compute", 60), ("deadlock", 240, {"power_w": table.low_max_w - 0.03 * low, "power_sd": 0.1 * low})]
    synth = build_trace({("node0", 0): segs}, table, seed=3)
    got = phases_of(synth)[60:]
    assert (got == "deadlock").mean() >= 0.95
    assert (got[1:] != got[:-1]).sum() <= 2


def test_heartbeats_call_the_final_export_a_checkpoint_not_a_hang(tmp_path):
    """Peers wait while rank 0 writes the final model, then all exit: power alone reads a hang killed at the end."""
    table = shipped_table("h100")
    synth = build_trace(job(GPUS, [("compute", 60), ("checkpoint", 80), ("idle", 30)], writer=0), table)
    assert (phases_of(synth)[60:140] == "deadlock").mean() > 0.9
    run = tmp_path / "run"
    (run / "heartbeat").mkdir(parents=True)
    for rank, (host, gpu) in enumerate(GPUS):
        events = [(T0, "init"), (T0, "train"), (T0 + 60, "export"), (T0 + 140, "done")]
        (run / "heartbeat" / f"rank-{rank}.events.jsonl").write_text(
            "".join(
                json.dumps({"time": t, "rank": rank, "step": 30, "epoch": 0, "phase": ph}) + "\n" for t, ph in events
            )
        )
        (run / "heartbeat" / f"rank-{rank}.json").write_text(
            json.dumps(
                {
                    "rank": rank,
                    "local_rank": gpu,
                    "gpu": None,
                    "host": host,
                    "step": 30,
                    "phase": "done",
                    "time": T0 + 140,
                }
            )
        )
    phases = triage(synth.table, table, deadlock_after_s=DL, run_info=load_run_info(run))
    got, truth = phases.column("phase").to_numpy(zero_copy_only=False), synth.truth_for(phases)
    assert "deadlock" not in set(got)
    assert (got == truth).mean() >= 0.98


def test_missing_samples_are_unknown_and_do_not_relabel_neighbours():
    table = shipped_table("h200")
    sched = job(GPUS, [("compute", 120), ("checkpoint", 70), ("compute", 60), ("deadlock", 150)], writer=1)
    drop = [(GPUS[0], 40, 55), (GPUS[2], 200, 212.5), (None, 300, 320)]  # in compute, in a checkpoint, in the hang
    synth = build_trace(sched, table, spec=TraceSpec(drop=drop))
    phases = triage(synth.table, table, deadlock_after_s=DL)
    got, truth = phases.column("phase").to_numpy(zero_copy_only=False), synth.truth_for(phases)
    assert ((got == "unknown") == (truth == "unknown")).all()
    assert (truth == "unknown").sum() == 15 + 12 + 4 * 20
    df = phases.to_pandas()
    unknown = df[got == "unknown"]
    assert unknown["power_w"].isna().all() and (unknown["confidence"] == 0).all()
    assert (got == truth).mean() >= 0.97
    # the hang is measured across the gap: all of it is still a deadlock
    assert (got[truth == "deadlock"] == "deadlock").mean() >= 0.98


def test_util_missing_falls_back_to_power():
    table = shipped_table("h100")
    synth = build_trace(job(GPUS[:2], [("idle", 30), ("compute", 60), ("communication", 30), ("deadlock", 90)]), table)
    trace = synth.table.set_column(
        TRACE_SCHEMA.get_field_index("util_gpu"), "util_gpu", pa.nulls(synth.table.num_rows, pa.float32())
    )
    phases = triage(trace, table, deadlock_after_s=DL)
    got, truth = phases.column("phase").to_numpy(zero_copy_only=False), synth.truth_for(phases)
    assert (got == truth).mean() >= 0.95
    assert phases.column("util_gpu").null_count == len(phases)


# ---------------------------------------------------------------- the stage


def test_run_triage_writes_every_artifact(tmp_path):
    table = shipped_table("b200")
    synth = build_trace(job(GPUS, MIXED[:10], writer=3), table)
    paths = synth.write(tmp_path / "telemetry")
    write_run_info(tmp_path / "run", synth)
    result = run_triage(
        paths, tmp_path / "out", run_dir=tmp_path / "run", settings=TriageSettings(deadlock_after_s=DL)
    ).to_json()
    assert result == json.loads((tmp_path / "out" / "triage.json").read_text())
    assert result["status"] == "ok" and result["table"]["gpu_model"] == "B200"
    assert result["table_source"].startswith("detected") and result["table"]["provenance"]
    assert result["signals"] == {"power": True, "util": True, "heartbeats": True, "metrics": True}
    assert result["hosts"] == ["node0", "node1"] and result["gpus"] == 4
    assert len(result["ranks"]["mapped"]) == 4 and result["ranks"]["unmapped"] == []
    phases = pq.read_table(tmp_path / "out" / "phases.parquet")
    assert phases.schema.remove_metadata() == PHASES_SCHEMA
    summary = pd.read_csv(tmp_path / "out" / "phase_summary.csv")
    assert list(summary.columns) == ["host", "gpu", "phase", "windows", "seconds", "share", "energy_j"]
    assert np.allclose(summary.groupby(["host", "gpu"])["share"].sum(), 1.0)
    assert abs(sum(p["seconds"] for p in result["phases"].values()) - len(phases)) < 1e-6
    assert "| compute |" in (tmp_path / "out" / "triage.md").read_text()
    left = [p.name for p in (tmp_path / "out").glob(".*")]
    assert left == [".wattgate-output"]  # the marker, and no temporary files left


def test_phase_summary_energy_and_shares():
    phases = pa.table(
        {
            "host": ["a"] * 4,
            "gpu": pa.array([0] * 4, pa.int32()),
            "start": [0.0, 1.0, 2.0, 3.0],
            "end": [1.0, 2.0, 3.0, 4.0],
            "phase": ["compute", "compute", "idle", "unknown"],
            "power_w": pa.array([500.0, 300.0, 70.0, None], pa.float32()),
            "util_gpu": pa.array([100.0, 100.0, 0.0, None], pa.float32()),
            "confidence": pa.array([1.0, 1.0, 1.0, 0.0], pa.float32()),
        },
        schema=PHASES_SCHEMA,
    )
    s = phase_summary(phases).set_index("phase")
    assert s.loc["compute", "energy_j"] == 800.0 and s.loc["compute", "windows"] == 2
    assert s.loc["compute", "share"] == 0.5 and s.loc["unknown", "energy_j"] == 0.0


def test_deterministic_phases_file(tmp_path):
    table = shipped_table("h100")
    synth = build_trace(job(GPUS, MIXED[:9], writer=2), table, seed=5)
    paths = synth.write(tmp_path / "t")
    run_triage(paths, tmp_path / "a", settings=TriageSettings(deadlock_after_s=DL))
    run_triage(list(reversed(paths)), tmp_path / "b", settings=TriageSettings(deadlock_after_s=DL))
    for name in ("phases.parquet", "phase_summary.csv", "triage.md"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    shuffled = synth.table.take(np.random.default_rng(0).permutation(synth.table.num_rows))
    assert triage(shuffled, table, deadlock_after_s=DL).equals(triage(synth.table, table, deadlock_after_s=DL))


def test_empty_trace_gives_empty_outputs(tmp_path):
    path = tmp_path / "cpu-host.parquet"
    TraceWriter(path, {"nvml": "unavailable: no GPU"}).close()  # what the sampler leaves on a CPU run
    result = run_triage([path], tmp_path / "out").to_json()
    assert result["status"] == "no GPU telemetry" and result["phases"] == {} and result["table"] is None
    phases = pq.read_table(tmp_path / "out" / "phases.parquet")
    assert phases.num_rows == 0 and phases.schema.remove_metadata() == PHASES_SCHEMA
    assert "no GPU telemetry" in (tmp_path / "out" / "triage.md").read_text()
    assert pd.read_csv(tmp_path / "out" / "phase_summary.csv").empty
    assert triage(TRACE_SCHEMA.empty_table(), shipped_table("h100")).num_rows == 0


def test_bad_inputs_are_one_line_input_errors(tmp_path):
    synth = build_trace(job(GPUS[:1], [("compute", 10)]), shipped_table("h100"))
    good = synth.write(tmp_path / "t")
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"not parquet")
    cases = [
        (dict(trace_paths=[broken]), "broken.parquet"),
        (dict(trace_paths=[tmp_path / "absent.parquet"]), "absent.parquet"),
        (dict(trace_paths=good, settings=TriageSettings(gpu_model="v100")), "v100"),
        (dict(trace_paths=good, settings=TriageSettings(table_path=str(tmp_path / "no-table.yaml"))), "no-table.yaml"),
        (dict(trace_paths=good, run_dir=str(tmp_path / "no-run")), "no-run"),
    ]
    bad_table = tmp_path / "bad.yaml"
    bad_table.write_text("gpu_model: X\nmatch: [X]\ntdp_w: 700\nidle_w: 70\nlow_max_w: 400\ncompute_min_w: 380\n")
    cases.append((dict(trace_paths=good, settings=TriageSettings(table_path=str(bad_table))), "bad.yaml"))
    unnamed = tmp_path / "unnamed"
    unnamed.mkdir()
    pq.write_table(synth.table, unnamed / "x.parquet")  # no metadata: the model cannot be detected
    cases.append((dict(trace_paths=[unnamed / "x.parquet"]), "--gpu-model"))
    events = tmp_path / "run" / "heartbeat" / "rank-0.events.jsonl"
    events.parent.mkdir(parents=True)
    events.write_text('{"time": 1}\n')
    cases.append((dict(trace_paths=good, run_dir=str(tmp_path / "run")), "rank-0.events.jsonl:1"))
    for kwargs, needle in cases:
        with pytest.raises(InputError) as exc:
            run_triage(out_dir=tmp_path / "out", **kwargs)
        assert needle in str(exc.value) and "\n" not in str(exc.value), str(exc.value)
    with pytest.raises(InputError, match="window_s"):
        triage(synth.table, shipped_table("h100"), window_s=0)


def test_calibrated_table_from_file(tmp_path):
    table = TriageTable(
        gpu_model="H100",
        match=("H100",),
        tdp_w=700,
        idle_w=70,
        low_max_w=200,
        compute_min_w=400,
        provenance={"kind": "calibrated", "host": "n1"},
    )
    path = tmp_path / "h100-calibrated.yaml"
    path.write_text(table.to_yaml())
    synth = build_trace(job(GPUS[:2], [("compute", 40), ("communication", 40)]), table)
    result = run_triage(
        synth.write(tmp_path / "t"), tmp_path / "out", settings=TriageSettings(table_path=str(path))
    ).to_json()
    assert result["table"]["provenance"]["kind"] == "calibrated"
    assert result["table_source"] == f"--table {path}"
    assert set(result["phases"]) == {"compute", "communication"}


def test_windows_span_from_first_to_last_sample_per_gpu():
    table = shipped_table("h100")
    sched = {("n", 0): [("compute", 20)], ("n", 1): [("idle", 5), ("compute", 30)]}
    synth = build_trace(sched, table, spec=TraceSpec(t0=T0 + 0.5))
    df = triage(synth.table, table).to_pandas()
    assert df.groupby("gpu").size().to_dict() == {0: 21, 1: 36}  # t0 mid-window: one extra window


def test_a_trace_with_no_active_window_anywhere_still_triages():
    """One GPU waits for the whole trace, its peer idles: nothing to anchor a hang to, and no crash."""
    table = shipped_table("h100")
    synth = build_trace({("node0", 0): [("deadlock", 120)], ("node0", 1): [("idle", 120)]}, table)
    got = triage(synth.table, table, deadlock_after_s=DL).column("phase").to_numpy(zero_copy_only=False)
    assert set(got) <= {"deadlock", "idle", "unknown"} and (got == "idle").any()
