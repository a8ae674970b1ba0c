"""`wattgate import-trace`: small hand-written logs in each format, round-tripped into the trace contract."""

import subprocess
import sys

import pytest

from conftest import REPO, gpu_rows, write_log
from wattgate.errors import InputError
from wattgate.power.importers import import_trace, write_trace
from wattgate.power.importers.nvidia_smi import infer_burst_positions
from wattgate.triage_tables import resolve_table
from wattgate.trace import TRACE_SCHEMA, read_trace, trace_meta

SMI_HEADER = "timestamp, index, name, power.draw [W], power.draw.instant [W], utilization.gpu [%], memory.used [MiB]"
T0 = 1753576485.155  # 2025/07/27 00:34:45.155 UTC


def test_nvidia_smi_with_units_markers_and_an_index(tmp_path):
    log = write_log(
        tmp_path / "node1.csv",
        f"""
{SMI_HEADER}
2025/07/27 00:34:45.155, 0, NVIDIA H100 80GB HBM3, 72.36 W, 75.10 W, 0 %, 1 MiB
2025/07/27 00:34:45.158, 1, NVIDIA H100 80GB HBM3, 70.01 W, [N/A], [Not Supported], 1 MiB
2025/07/27 00:34:45.255, 0, NVIDIA H100 80GB HBM3, 142.40 W, 141.90 W, 100 %, 70123 MiB
2025/07/27 00:34:45.259, 1, NVIDIA H100 80GB HBM3, 70.00 W, 71.00 W, 3 %, 1 MiB
""",
    )
    table, meta = import_trace("nvidia-smi", [log])
    d = gpu_rows(table)
    assert table.schema.names == TRACE_SCHEMA.names
    assert d["host"].unique().tolist() == ["node1"] and d["gpu"].tolist() == [0, 0, 1, 1]
    assert d["time"].iloc[0] == pytest.approx(T0, abs=1e-3)
    assert d["power_w"].tolist() == pytest.approx([75.10, 141.90, 70.01, 71.0])  # instant, else the average
    assert d["util_gpu"].isna().tolist() == [False, False, True, False]
    assert d["mem_used_mib"].iloc[1] == 70123
    assert not meta["gpu_index_inferred"]
    out = tmp_path / "t.parquet"
    write_trace(table, out)
    back = read_trace(out)
    assert len(back) == 4 and trace_meta(back).gpus[0].name == "NVIDIA H100 80GB HBM3"
    assert resolve_table(None, None, trace_meta(back).device_names()).gpu_model == "H100"


def test_nvidia_smi_without_index_infers_gpus_from_bursts_including_a_short_one(tmp_path):
    lines = ["timestamp, power.draw [W], utilization.gpu [%]"]
    for burst in range(6):
        n = 2 if burst == 3 else 4  # burst 3: two GPUs did not answer in time
        for g in range(n):
            ms = 155 + burst * 100 + 3 * g
            lines.append(f"2025/07/27 00:34:{45 + ms // 1000:02d}.{ms % 1000:03d}, {100 + 10 * g}.0 W, {g} %")
    log = write_log(tmp_path / "n.csv", "\n".join(lines) + "\n")
    table, meta = import_trace("nvidia-smi", [log])
    d = gpu_rows(table)
    assert meta["gpu_index_inferred"] and "4 GPU(s); 1 short burst(s)" in meta["notes"][0]
    assert d.groupby("gpu").size().tolist() == [6, 6, 5, 5]
    assert (d["power_w"] == 100 + 10 * d["gpu"]).all()  # every row landed on its GPU


def test_burst_inference_on_exact_grid():
    t = [0.0, 0.003, 0.006, 0.1, 0.103, 0.106, 0.2, 0.203]
    positions, n, short = infer_burst_positions(__import__("numpy").array(t))
    assert positions == [0, 1, 2, 0, 1, 2, 0, 1] and n == 3 and short == 1


def test_noheader_needs_fields_and_nounits_values_work(tmp_path):
    log = write_log(tmp_path / "n.csv", "2025/07/27 00:34:45.155, 0, 72.36, 0\n2025/07/27 00:34:45.255, 0, 75.0, 100\n")
    with pytest.raises(InputError, match="no header line.*--fields"):
        import_trace("nvidia-smi", [log])
    table, _ = import_trace("nvidia-smi", [log], fields=["timestamp", "index", "power.draw", "utilization.gpu"])
    assert gpu_rows(table)["power_w"].tolist() == pytest.approx([72.36, 75.0])


