"""`wattgate import-trace --from csv`, ISO-8601 times with a zone, truncated final lines, --fields with a header,
and `wattgate report --table` for a GPU with no shipped table (issue 14, item 4)."""

import datetime as dt
import subprocess
import sys

import pytest

from conftest import REPO
from wattgate.cli import main
from wattgate.errors import InputError
from wattgate.power.importers import import_trace, write_trace
from wattgate.report import ReportSources, run_report

from conftest import gpu_rows, write_log

T0 = dt.datetime(2025, 9, 24, 3, 41, 43, 487000, tzinfo=dt.timezone.utc).timestamp()
CUSTOM = "timestamp,gpu_index,temperature_C,utilization_gpu_percent,power_W"
COLUMNS = "time=timestamp,gpu=gpu_index,power_w=power_W,util_gpu=utilization_gpu_percent,temp_c=temperature_C"


def test_custom_header_mapped_with_columns_and_iso_z_times(tmp_path):
    log = write_log(
        tmp_path / "node7.csv",
        f"""
{CUSTOM}
2025-09-24T03:41:43.487Z,0,41,0,72.5
2025-09-24T03:41:43.487Z,1,43,100,650.25
2025-09-24T03:41:44.487Z,0,42,98,610.0
2025-09-24T03:41:44.487Z,1,44,100,655.0
""",
    )
    table, meta = import_trace("csv", [log], columns=COLUMNS)
    d = gpu_rows(table)
    assert d["time"].tolist() == pytest.approx([T0, T0 + 1, T0, T0 + 1], abs=1e-3)
    assert d["gpu"].tolist() == [0, 0, 1, 1] and d["host"].unique().tolist() == ["node7"]
    assert d["power_w"].tolist() == pytest.approx([72.5, 610.0, 650.25, 655.0])
    assert d["util_gpu"].tolist() == [0, 98, 100, 100] and d["temp_c"].tolist() == [41, 42, 43, 44]
    assert meta["source"] == "csv" and meta["skipped_lines"] == {}


def test_stated_units_epoch_ms_milliwatts_and_unmapped_gpu_is_one_gpu(tmp_path):
    ms = int(T0 * 1000)
    log = write_log(
        tmp_path / "w.csv",
        f"""
ts,power_mW,energy
{ms},350120,1.5
{ms + 500},0.36 kW,2.0
""",
    )
    table, meta = import_trace("csv", [log], columns="time=ts:ms,power_w=power_mW:mW,energy_j=energy:kJ")
    d = gpu_rows(table)
    assert d["time"].tolist() == pytest.approx([T0, T0 + 0.5], abs=1e-3)
    assert d["power_w"].tolist() == pytest.approx([350.12, 360.0])  # the value's own unit wins
    assert d["energy_j"].tolist() == pytest.approx([1500.0, 2000.0])
    assert d["gpu"].tolist() == [0, 0] and any("one GPU" in n for n in meta["notes"])


def test_a_mapped_column_missing_from_the_header_names_file_and_header(tmp_path):
    log = write_log(tmp_path / "c.csv", f"{CUSTOM}\n2025-09-24T03:41:43.487Z,0,41,0,72.5\n")
    with pytest.raises(InputError, match=r"c\.csv: --columns names 'power_mw', not in the header \(timestamp, "):
        import_trace("csv", [log], columns="time=timestamp,power_w=power_mw")
    with pytest.raises(InputError, match="time and power_w must be mapped|power_w must be mapped"):
        import_trace("csv", [log], columns="time=timestamp")
    with pytest.raises(InputError, match="unknown unit 'parsecs'"):
        import_trace("csv", [log], columns="time=timestamp:parsecs,power_w=power_W")
    with pytest.raises(InputError, match="--columns is for --from csv"):
        import_trace("zeus", [log], columns="time=timestamp,power_w=power_W")
    out = tmp_path / "t.parquet"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "wattgate",
            "import-trace",
            "--from",
            "csv",
            str(log),
            "--out",
            str(out),
            "--columns",
            "time=timestamp,power_w=watts",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "'watts', not in the header" in proc.stderr


def test_nvidia_smi_reads_iso_times_with_z_or_an_offset_and_naive_ones_take_tz(tmp_path):
    header = "timestamp, index, power.draw [W]"
    log = write_log(
        tmp_path / "n.csv",
        f"""
{header}
2025-09-24T03:41:43.487Z, 0, 100 W
2025-09-24T05:41:44.487+02:00, 0, 110 W
2025/09/24 05:41:45.487, 0, 120 W
""",
    )
    table, _ = import_trace("nvidia-smi", [log], tz_name="Europe/Berlin")  # CEST: UTC+2 for the naive one
    assert gpu_rows(table)["time"].tolist() == pytest.approx([T0, T0 + 1, T0 + 2], abs=1e-3)


