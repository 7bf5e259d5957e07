"""The one description of a network's layers, from which every consumer derives its view:
the cost table (`layers`, roofline, predict), the pipeline's cut points, the spatial split's
trunk, the fast path's stage list.

A workload returns its layers with `Workload.layers(model)`; running the layers' modules one
after another on the prepared input (N, ...) gives the model's forward (tested per workload).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torch import nn

# How a layer acts along the spatial split axis (rows of an image, positions of a text):
#   window: reads kernel rows per output row (conv, pooling): needs halos of its geometry
#   point:  row-local (ReLU, LRN across channels, BatchNorm in eval, element-wise)
#   norm:   moments over the whole map, split axis included (LayerNorm over (C, L))
#   global: mixes every position (flatten, linear, global pooling): ends the spatial trunk
Reach = Literal["window", "point", "norm", "global"]


@dataclass(frozen=True)
class Layer:
    name: str  # as in the seeds' tables: c1, relu1, pool1, fc6 (else the module's dotted path)
    kind: str  # conv, linear, relu, lrn, maxpool, batchnorm, layernorm, flatten, cast, block, ...
    module: nn.Module  # the model's own submodule (same parameters) or parameter-free glue
    reach: Reach = "global"
    kernel: int = 1  # along the split axis (square kernels: the other spatial axes too)
    stride: int = 1
    pad: int = 0
    path: str | None = None  # dotted path in the model; None for glue the forward calls inline
