"""`scalelab` entry point: subcommands, and the one place errors become exit codes."""

from __future__ import annotations

import argparse
import faulthandler
import os
import sys
import typing

from scalelab import __version__
from scalelab.cli.base import COMMANDS
from scalelab.errors import CheckFailed, UsageError


class OneLineParser(argparse.ArgumentParser):
    """Bad flags give one line naming the problem and exit code 2 (argparse prints usage too)."""

    def error(self, message: str) -> typing.NoReturn:
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    from scalelab.cli import commands  # noqa: F401  (fills COMMANDS)

    parser = OneLineParser(
        prog="scalelab",
        description="Run a network under one execution strategy after another, check that "
        "they compute the same function, and explain where the time goes.",
    )
    parser.add_argument("--version", action="version", version=f"scalelab {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)
    sub.required = True
    for name in COMMANDS:
        cmd = COMMANDS.get(name)
        p = sub.add_parser(name, help=COMMANDS.describe(name), description=COMMANDS.describe(name))
        cmd.add_arguments(p)
        p.set_defaults(handler=cmd.run)
    return parser


def watch_for_hangs() -> None:
    """SCALELAB_STACKS_AFTER_S=T: every process (each rank too) prints all its threads' Python
    stacks to stderr after T seconds, and again every T seconds, without stopping: where a
    rank waits in a collective that never completes shows up in the log."""
    after = os.environ.get("SCALELAB_STACKS_AFTER_S")
    if after:
        faulthandler.dump_traceback_later(float(after), repeat=True, file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    watch_for_hangs()
    args = build_parser().parse_args(argv)
    args.argv = list(argv)  # a launcher re-runs exactly this command line on every rank
    try:
        return args.handler(args)
    except UsageError as exc:
        sys.stderr.write(f"scalelab {args.command}: error: {exc}\n")
        return exc.exit_code
    except CheckFailed as exc:
        sys.stderr.write(f"scalelab {args.command}: check failed: {exc}\n")
        return exc.exit_code
    except KeyboardInterrupt:
        sys.stderr.write("scalelab: interrupted\n")
        return 130
    except Exception as exc:
        if os.environ.get("SCALELAB_DEBUG"):
            raise
        sys.stderr.write(
            f"scalelab {args.command}: internal error: {type(exc).__name__}: {exc} "
            "(set SCALELAB_DEBUG=1 for the traceback)\n"
        )
        return 1
