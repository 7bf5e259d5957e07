"""Inference splits shared by the `mpi`, `mpi-gpu` and `nccl` strategies: one code path, the
comm object (mpi4py or torch.distributed) and the transport (host, pinned staging, device)
differ. Importing fills SPLITS."""

from scalelab.strategies.split import batch, broadcast, overlap, spatial  # noqa: F401
from scalelab.strategies.split.base import SPLITS, Split
from scalelab.strategies.split.strategy import SplitStrategy

__all__ = ["SPLITS", "Split", "SplitStrategy"]
