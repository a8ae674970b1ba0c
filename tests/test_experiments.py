"""Measurement variants (scaling: same global batch at each world size; dataio: shared vs local shards)
and the comparison tables built from finished runs."""

import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from real_traces import H200_DATA

from wattgate.errors import InputError
from wattgate.experiments import compare, node_layout, step_throughput, variant_config, variant_names
from wattgate.run_tables import METRICS_SCHEMA

from conftest import set_column

TRAIN = H200_DATA / "train"


def test_scaling_variants_keep_the_global_batch(make_config):
    base = make_config(
        cluster={"nodes": 2, "gpus_per_node": 8},
        train={"micro_batch_size": 1, "grad_accum": 8},
        scaling={"world_sizes": [4, 8, 16], "steps": 20},
    )
    assert variant_names(base, "scaling") == ["w4", "w8", "w16"]
    for world, nodes, per_node, accum in [(4, 1, 4, 32), (8, 1, 8, 16), (16, 2, 8, 8)]:
        v = variant_config(base, "scaling", f"w{world}")
        assert (v.cluster.nodes, v.cluster.gpus_per_node, v.train.grad_accum) == (
            nodes,
            per_node,
            accum,
        )
        assert v.train.max_steps == 20 and v.run_name == f"{base.run_name}-scaling-w{world}"
        assert v.train.checkpoint_every == 20 and not v.train.checkpoint_at_epoch_end


def test_scaling_rejects_sizes_that_do_not_fit(make_config):
    base = make_config(cluster={"gpus_per_node": 8}, scaling={"world_sizes": [12, 3]})
    with pytest.raises(InputError, match="12 does not fill whole nodes"):
        node_layout(12, 8)
    with pytest.raises(InputError, match="does not split over 3 GPU"):
        variant_config(base, "scaling", "w3")
    with pytest.raises(InputError, match="expected w<N>"):
        variant_config(base, "scaling", "w5")
    with pytest.raises(InputError, match="expected one of shared, local"):
        variant_config(base, "dataio", "nfs")


def test_dataio_variants_differ_only_in_the_data_path(make_config):
    base = make_config()
    shared, local = (variant_config(base, "dataio", v) for v in ("shared", "local"))
    assert shared.train.data_cache == "shared" and local.train.data_cache == "local"
    assert shared.train.replace(data_cache="local") == local.train and shared.cluster == local.cluster


def metrics(step_times, ranks=2, tokens=1000, wait=0.01):
    rows, t = [], 100.0
    for step, st in enumerate(step_times, start=1):
        t += st
        for r in range(ranks):
            rows.append(
                {
                    "step": step,
                    "rank": r,
                    "epoch": 0,
                    "loss": 1.0,
                    "tokens": tokens,
                    "loss_tokens": tokens,
                    "step_time_s": st * (1.0 if r == 0 else 0.9),
                    "data_wait_s": wait,
                    "lr": 1e-3,
                    "grad_norm": 1.0,
                    "time": t,
                }
            )
    return pd.DataFrame(rows)


def test_throughput_skips_warmup_and_waits_for_the_slowest_rank():
    m = step_throughput(metrics([5.0, 1.0, 1.0, 1.0]))
    assert m.steps_measured == 3 and m.tokens_per_s == pytest.approx(2000.0)
    assert m.data_wait_share == pytest.approx((0.01 / 1.0 + 0.01 / 0.9) / 2)


def run_folder(root, name) -> Path:
    """results/train/<name> under root, its config's folder beside it (the workflow's layout)."""
    run = root / "results" / "train" / name
    run.mkdir(parents=True)
    (root / "results" / "config").mkdir(exist_ok=True)
    return run


def gate_folder(run) -> Path:
    gate = run.parent.parent / "gate" / run.name
    gate.mkdir(parents=True)
    return gate


def fake_run(root, name, config, step_time, ranks, device="cpu") -> Path:
    run = run_folder(root, name)
    (root / "results" / "config" / f"{name}.yaml").write_text(yaml.safe_dump(config.to_json()))
    pq.write_table(
        pa.Table.from_pandas(
            metrics([3.0] + [step_time] * 5, ranks=ranks), schema=METRICS_SCHEMA, preserve_index=False
        ),
        run / "metrics.parquet",
    )
    (run / "TRAINED").write_text(json.dumps({"device": device, "data_copy_s": 0.0}))
    return run


