"""How an inference batch is divided over ranks: the interface every split implements.

A split sees a `Comm` (mpi4py or torch.distributed, never which), a `Transport` (host, pinned
host staging, or device-direct) and the rank's `TimelineTimer`. The same split classes run
under `mpi` (CPU ranks), `mpi-gpu` (one GPU per rank) and `nccl`: only those three objects
differ between them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch
from torch import nn

from scalelab.config import RunConfig
from scalelab.registry import Registry
from scalelab.workloads.base import Inputs, Workload

if TYPE_CHECKING:
    from scalelab.comm.base import Comm
    from scalelab.instrument.timer import PhaseTimer
    from scalelab.precision import Precision
    from scalelab.strategies.split.transport import Transport

# Activation memory one forward pass may use (largest layer's input + output); bigger local
# batches run as several passes so that charcnn at 32k texts per GPU fits (about 2 MB/text).
PASS_BUDGET_BYTES = 4 << 30


class SplitHost(Protocol):
    """What a split reads of the strategy running it (split/strategy.SplitStrategy, which
    imports the splits, so they name this instead of it)."""

    cfg: RunConfig
    comm: Comm
    timer: PhaseTimer
    wire: Transport
    precision: Precision

    def forward(self, workload: Workload, model: nn.Module, x: torch.Tensor) -> torch.Tensor: ...


class Split:
    """One way of dividing the work; subclasses register in SPLITS by name."""

    name: ClassVar[str]

    def __init__(self, strategy: SplitHost, workload: Workload) -> None:
        self.strategy = strategy
        self.workload = workload
        self.cfg = strategy.cfg
        self.comm = strategy.comm
        self.timer = strategy.timer
        self.wire = strategy.wire

    @property
    def rank(self) -> int:
        return self.comm.rank

    @classmethod
    def check(cls, cfg: RunConfig, workload: Workload, ranks: int) -> None:
        """Raise UsageError for a topology this split cannot run (ranks vs batch, slab vs
        halo); needs no comm, so it also runs before a launcher starts the ranks."""

    def validate(self) -> None:
        self.check(self.cfg, self.workload, self.comm.size)

    def setup(self, model: nn.Module, inputs: Inputs | None) -> None:
        """Untimed preparation: weight slices, plans, pinned inputs (root has inputs)."""
        self.model = model
        self.inputs = inputs

    def step(self) -> torch.Tensor | None:
        """One timed iteration; returns the float64 output on the root rank, else None."""
        raise NotImplementedError

    def notes(self) -> dict[str, Any]:
        """Split-specific facts for the record (root rank's view)."""
        return {}

    def rank_extra(self) -> dict[str, Any]:
        """Per-rank facts gathered into the record (e.g. overlap accounting)."""
        return {}

    # --- helpers the splits share ------------------------------------------------------------
    def received(self, phase: str, t: torch.Tensor) -> None:
        """Book bytes that crossed to this rank (the root's own share never moves)."""
        if not self.comm.is_root:
            self.timer.add_bytes(phase, t.nbytes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The whole model on this rank's items, in passes that fit PASS_BUDGET_BYTES."""
        n = pass_items(self.workload, self.strategy.precision.itemsize)
        outs = [
            self.strategy.forward(self.workload, self.model, x[i : i + n])
            for i in range(0, x.shape[0], n)
        ]
        return outs[0] if len(outs) == 1 else torch.cat(outs)


def pass_items(workload: Workload, itemsize: int) -> int:
    """Items per forward pass under the activation budget (at least 1)."""
    per_item = max(r.in_elems + r.out_elems for r in workload.cost_table()) * max(itemsize, 4)
    return max(1, PASS_BUDGET_BYTES // per_item)


SPLITS: Registry[type[Split]] = Registry("split")
