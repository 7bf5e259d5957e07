"""What a fast path is made of: stages with candidate implementations, registered per workload.

A workload's fast path is a list of stages (block1, conv2, ..., fc), each with candidates that
compute the same function of the stage input: the first candidate is plain torch (the reference
and the fallback), the others are Triton kernels or alternative layouts. The pipeline
(pipeline.py) validates every candidate against the torch one on the real input, times them
on a GPU and keeps the fastest that agrees. Builders register with
@FAST_PATHS.register(workload_name, line); a workload without one gets the generic path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from scalelab.registry import Registry
from scalelab.workloads.base import Workload

StageFn = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class Candidate:
    name: str  # e.g. "torch", "triton-gather", "triton-128x128x64w8s3", "cudnn-s2d"
    fn: StageFn
    kernel: str | None = None  # Triton kernel family it needs (None: plain torch)


@dataclass
class Stage:
    """One step of the fast forward: input -> output, several ways."""

    name: str
    candidates: list[Candidate]

    def __post_init__(self) -> None:
        if not self.candidates or self.candidates[0].kernel is not None:
            raise ValueError(f"stage {self.name}: the first candidate must be plain torch")


@dataclass
class Plan:
    """The stages of a workload's fast forward.

    prepare, when given, maps the transport-form input to the first stage's input outside the
    CUDA graph: for workloads whose prepare() builds tensors from Python data (a host-to-device
    copy, which graph capture forbids). Otherwise the first stage takes the transport form.
    """

    stages: list[Stage]
    notes: list[str] = field(default_factory=list)  # what the builder did (folded BN, ...)
    prepare: StageFn | None = None


def dense_head_stage(
    params: list[tuple[torch.Tensor, torch.Tensor]], flatten: StageFn, dtype: torch.dtype
) -> Stage:
    """Linear layers with ReLU between them (not after the last), cuBLAS in `dtype`.

    params: (weight, bias) per layer, the first weight's columns already in the order
    `flatten` lays the features out (the fast trunks keep channels last).
    """
    cast = [(w.detach().to(dtype), b.detach().to(dtype)) for w, b in params]

    def fc(x: torch.Tensor) -> torch.Tensor:
        h = flatten(x)
        for i, (w, b) in enumerate(cast):
            h = torch.nn.functional.linear(h, w, b)
            if i < len(cast) - 1:
                h = torch.relu_(h)
        return h

    return Stage("fc", [Candidate("cublas", fc)])


# builder(workload, model, device) -> Plan; the model is the caller's, never modified.
Builder = Callable[[Workload, nn.Module, torch.device], Plan]
FAST_PATHS: Registry[Builder] = Registry("fast path")
