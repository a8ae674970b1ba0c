"""`wattgate <stage>`: one subcommand per stage, the same under Snakemake and by hand.

Exit status: 0 success, 1 the stage ran and found a failure, 2 usage or input
error with a one-line message on stderr.
"""

from __future__ import annotations

import os
import sys

from wattgate.cli.parser import build_parser
from wattgate.errors import InputError, StageFailed, first_line

__all__ = ["build_parser", "main", "os_error_line"]


OS_ERROR_ADVICE = {
    "ENOSPC": "free space there or point {flag} elsewhere",
    "EDQUOT": "free space in your quota or point {flag} elsewhere",
    "EROFS": "the filesystem is read-only: point {flag} at a writable folder",
    "EACCES": "check the permissions of the file and its folder",
    "EPERM": "check the permissions of the file and its folder",
    "ENOENT": "check the path",
}


def os_error_line(exc: OSError, flag: str = "--out") -> str:
    """'<file>: <what happened> (<what to do>)' for an OSError from anywhere in a stage; `flag`: the option naming
    where the stage writes (--run-dir for train and launch)."""
    import errno

    code = errno.errorcode.get(exc.errno or 0, "")
    where = exc.filename if exc.filename is not None else "(no file named)"
    what = exc.strerror or str(exc)
    advice = OS_ERROR_ADVICE.get(code)
    return f"{where}: {what}" + (f" ({advice.format(flag=flag)})" if advice else "")


def main(argv: list[str] | None = None) -> int:
    rc = _run_stage(argv)
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a rank under torchrun
        _end_rank(rc)
    return rc


def _end_rank(rc: int) -> None:
    """Exit a torchrun rank after Python's exit handlers, without the interpreter's teardown.

    gloo's worker threads drop their last collective's tensors only after the collective has
    returned, and `destroy_process_group` does not join them. When that drop lands inside
    interpreter teardown, the worker's GIL request aborts the process ("terminate called without
    an active exception", SIGABRT) after the stage has succeeded: seen in CI, and here in about
    1 of 170 two-rank load-checks on a loaded 2-core machine. Exit handlers (logging, thread
    pools, TensorBoard) still run; the teardown that follows them has nothing left to save.
    """
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can reach it
            pass
    os._exit(rc)


def _run_stage(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from wattgate.config import load_run_config

    try:
        config = load_run_config(args.config) if args.config is not None else None
        rc = args.func(args, config)
        if isinstance(rc, int):
            return rc
    except InputError as exc:  # a trainer refused by another's lock writes nothing into that run folder
        return _failed(args, f"error: {exc}", 2, record=type(exc).__name__ != "RunLocked")
    except StageFailed as exc:
        return _failed(args, f"failed: {exc}", 1)
    except OSError as exc:  # disk full, read-only, permission, missing file: one line, never a traceback
        flag = "--run-dir" if args.stage in ("train", "launch") else "--out"
        return _failed(args, f"error: {os_error_line(exc, flag)}", 2)
    except KeyboardInterrupt:
        return _failed(args, "interrupted", 130)
    except Exception as exc:  # a traceback follows; a training rank still leaves its one line for the verdict
        _record_rank_error(args, f"{type(exc).__name__}: {first_line(exc)}", 1)
        raise
    return 0


def _failed(args, text: str, code: int, record: bool = True) -> int:
    print(f"wattgate {args.stage}: {text}", file=sys.stderr)
    if record:
        _record_rank_error(args, text.partition(": ")[2] or text, code)
    return code


def _record_rank_error(args, text: str, code: int) -> None:
    """A training rank's failure record beside its heartbeat (its line, exit status, step and phase), for the
    watcher's verdict and launch's line; only into a run folder train has claimed (never a foreign --run-dir)."""
    if args.stage != "train" or "RANK" not in os.environ:
        return
    from wattgate.artifacts import marker_stage
    from wattgate.heartbeats import write_rank_error

    if marker_stage(args.run) == "train":
        write_rank_error(args.run, int(os.environ["RANK"]), text, code)


if __name__ == "__main__":
    sys.exit(main())
