"""The spatial split's trunk of a workload, derived from its layer description: see
scalelab.planning.trunk (re-exported here)."""

from scalelab.planning.trunk import Step, Trunk, trunk_for, trunk_from_layers  # noqa: F401
