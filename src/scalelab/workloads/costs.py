"""The analytic cost model: one row per layer per input item, and the per-kind formulas that
derive a workload's cost table from its layer description (workloads/layers.py).

FLOPs count multiply and add as two operations (2 * MACs for conv/linear), the convention of
torch.utils.flop_counter; element-wise layers count their own FLOPs per input element.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from scalelab.errors import UsageError
from scalelab.workloads.layer_cost import LayerCost
from scalelab.workloads.layers import Layer, layer_shapes


def conv_cost(
    name: str,
    module: str | None,
    c_in: int,
    in_hw: tuple[int, ...],
    c_out: int,
    kernel: tuple[int, ...],
    out_hw: tuple[int, ...],
    bias: bool = True,
) -> LayerCost:
    """Convolution (1-D or 2-D): FLOPs = 2 * C_out * C_in * prod(kernel) * prod(out spatial)."""
    k = math.prod(kernel)
    params = c_out * c_in * k + (c_out if bias else 0)
    flops = 2 * c_out * c_in * k * math.prod(out_hw)
    return LayerCost(
        name,
        "conv",
        (c_out, *out_hw),
        params,
        flops,
        c_in * math.prod(in_hw),
        c_out * math.prod(out_hw),
        module,
    )


def linear_cost(
    name: str, module: str | None, n_in: int, n_out: int, bias: bool = True
) -> LayerCost:
    """Fully connected: FLOPs = 2 * n_in * n_out (the bias add is not counted, as FlopCounter)."""
    return LayerCost(
        name,
        "linear",
        (n_out,),
        n_in * n_out + (n_out if bias else 0),
        2 * n_in * n_out,
        n_in,
        n_out,
        module,
    )


def elementwise_cost(
    name: str,
    kind: str,
    shape: tuple[int, ...],
    flops_per_elem: int = 1,
    params: int = 0,
    out_shape: tuple[int, ...] | None = None,
    module: str | None = None,
) -> LayerCost:
    """ReLU, norms, pools, softmax: FLOPs = flops_per_elem * elements of the input."""
    out_shape = shape if out_shape is None else out_shape
    n_in = math.prod(shape)
    return LayerCost(
        name, kind, out_shape, params, flops_per_elem * n_in, n_in, math.prod(out_shape), module
    )


# FLOPs per input element of the element-wise kinds. LayerNorm: add into the mean, subtract
# it, square, add into the variance, multiply by 1/sqrt(var + eps) (once per map, not
# counted), by gamma, add beta. Inference BatchNorm folds to x * scale + shift. Sigmoid:
# negate, exp, add 1, divide. An LRN of size n: square, n - 1 adds of the window, * alpha/n,
# + k, ** beta, divide = n + 4 (its module gives n).
ELEMENTWISE_FLOPS = {"relu": 1, "sigmoid": 4, "batchnorm": 2, "layernorm": 7, "add": 1}
NO_ROW = frozenset({"cast", "flatten", "dropout", "identity"})  # views, casts, eval no-ops


def pool_cost(name: str, kind: str, in_shape: tuple[int, ...], out_shape: tuple[int, ...],
              window: int) -> LayerCost:  # fmt: skip
    """Max-pool: window - 1 comparisons per output (an input-based count would overcount)."""
    n_out = math.prod(out_shape)
    return LayerCost(name, kind, out_shape, 0, (window - 1) * n_out, math.prod(in_shape), n_out)


def layer_rows(
    layer: Layer, in_shape: tuple[int, ...], out_shape: tuple[int, ...]
) -> list[LayerCost]:
    """The cost-table rows of one layer on (C, spatial...) input in_shape, from its kind."""
    if layer.cost is not None:
        return layer.cost(in_shape, out_shape)
    m, kind, name, path = layer.module, layer.kind, layer.name, layer.path
    if kind == "conv":
        bias = m.bias is not None
        return [conv_cost(name, path, in_shape[0], in_shape[1:], m.out_channels, m.kernel_size,
                          out_shape[1:], bias)]  # fmt: skip
    if kind == "linear":
        return [linear_cost(name, path, m.in_features, m.out_features, m.bias is not None)]
    if kind == "maxpool":
        k = m.kernel_size
        window = math.prod((k,) * (len(in_shape) - 1) if isinstance(k, int) else k)
        return [pool_cost(name, kind, in_shape, out_shape, window)]
    if kind == "avgpool":  # global average: one add per input element; out (C,)
        n_in = math.prod(in_shape)
        flat = out_shape[:1] if math.prod(out_shape[1:]) == 1 else out_shape
        return [LayerCost(name, kind, flat, 0, n_in, n_in, math.prod(out_shape))]
    if kind in NO_ROW:
        return []
    params = sum(p.numel() for p in m.parameters())
    if kind == "lrn":
        return [elementwise_cost(name, kind, in_shape, m.size + 4, params, module=path)]
    if kind == "layernorm":
        flops = ELEMENTWISE_FLOPS[kind]
        return [elementwise_cost(name, kind, in_shape, flops, params, module=path)]
    if kind in ELEMENTWISE_FLOPS or (params == 0 and in_shape == out_shape):
        flops = ELEMENTWISE_FLOPS.get(kind, 1)  # an unknown element-wise op: 1 per element
        return [elementwise_cost(name, kind, in_shape, flops, params, out_shape)]
    raise UsageError(f"layer {name} ({kind}) has no cost formula; describe it with Layer(cost=...)")


def layer_costs(
    layers: Sequence[Layer], item_shape: tuple[int, ...]
) -> list[tuple[Layer, LayerCost]]:
    """(layer, row) for every row the layers compute on one item of item_shape, in order;
    shapes come from running the layers on the meta device."""
    out = []
    for layer, (i, o) in zip(layers, layer_shapes(layers, item_shape)):
        out += [(layer, row) for row in layer_rows(layer, i, o)]
    return out