def test_scaling_table_efficiency_and_gpu_hours(make_config, tmp_path):
    base = make_config(scaling={"world_sizes": [1, 2]})
    w1 = fake_run(tmp_path, "w1", variant_config(base, "scaling", "w1"), 1.0, 1)
    w2 = fake_run(tmp_path, "w2", variant_config(base, "scaling", "w2"), 0.6, 2)
    table = compare("scaling", [w2, w1], tmp_path / "out")
    assert table["world_size"].tolist() == [1, 2]
    assert table["tokens_per_s"].tolist() == pytest.approx([1000.0, 2000 / 0.6])
    assert table["scaling_efficiency"].tolist() == pytest.approx([1.0, (2000 / 0.6 / 2) / 1000.0])
    assert table["gpu_hours_per_billion_tokens"].iloc[0] == pytest.approx(1e9 / 1000 / 3600)
    assert table["joules_per_token"].isna().all()  # no GPU traces
    assert (tmp_path / "out" / "plot.png").read_bytes()[:4] == b"\x89PNG"
    assert "| world_size |" in (tmp_path / "out" / "table.md").read_text()


def test_compare_tabulates_the_gates_forecast_error(make_config, tmp_path):
    base = make_config(scaling={"world_sizes": [1, 2]})
    runs = []
    for name, ranks, forecast, measured in (("w1", 1, 12.0, 10.0), ("w2", 2, None, 8.0)):
        run = fake_run(tmp_path, name, variant_config(base, "scaling", name), 1.0, ranks)
        trained = run / "TRAINED"
        trained.write_text(json.dumps(json.loads(trained.read_text()) | {"job_s": measured}))
        gate = {"forecast": {"wall_s": forecast, "throughput": {"source": "analytic"}} if forecast else None}
        (gate_folder(run) / "gate.json").write_text(json.dumps(gate))
        runs.append(run)
    table = compare("scaling", runs, tmp_path / "out")
    assert table["forecast_wall_s"].tolist()[0] == 12.0 and table["measured_wall_s"].tolist() == [10.0, 8.0]
    assert table["forecast_error"].iloc[0] == pytest.approx(0.2) and pd.isna(table["forecast_error"].iloc[1])
    assert table["forecast_source"].tolist()[0] == "analytic"
    assert "forecast_error" in (tmp_path / "out" / "table.md").read_text()


def test_compare_names_an_unfinished_run(make_config, tmp_path):
    run = run_folder(tmp_path, "w1")
    (tmp_path / "results/config/w1.yaml").write_text(
        yaml.safe_dump(variant_config(make_config(), "scaling", "w1").to_json())
    )
    with pytest.raises(InputError, match="train/w1: not a finished train run"):
        compare("scaling", [run], tmp_path / "out")


# ---------------------------------------------------------------- compare on damaged inputs


def variant(tmp_path, name="shared") -> Path:
    """A copy of the recorded H200 run as a variant run of the workflow's layout (results/train/<name>)."""
    run = tmp_path / "results" / "train" / name
    shutil.copytree(TRAIN, run)
    (tmp_path / "results" / "config").mkdir()
    shutil.copy(TRAIN / "config.yaml", tmp_path / "results" / "config" / f"{name}.yaml")
    return run


def test_compare_refuses_a_forecast_without_throughput_naming_the_file(tmp_path):
    v = variant(tmp_path)
    (gate_folder(v) / "gate.json").write_text(json.dumps({"forecast": {"wall_s": 10}}))
    with pytest.raises(InputError, match=r"gate/shared/gate.json: forecast has no throughput.source"):
        compare("dataio", [v], tmp_path / "out")


def test_compare_leaves_out_a_step_of_zero_seconds(tmp_path):
    v = variant(tmp_path)
    times = pq.read_table(v / "metrics.parquet")["step_time_s"].to_numpy().copy()
    times[10] = 0.0
    set_column(v / "metrics.parquet", "step_time_s", times)
    notes = []
    table = compare("dataio", [v], tmp_path / "out", note=notes.append)
    assert np.isfinite(table["data_wait_share"].to_numpy(dtype=float)).all()
    assert "inf" not in (tmp_path / "out" / "table.csv").read_text()
    assert any("without a positive step_time_s left out" in n for n in notes)
    assert "without a positive step_time_s" in (tmp_path / "out" / "table.md").read_text()


def test_compare_names_the_variants_metrics_when_no_step_is_measured(tmp_path):
    v = variant(tmp_path)
    times = pq.read_table(v / "metrics.parquet")["step_time_s"].to_numpy()
    set_column(v / "metrics.parquet", "step_time_s", -np.abs(times))
    with pytest.raises(InputError, match=r"train/shared/metrics.parquet: no measured steps"):
        compare("dataio", [v], tmp_path / "out")
