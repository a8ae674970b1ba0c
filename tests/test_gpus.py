"""wattgate/gpus.py: one table of GPU facts, one name normalisation; the copies it keeps must not drift."""

import pytest

from wattgate.gpus import GPUS, SHIPPED, is_cpu, memory_gib, model_key, peak_bf16_flops, triage_table_name
from wattgate.triage_tables import shipped_table


@pytest.mark.parametrize("key", sorted(GPUS))
def test_each_row_agrees_with_its_shipped_triage_table(key):
    row = GPUS[key]
    assert row.triage_table in SHIPPED
    table = shipped_table(row.triage_table)
    assert (table.tdp_w, table.idle_w) == (row.power_cap_w, row.idle_w)


@pytest.mark.parametrize(
    "name, key",
    [
        ("H100", "h100"),
        ("h100", "h100"),
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("A100-80GB", "a100"),
        ("a100-40gb", "a100"),
        ("B300", "b300"),
    ],
)
def test_one_normalisation_for_every_spelling(name, key):
    assert model_key(name) == key and triage_table_name(name) == key and peak_bf16_flops(name) > 0


def test_memory_by_spelling_and_cpu_has_no_row():
    assert [memory_gib(n)[0] for n in ("A100-80GB", "A100-40GB", "a100-40gb", "A100")] == [80, 40, 40, 80]
    assert memory_gib("H200")[0] == 141 and memory_gib("B300")[0] == 288
    assert is_cpu("cpu") and is_cpu("CPU") and memory_gib("cpu") is None and peak_bf16_flops("cpu") is None
    assert memory_gib("V100") is None and triage_table_name("V100") is None
