"""Strategies: one module per way of executing a workload. Importing fills the registry."""

from scalelab.strategies import (  # noqa: F401
    ddp,
    fsdp,
    local,
    mpi_cpu,
    mpi_dp,
    mpi_gpu,
    nccl,
    pipeline,
    serial,
    tensor,
)
from scalelab.strategies.base import STRATEGIES, Strategy

__all__ = ["STRATEGIES", "Strategy"]
