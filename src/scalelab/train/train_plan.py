"""What a strategy may change about training (a `TrainPlan`) and where training stands (a
`Position`): in a module of their own, so the loop, its steps and its checkpoints read them
without importing one another."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from scalelab.train.sources import BatchSource

StateExport = Callable[[nn.Module, torch.optim.Optimizer], "tuple[dict, dict] | None"]
StateImport = Callable[[nn.Module, torch.optim.Optimizer, dict, dict], None]


@dataclass
class TrainPlan:
    """How one strategy trains. `default_plan` is the one-process plan.

    module: the bare model under any wrapper (DDP, compile, a channels_last adapter); its
        state_dict keys are the workload's, so checkpoints load anywhere.
    export_state / import_state: the whole (model, optimizer) state as on one process;
        export is collective and returns None off the root rank. None: module.state_dict().
    n_train: training items (the data order's length), recorded in checkpoints.
    epoch_end: called on every rank after each epoch's evaluation (compare-devices snapshots).
    """

    source: BatchSource
    evaluate: Callable[[nn.Module], float]
    module: nn.Module
    prepare: Callable[[torch.Tensor], torch.Tensor]
    loss: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
    n_train: int
    export_state: StateExport | None = None
    import_state: StateImport | None = None
    epoch_end: Callable[[int, nn.Module], None] | None = None
    notes: dict[str, Any] = field(default_factory=dict)


@dataclass
class Position:
    """Where training stands: epoch, step within it, and the epoch's partial sums."""

    epoch: int = 0
    step: int = 0
    loss_sum: torch.Tensor | None = None  # summed (loss * items) of this epoch, on the device
    items: int = 0  # items of this epoch so far, all ranks
