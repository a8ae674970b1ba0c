"""Errors that end a stage with a one-line message instead of a traceback."""

# A run that stopped on request (a time limit, preemption, SIGTERM or SIGUSR1) after publishing a checkpoint:
# not a failure, not done. EX_TEMPFAIL: "try again", which is what Snakemake's retry and a rerun do.
EXIT_STOPPED = 75


class InputError(Exception):
    """Bad usage or unreadable/invalid input: the CLI prints the message and exits 2."""


class StageFailed(Exception):
    """The stage ran and found a failure (e.g. a gate check): exit 1."""


def first_line(exc: BaseException) -> str:
    """An exception's message's first line (its type's name when it has none): for one-line errors."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
