"""Errors that the CLI turns into one line and an exit code, never a traceback.

The exit-code contract (enforced in `scalelab.cli.main`, documented in docs/USAGE.md, "Exit codes"):
0 ok; 1 the check (or a scripted performance reference) failed, or the run failed after work
started (a dead rank, non-finite weights, out of memory) with a `failed` record; 2 bad input or
a refused configuration: one line on stderr, nothing written; 3 internal error (a bug).
"""

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERNAL = 3


class UsageError(Exception):
    """Bad input from the user (flags, data files, topology). Exit code 2, nothing written."""

    exit_code = EXIT_USAGE


class CheckFailed(Exception):
    """A run finished but its output disagrees with the float64 oracle. Exit code 1."""

    exit_code = EXIT_FAILED


class RunFailed(Exception):
    """Work started and then failed (a dead rank, non-finite results, out of memory); a
    `failed` record says what happened. Exit code 1, one line."""

    exit_code = EXIT_FAILED
