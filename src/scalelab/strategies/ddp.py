"""`ddp`: torch DistributedDataParallel training of any workload, under torchrun.

Every rank holds the whole model and reads the training set itself; DDP all-reduces the
gradients in buckets while backward still runs (gloo on CPU, NCCL on GPU). The data follow
torch's DistributedSampler (train/data.py), so W ranks at B per rank train on the same global
batches as one process at B*W. `--batch` is the global batch, as for every strategy: W ranks
get B/W items each, so B must divide by the rank count.

What keeps the GPU busy (benchmarks/ddp_scaling.py measures the result): the prepared training
set lives on the device (no host work per step); no host sync inside a step (losses stay on
the device, phases are timed with CUDA events instead of synchronising); gradients are bucket
views (gradient_as_bucket_view: no copy into the buckets); static_graph lets DDP skip the
unused-parameter search; BN buffers are not broadcast every forward (broadcast_buffers=False:
rank 0's buffers are sent once before each evaluation and checkpoint instead); bf16 autocast
and channels_last for convolutions. One rank trains the bare model: no DDP with nothing to
reduce. `--fast` goes further: the whole step, DDP's all-reduces included, is captured as one
CUDA graph per rank and replayed (fast/captured_step.py, fast/feeds.py): a step costs the host one
index copy and one graph launch.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from scalelab.comm import even_counts
from scalelab.config import RunConfig
from scalelab.errors import UsageError
from scalelab.instrument import host_checks
from scalelab.instrument.spans import SPANS
from scalelab.instrument.timer import EventTimer
from scalelab.results import RunOutput
from scalelab.strategies.base import STRATEGIES
from scalelab.strategies.compile_scope import compile_blocks, compile_whole
from scalelab.strategies.ddp_comm import BucketTimer
from scalelab.strategies.torchdist_base import TorchDistStrategy
from scalelab.train.data import LoaderShards, ResidentShards
from scalelab.train.loop import (
    Trainer,
    TrainPlan,
    eval_batch,
    heldout_sum,
    require_labels,
    run_training,
)
from scalelab.workloads.base import Inputs, Workload

# --grad-compress: each bucket cast to 16 bits, all-reduced, cast back (torch's DDP hooks).
COMPRESS_HOOKS = {
    "bf16": default_hooks.bf16_compress_hook,
    "fp16": default_hooks.fp16_compress_hook,
}
# DDP's first iterations log statistics and sync the host; CUDA graph capture of a DDP step
# needs more eager iterations than that before it (torch.cuda.graphs docs: at least 11).
DDP_GRAPH_WARMUP = 11
# BN buffers are not broadcast before every forward (rank 0's are sent before evaluations and
# checkpoints instead); torch >= 2.12 renamed the option.
_DDP_ARGS = inspect.signature(DistributedDataParallel.__init__).parameters
NO_FORWARD_BUFFER_SYNC = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in _DDP_ARGS
    else {"broadcast_buffers": False}
)


def per_rank_batch(cfg: RunConfig, world: int) -> int:
    """Each rank's share of the global --batch (DistributedSampler's shares are equal)."""
    if cfg.batch % world:
        raise UsageError(
            f"--batch {cfg.batch} (the global batch) does not divide over {world} ranks "
            f"({cfg.strategy} gives every rank the same share); use a multiple of {world}"
        )
    return cfg.batch // world


class ChannelsLast(nn.Module):
    """Hands 4-D inputs to the model in channels_last (NHWC) memory order."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner.to(memory_format=torch.channels_last)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        return self.inner(x)


