"""What the training loop needs of whoever runs it: the hooks a strategy implements.

train/ sits below strategies/ (docs/ARCHITECTURE.md): the loop, its sources and steps, and the
fast path's trainer call these hooks and never import a strategy. `TorchStrategy`
(strategies/torch_base.py) is the implementation every torch strategy inherits; a distributed
one overrides only where data and gradients cross ranks (`shard`, `reduce_gradients`,
`all_sum`). A Protocol, not a base class: the strategies satisfy it by shape, so nothing here
points up.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Protocol

import torch
from torch import nn

from scalelab.comm import Comm
from scalelab.config import RunConfig
from scalelab.instrument.timer import PhaseTimer
from scalelab.precision import Precision
from scalelab.workloads.base import Inputs


class TrainHost(Protocol):
    """The strategy as the training loop sees it."""

    name: str
    cfg: RunConfig
    comm: Comm
    device: torch.device
    precision: Precision
    timer: PhaseTimer

    @property
    def is_root(self) -> bool: ...

    def shard(self, batch: Inputs) -> Inputs:
        """This rank's share of a global training batch (the whole batch in one process)."""
        ...

    def reduce_gradients(self, model: nn.Module, timer: PhaseTimer) -> None:
        """Combine gradients across ranks after backward (nothing in one process)."""
        ...

    def all_sum(self, value: float) -> float:
        """A float summed over ranks (loss totals, item counts)."""
        ...

    def autocast(self) -> AbstractContextManager:
        """The precision's autocast region (a null context without one)."""
        ...

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """A host tensor on the run's device."""
        ...
