"""Synchronized data-parallel steps and one slowed GPU, for synthetic_trace.build_trace.

With TraceSpec(sync_steps=True) every
GPU's compute segments run the same steps, as data-parallel ranks do: each
step computes for U(1.5, 4) s, then all GPUs reduce gradients together for
U(0.2, 0.4) s at the communication level. A `Straggler` computes each of its
slowed steps `slowdown` longer (0.15 = 15%); meanwhile its peers wait at the
wait level (a kernel spinning in the collective, util 98-100%), or idle at 0%
for `rank0_work` (the others blocked on the host while rank 0 works). How it
is slowed (`cause`), in its slowed steps:

  thermal       power x 0.92, SM clock 1980/(1 + slowdown) MHz, 88 C, reasons 0x20 (SW thermal)
  power_cap     power pinned at its recorded limit (0.86 x its level; 0.8 x in other steps),
                SM clock 1980/(1 + slowdown), reasons 0x4 (SW power cap)
  hw_slowdown   power x 0.7, SM clock 990 MHz, reasons 0x8 (HW slowdown)
  data          idle (0% util) for the first slowdown x compute of the step (its rank waits
                for data: write_sync_run_info gives that rank the data wait), then computes
  rank0_work    nothing about the GPU (it does more work; its peers idle)
  unknown       nothing about the GPU

With `reasons=False` the trace holds no reasons (null), as a log without
them. The slow-path columns (SM clock 1980 MHz, ~55 C per GPU, reasons 0)
are read once a second and held, as the sampler does. `caps` gives each GPU's
recorded power limit (the table's tdp_w, the power_cap straggler's own).
`write_sync_run_info` writes heartbeats and metrics for such a job.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from wattgate.trace import REASON_CAUSES
from wattgate.triage_tables import TriageTable


def wait_level(t: TriageTable, rng) -> float:
    return t.idle_w + rng.uniform(0.42, 0.59) * (t.low_max_w - t.idle_w)


def gpu_uuid(host: str, gpu: int) -> str:
    return f"GPU-{uuid.uuid5(uuid.NAMESPACE_DNS, f'{host}/{gpu}')}"


STRAGGLER_CAUSES = ("thermal", "power_cap", "hw_slowdown", "data", "rank0_work", "unknown")
BASE_CLOCK_MHZ = 1980.0


@dataclass(frozen=True)
class Straggler:
    """One GPU of a sync_steps job that computes `slowdown` longer in the steps that start inside `episodes`
    ((start, end) s from t0; empty: the whole run), slowed by `cause` (see the module docstring); `reasons`:
    whether the trace records the clocks-event reasons."""

    gpu: tuple[str, int]
    slowdown: float = 0.25
    cause: str = "thermal"
    episodes: tuple[tuple[float, float], ...] = ()
    reasons: bool = True

    def slowed(self, t: np.ndarray) -> np.ndarray:
        if not self.episodes:
            return np.ones(len(t), dtype=bool)
        return np.any([(t >= a) & (t < b) for a, b in self.episodes], axis=0)


@dataclass
class Steps:
    """One compute segment's synchronized steps (seconds from the segment start), the same for every GPU."""

    offset: float  # the segment's start, s from t0
    start: np.ndarray
    c: np.ndarray  # compute seconds of an unslowed GPU
    s: np.ndarray  # the straggler's slowdown in this step (0: not slowed)
    d: np.ndarray  # the gradient reduce, every GPU together

    @classmethod
    def draw(cls, length: float, seed: int, index: int, straggler: Straggler | None, offset: float) -> Steps:
        r = np.random.default_rng([seed, 11, index])
        k = int(length / 1.7) + 2
        c, d = r.uniform(1.5, 4.0, k), r.uniform(0.2, 0.4, k)
        s = np.zeros(k)
        for _ in range(2):  # the slowdown lengthens the steps, which moves where the later ones start
            start = np.concatenate([[0.0], np.cumsum(c * (1 + s) + d)[:-1]])
            if straggler is not None:
                s = np.where(straggler.slowed(offset + start), straggler.slowdown, 0.0)
        start = np.concatenate([[0.0], np.cumsum(c * (1 + s) + d)[:-1]])
        return cls(offset, start, c, s, d)


@dataclass
class SlowColumns:
    """A GPU's slow-path readings per sub-sample, then held for a second as the sampler reads them."""

    clock: np.ndarray
    temp: np.ndarray
    reasons: np.ndarray

    @classmethod
    def base(cls, n: int, key: tuple[str, int], seed: int) -> SlowColumns:
        temp = 55.0 + np.random.default_rng([seed, 5, *key[0].encode(), key[1]]).uniform(-5, 5)
        return cls(np.full(n, BASE_CLOCK_MHZ), np.full(n, temp), np.zeros(n))

    def held(self, rel: np.ndarray, reasons: bool) -> dict[str, np.ndarray]:
        sec = np.floor(rel)
        first = np.r_[True, sec[1:] != sec[:-1]]
        src = np.maximum.accumulate(np.where(first, np.arange(len(rel)), 0))
        out = {"sm_clock_mhz": self.clock[src], "temp_c": self.temp[src]}
        out["clocks_event_reasons"] = self.reasons[src] if reasons else np.full(len(rel), np.nan)
        return out


