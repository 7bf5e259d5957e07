"""Stages of a model whose forward is not a chain of its layers (a transformer: the root adds
a position table, the blocks add residuals), cut by torch.distributed.pipelining's tracer:
`pipeline(model, (micro-batch,), split_spec={name: SplitPoint.BEGINNING})` exports the whole
forward and splits the graph before each named module; the root's own ops and parameters go
with the stage that uses them. The stage modules hold the model's own Parameter objects, so
the optimizer over the whole model steps what the stages train.

The export fixes every shape, the micro-batch's included: each micro-batch size is traced
once (torch_engine.TorchPipeline keeps the pieces per size). A parameter two stages use (a
head tied to the embedding) is copied per stage by the tracer: the stages get the model's own
back, and its gradient is summed between them (torch_tied.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining import SplitPoint, pipeline

from scalelab.errors import UsageError
from scalelab.layout.partition import LayerProfile, bounds
from scalelab.strategies.pipeline.torch_tied import Tied, Traced
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
) -> Traced:
    """Stage modules `ids` of model cut before the modules `starts`, traced on the micro-batch
    x with the model and x on `device` (the stages' own), the model back on the host after.

    On the device, the export sees what the stages will run: the device a forward's
    `torch.arange(t, device=idx.device)` or a rotary buffer lands on (traced on the host and
    moved, the export met a weight on one device and a position on the other), and the
    strides of the device's kernels (an attention output laid out (B, T, H, D) on CUDA, where
    the host trace had recorded a `view` of a contiguous one)."""
    saved = {n: model.get_submodule(n).__dict__.get("forward") for n in starts}
    model.to(device)
    try:
        pipe = pipeline(
            model, (x.to(device),), split_spec={n: SplitPoint.BEGINNING for n in starts}
        )
    except RuntimeError as exc:
        why = str(exc.__cause__ or exc).strip().splitlines()[0]
        raise UsageError(f"pipeline: torch's tracer cannot export the model: {why}") from None
    except AssertionError as exc:  # torch 2.11's unflatten on an HF Llama's autocast block
        raise UsageError(
            f"pipeline: torch {torch.__version__}'s tracer cannot split the model "
            f"({str(exc).strip().splitlines()[0]}); torch 2.13 splits it"
        ) from None
    finally:
        model.to("cpu")
        for name, forward in saved.items():  # annotate_split_points wrapped their forwards
            mod = model.get_submodule(name)
            mod.__dict__.pop("_orig_forward", None)
            mod.__dict__.pop("forward", None)
            if forward is not None:
                mod.forward = forward
    if pipe.num_stages != len(starts) + 1:
        raise UsageError(f"pipeline: the tracer made {pipe.num_stages} stages of {len(starts) + 1}")
    _received_are_floating(pipe)
    pieces = {i: pipe.get_stage_module(i) for i in ids}
    tied = [_hold_the_models_own(model, pipe, uses) for uses in pipe.replicated_params]
    return Traced({i: piece.to(device) for i, piece in pieces.items()}, tied)


def _received_are_floating(pipe: Any) -> None:
    """Torch before 2.13 asks every tensor a stage receives to require grad, which a bool or
    integer one cannot (GPT-2's causal mask, (N, 1, T, T) bool, crosses its cut): refused here
    in one line, before any rank runs, rather than in the ranks' first step."""
    if tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 13):
        return
    for i in range(1, pipe.num_stages):
        for node in pipe.get_stage_module(i).graph.nodes:
            val = node.meta.get("val") if node.op == "placeholder" else None
            if isinstance(val, torch.Tensor) and not val.is_floating_point():
                raise UsageError(
                    f"pipeline: stage {i} receives {node.name}, a {str(val.dtype)[6:]} "
                    f"{tuple(val.shape)} tensor, which torch {torch.__version__}'s stages "
                    "cannot receive (they ask it to require grad); torch 2.13 can"
                )


def _hold_the_models_own(model: nn.Module, pipe: Any, uses: dict[str, str]) -> Tied:
    """The stages using one tied parameter (uses: stage submodule -> its name there) hold the
    model's own Parameter again, not the tracer's copy per stage (its copies would train
    apart): a rank holding two of them accumulates both uses' gradients in one tensor; ranks
    holding them apart sum theirs (TiedGrads)."""
    names = sorted(set(uses.values()))
    param = model.get_parameter(names[0])
    for submod, qualname in uses.items():
        owner, _, attr = qualname.rpartition(".")
        piece = getattr(pipe.split_gm, submod)
        setattr(piece.get_submodule(owner) if owner else piece, attr, param)
    stages = frozenset(int(s.rpartition("_")[2]) for s in uses)
    return Tied(" = ".join(names), param, stages)
