"""What the proof expected a rank to issue next, from its heartbeat: for the watcher's verdict on a hang.

A heartbeat says where a rank is (step, phase, micro-batch); the proof recorded, for one step of every class,
the collective index at each heartbeat the trainer wrote and the whole sequence. A rank that stopped after a
heartbeat is blocked in the collective at that index or a later one of the same step.
"""

from __future__ import annotations

from wattgate.records.gate import Collectives, ProofClass
from wattgate.records.heartbeat import Beat


def beat_position(beat: Beat) -> tuple[int, str, int | None]:
    """(1-based step whose collectives the rank is issuing, phase, micro-batch) from its heartbeat: during a
    step's micro-batches `step` counts the steps done; after them (log, eval, checkpoint) it is this step."""
    step, phase, micro = beat.step, beat.phase, beat.micro
    return (step + 1 if phase == "train" and micro is not None else step), phase, micro


def class_at(collectives: Collectives, step: int) -> ProofClass | None:
    """The proof's class row for 1-based `step` (None outside the planned steps)."""
    for first, last, k in collectives.class_runs or ():
        if first <= step <= last:
            assert collectives.classes is not None  # the proof writes class_runs only beside its classes
            return collectives.classes[k]
    return None


def expected_next(row: ProofClass, phase: str, micro: int | None) -> tuple[int, str] | None:
    """(index, collective) the proof saw first after the heartbeat (phase, micro) in a step of this class."""
    for b in row.beats:
        if b.phase == phase and b.micro == micro:
            seq = row.sequence
            return b.index, seq[b.index] if b.index < len(seq) else "nothing more in this step"
    return None


def hang_hint(collectives: Collectives | None, rank: int, beat: Beat) -> str | None:
    """One line for a watcher's verdict: the rank's step class and the collective the proof expected next."""
    if collectives is None or not collectives.classes:
        return None
    step, phase, micro = beat_position(beat)
    row = class_at(collectives, step)
    if row is None:
        return None
    where = f"{phase} micro-batch {micro}" if micro is not None else phase
    nxt = expected_next(row, phase, micro)
    said = f"collective #{nxt[0] + 1} of the step, {nxt[1]}, or a later one" if nxt else "a collective of the step"
    return f"rank {rank}: step {step} (class {row.label}), {where}: the proof expects {said}"
