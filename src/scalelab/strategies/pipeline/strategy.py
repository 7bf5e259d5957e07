"""`pipeline` on scalelab's engine: the model's layers cut into K stages, one rank (GPU, or CPU
process over gloo) each; a batch split into M micro-batches that flow through the stages
(GPipe, or 1F1B with `--schedule 1f1b`). The other placements (`--placement manual`,
`--engine torch`) are entries of the placement registry (placements.py).

Rank 0 is stage 0 and the root: it holds the inputs and gets the output back from the last
stage. Training takes the gradient of the batch's mean loss (each micro-batch's loss weighted
by its share of the batch), then every stage steps its own optimizer on its own parameters:
one pipelined step equals one single-process step on the whole batch. The steps run in the
shared Trainer (train/loop.py; checkpoints, --resume, NaN stop):
strategies/pipeline/schedule_step.py.

Record field `pipeline`: the partition, the bubble by the formula (K-1)/(M+K-1), simulated
from the measured per-stage times (layout/schedule.py) and measured (the share of each
stage's schedule it spent not computing), and per-stage times and peak memory.

SCALELAB_GPU_MEM_LIMIT (bytes) caps each rank's CUDA allocator, so a big GPU can play a small
one; `scalelab fit --mem-limit ... --find stages --run` sets it for the pipeline it starts.
"""

from __future__ import annotations

import sys
from contextlib import nullcontext
from typing import Any

import numpy as np
import torch
from torch import nn

from scalelab.comm import Comm, SelfComm
from scalelab.comm.base import even_counts
from scalelab.comm.launch import inside_torchrun
from scalelab.comm.torchdist import TorchDistComm
from scalelab.config import RunConfig
from scalelab.errors import UsageError
from scalelab.instrument.timer import EventTimer, timed_iterations
from scalelab.layout import partition as part
from scalelab.layout import profiling
from scalelab.layout.preserve import kept_state
from scalelab.layout.schedule import SCHEDULES
from scalelab.precision import get_precision
from scalelab.results import RunOutput
from scalelab.strategies.base import STRATEGIES, Strategy
from scalelab.strategies.pipeline import cut
from scalelab.strategies.pipeline.placements import PLACEMENTS, placement_name
from scalelab.strategies.pipeline.report import pipeline_notes, stage_summary, summary_line
from scalelab.strategies.pipeline.stage import StageBatch, StageContext, StageExecutor
from scalelab.strategies.pipeline.stage_plan import PlacedStage, StagePlan
from scalelab.strategies.torch_base import TorchStrategy
from scalelab.workloads.base import Inputs, Workload


