"""Scores of triage against real traces: a labelled calibration trace (its phases by window) and a real training
run (its steps, checkpoints, init and teardown from its heartbeats and metrics). The repository keeps one of each
under tests/data/h200 (tests/real_traces.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import cast

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from wattgate.power.triage.phases import END, PHASE, START
from wattgate.triage_tables import TriageTable

# the published-figure H200 table that the calibrated one replaced (its comment keeps these numbers)
PUBLISHED_H200 = TriageTable(
    gpu_model="H200",
    match=("H200",),
    tdp_w=700,
    idle_w=78,
    low_max_w=210,
    compute_min_w=380,
    busy_util_pct=85,
    idle_util_pct=5,
    provenance={"kind": "published figures, uncalibrated"},
)
# what each labelled phase of the calibration run may read as: a checkpoint on one GPU with no
# heartbeats has no peer waiting on it, so its power (idle, host copies) can only say idle
REAL_ACCEPT = {
    "idle": {"idle"},
    "compute": {"compute"},
    "data_starvation": {"data_starvation"},
    "checkpoint": {"checkpoint", "idle"},
    "deadlock": {"deadlock"},
}


def calibration_truth(labels: pd.DataFrame, window_s: float = 1.0) -> pd.DataFrame:
    """start, phase of each scored window of the labelled calibration trace: the majority label of
    its samples, without setup/end windows and the one window at each phase boundary (the window
    holding the new phase's first sample: it mixes both phases, or NVML's averages still lag)."""
    lab = labels.sort_values("time", kind="stable")
    w = np.floor(lab["time"].to_numpy() / window_s).astype(np.int64)
    phase = lab["phase"].to_numpy(dtype=object)
    boundary = np.unique(w[1:][phase[1:] != phase[:-1]])
    df = pd.DataFrame({"w": w, "phase": phase})
    major = df.groupby("w")["phase"].agg(lambda s: s.value_counts().index[0])
    keep = ~major.index.isin(boundary) & ~major.isin(["setup", "end"]).to_numpy()
    return pd.DataFrame({"start": major.index[keep] * window_s, "phase": major.to_numpy()[keep]})


def calibration_agreement(phases: pa.Table, labels: pd.DataFrame) -> pd.DataFrame:
    """Per labelled phase: scored windows, share read as REAL_ACCEPT allows, and what they read as."""
    truth = calibration_truth(labels)
    got = phases.select([START, PHASE]).to_pandas().set_index(START)[PHASE]
    truth["got"] = got.reindex(truth["start"]).to_numpy()
    rows = []
    for ph, g in truth.groupby("phase", sort=False):
        rows.append(
            {
                "phase": ph,
                "windows": len(g),
                "agree": float(g["got"].isin(REAL_ACCEPT[cast(str, ph)]).mean()),  # pandas types a key as any scalar
                "read_as": dict(g["got"].value_counts()),
            }
        )
    return pd.DataFrame(rows).set_index("phase")


def train_parts(phases: pa.Table, run_dir: Path) -> dict[str, np.ndarray]:
    """Boolean masks over the phases rows of a one-GPU run: its steps, checkpoints, init and teardown.

    steps: >= 50% inside metrics steps and < 50% inside checkpoint intervals; checkpoint: >= 50%
    inside a "checkpoint" event to the next event; init: ending before the first step began;
    teardown: starting after the "done" event.
    """
    events = pd.read_json(run_dir / "heartbeat" / "rank-0.events.jsonl", lines=True).sort_values("time")
    m = pq.read_table(run_dir / "metrics.parquet", columns=["time", "step_time_s"]).to_pandas()
    df = phases.select([START, END]).to_pandas()
    w0, w1 = df[START].to_numpy(), df[END].to_numpy()

    def share(starts, ends):  # the intervals do not overlap
        cover = np.clip(np.minimum(w1[:, None], ends[None]) - np.maximum(w0[:, None], starts[None]), 0, None)
        return cover.sum(axis=1) / (w1 - w0)

    times, names = events["time"].to_numpy(), events["phase"].to_numpy()
    ck = np.flatnonzero(names[:-1] == "checkpoint")
    in_ck = share(times[ck], times[ck + 1]) >= 0.5
    begin = (m["time"] - m["step_time_s"]).to_numpy()
    in_steps = share(begin, m["time"].to_numpy()) >= 0.5
    done = times[names == "done"].min()
    return {"steps": in_steps & ~in_ck, "checkpoint": in_ck, "init": w1 <= begin.min(), "teardown": w0 >= done}


TRAIN_EXPECT = {"steps": "compute", "checkpoint": "checkpoint", "init": "idle", "teardown": "idle"}


def train_agreement(phases: pa.Table, run_dir: Path) -> pd.DataFrame:
    """Per part of the real run (train_parts): windows, share read as TRAIN_EXPECT says, what they read as."""
    got = phases.column(PHASE).to_numpy(zero_copy_only=False)
    rows = []
    for part, mask in train_parts(phases, run_dir).items():
        g = pd.Series(got[mask])
        rows.append(
            {
                "part": part,
                "windows": int(mask.sum()),
                "agree": float((g == TRAIN_EXPECT[part]).mean()),
                "read_as": dict(g.value_counts()),
            }
        )
    return pd.DataFrame(rows).set_index("part")
