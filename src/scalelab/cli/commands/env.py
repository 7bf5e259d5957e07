"""`scalelab env`: the environment a record would carry."""

from __future__ import annotations

import argparse
import json

from scalelab import environment
from scalelab.cli.base import COMMANDS, Command


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print as JSON")


def run(args: argparse.Namespace) -> int:
    info = environment.collect(load_mpi=True)
    if args.json:
        print(json.dumps(info))
    else:
        width = max(map(len, info))
        print("\n".join(f"{k:<{width}}  {v}" for k, v in info.items()))
    return 0


COMMANDS.register("env", "GPU, driver, CUDA, torch, MPI library, CPU and git commit")(
    Command(add_arguments, run)
)
