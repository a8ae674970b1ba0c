"""Clocks-event reasons in the trace (issue 34): the sampler reads them (under the current NVML name, else the
older throttle name, else not at all), the DCGM, nvidia-smi and CSV importers read them when a log has them,
and traces written before the column keep working."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from wattgate.errors import InputError
from wattgate.power.importers import import_trace
from wattgate.telemetry.nvml import NvmlSource
from wattgate.telemetry.sampler import StopFlag, sample_loop
from wattgate.testing.fake_nvml import FakeNvml
from wattgate.trace import REASONS, TRACE_SCHEMA, TraceWriter, read_trace, read_trace_chunks


@pytest.mark.parametrize("driver", ["event", "throttle"])
def test_the_sampler_records_the_reasons_on_its_slow_path(tmp_path, driver):
    nvml = FakeNvml(2, reasons=driver, reason_bits=0x24)
    source = NvmlSource(nvml=nvml, slow_every_s=3600.0)  # one slow read, then the readings are held
    writer = TraceWriter(tmp_path / "t.parquet", source.meta(0.01))
    sample_loop(source, writer, 0.001, StopFlag(), max_samples=5)
    writer.close()
    table = read_trace(tmp_path / "t.parquet")
    assert table.column(REASONS).to_pylist() == [0x24] * 10  # 2 GPUs x 5 ticks, held between slow reads
    assert nvml.calls["clocks_event_reasons"] == 2 + 2  # once per GPU when opened, once per GPU on the slow read
    assert all(g["clocks_event_reasons"] for g in source.meta(0.1)["gpus"])


def test_a_driver_without_the_reasons_call_and_reasons_off_leave_the_column_null(tmp_path):
    for source in (NvmlSource(nvml=FakeNvml(1, reasons=None)), NvmlSource(nvml=FakeNvml(1), reasons=False)):
        rows = source.read()
        assert REASONS not in rows[0] and rows[0]["sm_clock_mhz"] == 1980.0
        assert source.meta(0.1)["gpus"][0]["clocks_event_reasons"] is False


def test_a_trace_without_the_column_reads_it_as_null(tmp_path):
    """A sampler from before issue 34 wrote no reasons column: every reader gives it back null."""
    old = pa.schema([f for f in TRACE_SCHEMA if f.name != REASONS])
    rows = {f.name: pa.nulls(3, f.type) for f in old}
    rows.update(
        time=pa.array([1.7e9, 1.7e9 + 0.1, 1.7e9 + 0.2]), host=pa.array(["h"] * 3), gpu=pa.array([0] * 3, pa.int32())
    )
    rows["power_w"] = pa.array([100.0, 110.0, 120.0], pa.float32())
    path = tmp_path / "old.parquet"
    pq.write_table(pa.table(rows, schema=old), path)
    assert read_trace(path).column(REASONS).null_count == 3
    assert read_trace(path, columns=["time", REASONS]).column(REASONS).null_count == 3
    _, batches = read_trace_chunks(path, ["time", "power_w", REASONS], 2)
    assert [b.column(REASONS).null_count for b in batches] == [2, 1]


def test_nvidia_smi_reads_the_active_mask_and_the_one_reason_columns(tmp_path):
    mask = tmp_path / "mask.csv"
    mask.write_text(
        "timestamp, index, power.draw [W], clocks.sm [MHz], clocks_event_reasons.active\n"
        "2025/07/27 00:34:45.100, 0, 650.0 W, 1410 MHz, 0x0000000000000024\n"
        "2025/07/27 00:34:45.200, 0, 651.0 W, 1980 MHz, 0x0000000000000000\n"
        "2025/07/27 00:34:45.300, 0, 652.0 W, 1980 MHz, [N/A]\n"
    )
    table, _ = import_trace("nvidia-smi", [mask])
    assert table.column(REASONS).to_pylist() == [0x24, 0, None]
    assert table.column("sm_clock_mhz").to_pylist() == [1410.0, 1980.0, 1980.0]
    flags = tmp_path / "flags.csv"
    flags.write_text(
        "timestamp, index, power.draw [W], clocks_throttle_reasons.sw_power_cap, "
        "clocks_throttle_reasons.hw_slowdown, clocks_throttle_reasons.hw_thermal_slowdown\n"
        "2025/07/27 00:34:45.100, 0, 650.0 W, Active, Not Active, Not Active\n"
        "2025/07/27 00:34:45.200, 0, 651.0 W, Not Active, Active, Active\n"
        "2025/07/27 00:34:45.300, 0, 652.0 W, [N/A], [N/A], [N/A]\n"
    )
    table, meta = import_trace("nvidia-smi", [flags])
    assert table.column(REASONS).to_pylist() == [0x4, 0x8 | 0x40, None]
    assert not any("ignored columns" in n for n in meta["notes"])
    bad = tmp_path / "bad.csv"
    bad.write_text(flags.read_text().replace("Not Active, Active, Active", "Not Active, maybe, Active"))
    with pytest.raises(InputError, match=r"bad.csv:3: .*clocks_throttle_reasons.hw_slowdown.*Active or Not Active"):
        import_trace("nvidia-smi", [bad])


def test_dcgm_reads_the_reasons_under_both_field_names(tmp_path):
    log = tmp_path / "dcgm.txt"
    log.write_text(
        'DCGM_FI_DEV_POWER_USAGE{gpu="0",Hostname="n1"} 650.0 1753576485100\n'
        'DCGM_FI_DEV_CLOCKS_EVENT_REASONS{gpu="0",Hostname="n1"} 32 1753576485100\n'
        'DCGM_FI_DEV_POWER_USAGE{gpu="1",Hostname="n1"} 640.0 1753576485100\n'
        'DCGM_FI_DEV_CLOCK_THROTTLE_REASONS{gpu="1",Hostname="n1"} 4 1753576485100\n'
        'DCGM_FI_DEV_POWER_USAGE{gpu="2",Hostname="n1"} 630.0 1753576485100\n'
        'DCGM_FI_DEV_CLOCKS_EVENT_REASONS{gpu="2",Hostname="n1"} -1 1753576485100\n'
    )
    table, meta = import_trace("dcgm", [log])
    assert table.column(REASONS).to_pylist() == [32, 4, None]
    assert meta["invalid_values"] == {REASONS: 1}  # a negative bitmask is no reading: nulled and counted


def test_any_csv_maps_a_reasons_column_in_hex_or_decimal(tmp_path):
    log = tmp_path / "log.csv"
    log.write_text("ts,gpu,watts,reasons\n1753576485.1,0,650,0x20\n1753576485.2,0,651,4\n1753576485.3,0,652,\n")
    table, _ = import_trace("csv", [log], columns="time=ts,gpu=gpu,power_w=watts,clocks_event_reasons=reasons")
    assert table.column(REASONS).to_pylist() == [0x20, 4, None]