def test_bad_lines_name_file_line_and_field_or_are_counted(tmp_path):
    log = write_log(
        tmp_path / "n.csv",
        f"""
{SMI_HEADER}
2025/07/27 00:34:45.155, 0, NVIDIA H100, 72.36 W, 75.10 W, 0 %, 1 MiB
2025/07/27 00:34:45.255, 0, NVIDIA H100, lots W, 75.10 W, 0 %, 1 MiB
yesterday, 0, NVIDIA H100, 72.36 W, 75.10 W, 0 %, 1 MiB
""",
    )
    with pytest.raises(InputError, match=r"n\.csv:3: field 'power.draw': cannot read 'lots W'"):
        import_trace("nvidia-smi", [log])
    table, meta = import_trace("nvidia-smi", [log], skip_bad_lines=True)
    assert len(table) == 1 and meta["skipped_lines"] == {"power.draw": 1, "timestamp": 1}


def test_unknown_layout_says_which_columns_it_needs(tmp_path):
    log = write_log(tmp_path / "n.csv", "date, watts\n2025-01-01, 3\n")
    with pytest.raises(InputError, match="needs the columns timestamp and power.draw"):
        import_trace("nvidia-smi", [log], fields=None)
    with pytest.raises(InputError, match="Zeus power CSV needs a time column"):
        import_trace("zeus", [log])
    with pytest.raises(InputError, match=r"n\.csv:1: .*not a Prometheus sample"):
        import_trace("dcgm", [log])
    other = write_log(tmp_path / "other.prom", "# HELP node_load1 load\nnode_load1 0.5\n")
    with pytest.raises(InputError, match="no DCGM samples.*DCGM_FI_DEV_POWER_USAGE"):
        import_trace("dcgm", [other])


def test_pci_bus_id_orders_gpus_when_there_is_no_index(tmp_path):
    log = write_log(
        tmp_path / "n.csv",
        """
timestamp, pci.bus_id, power.draw [W]
2025/07/27 00:34:45.155, 00000000:CB:00.0, 300 W
2025/07/27 00:34:45.157, 00000000:1B:00.0, 100 W
""",
    )
    table, meta = import_trace("nvidia-smi", [log])
    assert dict(zip(gpu_rows(table)["gpu"], gpu_rows(table)["power_w"])) == {0: 100.0, 1: 300.0}


DCGM_LINE = (
    'DCGM_FI_DEV_{m}{{gpu="{g}",UUID="GPU-{g}",device="nvidia{g}",modelName="NVIDIA B200",Hostname="node7"}} {v}{ts}\n'
)


def dcgm(metric, gpu, value, ts=""):
    return DCGM_LINE.format(m=metric, g=gpu, v=value, ts=ts)


def test_dcgm_scrapes_with_timestamps_comment_times_or_a_time_in_the_file_name(tmp_path):
    stamped = write_log(
        tmp_path / "a.prom",
        "# HELP DCGM_FI_DEV_POWER_USAGE Power draw (in W).\n"
        + dcgm("POWER_USAGE", 0, 412.5, " 1753576485100")
        + dcgm("GPU_UTIL", 0, 97, " 1753576485100")
        + dcgm("TOTAL_ENERGY_CONSUMPTION", 0, 5000, " 1753576485100")
        + 'DCGM_FI_PROF_SM_ACTIVE{gpu="0",Hostname="node7"} 0.42 1753576485100\n',
    )
    table, meta = import_trace("dcgm", [stamped])
    d = gpu_rows(table)
    assert d[["host", "gpu"]].values.tolist() == [["node7", 0]]
    assert (d["power_w"].iloc[0], d["util_gpu"].iloc[0], d["energy_j"].iloc[0]) == pytest.approx((412.5, 97, 5.0))
    assert d["sm_active"].iloc[0] == pytest.approx(42.0) and d["time"].iloc[0] == pytest.approx(1753576485.1)
    assert meta["gpus"][0]["name"] == "NVIDIA B200"
    blocks = write_log(
        tmp_path / "b.prom",
        "# 2025-07-27T00:34:45Z\n"
        + dcgm("POWER_USAGE", 0, 400)
        + dcgm("POWER_USAGE", 1, 401)
        + "# 2025-07-27T00:34:46Z\n"
        + dcgm("POWER_USAGE", 0, 402)
        + dcgm("POWER_USAGE", 1, 403),
    )
    d = gpu_rows(import_trace("dcgm", [blocks])[0])
    assert d["time"].tolist() == pytest.approx([1753576485.0, 1753576486.0] * 2)
    per_file = write_log(tmp_path / "scrape-1753576490.txt", dcgm("POWER_USAGE", 0, 399))
    assert gpu_rows(import_trace("dcgm", [per_file])[0])["time"].iloc[0] == pytest.approx(1753576490.0)
    untimed = write_log(tmp_path / "c.prom", dcgm("POWER_USAGE", 0, 400))
    with pytest.raises(InputError, match=r"c\.prom:1: field 'timestamp'"):
        import_trace("dcgm", [untimed])
    twice = write_log(tmp_path / "d.prom", "# 1753576485\n" + dcgm("POWER_USAGE", 0, 400) + dcgm("POWER_USAGE", 0, 401))
    with pytest.raises(InputError, match=r"d\.prom:3: .*second scrape without a time line"):
        import_trace("dcgm", [twice])


