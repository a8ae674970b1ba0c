"""Import and trace reading on bad input: logs that imported silently wrong (two nodes merged under one file
name, absurd or absent power, a DST fall-back, an empty trace, a header alone) are refused or read right, a
byte order mark is not part of a header name, and damaged inputs (a stray quote, trace metadata, sampler
segments, a binary file) get one line naming the file."""

import datetime as dt
import json
from zoneinfo import ZoneInfo

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from wattgate.errors import InputError
from wattgate.power.importers import import_trace, write_trace
from wattgate.trace import (
    META_KEY,
    TRACE_SCHEMA,
    read_segments,
    read_trace,
    read_trace_chunks,
    schema_with_meta,
    segment_dir,
    trace_meta,
)

T0 = 1758685713.0
COLUMNS = "time=time,gpu=gpu,power_w=power"


def _smi(path, seconds=20, power="300 W"):
    path.parent.mkdir(parents=True, exist_ok=True)
    start = dt.datetime(2025, 9, 24, 3, 0, 0)
    path.write_text(
        "timestamp, index, power.draw [W]\n"
        + "".join(
            f"{(start + dt.timedelta(seconds=s)).strftime('%Y/%m/%d %H:%M:%S.%f')[:-3]}, {g}, {power}\n"
            for s in range(seconds)
            for g in range(2)
        )
    )
    return path


def _csv(path, rows, header="time,gpu,power"):
    path.write_text(header + "\n" + "".join(",".join(map(str, r)) + "\n" for r in rows))
    return path


def test_two_logs_of_one_file_name_are_refused_not_merged_into_one_host(tmp_path):
    a, b = _smi(tmp_path / "node1" / "gpu.csv"), _smi(tmp_path / "node2" / "gpu.csv")
    with pytest.raises(InputError, match=r"node1/gpu\.csv and .*node2/gpu\.csv would both be host 'gpu'.*--host NAME"):
        import_trace("nvidia-smi", [a, b])
    table, meta = import_trace("nvidia-smi", [a], host="node1")  # each on its own, named: fine
    assert meta["hosts"] == ["node1"] and table.num_rows == 40
    # the host from DCGM's own Hostname label, not the file name: no clash
    for node in ("n1", "n2"):
        (tmp_path / node).mkdir()
        (tmp_path / node / "m.txt").write_text(
            "".join(
                f'DCGM_FI_DEV_POWER_USAGE{{gpu="0",Hostname="{node}"}} 300 {int((T0 + s) * 1000)}\n' for s in range(5)
            )
        )
    _, meta = import_trace("dcgm", [tmp_path / "n1" / "m.txt", tmp_path / "n2" / "m.txt"])
    assert meta["hosts"] == ["n1", "n2"]


def test_power_beyond_any_gpu_is_nulled_and_counted_on_import_and_read(tmp_path):
    log = _csv(tmp_path / "spike.csv", [(T0 + i, 0, 5e30 if i == 7 else 300.0) for i in range(20)])
    table, meta = import_trace("csv", [log], columns=COLUMNS)
    power = table.column("power_w").to_pylist()
    assert power.count(None) == 1 and max(p for p in power if p is not None) == 300.0
    assert meta["invalid_values"] == {"power_w": 1} and any("above 5000 W" in n for n in meta["notes"])
    # a trace written by another tool with an absurd reading: the reader nulls it as it nulls NaN
    foreign = tmp_path / "foreign.parquet"
    cols = {n: [None] * 3 for n in TRACE_SCHEMA.names} | {
        "time": [T0, T0 + 1, T0 + 2],
        "host": ["h"] * 3,
        "gpu": [0] * 3,
        "power_w": [300.0, 9000.0, 310.0],
    }
    pq.write_table(pa.Table.from_pydict(cols, schema=schema_with_meta({})), foreign)
    read = read_trace(foreign)
    assert read.column("power_w").to_pylist() == [300.0, None, 310.0]
    assert trace_meta(read).invalid_values == {"power_w": 1}


def test_an_import_without_any_power_reading_is_refused_for_every_format(tmp_path):
    util_only = tmp_path / "util.txt"
    util_only.write_text(
        "".join(f'DCGM_FI_DEV_GPU_UTIL{{gpu="0",Hostname="nodeA"}} 50 {int((T0 + s) * 1000)}\n' for s in range(5))
    )
    with pytest.raises(InputError, match=r"util\.txt: no power reading for host 'nodeA' in 5 sample row\(s\)"):
        import_trace("dcgm", [util_only])
    with pytest.raises(InputError, match=r"gpu\.csv: no power reading for host 'gpu'"):
        import_trace("nvidia-smi", [_smi(tmp_path / "gpu.csv", power="[N/A]")])
    absurd = _csv(tmp_path / "absurd.csv", [(T0 + i, 0, -5 if i % 2 else 6000) for i in range(5)])
    with pytest.raises(InputError, match=r"absurd\.csv: no power reading .*5 nulled as not readings"):
        import_trace("csv", [absurd], columns=COLUMNS)
    empty = _csv(tmp_path / "empty.csv", [(T0 + i, "", "") for i in range(5)], header="time,gpu0,gpu1")
    with pytest.raises(InputError, match=r"empty\.csv: no power reading for host 'empty'"):
        import_trace("zeus", [empty])
    half = _csv(tmp_path / "half.csv", [(T0 + i, "", 300) for i in range(5)], header="time,gpu0,gpu1")
    assert import_trace("zeus", [half])[0].num_rows == 10  # a host with some power is a trace (one GPU silent)


