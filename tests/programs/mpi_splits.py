"""Run under a launcher: every split of alexnet (67x67) and charcnn through the real runner,
checked against the float64 oracle, with batches that do not divide evenly over the ranks.

    mpiexec -n N python mpi_splits.py mpi          CPU ranks, mpi4py
    torchrun --nproc-per-node N mpi_splits.py gloo  the nccl strategy's code path, gloo on CPU
    mpiexec -n 2 python mpi_splits.py mpi-gpu       GPUs (device machine)
    torchrun --nproc-per-node 2 mpi_splits.py nccl  GPUs over NCCL (device machine)

The root prints one JSON line per run (and the per-rank table of the alexnet spatial run);
other ranks print nothing.
"""

import json
import sys

import torch.distributed as dist

from scalelab.comm.torchdist import TorchDistComm
from scalelab.config import RunConfig
from scalelab.run.runner import execute

# One process group for all runs: re-creating it on torchrun's store after a destroy can
# meet the previous group's addresses. It is closed once, at the end.
CLOSE, TorchDistComm.close = TorchDistComm.close, lambda self: None

STRATEGY = {
    "mpi": ("mpi", "cpu"),
    "gloo": ("nccl", "cpu"),
    "mpi-gpu": ("mpi-gpu", "cuda"),
    "nccl": ("nccl", "cuda"),
}
# (workload, options, splits); batch 5 leaves 3+2 over two ranks and 2+2+1 over three.
CASES = [
    ("alexnet", {"image_size": 67, "batch": 5}, ["broadcast", "batch", "spatial", "overlap"]),
    ("charcnn", {"batch": 5}, ["batch", "spatial"]),
    ("alexnet", {"image_size": 67, "batch": 3, "dtype": "bf16"}, ["spatial"]),  # autocast
]

strategy, device = STRATEGY[sys.argv[1]]
for workload, options, splits in CASES:
    for split in splits:
        cfg = RunConfig(
            workload=workload,
            strategy=strategy,
            device=device,
            check=True,
            quiet=not (workload == "alexnet" and split == "spatial"),  # one per-rank table
            iters=1,
            warmup=1,
            split="batch" if split == "overlap" else split,
            overlap=split == "overlap",
            chunks=2,
            **options,
        )
        rec = execute(cfg, None).record
        if rec is not None:
            keep = (
                "workload",
                "ranks",
                "relerr",
                "tolerance",
                "tolerance_basis",
                "one_process_relerr",
                "digest",
                "reference_digest",
                "check_passed",
                "bytes",
                "rank_phases",
                "accounting",
                "backend",
                "transport",
                "critical_path",
                "rank_extra",
                "halo_plan",
                "rank_timeline",
            )
            label = (
                split if options.get("dtype", "fp32") == "fp32" else f"{split}-{options['dtype']}"
            )
            print(json.dumps({"split": label, **{k: rec.get(k) for k in keep}}), flush=True)

TorchDistComm.close = CLOSE
if dist.is_initialized():
    TorchDistComm(dist.get_backend()).close()  # the group ends as every run's does