def test_zeus_wide_and_legacy_milliwatt_logs(tmp_path):
    wide = write_log(tmp_path / "wide.csv", "time,gpu0,gpu1\n1753576485.0,300.5,290.1\n1753576485.1,301.5,[N/A]\n")
    legacy = write_log(tmp_path / "legacy.csv", "Time,Power\n2022-07-13 02:07:36.708783111,32402\n")
    table, _ = import_trace("zeus", [wide, legacy], host=None, gpu_index=3)
    d = table.to_pandas()
    assert sorted(map(tuple, d[["host", "gpu"]].drop_duplicates().values.tolist())) == [
        ("legacy", 3),
        ("wide", 0),
        ("wide", 1),
    ]
    assert d.loc[d.host == "legacy", "power_w"].iloc[0] == pytest.approx(32.402)  # mW -> W
    assert d.loc[d.host == "legacy", "time"].iloc[0] == pytest.approx(1657678056.708783)
    assert d.loc[(d.host == "wide") & (d.gpu == 1), "power_w"].isna().tolist() == [False, True]


def test_cli_round_trip_and_one_line_errors(tmp_path):
    log = write_log(
        tmp_path / "n.csv", f"{SMI_HEADER}\n2025/07/27 00:34:45.155, 0, NVIDIA H200, 80 W, 79 W, 0 %, 1 MiB\n"
    )
    out = tmp_path / "t.parquet"

    def run(*a):
        return subprocess.run(
            [sys.executable, "-m", "wattgate", "import-trace", *a], capture_output=True, text=True, cwd=REPO, timeout=60
        )

    proc = run("--from", "nvidia-smi", str(log), "--out", str(out), "--host", "gpu-node-3")
    assert proc.returncode == 0, proc.stderr
    assert read_trace(out)["host"].to_pylist() == ["gpu-node-3"]
    proc = run("--from", "nvidia-smi", str(tmp_path / "missing.csv"), "--out", str(out))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "missing.csv: no such file" in proc.stderr
    proc = run("--from", "nvidia-smi", str(log), "--out", str(out), "--tz", "Mars/Olympus")
    assert proc.returncode == 2 and "not a time zone name" in proc.stderr


def test_readme_two_commands_import_then_report_in_power_only_mode(tmp_path):
    """`wattgate import-trace` then `wattgate report --trace`: a report from nothing but an nvidia-smi log."""
    lines = ["timestamp, index, name, power.draw [W], utilization.gpu [%]"]
    for i in range(600):  # 60 s at 10 Hz, 2 GPUs: busy, then both spin at low power until the log ends
        busy = i < 300
        ms = i * 100
        stamp = f"2025/07/27 00:{34 + (45 + ms // 1000) // 60:02d}:{(45 + ms // 1000) % 60:02d}.{ms % 1000:03d}"
        for g in range(2):
            lines.append(f"{stamp}, {g}, NVIDIA H100 80GB HBM3, {600 if busy else 140}.0 W, {100} %")
    log = write_log(tmp_path / "gpu.csv", "\n".join(lines) + "\n")

    def run(*a):
        return subprocess.run(
            [sys.executable, "-m", "wattgate", *a], capture_output=True, text=True, cwd=REPO, timeout=120
        )

    proc = run("import-trace", "--from", "nvidia-smi", str(log), "--out", str(tmp_path / "trace.parquet"))
    assert proc.returncode == 0, proc.stderr
    proc = run("report", "--trace", str(tmp_path / "trace.parquet"), "--out", str(tmp_path / "report"))
    assert proc.returncode == 0, proc.stderr
    page = (tmp_path / "report" / "index.html").read_text()
    assert "Power-only verdict" in page and "heartbeats" in page
