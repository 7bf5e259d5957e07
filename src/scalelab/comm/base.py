"""The communication layer every strategy talks through.

One interface over the engines that really move bytes (mpi4py, torch.distributed); strategies
never branch on the backend. `SelfComm` is the one-process member: every collective is the
identity, so a workload runs unchanged without a launcher.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any


class Comm(ABC):
    """Rank, size and the collectives the strategies use."""

    backend: str = "abstract"

    @property
    @abstractmethod
    def rank(self) -> int: ...

    @property
    @abstractmethod
    def size(self) -> int: ...

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    @abstractmethod
    def barrier(self) -> None: ...

    @abstractmethod
    def gather_object(self, obj: Any, root: int = 0) -> list[Any] | None:
        """Pickled gather of a small Python object (phase tables, metrics), list on root."""

    @abstractmethod
    def bcast_object(self, obj: Any, root: int = 0) -> Any: ...

    def abort(self, code: int = 1) -> None:
        """Bring every rank down (a failed rank must not leave the others waiting)."""
        raise SystemExit(code)

    def close(self) -> None:
        """Release the engine (process groups); safe to call twice."""


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
