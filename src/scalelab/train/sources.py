"""Where a rank's training batches come from.

`batch_order` is the one shuffled order every strategy and rank count follows; a
`BatchSource` yields one `Step` per optimizer step: this rank's share of the global batch and
its weight in the global mean loss. `GlobalBatches` is the one-process order with each rank
keeping `strategy.shard(batch)`; mpi-dp scatters its shares (strategies/mpi_dp.py), ddp takes
DistributedSampler's (train/data.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from scalelab.workloads.base import Inputs

if TYPE_CHECKING:
    from scalelab.train.host import TrainHost


def batch_order(n: int, epoch: int, seed: int) -> torch.Tensor:
    """The shuffled item order of one epoch, identical for every strategy and rank count.

    torch's DistributedSampler draws the same permutation with seed=seed * 1_000_003."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))


def batch_slices(n: int, batch: int) -> list[slice]:
    """Consecutive batches of the epoch; the last one may be short (kept, not dropped)."""
    return [slice(start, min(start + batch, n)) for start in range(0, n, batch)]


@dataclass
class Step:
    """One optimizer step's data on this rank.

    local: this rank's items (transport form, any device); items: the step's items over all
    ranks; weight: this rank's factor on its mean loss so that the reduced gradient is the
    gradient of the global mean (len(local) / items when ranks sum their gradients).
    """

    local: Inputs
    items: int
    weight: float


class BatchSource(ABC):
    """A rank's view of the epochs: its share of each global batch, in order."""

    global_batch: int  # items per optimizer step over all ranks (checkpoints record it)

    @abstractmethod
    def steps_per_epoch(self) -> int: ...

    @abstractmethod
    def epoch(self, epoch: int, skip: int) -> Iterator[Step]:
        """The epoch's steps from step `skip` on (skip > 0 when resuming mid-epoch)."""


RESIDENT_SHARE = 0.25  # at most this share of the GPU's free memory holds the training set


def on_device(train: Inputs, device: torch.device) -> Inputs:
    """The training set moved to a CUDA device when it takes at most RESIDENT_SHARE of the
    free memory (else as it was, on the host). A step is then one gather by index on the GPU,
    as ddp's ResidentShards does, instead of a gather on the host and a pinned copy each step
    (a launched rank runs one host thread: VGG-16's 256 x 3 x 224 x 224 pixels are 38.5 MB)."""
    if device.type != "cuda":
        return train
    size = train.x.nbytes + (0 if train.y is None else train.y.nbytes)
    if size > RESIDENT_SHARE * torch.cuda.mem_get_info(device)[0]:
        return train
    return Inputs(train.x.to(device), None if train.y is None else train.y.to(device))


class GlobalBatches(BatchSource):
    """The one-process order (batch_order, batch_slices); each rank keeps strategy.shard(batch).
    Needs the training set on every rank that calls it; on a GPU it lives there (on_device)."""

    def __init__(self, strategy: TrainHost, train: Inputs, batch: int, seed: int) -> None:
        self.strategy, self.global_batch, self.seed = strategy, batch, seed
        self.train = on_device(train, strategy.device)

    def steps_per_epoch(self) -> int:
        return len(batch_slices(len(self.train), self.global_batch))

    def epoch(self, epoch: int, skip: int) -> Iterator[Step]:
        # one copy of the order per epoch onto the set's device, not one per step
        order = batch_order(len(self.train), epoch, self.seed).to(self.train.x.device)
        for part in batch_slices(len(self.train), self.global_batch)[skip:]:
            idx = order[part]
            local = self.strategy.shard(Inputs(self.train.x[idx], self.train.y[idx]))
            yield Step(local, len(idx), len(local) / len(idx))
