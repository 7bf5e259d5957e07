"""CLI options generated from the typed RunConfig, so a new config field is a new flag.

With `lists=True` every numeric flag also takes a comma list (`--lr 0.01,0.1,0.5`); such a
command line stands for one run per value, the cartesian product when several flags are
lists (`expand_lists`).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import types
import typing
from collections.abc import Callable
from typing import Any

from scalelab.config import RunConfig
from scalelab.config_sections import SECTIONS
from scalelab.errors import UsageError

SKIP = {"workload"}
# Fields only a real run reads (records, checkpoints, instrumentation, data): commands that
# plan, predict or list do not show them in --help.
RUN_ONLY = frozenset(
    {"check", "weights", "save_weights", "ckpt_every", "ckpt_dir", "resume", "compare_devices",
     "trace", "nvml", "per_layer", "workers", "oversubscribe_gpus", "data_dir", "iters",
     "warmup", "train_size", "heldout_size", "epochs", "steps"}
)  # fmt: skip
# What sizes a model: the analytic layer table reads only these.
SHAPE = frozenset(
    {"batch", "dtype", "image_size", "num_classes", "hidden", "convs", "fcs", "swap_relu_pool",
     "model", "model_arg", "input_shape", "input_dtype", "vocab"}
)  # fmt: skip
MODEL_WORKLOAD = "model"  # the workload --model runs under (workloads/user_model.py)


def add_workload_argument(p: argparse.ArgumentParser, nargs: str | None = "?") -> None:
    """The WORKLOAD positional; --model MODULE:FACTORY stands in for it."""
    p.add_argument(
        "workload", nargs=nargs, help="workload name (scalelab list); or --model MODULE:FACTORY"
    )


def workload_name(args: argparse.Namespace, required: bool = True) -> str | None:
    """The workload a command runs: its positional name, or `model` under --model."""
    given, model = getattr(args, "workload", None), getattr(args, "model", None)
    if model is not None:
        if given not in (None, MODEL_WORKLOAD):
            raise UsageError(f"give a workload name ({given}) or --model {model}, not both")
        return MODEL_WORKLOAD
    if given is None and required:
        raise UsageError("name a workload (scalelab list) or give --model MODULE:FACTORY")
    return given


def _base_type(hint: Any) -> type:
    """int | None -> int."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


def _value_or_list(kind: type) -> Callable[[str], Any]:
    """`0.1` -> 0.1, `0.1,0.5` -> [0.1, 0.5]; a bad item fails as argparse's own type would."""

    def parse(text: str) -> Any:
        values = [kind(item) for item in text.split(",")]
        return values if len(values) > 1 else values[0]

    parse.__name__ = kind.__name__  # argparse names the type in "invalid int value: 'x'"
    return parse


def add_config_options(
    parser: argparse.ArgumentParser,
    skip: set[str] = frozenset(),
    lists: bool = False,
    only: set[str] | None = None,
) -> None:
    """A flag per RunConfig field, grouped in --help by the field's config section; only:
    just these (help shows what the command reads)."""
    hints = typing.get_type_hints(RunConfig)
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in dataclasses.fields(RunConfig):
        if f.name in SKIP or f.name in skip or (only is not None and f.name not in only):
            continue
        title = SECTIONS[f.metadata["section"]].title  # the shape sections share one group
        if title not in groups:
            groups[title] = parser.add_argument_group(f"{title} options")
        _add_option(groups[title], f, hints[f.name], lists)


def _add_option(
    parser: argparse._ArgumentGroup, f: dataclasses.Field, hint: Any, lists: bool
) -> None:
    flag = "--" + f.name.replace("_", "-")
    kind = _base_type(hint)
    help_text = f.metadata.get("help", "")
    if kind is bool:
        flags = ("-q", flag) if f.name == "quiet" else (flag,)
        parser.add_argument(*flags, action="store_true", default=None, help=help_text)
    elif typing.get_origin(kind) is tuple:  # repeatable: --model-arg a=1 --model-arg b=2
        parser.add_argument(
            flag, action=_AppendTuple, default=None, metavar="KEY=VALUE", help=help_text
        )
    else:
        numeric = lists and kind in (int, float)
        parser.add_argument(
            flag,
            type=_value_or_list(kind) if numeric else kind,
            default=None,
            metavar=f.name.upper() + (",..." if numeric else ""),
            help=f"{help_text} (default: {f.default})",
        )


class _AppendTuple(argparse.Action):
    """Collects a repeatable flag into a tuple (a list would read as a comma-list study)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, (*(getattr(namespace, self.dest) or ()), values))


def config_from_args(args: argparse.Namespace, **overrides: Any) -> RunConfig:
    """RunConfig from the parsed flags: only the flags the user gave override the defaults."""
    given = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(RunConfig)
        if f.name not in SKIP and getattr(args, f.name, None) is not None
    }
    return RunConfig(**_derived_by_strategy({**given, **overrides}))


def _derived_by_strategy(given: dict[str, Any]) -> dict[str, Any]:
    """The given flags with what the chosen strategy derives from them (a pipeline's stages
    from --ranks); an unknown strategy is left for RunConfig to refuse."""
    from scalelab.strategies import STRATEGIES

    name = given.get("strategy", RunConfig.strategy)
    return STRATEGIES.get(name).derived_flags(given) if name in STRATEGIES else given


def workload_config(args: argparse.Namespace, **overrides: Any) -> RunConfig:
    """config_from_args for the commands that model a workload without running a strategy
    (`layers`, `fit`, `predict`): a shape option the workload would not read is refused, as
    `scalelab run` refuses it."""
    from scalelab import config_sections
    from scalelab.workloads import WORKLOADS

    cfg = config_from_args(args, **overrides)
    config_sections.refuse_unread_shapes(cfg, WORKLOADS.get(cfg.workload))
    return cfg


def list_options(args: argparse.Namespace) -> dict[str, list[Any]]:
    """The config flags given as comma lists: field name -> values."""
    return {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(RunConfig)
        if isinstance(getattr(args, f.name, None), list)
    }


def expand_lists(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One {field: value} per run of the cartesian product of the list flags ([{}]: none)."""
    lists = list_options(args)
    return [dict(zip(lists, combo)) for combo in itertools.product(*lists.values())]


def flag_of(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")
