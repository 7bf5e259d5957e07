"""Where a graph-captured training step's batches come from.

A captured step reads its batch by index from a data set that lives on the GPU, so a feed
gives two things: the resident set (uploaded once) and, per step, this rank's item indices.
One feed per data path the plain trainers have, so the fast path trains on exactly the
batches the plain loop would:

GlobalFeed  one process: `batch_order`'s permutation cut into `batch_slices` (train/sources.py)
ShardFeed   `ddp`: DistributedSampler's share of every epoch, the set already prepared on the
            device by ResidentShards (train/data.py)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from scalelab.train.data import ResidentShards
from scalelab.train.sources import batch_order, batch_slices
from scalelab.workloads.base import Inputs

Prepare = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class GlobalFeed:
    """The whole training set, in transport form, through `prepare` once on the device."""

    train: Inputs
    batch: int
    seed: int
    prepare: Prepare
    world: int = 1

    def resident(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, Prepare]:
        return self.train.x.to(device), self.train.y.to(device), self.prepare

    def steps(self, epoch: int, skip: int, device: torch.device) -> Iterator[torch.Tensor]:
        n = len(self.train)
        order = batch_order(n, epoch, self.seed).to(device)
        for part in batch_slices(n, self.batch)[skip:]:
            yield order[part]


@dataclass
class ShardFeed:
    """This rank's DistributedSampler share; the set is already model input on the device."""

    shards: ResidentShards

    @property
    def batch(self) -> int:
        return self.shards.per_rank

    @property
    def world(self) -> int:
        return self.shards.world

    def resident(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, Prepare]:
        return self.shards.x, self.shards.y, lambda x: x

    def steps(self, epoch: int, skip: int, device: torch.device) -> Iterator[torch.Tensor]:
        return self.shards.indices(epoch, skip)


Feed = GlobalFeed | ShardFeed
