"""Fast training: the data set resident on the GPU (prepared once) and one optimizer step
captured as a CUDA graph (batch gather by index, forward under autocast, loss, backward, SGD).

Eager training pays host time for every kernel of forward, backward and optimizer (hundreds
per step), plus a host-side gather and a host-to-device copy per batch; at small and medium
batches that, not the GPU, sets the pace. Here a step is one index copy and one graph replay,
and nothing syncs the device between steps. The shared Trainer (train/loop.py) still runs the
epochs, checkpoints, NaN guard, resume and progress; FastTrainer only replaces how an epoch's
steps execute. Warm-up and capture run real steps, so parameters, buffers (batch-norm
statistics) and momentum are restored afterwards: the first replay is the run's next step.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING

import torch
from torch import nn

from scalelab.fast.feeds import Feed, GlobalFeed
from scalelab.fast.generic import has_conv2d
from scalelab.fast.graphs import warm_up
from scalelab.train.loop import Trainer, TrainPlan
from scalelab.train.sources import GlobalBatches, Step
from scalelab.workloads.base import Inputs, Workload

if TYPE_CHECKING:
    from scalelab.train.host import TrainHost

LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def autocast_for(device: torch.device, dtype: torch.dtype | None) -> AbstractContextManager:
    # No weight-cast cache: a cached bf16 copy made outside the graph would be replayed stale.
    if dtype is None:
        return nullcontext()
    return torch.autocast(device.type, dtype=dtype, cache_enabled=False)


class GraphStep:
    """Training steps of a fixed batch size replayed from one captured CUDA graph.

    data: (x, y) on the GPU, x in transport form; prepare maps it once to the model input
    (per item it is elementwise, and some prepare()s copy constants from the host, which
    capture forbids). step(idx) returns the step's summed loss (loss * items) on the device,
    valid until the next step.
    """

    def __init__(
        self,
        model: nn.Module,
        opt: torch.optim.Optimizer,
        prepare: Callable[[torch.Tensor], torch.Tensor],
        loss: LossFn,
        data: tuple[torch.Tensor, torch.Tensor],
        batch: int,
        amp: torch.dtype | None,
        warmup: int = 3,
        convert_layout: bool = True,
        stream: torch.cuda.Stream | None = None,
    ) -> None:
        self.model, self.opt, self.loss_fn, self.batch, self.amp = model, opt, loss, batch, amp
        self.warmup = warmup
        # The stream warm-up and capture run on. DDP's: autograd runs each parameter's
        # AccumulateGrad node (and DDP's hook on it, which copies the gradient into its bucket)
        # on the stream current when DDP made the node, and a capture on another stream can
        # fail on it (NVIDIA/Megatron-LM#6021). Under SCALELAB_DETERMINISTIC=1 the captured
        # DDP step equals eager DDP's bitwise (measured on 2x H200; tests/test_ddp.py's GPU test).
        self.stream = stream
        with torch.no_grad():
            self.x_all = prepare(data[0])  # (n, ...) model inputs
        self.y_all = data[1]
        self.device = self.x_all.device
        # convert_layout=False: the caller chose the layout (a DDP wrapper's buckets must keep
        # the parameters' memory, so the model cannot be converted after wrapping).
        self.channels_last = convert_layout and has_conv2d(model)
        if self.channels_last:  # Module.to keeps the Parameter objects: opt stays valid
            model.to(memory_format=torch.channels_last)
        self.idx = torch.zeros(batch, dtype=torch.long, device=self.device)
        self.graph, self.loss_out = self._capture()

    def _loss(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.x_all.index_select(0, idx)
        if self.channels_last and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        with autocast_for(self.device, self.amp):
            return self.loss_fn(self.model, self.model(x), self.y_all.index_select(0, idx))

    def _step(self) -> torch.Tensor:
        loss = self._loss(self.idx)
        loss.backward()
        self.opt.step()
        return loss.detach() * self.batch

    def _capture(self) -> tuple[torch.cuda.CUDAGraph | None, torch.Tensor | None]:
        """Warm up, capture, restore. Off CUDA (tests) the same warm-up and restore run and
        step() then runs _step eagerly, so everything but the graph itself is checked on CPU."""
        saved = self._snapshot()
        self.opt.zero_grad(set_to_none=True)
        if self.device.type != "cuda":
            for _ in range(self.warmup):
                self._step()
            self._restore(saved)
            return None, None
        warm_up(self._step, self.warmup, self.stream)
        # Gradients are None at capture, so the captured backward writes them (no += stale).
        self.opt.zero_grad(set_to_none=True)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=self.stream):
            loss_out = self._step()
        self._restore(saved)
        return graph, loss_out

    def _snapshot(self) -> dict[str, torch.Tensor | None]:
        saved: dict[str, torch.Tensor | None] = {
            k: v.detach().clone() for k, v in self.model.state_dict().items()
        }
        for i, p in enumerate(self._params()):
            buf = self.opt.state.get(p, {}).get("momentum_buffer")
            saved[f"momentum.{i}"] = None if buf is None else buf.clone()
        return saved

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.opt.param_groups for p in group["params"]]

    @torch.no_grad()
    def _restore(self, saved: dict[str, torch.Tensor | None]) -> None:
        for k, v in self.model.state_dict().items():
            v.copy_(saved[k])
        for i, p in enumerate(self._params()):
            buf = self.opt.state.get(p, {}).get("momentum_buffer")
            if buf is None:
                continue
            old = saved.get(f"momentum.{i}")
            # No buffer before: zero momentum with dampening 0 is SGD's first step (buf = grad).
            buf.copy_(old) if old is not None else buf.zero_()

    def step(self, idx: torch.Tensor) -> torch.Tensor:
        """One step on items idx (on the GPU): a replay, or eagerly for a short last batch."""
        if len(idx) == self.batch:
            self.idx.copy_(idx)
            if self.graph is None:  # off CUDA: what the replay does, eagerly
                self.opt.zero_grad(set_to_none=True)
                return self._step()
            self.graph.replay()
            return self.loss_out
        # The graph keeps its own gradient buffers, so eager gradients start from None.
        self.opt.zero_grad(set_to_none=True)
        loss = self._loss(idx)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach() * len(idx)


class FastTrainer(Trainer):
    """The shared Trainer with each epoch's steps replayed from a GraphStep.

    feed: where the batches come from (fast/feeds.py); warmup: eager steps before capture
    (DDP needs 11: its first iterations log and sync); convert_layout, stream: see GraphStep.
    """

    def __init__(
        self,
        strategy,
        workload,
        model,
        plan,
        timer,
        history,
        *,
        feed: Feed,
        warmup: int = 3,
        convert_layout: bool = True,
        stream: torch.cuda.Stream | None = None,
    ) -> None:
        super().__init__(strategy, workload, model, plan, timer, history)
        self.feed, self.warmup, self.convert_layout = feed, warmup, convert_layout
        self.stream = stream  # GraphStep's
        self.graph: GraphStep | None = None  # captured in the first epoch, after any --resume

    def _setup(self) -> None:
        device = self.strategy.device
        with self.timer.phase("h2d"):
            x, y, prepare = self.feed.resident(device)
        with self.timer.phase("capture"):
            self.graph = GraphStep(
                self.model,
                self.opt,
                prepare,
                self.plan.loss,
                (x, y),
                self.feed.batch,
                self.strategy.precision.autocast,
                warmup=self.warmup,
                convert_layout=self.convert_layout,
                stream=self.stream,
            )

    def _epoch(self) -> tuple[float, dict[str, float]]:
        self.sync()
        start, self.excluded, self.full_items = time.perf_counter(), 0.0, 0
        if self.graph is None:  # data upload and capture count in the first epoch
            self._setup()
        steps = self.feed.steps(self.pos.epoch, self.pos.step, self.strategy.device)
        with self.timer.phase("compute"):  # one phase: a phase per step would sync per step
            for idx in steps:
                items = len(idx) * self.feed.world
                self._before_step(items)
                loss = self.graph.step(idx)  # summed loss of this rank's items
                self.pos.loss_sum += loss
                self.pos.items += items
                self.pos.step += 1
                self.history.steps += 1
                self.trained += items
                self._after_step(loss, Step(Inputs(idx), items, 1.0))
                if self.finished:
                    break
        self.sync()
        return time.perf_counter() - start - self.excluded, self.timer.lap()


def step_unsupported(strategy: TrainHost, opt: torch.optim.Optimizer) -> str | None:
    """Why no captured step can run here (device, optimizer, precision), or None."""
    if strategy.device.type != "cuda":
        return f"on {strategy.device.type}: CUDA graphs unavailable (no CUDA GPU)"
    if not isinstance(opt, torch.optim.SGD) or any(
        g["dampening"] != 0 or g["nesterov"] for g in opt.param_groups
    ):
        return f"optimizer {type(opt).__name__} state cannot be reset after capture"
    if strategy.precision.autocast is torch.float16:
        return "fp16 needs a gradient scaler; use --dtype bf16"
    return None


def unsupported(
    strategy: TrainHost, opt: torch.optim.Optimizer, plan: TrainPlan, own_hooks: str | None
) -> str | None:
    """Why the captured step cannot stand in for the one-process train_step here, or None.
    own_hooks: the strategy's reason (it reduces gradients or draws batches its own way)."""
    reason = step_unsupported(strategy, opt)
    if reason is not None:
        return reason
    if own_hooks is not None:
        return own_hooks
    if type(plan.source) is not GlobalBatches:
        return f"strategy {strategy.name} draws its batches its own way"
    return None


