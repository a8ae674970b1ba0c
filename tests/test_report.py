"""`wattgate report`: summary.json numbers, the self-contained page, anomalies, determinism and bad inputs.

Real data: the H200 training run in tests/data/h200/train (one GPU, energy counter on every sample).
Synthetic: wattgate.testing.synthetic_trace jobs for hangs, hand-written metrics for stragglers and data starvation,
and an empty trace (what the sampler writes without NVML) for the CPU default.
"""

import html
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import plotly.graph_objects as go
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from real_traces import H200_DATA

from wattgate.durations import duration
from wattgate.cli import main
from wattgate.testing.synthetic_trace import T0, build_trace, gpus_of, job, write_run_info
from wattgate.errors import InputError
from wattgate.triage_tables import TriageSettings, shipped_table
from wattgate.power.triage import LABELS, run_triage
from wattgate.report import ReportSources, run_report
from wattgate.power.energy import gpu_energy
from wattgate.report.binning import MAX_POINTS, bin_edges, bin_majority
from wattgate.report.figures import POWER_BINS
from wattgate.report.plotly_page import spec_json
from wattgate.report.plot_spec import values
from wattgate.report.inputs import default_power_dir, read_samples
from wattgate.report.phases import PHASE_COLORS
from wattgate.trace import TRACE_SCHEMA, TraceWriter, trace_files
from wattgate.run_tables import METRICS_SCHEMA

TRAIN = H200_DATA / "train"
SECTIONS = (
    "Phase breakdown",
    "Energy",
    "Step time and data wait over time",
    "Loss",
    "Anomalies",
    "Invariant gate",
    "Memory: measured and estimated",
    "Watcher diagnosis",
    "Inputs",
)


FIGURE = re.compile(
    r'<div class="figure" id="figure-(?P<name>[\w-]+)" data-figure="(?P=name)" role="img" aria-label="(?P<alt>[^"]*)">'
    r'</div><script type="application/json" id="figure-(?P=name)-data">(?P<json>[^<]*)</script>'
)
BUNDLE = re.compile(r'<script type="application/octet-stream" id="plotly-js-gz">[A-Za-z0-9+/=]+</script>')


def figure_matches(page: str) -> list[re.Match]:
    return list(FIGURE.finditer(page))


def figures(page: str) -> list[dict]:
    """Every figure's Plotly spec, its aria-label as "alt": each one checked by plotly.py against the schema."""
    out = []
    for m in figure_matches(page):
        spec = json.loads(m["json"])
        go.Figure(spec)  # raises on a property or value Plotly does not know
        out.append(dict(spec, alt=m["alt"], name=m["name"]))
    return out


def without_figures(page: str) -> str:
    """The page's text without the figures' JSON and the embedded plotly.js."""
    return BUNDLE.sub("<script/>", FIGURE.sub("<div/>", page))


def row_axes(fig: dict) -> dict[str, str]:
    """The stacked figures' rows: the y axis of each named row (a name above it), top to bottom."""
    layout = fig["layout"]
    tops = {round(v["domain"][1], 5): k for k, v in layout.items() if k.startswith("yaxis") and "domain" in v}
    rows = sorted(layout["annotations"], key=lambda a: -a["y"])
    return {html.unescape(a["text"]): tops[round(a["y"], 5)] for a in rows if a["yref"] == "paper"}


def lanes(power: dict) -> list[str]:
    """The power figure's GPU rows (those with a watt axis), top to bottom."""
    return [label for label, axis in row_axes(power).items() if power["layout"][axis].get("title") == {"text": "W"}]


def trace_axis(trace: dict) -> str:
    """The layout key of a trace's y axis."""
    ref = trace.get("yaxis", "y")
    return "yaxis" + ref[1:]


def colours(fig: dict) -> set[str]:
    found = set()
    for item in fig["data"] + fig["layout"].get("shapes", []):
        for part in (item, item.get("line", {}), item.get("marker", {})):
            found |= {part[k] for k in ("color", "fillcolor") if isinstance(part.get(k), str)}
    return found


def write_metrics(run, ranks=2, steps=20, step_s=1.0, t0=T0, slow=None, starved=(), loss=None):
    """metrics.parquet rows per (step, rank); `slow`: {rank: factor} on its compute time;
    `starved`: steps whose data wait is half the step."""
    rows = []
    for step in range(1, steps + 1):
        for r in range(ranks):
            wait = 0.5 * step_s if step in starved else 0.01 * step_s
            compute = (step_s - 0.01 * step_s) * (slow or {}).get(r, 1.0)
            rows.append(
                {
                    "step": step,
                    "rank": r,
                    "epoch": 0,
                    "loss": (loss or 5.0) / step**0.3,
                    "tokens": 1000,
                    "loss_tokens": 500,
                    "step_time_s": compute + wait,
                    "data_wait_s": wait,
                    "lr": 1e-4,
                    "time": t0 + step * step_s * 2,
                }
            )
    run.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=METRICS_SCHEMA), run / "metrics.parquet")
    return rows


