"""Where a pipeline's stages run: the placement registry `--placement` and `--engine` choose
from. `pipeline` is one registered strategy; `PipelineStrategy.build` constructs the entry
named here (no placement is a subclass of another, and none needs to be).

Entries are imported on use: torch.distributed.pipelining (the torch engine) costs ~2 s of
CPU in imports (dynamo, DTensor) that a run of the scalelab engine should not pay, nor the
process that checks a torch-engine run's options and launches its ranks. So each entry
declares here the config sections its placement reads: the classes take theirs from it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from scalelab.config import RunConfig
from scalelab.errors import UsageError


@dataclass(frozen=True)
class Placement:
    description: str
    module: str  # the module that defines the placement's Strategy class
    cls: str
    reads: tuple[str, ...]  # the config sections a run on it reads (the class's `reads`)

    def load(self) -> type:
        return getattr(importlib.import_module(self.module), self.cls)


PLACEMENTS: dict[str, Placement] = {
    "scheduled": Placement(
        "one rank per stage, micro-batches through scalelab's GPipe/1F1B engine",
        "scalelab.strategies.pipeline.strategy",
        "PipelineStrategy",
        ("pipeline", "placement", "engine", "gpus", "layout", "compile", "checkpoint"),
    ),
    "torch": Placement(
        "one rank per stage (x --dp replicas), torch.distributed.pipelining's schedules",
        "scalelab.strategies.pipeline.torch_engine",
        "TorchPipeline",
        ("pipeline", "engine", "mesh", "interleave", "layout", "checkpoint"),
    ),
    "manual": Placement(
        "naive model parallelism: the stages on the GPUs of one process, no micro-batches",
        "scalelab.strategies.pipeline.manual",
        "ManualPlacement",
        ("pipeline", "placement", "engine", "checkpoint"),
    ),
}
PLACEMENT_FLAGS = ("pipeline", "manual")  # the values --placement takes


def placement_name(cfg: RunConfig) -> str:
    """The PLACEMENTS entry a config asks for (--placement manual, else by --engine)."""
    if cfg.placement not in PLACEMENT_FLAGS:
        raise UsageError(
            f"unknown --placement {cfg.placement!r} (known: {', '.join(PLACEMENT_FLAGS)})"
        )
    if cfg.placement == "manual":
        return "manual"
    return "torch" if cfg.engine == "torch" else "scheduled"