def fast_trainer(
    strategy: TrainHost, reason: str | None, feed: Feed, what: str = "step", **graph
) -> Callable[..., Trainer] | None:
    """A FastTrainer bound to feed (graph: GraphStep options), for train_epochs/run_training's
    make_trainer; or None, after one line saying why the plain training loop runs instead."""
    from scalelab.fast import stderr_log

    log = stderr_log(strategy.cfg.quiet or not strategy.is_root)
    if reason is not None:
        log(f"fast training {reason}; running the plain training loop")
        return None
    log(f"fast training: data resident on {strategy.device}, {what} captured as a CUDA graph")
    return functools.partial(FastTrainer, feed=feed, **graph)


def local_fast_trainer(
    strategy: TrainHost,
    workload: Workload,
    plan: TrainPlan,
    train: Inputs,
    own_hooks: str | None = None,
) -> Callable[..., Trainer] | None:
    """One process: same batches (batch_order), loss, optimizer, checkpoints and guards as the
    plain loop; the data upload and graph capture are charged to the first epoch's lap."""
    cfg = strategy.cfg
    reason = unsupported(strategy, workload.optimizer(plan.module), plan, own_hooks)
    return fast_trainer(strategy, reason, GlobalFeed(train, cfg.batch, cfg.seed, plan.prepare))
