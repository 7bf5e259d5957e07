"""`scalelab` entry point: subcommands, and the one place errors become exit codes.

The contract (docs/USAGE.md, "Exit codes"): 0 ok; 1 the check failed or the run failed after work
started (one line, a `failed` record); 2 bad input or a refused configuration (one line on
stderr, nothing written); 3 internal error (a bug: one line, SCALELAB_DEBUG=1 for the traceback).
"""

from __future__ import annotations

import argparse
import difflib
import faulthandler
import logging
import os
import sys
import typing
import warnings

from scalelab import __version__, eager_process
from scalelab.cli.base import COMMANDS
from scalelab.comm import job_status
from scalelab.comm.launch import die_with_parent
from scalelab.errors import EXIT_FAILED, EXIT_INTERNAL, EXIT_OK, EXIT_USAGE, CheckFailed, UsageError
from scalelab.instrument.timer import HUB

log = logging.getLogger("scalelab")

# Third-party warnings that tell a scalelab user nothing they can act on, each printed once per
# rank otherwise: (message regex, category). torch's own pipelining tracer checks
# `isinstance(spec, LeafSpec)`, which torch >= 2.10 deprecates.
QUIET_WARNINGS = ((r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning),)


def quiet_third_party_warnings() -> None:
    """Every process runs main() (ranks too: launchers start `python -m scalelab run`), so the
    filter holds in every rank."""
    for message, category in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)


class OneLineParser(argparse.ArgumentParser):
    """Bad flags give one line naming the problem and exit code 2 (argparse prints usage too);
    an unknown option names the closest one the command takes."""

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}{self._closest(parsed, extras)}")
        return parsed

    def _closest(self, parsed: argparse.Namespace, extras: list[str]) -> str:
        """' (did you mean --strategy?)' for the first unknown option with a close match
        among the chosen subcommand's options."""
        parser: argparse.ArgumentParser = self
        for action in self._actions:  # the subcommand's own parser holds its options
            if isinstance(action, argparse._SubParsersAction):
                parser = action.choices.get(getattr(parsed, action.dest, None), self)
        known = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
        for extra in extras:
            if extra.startswith("--"):
                near = difflib.get_close_matches(extra.split("=", 1)[0], known, n=1)
                if near:
                    return f" (did you mean {near[0]}?)"
        return ""

    def error(self, message: str) -> typing.NoReturn:
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(EXIT_USAGE)


