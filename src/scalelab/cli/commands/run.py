"""`scalelab run WORKLOAD`: one run under one strategy; also the per-rank entry point."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from scalelab.cli.base import COMMANDS, Command
from scalelab.cli.options import add_config_options, config_from_args
from scalelab.comm.launch import inside_launcher, relaunch
from scalelab.record import DEFAULT_RESULTS
from scalelab.runner import execute, format_summary
from scalelab.strategies import STRATEGIES


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("workload", help="workload name (scalelab list)")
    add_config_options(p)
    p.add_argument(
        "--out",
        default=str(DEFAULT_RESULTS),
        help=f"results file the record is appended to (default: {DEFAULT_RESULTS})",
    )
    p.add_argument("--no-record", action="store_true", help="write no record")
    p.add_argument(
        "--json",
        action="store_true",
        help="print the record as one line of JSON, the last line printed",
    )


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args, workload=args.workload)
    launcher = STRATEGIES.get(cfg.strategy).launcher
    if launcher is not None and cfg.ranks > 1 and not inside_launcher(launcher):
        return relaunch(launcher, cfg.ranks, args.argv)
    report = execute(cfg, None if args.no_record else Path(args.out))
    if report.record is None:  # not the root rank
        return report.exit_code
    print(format_summary(report.record))
    if not args.no_record:
        print(f"  record appended to {args.out}")
    if args.json:
        sys.stdout.flush()
        print(json.dumps(report.record))
    return report.exit_code


COMMANDS.register("run", "run one workload under one strategy and append a record")(
    Command(add_arguments, run)
)
