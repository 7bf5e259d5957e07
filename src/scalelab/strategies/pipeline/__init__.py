"""The `pipeline` strategy: a model's layers cut into stages. One registered strategy
(strategy.PipelineStrategy) whose `build` constructs the placement the config names from the
placement registry (placements.PLACEMENTS): `scheduled` (scalelab's engine: strategy.py,
cut.py, stage.py, train.py, report.py), `torch` (torch.distributed.pipelining: torch_*.py)
and `manual` (manual.py). The schedules' op lists and their simulation are layout code
(scalelab/layout/schedule.py)."""

from scalelab.strategies.pipeline.placements import PLACEMENTS, placement_name
from scalelab.strategies.pipeline.strategy import PipelineStrategy

__all__ = ["PLACEMENTS", "PipelineStrategy", "placement_name"]
