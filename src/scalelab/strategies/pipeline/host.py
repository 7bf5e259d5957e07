"""What the cut (cut.py) and the training plan (train.py) read of the pipeline strategy
(strategy.py), as a protocol: strategy.py imports both, so they name this instead of it."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch
from torch import nn

from scalelab.comm import Comm
from scalelab.config import RunConfig
from scalelab.instrument.timer import PhaseTimer
from scalelab.precision import Precision
from scalelab.strategies.pipeline.stage_plan import PlacedStage, StagePlan
from scalelab.workloads.base import Inputs, Workload


class PipelineHost(Protocol):
    cfg: RunConfig
    comm: Comm
    device: torch.device
    timer: PhaseTimer
    precision: Precision
    plan: StagePlan | None  # the cut (setup)
    placed: PlacedStage | None  # this rank's stage of the cut (setup)

    @property
    def is_root(self) -> bool: ...
    def autocast(self) -> AbstractContextManager: ...
    def setup(self, workload: Workload, model: nn.Module, sample: torch.Tensor | None) -> None: ...
    def place(self, counts: list[int], sample: torch.Tensor | None) -> None: ...
    def prepare(self, x: torch.Tensor) -> torch.Tensor: ...
    def device_batch(self, x: torch.Tensor) -> torch.Tensor: ...
    def forward_batch(self, x: torch.Tensor | None, n: int) -> torch.Tensor | None: ...
    def pipelined_pass(self, batch: Inputs | None, n: int) -> torch.Tensor | None: ...
    def stage_summary(self, laps: list, walls: list[float], spans: list | None = None) -> dict: ...
    def announce(self, notes: dict[str, Any]) -> dict[str, Any]: ...
    def bytes_moved(self) -> dict[str, int]: ...
