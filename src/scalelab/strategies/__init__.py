"""Strategies: one module per way of executing a workload. Importing fills the registry."""

from scalelab.strategies import local, serial  # noqa: F401
from scalelab.strategies.base import STRATEGIES, RunOutput, Strategy

__all__ = ["STRATEGIES", "RunOutput", "Strategy"]
