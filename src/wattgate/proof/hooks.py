"""The dry run's heartbeat, stop request and step hooks (train/seams.py): what the Trainer is given in place of
heartbeat files, signals and `EveryStep`, so that the proof records each step's collectives and heartbeats while
the Trainer runs its own code.

- `RecordingHeartbeat`: each beat's phase and micro-batch, at the index of the collective that follows it (where
  the watcher's view of a rank sits in its collective sequence); no file is written.
- `ArmedStop`: no stop request until the proof arms it for the graceful stop path.
- `DryRunSteps`: one step of each class, each step's collectives, heartbeats and class recorded into the rank's
  record; and the replay: a train part with micro-batches of the same shapes, or a validation pass,
  runs the Trainer's own code the first time a rank meets it and is replayed afterwards (the same collectives and
  heartbeats at the same places, the same result); inside a pass the forwards from the second on replay the one
  before (the first gathers the root's parameters and leaves them gathered, so from the second on every forward
  starts in the same state: the root gathered, every layer resharded after its own forward).

Why the replay is sound: the proof's premise is that collectives follow the plan's counts and shapes, never values;
a train part and a validation pass are functions of nothing else once FSDP2 is initialized (each starts and ends
with every unit resharded), so a second run would issue the same sequence.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from wattgate.heartbeats import HEARTBEAT_PHASES
from wattgate.proof.record import CollectiveRecorder
from wattgate.records.gate import ProofBeat

T = TypeVar("T")


class RecordingHeartbeat:
    """HeartbeatSink of a dry run: `beats` holds each beat's phase, micro-batch and next collective's index, in
    order."""

    def __init__(self, recorder: CollectiveRecorder):
        self.recorder = recorder
        self.beats: list[ProofBeat] = []

    def set_plan(self, total_steps: int, epoch_ends: list[int]) -> None:
        pass

    def beat(self, step: int, epoch: int, phase: str, micro: int | None = None, **extra) -> None:
        assert phase in HEARTBEAT_PHASES, phase
        self.beats.append(ProofBeat(index=len(self.recorder.collectives), phase=phase, micro=micro))


class ArmedStop:
    """StopSource of a dry run: no request until `arm()`, then every rank is asked to stop (a time limit)."""

    def __init__(self):
        self.armed = False

    def arm(self) -> None:
        self.armed = True

    def reason(self) -> str | None:
        return "a stop request (collective proof)" if self.armed else None


def shapes(tensors: dict) -> tuple:
    return tuple((k, tuple(v.shape), str(v.dtype)) for k, v in sorted(tensors.items()))


class DryRunSteps:
    """StepHooks of a dry run over the steps `chosen` (0-based), recording into `record` (a RankRecord)."""

    def __init__(self, recorder: CollectiveRecorder, heartbeat: RecordingHeartbeat, record, chosen, replay: bool):
        self.recorder, self.heartbeat, self.record = recorder, heartbeat, record
        self.chosen, self.replay = sorted(chosen), replay
        self.tapes: dict[tuple, tuple] = {}
        self.end_mark = 0  # where the last dry-run step (or start-up) ended: the export follows
        self.forwards: list | None = None  # inside a validation pass: its forwards so far

    def steps(self, start: int, total: int) -> list[int]:
        self.record.startup = list(self.recorder.collectives)
        self.end_mark = len(self.recorder.collectives)
        return [g for g in self.chosen if start <= g < total]

    def step(self, g: int, step_class, run: Callable[[], T]) -> T:
        collectives, beats = self.recorder.collectives, self.heartbeat.beats
        mark, first_beat = len(collectives), len(beats)
        result = run()
        self.record.steps[g] = collectives[mark:]
        self.record.beats[g] = [b.replace(index=b.index - mark) for b in beats[first_beat:]]
        self.record.classes[g] = step_class.key()
        self.end_mark = len(collectives)
        return result

    def train_part(self, batches: list, run: Callable[[], T]) -> T:
        return self.replayed(("train", tuple(shapes(host) for _, host in batches)), run)

    def validation(self, micros: int, run: Callable[[], T]) -> T:
        self.forwards = []
        try:
            return self.replayed(("eval", micros), run)
        finally:
            self.forwards = None

    def forward(self, tensors: dict, run: Callable[[], T]) -> T:
        done = self.forwards
        if not self.replay or done is None:
            return run()
        key, collectives = shapes(tensors), self.recorder.collectives
        if len(done) >= 2 and done[-1][0] == key:
            collectives.extend(done[-1][1])
            return done[-1][2]
        mark = len(collectives)
        result = run()
        done.append((key, collectives[mark:], result))
        return result

    def replayed(self, key: tuple, run: Callable[[], T]) -> T:
        """`run()` the first time this rank meets `key`, its collectives and heartbeats taped; later the tape again
        and the same result, without running it. A None result (a pass a stop interrupted) is not taped."""
        collectives, beats = self.recorder.collectives, self.heartbeat.beats
        if not self.replay:
            return run()
        if key in self.tapes:
            taped, taped_beats, result = self.tapes[key]
            at = 0
            for offset, beat in taped_beats:
                collectives.extend(taped[at:offset])
                at = offset
                beats.append(beat.replace(index=len(collectives)))
            collectives.extend(taped[at:])
            return result
        mark, first_beat = len(collectives), len(beats)
        result = run()
        if result is not None:
            self.tapes[key] = (collectives[mark:], [(b.index - mark, b) for b in beats[first_beat:]], result)
        return result
