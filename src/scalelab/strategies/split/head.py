"""The dense head after a spatially split trunk, computed by all ranks in weight blocks.

The flattened features never need assembling: rank r holds rows [a, b) of the final map
(N, C, H, W), i.e. a fixed subset of fc6's input columns, so

    fc6(f) = sum_r  W6[:, cols(r)] @ f_r  + b6          (partial products, one all-reduce)

Layers then alternate (Megatron-style): an *output-split* layer computes its own block of
output columns from the full activation it has, and the *input-split* layer after it turns
that block into a partial product of the next activation. A reduction sums the partials: an
all-reduce in the middle, a gather to the root at the end. AlexNet (fc6, fc7, fc8) and the
char-CNN (fc1, fc2, fc3) are input-split, output-split, input-split: one all-reduce of
(N, 4096) and one gather of (N, classes) per rank, and each rank reads 1/n of the weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from scalelab.comm.base import even_counts
from scalelab.strategies.halo import bounds


@dataclass
class HeadLayer:
    """This rank's block of one dense layer."""

    weight: torch.Tensor  # input-split: (out, my in cols); output-split: (my out cols, in)
    bias: torch.Tensor | None  # input-split: full bias, added once after the reduction
    relu: bool
    input_split: bool


def plan_head(
    head: list[tuple[nn.Linear, bool]],
    rows: tuple[int, int],
    final_shape: tuple[int, ...],
    rank: int,
    ranks: int,
) -> list[HeadLayer]:
    """Weight blocks for this rank. final_shape: the trunk's map per item (C, H, ...);
    rows: the map rows [a, b) this rank holds. Slices are copied once, outside timing."""
    layers, cols = [], None
    for i, (lin, relu) in enumerate(head):
        w, b = lin.weight.detach(), lin.bias.detach() if lin.bias is not None else None
        if i == 0:  # columns of fc6 that read this rank's rows of the (C, H, ...) map
            block = w.view(w.shape[0], *final_shape)[:, :, rows[0] : rows[1]]
            layers.append(HeadLayer(block.reshape(w.shape[0], -1).contiguous(), b, relu, True))
        elif layers[-1].input_split:  # output-split: my block of this layer's outputs
            bnd = bounds(even_counts(w.shape[0], ranks))
            cols = (bnd[rank], bnd[rank + 1])
            blk_b = b[cols[0] : cols[1]] if b is not None else None
            layers.append(HeadLayer(w[cols[0] : cols[1]].contiguous(), blk_b, relu, False))
        else:  # input-split over the previous layer's output block
            layers.append(HeadLayer(w[:, cols[0] : cols[1]].contiguous(), b, relu, True))
    return layers


def _wide(t: torch.Tensor) -> torch.Tensor:
    """Reductions run in at least fp32 (autocast may hand back bf16/fp16)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def head_forward(split, layers: list[HeadLayer], features: torch.Tensor) -> torch.Tensor | None:
    """features: this rank's (N, C, rows, ...) slab -> logits (N, classes) on the root."""
    comm, timer, wire = split.comm, split.timer, split.wire
    h = features.flatten(1)  # (N, C * rows * ...), channel-major like torch.flatten
    for i, layer in enumerate(layers):
        last = i == len(layers) - 1
        with timer.phase("compute"):
            h = F.linear(h, layer.weight, None if layer.input_split else layer.bias)
        if layer.input_split and last:
            return _reduce_to_root(split, h, layer.bias)
        if layer.input_split:
            buf = wire.to_wire(_wide(h))
            with timer.phase("allreduce"):
                comm.allreduce(buf)
            timer.add_bytes("allreduce", buf.nbytes)
            h = wire.from_wire(buf).to(h.dtype)
            with timer.phase("compute"):
                h = h + layer.bias if layer.bias is not None else h
        if layer.relu:
            with timer.phase("compute"):
                h = F.relu(h)
    # the last layer was output-split: gather the column blocks, (cols, N) so rows travel
    with timer.phase("gather"):
        cols = comm.gatherv(wire.to_wire(h.t().contiguous()))
    return cols.t() if comm.is_root else None


def _reduce_to_root(split, partial: torch.Tensor, bias: torch.Tensor | None):
    """Sum every rank's partial logits on the root, in rank order (deterministic)."""
    comm, timer, wire = split.comm, split.timer, split.wire
    buf = wire.to_wire(_wide(partial).unsqueeze(0))  # (1, N, classes)
    with timer.phase("wait"):  # the slowest rank's trunk, kept out of the gather
        comm.barrier()
    with timer.phase("gather"):
        parts = comm.gatherv(buf)
    if not comm.is_root:
        return None
    timer.add_bytes("gather", parts.nbytes - buf.nbytes)
    with timer.phase("compute"):
        out = parts.sum(0)
        return out + bias.to(out.device, out.dtype) if bias is not None else out
