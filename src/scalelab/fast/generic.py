"""The fast path of a workload without fused kernels: bf16 weights, channels_last, one stage.

The pipeline then captures it in a CUDA graph like any other. Used for mlp, vgg16, deepstack,
and as the last step of resnet's path (after folding batch norm).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from scalelab.fast.registry import Candidate, Plan, Stage
from scalelab.workloads.base import Workload

BF16 = torch.bfloat16


def has_conv2d(model: nn.Module) -> bool:
    return any(isinstance(m, nn.Conv2d) for m in model.modules())


def bf16_copy(model: nn.Module) -> nn.Module:
    """A bf16 (and, with 2-D convolutions, channels_last) copy; the caller's model is kept."""
    fast = copy.deepcopy(model).to(BF16).eval()
    if has_conv2d(fast):
        fast = fast.to(memory_format=torch.channels_last)
    return fast


def model_plan(workload: Workload, fast_model: nn.Module, notes: list[str]) -> Plan:
    """One stage running fast_model; prepare() runs before the graph (it may copy from host)."""
    channels_last = has_conv2d(fast_model)

    def prepare(x: torch.Tensor) -> torch.Tensor:
        h = workload.prepare(x).to(BF16)
        if channels_last and h.dim() == 4:
            h = h.contiguous(memory_format=torch.channels_last)
        return h

    stage = Stage("model", [Candidate("torch-bf16", fast_model)])
    return Plan([stage], notes + (["channels_last"] if channels_last else []), prepare)


def build(workload: Workload, model: nn.Module, device: torch.device) -> Plan:
    return model_plan(workload, bf16_copy(model), ["bf16"])
