"""`scalelab layers WORKLOAD`: the analytic cost table (shapes, parameters, FLOPs, bytes)."""

from __future__ import annotations

import argparse

from scalelab.cli.base import COMMANDS, Command
from scalelab.cli.options import (
    SHAPE,
    add_config_options,
    add_workload_argument,
    workload_config,
    workload_name,
)
from scalelab.precision import get_precision
from scalelab.workloads import WORKLOADS


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_workload_argument(p)
    add_config_options(p, only=SHAPE)


def run(args: argparse.Namespace) -> int:
    cfg = workload_config(args, workload=workload_name(args))
    workload = WORKLOADS.get(cfg.workload)(cfg)
    itemsize = get_precision(cfg.dtype).itemsize
    rows = workload.cost_table()
    w = max([14, *(len(r.name) + 1 for r in rows)])
    k = max([11, *(len(r.kind) + 1 for r in rows)])
    print(
        f"{'layer':<{w}}{'kind':<{k}}{'output (per item)':<22}{'params':>12}"
        f"{'MFLOP':>12}{'MB moved':>11}   (batch {cfg.batch}, {cfg.dtype})"
    )
    for r in rows:
        shape = "x".join(map(str, r.out_shape))
        print(
            f"{r.name:<{w}}{r.kind:<{k}}{shape:<22}{r.params:>12,}"
            f"{r.flops * cfg.batch / 1e6:>12.1f}{r.bytes_moved(cfg.batch, itemsize) / 1e6:>11.2f}"
        )
    total = sum(r.flops for r in rows) * cfg.batch
    params = sum(r.params for r in rows)
    print(f"{'total':<{w + k + 22}}{params:>12,}{total / 1e6:>12.1f}")
    return 0


COMMANDS.register("layers", "the analytic per-layer cost table of a workload")(
    Command(add_arguments, run)
)
