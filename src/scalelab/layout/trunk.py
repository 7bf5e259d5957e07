"""A model's convolution trunk as the spatial split sees it, derived from its layer description
(workloads/layers.py): the longest leading run of window / point / norm layers is the trunk, a
list of steps along one axis (height for images, text length for the char-CNN); the dense
layers after it are the head, computed in weight blocks (strategies/split/head.py); any other
tail (global pooling, residual blocks) runs on the root after a gather of the final slabs.

The steps reuse the model's own modules (weights and biases), called with torch.nn.functional
so that padding along the split axis is left to the split (edge ranks only) while padding
across the other axes stays with the op. Any workload whose layers start with such a run
joins the spatial split; nothing is registered.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from scalelab.errors import UsageError
from scalelab.layout.halo import Geometry
from scalelab.workloads.base import Workload
from scalelab.workloads.layers import Layer, layer_shapes

SKIP = frozenset({"cast", "identity", "dropout"})  # no-ops on a slab (the split casts itself)
GLUE = frozenset({"flatten", "relu", "dropout", "identity", "cast"})  # between head layers


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
    rest: list[Layer] = field(default_factory=list)  # a non-dense tail, run on the root

    def geometries(self) -> list[Geometry]:
        """Each step's geometry along the split axis, input sizes chained."""
        out, size = [], self.in_size
        for s in self.steps:
            g = Geometry(s.name, s.kernel, s.stride, s.pad, size)
            out.append(g)
            size = g.out_size
        return out


def _window(layer: Layer) -> Callable[[torch.Tensor], torch.Tensor]:
    """The layer's op without padding along the split axis (the split pads edge ranks)."""
    m = layer.module
    if isinstance(m, nn.Conv2d) and m.dilation == (1, 1):
        pad = (0, m.padding[1])
        return lambda x: F.conv2d(x, m.weight, m.bias, m.stride, pad, 1, m.groups)
    if isinstance(m, nn.Conv1d) and m.dilation == (1,):
        return lambda x: F.conv1d(x, m.weight, m.bias, m.stride, 0, 1, m.groups)
    if isinstance(m, nn.MaxPool2d) and m.dilation == 1 and not m.ceil_mode:
        pad = (0, m.padding if isinstance(m.padding, int) else m.padding[1])
        return lambda x: F.max_pool2d(x, m.kernel_size, m.stride, pad)
    if isinstance(m, nn.MaxPool1d) and m.dilation == 1 and not m.ceil_mode:
        return lambda x: F.max_pool1d(x, m.kernel_size, m.stride)
    raise UsageError(f"--split spatial: layer {layer.name} ({type(m).__name__}) has no halo form")


def _step(layer: Layer, out_channels: int) -> Step:
    if layer.reach == "window":
        pad_value = -math.inf if layer.kind == "maxpool" else 0.0
        return Step(layer.name, "window", _window(layer), out_channels, layer.kernel,
                    layer.stride, layer.pad, pad_value)  # fmt: skip
    if layer.reach == "norm":
        return Step(layer.name, "norm", None, out_channels, norm=layer.module)
    return Step(layer.name, "point", layer.module, out_channels)


def dense_head(layers: Sequence[Layer]) -> list[tuple[nn.Linear, bool]] | None:
    """flatten, linear, (relu, linear)*: the linears with "ReLU after"; None for another head."""
    kinds = [x.kind for x in layers if x.kind not in ("dropout", "identity", "cast")]
    if not kinds or kinds[0] != "flatten" or any(k not in GLUE | {"linear"} for k in kinds):
        return None
    head: list[tuple[nn.Linear, bool]] = []
    for layer in layers[1:]:
        if layer.kind == "linear":
            head.append((layer.module, False))
        elif layer.kind == "relu" and head and not head[-1][1]:
            head[-1] = (head[-1][0], True)
        elif layer.kind not in ("dropout", "identity", "cast"):
            return None  # two ReLUs, or a ReLU before the first linear
    return head if head and not head[-1][1] else None


def trunk_from_layers(
    layers: Sequence[Layer],
    shapes: Sequence[tuple[tuple[int, ...], tuple[int, ...]]],
    in_axis: int = 2,
    name: str = "the model",
) -> Trunk:
    """The trunk of a layer list: its leading window/point/norm layers (no-op casts skipped)
    and the dense head after them. shapes: (input, output) per item of every layer, e.g.
    layer_shapes() of the same layers on the meta device. in_axis: the transport form's split
    axis (the prepared maps are (N, C, rows, ...): axis 2)."""
    steps, rest = [], len(layers)
    for i, (layer, (_, out)) in enumerate(zip(layers, shapes)):
        if layer.reach == "global" or len(out) < 2:
            rest = i
            break
        if layer.kind not in SKIP:
            steps.append(_step(layer, out[0]))
    if not any(s.kind == "window" for s in steps):
        stop = layers[rest] if rest < len(layers) else None
        why = "" if stop is None or stop.reach == "global" else ": its items have no channel axis"
        at = "" if stop is None else f" (its local run stops at {stop.name}, {stop.kind}{why})"
        raise UsageError(f"--split spatial needs a convolution trunk; {name} has none{at}")
    head = dense_head(layers[rest:])
    tail = [] if head is not None else list(layers[rest:])
    item = shapes[0][0]
    return Trunk(steps, head or [], item[1], in_axis, tuple(item[2:]), rest=tail)


def trunk_for(workload: Workload, model: nn.Module | None) -> Trunk:
    """The workload's trunk; with model None only its geometry is usable (for validation): the
    steps then hold the meta-device model's modules."""
    meta = workload.layers(workload.meta_model())
    shapes = layer_shapes(meta, workload.item_shape())
    layers = meta if model is None else workload.layers(model)
    transport = workload.synthetic_inputs(1, 0).x  # (1, C, H, W) or (1, L) without channels
    in_axis = 2 if transport.dim() == len(shapes[0][0]) + 1 else 1
    return trunk_from_layers(layers, shapes, in_axis, workload.name)