@STRATEGIES.register(
    "ddp", "torch DistributedDataParallel training under torchrun (gloo on CPU, NCCL on GPU)"
)
class DDPStrategy(TorchDistStrategy):
    name = "ddp"
    reads = ("ddp", "amp", "layout", "compile", "fast", "checkpoint")
    needs_data_everywhere = True
    data_parallel = True
    ddp_buckets = True
    gpu_first = True
    trains_only = True

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__(cfg)  # --amp: TorchStrategy's precision
        if self.device.type == "cuda":
            self.timer = EventTimer(self.device)
        self.per_rank = per_rank_batch(cfg, self.comm.size)
        self.buckets: BucketTimer | None = None  # the comm hook timing DDP's all-reduces
        self.graph_stream: torch.cuda.Stream | None = None  # --fast on GPUs: DDP's, wrap()'s

    @classmethod
    def preflight(cls, cfg: RunConfig) -> int:
        """Check the batch's shares before torchrun starts; returns the global batch."""
        per_rank_batch(cfg, cfg.ranks)
        return cfg.batch

    def all_sum(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=self.comm.device)
        return float(self.comm.allreduce(t).cpu()[0])

    def infer(self, workload: Workload, model: nn.Module, inputs: Inputs | None) -> RunOutput:
        raise UsageError("ddp trains (add --train); for inference use local or nccl")

    # --- training ------------------------------------------------------------------------------
    def train(
        self, workload: Workload, model: nn.Module, data: tuple[Inputs, Inputs] | None
    ) -> RunOutput:
        train, heldout = self.train_data(data)
        module = self.place(model)
        plan = self.train_plan(workload, module, train, heldout)
        net = self.wrap(module)
        self.compile_loss(workload)
        fast = self.fast_trainer(workload, net, plan)
        out = run_training(self, workload, net, plan, make_trainer=fast)
        out.notes.update(self.bucket_notes())
        out.notes.update(self.compile_record())
        out.notes.update(self.replica_notes(module))
        return out

    def train_data(self, data: tuple[Inputs, Inputs] | None) -> tuple[Inputs, Inputs]:
        """(train, held-out), labelled and enough to give every rank an item."""
        assert data is not None
        train, heldout = data
        require_labels(train, heldout)
        if len(train) < self.comm.size:
            raise UsageError(f"{len(train)} training items cannot feed {self.comm.size} ranks")
        return train, heldout

    def train_plan(
        self, workload: Workload, module: nn.Module, train: Inputs, heldout: Inputs, **over: Any
    ) -> TrainPlan:
        """The data-parallel plan: every rank's share of each global batch (resident on the
        device, or from loader workers), held-out accuracy over the ranks; `over` replaces
        fields (fsdp: the loss over gathered parameters, full-state checkpoints)."""
        source = self.source(workload, train)
        fields: dict[str, Any] = dict(
            source=source,
            evaluate=lambda m: self.evaluate(workload, module, heldout),
            module=module,
            prepare=(lambda x: x) if isinstance(source, ResidentShards) else workload.prepare,
            loss=workload.loss,
            n_train=len(train),
        )
        fields.update(over)
        if "notes" not in fields:
            fields["notes"] = self.notes(source)
        return TrainPlan(**fields)

    def fast_trainer(
        self, workload: Workload, net: nn.Module, plan: TrainPlan
    ) -> Callable[..., Trainer] | None:
        """--fast: the whole step (forward, backward with DDP's bucketed all-reduces, SGD)
        replayed from one CUDA graph per rank, or None with one line saying why not."""
        if not self.cfg.fast:
            return None
        from scalelab.fast.captured_step import fast_trainer, step_unsupported
        from scalelab.fast.feeds import ShardFeed

        reason = step_unsupported(self, workload.optimizer(net))
        if reason is None and not isinstance(plan.source, ResidentShards):
            reason = "with --workers the batches come from host processes"
        if reason is None and self.cfg.compile:
            reason = "with --compile (compiled DDP inside a captured step is not supported yet)"
        return fast_trainer(
            self,
            reason,
            ShardFeed(plan.source),
            what="step (with DDP all-reduce)",
            warmup=DDP_GRAPH_WARMUP if self.comm.size > 1 else 3,
            convert_layout=False,  # wrap() chose the layout before DDP took the parameters
            stream=self.graph_stream,  # the one DDP was built on (its AccumulateGrad nodes')
        )

    def source(self, workload: Workload, train: Inputs) -> ResidentShards | LoaderShards:
        cfg, comm = self.cfg, self.comm
        shape = (self.per_rank, comm.size, comm.rank, cfg.seed)
        if cfg.workers > 0:
            pin = self.device.type == "cuda"
            return LoaderShards(train, *shape, workers=cfg.workers, pin=pin)
        storage = self.precision.storage
        to_input = lambda x: workload.prepare(x).to(storage)  # noqa: E731
        return ResidentShards(train, *shape, to_input=to_input, device=self.device)

    def wrap(self, module: nn.Module) -> nn.Module:
        """--compile: the blocks compiled in place before DDP takes the model, so DDP's
        bucket all-reduces run between compiled blocks (compile_scope.py); a model without
        repeated blocks is compiled whole, DDP and all (DDPOptimizer splits it at buckets)."""
        cfg, net = self.cfg, module
        if cfg.compile:
            self.compile_notes = compile_blocks(module, cfg.compile_backend)
        whole = cfg.compile and self.compile_notes is None
        if cfg.channels_last:
            net = ChannelsLast(net)
        if self.comm.size > 1:
            # A step captured as a CUDA graph (--fast) needs DDP built on a side stream.
            # The same stream then warms up and captures the step (fast/captured_step.GraphStep).
            side = torch.cuda.Stream() if cfg.fast and self.device.type == "cuda" else None
            self.graph_stream = side
            if side is not None:
                side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side) if side is not None else nullcontext():
                net = DistributedDataParallel(
                    net,
                    device_ids=[self.device.index] if self.device.type == "cuda" else None,
                    bucket_cap_mb=cfg.bucket_mb,
                    gradient_as_bucket_view=True,
                    static_graph=not whole,  # a compiled DDP splits graphs at buckets
                    **NO_FORWARD_BUFFER_SYNC,
                )
            if side is not None:
                torch.cuda.current_stream().wait_stream(side)
            self.register_hooks(net, whole)
        if whole:
            net, self.compile_notes = compile_whole(net, backend=self.cfg.compile_backend)
        return net

    def register_hooks(self, net: DistributedDataParallel, whole: bool = False) -> None:
        """--grad-compress's hook, wrapped in the bucket timer (ddp_comm.py) on gloo and, with
        --timeline/--trace, on NCCL; not inside a captured (--fast) or a whole compiled step."""
        hook = COMPRESS_HOOKS.get(self.cfg.grad_compress)
        timed = self.device.type == "cpu" or SPANS.log is not None
        if timed and not (self.cfg.fast or whole):
            self.buckets = BucketTimer(hook, self.device)
            hook = self.buckets.hook
        if hook is not None:
            net.register_comm_hook(None, hook)

    def bucket_notes(self) -> dict:
        """Every rank's `ddp_comm` totals (a gather: every rank calls it)."""
        mine = self.buckets.notes() if self.buckets is not None else None
        ranks = self.comm.gather_object(mine)
        return {"ddp_comm": ranks} if ranks and ranks[0] is not None else {}

    def replica_notes(self, module: nn.Module) -> dict:
        """Whether every rank ended with rank 0's parameters (a gather: every rank calls it).
        DDP applies one averaged gradient on every rank, so the replicas stay bitwise equal;
        a difference means a step ran without its all-reduce."""
        if self.comm.size == 1:
            return {}
        with torch.no_grad():  # (2 per parameter,) its sum and sum of squares, in float64
            mine = torch.stack(
                [
                    f
                    for p in module.parameters()
                    for f in (p.double().sum(), p.double().square().sum())
                ]
            ).cpu()
        ranks = self.comm.gather_object(mine)
        if ranks is None:
            return {}
        scale = ranks[0].abs().clamp_min(1e-30)
        diff = max(float(((r - ranks[0]).abs() / scale).max()) for r in ranks)
        if diff > 0:
            host_checks.emit([f"ddp replicas differ after training (largest relative difference "
                              f"{diff:.3g} from rank 0's parameters): a step ran without its "
                              "all-reduce"])  # fmt: skip
        return {"replica_max_rel_diff": diff}

    def notes(self, source: ResidentShards | LoaderShards) -> dict:
        return {
            "per_rank_batch": self.per_rank,
            "data_path": "loader" if isinstance(source, LoaderShards) else "device-resident",
            "bucket_mb": self.cfg.bucket_mb,
            "grad_compress": self.cfg.grad_compress,
            "amp": self.cfg.amp,
            "backend": self.comm.backend,
        }

    def evaluate(self, workload: Workload, module: nn.Module, heldout: Inputs) -> float:
        """Each rank scores a contiguous part of the held-out set; the counts are summed."""
        self.sync_buffers(module)
        counts = even_counts(len(heldout), self.comm.size)
        start = sum(counts[: self.comm.rank])
        part = heldout.slice(start, start + counts[self.comm.rank])
        correct = heldout_sum(self, workload, module, part, eval_batch(workload, self.cfg.batch))
        return self.all_sum(correct) / max(len(heldout), 1)

    def sync_buffers(self, module: nn.Module) -> None:
        """Rank 0's buffers (BN running statistics) everywhere, as DDP's default would keep."""
        if self.comm.size > 1:
            for buf in module.buffers():
                dist.broadcast(buf, src=0)
