"""The convolution trunk of each workload as the spatial split sees it: a list of steps along
one axis (height for AlexNet, text length for the char-CNN) plus the dense head.

The steps reuse the model's own modules (weights and biases), called with torch.nn.functional
so that padding along the split axis is left to the split (edge ranks only) while padding
across the other axes stays with the op. A workload joins the spatial split by registering a
builder here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from scalelab.errors import UsageError
from scalelab.registry import Registry
from scalelab.strategies.halo import Geometry
from scalelab.workloads.base import Workload


@dataclass(frozen=True)
class Step:
    """One layer of the trunk.

    kind: "window" (conv, max-pool: reads k rows per output row, needs halos), "point"
    (ReLU, LRN across channels: row-local) or "norm" (LayerNorm over the whole map, split
    axis included: needs an all-reduce of partial moments). Feature maps are (N, C, rows, ...).
    """

    name: str
    kind: str
    apply: Callable[[torch.Tensor], torch.Tensor] | None
    out_channels: int
    kernel: int = 1
    stride: int = 1
    pad: int = 0
    pad_value: float = 0.0  # padding along the split axis: 0 for conv, -inf for max-pool
    norm: nn.LayerNorm | None = None

    def out_trailing(self, trailing: tuple[int, ...]) -> tuple[int, ...]:
        """Sizes after the split axis (width for images): square kernels act there too."""
        if self.kind != "window":
            return trailing
        return tuple((t + 2 * self.pad - self.kernel) // self.stride + 1 for t in trailing)


@dataclass
class Trunk:
    steps: list[Step]
    head: list[tuple[nn.Linear, bool]]  # dense layers after flatten, with "ReLU after"
    in_size: int  # input rows along the split axis
    in_axis: int  # split axis of the transport form: (N, 3, H, W) -> 2, (N, L) -> 1
    in_trailing: tuple[int, ...] = ()  # input sizes after the split axis: (W,) for images
    axis: int = 2  # split axis of the prepared maps (N, C, rows, ...)

    def geometries(self) -> list[Geometry]:
        """Each step's geometry along the split axis, input sizes chained."""
        out, size = [], self.in_size
        for s in self.steps:
            g = Geometry(s.name, s.kernel, s.stride, s.pad, size)
            out.append(g)
            size = g.out_size
        return out


TRUNKS: Registry[Callable[[Workload, nn.Module | None], Trunk]] = Registry("spatial trunk")


def trunk_for(workload: Workload, model: nn.Module | None) -> Trunk:
    """The workload's trunk; with model None only its geometry is usable (for validation)."""
    if workload.name not in TRUNKS:
        raise UsageError(
            f"--split spatial needs a convolution trunk; {workload.name} has none "
            f"(workloads with one: {', '.join(TRUNKS.names())})"
        )
    return TRUNKS.get(workload.name)(workload, model)


@TRUNKS.register("model", "your model's leading run of windowed and point-wise layers")
def user_trunk(workload: Workload, model: nn.Module | None) -> Trunk:
    # Until the generic trunk from Layer lists lands: refuse, naming the layer that stops it.
    first = workload.first_nonlocal()
    where = "none" if first is None else f"{first.name} ({first.kind})"
    raise UsageError(
        f"--split spatial: the model's leading local run is not split yet (first non-local "
        f"layer: {where}); use --split batch"
    )


def _conv2d(m: nn.Conv2d | None, stride: int, pad: int) -> Callable[[torch.Tensor], torch.Tensor]:
    # height padding comes from the split (edge ranks), width padding from the op
    return lambda x: F.conv2d(x, m.weight, m.bias, stride=stride, padding=(0, pad))


def _maxpool2d(kernel: int, stride: int, pad: int) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: F.max_pool2d(x, kernel, stride, padding=(0, pad))


@TRUNKS.register("alexnet", "height-wise: c1..pool5 on row slabs, fc6..fc8 distributed")
def alexnet_trunk(workload: Workload, model: nn.Module | None) -> Trunk:
    steps = []
    for layer in workload.trunk_layers():
        k, s, p, c = layer.kernel, layer.stride, layer.pad, layer.out_channels
        if layer.kind == "conv":
            conv = getattr(model, layer.name, None)
            steps.append(Step(layer.name, "window", _conv2d(conv, s, p), c, k, s, p))
        elif layer.kind == "maxpool":
            steps.append(
                Step(layer.name, "window", _maxpool2d(k, s, p), c, k, s, p, pad_value=-math.inf)
            )
        elif layer.kind == "lrn":  # its window runs across channels: row-local
            steps.append(Step(layer.name, "point", getattr(model, layer.name, None), c))
        else:
            steps.append(Step(layer.name, "point", F.relu, c))
    head = _head(model, ("fc6", "fc7", "fc8"))
    size = workload.image_size
    return Trunk(steps, head, in_size=size, in_axis=2, in_trailing=(size,))


@TRUNKS.register("charcnn", "length-wise: conv1..pool6 on length slabs, LayerNorm all-reduced")
def charcnn_trunk(workload: Workload, model: nn.Module | None) -> Trunk:
    from scalelab.workloads import charcnn

    c, p = charcnn.FEATURES, charcnn.POOL
    steps = []
    for conv, _, kernel, norm, pool in charcnn.CONV_BLOCKS:
        steps.append(Step(conv, "window", _conv1d(getattr(model, conv, None)), c, kernel))
        if norm is not None:  # LayerNorm over (256, length): moments all-reduced over ranks
            steps.append(Step(norm, "norm", None, c, norm=getattr(model, norm, None)))
        steps.append(Step(f"relu{conv[-1]}", "point", F.relu, c))
        if pool:
            steps.append(
                Step(f"pool{conv[-1]}", "window", _maxpool1d(p), c, p, p, pad_value=-math.inf)
            )
    return Trunk(steps, _head(model, ("fc1", "fc2", "fc3")), in_size=charcnn.L, in_axis=1)


def _conv1d(m: nn.Conv1d | None) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: F.conv1d(x, m.weight, m.bias)


def _maxpool1d(kernel: int) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: F.max_pool1d(x, kernel, kernel)


def _head(model: nn.Module | None, names: tuple[str, ...]) -> list[tuple[nn.Linear, bool]]:
    """Linear layers with a ReLU after every one but the last (both workloads' heads)."""
    return [(getattr(model, n, None), i < len(names) - 1) for i, n in enumerate(names)]
