"""Communication layer: one interface over mpi4py and torch.distributed.

Comm and friends load on first use (they import torch): a process that only asks Slurm about
its job (`scalelab.comm.slurm_env`, a stopped job's record in its kill grace) stays torch-free."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from scalelab.comm.base import Comm, Request, SelfComm, even_counts

__all__ = ["Comm", "Request", "SelfComm", "even_counts"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from scalelab.comm import base

        return getattr(base, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
