"""The pipeline's view of a model: an ordered list of layers whose composition is its forward
(the workload's own description, `Workload.layers`), and the planning it is cut by. The
planning lives in scalelab.planning (predict uses it too); its names are re-exported here for
the strategies that import `partition as part`.
"""

from __future__ import annotations

from torch import nn

from scalelab.planning.partition import (  # noqa: F401  (re-exported)
    LayerProfile,
    MemoryModel,
    balance_auto,
    bounds,
    fit_layer_seconds,
    memory_model,
    min_stages,
    parse_balance,
    rebalance,
    recut_step,
)
from scalelab.planning.profiling import (  # noqa: F401  (re-exported)
    HEADROOM,
    MEM_LIMIT_ENV,
    cap_allocator,
    device_capacity,
    env_mem_limit,
    profile_layers,
)
from scalelab.workloads.base import Workload
from scalelab.workloads.layers import Layer


def model_layers(workload: Workload, model: nn.Module) -> list[Layer]:
    """The model as an ordered list of layers whose composition is its forward."""
    return workload.layers(model)
