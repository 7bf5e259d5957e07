"""Stages of a model whose forward is not a chain of its layers (a transformer: the root adds
a position table, the blocks add residuals), cut by torch.distributed.pipelining's tracer:
`pipeline(model, (micro-batch,), split_spec={name: SplitPoint.BEGINNING})` exports the whole
forward and splits the graph before each named module; the root's own ops and parameters go
with the stage that uses them. The stage modules hold the model's own Parameter objects, so
the optimizer over the whole model steps what the stages train.

The export fixes every shape, the micro-batch's included: each micro-batch size is traced
once (torch_engine.TorchPipeline keeps the pieces per size). A parameter two stages use (a
head tied to the embedding) would be copied per stage by the tracer and trained apart: it is
refused, by name.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.pipelining import SplitPoint, pipeline

from scalelab.errors import UsageError
from scalelab.planning.partition import LayerProfile, bounds
from scalelab.workloads.layers import Layer

RATE = 1e10  # FLOP/s a layer profile from FLOPs assumes: only the ratios between layers count


def check_cut(counts: list[int], layers: Sequence[Layer], cut_points: frozenset[str]) -> None:
    """A given cut (--cut, --balance) starts every stage at a module the tracer splits at."""
    for start, _ in bounds(counts)[1:]:
        if layers[start].path not in cut_points:
            raise UsageError(
                f"pipeline: a stage cannot begin at {layers[start].name} (the tracer splits "
                f"before a module called once: {', '.join(sorted(cut_points))})"
            )


def flop_profile(rows: list, n: int, train: bool, itemsize: int) -> list[LayerProfile]:
    """Per-layer profile of n items from the cost table (FlopCounter's FLOPs): the layers of
    a traced model do not run one by one, so they are balanced by FLOPs, not timed."""
    factor = 3 if train else 1
    return [
        LayerProfile(r.name, factor * n * r.flops / RATE, r.params * itemsize,
                     n * r.out_elems * itemsize, n * r.in_elems * itemsize)
        for r in rows
    ]  # fmt: skip


def trace_pieces(
    model: nn.Module, x: torch.Tensor, starts: list[str], ids: list[int], device: torch.device
) -> dict[int, nn.Module]:
    """Stage modules `ids` of model cut before the modules `starts`, traced on the micro-batch
    x (on the host, like the model), moved to the device."""
    saved = {n: model.get_submodule(n).__dict__.get("forward") for n in starts}
    try:
        pipe = pipeline(model, (x,), split_spec={n: SplitPoint.BEGINNING for n in starts})
    except RuntimeError as exc:
        why = str(exc.__cause__ or exc).strip().splitlines()[0]
        raise UsageError(f"pipeline: torch's tracer cannot export the model: {why}") from None
    finally:
        for name, forward in saved.items():  # annotate_split_points wrapped their forwards
            mod = model.get_submodule(name)
            mod.__dict__.pop("_orig_forward", None)
            mod.__dict__.pop("forward", None)
            if forward is not None:
                mod.forward = forward
    if pipe.replicated_params:
        names = " = ".join(next(iter(pipe.replicated_params)).values())
        raise UsageError(f"pipeline: stages share a parameter (tied weights): {names}")
    if pipe.num_stages != len(starts) + 1:
        raise UsageError(f"pipeline: the tracer made {pipe.num_stages} stages of {len(starts) + 1}")
    pieces = {i: pipe.get_stage_module(i) for i in ids}
    if device.type != "cpu":
        from torch.distributed.pipelining._IR import _modify_graph_op_device

        for piece in pieces.values():  # the export burnt the host device into new tensors
            _modify_graph_op_device(piece, device)
    return {i: piece.to(device) for i, piece in pieces.items()}
