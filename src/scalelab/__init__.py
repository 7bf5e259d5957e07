"""scalelab: run a network under one execution strategy after another, check they agree,
and explain where the time goes."""

__version__ = "0.1.0"
