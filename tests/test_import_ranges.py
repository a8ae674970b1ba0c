"""Imported traces in range (issue 25, section 3): times and GPU indexes no log can hold are rejected at
import with file:line, and triage never allocates windows for a span nobody sampled."""

import numpy as np
import pyarrow as pa
import pytest

from wattgate.errors import InputError
from wattgate.power.importers import import_trace
from wattgate.triage_tables import shipped_table
from wattgate.power.triage import triage

T0 = 1753576485.0
COLUMNS = "time=time,gpu=gpu,power_w=power"


def _csv(tmp_path, rows, name="node1.csv"):
    log = tmp_path / name
    log.write_text("time,gpu,power\n" + "".join(f"{t},{g},{p}\n" for t, g, p in rows))
    return log


def _normal(n=20):
    return [(T0 + i, 0, 300.0) for i in range(n)]


@pytest.mark.parametrize(
    "bad, why",
    [
        ((0, 0, 300.0), r"time 0 \(1970-01-01T00:00:00\+00:00\) is 20296 days from the file's other samples"),
        ((-1e12, 0, 300.0), r"time -1000000000000 \(no date\) is before 1970"),
        ((T0 + 400 * 86400 * 365, 0, 300.0), r"time 14367976485 \(2425-04-21T00:34:45\+00:00\) is in the future"),
        ((T0 + 5, -1, 300.0), r"GPU index -1 is outside 0\.\.1023"),
        ((T0 + 5, 4000000000, 300.0), r"GPU index 4000000000 is outside 0\.\.1023"),
    ],
)
def test_a_wild_time_or_gpu_index_is_rejected_with_file_line(tmp_path, bad, why):
    rows = _normal()
    rows.insert(7, bad)
    log = _csv(tmp_path, rows)
    with pytest.raises(InputError, match=rf"node1\.csv:9: {why}.*--skip-bad-lines"):
        import_trace("csv", [log], columns=COLUMNS)
    table, meta = import_trace("csv", [log], columns=COLUMNS, skip_bad_lines=True)
    assert table.num_rows == 20 and sum(meta["skipped_lines"].values()) == 1
    assert table.column("time").to_numpy().min() >= T0


def test_every_importer_checks_times(tmp_path):
    smi = tmp_path / "smi.csv"
    smi.write_text(
        "timestamp, index, power.draw [W]\n"
        + "".join(f"2025/07/27 00:34:{s:02d}.155, 0, 70 W\n" for s in range(10))
        + "1971/01/01 00:00:00.000, 0, 70 W\n"
    )
    with pytest.raises(InputError, match=r"smi\.csv:12: time .* days from the file's other samples"):
        import_trace("nvidia-smi", [smi])
    zeus = tmp_path / "zeus.csv"
    zeus.write_text("time,gpu0\n" + "".join(f"{T0 + i},70\n" for i in range(10)) + "0,70\n")
    with pytest.raises(InputError, match=r"zeus\.csv:12: time 0 "):
        import_trace("zeus", [zeus])
    dcgm = tmp_path / "dcgm.prom"
    dcgm.write_text(
        "".join(f'DCGM_FI_DEV_POWER_USAGE{{gpu="0"}} 70 {int((T0 + i) * 1000)}\n' for i in range(10))
        + 'DCGM_FI_DEV_POWER_USAGE{gpu="0"} 70 5\n'
    )
    with pytest.raises(InputError, match=r"dcgm\.prom:11: time 0\.005 "):
        import_trace("dcgm", [dcgm])


def test_times_from_a_logs_own_start_and_a_long_gap_are_fine(tmp_path):
    relative = _csv(tmp_path, [(i * 0.5, 0, 300.0) for i in range(20)], "rel.csv")
    assert import_trace("csv", [relative], columns=COLUMNS)[0].num_rows == 20
    gap = _normal(10) + [(T0 + 3 * 86400 + i, 0, 300.0) for i in range(10)]  # a sampler off for 3 days
    assert import_trace("csv", [_csv(tmp_path, gap, "gap.csv")], columns=COLUMNS)[0].num_rows == 20


def test_triage_refuses_a_span_nobody_sampled_instead_of_allocating_it():
    """Before: one sample at time 0 among today's made triage allocate ~1.75e9 windows (13 GiB)."""
    n = 50
    trace = pa.table(
        {
            "time": np.concatenate([[0.0], T0 + np.arange(n)]),
            "host": ["h"] * (n + 1),
            "gpu": np.zeros(n + 1, np.int32),
            "power_w": np.full(n + 1, 300.0, np.float32),
            "util_gpu": np.full(n + 1, 100.0, np.float32),
        }
    )
    with pytest.raises(InputError, match=r"GPU h:0 has samples from 0 s to .* but only \d+ of those \d+ windows"):
        triage(trace, shipped_table("H100"), 1.0, 60.0)
    assert triage(trace.slice(1), shipped_table("H100"), 1.0, 60.0).num_rows == n


def test_a_gpu_index_beyond_any_float_is_a_bad_line_not_a_traceback(tmp_path):
    log = _csv(tmp_path, _normal(5) + [(T0 + 9, "1e400", 300.0)])
    with pytest.raises(InputError, match=r"node1\.csv:7: field 'gpu': cannot read '1e400': not a GPU index"):
        import_trace("csv", [log], columns=COLUMNS)
