"""`MPIComm`: the comm interface over mpi4py.

Collectives move raw bytes (MPI.BYTE) so any torch dtype travels unchanged (bf16 included);
only reductions need a typed buffer. CPU tensors go through zero-copy NumPy views. CUDA tensors
go straight to the library when it is CUDA-aware (mpi4py reads __cuda_array_interface__);
otherwise the caller stages them through pinned host buffers (the mpi-gpu strategy does).
"""

from __future__ import annotations

import atexit
import math
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from scalelab.comm import slurm_env as slurm
from scalelab.comm.base import Comm, Request
from scalelab.environment import mpi_problem, query_cuda_aware
from scalelab.errors import UsageError

_NUMPY_REDUCIBLE = {torch.float32, torch.float64, torch.int32, torch.int64, torch.float16}


def import_mpi():
    """mpi4py's MPI module, initialised (thread-multiple requested) and finalised at exit."""
    problem = mpi_problem()  # mpi4py missing, or no MPI library on the loader's path
    if problem is not None:
        raise UsageError(problem)
    import mpi4py

    mpi4py.rc.initialize = False  # we initialise ourselves, so import order never matters
    mpi4py.rc.finalize = False
    from mpi4py import MPI

    if not MPI.Is_initialized():
        os.environ.update(slurm_pmi2_netmod(os.environ, MPI.Get_library_version()))
        MPI.Init_thread(MPI.THREAD_MULTIPLE)
        atexit.register(lambda: MPI.Is_finalized() or MPI.Finalize())
    return MPI


# MPICH's own netmod variable and its aliases; a user's choice is kept.
NETMOD_VARS = ("MPIR_CVAR_CH4_NETMOD", "MPICH_CH4_NETMOD", "MPIR_PARAM_CH4_NETMOD")


def slurm_pmi2_netmod(env: Mapping[str, str], version: str) -> dict[str, str]:
    """The netmod an MPICH with both UCX and OFI (the PyPI wheel: `MPICH Device: ch4:ucx
    ofi`) must use under `srun --mpi=pmi2`: OFI, unless the user chose one.

    Slurm's pmi2 plugin serves MPICH's PMI-1 wire protocol with one read of at most 1024
    bytes per request (pmi1.c, "TODO: read until newline"). MPICH cuts its business card in
    values of up to 1022 hex characters, so `cmd=put kvsname=JOB.STEP key=-allgather-1-0-seg-3/9
    value=...` can run past 1024 bytes: slurmstepd logs "mpi/pmi2: value not properly
    terminated in client request" and "invalid client request", never answers, and every rank
    waits in MPI_Init for ever. UCX's card is 4096 bytes in 9 such values, long or short as
    the zeros in it fall (1 hang in 20 launches of alexnet's spatial split on 2 nodes); OFI's
    is 16 bytes, one 72-byte line (0 in 32). PMI-2's length-prefixed requests would be read
    whole, but the wheel's MPICH has no PMI-2 or PMIx client (MPIR_CVAR_PMI_VERSION=2 or x:
    "Internal MPI error" in MPIR_pmi_init)."""
    if env.get("SLURM_MPI_TYPE") != "pmi2" or "MPI_LOCALNRANKS" in env:  # not under Hydra
        return {}
    if any(env.get(var) for var in NETMOD_VARS):
        return {}
    device = next((ln for ln in version.splitlines() if ln.startswith("MPICH Device:")), "")
    netmods = re.split(r"[\s,]+", device.partition("ch4:")[2].strip())
    return {"MPIR_CVAR_CH4_NETMOD": "ofi"} if {"ucx", "ofi"} <= set(netmods) else {}


