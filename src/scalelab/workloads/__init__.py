"""Workloads: one module per network. Importing this package fills the registry."""

from scalelab.workloads import alexnet, charcnn, deepstack, mlp, resnet, vgg  # noqa: F401
from scalelab.workloads.base import WORKLOADS, Inputs, LayerCost, Workload

__all__ = ["WORKLOADS", "Inputs", "LayerCost", "Workload"]
