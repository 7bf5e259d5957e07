"""The analyses' StrategyRoles from the registered strategy classes' own traits."""

from __future__ import annotations

from collections.abc import Callable

from scalelab.analysis.roles import StrategyRoles


def strategy_roles() -> StrategyRoles:
    from scalelab.strategies import STRATEGIES

    classes = {name: STRATEGIES.get(name) for name in STRATEGIES.names()}

    def having(trait: Callable[[type], bool]) -> frozenset[str]:
        return frozenset(name for name, cls in classes.items() if trait(cls))

    return StrategyRoles(
        reference=having(lambda c: c.reference),
        plain_local=having(lambda c: c.plain_local),
        mpi_allreduce=having(lambda c: c.data_parallel and c.launcher == "mpi"),
    )
