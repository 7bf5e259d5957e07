"""The data path of the `ddp` strategy: DistributedSampler's share of every epoch.

torch's DistributedSampler (shuffle, seed = seed * 1_000_003) draws each epoch the same
permutation as `batch_order`, pads it to a multiple of the world size W and gives rank r the
positions r, r + W, r + 2W, ...; a rank's step k is the k-th run of B of its positions. Step k
over all ranks is therefore the permutation's positions [k*B*W, (k+1)*B*W): the one-process
global batch of B*W items (when W divides the training set there is no padding and the
batches are the same sets as one process's). Every rank holds the same number of items, so
DDP's gradient average is the gradient of the global mean loss.

Two sources produce those shares:

ResidentShards  (--workers 0) the training set, already through `prepare`, lives on the
                device; a step is one gather by index, no host work and no host sync.
LoaderShards    (--workers N) a DataLoader over the transport-form set with N worker
                processes, pinned memory, persistent workers and prefetch; batches are
                fetched by index lists (no per-item collate) and copied to the device.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from scalelab.train.sources import BatchSource, Step
from scalelab.workloads.base import Inputs

PREFETCH = 4  # batches each worker keeps ready
PREPARE_CHUNK = 4096  # items prepared at once when the set moves to the device


def epoch_sampler(n: int, world: int, rank: int, seed: int) -> DistributedSampler:
    return DistributedSampler(
        range(n), num_replicas=world, rank=rank, shuffle=True, seed=seed * 1_000_003
    )


class _From(Sampler[int]):
    """A DistributedSampler's epoch from position `skip` on (resuming mid-epoch)."""

    def __init__(self, inner: DistributedSampler) -> None:
        self.inner, self.skip = inner, 0

    def set_epoch(self, epoch: int, skip: int) -> None:
        self.inner.set_epoch(epoch)
        self.skip = skip

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(iter(self.inner), self.skip, None)

    def __len__(self) -> int:
        return len(self.inner) - self.skip


class _Shares(BatchSource):
    def __init__(self, n: int, per_rank: int, world: int, rank: int, seed: int) -> None:
        self.sampler = epoch_sampler(n, world, rank, seed)
        self.per_rank, self.world = per_rank, world
        self.global_batch = per_rank * world

    def steps_per_epoch(self) -> int:
        return math.ceil(self.sampler.num_samples / self.per_rank)


class ResidentShards(_Shares):
    """Prepared training set on the device; prepare maps transport form -> model input."""

    def __init__(
        self,
        train: Inputs,
        per_rank: int,
        world: int,
        rank: int,
        seed: int,
        to_input: Callable[[torch.Tensor], torch.Tensor],
        device: torch.device,
    ) -> None:
        super().__init__(len(train), per_rank, world, rank, seed)
        chunks = [
            to_input(train.x[i : i + PREPARE_CHUNK].to(device))
            for i in range(0, len(train), PREPARE_CHUNK)
        ]
        self.x = torch.cat(chunks)  # (N, ...) model input, storage dtype
        self.y = train.y.to(device)

    def indices(self, epoch: int, skip: int) -> Iterator[torch.Tensor]:
        """This rank's item indices (on the device) for each step of the epoch from `skip`."""
        self.sampler.set_epoch(epoch)
        idx = torch.tensor(list(self.sampler), device=self.x.device)  # one copy per epoch
        b = self.per_rank
        for k in range(skip, self.steps_per_epoch()):
            yield idx[k * b : (k + 1) * b]

    def epoch(self, epoch: int, skip: int) -> Iterator[Step]:
        for part in self.indices(epoch, skip):
            yield Step(Inputs(self.x[part], self.y[part]), len(part) * self.world, 1.0)


class _ByIndex(Dataset):
    """Batched fetch: the DataLoader hands over a rank's index list, we return (x, y) tensors."""

    def __init__(self, data: Inputs) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitems__(self, idx: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        i = torch.as_tensor(idx)
        return self.data.x[i], self.data.y[i]


def _as_is(batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return batch


class LoaderShards(_Shares):
    """DataLoader with worker processes over the transport-form training set."""

    def __init__(
        self,
        train: Inputs,
        per_rank: int,
        world: int,
        rank: int,
        seed: int,
        workers: int,
        pin: bool,
    ) -> None:
        super().__init__(len(train), per_rank, world, rank, seed)
        self.from_ = _From(self.sampler)
        self.loader = DataLoader(
            _ByIndex(train),
            batch_size=per_rank,
            sampler=self.from_,
            num_workers=workers,
            pin_memory=pin,
            persistent_workers=workers > 0,
            prefetch_factor=PREFETCH if workers > 0 else None,
            collate_fn=_as_is,
        )

    def epoch(self, epoch: int, skip: int) -> Iterator[Step]:
        self.from_.set_epoch(epoch, skip * self.per_rank)
        for x, y in self.loader:
            yield Step(Inputs(x, y), len(x) * self.world, 1.0)