def write_heartbeats(run, ranks=2, t0=T0, checkpoint_at=(10.0, 14.0), host="cpu-host"):
    beat = run / "heartbeat"
    beat.mkdir(parents=True, exist_ok=True)
    for r in range(ranks):
        events = [
            (t0, "init"),
            (t0 + 1, "train"),
            (t0 + checkpoint_at[0], "checkpoint"),
            (t0 + checkpoint_at[1], "train"),
            (t0 + 41, "export"),
            (t0 + 42, "done"),
        ]
        (beat / f"rank-{r}.events.jsonl").write_text(
            "".join(json.dumps({"time": t, "rank": r, "step": 0, "epoch": 0, "phase": ph}) + "\n" for t, ph in events)
        )
        (beat / f"rank-{r}.json").write_text(
            json.dumps(
                {
                    "rank": r,
                    "local_rank": r,
                    "gpu": None,
                    "host": host,
                    "step": 20,
                    "epoch": 0,
                    "phase": "done",
                    "time": t0 + 42,
                }
            )
        )


@pytest.fixture(scope="module")
def h200(tmp_path_factory):
    """The H200 run reported twice: with run_triage's output, and with triage run in process."""
    tmp = tmp_path_factory.mktemp("h200")
    power = tmp / "power"
    run_triage(trace_files(TRAIN / "telemetry"), power, run_dir=TRAIN)
    with_power = run_report(TRAIN, tmp / "with-power", ReportSources(power_dir=power)).to_json()
    in_process = run_report(TRAIN, tmp / "in-process").to_json()
    return tmp, with_power, in_process


@pytest.fixture
def cpu_run(tmp_path):
    """The embedded CPU default's shape: an empty trace (no NVML), metrics, heartbeats, TRAINED, watcher."""
    run = tmp_path / "results" / "train" / "demo"
    TraceWriter(
        run / "telemetry" / "cpu-host.parquet", {"nvml": "NVML unavailable: no driver", "interval_s": 0.1}
    ).close()
    write_metrics(run)
    write_heartbeats(run)
    (run / "TRAINED").write_text(
        json.dumps(
            {
                "device": "cpu",
                "world_size": 2,
                "steps": 20,
                "wall_s": 40.0,
                "tokens_per_s": 1000.0,
                "first_loss": 5.0,
                "final_loss": 2.0,
            }
        )
    )
    (run / "watcher.json").write_text(json.dumps({"verdict": "healthy", "longest_stall_s": 3.0}))
    gate = tmp_path / "results" / "gate" / "demo"
    gate.mkdir(parents=True)
    (gate / "gate.json").write_text(
        json.dumps(
            {
                "passed": True,
                "enforce": True,
                "elapsed_s": 0.1,
                "checks": [{"name": "equal_steps", "passed": True, "detail": "20 steps on every rank"}],
            }
        )
    )
    return run


# ---------------------------------------------------------------- the real H200 run


def test_h200_summary_numbers(h200):
    tmp, s, _ = h200
    metrics = pq.read_table(TRAIN / "metrics.parquet").to_pandas()
    trained = json.loads((TRAIN / "TRAINED").read_text())
    assert s["tokens"] == int(metrics["tokens"].sum())
    assert s["steps"] == 106 and s["world_size"] == 1 and s["gpus"] == 1
    assert s["wall_s"] == pytest.approx(trained["wall_s"], abs=1e-3)
    assert s["tokens_per_s_per_gpu"] == pytest.approx(trained["tokens_per_s"], rel=1e-6)
    assert s["loss"] == {"first": pytest.approx(trained["first_loss"]), "final": pytest.approx(trained["final_loss"])}
    e = s["energy"]
    assert e["method"] == "energy_counter" and e["kwh"] > 0
    assert e["j_per_token"] == pytest.approx(e["kwh"] * 3.6e6 / s["tokens"], rel=1e-4)
    assert s["gpu_hours"] == pytest.approx(60.2 / 3600, rel=0.01)
    by = s["phases"]["by_phase"]
    assert sum(v["time_share"] for v in by.values()) == pytest.approx(1.0, abs=1e-5)
    assert sum(v["energy_share"] for v in by.values()) == pytest.approx(1.0, abs=1e-5)
    assert {"compute", "checkpoint", "idle"} <= set(by)
    assert by["compute"]["energy_share"] > by["compute"]["time_share"]  # compute draws the most power
    assert s["phases"]["source"].endswith("phases.parquet")
    assert s["watcher"]["verdict"] == "healthy" and s["anomalies"] == []
    assert s["signals"]["energy_counter"] and s["signals"]["heartbeats"] and not s["signals"]["gate"]


def test_h200_energy_counter_and_integration_agree(h200):
    _, s, _ = h200
    e = s["energy"]
    assert e["counter_kwh"] == pytest.approx(e["integrated_kwh"], rel=0.02)
    # the integral, straight from the file
    t = pq.read_table(TRAIN / "telemetry" / "vm.parquet", columns=["time", "power_w"]).to_pandas()
    t = t.sort_values("time")
    joules = np.sum(np.diff(t["time"]) * (t["power_w"].to_numpy()[1:] + t["power_w"].to_numpy()[:-1]) / 2)
    assert e["integrated_kwh"] == pytest.approx(joules / 3.6e6, rel=1e-3)


def test_h200_in_process_triage_gives_the_same_phases(h200):
    _, with_power, in_process = h200
    assert in_process["phases"]["source"].startswith("in-process triage (H200 table")
    assert {p: v["time_share"] for p, v in in_process["phases"]["by_phase"].items()} == {
        p: v["time_share"] for p, v in with_power["phases"]["by_phase"].items()
    }
    assert in_process["energy"] == with_power["energy"]


