"""Errors that the CLI turns into one line and an exit code, never a traceback."""


class UsageError(Exception):
    """Bad input from the user (flags, data files, topology). Exit code 2, nothing written."""

    exit_code = 2


class CheckFailed(Exception):
    """A run finished but its output disagrees with the float64 oracle. Exit code 1."""

    exit_code = 1
