"""The report page in a real headless Chromium: the page unpacks its embedded plotly.js and Plotly draws every
figure (a laid-out plot with a trace in it), and a screenshot is not blank.

Chromium is installed with apt when missing and we are root; otherwise the tests skip and say why.
A copy of the H200 report's screenshot is left at /tmp/report-shot.png for a person to look at.
"""

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from real_traces import H200_DATA

from wattgate.report import run_report
from wattgate.trace import TraceWriter

pytestmark = pytest.mark.slow

CHROMIUM = Path("/usr/bin/chromium")
INSTALL = ["apt-get", "install", "-y", "--no-install-recommends", "chromium"]
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--virtual-time-budget=10000",  # time to unpack plotly.js and draw
]
SHOT_COPY = Path("/tmp/report-shot.png")


def _apt(args: list[str], timeout: int) -> tuple[int, str]:
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    try:
        p = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env)
    except (subprocess.TimeoutExpired, OSError) as exc:
        return 1, str(exc)
    return p.returncode, (p.stdout + p.stderr)[-400:]


@pytest.fixture(scope="module")
def chromium() -> Path:
    if CHROMIUM.exists():
        return CHROMIUM
    if os.geteuid() != 0:
        pytest.skip(f"{CHROMIUM} is missing and we are not root, so it cannot be installed with apt-get")
    rc, log = _apt(INSTALL, 600)
    if rc != 0:  # a stale package list: refresh it once
        _apt(["apt-get", "update"], 300)
        rc, log = _apt(INSTALL, 600)
    if rc != 0 or not CHROMIUM.exists():
        pytest.skip(f"could not install chromium with apt-get: {log.strip()}")
    return CHROMIUM


def browse(chromium: Path, page: Path, profile: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(chromium), *FLAGS, f"--user-data-dir={profile}", *extra, page.resolve().as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
    )


def rendered(chromium: Path, page: Path, profile: Path) -> tuple[int, int]:
    """(figures drawn, figures on the page) as the page's loader counts them once its scripts ran, each figure
    <div> checked to have become a Plotly plot with its SVG and a trace."""
    dom = browse(chromium, page, profile, "--dump-dom")
    m = re.search(r'data-figures-rendered="(\d+)/(\d+)"', dom.stdout)
    assert m, f"no data-figures-rendered on <body>: rc {dom.returncode}, stderr {dom.stderr[-400:]}"
    assert not re.search(r'<body[^>]*data-figures-error="([^"]*)"', dom.stdout), "the loader failed"
    names = re.findall(r'<div class="figure[^"]*" id="figure-([\w-]+)"', page.read_text())
    for name in names:
        div = re.search(
            rf'<div class="([^"]*)" id="figure-{name}"(.*?)<script type="application/json"', dom.stdout, re.S
        )
        assert div and "js-plotly-plot" in div.group(1).split(), f"figure {name}: not a Plotly plot"
        drew = 'class="main-svg"' in div.group(2) and re.search(r'class="trace\b', div.group(2))
        assert drew, f"figure {name}: nothing drawn"
    assert len(names) == int(m.group(2))
    return int(m.group(1)), int(m.group(2))


def distinct_colours(png: Path) -> int:
    from PIL import Image

    with Image.open(png) as im:
        colours = im.convert("RGB").getcolors(maxcolors=1 << 20)
    return len(colours) if colours is not None else 1 << 20


@pytest.fixture(scope="module")
def h200_page(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("report")
    run_report(H200_DATA / "train", out)
    return out / "index.html"


def test_every_figure_renders_in_chromium(chromium, h200_page, tmp_path):
    done, total = rendered(chromium, h200_page, tmp_path / "profile")
    assert total == 4 and done == total, f"{done}/{total} figures rendered"


def test_screenshot_is_not_blank(chromium, h200_page, tmp_path):
    shot = tmp_path / "shot.png"
    p = browse(
        chromium,
        h200_page,
        tmp_path / "profile",
        f"--screenshot={shot}",
        "--window-size=1400,2400",
        "--hide-scrollbars",
    )
    assert shot.is_file(), f"no screenshot: rc {p.returncode}, stderr {p.stderr[-400:]}"
    assert distinct_colours(shot) >= 200  # a blank or error page has a handful
    shutil.copy(shot, SHOT_COPY)


def test_cpu_page_renders_its_figures(chromium, tmp_path):
    """The CPU default: no GPU telemetry, yet the step time and loss figures render."""
    run = tmp_path / "run"
    TraceWriter(run / "telemetry" / "cpu.parquet", {"nvml": "unavailable: no driver"}).close()
    shutil.copy(H200_DATA / "train" / "metrics.parquet", run / "metrics.parquet")
    (run / "TRAINED").write_text(json.dumps({"device": "cpu", "world_size": 1, "wall_s": 35.0}))
    run_report(run, tmp_path / "out")
    page = tmp_path / "out" / "index.html"
    assert "No GPU telemetry on this host" in page.read_text()
    assert rendered(chromium, page, tmp_path / "profile") == (2, 2)
