"""Issue 13: units per value, range checks (null + counted), strict JSON, one-line errors for a bad time column."""

import json
import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from wattgate.errors import InputError
from wattgate.power.importers import import_trace, write_trace
from wattgate.trace import TRACE_SCHEMA, read_trace, schema_with_meta, trace_meta


def write(path, text):
    path.write_text(text.lstrip("\n"))
    return path


def powers(table):
    d = table.to_pandas().sort_values(["gpu", "time"]).reset_index(drop=True)
    return d["power_w"].tolist()


def test_nvidia_smi_mixed_mw_and_w_rows_convert_each_value_by_its_own_unit(tmp_path):
    log = write(
        tmp_path / "mixed.csv",
        """
timestamp, index, power.draw [W]
2025/07/27 00:34:45.155, 0, 350.12 W
2025/07/27 00:34:45.255, 0, 350120 mW
2025/07/27 00:34:45.355, 0, 0.35 kW
2025/07/27 00:34:45.455, 0, 351
""",
    )
    table, _ = import_trace("nvidia-smi", [log])
    assert powers(table) == pytest.approx([350.12, 350.12, 350.0, 351.0])


def test_nvidia_smi_header_unit_is_the_default_for_bare_values(tmp_path):
    log = write(
        tmp_path / "mw.csv",
        "timestamp, index, power.draw [mW], memory.used [GiB]\n"
        "2025/07/27 00:34:45.155, 0, 350120, 2\n2025/07/27 00:34:45.255, 0, 300 W, 1024 MiB\n",
    )
    table, _ = import_trace("nvidia-smi", [log])
    d = table.to_pandas().sort_values("time")
    assert d["power_w"].tolist() == pytest.approx([350.12, 300.0])
    assert d["mem_used_mib"].tolist() == pytest.approx([2048.0, 1024.0])


def test_unknown_unit_is_an_error_naming_file_line_and_field(tmp_path):
    log = write(
        tmp_path / "u.csv",
        "timestamp, index, power.draw [W]\n2025/07/27 00:34:45.155, 0, 350 W\n2025/07/27 00:34:45.255, 0, 350 dBm\n",
    )
    with pytest.raises(InputError, match=r"u\.csv:3: field 'power.draw': cannot read '350 dBm': unknown unit 'dBm'"):
        import_trace("nvidia-smi", [log])
    table, meta = import_trace("nvidia-smi", [log], skip_bad_lines=True)
    assert len(table) == 1 and meta["skipped_lines"] == {"power.draw": 1}


def test_zeus_values_with_their_own_unit_override_the_column_unit(tmp_path):
    log = write(tmp_path / "z.csv", "time,gpu0 (mW)\n1753576485.0,32402\n1753576485.1,32.5 W\n1753576485.2,32402 mW\n")
    table, _ = import_trace("zeus", [log])
    assert powers(table) == pytest.approx([32.402, 32.5, 32.402])


def test_zeus_milliwatt_column_and_watt_column_in_one_file(tmp_path):
    log = write(tmp_path / "z.csv", "time,gpu0 (mW),gpu1\n1753576485.0,300000,300\n")
    assert powers(import_trace("zeus", [log])[0]) == pytest.approx([300.0, 300.0])


DCGM = 'DCGM_FI_DEV_{m}{{gpu="{g}",Hostname="n"}} {v} {ts}\n'


def test_dcgm_nan_inf_and_negative_become_null_and_are_counted(tmp_path):
    ts = 1753576485000
    text = "".join(
        [
            DCGM.format(m="POWER_USAGE", g=0, v="412.5", ts=ts),
            DCGM.format(m="POWER_USAGE", g=0, v="+Inf", ts=ts + 100),
            DCGM.format(m="POWER_USAGE", g=0, v="NaN", ts=ts + 200),
            DCGM.format(m="POWER_USAGE", g=0, v="-5", ts=ts + 300),
            DCGM.format(m="POWER_USAGE", g=0, v="1e40", ts=ts + 400),  # overflows float32
            DCGM.format(m="TOTAL_ENERGY_CONSUMPTION", g=0, v="-Inf", ts=ts),
        ]
    )
    log = write(tmp_path / "d.prom", text)
    table, meta = import_trace("dcgm", [log])
    p = powers(table)
    assert p[0] == pytest.approx(412.5) and all(v is None or math.isnan(v) for v in p[1:])
    assert table.column("power_w").null_count == 4 and table.column("energy_j").null_count == 5
    assert meta["invalid_values"] == {"energy_j": 1, "power_w": 4}
    out = tmp_path / "t.parquet"
    write_trace(table, out)
    assert trace_meta(read_trace(out)).invalid_values == {"energy_j": 1, "power_w": 4}


