"""Workloads: one module per network. Importing this package fills the registry."""

from scalelab.workloads import alexnet, charcnn, deepstack, mlp, resnet, user_model, vgg  # noqa: F401
from scalelab.workloads.base import WORKLOADS, Inputs, LayerCost, Workload

user_model.entry_point_workloads()  # packages' models: group scalelab.workloads

__all__ = ["WORKLOADS", "Inputs", "LayerCost", "Workload"]