def verbosity_options() -> argparse.ArgumentParser:
    """-v/-q for every subcommand (stdlib logging levels; `run` maps -q to its --quiet)."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "-v", "--verbose", action="count", default=0, help="more log lines on stderr (-vv: debug)"
    )
    return common


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser of every command, or, given the command line, of the command it names."""
    from scalelab.cli import commands

    chosen = argv[0] if argv and argv[0] in commands.MODULES else None
    commands.load(chosen)

    parser = OneLineParser(
        prog="scalelab",
        description="Run a network under one execution strategy after another, check that "
        "they compute the same function, and explain where the time goes. Exit codes: 0 ok, "
        "1 check failed or run failed, 2 bad input (one line, nothing written), 3 internal error.",
    )
    parser.add_argument("--version", action="version", version=f"scalelab {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)
    sub.required = True
    common = verbosity_options()
    for name in [chosen] if chosen else commands.MODULES:
        cmd = COMMANDS.get(name)
        p = sub.add_parser(
            name,
            help=COMMANDS.describe(name),
            description=COMMANDS.describe(name),
            parents=[common],
        )
        cmd.add_arguments(p)
        if not any("--quiet" in a.option_strings for a in p._actions):
            p.add_argument("-q", "--quiet", action="store_true", default=None, help="warnings only")
        p.set_defaults(handler=cmd.run)
    return parser


def watch_for_hangs() -> None:
    """SCALELAB_STACKS_AFTER_S=T: every process (each rank too) prints all its threads' Python
    stacks to stderr after T seconds, and again every T seconds, without stopping: where a
    rank waits in a collective that never completes shows up in the log."""
    after = os.environ.get("SCALELAB_STACKS_AFTER_S")
    if after:
        faulthandler.dump_traceback_later(float(after), repeat=True, file=sys.stderr)


def setup_logging(args: argparse.Namespace) -> None:
    """Progress and notes are INFO on stderr; -q keeps warnings, -v adds debug lines."""
    level = logging.INFO
    if getattr(args, "quiet", None):
        level = logging.WARNING
    elif getattr(args, "verbose", 0):
        level = logging.DEBUG
    log.setLevel(level)
    log.propagate = False
    for handler in list(log.handlers):
        log.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)  # the current stderr (tests capture it)
    handler.setFormatter(logging.Formatter("%(message)s"))
    log.addHandler(handler)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    quiet_third_party_warnings()
    eager_process.stay_eager()  # until something compiles: no torch._dynamo import (~2 s CPU)
    watch_for_hangs()
    args = build_parser(argv).parse_args(argv)
    args.argv = list(argv)  # a launcher re-runs exactly this command line on every rank
    setup_logging(args)
    if job_status.start_beacon():  # a rank of a job scalelab launched: report phases
        HUB.beacon = job_status.beacon  # every phase the timer opens lands on its status page
        # ... and dies with its launcher: torchrun starts its workers in a session of their
        # own, so a killed torchrun (or watcher) would leave them running past scancel
        die_with_parent()
    try:
        return args.handler(args)
    except UsageError as exc:
        return _one_line(args, "error", exc, exc.exit_code)
    except CheckFailed as exc:
        return _one_line(args, "check failed", exc, exc.exit_code)
    except BrokenPipeError:
        return _reader_gone()
    except KeyboardInterrupt:
        sys.stderr.write("scalelab: interrupted\n")
        return 130
    except Exception as exc:
        return _failure(args, exc)


def _one_line(args: argparse.Namespace, kind: str, exc: BaseException | str, code: int) -> int:
    """The contract's one line; a rank of a job scalelab launched hands it to the launching
    process instead, which prints the first rank's line once."""
    text = " ".join(str(exc).split("\n"))
    line = f"scalelab {args.command}: {kind}: {text}"
    if not job_status.report(line, code) and not _said_by_task0(code):
        sys.stderr.write(line + "\n")
    return code


def _said_by_task0(code: int) -> bool:
    """srun's tasks refuse alike (the same command line on each): task 0 says it once."""
    from scalelab.comm.slurm_env import srun_launched

    return code == EXIT_USAGE and srun_launched() and os.environ.get("SLURM_PROCID") != "0"


def _reader_gone() -> int:
    """`scalelab layers vgg16 | head -2`: the reader left; end quietly, as `cat` would.
    stdout goes to /dev/null so the interpreter's final flush cannot fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    return EXIT_OK


def _failure(args: argparse.Namespace, exc: Exception) -> int:
    """Exceptions no layer turned into a UsageError: a failed run (1) when the failure is
    the run's own (out of memory, a failed run), else a bug (3)."""
    if os.environ.get("SCALELAB_DEBUG"):
        raise exc
    code = getattr(exc, "exit_code", None)
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return _one_line(args, "failed", f"out of memory: {exc}", EXIT_FAILED)
    if code == EXIT_FAILED:
        return _one_line(args, "failed", exc, EXIT_FAILED)
    if type(exc).__module__ == "mpi4py.MPI":  # the MPI library's error: the run failed in it
        return _one_line(args, "failed", f"MPI: {exc}", EXIT_FAILED)
    if isinstance(exc, UnicodeDecodeError):  # a user's file: only readers decode bytes
        return _one_line(args, "error", f"a file is not UTF-8 text ({exc.reason})", EXIT_USAGE)
    text = f"{type(exc).__name__}: {exc} (a bug: please report it; SCALELAB_DEBUG=1: traceback)"
    return _one_line(args, "internal error", text, EXIT_INTERNAL)
