"""One row of the analytic cost table, in a module of its own: the layer description
(layers.py) names it in a layer's cost function and the formulas (costs.py) build it, so neither
imports the other for it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LayerCost:
    """One row of a workload's analytic cost table, per input item (batch 1).

    flops counts multiply and add as two operations (2*MACs for conv/linear), the convention of
    torch.utils.flop_counter. Bytes moved at batch N and element size b are
    b * (N * (in_elems + out_elems) + params): read input and weights, write output once.
    """

    name: str  # as in the seed tables: c1, lrn1, pool1, fc6, ...
    kind: str  # conv, linear, relu, lrn, maxpool, layernorm, batchnorm, softmax, add, ...
    out_shape: tuple[int, ...]  # per item, e.g. (96, 55, 55)
    params: int
    flops: int  # per item
    in_elems: int  # per item
    out_elems: int  # per item
    module: str | None = None  # dotted path of the nn.Module computing it (FlopCounter check)

    def bytes_moved(self, batch: int, itemsize: int) -> int:
        return itemsize * (batch * (self.in_elems + self.out_elems) + self.params)
