"""A workload's parameter penalty (mlp's L2) evaluated on some of its parameters.

Model-parallel ranks hold a part of the model, so a loss that looks at the whole model (mlp:
cross-entropy + l2/2 * sum of squared weights) cannot run on one rank. The penalty is what the
workload's loss adds to the base cross-entropy; it is a sum over parameters, so evaluating it
on each rank's own parameters (a pipeline stage's layers, a tensor shard's local pieces) and
summing over ranks gives the whole. Its gradient is exact (the cross-entropy of the constant
probe logits has none); its value carries a rounding of ~1e-16 from the subtraction.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from scalelab.workloads.base import Workload


class _Params(nn.Module):
    """Just enough of a module for Workload.loss: named_parameters over given tensors."""

    def __init__(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().__init__()
        self.named = list(named)

    def named_parameters(self, *args, **kwargs):  # noqa: ARG002 (nn.Module's signature)
        return iter(self.named)


def has_penalty(workload: Workload) -> bool:
    return type(workload).loss is not Workload.loss


def penalty(workload: Workload, named: Iterable[tuple[str, torch.Tensor]]) -> torch.Tensor | None:
    """The workload's penalty on these parameters (None when it has none)."""
    named = list(named)
    if not has_penalty(workload) or not named:
        return None
    ref = named[0][1]
    z = torch.zeros((1, 2), dtype=ref.dtype, device=ref.device)  # (1, C=2) probe logits
    y = torch.zeros(1, dtype=torch.int64, device=ref.device)
    extra = workload.loss(_Params(named), z, y) - item_loss(workload, z, y)
    # A loss of its own that reads no parameter (a user model's label smoothing) is no penalty:
    # a constant here, with no gradient to take.
    return extra if extra.requires_grad else None


def item_loss(workload: Workload, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The workload's loss without its parameter penalty: its loss over no parameters (mlp:
    the cross-entropy; a user model with a loss of its own, e.g. label smoothing: that loss,
    which the base cross-entropy would silently replace)."""
    return workload.loss(_Params(()), logits, y)
