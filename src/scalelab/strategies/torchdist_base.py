"""What every strategy on torch.distributed shares (ddp, the torch pipeline engine, DTensor):
the default process group and one device per local rank.

init_group starts the default group itself rather than leaving it to torchrun's environment
alone, so that one process without a launcher runs too, and so that each run of a process (a
--lr study runs several) gets fresh keys in torchrun's store.
"""

from __future__ import annotations

import datetime as dt
import itertools
import os

import torch
import torch.distributed as dist

from scalelab.comm import Comm
from scalelab.comm.launch import inside_torchrun
from scalelab.comm.torchdist import TIMEOUT_S, TorchDistComm
from scalelab.strategies.torch_base import TorchStrategy, resolve_device

_RUNS = itertools.count()  # process groups this process has started (one per run)


def init_group(backend: str) -> None:
    """Start the default process group ourselves.

    One process without a launcher gets a private in-memory store (no port, no environment).
    Under torchrun every run of this process (a --lr study runs several) uses a fresh key
    prefix in torchrun's store: a second group on the first one's keys could read a peer's
    stale address and fail to connect."""
    if dist.is_initialized():
        return
    if not inside_torchrun():
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        return
    env, timeout = os.environ, dt.timedelta(seconds=TIMEOUT_S)
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    hosts = env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" and rank == 0
    store = dist.TCPStore(
        env["MASTER_ADDR"], int(env["MASTER_PORT"]), world, is_master=hosts, timeout=timeout
    )
    prefixed = dist.PrefixStore(f"scalelab/run{next(_RUNS)}", store)
    dist.init_process_group(backend, store=prefixed, rank=rank, world_size=world, timeout=timeout)


class TorchDistStrategy(TorchStrategy):
    """Ranks in torch.distributed's default group: NCCL with CUDA, gloo on the CPU."""

    launcher = "torchrun"

    def make_comm(self) -> Comm:
        backend = "nccl" if self.cfg.device == "cuda" else "gloo"
        if backend == "nccl":
            resolve_device("cuda")  # one clear line when there is no GPU
        init_group(backend)
        return TorchDistComm(backend)

    def pick_device(self) -> torch.device:
        if self.cfg.device != "cuda":
            return resolve_device(self.cfg.device)
        resolve_device("cuda")
        return torch.device("cuda", self.comm.local_rank % torch.cuda.device_count())