REASON_OF = {"thermal": 0x20, "power_cap": 0x4, "hw_slowdown": 0x8}
assert all(bit & REASON_CAUSES[c] for c, bit in REASON_OF.items())


class SyncJob:
    """build_trace's state for a sync_steps job: each compute segment's steps (the same for every GPU), the
    GPUs' compute levels and recorded power limits, and the slow-path columns of every sample kept."""

    def __init__(self, table: TriageTable, seed: int, straggler: Straggler | None, reasons: bool | None):
        if straggler is not None and straggler.cause not in STRAGGLER_CAUSES:
            raise ValueError(f"unknown straggler cause {straggler.cause!r}")
        self.table, self.seed, self.straggler = table, seed, straggler
        self.reasons = (straggler.reasons if straggler is not None else True) if reasons is None else reasons
        self.steps: dict[int, Steps] = {}  # compute segment index -> its steps
        self.caps: dict[tuple[str, int], float] = {}
        self.kept: dict[str, list] = {c: [] for c in ("sm_clock_mhz", "temp_c", "clocks_event_reasons")}

    def start_gpu(self, key: tuple[str, int], n: int) -> None:
        """The next GPU's `n` sub-samples: its level (drawn from its name: the same whatever the GPUs before it),
        its power limit and fresh slow-path columns."""
        self.key, self.slow = key, SlowColumns.base(n, key, self.seed)
        r = np.random.default_rng([self.seed, 7, *key[0].encode(), key[1]])
        self.level = r.uniform(0.75, 0.95) * self.table.tdp_w
        st = self.straggler
        capped = st is not None and st.cause == "power_cap" and key == st.gpu
        self.caps[key] = round(0.86 * self.level, 1) if capped else float(self.table.tdp_w)

    def compute(
        self, index: int, length: float, start: float, u: np.ndarray, at: int, rng, noise: float
    ) -> tuple[np.ndarray, np.ndarray]:
        """Power and util of the current GPU over compute segment `index` (`length` s from `start`), in
        synchronized steps (`u`: s from the segment start); the straggler's slow-path readings go into the GPU's
        slow-path columns from position `at`."""
        plan = self.steps.setdefault(index, Steps.draw(length, self.seed, index, self.straggler, start))
        key, level, t, straggler, slow = self.key, self.level, self.table, self.straggler, self.slow
        cap = self.caps[key]
        n = len(u)
        k = np.clip(np.searchsorted(plan.start, u, side="right") - 1, 0, len(plan.start) - 1)
        off = u - plan.start[k]
        c, s = plan.c[k], plan.s[k]
        end = c * (1 + s)
        me = straggler is not None and key == straggler.gpu
        cause = straggler.cause if straggler is not None else ""
        slowed = me & (s > 0)
        if me and cause == "data":
            data_wait = off < c * s
            busy = ~data_wait & (off < end)
        else:
            data_wait = np.zeros(n, dtype=bool)
            busy = off < (end if me else c)
        waiting = ~busy & ~data_wait & (off < end)
        comm = off >= end
        band = t.compute_min_w - t.low_max_w
        comm_level = t.low_max_w + rng.uniform(0.5, 0.9) * band
        wait = wait_level(t, rng)
        power = np.where(busy, level + rng.normal(0, noise * 0.02 * t.tdp_w, n), 0.0)
        util = np.where(busy, rng.uniform(95, 100, n), 0.0)
        if me and cause == "power_cap":
            power = np.where(
                busy, np.where(slowed, cap + rng.normal(0, noise * 0.004 * t.tdp_w, n), 0.8 * power), power
            )
        elif me and cause in ("thermal", "hw_slowdown"):
            power = np.where(busy & slowed, power * (0.92 if cause == "thermal" else 0.7), power)
        if cause == "rank0_work" and not me:  # blocked on the host while rank 0 works: idle, nothing resident
            idle = t.idle_w * rng.uniform(1.0, 1.1)
            power = np.where(waiting, idle + rng.normal(0, noise * 0.02 * t.idle_w, n), power)
        else:
            power = np.where(waiting, wait + rng.normal(0, noise * 0.03 * (t.low_max_w - t.idle_w), n), power)
            util = np.where(waiting, rng.uniform(98, 100, n), util)
        power = np.where(data_wait, t.idle_w * rng.uniform(1.0, 1.1) + rng.normal(0, noise * 0.02 * t.idle_w, n), power)
        power = np.where(comm, comm_level + rng.normal(0, noise * 0.03 * band, n), power)
        util = np.where(comm, rng.uniform(97, 100, n), util)
        if me and cause in REASON_OF:
            hot = np.flatnonzero(busy & slowed) + at
            slow.clock[hot] = (
                BASE_CLOCK_MHZ * 0.5 if cause == "hw_slowdown" else BASE_CLOCK_MHZ / (1 + s[busy & slowed])
            )
            slow.reasons[hot] = REASON_OF[cause]
            if cause == "thermal":
                slow.temp[hot] = 88.0
        return power, util

    def keep(self, rel: np.ndarray, at: np.ndarray, keep: np.ndarray) -> None:
        for name, values in self.slow.held(rel, self.reasons).items():
            self.kept[name].append(values[at][keep])

    def columns(self) -> dict[str, pa.Array]:
        """The slow-path columns as trace columns (reasons: NaN, not recorded, is null)."""
        out = {c: pa.array(np.concatenate(self.kept[c]).astype(np.float32)) for c in ("sm_clock_mhz", "temp_c")}
        r = np.concatenate(self.kept["clocks_event_reasons"])
        out["clocks_event_reasons"] = pa.array(np.nan_to_num(r).astype(np.int64), pa.int64(), mask=np.isnan(r))
        return out

    def results(self, t0: float) -> tuple[dict, pd.DataFrame, Straggler | None]:
        """SyntheticTrace's caps ((host, gpu) -> {"power_limit_w": W}), steps and straggler."""
        caps = {k: {"power_limit_w": float(v)} for k, v in self.caps.items()}
        return caps, self.step_table(t0), self.straggler

    def step_table(self, t0: float) -> pd.DataFrame:
        """Every step of every compute segment: start (unix s), compute_s, slowdown, comm_s."""
        frames = [
            pd.DataFrame({"start": t0 + p.offset + p.start, "compute_s": p.c, "slowdown": p.s, "comm_s": p.d})
            for _, p in sorted(self.steps.items())
        ]
        return pd.concat(
            frames or [pd.DataFrame(columns=["start", "compute_s", "slowdown", "comm_s"])], ignore_index=True
        )


