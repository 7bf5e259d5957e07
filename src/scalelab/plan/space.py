"""What a plan is for: one workload (a base RunConfig: model sizes, training or inference,
data), the hardware (ranks, ranks per node, CPU cores), the batch rule and the knobs the
user lets the planner turn (precisions)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from scalelab.config import RunConfig
from scalelab.errors import UsageError


@dataclass(frozen=True, kw_only=True)
class PlanSpec:
    base: RunConfig
    """The run every candidate starts from (workload, sizes, --train, data, iters)."""
    ranks_max: int
    """The most ranks (processes) a candidate may use."""
    per_node: int
    """Ranks per node: GPUs per node, or CPU cores per node for CPU strategies."""
    cores: int = 1
    """CPU cores per node (ranks x threads per rank never exceed it: time-slicing is not
    modelled)."""
    global_batch: int | None = None
    """Items per iteration or optimizer step over all ranks (every candidate the same)."""
    per_rank_batch: int | None = None
    """Items per rank (the global batch grows with the ranks); exclusive with global_batch."""
    precisions: tuple[str, ...] = ("fp32",)
    """Precisions a candidate may use (a lower one changes the numerics: opt in)."""
    memory_per_device: float | None = None
    """Bytes a rank may hold (None: no memory filter)."""
    strategies: tuple[str, ...] | None = None
    """Only these candidate sources (None: every source that applies)."""

    def __post_init__(self) -> None:
        if self.ranks_max < 1 or self.per_node < 1 or self.cores < 1:
            raise UsageError("--ranks-max, --gpus-per-node and the core count must be >= 1")
        if (self.global_batch is None) == (self.per_rank_batch is None):
            raise UsageError("give one of --global-batch and --per-rank-batch")
        if min(self.global_batch or 1, self.per_rank_batch or 1) < 1:
            raise UsageError("--global-batch and --per-rank-batch must be >= 1")

    @property
    def gpu(self) -> bool:
        return self.base.device == "cuda"

    def batch_of(self, ranks: int) -> int:
        """Items per iteration over all ranks."""
        return self.global_batch if self.global_batch is not None else self.per_rank_batch * ranks

    def layouts(self) -> list[tuple[int, int | None]]:
        """(ranks, threads per rank): on CPUs every split of the node's cores that
        oversubscribes none (ranks x threads <= cores on a node); on GPUs powers of two and
        --ranks-max itself, no threads."""
        if self.gpu:
            ranks = sorted({2**i for i in range(self.ranks_max.bit_length())} | {self.ranks_max})
            return [(n, None) for n in ranks if n <= self.ranks_max]
        out = []
        for n in range(1, self.ranks_max + 1):
            on_node = min(n, self.per_node)
            out += [(n, t) for t in range(1, self.cores // on_node + 1)]
        return out

    def config(self, **change) -> RunConfig:
        return dataclasses.replace(self.base, **change)
