"""The worked example of docs/ARCHITECTURE.md, defined outside the package: `mpi-dp` with
gradients averaged by one blocking all-reduce per parameter. Importing registers it."""

from torch import nn

from scalelab.instrument.timer import PhaseTimer
from scalelab.strategies.base import STRATEGIES
from scalelab.strategies.mpi_dp import MPIDataParallel


@STRATEGIES.register("mpi-dp-naive", "data parallel over MPI: one all-reduce per parameter")
class NaiveMPIDataParallel(MPIDataParallel):
    def reduce_gradients(self, model: nn.Module, timer: PhaseTimer) -> None:
        with timer.phase("allreduce"):
            # each rank's loss is its items' share of the global batch's mean: the sum over
            # ranks of p.grad (p's shape) is the global batch's gradient
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.copy_(self.comm.allreduce(p.grad))
