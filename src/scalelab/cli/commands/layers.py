"""`scalelab layers WORKLOAD`: the analytic cost table (shapes, parameters, FLOPs, bytes)."""

from __future__ import annotations

import argparse

from scalelab.cli.base import COMMANDS, Command
from scalelab.cli.options import SHAPE, add_config_options, config_from_args
from scalelab.precision import get_precision
from scalelab.workloads import WORKLOADS


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("workload", help="workload name (scalelab list)")
    add_config_options(p, only=SHAPE)


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args, workload=args.workload)
    workload = WORKLOADS.get(cfg.workload)(cfg)
    itemsize = get_precision(cfg.dtype).itemsize
    rows = workload.cost_table()
    print(
        f"{'layer':<14}{'kind':<11}{'output (per item)':<22}{'params':>12}"
        f"{'MFLOP':>12}{'MB moved':>11}   (batch {cfg.batch}, {cfg.dtype})"
    )
    for r in rows:
        shape = "x".join(map(str, r.out_shape))
        print(
            f"{r.name:<14}{r.kind:<11}{shape:<22}{r.params:>12,}"
            f"{r.flops * cfg.batch / 1e6:>12.1f}{r.bytes_moved(cfg.batch, itemsize) / 1e6:>11.2f}"
        )
    total = sum(r.flops for r in rows) * cfg.batch
    params = sum(r.params for r in rows)
    print(f"{'total':<47}{params:>12,}{total / 1e6:>12.1f}")
    return 0


COMMANDS.register("layers", "the analytic per-layer cost table of a workload")(
    Command(add_arguments, run)
)
