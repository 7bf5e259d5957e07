"""The pipeline's plan, explicit: the cut of the workload's layers into stages and what it was
chosen from (StagePlan), and this rank's stage built from it (PlacedStage)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from scalelab.layout import partition as part
from scalelab.strategies.pipeline.stage import Meta, StageContext, StageExecutor
from scalelab.workloads.layers import Layer


@dataclass
class StagePlan:
    """layers: the workload's layers in order; counts: layers per stage (the cut); auto:
    chosen by --balance auto (so --rebalance may re-cut it);
    profile: --balance auto's per-layer measurement (root only; None for a given --balance);
    mem: the memory model the automatic cut respects (root); rounds: --rebalance's cuts tried,
    each with its measured stage times."""

    layers: list[Layer]
    counts: list[int]
    auto: bool = False
    profile: list[part.LayerProfile] | None = None
    mem: Any = None
    rounds: list[dict[str, Any]] = field(default_factory=list)

    def bounds(self, stage: int) -> tuple[int, int]:
        return part.bounds(self.counts)[stage]

    def layers_of(self, stage: int) -> list[Layer]:
        start, stop = self.bounds(stage)
        return self.layers[start:stop]

    def names(self, stage: int) -> list[str]:
        return [layer.name for layer in self.layers_of(stage)]


@dataclass
class PlacedStage:
    """This rank's stage of a plan: its layers on the device (module), possibly compiled
    (run), the shapes crossing its boundaries, and the executor that runs its op lists."""

    module: nn.Sequential
    ctx: StageContext
    executor: StageExecutor
    final_meta: Meta  # per-item shape and dtype of the last stage's output (the logits)
