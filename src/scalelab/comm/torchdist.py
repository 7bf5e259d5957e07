"""`TorchDistComm`: the comm interface over torch.distributed (gloo on CPU, NCCL on GPU).

Started by torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR in the environment). Uneven
scatter/gather pad every rank's share to the largest count (torch.distributed has no
Scatterv/Gatherv), then trim: the padding costs at most one row per rank.
"""

from __future__ import annotations

import datetime as dt
import gc
import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from scalelab.comm.base import Comm, Request
from scalelab.comm.launch import adopt_srun_step

# A dead peer must not leave the survivors waiting: collectives time out after this long.
TIMEOUT_S = float(os.environ.get("SCALELAB_COMM_TIMEOUT_S", "60"))


class _Work(Request):
    def __init__(self, work: Any) -> None:
        self._work = work

    def wait(self) -> None:
        self._work.wait()


class TorchDistComm(Comm):
    def __init__(self, backend: str) -> None:
        adopt_srun_step("torchrun")  # srun tasks without torchrun: rank and rendezvous from Slurm
        self.backend = backend
        self.device = "cuda" if backend == "nccl" else "cpu"
        self._local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if backend == "nccl":
            torch.cuda.set_device(self._local_rank % torch.cuda.device_count())
        if not dist.is_initialized():
            dist.init_process_group(backend, timeout=dt.timedelta(seconds=TIMEOUT_S))
        self._owns_group = True

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def size(self) -> int:
        return dist.get_world_size()

    @property
    def local_rank(self) -> int:
        return self._local_rank

    def barrier(self) -> None:
        dist.barrier()

    def gather_object(self, obj: Any, root: int = 0) -> list[Any] | None:
        out = [None] * self.size if self.rank == root else None
        dist.gather_object(obj, out, dst=root)
        return out

    def bcast_object(self, obj: Any, root: int = 0) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=root)
        return box[0]

    def scatterv(
        self, x: torch.Tensor | None, counts: Sequence[int], root: int = 0
    ) -> torch.Tensor:
        tail, dtype = self.bcast_object(
            (tuple(x.shape[1:]), x.dtype) if self.rank == root else None, root
        )
        most = max(counts)
        out = torch.empty((most, *tail), dtype=dtype, device=self.device)
        parts = None
        if self.rank == root:
            x = x.to(self.device)
            parts, start = [], 0
            for c in counts:
                part = torch.zeros((most, *tail), dtype=dtype, device=self.device)
                part[:c] = x[start : start + c]
                parts.append(part)
                start += c
        dist.scatter(out, parts, src=root)
        return out[: counts[self.rank]]

    def gatherv(self, x: torch.Tensor, root: int = 0) -> torch.Tensor | None:
        counts = torch.tensor([x.shape[0]], device=self.device)
        all_counts = [torch.zeros_like(counts) for _ in range(self.size)]
        dist.all_gather(all_counts, counts)
        sizes = [int(c) for c in all_counts]
        padded = torch.zeros((max(sizes), *x.shape[1:]), dtype=x.dtype, device=self.device)
        padded[: x.shape[0]] = x
        bufs = [torch.empty_like(padded) for _ in range(self.size)] if self.rank == root else None
        dist.gather(padded, bufs, dst=root)
        if self.rank != root:
            return None
        return torch.cat([b[:n] for b, n in zip(bufs, sizes)])

    def allreduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        dist.all_reduce(x, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])
        return x

    def bcast(self, x: torch.Tensor | None, root: int = 0) -> torch.Tensor:
        shape, dtype = self.bcast_object(
            (tuple(x.shape), x.dtype) if self.rank == root else None, root
        )
        buf = (
            x.to(self.device)
            if self.rank == root
            else torch.empty(shape, dtype=dtype, device=self.device)
        )
        dist.broadcast(buf, src=root)
        return buf

    def isend(self, x: torch.Tensor, dest: int, tag: int = 0) -> Request:
        return _Work(dist.isend(x.contiguous(), dst=dest, tag=tag))

    def irecv(self, buf: torch.Tensor, source: int, tag: int = 0) -> Request:
        return _Work(dist.irecv(buf, src=source, tag=tag))

    def abort(self, code: int = 1) -> None:
        # torchrun tears the other workers down when one exits non-zero.
        os._exit(code)

    def close(self) -> None:
        """Destroy the group while the interpreter is fully alive. Objects that hold it in
        reference cycles (a DDP wrapper's reducer) are collected first: left to interpreter
        exit, gloo's worker threads were sometimes torn down mid-flight ("terminate called
        without an active exception", rank 1 of a 2-rank ddp run in CI). The barrier keeps
        a rank from tearing down while its peer still talks to it."""
        if self._owns_group and dist.is_initialized():
            gc.collect()
            dist.barrier()
            dist.destroy_process_group()
        self._owns_group = False
