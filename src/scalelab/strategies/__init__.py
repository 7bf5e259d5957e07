"""Strategies: one module per way of executing a workload. Importing fills the registry.

Every module of the package that registers a strategy is imported here, found by its
`@STRATEGIES.register` line, so a new strategy is one new module; the helpers (fsdp_comm,
tensor_dtensor, ...) stay unimported until a strategy builds, since they pull in torch's
optional engines (tests/test_startup.py).
"""

import re
from importlib import import_module
from pathlib import Path

from scalelab.strategies.base import STRATEGIES, Strategy

_REGISTERS = re.compile(r"^@STRATEGIES\.register\(", re.MULTILINE)


def _register_all() -> None:
    here = Path(__file__).parent
    for path in sorted(here.rglob("*.py")):
        if _REGISTERS.search(path.read_text(encoding="utf-8")):
            parts = path.relative_to(here).with_suffix("").parts
            import_module(".".join((__name__, *parts)))


_register_all()


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