def test_h200_page_is_self_contained_with_every_section(h200):
    tmp, _, _ = h200
    page = (tmp / "with-power" / "index.html").read_text()
    text = without_figures(page)
    for title in ("Power per GPU over time",) + SECTIONS:
        assert f">{title}</h2>" in text, title
    assert "No GPU telemetry on this host" not in text
    power, shares, steps, loss = figures(page)
    assert [f["alt"] for f in (power, shares, steps, loss)] == [
        "power per GPU over time",
        "phase shares per GPU",
        "Step time and data wait over time",
        "Loss",
    ]
    assert lanes(power) == ["vm:0"] and power["layout"]["yaxis2"]["title"] == {"text": "W"}
    phases = {PHASE_COLORS[p] for p in ("compute", "checkpoint", "idle")}
    assert phases <= colours(power) and phases <= colours(shares)
    assert [t["name"] for t in steps["data"]] == ["step time (slowest rank)", "data wait (mean over ranks)"]
    assert [t["name"] for t in loss["data"]] == ["training"]
    assert not re.search(r"https?://|src=|href=|url\(|<img", page)  # nothing to fetch
    assert len(BUNDLE.findall(page)) == 1 and "DecompressionStream('gzip')" in text  # plotly.js once, packed
    assert "data-figures-rendered" in text and "<script>" in text


def test_report_is_deterministic(h200, tmp_path):
    tmp, _, _ = h200
    run_report(TRAIN, tmp_path / "again")
    for name in ("summary.json", "index.html"):
        assert (tmp_path / "again" / name).read_bytes() == (tmp / "in-process" / name).read_bytes(), name
    assert not list((tmp_path / "again").glob(".*tmp"))  # atomic writes leave no temp files


def test_summary_json_reads_back_as_its_record_and_a_bad_value_is_one_line(h200, tmp_path):
    from wattgate.records.summary import Summary

    tmp, _, _ = h200
    for out in ("with-power", "in-process"):
        path = tmp / out / "summary.json"
        s = Summary.read(path, rerun="report")
        assert s.to_json() == json.loads(path.read_text()) and s.energy.method == "energy_counter"
    bad = json.loads((tmp / "in-process" / "summary.json").read_text())
    bad["energy"]["per_gpu"][0]["kwh"] = "lots"
    (tmp_path / "summary.json").write_text(json.dumps(bad))
    with pytest.raises(InputError, match=r"summary.json: 'energy.per_gpu\[0\].kwh' \(\"lots\"\) is not") as err:
        Summary.read(tmp_path / "summary.json", rerun="report")
    assert "\n" not in str(err.value)


def test_index_html_is_byte_identical_from_another_process(h200, tmp_path):
    """Nothing in the page may hang on the process: string hashing (set order) differs between the two.
    That process also shows the report draws without importing matplotlib."""
    tmp, _, _ = h200
    code = (
        f"import sys; from wattgate.report import run_report; run_report({str(TRAIN)!r}, {str(tmp_path / 'other')!r}); "
        "assert 'matplotlib' not in sys.modules, 'the report imported matplotlib'"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=300)
    assert (tmp_path / "other" / "index.html").read_bytes() == (tmp / "in-process" / "index.html").read_bytes()


def test_host_names_are_escaped_in_the_figures(tmp_path):
    run = tmp_path / "run"
    host = "n<&\"x'"
    synth = build_trace(job(gpus_of(1, 1, prefix=host), [("compute", 60), ("idle", 30)]), shipped_table("h100"), seed=2)
    synth.write(run / "telemetry")
    run_report(run, tmp_path / "out")
    page = (tmp_path / "out" / "index.html").read_text()
    power, shares = figures(page)
    assert lanes(power) == [f"{host}0:0"]  # plotly.js reads texts as HTML: it shows the name unescaped
    assert {html.unescape(y) for t in shares["data"] for y in t["y"]} == {f"{host}0:0"}
    escaped = "n&lt;&amp;&quot;x&#x27;0:0"  # as plotly.js reads it back: HTML
    assert power["layout"]["annotations"][-1]["text"] == escaped and set(shares["data"][0]["y"]) == {escaped}
    for m in figure_matches(page):  # in the page neither the name nor a tag: nothing closes the <script>
        assert host not in m["json"] and "<" not in m["json"]


def test_default_power_and_gate_dirs_beside_the_run(tmp_path):
    results = tmp_path / "results"
    run = results / "train" / "demo"
    shutil.copytree(TRAIN, run)
    assert default_power_dir(run) == results / "power" / "demo"
    run_triage(trace_files(run / "telemetry"), results / "power" / "demo", run_dir=run)
    (results / "gate" / "demo").mkdir(parents=True)
    (results / "gate" / "demo" / "gate.json").write_text(
        json.dumps(
            {
                "passed": False,
                "enforce": False,
                "checks": [
                    {"name": "balance", "passed": False, "detail": "max/mean 1.3 > 1.1"},
                    {"name": "equal_steps", "passed": True, "detail": "ok"},
                ],
            }
        )
    )
    (results / "config").mkdir()
    shutil.copy(TRAIN / "config.yaml", results / "config" / "demo.yaml")
    s = run_report(run, tmp_path / "out").to_json()
    assert s["phases"]["source"] == str(results / "power" / "demo" / "phases.parquet")
    assert s["gate"]["passed"] is False and s["gate"]["failed_checks"] == ["balance"]
    assert s["run"]["name"] == "gpu" and s["run"]["gpu_model"] == "H200"  # from results/config/demo.yaml
    page = (tmp_path / "out" / "index.html").read_text()
    assert "gate: FAILED: balance" in page and "gate.enforce was false" in page


