"""`pipeline`: the model's layers cut into K stages, one rank (GPU, or CPU process over gloo)
each; a batch split into M micro-batches that flow through the stages (GPipe, or 1F1B with
`--schedule 1f1b`). `--placement manual` is the naive alternative: the stages on the GPUs of
one process, no micro-batches (strategies/manual_placement.py).

Rank 0 is stage 0 and the root: it holds the inputs and gets the output back from the last
stage. Training takes the gradient of the batch's mean loss (each micro-batch's loss weighted
by its share of the batch), then every stage steps its own optimizer on its own parameters:
one pipelined step equals one single-process step on the whole batch.

Record field `pipeline`: the partition, the bubble by the formula (K-1)/(M+K-1), simulated
from the measured per-stage times (strategies/pipeline_schedule.py) and measured (the share of
each stage's schedule it spent not computing), and per-stage times and peak memory.

SCALELAB_GPU_MEM_LIMIT (bytes) caps each rank's CUDA allocator, so a big GPU can play a small
one; `scalelab fit --mem-limit ... --find stages --run` sets it for the pipeline it starts.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from torch import nn

from scalelab.comm import Comm, SelfComm
from scalelab.comm.base import even_counts
from scalelab.comm.launch import inside_torchrun
from scalelab.comm.torchdist import TorchDistComm
from scalelab.errors import UsageError
from scalelab.instrument.progress import Progress
from scalelab.instrument.timer import (
    EventTimer,
    Timings,
    notify_step,
    timed_iterations,
)
from scalelab.strategies import partition as part
from scalelab.strategies.base import STRATEGIES, RunOutput, Strategy, TrainHistory
from scalelab.strategies.manual_placement import ManualPlacement
from scalelab.strategies.pipeline_report import pipeline_notes, stage_summary, summary_line
from scalelab.strategies.pipeline_schedule import SCHEDULES
from scalelab.strategies.pipeline_stage import (
    Meta,
    StageBatch,
    StageContext,
    StageExecutor,
    make_lanes,
)
from scalelab.strategies.torch_base import TorchStrategy
from scalelab.train.loop import batch_order, batch_slices, total_steps
from scalelab.workloads.base import Inputs, Workload


@STRATEGIES.register(
    "pipeline",
    "layers cut into --stages ranks, --microbatches GPipe/1F1B micro-batching "
    "(--placement manual: GPUs of one process)",
)
class PipelineStrategy(TorchStrategy):
    launcher = "torchrun"
    reads = ("pipeline", "placement", "engine", "gpus", "layout", "compile")

    @classmethod
    def reads_for(cls, cfg) -> tuple[str, ...]:
        if cfg.engine == "torch":
            from scalelab.strategies.pipeline_torch import TorchPipeline

            return TorchPipeline.reads
        return ManualPlacement.reads if cfg.placement == "manual" else cls.reads

    @classmethod
    def describe(cls, cfg) -> str:
        if cfg.engine == "torch":
            return "the pipeline strategy with --engine torch"
        return f"the pipeline strategy with --placement {cfg.placement}"

    @classmethod
    def read_with(cls, cfg, section: str) -> str | None:
        from scalelab.strategies.pipeline_torch import TorchPipeline

        if cfg.engine != "torch" and section in TorchPipeline.reads:
            return "--engine torch"
        return "--engine scalelab" if cfg.engine == "torch" and section in cls.reads else None

    def __new__(cls, cfg) -> Strategy:
        placement = PLACEMENTS[cfg.placement]  # a known name (config_sections)
        if cfg.engine == "torch":
            from scalelab.strategies.pipeline_torch import TorchPipeline

            return TorchPipeline(cfg)  # torch.distributed.pipelining's schedules
        if placement is cls:
            return super().__new__(cls)
        return placement(cfg)  # not a subclass: Python does not run our __init__ on it

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        if self.device.type == "cuda":
            # No barrier per phase: the host enqueues micro-batch after micro-batch while the
            # GPU works (a barrier each left it idle during every launch: 0.66x plain PyTorch
            # at M=8 on one stage), sends in flight never block, and receives are waited for
            # on the device (NCCL's wait() makes the stream wait). Phases are CUDA-event times.
            self.timer = EventTimer(self.device)

    def make_comm(self) -> Comm:
        if self.cfg.ranks == 1 and not inside_torchrun():
            return SelfComm()
        return TorchDistComm("nccl" if self.cfg.device == "cuda" else "gloo")

    def pick_device(self) -> torch.device:
        device = super().pick_device()
        if device.type == "cuda":
            device = torch.device("cuda", self.comm.local_rank % torch.cuda.device_count())
            part.cap_allocator(device, part.env_mem_limit())
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
        """sample: one batch's transport-form inputs on the root (None elsewhere)."""
        cfg, comm = self.cfg, self.comm
        self.workload = workload
        self.layers = part.model_layers(workload, model)
        counts = part.parse_balance(cfg.balance, len(self.layers), cfg.stages)
        self.profile: list[part.LayerProfile] | None = None
        self.lanes = make_lanes(comm.size) if comm.size > 1 else {}  # collective, in order
        self.balance_rounds: list[dict[str, Any]] = []
        auto = counts is None
        if auto:
            counts = comm.bcast_object(self._auto_counts(sample) if self.is_root else None)
        self._place(counts, sample)
        self.executor.connect()
        if auto and comm.size > 1 and cfg.rebalance > 0:
            self._rebalance(sample)

    def _place(self, counts: list[int], sample: torch.Tensor | None) -> None:
        """Build this rank's stage of the cut `counts`: its layers on the device, the shapes
        crossing every boundary, the executor. A previous stage's layers go back to the host
        first (those that stay return with the rest)."""
        cfg, comm = self.cfg, self.comm
        if getattr(self, "stage", None) is not None:
            self.stage.to("cpu")
        self.counts = counts
        start, stop = part.bounds(counts)[comm.rank]
        modules = [layer.module for layer in self.layers[start:stop]]
        stage = nn.Sequential(*modules).to(device=self.device, dtype=self.precision.storage)
        if cfg.channels_last:
            stage = stage.to(memory_format=torch.channels_last)
        self.stage = stage.train(cfg.train)
        metas = self._probe_shapes(sample)
        # --compile: Inductor fuses each conv's bias add, ReLU and pooling (and their
        # backwards) into a few Triton kernels. Eager VGG-16 spends more time in those
        # elementwise kernels than in its convolutions (H100: 43 of 77 ms a step at batch
        # 256), and micro-batches of 32 pay them again per micro-batch. Shapes are static:
        # every micro-batch size compiles once (dynamic shapes would give up the fusions).
        run = torch.compile(stage, dynamic=False) if cfg.compile else stage
        self.final_meta = metas[-1]
        self.ctx = StageContext(
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
        self.executor = StageExecutor(self.ctx)

    def _rebalance(self, sample: torch.Tensor | None) -> None:
        """--rebalance R: time the cut in a real pipelined pass, re-cut the profile fitted to
        every cut timed so far (partition.rebalance), time the new cut; at most R times. Keep
        the fastest cut timed (the smallest slowest stage). A re-cut that lands on a cut
        already timed ends the search early. Every cut tried is recorded with its times."""
        timed: dict[tuple[int, ...], float] = {}  # cut -> its slowest stage's seconds
        for round_ in range(self.cfg.rebalance + 1):
            measured = self.comm.gather_object(self._time_stage(sample))
            decision = None
            if self.is_root:
                decision = part.recut_step(
                    self.profile, self.balance_rounds, timed, self.counts, measured,
                    round_ == self.cfg.rebalance, self._mem,
                )  # fmt: skip
            counts, done = self.comm.bcast_object(decision)
            if counts != self.counts:
                self._place(counts, sample)
            if done:
                return

    def _time_stage(self, sample: torch.Tensor | None) -> float:
        """This stage's forward (+ backward) seconds per micro-batch inside a real pipelined
        pass of the sample batch, schedule and point-to-point and all (training: zero labels,
        no optimizer step, the gradients dropped). The second of two passes counts: the first
        allocates, autotunes and, under --compile, compiles the cut. Timed alone, a stage
        does not run as it runs in place: VGG-16's FC stage took ~1.5x its in-pipeline time
        per micro-batch on an H200 (cause not found), and a re-cut from those times kept a
        60/40 split of the work (docs/PERFORMANCE.md)."""
        n = self.comm.bcast_object(len(sample) if self.is_root else None)
        for _ in range(2):
            self.timer.lap()
            if self.cfg.train:
                labels = torch.zeros(n, dtype=torch.int64)
                batch = Inputs(self._device_batch(sample), labels) if self.is_root else None
                self.pipelined_pass(batch, n)
            else:
                self.forward_batch(sample, n)
            self.timer.settle()
        lap = self.timer.lap()
        self.timer.discard()
        self.stage.zero_grad(set_to_none=True)
        return (lap.get("forward", 0.0) + lap.get("backward", 0.0)) / min(self.cfg.microbatches, n)

    def _auto_counts(self, sample: torch.Tensor) -> list[int]:
        """Root: measure every layer on one micro-batch, then split by time within memory."""
        cfg = self.cfg
        n = even_counts(len(sample), cfg.microbatches)[0]
        x = self._prepare(sample[:n].to(self.device))
        self.profile = part.profile_layers(
            self.layers,
            x,
            self.device,
            self.precision.storage,
            cfg.train,
            self.autocast,
            channels_last=cfg.channels_last,
        )
        mem = part.memory_model(
            part.device_capacity(self.device, part.env_mem_limit()),
            cfg.stages,
            cfg.microbatches,
            cfg.train,
            cfg.schedule,
            cfg.momentum,
        )
        self._mem = mem
        return part.balance_auto(self.profile, cfg.stages, mem)

    def _prepare(self, x: torch.Tensor) -> torch.Tensor:
        x = self.workload.prepare(x).to(self.precision.storage)
        if self.cfg.channels_last and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        return x

    def _probe_shapes(self, sample: torch.Tensor | None) -> list[Meta]:
        """Each stage's output (per-item shape, dtype), learnt by running one item through
        stage after stage (stage s > 0 on zeros of the shape stage s-1 announced)."""
        metas: list[Any] = []
        for s in range(self.comm.size):
            meta = None
            if self.comm.rank == s:
                if s == 0:
                    x = self._prepare(sample[:1].to(self.device))
                else:
                    tail, dtype = metas[-1]
                    x = torch.zeros((1, *tail), dtype=dtype, device=self.device)
                with torch.no_grad(), self.autocast():
                    y = self.stage.eval()(x)
                self.stage.train(self.cfg.train)
                meta = (tuple(y.shape[1:]), y.dtype)
            metas.append(self.comm.bcast_object(meta, root=s))
        return metas

    # --- one batch through the pipeline -----------------------------------------------------
    def _device_batch(self, x: torch.Tensor) -> torch.Tensor:
        """A batch's host items on the device, prepared (the model's input dtype, layout)."""
        with self.timer.phase("h2d"):
            x = self.to_device(x)
        return self._prepare(x)

    def forward_batch(self, x: torch.Tensor | None, n: int) -> torch.Tensor | None:
        """Inference of n items (x on the root): the logits on the root, float64 on CPU."""
        sizes = even_counts(n, min(self.cfg.microbatches, n))
        inputs = list(torch.split(self._device_batch(x), sizes)) if self.is_root else None
        batch = StageBatch(sizes, inputs)
        ops = SCHEDULES[self.cfg.schedule](self.comm.rank, self.comm.size, len(sizes), False)
        with torch.no_grad():
            self.executor.run(ops, batch, train=False)
        return self._gather(batch, n)

    def _gather(self, batch: StageBatch, n: int) -> torch.Tensor | None:
        last = self.comm.size - 1
        out = torch.cat(batch.outputs) if self.ctx.last else None
        if last != 0 and self.ctx.last:
            self.executor.exchange([(out, 0)], [], "gather")
            self.executor.drain()
        elif last != 0 and self.is_root:
            tail, dtype = self.final_meta
            out = torch.empty((n, *tail), dtype=dtype, device=self.device)
            self.executor.exchange([], [(out, last)], "gather")
        if not self.is_root:
            return None
        with self.timer.phase("d2h"):
            return out.to("cpu", torch.float64)

    def train_batch(self, batch: Inputs | None, n: int) -> torch.Tensor | None:
        """One optimizer step on n items (on the root); the loss sum on the last stage."""
        loss_sum = self.pipelined_pass(batch, n)
        with self.timer.phase("step"):
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return loss_sum

    def pipelined_pass(self, batch: Inputs | None, n: int) -> torch.Tensor | None:
        """Forward and backward of n items through the schedule (batch on the root: inputs
        prepared on the device, labels anywhere): every stage's gradients accumulated, the
        loss sum on the last stage."""
        sizes = even_counts(n, min(self.cfg.microbatches, n))
        work = StageBatch(sizes, loss_fn=self.workload.loss)
        last = self.comm.size - 1
        if self.is_root:
            work.inputs = list(torch.split(batch.x, sizes))  # row slices stay channels-last
            y = self.to_device(batch.y)
            if last == 0:
                work.labels = list(torch.split(y, sizes))
            else:
                self.executor.exchange([(y, last)], [], "labels")
        elif self.ctx.last:
            y = torch.empty(n, dtype=torch.int64, device=self.device)
            self.executor.exchange([], [(y, 0)], "recv")  # idle until stage 0 starts: bubble
            work.labels = list(torch.split(y, sizes))
        ops = SCHEDULES[self.cfg.schedule](self.comm.rank, self.comm.size, len(sizes), True)
        self.executor.run(ops, work, train=True)
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
        stages = self.comm.gather_object(stage_summary(self, timings.laps, timings.walls))
        return RunOutput(
            timings,
            self.gather_phases(timings),
            None if out is None else np.asarray(out),
            n,
            self._bytes(),
            notes=self._announce(pipeline_notes(self, stages, train=False)),
        )

    def train(
        self, workload: Workload, model: nn.Module, data: tuple[Inputs, Inputs] | None
    ) -> RunOutput:
        train, heldout = data if self.is_root else (None, None)
        if self.is_root and train.y is None:
            raise UsageError(f"{workload.name} has no labels to train on")
        n_train, n_held = self.comm.bcast_object(
            (len(train), len(heldout)) if self.is_root else None
        )
        self.setup(workload, model, train.x[: self.cfg.batch] if self.is_root else None)
        self.optimizer = workload.optimizer(self.stage)
        history = TrainHistory()
        self.step_laps: list[dict[str, float]] = []
        self.step_walls: list[float] = []
        self.step_spans: list[list[tuple[str, float, float]]] = []  # CUDA: each step's phases
        timings = self._train_epochs(train, heldout, n_train, n_held, history)
        stages = self.comm.gather_object(stage_summary(self, self.step_laps, self.step_walls))
        items_per_epoch = history.items / max(len(timings.walls), 1)
        return RunOutput(
            timings,
            self.comm.gather_object(timings.phase_totals()),
            None,
            round(items_per_epoch),
            self._bytes(),
            history=history,
            model=self._collect_weights(model),
            notes=self._announce(pipeline_notes(self, stages, train=True)),
        )

    def _announce(self, notes: dict[str, Any]) -> dict[str, Any]:
        if notes and not self.cfg.quiet:
            print(summary_line(notes), file=sys.stderr, flush=True)
        return notes

    def _train_epochs(self, train, heldout, n_train, n_held, history) -> Timings:
        """train/loop.py's epochs with a pipelined step; one timing lap per epoch, each
        step's wall and phases kept (self.step_walls, self.step_laps) for the bubble."""
        cfg = self.cfg
        n_steps = total_steps(n_train, cfg.batch, cfg.epochs, cfg.steps)
        progress = Progress(n_steps, "train", enabled=self.is_root and not cfg.quiet)
        timings = Timings()
        for epoch in range(cfg.epochs):
            order = batch_order(n_train, epoch, cfg.seed) if self.is_root else None
            loss_sum, items, epoch_laps = 0.0, 0, []
            pieces = list(batch_slices(n_train, cfg.batch))
            gather = lambda i, order=order, pieces=pieces: self._host_batch(  # noqa: E731
                train, order[pieces[i]]
            )
            with HostPrefetch(gather) as fetch:
                for i, piece in enumerate(pieces):
                    n = piece.stop - piece.start
                    self.timer.settle()
                    # The wall includes waiting for this batch's gather (the root's host work is
                    # part of the pipeline's period), which ran while the previous step computed.
                    start = time.perf_counter()
                    batch = fetch.get(i, ahead=i + 1 < len(pieces)) if self.is_root else None
                    if batch is not None and batch.x.is_cuda:
                        # Allocated on the copy stream, read on this one: the allocator must
                        # not hand the memory to the next copy before this step is done.
                        for t in (batch.x, batch.y):
                            t.record_stream(torch.cuda.current_stream(self.device))
                    loss = self.train_batch(batch, n)
                    self.timer.settle()
                    self.step_walls.append(time.perf_counter() - start)
                    epoch_laps.append(self.timer.lap())
                    self.step_spans.append(getattr(self.timer, "last_device_spans", []))
                    notify_step()
                    loss_sum += 0.0 if loss is None else float(loss)
                    items, history.steps = items + n, history.steps + 1
                    progress.update(history.steps)
                    if history.steps >= n_steps:
                        break
            self.step_laps += epoch_laps
            timings.add(sum(self.step_walls[-len(epoch_laps) :]), _sum_laps(epoch_laps))
            history.end_epoch(
                items, self.all_sum(loss_sum) / items, self._evaluate(heldout, n_held), progress
            )
            if history.steps >= n_steps:
                break
        return timings

    def _host_batch(self, train: Inputs, idx: torch.Tensor) -> Inputs:
        """The batch's items on the device, prepared. Runs one step ahead on the prefetch
        thread (so no timer phases here), overlapping the step in flight: the gather into a
        reused pinned buffer (VGG-16 at batch 256: 38.5 MB of uint8 pixels), then on a side
        stream the copy to the device and `prepare` (pixels to normalised floats,
        channels-last). In the step, that work held the first micro-batch back by ~1.7 ms of
        a 41 ms step on 2 H200s, which every later stage waited out as bubble. The side
        stream is waited for here, on this thread: the buffer is free for the next gather
        and the step gets a ready batch."""
        if self.device.type != "cuda":
            return Inputs(self._prepare(train.x[idx]), train.y[idx])
        if getattr(self, "_staging", None) is None:
            shape = (self.cfg.batch, *train.x.shape[1:])
            self._staging = torch.empty(shape, dtype=train.x.dtype).pin_memory()
            self._copy_stream = torch.cuda.Stream(self.device)
        x = torch.index_select(train.x, 0, idx, out=self._staging[: len(idx)])
        with torch.cuda.stream(self._copy_stream):
            x = self._prepare(x.to(self.device, non_blocking=True))
            batch = Inputs(x, train.y[idx].to(self.device))
        self._copy_stream.synchronize()
        return batch

    def all_sum(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=self.comm.device)
        return float(self.comm.allreduce(t)[0])

    def _evaluate(self, heldout: Inputs | None, n_held: int) -> float:
        """Held-out accuracy through the pipeline (untimed: its phases are discarded)."""
        self.stage.eval()
        correct = 0
        for piece in batch_slices(n_held, self.cfg.batch):
            x = heldout.x[piece] if self.is_root else None
            logits = self.forward_batch(x, piece.stop - piece.start)
            if self.is_root:
                correct += int((logits.argmax(dim=1) == heldout.y[piece]).sum())
        self.stage.train()
        self.timer.lap()
        return self.comm.bcast_object(correct / max(n_held, 1))

    def _collect_weights(self, model: nn.Module) -> nn.Module | None:
        """With --save-weights: every stage's trained parameters into the root's model."""
        if not self.cfg.save_weights:
            return None
        start, stop = part.bounds(self.counts)[self.comm.rank]
        mine = {
            i: {k: v.detach().cpu() for k, v in self.layers[i].module.state_dict().items()}
            for i in range(start, stop)
        }
        everything = self.comm.gather_object(mine)
        if not self.is_root:
            return None
        # The root's copies of other stages' layers were never cast: cast before loading, or
        # fp64 weights would be rounded to the model's build dtype.
        model.to(device="cpu", dtype=self.precision.storage)
        for states in everything[1:]:
            for i, state in states.items():
                self.layers[i].module.load_state_dict(state)
        return model

    def _bytes(self) -> dict[str, int]:
        per_rank = self.comm.gather_object(self.timer.bytes_moved())
        if per_rank is None:
            return {}
        total: dict[str, int] = {}
        for moved in per_rank:
            for name, n in moved.items():
                total[name] = total.get(name, 0) + n
        return total


class HostPrefetch:
    """gather(i) for step i, run one step ahead on a worker thread (torch's copy kernels drop
    the GIL), so the root's host gather overlaps the previous step's device work."""

    def __init__(self, gather: Callable[[int], Inputs]) -> None:
        self.gather = gather
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="scalelab-prefetch")
        self.pending: dict[int, Future] = {}

    def get(self, i: int, ahead: bool) -> Inputs:
        future = self.pending.pop(i, None) or self.pool.submit(self.gather, i)
        batch = future.result()
        if ahead:
            self.pending[i + 1] = self.pool.submit(self.gather, i + 1)
        return batch

    def __enter__(self) -> HostPrefetch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


def _sum_laps(laps: list[dict[str, float]]) -> dict[str, float]:
    total: dict[str, float] = {}
    for lap in laps:
        for name, seconds in lap.items():
            total[name] = total.get(name, 0.0) + seconds
    return total


def _check_trainable(workload: Workload, precision) -> None:
    if precision.autocast is torch.float16:
        raise UsageError(
            "pipeline trains in fp64/fp32/tf32/bf16 (fp16 needs a loss scaler shared by the "
            "stages); use --dtype bf16"
        )
    if type(workload).loss is not Workload.loss:
        raise UsageError(
            f"pipeline: {workload.name}'s loss looks at the whole model (regularisation), "
            "which no single stage holds; pipeline trains plain cross-entropy workloads"
        )


PLACEMENTS: dict[str, type[Strategy]] = {"pipeline": PipelineStrategy, "manual": ManualPlacement}
