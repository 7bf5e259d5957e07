"""Subcommands register here: each is a module with add_arguments(parser) and run(args)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

from scalelab.registry import Registry


@dataclass(frozen=True)
class Command:
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


COMMANDS: Registry[Command] = Registry("command")
