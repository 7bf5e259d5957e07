"""CLI options generated from the typed RunConfig, so a new config field is a new flag."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any

from scalelab.config import RunConfig

SKIP = {"workload", "extra"}


def _base_type(hint: Any) -> type:
    """int | None -> int."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


def add_config_options(parser: argparse.ArgumentParser, skip: set[str] = frozenset()) -> None:
    hints = typing.get_type_hints(RunConfig)
    for f in dataclasses.fields(RunConfig):
        if f.name in SKIP or f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = _base_type(hints[f.name])
        help_text = f.metadata.get("help", "")
        if kind is bool:
            parser.add_argument(flag, action="store_true", default=None, help=help_text)
        else:
            parser.add_argument(
                flag,
                type=kind,
                default=None,
                metavar=f.name.upper(),
                help=f"{help_text} (default: {f.default})",
            )


def config_from_args(args: argparse.Namespace, **overrides: Any) -> RunConfig:
    """RunConfig from the parsed flags: only the flags the user gave override the defaults."""
    given = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(RunConfig)
        if f.name not in SKIP and getattr(args, f.name, None) is not None
    }
    return RunConfig(**{**given, **overrides})
