"""The registry of strategy models (MODELS, filled by predict/models/*.py) and which model
predicts a strategy: its own, else its nearest registered ancestor's (the strategy class's
MRO), so a strategy that subclasses another is predicted as its parent unless it registers
a model of its own. Apart from models/base.py so calibration can group by model without
importing the models."""

from __future__ import annotations

from scalelab.registry import Registry
from scalelab.strategies import STRATEGIES, lineage

# strategy name -> its StrategyModel subclass (models/base.py), untyped here: that module
# imports this one
MODELS: Registry[type] = Registry("strategy model")


def modelled_as(strategy: str) -> str | None:
    """The nearest registered ancestor of strategy (itself first) that has a model, else None."""
    if strategy not in STRATEGIES:
        return strategy if strategy in MODELS else None
    return next((name for name in lineage(strategy) if name in MODELS), None)


def modelled_by(strategy: str) -> str:
    """The name of the model that predicts `strategy` (itself where none does)."""
    return modelled_as(strategy) or strategy
