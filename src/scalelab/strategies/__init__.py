"""Strategies: one module per way of executing a workload. Importing fills the registry.

Every module of the package that registers a strategy is imported here, found by its
`@STRATEGIES.register` line, so a new strategy is one new module; the helpers (fsdp_comm,
tensor_dtensor, ...) stay unimported until a strategy builds, since they pull in torch's
optional engines (tests/test_startup.py). A package outside scalelab adds strategies through
the entry-point group `scalelab.strategies` (`name = module`, importing it registers `name`),
as its networks come through `scalelab.workloads`.
"""

import logging
import re
from importlib import import_module
from importlib.metadata import entry_points
from pathlib import Path

from scalelab.strategies.base import STRATEGIES, Strategy

_REGISTERS = re.compile(r"^@STRATEGIES\.register\(", re.MULTILINE)


def _register_all() -> None:
    here = Path(__file__).parent
    for path in sorted(here.rglob("*.py")):
        if _REGISTERS.search(path.read_text(encoding="utf-8")):
            parts = path.relative_to(here).with_suffix("").parts
            import_module(".".join((__name__, *parts)))


def _register_entry_points() -> None:
    for ep in entry_points(group="scalelab.strategies"):
        if ep.name in STRATEGIES:
            continue  # a shipped name wins
        try:
            ep.load()
        except Exception as exc:  # one broken package must not stop every command
            logging.getLogger(__name__).warning(
                "strategy entry point %s = %s not loaded: %s", ep.name, ep.value, exc
            )
            continue
        if ep.name not in STRATEGIES:
            logging.getLogger(__name__).warning(
                "strategy entry point %s = %s registers no strategy %r", ep.name, ep.value, ep.name
            )


_register_all()
_register_entry_points()


def lineage(name: str) -> list[str]:
    """The registered names of strategy `name` and its ancestors, nearest first: what predict
    and plan look up by name, so a subclass inherits its parent's model unless it has its own."""
    names = []
    for cls in STRATEGIES.get(name).__mro__:
        own = cls.__dict__.get("name")
        if isinstance(own, str) and own in STRATEGIES and STRATEGIES.get(own) is cls:
            names.append(own)
    return names


__all__ = ["STRATEGIES", "Strategy", "lineage"]
