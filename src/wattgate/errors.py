"""Errors that end a stage with a one-line message instead of a traceback."""


class InputError(Exception):
    """Bad usage or unreadable/invalid input: the CLI prints the message and exits 2."""


class StageFailed(Exception):
    """The stage ran and found a failure (e.g. a gate check): exit 1."""
