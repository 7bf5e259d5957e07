"""`fsdp`: sharded data parallelism on torch's FSDP2 (`torch.distributed.fsdp.fully_shard`).

Each rank keeps 1/W of every parameter, of its gradient and of the optimizer state (DTensor
shards along dim 0). Before a unit's forward the unit's parameters are all-gathered, after its
backward its gradients are reduce-scattered (averaged: the gradient of the global mean loss,
as DDP's all-reduce). Units: repeated blocks, else layers with parameters
(fsdp_units.shard_units), consecutive ones joined until a unit gathers --fsdp-unit-mb (200 MB
by default; 0: one each), then the root. The optimizer steps each rank's local shards where it
is elementwise (fsdp_step.py). `--reshard-after-forward off` keeps the gathered
parameters from forward to backward (ZeRO-2-like: one all-gather per unit and step, more
memory); `on` (ZeRO-3) frees them and gathers again in backward; `auto`, the default and
torchtitan's, is `on` for every unit but the last (its backward follows at once). FSDP2
prefetches implicitly (the next unit's all-gather is issued before this one's compute, on its
own stream), which needs a host that runs ahead of the GPU: the GPU phases are timed by CUDA
events, with no barrier inside a step. `--compile` compiles each block before fully_shard
wraps it (compile_scope.py). The choices are the record's `fsdp` and `compile`.
`--dp-replicate R`: HSDP on a 2-D mesh (R replicas of a group of W/R ranks that shards;
gradients reduce-scattered within a group, then all-reduced across the replicas).
`--dtype bf16/fp16`: torch's MixedPrecisionPolicy (parameters gathered and computed in the low
dtype, gradients reduced in fp32, the sharded master weights fp32) in place of autocast.

The data path is ddp's (DistributedSampler shares, --batch the global batch). Checkpoints hold
the whole model and optimizer as one process holds them (get_state_dict / set_state_dict of
torch.distributed.checkpoint.state_dict, full state dicts), so they resume on any rank count
and under any strategy. Inference splits the batch over the ranks; every rank runs the same
forwards (all-gather per unit) and the root gathers the outputs.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from scalelab.comm import even_counts
from scalelab.config import RunConfig
from scalelab.errors import UsageError
from scalelab.instrument.spans import SPANS
from scalelab.instrument.timer import EventTimer, PhaseTimer, timed_iterations
from scalelab.results import RunOutput
from scalelab.strategies import fsdp_units as units
from scalelab.strategies.base import STRATEGIES
from scalelab.strategies.compile_scope import compile_blocks, compile_whole
from scalelab.strategies.ddp import DDPStrategy, per_rank_batch
from scalelab.strategies.fsdp_step import ShardedStep
from scalelab.strategies.torchdist_base import TorchDistStrategy
from scalelab.train.loop import eval_batch, run_training
from scalelab.train.sources import batch_slices
from scalelab.workloads.base import Inputs, Workload

if TYPE_CHECKING:  # torch's fsdp is imported where it is used (a second at start-up)
    from torch.distributed.fsdp import MixedPrecisionPolicy


@STRATEGIES.register(
    "fsdp", "torch FSDP2 (fully_shard) sharded data parallelism under torchrun; HSDP"
)
class FSDPStrategy(DDPStrategy):
    name = "fsdp"
    reads = ("fsdp", "compile", "checkpoint")
    shards_parameters = True
    ddp_buckets = False

    def __init__(self, cfg: RunConfig) -> None:
        TorchDistStrategy.__init__(self, cfg)  # not ddp's: an inference batch needs no shares
        if self.device.type == "cuda":
            self.timer = EventTimer(self.device)
        self.per_rank = per_rank_batch(cfg, self.comm.size) if cfg.train else cfg.batch
        self.buckets = None
        self.mesh = units.make_mesh(self.device, self.comm.size, cfg.dp_replicate)
        self.n_units = 0
        self.reshard: list[bool] = []  # each unit's reshard_after_forward, in forward order
        self.unit_sizes: list[int] = []  # blocks (or layers) per unit, in forward order
        self.grad_bytes: int | None = None  # gradient shards held after a backward

    @classmethod
    def preflight(cls, cfg: RunConfig) -> int:
        if cfg.ranks > 1 and cfg.ranks % cfg.dp_replicate:  # 1: under the user's own launcher
            raise UsageError(f"--dp-replicate {cfg.dp_replicate} does not divide --ranks")
        if cfg.train:
            per_rank_batch(cfg, cfg.ranks)
        return cfg.batch

    # --- placement ---------------------------------------------------------------------------
    def mp_policy(self, cast_inputs: bool = True) -> MixedPrecisionPolicy:
        """bf16/fp16 compute over fp32 shards, gradients reduced in fp32; `cast_inputs=False`
        for a root whose inputs are token ids in float32 (exact there; bf16 is exact only
        below 256, fp16 below 2048: id 299 in bf16 is 300)."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        low = self.precision.autocast
        if low is None:
            return MixedPrecisionPolicy()
        return MixedPrecisionPolicy(
            param_dtype=low, reduce_dtype=torch.float32, cast_forward_inputs=cast_inputs
        )

    def autocast(self) -> AbstractContextManager:
        return nullcontext()  # the MixedPrecisionPolicy casts (FSDP's own low-precision path)

    def shard_model(self, workload: Workload, module: nn.Module) -> nn.Module:
        """fully_shard each unit, then the root (in place: module becomes an FSDPModule)."""
        from torch.distributed.fsdp import fully_shard

        from scalelab.strategies.fsdp_comm import CommTimer  # torch's fsdp internals, as above

        if self.cfg.compile:  # before fully_shard, as torchtitan: dynamo skips FSDP's hooks
            self.compile_notes = compile_blocks(module, self.cfg.compile_backend)
            if self.compile_notes is None:
                module, self.compile_notes = compile_whole(
                    module, in_place=True, backend=self.cfg.compile_backend
                )
        kw = {"mesh": self.mesh, "mp_policy": self.mp_policy()}
        itemsize = (self.precision.autocast or self.precision.storage).itemsize
        found = units.group_units(
            units.shard_units(module, workload.layers(module)), self.cfg.fsdp_unit_mb, itemsize
        )
        policy = units.reshard_policy(self.cfg.reshard_after_forward, len(found))
        for unit, reshard in zip(found, policy):  # a list of blocks: one unit, one gather
            fully_shard(unit if len(unit) > 1 else unit[0], reshard_after_forward=reshard, **kw)
        # the root: FSDP keeps its parameters from forward to backward whatever it is told;
        # its inputs stay as prepare() made them where they are token ids (the model's own
        # hook turns them back into ids; FSDP's cast would run first and round them)
        kw["mp_policy"] = self.mp_policy(cast_inputs=not workload.ids_as_floats)
        fully_shard(module, reshard_after_forward=self.cfg.reshard_after_forward != "off", **kw)
        self.n_units = len(found) + 1
        self.unit_sizes = [len(u) for u in found]
        self.reshard = policy
        self.comm_timer = CommTimer(self.device)
        # On a GPU the timed collectives are an A/B of their own: installed only under
        # --timeline/--trace, as DDP's bucket timer is (see fsdp_comm.py).
        if self.device.type == "cpu" or SPANS.log is not None:
            self.comm_timer.install(module)
        return module

    def full_model(self, workload: Workload, module: nn.Module) -> nn.Module | None:
        """The trained model as one process holds it, on the root (None elsewhere): the
        all-gathered state loaded into a model built on the meta device (no second init)."""
        state = units.full_model_state(module)
        if not self.is_root:
            return None
        with torch.device("meta"):
            whole = workload.build_model()
        whole.load_state_dict(state, assign=True)
        return whole

    # --- inference ---------------------------------------------------------------------------
    def infer(self, workload: Workload, model: nn.Module, inputs: Inputs | None) -> RunOutput:
        module = self.shard_model(workload, self.place(model)).eval()
        n = self.comm.bcast_object(len(inputs) if inputs is not None else None)
        counts = even_counts(n, self.comm.size)
        host_x = inputs.x if inputs is not None else None

        def step() -> torch.Tensor | None:
            with self.timer.phase("scatter"):
                x = self.comm.scatterv(host_x, counts)
            with self.timer.phase("compute"), torch.no_grad():
                out = module(workload.prepare(x).to(self.precision.storage))
            with self.timer.phase("gather"):
                whole = self.comm.gatherv(out.to(torch.float64))
            return None if whole is None else whole.cpu()

        timings, out = timed_iterations(step, self.timer, self.cfg.warmup, self.cfg.iters)
        units.reshard(module)
        comm = self.comm.gather_object(self.comm_timer.notes())
        return RunOutput(
            timings,
            self.gather_phases(timings),
            None if out is None else np.asarray(out),
            n,
            notes={**self.notes(), "fsdp_comm": comm},
        )

    # --- training ----------------------------------------------------------------------------
    def train(
        self, workload: Workload, model: nn.Module, data: tuple[Inputs, Inputs] | None
    ) -> RunOutput:
        train, heldout = self.train_data(data)
        module = self.shard_model(workload, self.place(model))
        self.compile_loss(workload)
        plan = self.train_plan(
            workload,
            module,
            train,
            heldout,
            loss=lambda m, out, y: workload.loss(units.WholeParams(module), out, y),
            export_state=lambda m, o: units.export_full(m, o, self.is_root),
            import_state=units.import_full,
            notes=self.notes(),
        )
        step = ShardedStep(self, workload, module, plan)
        out = run_training(self, workload, module, plan, step=step)
        out.notes.update(self.memory_notes(module, step.optimizer()))
        out.notes.update(self.compile_record())  # the graphs dynamo built while training
        out.notes["fsdp"] = {**out.notes.get("fsdp", {}), "optimizer_step": step.optimizer_step}
        out.model = self.full_model(workload, module)
        return out

    def reduce_gradients(self, model: nn.Module, timer: PhaseTimer) -> None:
        """FSDP reduce-scattered the gradients inside backward; this only notes the bytes of
        the gradient shards held (once, the first step)."""
        if self.grad_bytes is None:
            self.grad_bytes = units.held_bytes(model, None)["grads"]

    def evaluate(self, workload: Workload, module: nn.Module, heldout: Inputs) -> float:
        """Each rank scores a contiguous part of the held-out set in as many forwards as
        every other rank (each forward all-gathers: a rank with fewer would hang the rest)."""
        self.sync_buffers(module)
        counts = even_counts(len(heldout), self.comm.size)
        start = sum(counts[: self.comm.rank])
        part = heldout.slice(start, start + counts[self.comm.rank])
        module.eval()
        correct = 0
        size = eval_batch(workload, self.cfg.batch)
        with torch.no_grad():
            for k in range(len(batch_slices(max(counts), size))):
                x = self.to_device(part.x[k * size : (k + 1) * size])
                logits = module(workload.prepare(x))
                correct += workload.score(logits, part.y[k * size : (k + 1) * size])
        units.reshard(module)
        module.train()
        return self.all_sum(correct) / max(len(heldout), 1)

    # --- what the record says ------------------------------------------------------------------
    def notes(self, source: object = None) -> dict:
        low = self.precision.autocast
        name = lambda d: str(d).removeprefix("torch.") if d is not None else None  # noqa: E731
        policy = self.mp_policy() if self.n_units else None
        return {
            "per_rank_batch": self.per_rank,
            "reshard_after_forward": self.cfg.reshard_after_forward,
            "dp_replicate": self.cfg.dp_replicate,
            "dp_shard": self.comm.size // self.cfg.dp_replicate,
            "fsdp_units": self.n_units,
            "param_dtype": name(low),
            "backend": self.comm.backend,
            # what was chosen, as fully_shard was called (units in forward order, then root)
            "fsdp": {
                "units": self.n_units,
                "unit_kind": _unit_kind(self.unit_sizes),
                "unit_mb": self.cfg.fsdp_unit_mb,
                "mp_policy": {
                    "param_dtype": name(policy.param_dtype) if policy else None,
                    "reduce_dtype": name(policy.reduce_dtype) if policy else None,
                },
                "reshard_after_forward": [*self.reshard, self.cfg.reshard_after_forward != "off"],
                "prefetch": "implicit (FSDP2: the next unit's all-gather issued in the pre-hook)",
            },
            **self.compile_record(),
        }

    def memory_notes(self, module: nn.Module, opt: torch.optim.Optimizer) -> dict:
        """Every rank's memory (a gather): the sharded state it holds (bytes of its
        parameter, gradient and optimizer-state shards) and, on a GPU, the allocator's peak."""
        held = units.held_bytes(module, opt)
        held["grads"] = self.grad_bytes or 0
        comm = self.comm.gather_object(self.comm_timer.notes())
        if self.device.type == "cuda":
            held["peak_allocated"] = torch.cuda.max_memory_allocated(self.device)
            held["peak_reserved"] = torch.cuda.max_memory_reserved(self.device)
        return {"memory_per_rank": self.comm.gather_object(held), "fsdp_comm": comm}


def _unit_kind(sizes: list[int]) -> str:
    if not sizes:
        return "root only"
    return "per-block" if max(sizes) == 1 else f"{max(sizes)} blocks per unit"
