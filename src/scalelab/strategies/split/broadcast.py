"""`--split broadcast`: the seed's V2.1 baseline. Every iteration the root broadcasts the whole
batch and every weight; every rank computes the whole batch; the root keeps its own copy.

It exists to show why replication loses: n ranks do n times the work of one, and the weights
(250 MB for AlexNet) cross the wire every time.
"""

from __future__ import annotations

import torch
from torch import nn

from scalelab.strategies.split.base import SPLITS, Split
from scalelab.workloads.base import Inputs


@SPLITS.register("broadcast", "every rank receives the whole batch and all weights (seed V2.1)")
class BroadcastSplit(Split):
    def setup(self, model: nn.Module, inputs: Inputs | None) -> None:
        super().setup(model, inputs)
        self.params = list(model.parameters())
        self.host_x = self.wire.pin(inputs.x) if inputs is not None else None
        self.flat = None
        if self.comm.is_root:  # one contiguous buffer, so the weights go in one broadcast
            with torch.no_grad():
                flat = torch.cat([p.detach().reshape(-1) for p in self.params])
            self.flat = self.wire.pin(flat.cpu()) if self.wire.staged else flat

    def step(self) -> torch.Tensor | None:
        root = self.comm.is_root
        x = self.wire.host_to_wire(self.host_x) if root else None
        with self.timer.phase("bcast"):
            x = self.comm.bcast(x)
            flat = self.comm.bcast(self.flat)
        self.received("bcast", x)
        self.received("bcast", flat)
        x, flat = self.wire.from_wire(x), self.wire.from_wire(flat)
        if not root:
            with self.timer.phase("bcast"):  # unpack the received weights into the model
                self._load(flat)
        with self.timer.phase("compute"):
            y = self.forward(x)
        with self.timer.phase("wait"):  # the iteration ends when every rank is done
            self.comm.barrier()
        return self.wire.to_host64(y) if root else None

    def _load(self, flat: torch.Tensor) -> None:
        offset = 0
        for p in self.params:
            n = p.numel()
            p.copy_(flat[offset : offset + n].view_as(p))
            offset += n
