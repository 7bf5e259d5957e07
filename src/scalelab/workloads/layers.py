"""The one description of a network's layers, from which every consumer derives its view:
the cost table (workloads/costs.py), the pipeline's cut points (layout/partition.py), the
spatial split's trunk (layout/trunk.py), the fast path's stage list and predict's per-layer
costs.

A workload returns its layers with `Workload.layers(model)`; running the layers' modules one
after another on the prepared input (N, ...) gives the model's forward (tested per workload).
`describe(name, module)` fills kind, reach and geometry from a torch module's type, so most
layers are one call; a block the formulas do not know (a residual block) brings its own `cost`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
from torch import nn

from scalelab.errors import UsageError
from scalelab.workloads import shape_cache

if TYPE_CHECKING:
    from scalelab.workloads.layer_cost import LayerCost

# How a layer acts along the spatial split axis (rows of an image, positions of a text):
#   window: reads kernel rows per output row (conv, pooling): needs halos of its geometry
#   point:  row-local (ReLU, LRN across channels, BatchNorm in eval, element-wise)
#   norm:   moments over the whole map, split axis included (LayerNorm over (C, L))
#   global: mixes every position (flatten, linear, global pooling): ends the spatial trunk
Reach = Literal["window", "point", "norm", "global"]

# (per-item input shape, per-item output shape) -> the layer's cost-table rows
CostFn = Callable[[tuple[int, ...], tuple[int, ...]], "list[LayerCost]"]


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
    cost: CostFn | None = None  # rows of a layer the per-kind formulas (costs.py) do not know


class MatchDtype(nn.Module):
    """Casts the input to the model's floating dtype: prepare() hands over float32, and an
    fp64 model (model.double()) needs fp64 inputs. The dtype is read off an empty buffer, which
    .double() / .to(dtype) convert like any floating buffer; it is not saved in the state_dict.
    """

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("probe", torch.empty(0), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.probe.dtype)


# torch module class -> (kind, reach); a class not listed is kind = its lowercased name, global
KINDS: dict[type[nn.Module], tuple[str, Reach]] = {
    nn.Conv1d: ("conv", "window"),
    nn.Conv2d: ("conv", "window"),
    nn.MaxPool1d: ("maxpool", "window"),
    nn.MaxPool2d: ("maxpool", "window"),
    nn.ReLU: ("relu", "point"),
    nn.Sigmoid: ("sigmoid", "point"),
    nn.LocalResponseNorm: ("lrn", "point"),
    nn.BatchNorm1d: ("batchnorm", "point"),
    nn.BatchNorm2d: ("batchnorm", "point"),
    nn.Dropout: ("dropout", "point"),
    nn.Identity: ("identity", "point"),
    MatchDtype: ("cast", "point"),
    nn.LayerNorm: ("layernorm", "norm"),
    nn.Linear: ("linear", "global"),
    nn.Flatten: ("flatten", "global"),
    nn.AdaptiveAvgPool2d: ("avgpool", "global"),
}


def _first(v: int | Sequence[int]) -> int:
    """The split axis' entry of a torch size argument (rows: the first spatial axis)."""
    return int(v if isinstance(v, int) else v[0])


def describe(name: str, module: nn.Module, path: str | None = None, **kw) -> Layer:
    """A Layer whose kind, reach and window geometry are read off the module's type and
    arguments; kw overrides any field (kind="block", cost=...)."""
    kind, reach = KINDS.get(type(module), (type(module).__name__.lower(), "global"))
    geometry = {}
    if reach == "window":
        stride = module.stride if module.stride is not None else module.kernel_size
        geometry = dict(
            kernel=_first(module.kernel_size), stride=_first(stride), pad=_first(module.padding)
        )
    return Layer(**{"name": name, "kind": kind, "module": module, "reach": reach,
                    "path": path, **geometry, **kw})  # fmt: skip


def sequential_layers(model: nn.Module) -> list[Layer]:
    """An nn.Sequential's children as layers, named by their attribute names."""
    if not isinstance(model, nn.Sequential):
        raise UsageError(
            f"the {type(model).__name__} model is not a sequence of layers: its workload must "
            "describe them (Workload.layers) for the pipeline, the spatial split and the cost table"
        )
    return [describe(name, m, name) for name, m in model.named_children()]


def run_layers(layers: Sequence[Layer], x: torch.Tensor) -> torch.Tensor:
    """The layers' modules applied in order: the model's forward."""
    for layer in layers:
        x = layer.module(x)
    return x


def layer_shapes(
    layers: Sequence[Layer], item_shape: tuple[int, ...]
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(input, output) shape per item of every layer: the layers run on an empty meta tensor of
    one item (no arithmetic, no memory; the modules should be on the meta device or be glue).
    Kept on disk across processes by workloads/shape_cache.py (the probe costs ~1 s)."""
    key = shape_cache.key([x.name for x in layers], [x.module for x in layers], item_shape)
    cached = shape_cache.lookup(key) if key else None
    if cached is not None and len(cached) == len(layers):
        return cached
    out = _probe(layers, item_shape)
    if key:
        shape_cache.store(key, out)
    return out


def _probe(
    layers: Sequence[Layer], item_shape: tuple[int, ...]
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    x, out = torch.empty((1, *item_shape), device="meta"), []
    for layer in layers:
        y = layer.module(x)
        out.append((tuple(x.shape[1:]), tuple(y.shape[1:])))
        x = y
    return out
