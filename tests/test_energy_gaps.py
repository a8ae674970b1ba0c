"""Gaps in the energy (issue 25, section 3): energy is integrated over sampled time only, the gap is reported,
and GPU-hours leave it out. The issue's case: 10 s at 100 W, a 1 h hole, then 30 s at 300 W."""

import json

import numpy as np
import pytest

from wattgate.power import energy as E
from wattgate.power.triage import run_triage
from wattgate.report import ReportSources, run_report
from wattgate.triage_tables import TriageSettings
from wattgate.trace import TraceWriter

T0 = 1753576485.0
J_PER_KWH = 3.6e6
EXPECTED_KWH = (10 * 100 + 30 * 300) / J_PER_KWH  # 0.00278


def _times(hz=10):
    first = T0 + np.arange(0, 10 * hz + 1) / hz
    second = T0 + 10 + 3600 + np.arange(0, 30 * hz + 1) / hz
    return first, second


def _trace(path, with_counter=False):
    first, second = _times()
    writer = TraceWriter(path, {"host": "h", "interval_s": 0.1})
    energy = 0.0
    last = None
    for t, p in [(t, 100.0) for t in first] + [(t, 300.0) for t in second]:
        energy += 0.0 if last is None else (t - last[0]) * (p + last[1]) / 2
        last = (t, p)
        writer.add({"time": t, "host": "h", "gpu": 0, "power_w": p, "util_gpu": 100.0, "energy_j": energy})
    writer.close()
    return path


def test_the_integral_skips_the_hole_and_says_how_long_it_was():
    first, second = _times()
    t = np.concatenate([first, second])
    p = np.concatenate([np.full(len(first), 100.0), np.full(len(second), 300.0)])
    whole = E.join_segments(E.summarize_segments(np.zeros(len(t), np.int64), t, p, None), 1)
    assert whole.integrated_j[0] / J_PER_KWH == pytest.approx(EXPECTED_KWH, rel=1e-9)  # before: 0.2022
    assert whole.gap_s[0] == pytest.approx(3600.0) and whole.sampled_s[0] == pytest.approx(40.0)
    k = len(first) + 5  # the same rows read in two chunks, the hole between them or inside one
    for cut in (len(first), k):
        parts = [
            E.summarize_segments(np.zeros(n, np.int64), tt, pp, None)
            for tt, pp, n in ((t[:cut], p[:cut], cut), (t[cut:], p[cut:], len(t) - cut))
        ]
        joined = E.join_segments(E.concat_segments(parts), 1)
        assert joined.integrated_j[0] == pytest.approx(whole.integrated_j[0], rel=1e-12)
        assert joined.gap_s[0] == pytest.approx(3600.0)


def test_jitter_and_a_slow_sampler_are_no_gap():
    t = T0 + np.cumsum(np.r_[0, np.full(99, 30.0)])  # a DCGM scrape every 30 s
    t[50:] += 25.0  # one scrape late by most of an interval
    seg = E.summarize_segments(np.zeros(100, np.int64), t, np.full(100, 200.0), None)
    joined = E.join_segments(seg, 1)
    assert joined.gap_s[0] == 0 and joined.integrated_j[0] == pytest.approx(200.0 * (t[-1] - t[0]))


@pytest.mark.parametrize("via_triage", [False, True])
def test_the_report_headline_and_gpu_hours_count_only_sampled_time(tmp_path, via_triage):
    trace = _trace(tmp_path / "h.parquet")
    power = None
    if via_triage:
        power = tmp_path / "power"
        run_triage([trace], power, settings=TriageSettings(gpu_model="H100"))
        record = json.loads((power / "triage.json").read_text())["energy"]["h:0"]
        assert record["gap_s"] == pytest.approx(3600.0)
    s = run_report(
        None, tmp_path / "report", ReportSources(power_dir=power, trace_paths=[trace], gpu_model="H100")
    ).to_json()
    e = s["energy"]
    assert e["kwh"] == pytest.approx(EXPECTED_KWH, rel=1e-3) and e["gap_s"] == pytest.approx(3600.0)  # before: 0.2022
    assert s["gpu_hours"] == pytest.approx(40.0 / 3600, rel=1e-3)  # before: 1.011 h, the hole counted
    assert e["per_gpu"][0]["mean_power_w"] == pytest.approx(EXPECTED_KWH * J_PER_KWH / 40.0, rel=1e-3)
    phases_kwh = sum(v["energy_kwh"] or 0.0 for v in s["phases"]["by_phase"].values())
    assert phases_kwh == pytest.approx(e["kwh"], rel=0.05)  # the headline agrees with its own phases
    assert "of gaps between samples are counted nowhere" in (tmp_path / "report" / "index.html").read_text()


def test_a_counter_across_the_hole_falls_back_to_the_integral(tmp_path):
    first, second = _times()
    t = np.concatenate([first, second])
    p = np.concatenate([np.full(len(first), 100.0), np.full(len(second), 300.0)])
    e = np.full(len(t), np.nan)
    e[0], e[-1] = 0.0, 0.2022 * J_PER_KWH  # the counter ran on through the hour nobody sampled
    joined = E.join_segments(E.summarize_segments(np.zeros(len(t), np.int64), t, p, e), 1)
    assert np.isnan(joined.counter_j[0]) and joined.methods == [E.INTEGRATED]
    e[-1] = np.nan
    e[len(first) - 1] = 1000.0  # both readings before the hole: the counter is used
    joined = E.join_segments(E.summarize_segments(np.zeros(len(t), np.int64), t, p, e), 1)
    assert not np.isnan(joined.counter_j[0])
