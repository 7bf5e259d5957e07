"""ResNet-18 inference fast path: batch norm folded into the convolutions, then bf16 and
channels_last (generic.py), captured in a CUDA graph by the pipeline.

Inference BN is y = (x - mean) / sqrt(var + eps) * gamma + beta, an affine map per channel,
so conv followed by BN is one conv with weight W * s (s = gamma / sqrt(var + eps), per output
channel) and bias beta - mean * s: one kernel and one pass over the map fewer per conv.
Training keeps BN (its statistics come from the batch) and uses fast/captured_step.py.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from scalelab.fast.generic import bf16_copy, model_plan
from scalelab.fast.registry import FAST_PATHS, Plan
from scalelab.workloads.base import Workload


@torch.no_grad()
def fold_bn(conv: nn.Conv2d, bn: nn.BatchNorm2d) -> None:
    """Fold bn (eval statistics) into conv in place, in float64 for the products."""
    scale = bn.weight.double() / torch.sqrt(bn.running_var.double() + bn.eps)  # (C_out,)
    w = conv.weight.double() * scale.view(-1, 1, 1, 1)
    shift = bn.bias.double() - bn.running_mean.double() * scale
    if conv.bias is not None:
        shift = shift + conv.bias.double() * scale
    conv.weight.copy_(w.to(conv.weight.dtype))
    conv.bias = nn.Parameter(shift.to(conv.weight.dtype))


def fold_resnet(model: nn.Module) -> nn.Module:
    """A copy of a torchvision-layout ResNet with every BatchNorm folded and set to Identity."""
    model = copy.deepcopy(model).eval()
    pairs = [(model, "conv1", "bn1")]
    for name, module in model.named_modules():
        if hasattr(module, "bn2"):  # a BasicBlock
            pairs += [(module, "conv1", "bn1"), (module, "conv2", "bn2")]
        if name.endswith("downsample"):
            pairs.append((module, "0", "1"))
    for parent, conv_name, bn_name in pairs:
        fold_bn(getattr(parent, conv_name), getattr(parent, bn_name))
        setattr(parent, bn_name, nn.Identity())
    return model


@FAST_PATHS.register("resnet18", "batch norm folded into convs, bf16 channels_last, CUDA graph")
def build(workload: Workload, model: nn.Module, device: torch.device) -> Plan:
    return model_plan(workload, bf16_copy(fold_resnet(model)), ["batch norm folded", "bf16"])


FAST_PATHS.register("resnet18-cifar", "as resnet18")(build)
