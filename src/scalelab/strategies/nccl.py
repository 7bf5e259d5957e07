"""`nccl`: the same splits over torch.distributed, launched by torchrun.

On GPUs (`--device cuda`) the backend is NCCL and every message moves between device buffers,
no host staging: the device-to-device path the GPU machines' Open MPI (not CUDA-aware) lacks.
With `--device cpu` the backend is gloo (tests, CPU-only machines); the strategy name stays
`nccl` and the record's `backend` says which one ran.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from scalelab.comm.base import Comm
from scalelab.comm.launch import inside_torchrun
from scalelab.config import RunConfig
from scalelab.errors import UsageError
from scalelab.strategies.base import STRATEGIES
from scalelab.strategies.mpi_gpu import check_gpu_count, check_gpus_per_node
from scalelab.strategies.split import SplitStrategy
from scalelab.workloads.base import Workload


@STRATEGIES.register(
    "nccl", "torch.distributed under torchrun: NCCL device buffers (--device cuda), gloo on CPU"
)
class NCCLStrategy(SplitStrategy):
    launcher = "torchrun"
    gpu_first = True

    @classmethod
    def check_devices(cls, cfg: RunConfig) -> None:
        if cfg.device != "cuda":
            return
        if not torch.cuda.is_available():
            raise UsageError("--device cuda: no CUDA GPU is visible; use --device cpu (gloo)")
        if not inside_torchrun():  # scalelab starts every rank on this node
            check_gpu_count(cfg, cfg.ranks, local_rank=0)

    def make_comm(self) -> Comm:
        from scalelab.comm.torchdist import TorchDistComm

        self.check_devices(self.cfg)
        backend = "nccl" if self.cfg.device == "cuda" else "gloo"
        if not inside_torchrun() and not dist.is_initialized():
            # One process, no launcher: a private in-memory store, no port, no environment.
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        return TorchDistComm(backend)

    def pick_device(self) -> torch.device:
        if self.cfg.device == "cpu":
            return torch.device("cpu")
        return torch.device("cuda", self.comm.local_rank % torch.cuda.device_count())

    def validate(self, workload: Workload) -> None:
        if self.device.type == "cuda":
            check_gpus_per_node(self)
        super().validate(workload)
