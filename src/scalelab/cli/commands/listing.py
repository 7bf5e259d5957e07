"""`scalelab list`: the registries, one line each."""

from __future__ import annotations

import argparse

from scalelab.cli.base import COMMANDS, Command
from scalelab.precision import PRECISIONS
from scalelab.registry import Registry
from scalelab.strategies import STRATEGIES
from scalelab.workloads import WORKLOADS


def add_arguments(p: argparse.ArgumentParser) -> None:
    del p  # no options


def _section(title: str, registry: Registry) -> list[str]:
    width = max(len(n) for n in registry.names())
    return [f"{title}:"] + [f"  {n:<{width}}  {registry.describe(n)}" for n in registry.names()]


def run(args: argparse.Namespace) -> int:
    lines = _section("workloads", WORKLOADS) + [""] + _section("strategies", STRATEGIES)
    lines += [
        "",
        "dtypes: " + ", ".join(f"{p.name} (tol {p.tolerance:g})" for p in PRECISIONS.values()),
    ]
    print("\n".join(lines))
    return 0


COMMANDS.register("list", "list workloads, strategies and dtypes")(Command(add_arguments, run))
