"""torchrun, recording why each rank failed: `python -m wattgate.train.torchrun --run-dir DIR <torchrun args>`.

`wattgate launch` starts every node's agent through this module instead of `python -m torch.distributed.run`. It is
torchrun itself (the same `main`, in the same process, so the ranks' parent and its signal handling are
unchanged), with one addition: when ranks fail, the agent knows each one's wait status, and torchrun only prints it
in a failure table. Here each failed rank's status goes to `heartbeat/exit-rank-<r>.json` in the run folder (the
exit code, or the signal that killed it: a SIGKILL from the OOM killer leaves the rank no chance to write anything),
on every node, for the watcher's verdict and launch's line, and the table becomes one line per rank. Parsing the
printed table instead would tie wattgate to its format and to one node's output.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

from wattgate.errors import first_line
from wattgate.heartbeats import write_rank_exit


def signal_text(exitcode: int) -> str:
    """'killed by SIGKILL (signal 9)' for a negative wait status, else 'exit status N'."""
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = "an unknown signal"
        return f"killed by {name} (signal {-exitcode})"
    return f"exit status {exitcode}"


def record_failures(run: Path, failures: dict) -> list[str]:
    """Write each failed rank's record (torch's ProcessFailure by global rank); one line per rank to print."""
    lines = []
    for rank, f in sorted(failures.items()):
        write_rank_exit(run, int(rank), int(f.local_rank), int(f.pid), int(f.exitcode))
        lines.append(
            f"torchrun: rank {rank} (local rank {f.local_rank}, pid {f.pid}) failed: {signal_text(f.exitcode)}"
        )
    return lines


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] != "--run-dir":
        print("usage: python -m wattgate.train.torchrun --run-dir DIR <torchrun arguments>", file=sys.stderr)
        return 2
    run, args = Path(argv[1]), argv[2:]
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    try:
        torchrun_main(args)
    except ChildFailedError as exc:
        for line in record_failures(run, exc.failures):
            print(line, file=sys.stderr, flush=True)
        return 1
    except SignalException as exc:
        # torchrun gave its ranks the signal and ~30 s to exit, then SIGKILL: the ranks' own lines say how they ended
        name = signal.Signals(exc.sigval).name
        print(f"torchrun: stopped by {name}; its ranks were sent {name}", file=sys.stderr, flush=True)
        return 128 + int(exc.sigval)
    except Exception as exc:  # e.g. the rendezvous store lost with the node that hosted it: that node's line says why
        print(f"torchrun: {type(exc).__name__}: {first_line(exc)}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
