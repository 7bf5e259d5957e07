"""Communication layer: one interface over mpi4py and torch.distributed."""

from scalelab.comm.base import Comm, SelfComm

__all__ = ["Comm", "SelfComm"]
