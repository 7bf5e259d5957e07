"""What `scalelab bench` checks, so that its status can fail.

Inference: relerr of each mode's logits against the float64 NumPy oracle on the first items,
against the precision's tolerance.

Training: the loss trajectory of STEPS steps (the same batches, the same initial weights)
against the same steps in float64 torch: error = max_k |L_k - L64_k| / |L64_1|. A loss
trajectory is meaningful for every network; the earlier basis (one step's parameter update)
is not for BatchNorm nets, where fp32 itself read 0.10 because per-channel normalisation makes
the update of the weights before a BN layer nearly cancel. The tolerance is derived from the
plain bf16 loop measured in the same run: the fast step may be at most SPREAD times as far
from float64 as eager bf16 is (never below FLOOR, the rounding of a loss in bf16).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import torch
from torch import nn

from scalelab.workloads import Workload

STEPS = 5  # losses compared: the first is the forward alone, later ones follow the updates
SPREAD = 4.0  # fast may be this many times as far from float64 as eager bf16
FLOOR = 2e-3  # below this, differences are bf16 rounding of the loss itself
TRAIN_BASIS = (
    f"max relative deviation of {STEPS} steps' losses from the same steps in float64 torch; "
    f"tolerance max({FLOOR:g}, {SPREAD:g} x the eager bf16 deviation in this run)"
)

StepFn = Callable[[torch.Tensor], torch.Tensor | float | None]


def trajectory(step: StepFn, batches: list[torch.Tensor], summed: bool = False) -> list[float]:
    """Losses of step over batches, as floats. summed: step returns loss * items."""
    out = []
    for idx in batches:
        loss = step(idx)
        value = float(loss) if loss is not None else math.nan
        out.append(value / len(idx) if summed else value)
    return out


def float64_trajectory(
    workload: Workload, model: nn.Module, data, batches: list[torch.Tensor], make_step
) -> list[float]:
    """The same steps from model's weights in float64 (a deep copy; model is unchanged)."""
    m64 = copy.deepcopy(model).double().train()
    step = make_step(workload, m64, workload.optimizer(m64), data, None, torch.float64)
    return trajectory(step, batches)


def deviation(losses: list[float], ref: list[float]) -> float:
    """max_k |L_k - ref_k| / |ref_1|; inf when a loss is not finite."""
    if not all(math.isfinite(v) for v in losses):
        return math.inf
    scale = max(abs(ref[0]), 1e-30)
    return max(abs(a - b) for a, b in zip(losses, ref)) / scale


def train_tolerance(eager_deviation: float) -> float:
    return max(FLOOR, SPREAD * eager_deviation)