# ---------------------------------------------------------------- no GPU telemetry (the CPU default)


def test_cpu_run_says_no_gpu_telemetry_and_keeps_every_other_section(cpu_run, tmp_path):
    s = run_report(cpu_run, tmp_path / "out").to_json()
    assert s["gpus"] == 0 and s["gpu_hours"] is None and s["energy"]["kwh"] is None
    assert s["tokens"] == 40 * 1000 and s["tokens_per_s_per_rank"] == 500.0 and s["tokens_per_s_per_gpu"] is None
    assert s["rank_hours"] == pytest.approx(2 * 40 / 3600, abs=1e-6)
    assert s["phases"]["by_phase"] == {} and s["gate"]["passed"] and s["watcher"]["verdict"] == "healthy"
    assert s["signals"]["traces"] and not s["signals"]["power"] and s["run"]["nvml"] == "NVML unavailable: no driver"
    page = (tmp_path / "out" / "index.html").read_text()
    text = without_figures(page)
    assert ">No GPU telemetry on this host</h2>" in text and "NVML unavailable: no driver" in text
    for title in SECTIONS:
        assert f">{title}</h2>" in text, title
    assert "Power per GPU over time" not in text
    assert [f["alt"] for f in figures(page)] == ["Step time and data wait over time", "Loss"]


def test_memory_measured_per_phase_beside_the_gate_estimate(cpu_run, tmp_path):
    gib = 1 << 30
    phases = {
        p: {"host_peak_gib": 1.0 + i, "host_at_start_gib": 0.5, "seconds": 2.0 * (i + 1)}
        for i, p in enumerate(("load", "steady", "export"))
    }
    trained = json.loads((cpu_run / "TRAINED").read_text())
    trained.update(
        load_s=2.0,
        export_s=6.0,
        export_dtype="bfloat16",
        memory={"per_rank": [{"rank": r, "host": "n1", "phases": phases} for r in (0, 1)], "max_over_ranks": phases},
    )
    (cpu_run / "TRAINED").write_text(json.dumps(trained))
    gate_file = cpu_run.parent.parent / "gate" / cpu_run.name / "gate.json"
    gate = json.loads(gate_file.read_text())
    estimate = {
        "terms_bytes": {"sharded_params_fp32": gib, "activations": 2 * gib},
        "total_bytes": 3 * gib,
        "usable_bytes": 10 * gib,
        "fits": True,
        "per": "rank",
    }
    gate["memory_estimate_phases"] = {
        "load": estimate,
        "steady": estimate,
        "export": estimate,
        "host_per_node": dict(estimate, per="node", total_bytes=5 * gib),
    }
    gate_file.write_text(json.dumps(gate))
    s = run_report(cpu_run, tmp_path / "out").to_json()
    rows = {r["phase"]: r for r in s["memory"]["phases"]}
    assert rows["export"]["measured_host_peak_gib"] == 3.0 and rows["export"]["seconds"] == 6.0
    assert rows["load"]["estimated_device_gib"] == 3.0 and rows["load"]["largest_term"] == "activations"
    assert s["memory"]["measured_host_per_node_gib"] == {"n1": 6.0}  # two ranks' peaks on one node
    assert s["memory"]["estimated_host_per_node_gib"] == 5.0 and s["memory"]["host_budget_gib"] == 10.0
    text = without_figures((tmp_path / "out" / "index.html").read_text())
    assert ">Memory: measured and estimated</h2>" in text and "n1 6.00 GiB" in text


def with_forecast(run, wall_s, gpu_hours, source, terms_s, trained, failure=None) -> None:
    """The run's gate.json given a forecast (and a hang's cost line), its TRAINED given `trained`'s fields."""
    gate_file = run.parent.parent / "gate" / run.name / "gate.json"
    gate = json.loads(gate_file.read_text())
    throughput = {"source": source, "detail": "3 runs" if source == "ledger" else "99 GFLOP/s"}
    gate["forecast"] = {"wall_s": wall_s, "gpu_hours": gpu_hours, "kwh": None, "throughput": throughput}
    gate["forecast"]["terms_s"] = terms_s
    if failure:
        gate["failure"] = {"line": failure}
    gate_file.write_text(json.dumps(gate))
    (run / "TRAINED").write_text(json.dumps(json.loads((run / "TRAINED").read_text()) | trained))


def test_forecast_against_actual_and_the_watcher_card_keep_what_their_records_hold(cpu_run, tmp_path):
    terms = {"steps": 80.0, "startup": 20.0}
    with_forecast(cpu_run, 100.0, 0.05, "ledger", terms, {"job_s": 120.0}, "a hang would cost 2 GPU-hours")
    watcher = {"verdict": "deadlock", "stalled_for_s": 61.5, "stuck_ranks": [1], "table": None, "detected_at": T0 + 30}
    (cpu_run / "watcher.json").write_text(json.dumps(watcher))
    s = run_report(cpu_run, tmp_path / "out").to_json()
    f = s["forecast"]
    assert f["forecast"]["source"] == "ledger" and f["forecast"]["terms_s"] == {"steps": 80.0, "startup": 20.0}
    assert f["actual"] == {"wall_s": 120.0, "gpu_hours": pytest.approx(120 * 2 / 3600, abs=1e-6), "kwh": None}
    assert f["error"] == {"wall_s": 0.2, "gpu_hours": pytest.approx(0.3333), "kwh": None}
    assert f["failure"] == "a hang would cost 2 GPU-hours"
    assert s["watcher"] == watcher  # a null table stays null, keys watcher.json lacks stay out
    text = without_figures((tmp_path / "out" / "index.html").read_text())
    assert "<td>stuck ranks</td><td>1</td>" in text and "Gate: a hang would cost 2 GPU-hours" in text


