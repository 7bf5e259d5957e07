"""What `scalelab versions` runs: its variants (a strategy, engine, ranks and device each), why
one cannot run here, and the `scalelab run` command line that runs one.

Inference: the seed's V1..V5 (serial, local cpu, mpi's three splits, local cuda, mpi-gpu with
and without --overlap, nccl), then the model-parallel and sharded strategies (pipeline with
both engines, tensor with DTensor, fsdp) on CPU ranks and on the GPU ranks, and the 2-D meshes
(dp x tp, dp x pp: 2 x --ranks GPUs). --train: local, the data-parallel ddp and mpi-dp, and the
same model-parallel ones, trained under the training check. The model-parallel variants on CPU
ranks run only with --all: each is one more launch (~9-13 s on a 2-core host).
"""

from __future__ import annotations

import dataclasses
from dataclasses import KW_ONLY, dataclass

import torch

from scalelab.config import RunConfig
from scalelab.errors import UsageError
from scalelab.run.train_check import SYNC_BN
from scalelab.strategies import STRATEGIES

# Model-parallel or sharded: on CPU ranks they run only under --all.
HEAVY = ("pipeline", "tensor", "fsdp")
NEEDS_ALL = "on CPU ranks with --all"


@dataclass(frozen=True)
class Variant:
    label: str
    strategy: str
    ranks: int = 1
    device: str = "cpu"
    _: KW_ONLY
    split: str = "batch"
    overlap: bool = False
    engine: str = "scalelab"  # pipeline/tensor: scalelab (pipeline: scheduled) or torch
    dp: int = 1  # --engine torch: data-parallel replicas of the pipeline or tensor group
    train: bool = False

    @property
    def launched(self) -> bool:
        return self.ranks > 1 or STRATEGIES.get(self.strategy).takes_split

    @property
    def needs_all(self) -> bool:
        """A model-parallel or sharded variant on CPU ranks: one more launch, --all only."""
        return self.device == "cpu" and self.strategy in HEAVY and self.ranks > 1


def _model_parallel(ranks: int, device: str, train: bool) -> list[Variant]:
    """pipeline (both engines), tensor (DTensor), fsdp on `ranks` ranks of device; on the
    GPUs also the 2-D meshes over 2 x ranks GPUs."""
    out = [
        Variant(f"pipeline {device}", "pipeline", ranks, device, train=train),
        Variant(f"pipeline torch {device}", "pipeline", ranks, device, engine="torch", train=train),
        Variant(f"tensor dtensor {device}", "tensor", ranks, device, engine="torch", train=train),
        Variant(f"fsdp {device}", "fsdp", ranks, device, train=train),
    ]
    if device == "cuda":
        out += [
            Variant(f"dp x tp {device}", "tensor", 2 * ranks, device, engine="torch", dp=2,
                    train=train),
            Variant(f"dp x pp {device}", "pipeline", 2 * ranks, device, engine="torch", dp=2,
                    train=train),
        ]  # fmt: skip
    return out


def variants(ranks: int, train: bool = False) -> list[Variant]:
    """Inference: serial, local CPU, MPI (three splits), the model-parallel ones on CPU ranks,
    local CUDA, MPI+GPU (plain, overlapped), NCCL, the model-parallel ones on the GPUs.
    train: local, ddp, mpi-dp, the model-parallel ones; on CPU, then on CUDA."""
    if train:
        return [
            Variant("local cpu", "local", train=True),
            Variant("ddp cpu", "ddp", ranks, train=True),
            Variant("mpi-dp", "mpi-dp", ranks, train=True),
            *_model_parallel(ranks, "cpu", True),
            Variant("local cuda", "local", device="cuda", train=True),
            Variant("ddp cuda", "ddp", ranks, "cuda", train=True),
            *_model_parallel(ranks, "cuda", True),
        ]
    return [
        Variant("serial (V1)", "serial"),
        Variant("local cpu", "local"),
        *(
            Variant(f"mpi {s} (V2)", "mpi", ranks, split=s)
            for s in ("broadcast", "batch", "spatial")
        ),
        *_model_parallel(ranks, "cpu", False),
        Variant("local cuda (V3)", "local", device="cuda"),
        Variant("mpi-gpu (V4)", "mpi-gpu", ranks, "cuda"),
        Variant("mpi-gpu --overlap", "mpi-gpu", ranks, "cuda", overlap=True),
        Variant("nccl (V5)", "nccl", ranks, "cuda"),
        *_model_parallel(ranks, "cuda", False),
    ]


def unavailable(v: Variant, base: RunConfig, every: bool = False) -> str | None:
    """Why v cannot run on this machine (None: it can); every: --all was given. The
    strategy's and workload's own one-line refusals, asked before any rank starts."""
    if v.needs_all and not every:
        return NEEDS_ALL
    if v.device == "cuda" and not torch.cuda.is_available():
        return "no CUDA GPU on this machine"
    if v.device == "cuda" and v.ranks > torch.cuda.device_count():
        return f"needs {v.ranks} GPUs, this machine has {torch.cuda.device_count()}"
    try:
        _refusal(variant_config(v, base))
    except UsageError as exc:
        return str(exc)
    if STRATEGIES.get(v.strategy).reference:
        from scalelab.workloads import WORKLOADS

        if not WORKLOADS.get(base.workload).has_reference():
            return f"{base.workload} has no NumPy float64 reference"
    return None


def _refusal(cfg: RunConfig) -> None:
    """What `scalelab run` refuses before a launcher starts (the options the strategy reads,
    MPI present, its preflight), and the workload's refusal of the strategy."""
    from scalelab.cli.commands.run import preflight
    from scalelab.comm.launch import find_mpiexec
    from scalelab.workloads import WORKLOADS

    strategy = STRATEGIES.get(cfg.strategy)
    preflight(strategy, cfg)
    if strategy.launcher_for(cfg) == "mpi":
        find_mpiexec()
    WORKLOADS.get(cfg.workload)(cfg).check_strategy(
        cfg.strategy, cfg, **STRATEGIES.get(cfg.strategy).model_needs(cfg)
    )


def variant_config(v: Variant, base: RunConfig) -> RunConfig:
    """base as v runs it: v's strategy, ranks, device and engine; a pipeline has one stage a
    rank of each replica; checked, quiet."""
    stages = v.ranks // v.dp if STRATEGIES.get(v.strategy).pipelined else RunConfig.stages
    # --sync-bn is for the strategies whose ranks each normalise their share; the others
    # normalise the whole batch already (run/train_check.SYNC_BN)
    sync_bn = base.sync_bn and v.strategy in SYNC_BN
    return dataclasses.replace(
        base, strategy=v.strategy, ranks=v.ranks, device=v.device, split=v.split,
        overlap=v.overlap, engine=v.engine, dp=v.dp, stages=stages, train=v.train,
        sync_bn=sync_bn, check=True, quiet=True,
    )  # fmt: skip


def cli_flags(cfg: RunConfig) -> list[str]:
    """The command line that rebuilds cfg: every field that differs from its default."""
    out = []
    for f in dataclasses.fields(RunConfig):
        if f.name in ("workload", "extra"):
            continue
        value = getattr(cfg, f.name)
        if f.default is not dataclasses.MISSING and value == f.default:
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, tuple):  # repeatable KEY=VALUE (--model-arg)
            out += [x for item in value for x in (flag, str(item))]
            continue
        out += [flag] if value is True else [] if value is False else [flag, str(value)]
    return out