def test_a_dst_fall_back_hour_in_local_time_is_placed_by_line_order(tmp_path):
    berlin = ZoneInfo("Europe/Berlin")
    start = dt.datetime(2025, 10, 26, 0, 30, tzinfo=dt.timezone.utc)  # 02:30 CEST; clocks go back at 01:00 UTC
    times = [start + dt.timedelta(seconds=10 * i) for i in range(720)]  # two hours
    local = [t.astimezone(berlin).replace(tzinfo=None) for t in times]
    smi = tmp_path / "dst.csv"
    smi.write_text(
        "timestamp, index, power.draw [W]\n"
        + "".join(f"{t.strftime('%Y/%m/%d %H:%M:%S.%f')[:-3]}, 0, 600 W\n" for t in local)
    )
    csv_log = _csv(tmp_path / "dst_iso.csv", [(t.isoformat(), 0, 600) for t in local])
    expected = [t.timestamp() for t in times]
    for fmt, log, kw in (("nvidia-smi", smi, {}), ("csv", csv_log, {"columns": COLUMNS})):
        table, meta = import_trace(fmt, [log], tz_name="Europe/Berlin", **kw)
        assert table.column("time").to_pylist() == pytest.approx(expected), fmt
        assert any("360 line(s) in the hour repeated" in n for n in meta["notes"]), fmt


def test_every_format_refuses_a_log_with_no_readable_line(tmp_path):
    bad = _csv(tmp_path / "allbad.csv", [("garbage", "x", "y")])
    with pytest.raises(InputError, match=r"allbad\.csv: no readable sample lines"):
        import_trace("csv", [bad], columns=COLUMNS, skip_bad_lines=True)
    zeus = _csv(tmp_path / "zeus.csv", [("garbage", "y")], header="time,gpu0")
    with pytest.raises(InputError, match=r"zeus\.csv: no readable sample lines"):
        import_trace("zeus", [zeus], skip_bad_lines=True)
    wild = _csv(tmp_path / "wild.csv", [(T0, -1, 300.0), (T0 + 1, -2, 300.0)])  # every row out of range
    with pytest.raises(InputError, match=r"wild\.csv: no readable sample lines"):
        import_trace("csv", [wild], columns=COLUMNS, skip_bad_lines=True)


