"""Training on scalelab's pipeline engine, in the shared Trainer (train/loop.py): its
checkpoints, --resume, NaN stop, progress and history. What the pipeline plugs in:

- RootBatches: the one-process batch order; the root gathers each batch (a step ahead, on a
  thread), the other stages learn only its size;
- ScheduledStep: one optimizer step = the schedule's forward and backward of every
  micro-batch, then each stage's own SGD on its own parameters; it keeps each step's wall and
  phases for the bubble (report.stage_summary). Its checkpoint state is the whole model and
  the optimizer state by the whole model's parameter index, gathered from every stage onto
  the root, so a resume may land on another cut (--balance auto times may differ).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from scalelab.results import RunOutput
from scalelab.strategies.pipeline.report import pipeline_notes
from scalelab.train.loop import TrainPlan, TrainStep, require_labels, run_training
from scalelab.train.sources import BatchSource, Step, batch_order, batch_slices
from scalelab.workloads.base import Inputs, Workload

if TYPE_CHECKING:
    from scalelab.strategies.pipeline.host import PipelineHost


def train_pipelined(
    s: PipelineHost, workload: Workload, model: nn.Module, data: tuple | None
) -> RunOutput:
    train, heldout = data if s.is_root else (None, None)
    if s.is_root:
        require_labels(train, heldout)
    n_train, n_held = s.comm.bcast_object((len(train), len(heldout)) if s.is_root else None)
    s.setup(workload, model, train.x[: s.cfg.batch] if s.is_root else None)
    source = RootBatches(s, train, n_train)
    step = ScheduledStep(s, workload, model, source)
    plan = TrainPlan(
        source=source,
        evaluate=lambda _: evaluate(s, heldout, n_held),
        module=model,
        prepare=workload.prepare,
        loss=workload.loss,
        n_train=n_train,
    )
    out = run_training(s, workload, model, plan, step=step)
    out.bytes_moved = s.bytes_moved()
    # the whole model on the root, gathered (collective): for --save-weights and --check
    out.model = step.whole_model() if s.cfg.save_weights or s.cfg.check else None
    summary = s.stage_summary(step.laps, step.walls, step.spans)
    stages = s.comm.gather_object(summary)
    out.notes.update(s.announce(pipeline_notes(s.cfg, s.plan, stages, train=True)))
    return out


def evaluate(s: PipelineHost, heldout: Inputs | None, n_held: int) -> float:
    """Held-out accuracy through the pipeline (untimed: its phases are discarded)."""
    s.placed.module.eval()
    correct = 0
    for piece in batch_slices(n_held, s.cfg.batch):
        x = heldout.x[piece] if s.is_root else None
        logits = s.forward_batch(x, piece.stop - piece.start)
        if s.is_root:
            correct += s.workload.score(logits, heldout.y[piece])
    s.placed.module.train()
    s.timer.lap()
    return s.comm.bcast_object(correct / max(n_held, 1))


class RootBatches(BatchSource):
    """batch_order's batches; the root's are gathered, on the device and prepared; the other
    ranks' steps carry only the size. `started`: when the current step began waiting for its
    batch (the step's wall counts that wait: the root's host work is part of the period)."""

    def __init__(self, s: PipelineHost, train: Inputs | None, n_train: int) -> None:
        self.s, self.train, self.n_train = s, train, n_train
        self.global_batch = s.cfg.batch
        self.started = time.perf_counter()
        self._staging: torch.Tensor | None = None  # CUDA: the pinned gather buffer
        self._copy_stream: Any = None

    def steps_per_epoch(self) -> int:
        return len(batch_slices(self.n_train, self.global_batch))

    def epoch(self, epoch: int, skip: int) -> Iterator[Step]:
        s = self.s
        pieces = batch_slices(self.n_train, self.global_batch)
        order = batch_order(self.n_train, epoch, s.cfg.seed) if s.is_root else None
        nothing = Inputs(torch.empty(0), None)
        with HostPrefetch(lambda i: self._host_batch(order[pieces[i]])) as fetch:
            for i in range(skip, len(pieces)):
                s.timer.settle()
                self.started = time.perf_counter()
                batch = fetch.get(i, ahead=i + 1 < len(pieces)) if s.is_root else None
                if batch is not None and batch.x.is_cuda:
                    # Allocated on the copy stream, read on this one: the allocator must
                    # not hand the memory to the next copy before this step is done.
                    for t in (batch.x, batch.y):
                        t.record_stream(torch.cuda.current_stream(s.device))
                yield Step(batch or nothing, pieces[i].stop - pieces[i].start, 1.0)

    def _host_batch(self, idx: torch.Tensor) -> Inputs:
        """The batch's items on the device, prepared. Runs one step ahead on the prefetch
        thread (so no timer phases here), overlapping the step in flight: the gather into a
        reused pinned buffer (VGG-16 at batch 256: 38.5 MB of uint8 pixels), then on a side
        stream the copy to the device and `prepare` (pixels to normalised floats,
        channels-last). In the step, that work held the first micro-batch back by ~1.7 ms of
        a 41 ms step on 2 H200s, which every later stage waited out as bubble. The side
        stream is waited for here, on this thread: the buffer is free for the next gather
        and the step gets a ready batch."""
        s, train = self.s, self.train
        if s.device.type != "cuda":
            return Inputs(s.prepare(train.x[idx]), train.y[idx])
        if self._staging is None:
            shape = (s.cfg.batch, *train.x.shape[1:])
            self._staging = torch.empty(shape, dtype=train.x.dtype).pin_memory()
            self._copy_stream = torch.cuda.Stream(s.device)
        x = torch.index_select(train.x, 0, idx, out=self._staging[: len(idx)])
        with torch.cuda.stream(self._copy_stream):
            x = s.prepare(x.to(s.device, non_blocking=True))
            batch = Inputs(x, train.y[idx].to(s.device))
        self._copy_stream.synchronize()
        return batch


class ScheduledStep(TrainStep):
    """One pipelined optimizer step; keeps every step's wall, phases and (CUDA) phase spans."""

    def __init__(
        self, s: PipelineHost, workload: Workload, model: nn.Module, source: RootBatches
    ) -> None:
        self.s, self.model, self.source = s, model, source
        self.loss_here = s.placed.ctx.last
        # A stage of parameter-free layers (an auto cut of [GELU, Dropout]) has nothing to
        # step, but SGD refuses an empty list: it steps one empty placeholder instead.
        params = any(True for _ in s.placed.module.parameters())
        empty = nn.ParameterList([nn.Parameter(torch.zeros(0, device=s.device))])
        self.opt = workload.optimizer(s.placed.module if params else empty)
        self.laps: list[dict[str, float]] = []
        self.walls: list[float] = []
        self.spans: list[list[tuple[str, float, float]]] = []
        self._epoch_laps: list[dict[str, float]] = []

    def __call__(self, step: Step) -> torch.Tensor:
        s = self.s
        loss_sum = s.pipelined_pass(step.local if s.is_root else None, step.items)
        with s.timer.phase("step"):
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        s.timer.settle()
        self.walls.append(time.perf_counter() - self.source.started)
        lap = s.timer.lap()
        self.laps.append(lap)
        self._epoch_laps.append(lap)
        self.spans.append(getattr(s.timer, "last_device_spans", []))
        if loss_sum is None:  # not the last stage: the loss lives there
            return torch.zeros((), dtype=torch.float64, device=s.device)
        return loss_sum

    def lap(self, timer: Any) -> dict[str, float]:
        laps, self._epoch_laps = [*self._epoch_laps, timer.lap()], []
        total: dict[str, float] = {}
        for lap in laps:
            for name, seconds in lap.items():
                total[name] = total.get(name, 0.0) + seconds
        return total

    def weights(self) -> list[torch.Tensor]:
        return [p.detach() for p in self.s.placed.module.parameters()]

    # --- checkpoint state: the whole model, gathered --------------------------------------
    def _index(self) -> dict[int, int]:
        """id(parameter) -> its index among the whole model's parameters."""
        return {id(p): i for i, p in enumerate(self.model.parameters())}

    def export_state(self) -> tuple[dict, dict] | None:
        stage, index = self.s.placed.module, self._index()
        mine = {id(t) for t in (*stage.parameters(), *stage.buffers())}
        tensors = self.model.state_dict(keep_vars=True)
        model_part = {k: t.detach().cpu().clone() for k, t in tensors.items() if id(t) in mine}
        local = list(stage.parameters())
        opt_part = {
            index[id(local[i])]: {k: _cpu(v) for k, v in state.items()}
            for i, state in self.opt.state_dict()["state"].items()
        }
        parts = self.s.comm.gather_object((model_part, opt_part))
        if parts is None:
            return None
        whole = {k: t.detach().cpu().clone() for k, t in self.model.state_dict().items()}
        opt_state: dict[int, Any] = {}
        for model_part, opt_part in parts:
            whole.update(model_part)
            opt_state.update(opt_part)
        hyper = {k: v for k, v in self.opt.param_groups[0].items() if k != "params"}
        groups = [{**hyper, "params": list(range(len(index)))}]
        return whole, {"state": opt_state, "param_groups": groups}

    def import_state(self, model: dict, optimizer: dict) -> None:
        """Every rank loads the whole model (its stage's tensors are the model's own) and
        its stage's optimizer buffers, by whole-model index."""
        hyper = {k: v for k, v in self.opt.param_groups[0].items() if k != "params"}
        self.model.load_state_dict(model)
        index, local = self._index(), list(self.s.placed.module.parameters())
        saved = optimizer["state"]
        state = {i: saved[index[id(p)]] for i, p in enumerate(local) if index[id(p)] in saved}
        slots = list(range(len(self.opt.param_groups[0]["params"])))  # local, or the placeholder
        self.opt.load_state_dict({"state": state, "param_groups": [{**hyper, "params": slots}]})

    def whole_model(self) -> nn.Module | None:
        """--save-weights: every stage's trained tensors in the root's model (collective)."""
        pair = self.export_state()
        if pair is None:
            return None
        # The root's copies of other stages' layers were never cast: cast before loading, or
        # fp64 weights would be rounded to the model's build dtype.
        self.model.to(device="cpu", dtype=self.s.precision.storage)
        self.model.load_state_dict(pair[0])
        return self.model


def _cpu(v: Any) -> Any:
    return v.detach().cpu().clone() if torch.is_tensor(v) else v


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