@STRATEGIES.register(
    "pipeline",
    "layers cut into --stages ranks, --microbatches GPipe/1F1B micro-batching "
    "(--placement manual: GPUs of one process)",
)
class PipelineStrategy(TorchStrategy):
    launcher = "torchrun"
    gpu_first = True
    splits_model = True
    pipelined = True
    reads = PLACEMENTS["scheduled"].reads

    @classmethod
    def build(cls, cfg: RunConfig) -> Strategy:
        """The placement the config names (placements.PLACEMENTS), constructed."""
        return PLACEMENTS[placement_name(cfg)].load()(cfg)

    @classmethod
    def derived_flags(cls, given: dict[str, Any]) -> dict[str, Any]:
        """Over --ranks R without --stages: R / --dp stages (one rank each, as `predict` and
        `plan` model it), not the field's default of 2 refused against R."""
        ranks, dp = given.get("ranks", 1), given.get("dp", 1)
        if "stages" in given or ranks < 2 or ranks % dp or given.get("placement") == "manual":
            return given
        return {**given, "stages": ranks // dp}

    @classmethod
    def reads_for(cls, cfg: RunConfig) -> tuple[str, ...]:
        """The sections of the placement the config names."""
        return PLACEMENTS[placement_name(cfg)].reads  # declared there: no engine import

    @classmethod
    def preflight(cls, cfg: RunConfig) -> int:
        """Before any rank starts: a training loss no stage of the scheduled engine holds,
        and a --balance or --cut that does not cut this model's layers into --stages (the
        checks the ranks make, so no launcher starts for them)."""
        if placement_name(cfg) != "scheduled":
            return cfg.batch
        from scalelab.workloads import WORKLOADS

        workload = WORKLOADS.get(cfg.workload)(cfg)
        if cfg.train:
            _check_trainable(workload, get_precision(cfg.dtype))
        if cfg.balance.strip() != "auto" or cfg.cut is not None:  # the model only then
            part.given_counts(cfg.balance, cfg.cut, _layer_paths(workload), cfg.stages)
        return cfg.batch

    @classmethod
    def describe(cls, cfg: RunConfig) -> str:
        if cfg.engine == "torch":
            return "the pipeline strategy with --engine torch"
        return f"the pipeline strategy with --placement {cfg.placement}"

    @classmethod
    def read_with(cls, cfg: RunConfig, section: str) -> str | None:
        """The flag under which a section this run does not read would be read."""
        torch_reads = PLACEMENTS["torch"].reads
        if cfg.engine != "torch" and section in torch_reads:
            return "--engine torch"
        return "--engine scalelab" if cfg.engine == "torch" and section in cls.reads else None

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        if self.device.type == "cuda":
            # No barrier per phase: the host enqueues micro-batch after micro-batch while the
            # GPU works (a barrier each left it idle during every launch: 0.66x plain PyTorch
            # at M=8 on one stage), sends in flight never block, and receives are waited for
            # on the device (NCCL's wait() makes the stream wait). Phases are CUDA-event times.
            self.timer = EventTimer(self.device)
        self.workload: Workload | None = None
        self.plan: StagePlan | None = None  # the cut (setup)
        self.placed: PlacedStage | None = None  # this rank's stage of the cut (setup)
        self.lanes: dict[tuple[int, int], Any] = {}  # (src, dst) -> process group

    def make_comm(self) -> Comm:
        if self.cfg.ranks == 1 and not inside_torchrun():
            return SelfComm()
        return TorchDistComm("nccl" if self.cfg.device == "cuda" else "gloo")

    def pick_device(self) -> torch.device:
        device = super().pick_device()
        if device.type == "cuda":
            device = torch.device("cuda", self.comm.local_rank % torch.cuda.device_count())
            profiling.cap_allocator(device, profiling.env_mem_limit())
        return device

    # --- checks ---------------------------------------------------------------------------
    def validate(self, workload: Workload) -> None:
        cfg, k = self.cfg, self.cfg.stages
        if self.comm.size != k:
            raise UsageError(
                f"pipeline: --stages {k} runs one rank per stage; pass --ranks {k} "
                f"(got {self.comm.size})"
            )
        gpus = torch.cuda.device_count() if self.device.type == "cuda" else 0
        if self.device.type == "cuda" and k > gpus and not cfg.oversubscribe_gpus:
            raise UsageError(f"pipeline: {k} stages but {gpus} GPUs (or --oversubscribe-gpus)")
        if cfg.train:
            _check_trainable(workload, self.precision)

    # --- setup: cut, place, learn the shapes crossing each boundary ----------------------
    def setup(self, workload: Workload, model: nn.Module, sample: torch.Tensor | None) -> None:
        """sample: one batch's transport-form inputs on the root (None elsewhere). The
        balancing passes leave the model's state and the RNG as they were (kept_state)."""
        comm = self.comm
        self.workload = workload
        self.lanes = cut.make_lanes(comm.size) if comm.size > 1 else {}  # collective, in order
        with kept_state([model]) if self.cfg.train else nullcontext():
            self.plan = cut.initial_plan(self, workload.layers(model), sample)
            self.place(self.plan.counts, sample)
            self.placed.executor.connect()
            if self.plan.auto and comm.size > 1 and self.cfg.rebalance > 0:
                cut.rebalance(self, sample)

    def place(self, counts: list[int], sample: torch.Tensor | None) -> None:
        """Build this rank's stage of the cut `counts`: its layers on the device, the shapes
        crossing every boundary, the executor. A previous stage's layers go back to the host
        first (those that stay return with the rest)."""
        cfg, comm = self.cfg, self.comm
        if self.placed is not None:
            self.placed.module.to("cpu")
        self.plan.counts = counts
        modules = [layer.module for layer in self.plan.layers_of(comm.rank)]
        stage = nn.Sequential(*modules).to(device=self.device, dtype=self.precision.storage)
        if cfg.channels_last:
            stage = stage.to(memory_format=torch.channels_last)
        stage.train(cfg.train)
        metas = cut.probe_shapes(self, stage, sample)
        # --compile: Inductor fuses each conv's bias add, ReLU and pooling (and their
        # backwards) into a few Triton kernels. Eager VGG-16 spends more time in those
        # elementwise kernels than in its convolutions (H100: 43 of 77 ms a step at batch
        # 256), and micro-batches of 32 pay them again per micro-batch. Shapes are static:
        # every micro-batch size compiles once (dynamic shapes would give up the fusions).
        run = (
            torch.compile(stage, dynamic=False, backend=cfg.compile_backend)
            if cfg.compile
            else stage
        )
        ctx = StageContext(
            rank=comm.rank,
            stages=comm.size,
            device=self.device,
            module=run,
            in_meta=metas[comm.rank - 1] if comm.rank > 0 else None,
            out_meta=metas[comm.rank],
            timer=self.timer,
            autocast=self.autocast,
            channels_last=cfg.channels_last,
            lanes=self.lanes,
        )
        self.placed = PlacedStage(stage, ctx, StageExecutor(ctx), metas[-1])

    def prepare(self, x: torch.Tensor) -> torch.Tensor:
        """Transport-form items -> the model's input dtype and layout (on x's device)."""
        x = self.workload.prepare(x).to(self.precision.storage)
        if self.cfg.channels_last and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        return x

    # --- one batch through the pipeline -----------------------------------------------------
    def device_batch(self, x: torch.Tensor) -> torch.Tensor:
        """A batch's host items on the device, prepared (the model's input dtype, layout)."""
        with self.timer.phase("h2d"):
            x = self.to_device(x)
        return self.prepare(x)

    def forward_batch(self, x: torch.Tensor | None, n: int) -> torch.Tensor | None:
        """Inference of n items (x on the root): the logits on the root, float64 on CPU."""
        sizes = even_counts(n, min(self.cfg.microbatches, n))
        inputs = list(torch.split(self.device_batch(x), sizes)) if self.is_root else None
        batch = StageBatch(sizes, inputs)
        ops = SCHEDULES[self.cfg.schedule](self.comm.rank, self.comm.size, len(sizes), False)
        with torch.no_grad():
            self.placed.executor.run(ops, batch, train=False)
        return self._gather(batch, n)

    def _gather(self, batch: StageBatch, n: int) -> torch.Tensor | None:
        last, executor = self.comm.size - 1, self.placed.executor
        out = torch.cat(batch.outputs) if self.placed.ctx.last else None
        if last != 0 and self.placed.ctx.last:
            executor.exchange([(out, 0)], [], "gather")
            executor.drain()
        elif last != 0 and self.is_root:
            tail, dtype = self.placed.final_meta
            out = torch.empty((n, *tail), dtype=dtype, device=self.device)
            executor.exchange([], [(out, last)], "gather")
        if not self.is_root:
            return None
        with self.timer.phase("d2h"):
            return out.to("cpu", torch.float64)

    def pipelined_pass(self, batch: Inputs | None, n: int) -> torch.Tensor | None:
        """Forward and backward of n items through the schedule (batch on the root: inputs
        prepared on the device, labels anywhere): every stage's gradients accumulated, the
        loss sum on the last stage."""
        sizes = even_counts(n, min(self.cfg.microbatches, n))
        work = StageBatch(sizes, loss_fn=self.workload.loss)
        last, executor = self.comm.size - 1, self.placed.executor
        if self.is_root:
            work.inputs = list(torch.split(batch.x, sizes))  # row slices stay channels-last
            y = self.to_device(batch.y)
            if last == 0:
                work.labels = list(torch.split(y, sizes))
            else:
                executor.exchange([(y, last)], [], "labels")
        elif self.placed.ctx.last:
            y = torch.empty(n, dtype=torch.int64, device=self.device)
            executor.exchange([], [(y, 0)], "recv")  # idle until stage 0 starts: bubble
            work.labels = list(torch.split(y, sizes))
        ops = SCHEDULES[self.cfg.schedule](self.comm.rank, self.comm.size, len(sizes), True)
        executor.run(ops, work, train=True)
        return work.loss_sum

    # --- the two modes ---------------------------------------------------------------------
    def infer(self, workload: Workload, model: nn.Module, inputs: Inputs | None) -> RunOutput:
        n = self.cfg.batch
        self.setup(workload, model, inputs.x if self.is_root else None)
        host_x = None
        if self.is_root:
            host_x = inputs.x.pin_memory() if self.device.type == "cuda" else inputs.x

        def step() -> torch.Tensor | None:
            return self.forward_batch(host_x, n)

        timings, out = timed_iterations(
            step, self.timer, self.cfg.warmup, self.cfg.iters, barrier=self.comm.barrier
        )
        stages = self.comm.gather_object(self.stage_summary(timings.laps, timings.walls))
        return RunOutput(
            timings,
            self.gather_phases(timings),
            None if out is None else np.asarray(out),
            n,
            self.bytes_moved(),
            notes=self.announce(pipeline_notes(self.cfg, self.plan, stages, train=False)),
        )

    def train(
        self, workload: Workload, model: nn.Module, data: tuple[Inputs, Inputs] | None
    ) -> RunOutput:
        from scalelab.strategies.pipeline.schedule_step import train_pipelined

        return train_pipelined(self, workload, model, data)

    def stage_summary(self, laps: list, walls: list[float], spans: list | None = None) -> dict:
        rank = self.comm.rank
        params = sum(p.numel() for p in self.placed.module.parameters())
        names = self.plan.names(rank)
        return stage_summary(self.cfg, rank, self.device, names, params, laps, walls, spans)

    def announce(self, notes: dict[str, Any]) -> dict[str, Any]:
        if notes and not self.cfg.quiet:
            print(summary_line(notes), file=sys.stderr, flush=True)
        return notes

    def all_sum(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=self.comm.device)
        return float(self.comm.allreduce(t)[0])

    def bytes_moved(self) -> dict[str, int]:
        per_rank = self.comm.gather_object(self.timer.bytes_moved())
        if per_rank is None:
            return {}
        total: dict[str, int] = {}
        for moved in per_rank:
            for name, n in moved.items():
                total[name] = total.get(name, 0) + n
        return total


def _check_trainable(workload: Workload, precision) -> None:
    if precision.autocast is torch.float16:
        raise UsageError(
            "pipeline trains in fp64/fp32/tf32/bf16 (fp16 needs a loss scaler shared by the "
            "stages); use --dtype bf16"
        )
    if type(workload).loss is not Workload.loss and not workload.loss_reads_output_only:
        raise UsageError(
            f"pipeline: {workload.name}'s loss looks at the whole model (regularisation), "
            "which no single stage holds; pipeline trains plain cross-entropy workloads"
        )


def _layer_paths(workload: Workload) -> list[str | None]:
    """The model's layer paths, from a model on the meta device (shapes only: no weights to
    allocate, VGG-16's 0.5 GB included); a factory that cannot build there is built as is."""
    try:
        with torch.device("meta"):
            return [layer.path for layer in workload.layers(workload.build_model())]
    except Exception:  # a user's factory that reads files, a traced forward on real inputs
        return [layer.path for layer in workload.layers(workload.build_model())]