@pytest.mark.parametrize(
    "fmt,text,kw",
    [
        (
            "nvidia-smi",
            "timestamp, index, power.draw [W]\n2025/07/27 00:34:45.155, 0, 70 W\n"
            "2025/07/27 00:34:46.155, 0, 71 W\n2025/07/27 00:34:47.155, 0",
            {},
        ),
        (
            "nvidia-smi",
            "timestamp, index, power.draw [W]\n2025/07/27 00:34:45.155, 0, 70 W\n"
            "2025/07/27 00:34:46.155, 0, 71 W\n2025/07/27 00:34:47.155, 0, 70 m",
            {},
        ),  # "70 mW" cut
        ("zeus", "time,gpu0,gpu1\n1753576485.1,70,71\n1753576486.1,70,71\n1753576487.1,7", {}),
        (
            "csv",
            f"{CUSTOM}\n2025-09-24T03:41:43.487Z,0,41,0,72.5\n2025-09-24T03:41:44.487Z,0,41,0,73\n"
            "2025-09-24T03:41:45.4",
            {"columns": COLUMNS},
        ),
    ],
)
def test_truncated_final_line_is_dropped_with_a_note_but_a_bad_middle_line_still_errors(tmp_path, fmt, text, kw):
    log = write_log(tmp_path / "log.csv", text)
    table, meta = import_trace(fmt, [log], **kw)
    assert table.num_rows in (2, 4) and meta["skipped_lines"] == {"truncated_final_line": 1}
    assert any("log.csv:4: truncated final line dropped" in n for n in meta["notes"])
    lines = text.split("\n")
    bad = "\n".join(lines[:2] + [lines[3]] + [lines[2]]) + "\n"  # the cut line mid-file, a good line last
    write_log(log, bad)
    with pytest.raises(InputError, match=r"log\.csv:3: .*--skip-bad-lines"):
        import_trace(fmt, [log], **kw)
    assert import_trace(fmt, [log], skip_bad_lines=True, **kw)[1]["skipped_lines"] != {"truncated_final_line": 1}
    if fmt == "nvidia-smi" and text.endswith("70 m"):  # a complete line (it has its line end) is a bad line
        write_log(log, text + "\n")
        with pytest.raises(InputError, match=r"log\.csv:4: field 'power.draw': .*unknown unit 'm'"):
            import_trace(fmt, [log])


def test_fields_with_a_header_warns_that_the_header_wins(tmp_path, capsys):
    log = write_log(tmp_path / "h.csv", "timestamp, index, power.draw [W]\n2025/07/27 00:34:45.155, 0, 70 W\n")
    table, _ = import_trace("nvidia-smi", [log], fields=["timestamp", "power.draw"])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "h.csv" in err[0] and "--fields ignored (the header wins)" in err[0]
    assert table["gpu"].to_pylist() == [0] and table["power_w"].to_pylist() == [70.0]


def test_report_table_for_a_gpu_with_no_shipped_table(tmp_path):
    lines = ["timestamp, index, name, power.draw [W], utilization.gpu [%]"]
    for i in range(120):
        for g in range(2):
            lines.append(
                f"2025-07-27T00:{34 + (i // 60)}:{i % 60:02d}.000Z, {g}, Tesla V100-SXM2-32GB, "
                f"{250 if i < 60 else 60}.0 W, {100 if i < 60 else 0} %"
            )
    log = write_log(tmp_path / "v100.csv", "\n".join(lines) + "\n")
    table, _ = import_trace("nvidia-smi", [log])
    trace = tmp_path / "t.parquet"
    write_trace(table, trace)
    s = run_report(None, tmp_path / "plain", ReportSources(trace_paths=[trace])).to_json()
    assert s["phases"]["by_phase"] == {} and any("could not pick a table" in n for n in s["notes"])
    yaml_table = write_log(
        tmp_path / "v100.yaml",
        """
gpu_model: V100
match: ["V100"]
tdp_w: 300
idle_w: 40
low_max_w: 90
compute_min_w: 160
busy_util_pct: 85
idle_util_pct: 5
provenance:
  kind: test figures
""",
    )
    out = tmp_path / "report"
    assert main(["report", "--trace", str(trace), "--table", str(yaml_table), "--out", str(out)]) == 0
    import json

    s = json.loads((out / "summary.json").read_text())
    assert s["phases"]["table"] == "V100" and "compute" in s["phases"]["by_phase"]
    assert main(["report", "--trace", str(trace), "--table", str(tmp_path / "nope.yaml"), "--out", str(out)]) == 2


NANOGPT = REPO / "tests" / "data" / "nanogpt-8xh100"  # real 8 x H100 logs (MIT, see LICENSE and SOURCE.md there)


@pytest.mark.parametrize("name, span_s", [("baseline", 266), ("first", 217), ("25", 157)])
def test_real_gzipped_logs_import_with_only_columns(name, span_s):
    table, _ = import_trace("csv", [NANOGPT / f"gpu_metrics_{name}.csv.gz"], columns=COLUMNS)
    d = table.to_pandas()
    assert sorted(d["gpu"].unique()) == list(range(8)) and set(d["host"]) == {f"gpu_metrics_{name}"}
    assert abs((d["time"].max() - d["time"].min()) - span_s) < 2
    assert d["power_w"].between(50, 720).all() and d["util_gpu"].between(0, 100).all()


def test_a_damaged_gzip_log_is_one_line_error(tmp_path):
    data = (NANOGPT / "gpu_metrics_25.csv.gz").read_bytes()
    cut = tmp_path / "cut.csv.gz"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(InputError, match="cut.csv.gz: damaged gzip stream"):
        import_trace("csv", [cut], columns=COLUMNS)
