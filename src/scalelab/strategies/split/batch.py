"""`--split batch`: Scatterv the batch (uneven counts allowed), compute, Gatherv the outputs.

Inputs travel in their transport form (uint8 pixels, uint8 character indices) and are
expanded on the rank's device; outputs travel in the compute dtype.
"""

from __future__ import annotations

import torch
from torch import nn

from scalelab.comm.base import even_counts
from scalelab.config import RunConfig
from scalelab.errors import UsageError
from scalelab.strategies.split.base import SPLITS, Split
from scalelab.workloads.base import Inputs, Workload


@SPLITS.register("batch", "Scatterv the batch over ranks, compute, Gatherv the outputs")
class BatchSplit(Split):
    @classmethod
    def check(cls, cfg: RunConfig, workload: Workload, ranks: int) -> None:
        if ranks > cfg.batch:
            raise UsageError(
                f"--split batch: {ranks} ranks but only {cfg.batch} items in the batch; "
                f"use --ranks <= {cfg.batch} or a larger --batch"
            )

    def setup(self, model: nn.Module, inputs: Inputs | None) -> None:
        super().setup(model, inputs)
        self.counts = even_counts(self.cfg.batch, self.comm.size)
        self.host_x = self.wire.pin(inputs.x) if inputs is not None else None

    def notes(self) -> dict:
        return {"counts": self.counts}

    def step(self) -> torch.Tensor | None:
        root = self.comm.is_root
        x = self.wire.host_to_wire(self.host_x) if root else None
        with self.timer.phase("scatter"):
            x = self.comm.scatterv(x, self.counts)
        self.received("scatter", x)
        x = self.wire.from_wire(x)
        with self.timer.phase("compute"):
            y = self.forward(x)
        y = self.wire.to_wire(y)
        with self.timer.phase("wait"):  # load imbalance, kept out of the gather's transfer time
            self.comm.barrier()
        with self.timer.phase("gather"):
            out = self.comm.gatherv(y)
        if root:
            self.timer.add_bytes("gather", out.nbytes - y.nbytes)
            return self.wire.to_host64(out)
        return None