def test_a_forecast_far_off_is_called_out_with_where_the_time_went_and_tiles_agree_with_cards(cpu_run, tmp_path):
    """The job took 2.4x its forecast, the training steps most of it: one highlighted line says so; the header's job
    time is the Forecast card's actual, and a card without a value is named once instead of shown as n/a."""
    terms = {"steps_s": 20.0, "startup_s": 30.0}
    with_forecast(cpu_run, 50.0, 0.03, "host-matmul", terms, {"job_s": 120.0, "wall_s": 90.0})
    run_report(cpu_run, tmp_path / "out")
    text = without_figures((tmp_path / "out" / "index.html").read_text())
    assert '<p class="highlight">The job took 140.0% longer than the gate forecast. Most of it is the training ' in text
    assert "90.0 s measured against 20.0 s forecast (4.5x), so the throughput it assumed (host-matmul) was off" in text
    assert f"<small>job time</small><b>{duration(120.0)}</b>" in text and "<td>job time (start to export)</td>" in text
    assert "<small>GPU-hours</small>" not in text  # a CPU run: rank-hours only
    assert "Not measured in this run: " in text and "<b>n/a</b>" not in text


# ---------------------------------------------------------------- anomalies


def test_hang_at_the_end_is_an_anomaly_with_its_time(tmp_path):
    run = tmp_path / "results" / "train" / "hang"
    gpus = gpus_of(1, 2)
    synth = build_trace(
        job(gpus, [("idle", 20), ("compute", 300), ("deadlock", 200)], stuck=1), shipped_table("h100"), seed=3
    )
    synth.write(run / "telemetry")
    write_run_info(run, synth)
    hang_start = T0 + 320
    (run / "watcher.json").write_text(
        json.dumps(
            {
                "verdict": "deadlock",
                "detected_at": hang_start + 60,
                "stalled_for_s": 60.0,
                "action": "kill",
                "reason": "deadlock: no rank advanced for 60.0 s",
                "stuck_ranks": [1],
                "behind": [1],
            }
        )
    )
    s = run_report(run, tmp_path / "out").to_json()
    hangs = [a for a in s["anomalies"] if a["kind"] == "hang"]
    assert len(hangs) == 1, s["anomalies"]
    h = hangs[0]
    assert h["start"] == pytest.approx(hang_start, abs=5) and h["end"] >= hang_start + 190
    assert h["gpus"] == ["node0:0", "node0:1"] and h["ranks"] == [1]
    assert "power triage" in h["detail"] and "watcher: deadlock" in h["detail"]
    assert h["start_offset_s"] == pytest.approx(320, abs=5)
    assert s["phases"]["by_phase"]["deadlock"]["time_share"] > 0.3
    page = (tmp_path / "out" / "index.html").read_text()
    assert "watcher: deadlock" in page and h["start_utc"] in page


def test_straggler_rank_and_starved_steps_are_named(tmp_path):
    run = tmp_path / "run"
    write_metrics(run, ranks=4, steps=40, slow={2: 1.3}, starved=range(10, 16))
    s = run_report(run, tmp_path / "out").to_json()
    stragglers = [a for a in s["anomalies"] if a["kind"] == "straggler"]
    assert [a["ranks"] for a in stragglers] == [[2]]
    assert "rank 2" in stragglers[0]["detail"] and "1.3" in stragglers[0]["detail"]
    starved = [a for a in s["anomalies"] if a["kind"] == "starvation"]
    assert len(starved) == 1 and starved[0]["ranks"] == [0, 1, 2, 3]
    # 6 starved steps on each of 4 ranks, each waiting 0.5 s: 24 (rank, step) rows and 12 s of waiting
    assert starved[0]["detail"].startswith("metrics: 24 step(s) on 4 rank(s) waited >= 20% of the step for data")
    assert "(12.0 s of waiting)" in starved[0]["detail"]
    first = T0 + 10 * 2.0 - pq.read_table(run / "metrics.parquet").to_pandas().query("step == 10")["step_time_s"].max()
    assert starved[0]["start"] == pytest.approx(first, abs=1e-3)


def test_starvation_windows_of_at_least_5_s(tmp_path):
    run = tmp_path / "run"
    synth = build_trace(
        job(
            gpus_of(1, 1),
            [("compute", 60), ("data_starvation", 30), ("compute", 60), ("data_starvation", 2), ("compute", 60)],
        ),
        shipped_table("h100"),
        seed=1,
    )
    synth.write(run / "telemetry")
    s = run_report(run, tmp_path / "out").to_json()
    starved = [a for a in s["anomalies"] if a["kind"] == "starvation"]
    assert len(starved) == 1 and starved[0]["gpus"] == ["node0:0"]
    assert starved[0]["start"] == pytest.approx(T0 + 60, abs=3) and starved[0]["duration_s"] == pytest.approx(30, abs=4)


# ---------------------------------------------------------------- missing and bad inputs