@pytest.mark.parametrize("swallowed", [200, 200_000])  # under and over the csv module's 128 KiB field limit
def test_a_stray_quote_is_one_bad_line_with_a_short_excerpt(tmp_path, swallowed):
    rows = [f"{T0 + i},0,300.0\n" for i in range(swallowed // 20)]
    log = tmp_path / "quote.csv"
    log.write_text("time,gpu,power\n" + "".join(rows[:2]) + f'{T0 + 0.5},0,"387.26\n' + "".join(rows[2:]))
    with pytest.raises(InputError) as err:
        import_trace("csv", [log], columns=COLUMNS)
    assert str(err.value).startswith(f"{log}:4: field 'line': cannot read '{T0 + 0.5},0,") and "quote" in str(err.value)
    assert len(str(err.value)) < 300 and "\n" not in str(err.value)
    table, meta = import_trace("csv", [log], columns=COLUMNS, skip_bad_lines=True)
    assert table.num_rows == len(rows) and meta["skipped_lines"] == {"line": 1}


def _trace_with_meta(path, raw: bytes):
    cols = {n: [None] * 2 for n in TRACE_SCHEMA.names} | {
        "time": [T0, T0 + 1],
        "host": ["h", "h"],
        "gpu": [0, 0],
        "power_w": [300.0, -1.0],  # one invalid value: the reader rewrites invalid_values too
    }
    table = pa.Table.from_pydict(cols, schema=TRACE_SCHEMA).replace_schema_metadata({META_KEY: raw})
    pq.write_table(table, path)
    return path


@pytest.mark.parametrize(
    "raw, why",
    [
        (b'{"gpus": [1', r"not JSON"),
        (b"[]", r"a JSON list, not an object"),
        (b'{"gpus": "x"}', r"'gpus' is a str, not a list"),
        (b'{"gpus": [1]}', r"gpus\[0\] is a int, not an object"),
        (b'{"gpus": [{"index": "zero"}]}', r"gpus\[0\]\.index is 'zero', not a number"),
        (b'{"invalid_values": {"power_w": "many"}}', r"invalid_values\['power_w'\] is 'many', not a count"),
    ],
)
def test_damaged_trace_metadata_is_one_error_naming_the_file(tmp_path, raw, why):
    path = _trace_with_meta(tmp_path / "bad.parquet", raw)
    pattern = rf"bad\.parquet: not a wattgate trace: damaged metadata under 'wattgate\.trace' \({why}"
    with pytest.raises(InputError, match=pattern):
        read_trace(path)
    with pytest.raises(InputError, match=pattern):
        read_trace(path, columns=["time", "power_w"])
    with pytest.raises(InputError, match=pattern):
        read_trace_chunks(path, ["time", "power_w"], 10)
    with pytest.raises(InputError, match=r"^not a wattgate trace: damaged metadata"):  # no file known
        trace_meta(pq.read_schema(path))


def _segments(tmp_path, n=3):
    table, _ = import_trace("csv", [_csv(tmp_path / "h.csv", [(T0 + i, 0, 300.0) for i in range(30)])], columns=COLUMNS)
    final = tmp_path / "telemetry" / "h.parquet"
    folder = segment_dir(final)
    folder.mkdir(parents=True)
    k = table.num_rows // n
    paths = [folder / f"seg-{i:010d}-{i:010d}.parquet" for i in range(n)]
    for i, p in enumerate(paths):
        pq.write_table(table.slice(i * k, k), p)
    return final, paths, table


def test_a_damaged_segment_is_named_not_dropped(tmp_path):
    final, paths, _ = _segments(tmp_path)
    data = paths[1].read_bytes()
    paths[1].write_bytes(data[: len(data) // 2])
    with pytest.raises(InputError, match=rf"^{paths[1]}: damaged trace segment \(.*\); move it aside"):
        read_trace(final)


def test_a_segment_without_the_optional_columns_reads_them_as_null(tmp_path):
    final, paths, table = _segments(tmp_path)
    pq.write_table(pq.read_table(paths[1]).drop(["sm_active", "nvlink_rx_bps"]), paths[1])
    read = read_trace(final)
    assert read.num_rows == table.num_rows
    assert np.isnan(read.column("sm_active").to_numpy(zero_copy_only=False)).all()
    assert read_segments(final.parent / f".{final.name}.segments").schema.names == TRACE_SCHEMA.names
    pq.write_table(pq.read_table(paths[2]).drop(["power_w"]), paths[2])  # a required column: refused, named
    with pytest.raises(InputError, match=rf"^{paths[2]}: not a wattgate trace: missing column\(s\) power_w"):
        read_trace(final)


def test_a_bad_gpu_index_option_and_a_binary_file_get_a_plain_line(tmp_path):
    zeus = tmp_path / "zleg.csv"
    zeus.write_text("Time,Power\n1758685713.0,300500\n1758685713.1,301000\n")
    with pytest.raises(InputError, match=r"^--gpu-index -1: a GPU index is 0\.\.1023$"):
        import_trace("zeus", [zeus], gpu_index=-1)
    table, _ = import_trace("csv", [_csv(tmp_path / "h.csv", [(T0 + i, 0, 300.0) for i in range(5)])], columns=COLUMNS)
    trace = tmp_path / "t.parquet"
    write_trace(table, trace)
    with pytest.raises(InputError) as err:
        import_trace("csv", [trace], columns=COLUMNS)
    assert str(err.value) == (
        f"{trace}: not a text log: a Parquet file (a wattgate trace needs no import); "
        "import-trace reads text CSV or DCGM exporter logs"
    )
    assert json.loads(pq.read_schema(trace).metadata[META_KEY])["source"] == "csv"


# ---------------------------------------------------------------- CSV logs: a header alone, a byte order mark


@pytest.mark.parametrize(
    "fmt, text, columns",
    [
        ("csv", "timestamp,power_W\n", "time=timestamp,power_w=power_W"),
        ("zeus", "time,gpu0,gpu1\n", None),
    ],
)
def test_a_header_only_csv_is_an_error_like_nvidia_smi(tmp_path, fmt, text, columns):
    log = tmp_path / "h.csv"
    log.write_text(text)
    with pytest.raises(InputError, match=r"h\.csv: a header line and no sample lines"):
        import_trace(fmt, [log], columns=columns)


@pytest.mark.parametrize("gz", [False, True])
def test_a_utf8_byte_order_mark_is_not_part_of_the_first_header_name(tmp_path, gz):
    import gzip

    data = "\ufefftimestamp,power_W\n1753576485.0,70\n1753576486.0,71\n".encode()
    log = tmp_path / ("b.csv.gz" if gz else "b.csv")
    log.write_bytes(gzip.compress(data) if gz else data)
    table, _ = import_trace("csv", [log], columns="time=timestamp,power_w=power_W")
    assert table.column("power_w").to_pylist() == [70.0, 71.0]
