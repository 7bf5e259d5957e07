"""Communication layer: one interface over mpi4py and torch.distributed."""

from scalelab.comm.base import Comm, Request, SelfComm, even_counts

__all__ = ["Comm", "Request", "SelfComm", "even_counts"]