def test_missing_inputs_are_notes_not_crashes(tmp_path):
    run = tmp_path / "empty-run"
    run.mkdir()
    s = run_report(run, tmp_path / "out").to_json()
    notes = " ".join(s["notes"])
    for piece in ("TRAINED", "metrics.parquet", "watcher.json", "gate.json", "telemetry", "config"):
        assert piece in notes, piece
    assert s["tokens"] is None and s["energy"]["kwh"] is None and s["anomalies"] == []
    assert not any(s["signals"].values())
    page = (tmp_path / "out" / "index.html").read_text()
    assert ">No GPU telemetry on this host</h2>" in page and page.count("not available") >= 5
    assert figures(page) == [] and not BUNDLE.search(page)  # no figure: no plotly.js either


@pytest.mark.parametrize(
    "name", ["metrics.parquet", "TRAINED", "watcher.json", "telemetry/vm.parquet", "heartbeat/rank-0.events.jsonl"]
)
def test_a_bad_file_is_an_input_error_naming_it(tmp_path, name):
    run = tmp_path / "run"
    shutil.copytree(TRAIN, run)
    (run / name).write_bytes(b"{ not what it should be")
    with pytest.raises(InputError, match=re.escape(str(run / name))):
        run_report(run, tmp_path / "out")


def test_bad_phases_and_gate_files_are_named(tmp_path):
    power, gate = tmp_path / "power", tmp_path / "gate"
    power.mkdir()
    gate.mkdir()
    (power / "phases.parquet").write_bytes(b"PAR1 nope")
    with pytest.raises(InputError, match="phases.parquet"):
        run_report(TRAIN, tmp_path / "out", ReportSources(power_dir=power))
    (gate / "gate.json").write_text("[1, 2]")
    with pytest.raises(InputError, match="gate.json: the gate report is not a JSON object"):
        run_report(TRAIN, tmp_path / "out", ReportSources(gate_dir=gate))