def write_sync_run_info(run_dir: Path, synth) -> Path:
    """Heartbeats and metrics.parquet for a sync_steps trace: rank r on synth.gpus[r], one metrics row per step
    and rank ending when the slowest GPU's step (its reduce included) ends; the data straggler's rank waits
    slowdown x compute for data in its slowed steps, every other rank 0.01 s."""
    from wattgate.run_tables import METRICS_SCHEMA

    steps = synth.steps
    st = synth.straggler
    duration = steps["compute_s"] * (1 + steps["slowdown"]) + steps["comm_s"]
    end = (steps["start"] + duration).to_numpy()
    beat_dir = run_dir / "heartbeat"
    beat_dir.mkdir(parents=True, exist_ok=True)
    frames = []
    for rank, key in enumerate(synth.gpus):
        wait = np.full(len(steps), 0.01)
        if st is not None and st.cause == "data" and key == st.gpu:
            wait = np.where(steps["slowdown"] > 0, steps["compute_s"] * steps["slowdown"], 0.01)
        frames.append(
            pd.DataFrame(
                {
                    "step": np.arange(1, len(steps) + 1),
                    "rank": rank,
                    "data_wait_s": wait,
                    "time": end,
                    "step_time_s": duration.to_numpy(),
                }
            )
        )
        events = [(float(steps["start"].iloc[0]), 0, "init"), (float(steps["start"].iloc[0]), 0, "train")]
        events.append((float(end[-1]), len(steps), "done"))
        with open(beat_dir / f"rank-{rank}.events.jsonl", "w") as f:
            for t, step, phase in events:
                f.write(json.dumps({"time": t, "rank": rank, "step": step, "epoch": 0, "phase": phase}) + "\n")
        state = {
            "rank": rank,
            "local_rank": key[1],
            "gpu": gpu_uuid(*key),
            "host": key[0],
            "pid": 1000 + rank,
            "step": len(steps),
            "epoch": 0,
            "phase": "done",
            "time": float(end[-1]),
            "total_steps": len(steps),
            "epoch_ends": [len(steps)],
        }
        (beat_dir / f"rank-{rank}.json").write_text(json.dumps(state) + "\n")
    m = pd.concat(frames, ignore_index=True).assign(
        epoch=0, loss=1.0, tokens=4096, loss_tokens=2048, lr=1e-5, grad_norm=1.0
    )
    pq.write_table(
        pa.Table.from_pandas(m[METRICS_SCHEMA.names], schema=METRICS_SCHEMA, preserve_index=False),
        run_dir / "metrics.parquet",
    )
    return run_dir
