"""`scalelab demo`: the main job. A small study end to end on whatever this machine has
(CPU only, one GPU, several): ceilings, `versions alexnet` at a small size, mlp training with
mpi-dp on 1 and 2 ranks, a tiny scaling sweep, then the HTML report. The study itself lives in
scalelab.orchestration.demo; this module only parses flags."""

from __future__ import annotations

import argparse

from scalelab.cli.base import COMMANDS, Command
from scalelab.orchestration.demo import run_demo


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-o",
        "--out-dir",
        default="scalelab-results",
        help="folder for records, plots and the report (default: ./scalelab-results)",
    )
    p.add_argument(
        "--data-dir",
        default=None,
        help="folder with the MNIST IDX files (synthetic digits otherwise)",
    )
    p.add_argument("--quick", action="store_true", help="fewer iterations and points")
    p.add_argument(
        "--force",
        action="store_true",
        help="rerun every step instead of resuming from earlier records",
    )


def run(args: argparse.Namespace) -> int:
    return run_demo(args.out_dir, args.data_dir, args.quick, force=args.force)


COMMANDS.register("demo", "a small study end to end on this machine, then the report")(
    Command(add_arguments, run)
)