def test_cli_prints_one_line_and_exits_2_on_a_bad_input(tmp_path, capsys):
    assert (
        main(
            ["report", "--run-dir", str(TRAIN), "--out", str(tmp_path / "out"), "--config", str(TRAIN / "config.yaml")]
        )
        == 0
    )
    out = capsys.readouterr().out.strip().splitlines()
    assert out == [
        f"report: gpu: 1728543 tokens, 0.003412 kWh (energy counter), 0 anomaly(ies) -> {tmp_path / 'out'}/index.html"
    ]
    assert main(["report", "--run-dir", str(tmp_path / "nope"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no such run folder" in err[0]


# ---------------------------------------------------------------- pieces


def _trace(rows) -> pa.Table:
    cols = {f.name: [r.get(f.name) for r in rows] for f in TRACE_SCHEMA}
    return pa.Table.from_pydict(cols, schema=TRACE_SCHEMA)


def test_samples_split_by_gpu_whatever_the_row_order():
    """Sampler order (every GPU each tick), a GPU missing a tick, shuffled rows: the same per-GPU energy."""
    rng = np.random.default_rng(0)
    rows = []
    for i in range(200):
        for g in (0, 1):
            energy = 1000.0 + 100.0 * (i * 0.1) * (1 + g) if i % 10 == 0 else None
            rows.append({"time": T0 + i * 0.1, "host": "h", "gpu": g, "power_w": 100.0 * (1 + g), "energy_j": energy})
    periodic = gpu_energy(read_samples([_trace(rows)]))
    gap = gpu_energy(read_samples([_trace([r for k, r in enumerate(rows) if k != 51])]))
    shuffled = gpu_energy(read_samples([_trace([rows[k] for k in rng.permutation(len(rows))])]))
    for e in (periodic, gap, shuffled):
        assert e.keys == [("h", 0), ("h", 1)] and e.method == "energy_counter"
        assert e.integrated_j == pytest.approx([100 * 19.9, 200 * 19.9])
        assert e.joules == pytest.approx([100 * 19.9, 200 * 19.9])


def test_integration_without_a_counter_and_with_a_reset():
    rows = [
        {"time": T0 + i, "host": "h", "gpu": 0, "power_w": 50.0, "energy_j": (5000.0 - 10 * i) if i % 5 == 0 else None}
        for i in range(11)
    ]
    e = gpu_energy(read_samples([_trace(rows)]))
    assert e.method == "integrated_power" and e.joules == pytest.approx([500.0])  # a falling counter is unusable
    rows = [dict(r, energy_j=None) for r in rows]
    assert gpu_energy(read_samples([_trace(rows)])).joules == pytest.approx([500.0])


def test_binning_keeps_long_runs_to_a_few_thousand_points():
    edges = bin_edges(0.0, 86400.0, 1.0)
    assert len(edges) - 1 == MAX_POINTS
    x = np.arange(0, 86400.0)
    code = np.where(x < 43200, LABELS.index("compute"), LABELS.index("idle"))
    major = bin_majority(x, code, edges, np.ones(len(x)))
    assert set(major[: MAX_POINTS // 2 - 1]) == {LABELS.index("compute")}
    assert set(major[MAX_POINTS // 2 + 1 :]) == {LABELS.index("idle")}


def test_figure_json_cannot_close_its_script_element_and_rounds_its_numbers():
    spec = {"data": [{"name": "</script><script>alert(1)</script>", "y": values([1.23456, np.nan, np.inf], 2)}]}
    text = spec_json(spec)
    assert "<" not in text and ">" not in text and "&" not in text
    assert json.loads(text) == {"data": [{"name": "</script><script>alert(1)</script>", "y": [1.23, None, None]}]}
    assert values([2.5, 3.49, -0.4], 0) == [2, 3, 0] and all(type(v) is int for v in values([2.5, 7.0], 0))


def test_power_rows_draw_min_mean_max_per_bin_on_each_gpus_watt_axis(tmp_path):
    """A run longer than POWER_BINS windows: each GPU its own row and watt axis (one scale), the time axis
    shared, and per bin the band's min <= the line's mean <= its max, the line in the bin's phase colour."""
    run = tmp_path / "run"
    synth = build_trace(
        job(gpus_of(1, 2), [("compute", 1500), ("idle", 400), ("compute", 500)]), shipped_table("h100"), seed=4
    )
    synth.write(run / "telemetry")
    run_report(run, tmp_path / "out")
    power = figures((tmp_path / "out" / "index.html").read_text())[0]
    assert power["alt"] == "power per GPU over time" and lanes(power) == ["node0:0", "node0:1"]
    axes = row_axes(power)
    assert len({axes["node0:0"], axes["node0:1"]}) == 2
    assert power["layout"][axes["node0:0"]]["range"] == power["layout"][axes["node0:1"]]["range"]
    assert all("xaxis" not in t for t in power["data"]) and "xaxis2" not in power["layout"]  # one time axis
    for label, axis in axes.items():
        mine = [t for t in power["data"] if trace_axis(t) == axis]
        low, high = (t for t in mine if t["legendgroup"] == "range")
        assert len(low["y"]) == len(high["y"]) <= POWER_BINS
        bins = {round(low["x0"] + i * low["dx"], 3): i for i in range(len(low["y"]))}
        lines = [t for t in mine if t["legendgroup"] in LABELS]
        assert {t["legendgroup"] for t in lines} == {"compute", "idle"}
        seen = 0
        for t in lines:
            assert t["line"]["color"] == PHASE_COLORS[t["legendgroup"]] and t["name"] in t["hovertemplate"]
            for x, y in zip(t["x"], t["y"]):
                if y is not None:
                    i = bins[round(x, 3)]
                    assert low["y"][i] <= y <= high["y"][i], (label, x)
                    seen += 1
        assert seen >= len(low["y"]) and any(a < b for a, b in zip(low["y"], high["y"]))


def _pause_run(tmp_path):
    run = tmp_path / "results" / "train" / "pauses"
    synth = build_trace(
        job(gpus_of(1, 2), [("compute", 300), ("checkpoint", 120), ("compute", 200), ("deadlock", 200)], stuck=1),
        shipped_table("h100"),
        seed=5,
    )
    synth.write(run / "telemetry")
    write_run_info(run, synth)
    power = tmp_path / "results" / "power" / "pauses"
    run_triage(trace_files(run / "telemetry"), power, run_dir=run, settings=TriageSettings(gpu_model="h100"))
    return run, power


def test_report_takes_pauses_energy_and_gaps_from_triage_json(tmp_path, monkeypatch):
    """triage.json beside phases.parquet already holds the pauses, the gaps and (for the same trace files)
    each GPU's energy: the report takes them and reads neither the traces' rows nor recomputes any."""
    import wattgate.report.inputs as inputs_mod
    import wattgate.report.summary as summary_mod
    from wattgate.power.energy import records

    run, power = _pause_run(tmp_path)
    recomputed = run_report(
        run, tmp_path / "recomputed", ReportSources(power_dir=power)
    ).to_json()  # before triage.json has "energy"
    record = json.loads((power / "triage.json").read_text())
    if "energy" not in record:  # written by hand where run_triage does not write it (yet)
        tables = [inputs_mod._read_trace_columns(p, inputs_mod.TRACE_COLUMNS) for p in trace_files(run / "telemetry")]
        samples = read_samples(tables)
        record["energy"] = records(gpu_energy(samples), [len(s.energy_pos) for s in samples.series])
        (power / "triage.json").write_text(json.dumps(record))
    assert record["pauses"] and {p["kind"] for p in record["pauses"]} == {"checkpoint", "deadlock"}

    def boom(*_, **__):
        raise AssertionError("recomputed what triage.json holds")

    monkeypatch.setattr(inputs_mod, "read_samples", boom)
    monkeypatch.setattr(inputs_mod, "_read_trace_columns", boom)
    monkeypatch.setattr(summary_mod.power_only, "pauses", boom)
    monkeypatch.setattr(summary_mod, "gap_summary", boom)
    monkeypatch.setattr(summary_mod, "gpu_energy", boom)
    taken = run_report(run, tmp_path / "taken", ReportSources(power_dir=power)).to_json()
    assert taken == recomputed and taken["pauses"]
    assert taken["energy"]["per_gpu"] and taken["signals"]["energy_counter"] == recomputed["signals"]["energy_counter"]
    power, *others = figures((tmp_path / "taken" / "index.html").read_text())
    assert len(others) == 3 and lanes(power) == ["node0:0", "node0:1"]
    assert {PHASE_COLORS[p] for p in ("compute", "checkpoint", "deadlock")} <= colours(power)


def test_report_reads_the_traces_when_triage_json_is_for_other_files(tmp_path, monkeypatch):
    """Energy from triage.json only for the very trace files it lists, none modified since."""
    import os

    import wattgate.report.inputs as inputs_mod

    run, power = _pause_run(tmp_path)
    expected = run_report(run, tmp_path / "expected", ReportSources(power_dir=power)).to_json()
    record = json.loads((power / "triage.json").read_text())
    record["energy"] = {
        k: dict(v, integrated_j=1.0, counter_j=None)
        for k, v in (record.get("energy") or {"node0:0": {"first": T0, "last": T0 + 1, "readings": 0}}).items()
    }
    calls = []
    real = inputs_mod.read_samples
    monkeypatch.setattr(inputs_mod, "read_samples", lambda tables: calls.append(1) or real(tables))
    for change in ("traces", "mtime"):
        if change == "traces":
            (power / "triage.json").write_text(json.dumps(dict(record, traces=[str(tmp_path / "other.parquet")])))
        else:
            (power / "triage.json").write_text(json.dumps(record))
            trace = trace_files(run / "telemetry")[0]
            later = (power / "triage.json").stat().st_mtime + 10
            os.utime(trace, (later, later))
        s = run_report(run, tmp_path / change, ReportSources(power_dir=power)).to_json()
        assert calls and s["energy"] == expected["energy"], change
        calls.clear()


def test_a_resumed_runs_step_figure_marks_where_each_later_attempt_began():
    """The ranks of an attempt beat `init` together; a later attempt's is a dotted line, named, and the caption
    says what it is only when one is drawn."""
    from types import SimpleNamespace

    import pandas as pd

    from wattgate.report.figures import attempt_starts

    beats = [(0.0, 0, "init"), (0.4, 1, "init"), (5.0, 0, "train"), (300.0, 1, "init"), (300.2, 0, "init")]
    beats += [(900.0, 0, "init"), (901.0, 0, "export")]
    events = pd.DataFrame([{"time": T0 + t, "rank": r, "step": 0, "epoch": 0, "phase": p} for t, r, p in beats])
    analysis = SimpleNamespace(inputs=SimpleNamespace(events=events))
    assert attempt_starts(analysis) == [T0 + 300.0, T0 + 900.0]
    assert attempt_starts(SimpleNamespace(inputs=SimpleNamespace(events=events[:3]))) == []
    # a quick retry (the next attempt within seconds) is an attempt of its own too
    quick = pd.concat([events[:2], events[:2].assign(time=events["time"][:2] + 3.0)])
    assert attempt_starts(SimpleNamespace(inputs=SimpleNamespace(events=quick))) == [T0 + 3.0]
    # the step figure's caption names the dotted lines only when the figures mark a later attempt
    import dataclasses

    from wattgate.report import summarize
    from wattgate.report.figures import render_all
    from wattgate.report.html import render_page

    analysis = summarize(TRAIN)
    figures = render_all(analysis, analysis.steps, analysis.inputs.evals)
    dotted = "Dotted: where a later attempt began"
    assert figures.steps is not None and figures.later_attempts == 0
    assert dotted not in render_page(analysis.summary, figures, 8)
    assert dotted in render_page(analysis.summary, dataclasses.replace(figures, later_attempts=1), 8)


def test_a_resumed_runs_memory_peaks_say_they_are_the_last_attempts():
    """TRAINED is the last attempt's record (a failed attempt writes none): on a resumed run the header's memory
    card and the Memory section say whose peak they show; a run of one attempt says nothing of attempts."""
    from wattgate.records.summary import MemoryCard, MemoryPhase
    from wattgate.report import summarize
    from wattgate.report.cards import memory_section
    from wattgate.report.html import header

    peak = MemoryPhase(
        phase="train",
        seconds=30.0,
        measured_host_peak_gib=0.63,
        measured_device_peak_gib=None,
        estimated_device_gib=None,
        usable_device_gib=None,
        largest_term=None,
    )
    memory = MemoryCard(
        phases=(peak,),
        measured_host_per_node_gib={"node0": 1.26},
        estimated_host_per_node_gib=None,
        host_budget_gib=None,
        load_s=None,
        export_s=None,
        export_dtype=None,
    )
    s = summarize(TRAIN).summary
    s = s.replace(memory=memory, peak_memory_gib=None)
    assert "attempt" not in header(s) + memory_section(s)
    assert "peak host memory per rank" in header(s)
    resumed = s.replace(wall_source="metrics (every step's time over the run's attempts: it was resumed)")
    assert "peak host memory per rank (last attempt)" in header(resumed)
    assert "maximum over ranks in the last attempt" in memory_section(resumed)


def test_packed_plotly_js_is_kept_for_the_next_report_and_a_bad_cache_is_packed_again(tmp_path, monkeypatch):
    """Packing plotly.js is most of what the page costs beyond the figures: an earlier report's is read back from
    the user's cache folder; a damaged or unwritable cache only costs the packing again, never different bytes."""
    from wattgate.report import plotly_page as P

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    source = P.plotly_js_path()
    cached = P.packed_cache_path(source)
    assert cached.parent == tmp_path / "cache" / "wattgate" and not cached.exists()
    packed = P._packed_once(source)
    assert cached.read_text() == packed == P._packed(source)
    cached.write_text("not whole base64")  # a cache that is not what a report wrote: packed again, and rewritten
    assert P._packed_once(source) == packed and cached.read_text() == packed
    monkeypatch.setenv("XDG_CACHE_HOME", "/proc/no-such-cache")  # cannot be written: packed all the same
    assert P._packed_once(source) == packed