def check_spans_srun(size: int) -> None:
    """Under srun, MPI must span the step's tasks. Without a PMI shared by srun and the
    library every task initialises a world of one, and N independent studies would each
    record a 1-rank run: refused (task 0 says why; the others exit 2 quietly)."""
    tasks = slurm.step_tasks()
    launched_by_mpiexec = any(v in os.environ for v in ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_SIZE"))
    if tasks is None or tasks <= 1 or size == tasks or launched_by_mpiexec:
        return
    if os.environ.get("SLURM_PROCID", "0") != "0":
        raise SystemExit(2)
    from scalelab.environment import mpi_info

    speaks = mpi_info().get("mpi_pmi") or ["pmi2"]
    raise UsageError(
        f"srun started {tasks} tasks but MPI sees {size} rank(s) in each: srun and this MPI "
        f"library share no PMI; run srun --mpi={speaks[-1]} (this library speaks "
        f"{', '.join(speaks)})"
    )


class _MPIRequest(Request):
    def __init__(self, req: Any, keep: Any) -> None:
        self._req, self._keep = req, keep  # keep the buffer alive until the request completes

    def wait(self) -> None:
        self._req.Wait()


class MPIComm(Comm):
    backend = "mpi"

    def __init__(self) -> None:
        self.MPI = import_mpi()
        self.world = self.MPI.COMM_WORLD
        check_spans_srun(self.world.Get_size())
        self.node = self.world.Split_type(self.MPI.COMM_TYPE_SHARED)
        self.cuda_aware = query_cuda_aware(self.MPI) and torch.cuda.is_available()
        self.device = "cuda" if self.cuda_aware else "cpu"

    @property
    def rank(self) -> int:
        return self.world.Get_rank()

    @property
    def size(self) -> int:
        return self.world.Get_size()

    @property
    def local_rank(self) -> int:
        return self.node.Get_rank()

    def library_version(self) -> str:
        return self.MPI.Get_library_version().splitlines()[0].strip()

    # --- buffers ---------------------------------------------------------------------------
    def _bytes(self, t: torch.Tensor) -> Any:
        """A flat uint8 view of t that MPI can read or write in place."""
        flat = t.reshape(-1).view(torch.uint8)
        if t.is_cuda:
            if not self.cuda_aware:
                raise RuntimeError("this MPI library is not CUDA-aware: stage through host")
            torch.cuda.current_stream().synchronize()  # MPI does not follow CUDA streams
            return [flat, self.MPI.BYTE]
        return [flat.numpy(), self.MPI.BYTE]

    # --- objects -----------------------------------------------------------------------------
    def barrier(self) -> None:
        self.world.Barrier()

    def gather_object(self, obj: Any, root: int = 0) -> list[Any] | None:
        return self.world.gather(obj, root=root)

    def bcast_object(self, obj: Any, root: int = 0) -> Any:
        return self.world.bcast(obj, root=root)

    # --- tensors -----------------------------------------------------------------------------
    def scatterv(
        self, x: torch.Tensor | None, counts: Sequence[int], root: int = 0
    ) -> torch.Tensor:
        tail, dtype = self.bcast_object(
            (tuple(x.shape[1:]), x.dtype) if self.rank == root else None, root
        )
        row = math.prod(tail) * torch.empty((), dtype=dtype).element_size()
        out = torch.empty(
            (counts[self.rank], *tail), dtype=dtype, device=x.device if x is not None else "cpu"
        )
        nbytes = [c * row for c in counts]
        displs = [sum(nbytes[:r]) for r in range(len(nbytes))]
        send = None
        if self.rank == root:
            buf = x.contiguous()
            send = [self._bytes(buf)[0], (nbytes, displs), self.MPI.BYTE]
        self.world.Scatterv(send, self._bytes(out), root=root)
        return out

    def gatherv(self, x: torch.Tensor, root: int = 0) -> torch.Tensor | None:
        x = x.contiguous()
        counts = self.world.gather(x.shape[0], root=root)
        row = math.prod(x.shape[1:]) * x.element_size()
        out, recv = None, None
        if self.rank == root:
            out = torch.empty((sum(counts), *x.shape[1:]), dtype=x.dtype, device=x.device)
            nbytes = [c * row for c in counts]
            displs = [sum(nbytes[:r]) for r in range(len(nbytes))]
            recv = [self._bytes(out)[0], (nbytes, displs), self.MPI.BYTE]
        self.world.Gatherv(self._bytes(x), recv, root=root)
        return out

    def allreduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        mpi_op = {"sum": self.MPI.SUM, "max": self.MPI.MAX}[op]
        if x.is_cuda or x.dtype not in _NUMPY_REDUCIBLE:
            if x.is_cuda and self.cuda_aware:
                torch.cuda.current_stream().synchronize()
                self.world.Allreduce(self.MPI.IN_PLACE, x, op=mpi_op)
                return x
            raise RuntimeError(
                f"MPI allreduce needs a host float/int tensor, got {x.dtype} on {x.device}"
            )
        self.world.Allreduce(self.MPI.IN_PLACE, x.numpy(), op=mpi_op)
        return x

    def bcast(self, x: torch.Tensor | None, root: int = 0) -> torch.Tensor:
        shape, dtype = self.bcast_object(
            (tuple(x.shape), x.dtype) if self.rank == root else None, root
        )
        buf = x.contiguous() if self.rank == root else torch.empty(shape, dtype=dtype)
        self.world.Bcast(self._bytes(buf), root=root)
        return buf

    def isend(self, x: torch.Tensor, dest: int, tag: int = 0) -> Request:
        x = x.contiguous()
        return _MPIRequest(self.world.Isend(self._bytes(x), dest=dest, tag=tag), x)

    def irecv(self, buf: torch.Tensor, source: int, tag: int = 0) -> Request:
        if not buf.is_contiguous():
            raise ValueError("irecv needs a contiguous buffer")
        return _MPIRequest(self.world.Irecv(self._bytes(buf), source=source, tag=tag), buf)

    def abort(self, code: int = 1) -> None:
        self.world.Abort(code)
