"""One run per run folder: a launch under another run identity sets the folder's earlier run aside whole.

A run folder (results/train/<run>) holds one run: its checkpoints, metrics, heartbeats, telemetry, eval and
TensorBoard records, watcher verdict, TRAINED and final/. Rerunning the workflow after a change that alters what
the run computes (a learning rate, another plan or corpus, another model: wattgate/identity.py) trains a new run
in the same folder; its report must not mix the two. So launch records the identity it trains under
(`run-identity.json`), and the next launch with a different one moves every record of the earlier run into a
sibling folder, `<run>.previous-<time>/`, before it starts, saying so in one line. A run continued on another
world size (its plan links to the earlier one's packs) is the same run, as is any change the identity leaves out
(logging, checkpoint cadence, the watcher).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from wattgate.artifacts import write_json_atomic
from wattgate.errors import InputError
from wattgate.identity import identity_differences
from wattgate.records.base import Where
from wattgate.records.checkpoint import Position, RunIdentity
from wattgate.run_files import LAUNCH_LOCK, RUN_IDENTITY, TRAIN_LOCK
from wattgate.train.checkpoint import newest_recorded_identity

# what stays in the folder: the locks launch holds now, and the hidden files of this attempt (the output marker, the
# spare room set aside for the attempt's outcome)
KEPT = frozenset({LAUNCH_LOCK, TRAIN_LOCK})


def _recorded(run: Path) -> tuple[RunIdentity, str | None] | None:
    path = run / RUN_IDENTITY
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise InputError(f"{path}: unreadable ({exc}); move the run folder aside or delete this file") from None
    if not isinstance(raw, dict):
        raise InputError(f"{path}: not a JSON object; move the run folder aside or delete this file")
    identity = RunIdentity.from_json(raw.get("identity") or {}, Where(str(path), "train"))
    return identity, raw.get("packs_sha256")


def earlier_run_differences(run: Path, identity: RunIdentity) -> list[str]:
    """What the run recorded in `run` differs in from `identity` (empty: the same run, or none recorded). A folder
    without run-identity.json (trained before launch recorded it) is judged by its newest checkpoint's identity."""
    recorded = _recorded(run)
    if recorded is not None:
        before, packs = recorded
        return identity_differences(before, identity, Position(plan=packs))
    newest = newest_recorded_identity(run / "checkpoints")
    if newest is None:
        return []
    before, position = newest
    return identity_differences(before, identity, position)


def set_aside_earlier_run(run: Path, identity: RunIdentity) -> str | None:
    """Move the earlier run's records out of `run` when it was trained under another identity; the folder left
    holds only the locks and hidden files this attempt already made. Returns the line that says so (launch prints
    it once its own logs are started, so it opens the new run's train.log)."""
    differences = earlier_run_differences(run, identity)
    if not differences:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime())
    dest = run.with_name(f"{run.name}.previous-{stamp}")
    n = 1
    while dest.exists():
        n += 1
        dest = run.with_name(f"{run.name}.previous-{stamp}-{n}")
    dest.mkdir()
    try:
        for entry in sorted(run.iterdir()):
            if entry.name in KEPT or entry.name.startswith("."):
                continue
            os.replace(entry, dest / entry.name)
    except OSError as exc:
        raise InputError(f"{run}: cannot move the earlier run's records to {dest} ({exc.strerror})") from None
    return (
        f"launch: {run} held a run of another configuration (it differs in {', '.join(differences)}): its records "
        f"moved to {dest}; this is a new run"
    )


def record_run_identity(run: Path, identity: RunIdentity, packs_sha256: str | None) -> None:
    write_json_atomic(run / RUN_IDENTITY, {"identity": identity.to_json(), "packs_sha256": packs_sha256})
