"""`mpi`: CPU ranks under mpiexec (the seed's V2), inference divided by `--split`:

    broadcast  every rank gets the whole batch and all weights, computes everything (V2.1)
    batch      Scatterv the batch, compute, Gatherv (uneven counts allowed)
    spatial    halo-exchange domain decomposition of the conv trunk (V2.2)

`scalelab run ... --strategy mpi --ranks N` starts `mpiexec -n N` itself outside a launcher.
"""

from __future__ import annotations

import torch

from scalelab.comm.base import Comm
from scalelab.config import RunConfig
from scalelab.environment import mpi_problem
from scalelab.errors import UsageError
from scalelab.strategies.base import STRATEGIES
from scalelab.strategies.split import SplitStrategy


@STRATEGIES.register("mpi", "CPU ranks under mpiexec, --split broadcast|batch|spatial (seed V2)")
class MPIStrategy(SplitStrategy):
    launcher = "mpi"
    reads = ("split",)  # CPU ranks: no GPUs to oversubscribe

    @classmethod
    def replicates_model(cls, cfg: RunConfig) -> bool:
        return cfg.split == "batch"

    @classmethod
    def check_devices(cls, cfg: RunConfig) -> None:
        require_mpi4py()
        if cfg.device != "cpu":
            raise UsageError("strategy mpi runs CPU ranks; for GPUs use mpi-gpu or nccl")

    def make_comm(self) -> Comm:
        from scalelab.comm.mpi import MPIComm  # UsageError when mpi4py or MPI is missing

        return MPIComm()

    def pick_device(self) -> torch.device:
        self.check_devices(self.cfg)
        return torch.device("cpu")


def require_mpi4py() -> None:
    """One clear line when mpi4py is missing or finds no MPI library (without initialising
    MPI in this process)."""
    problem = mpi_problem()
    if problem is not None:
        raise UsageError(problem)