def test_nvidia_smi_negative_power_is_null_and_counted(tmp_path):
    log = write(
        tmp_path / "n.csv",
        "timestamp, index, power.draw [W]\n2025/07/27 00:34:45.155, 0, -1 W\n2025/07/27 00:34:45.255, 0, 80 W\n",
    )
    table, meta = import_trace("nvidia-smi", [log])
    assert table.column("power_w").null_count == 1 and meta["invalid_values"] == {"power_w": 1}


def foreign_trace(path, power, time=None):
    n = len(power)
    cols = {name: pa.nulls(n, typ) for name, typ in zip(TRACE_SCHEMA.names, TRACE_SCHEMA.types)}
    cols["time"] = pa.array(time if time is not None else [1753576485.0 + i for i in range(n)])
    cols["host"] = pa.array(["h"] * n)
    cols["gpu"] = pa.array([0] * n, pa.int32())
    cols["power_w"] = pa.array(power, pa.float32())
    cols["util_gpu"] = pa.array([50.0] * n, pa.float32())
    pq.write_table(pa.table(cols), path)
    return path


def test_read_trace_nulls_and_counts_non_finite_and_negative_power(tmp_path):
    path = foreign_trace(tmp_path / "f.parquet", [100.0, float("inf"), float("nan"), -3.0, 200.0])
    t = read_trace(path)
    assert t.column("power_w").to_pylist() == [100.0, None, None, None, 200.0]
    assert trace_meta(t).invalid_values == {"power_w": 3}


def test_read_trace_uncastable_time_column_is_one_line_error(tmp_path):
    path = foreign_trace(tmp_path / "s.parquet", [100.0, 101.0], time=["2025-07-27 00:34:45", "later"])
    with pytest.raises(InputError, match=r"s\.parquet: column 'time'.*unix seconds"):
        read_trace(path)


def test_zeus_non_finite_time_is_a_bad_line(tmp_path):
    log = write(tmp_path / "z.csv", "time,gpu0\n1753576485.0,300\nnan,301\ninf,302\n")
    with pytest.raises(InputError, match=r"z\.csv:3: field 'time'"):
        import_trace("zeus", [log])


def test_schema_meta_is_strict_json():
    schema = schema_with_meta({"x": float("nan"), "y": [float("inf"), 1.0]})
    raw = schema.metadata[b"wattgate.trace"].decode()
    assert json.loads(raw, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}")) == {
        "x": None,
        "y": [None, 1.0],
    }


def test_triage_json_never_holds_infinity(tmp_path):
    from wattgate.power.triage import run_triage
    from wattgate.triage_tables import TriageSettings

    n = 120
    path = foreign_trace(tmp_path / "f.parquet", [float("inf") if i % 7 == 0 else 600.0 for i in range(n)])
    result = run_triage([path], tmp_path / "out", settings=TriageSettings(gpu_model="H100")).to_json()
    text = (tmp_path / "out" / "triage.json").read_text()
    json.loads(text, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c} in triage.json"))
    assert result["phases"]


def test_triage_json_backstop_for_non_finite_values_from_any_source(tmp_path, monkeypatch):
    """Even if a non-finite float reaches the result by another path, triage.json stays strict JSON (null)."""
    from wattgate.power.triage import stage as triage_mod
    from wattgate.triage_tables import TriageSettings

    path = foreign_trace(tmp_path / "f.parquet", [600.0] * 30)
    real = triage_mod.totals
    monkeypatch.setattr(triage_mod, "totals", lambda s: {k: dict(v, energy_j=float("inf")) for k, v in real(s).items()})
    triage_mod.run_triage([path], tmp_path / "out", settings=TriageSettings(gpu_model="H100"))
    data = json.loads(
        (tmp_path / "out" / "triage.json").read_text(),
        parse_constant=lambda c: pytest.fail(f"non-JSON constant {c} in triage.json"),
    )
    assert all(v["energy_j"] is None for v in data["phases"].values())


def test_unknown_header_unit_is_an_error_naming_the_header_line(tmp_path):
    log = write(tmp_path / "h.csv", "timestamp, index, power.draw [dBm]\n2025/07/27 00:34:45.155, 0, 350\n")
    with pytest.raises(InputError, match=r"h\.csv:1: column 'power.draw': unknown unit 'dBm'"):
        import_trace("nvidia-smi", [log])


def test_null_invalid_values_works_on_a_column_subset():
    from wattgate.trace import null_invalid_values

    t = pa.table({"time": [1.0, 2.0, 3.0], "power_w": pa.array([1.0, float("inf"), -1.0], pa.float32())})
    out, counts = null_invalid_values(t)
    assert out.column("power_w").to_pylist() == [1.0, None, None] and counts == {"power_w": 2}
