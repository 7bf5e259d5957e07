"""`mpi-gpu`: one GPU per MPI rank (the seed's V4), CUDA-aware transport where it exists (V5).

Each rank drives GPU `local_rank % gpus_per_node`. At start-up the strategy asks the MPI
library whether it accepts device buffers (mpi4py's `MPI.Query_cuda_support()`, i.e.
MPIX_Query_cuda_support; Open MPI's `ompi_info` flag `mpi_built_with_cuda_support` is
recorded beside it). If it does, the splits pass device buffers straight to MPI; if not, the
root says so once and every message is staged through pinned host buffers (d2h before a
send, h2d after a receive) with the same answer. `SCALELAB_MPI_HOST_STAGING=1` forces staging
on a CUDA-aware library (to compare the two). `--overlap` pipelines chunks over CUDA streams.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from functools import lru_cache
from typing import Any

import torch

from scalelab.comm.base import Comm
from scalelab.comm.launch import inside_mpi_launcher
from scalelab.config import RunConfig
from scalelab.errors import UsageError
from scalelab.strategies.base import STRATEGIES
from scalelab.strategies.mpi_cpu import require_mpi4py
from scalelab.strategies.split import SplitStrategy
from scalelab.workloads.base import Workload


def ranks_on_node(comm: Comm) -> int:
    """Processes sharing this node (MPI's shared-memory split, or torchrun's environment)."""
    node = getattr(comm, "node", None)
    if node is not None:
        return node.Get_size()
    return int(os.environ.get("LOCAL_WORLD_SIZE", comm.size))


def check_gpus_per_node(strategy: SplitStrategy) -> None:
    """The check below with the ranks the launcher really put on this node."""
    check_gpu_count(strategy.cfg, ranks_on_node(strategy.comm), strategy.comm.local_rank)


def check_gpu_count(cfg: RunConfig, local: int, local_rank: int) -> None:
    """More ranks than GPUs on a node is an error unless --oversubscribe-gpus (then warned)."""
    gpus = torch.cuda.device_count()
    if local <= gpus:
        return
    if not cfg.oversubscribe_gpus:
        raise UsageError(
            f"{local} ranks on this node but {gpus} GPU(s): ranks would share GPUs; "
            "use --ranks <= GPUs per node, or --oversubscribe-gpus to allow it"
        )
    if local_rank == 0:
        sys.stderr.write(
            f"scalelab: warning: {local} ranks share {gpus} GPU(s) on this node "
            "(--oversubscribe-gpus): timings include the contention\n"
        )


@lru_cache(maxsize=1)
def ompi_built_with_cuda() -> bool | None:
    """Open MPI's own build flag (None when ompi_info is absent or silent)."""
    exe = shutil.which("ompi_info")
    if exe is None:
        return None
    try:
        text = subprocess.run(
            [exe, "--parsable", "--all"], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.search(r"mpi_built_with_cuda_support:value:(\w+)", text)
    return None if found is None else found.group(1) == "true"


@STRATEGIES.register(
    "mpi-gpu", "one GPU per MPI rank: pinned staging or CUDA-aware MPI, --overlap (seed V4/V5)"
)
class MPIGPUStrategy(SplitStrategy):
    launcher = "mpi"
    gpu_first = True

    def __init__(self, cfg) -> None:
        cfg.device = "cuda"  # the record says where it really computed, whatever --device said
        super().__init__(cfg)

    @classmethod
    def check_devices(cls, cfg: RunConfig) -> None:
        require_mpi4py()
        if not torch.cuda.is_available():
            raise UsageError(
                "strategy mpi-gpu drives one CUDA GPU per rank and none is visible; "
                "CPU ranks: --strategy mpi"
            )
        if not inside_mpi_launcher():  # scalelab starts every rank on this node
            check_gpu_count(cfg, cfg.ranks, local_rank=0)

    def make_comm(self) -> Comm:
        self.check_devices(self.cfg)
        from scalelab.comm.mpi import MPIComm

        comm = MPIComm()
        self.library_cuda_aware = comm.cuda_aware
        self.forced_staging = os.environ.get("SCALELAB_MPI_HOST_STAGING") == "1"
        if self.forced_staging:
            comm.cuda_aware, comm.device = False, "cpu"
        return comm

    def pick_device(self) -> torch.device:
        index = self.comm.local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)

    def validate(self, workload: Workload) -> None:
        check_gpus_per_node(self)
        super().validate(workload)
        if self.is_root and self.wire.staged:
            sys.stderr.write(f"scalelab: mpi-gpu: {self._staging_reason()}\n")
            sys.stderr.flush()

    def _staging_reason(self) -> str:
        lib = self.comm.library_version()
        if self.forced_staging:
            return f"host staging forced by SCALELAB_MPI_HOST_STAGING=1 ({lib})"
        built = ompi_built_with_cuda()
        flag = "" if built is None else f"; ompi_info: built with CUDA support = {built}"
        return (
            f"{lib} does not accept device buffers (MPIX_Query_cuda_support = 0{flag}); "
            "inputs, halos and outputs are staged through pinned host buffers, same answer. "
            "For device-to-device transport use --strategy nccl"
        )

    def notes(self) -> dict[str, Any]:
        return {
            "cuda_aware": {
                "library": self.comm.library_version(),
                "query_cuda_support": self.library_cuda_aware,
                "ompi_built_with_cuda": ompi_built_with_cuda() if self.is_root else None,
                "forced_host_staging": self.forced_staging,
                "used_device_buffers": not self.wire.staged,
            },
            "gpu": torch.cuda.get_device_name(self.device),
        }
