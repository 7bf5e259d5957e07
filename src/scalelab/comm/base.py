"""The communication layer every strategy talks through.

One interface over the engines that really move bytes (mpi4py, torch.distributed); strategies
never branch on the backend. `SelfComm` is the one-process member: every collective is the
identity, so a workload runs unchanged without a launcher.

Tensors are torch tensors. `Comm.device` says where a backend's buffers must live: "cpu" for
MPI without CUDA support and for gloo, "cuda" for NCCL and CUDA-aware MPI. Split collectives
(scatterv/gatherv) work along dim 0 with uneven counts.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import torch


class Request(ABC):
    """A non-blocking operation in flight."""

    @abstractmethod
    def wait(self) -> None: ...


class Comm(ABC):
    """Rank, size and the collectives the strategies use."""

    backend: str = "abstract"
    device: str = "cpu"  # where this backend's buffers live
    cuda_aware: bool = False  # MPI accepts device buffers directly

    # --- identity ---------------------------------------------------------------------------
    @property
    @abstractmethod
    def rank(self) -> int: ...

    @property
    @abstractmethod
    def size(self) -> int: ...

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    @property
    def local_rank(self) -> int:
        """Rank within this node (picks the GPU: local_rank % gpus_per_node)."""
        return self.rank

    # --- small Python objects (metadata, phase tables, metrics) -----------------------------
    @abstractmethod
    def barrier(self) -> None: ...

    @abstractmethod
    def gather_object(self, obj: Any, root: int = 0) -> list[Any] | None:
        """Pickled gather, list on root, None elsewhere."""

    @abstractmethod
    def bcast_object(self, obj: Any, root: int = 0) -> Any: ...

    # --- tensors ------------------------------------------------------------------------------
    @abstractmethod
    def scatterv(
        self, x: torch.Tensor | None, counts: Sequence[int], root: int = 0
    ) -> torch.Tensor:
        """Root's x (sum(counts), ...) split along dim 0; rank r receives counts[r] rows."""

    @abstractmethod
    def gatherv(self, x: torch.Tensor, root: int = 0) -> torch.Tensor | None:
        """Concatenate every rank's x along dim 0 (rows may differ) on root; None elsewhere."""

    @abstractmethod
    def allreduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In-place reduction ("sum" or "max") over ranks; returns x."""

    @abstractmethod
    def bcast(self, x: torch.Tensor | None, root: int = 0) -> torch.Tensor:
        """Root's tensor on every rank (others may pass None: shape travels as metadata)."""

    @abstractmethod
    def isend(self, x: torch.Tensor, dest: int, tag: int = 0) -> Request: ...

    @abstractmethod
    def irecv(self, buf: torch.Tensor, source: int, tag: int = 0) -> Request: ...

    # --- lifetime ------------------------------------------------------------------------------
    def abort(self, code: int = 1) -> None:
        """Bring every rank down (a failed rank must not leave the others waiting)."""
        raise SystemExit(code)

    def close(self) -> None:
        """Release the engine; safe to call twice."""


class _Done(Request):
    def wait(self) -> None:
        pass


class SelfComm(Comm):
    """A world of one: collectives return their input."""

    backend = "self"

    @property
    def rank(self) -> int:
        return 0

    @property
    def size(self) -> int:
        return 1

    def barrier(self) -> None:
        pass

    def gather_object(self, obj: Any, root: int = 0) -> list[Any] | None:
        return [obj]

    def bcast_object(self, obj: Any, root: int = 0) -> Any:
        return obj

    def scatterv(
        self, x: torch.Tensor | None, counts: Sequence[int], root: int = 0
    ) -> torch.Tensor:
        assert x is not None and list(counts) == [x.shape[0]]
        return x

    def gatherv(self, x: torch.Tensor, root: int = 0) -> torch.Tensor | None:
        return x

    def allreduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        return x

    def bcast(self, x: torch.Tensor | None, root: int = 0) -> torch.Tensor:
        assert x is not None
        return x

    def isend(self, x: torch.Tensor, dest: int, tag: int = 0) -> Request:
        raise RuntimeError("SelfComm has no peer to send to")

    def irecv(self, buf: torch.Tensor, source: int, tag: int = 0) -> Request:
        raise RuntimeError("SelfComm has no peer to receive from")


def even_counts(n: int, parts: int) -> list[int]:
    """n rows over parts ranks, the first n % parts ranks one row more (Scatterv counts)."""
    base, extra = divmod(n, parts)
    return [base + (1 if r < extra else 0) for r in range(parts)]
