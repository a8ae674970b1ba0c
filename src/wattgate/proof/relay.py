"""What rank 0's dry run makes known to the other ranks' dry runs: the objects it sends (broadcast_object_list,
scatter_object_list from rank 0) and the small records it publishes in a checkpoint folder (state.json).

Each rank is dry-run in its own process group (often its own process), so nothing it sends reaches another rank
by itself. On a real job rank 1 resumes from the checkpoint rank 0 lists and broadcasts, and DCP's save and load
hand every rank the plan their coordinator (rank 0) made; a dry run that made these up would not take the path
a real rank takes. So rank 0 puts each such object here as it sends it, and another rank takes rank 0's object
when it reaches the matching collective: the same operator at the same call site, the n-th time there (a rank
whose collectives diverge earlier still meets the ones it shares with rank 0).

Data only ever flows from rank 0, and rank 0 never waits: the ranks' dry runs need no common clock and cannot
deadlock. A rank that needs an object rank 0 has not sent yet waits for it, or for rank 0's dry run to end (it
never sent it: the object is left as it was, and the collectives already differ). Rank 0 is the first task of
the proof (wattgate.proof.workers runs it in the gate's own process), so in a single process the others find
its objects ready. A folder in the proof's work folder carries them between processes: one pickle per object.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import time
from pathlib import Path
from typing import Any

DONE = "DONE"
WAIT_S = 600.0  # a rank waits at most this long for rank 0 (the workers' own limit ends a stuck proof sooner)


class RankZeroRelay:
    """Rank 0's sent objects and published records, keyed by name: put by rank 0, taken by the others."""

    def __init__(self, folder: Path | None, rank: int):
        if folder is None and rank != 0:
            raise ValueError(
                f"rank {rank}'s dry run takes what rank 0's sends: give it the relay folder of rank 0's dry run"
            )
        self.folder, self.rank = (Path(folder) if folder is not None else None), rank
        self.own: dict[str, Any] = {}  # rank 0: everything it put, for its own reads
        if self.folder is not None and rank == 0:
            self.folder.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        assert self.folder is not None  # rank 0 with a folder, or another rank (which always has one)
        return self.folder / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.pkl"

    def put(self, key: str, value) -> None:
        """Rank 0: `value` under `key` for the other ranks (another rank's put is its own: nobody reads it)."""
        if self.rank != 0:
            return
        self.own[key] = value
        if self.folder is not None:
            path = self._path(key)
            tmp = path.with_suffix(f".tmp-{os.getpid()}")
            tmp.write_bytes(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))
            os.replace(tmp, path)

    def get(self, key: str, default: Any = None) -> Any:
        """Rank 0's value under `key`; rank 0 reads what it put, never waiting. Another rank waits until rank 0
        has put it, or `default` once rank 0's dry run has ended without it."""
        if self.rank == 0:
            return self.own.get(key, default)
        assert self.folder is not None  # __init__ refuses another rank without a folder
        path, done = self._path(key), self.folder / DONE
        deadline, pause = time.monotonic() + WAIT_S, 0.0005
        while True:
            if path.exists():
                return pickle.loads(path.read_bytes())
            if done.exists():
                return pickle.loads(path.read_bytes()) if path.exists() else default
            if time.monotonic() > deadline:
                waited = f"rank {self.rank}'s dry run waited {WAIT_S:.0f} s for rank 0's {key}"
                raise RuntimeError(f"{waited}; rerun the gate")
            time.sleep(pause)
            pause = min(pause * 2, 0.02)

    def close(self) -> None:
        """Rank 0: its dry run has ended (the others stop waiting for what it did not send)."""
        if self.rank == 0 and self.folder is not None:
            (self.folder / DONE).write_text("")
