"""The training loop every torch strategy shares; strategies plug in where data and gradients
move, so one process and N ranks train the same way.

A strategy customises the hooks on itself (`shard`, `reduce_gradients`, `all_sum`) and, where
its data path differs from the one-process order, a `TrainPlan`: where each step's batch comes
from (a `BatchSource`), how held-out accuracy is measured, and how the whole training state is
exported for a checkpoint. Around the steps the loop adds what users expect of a trainer:
`--resume`, a checkpoint every `--ckpt-every` steps and at the end (rank 0, atomic), a NaN/inf
stop that names the step, and a progress line on rank 0 with loss, items/s and ETA. None of
these syncs the device per step: losses stay on the device until an epoch ends, a checkpoint
is due or the NaN guard's buffer is full.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from scalelab.errors import UsageError
from scalelab.instrument import threads
from scalelab.instrument.progress import Progress
from scalelab.instrument.timer import PhaseTimer, Timings, device_sync, notify_step
from scalelab.results import RunOutput, TrainHistory
from scalelab.train import checkpoint as ckpt
from scalelab.train.guards import NonFiniteGuard, TrainingDiverged, all_finite
from scalelab.train.sources import (  # noqa: F401  (batch_order: re-exported, as before)
    BatchSource,
    GlobalBatches,
    Step,
    batch_order,
    batch_slices,
)
from scalelab.train.steps import TorchStep, TrainStep, grad_scaler, train_step  # noqa: F401
from scalelab.train.train_plan import (  # noqa: F401  (re-exported: the strategies' import)
    Position,
    StateExport,
    StateImport,
    TrainPlan,
)
from scalelab.workloads import next_token
from scalelab.workloads.base import Inputs, Workload

if TYPE_CHECKING:
    from scalelab.train.host import TrainHost


def total_steps(n: int, batch: int, epochs: int, limit: int | None) -> int:
    steps = epochs * len(batch_slices(n, batch))
    return steps if limit is None else min(steps, limit)


def require_labels(train: Inputs | None, heldout: Inputs | None) -> None:
    for name, data in (("training", train), ("held-out", heldout)):
        if data is not None and data.y is None:
            raise UsageError(f"the {name} data has no labels; training needs labelled data")


def default_plan(
    strategy: TrainHost, workload: Workload, model: nn.Module, train: Inputs, heldout: Inputs
) -> TrainPlan:
    cfg = strategy.cfg
    require_labels(train, heldout)
    size = eval_batch(workload, cfg.batch)
    return TrainPlan(
        source=GlobalBatches(strategy, train, cfg.batch, cfg.seed),
        evaluate=lambda m: evaluate(strategy, workload, m, heldout, size),
        module=model,
        prepare=workload.prepare,
        loss=workload.loss,
        n_train=len(train),
    )


EVAL_ITEMS = 512  # held-out items one forward scores, at most
# Output elements one held-out forward may produce (2 GiB of fp32 logits): a language model's
# (N, T, V) logits are T x V an item, 206 MB at GPT-2's 1024 x 50304, so 500 items were 96 GiB.
EVAL_OUTPUT = 2**29


def eval_batch(workload: Workload, batch: int) -> int:
    """Held-out items per forward: EVAL_ITEMS, fewer where their outputs would pass
    EVAL_OUTPUT elements, never fewer than the training batch (whose step holds its
    activations for the backward as well, so its forward alone fits)."""
    per_item = workload.num_classes or 1  # (N, K): one row an item, whatever its input
    if workload.task == next_token.TASK:  # (N, T, V)
        per_item *= workload.tokens_per_item or 1
    return max(batch, min(EVAL_ITEMS, EVAL_OUTPUT // per_item))


def evaluate(
    strategy: TrainHost, workload: Workload, model: nn.Module, data: Inputs, batch: int
) -> float:
    """The held-out figure: accuracy (fraction of items whose arg-max class is the label), or
    a next-token model's mean loss (Workload.score)."""
    return heldout_sum(strategy, workload, model, data, batch) / max(len(data), 1)


@torch.no_grad()
def heldout_sum(
    strategy: TrainHost, workload: Workload, model: nn.Module, data: Inputs, batch: int
) -> float:
    """Workload.score summed over data's items, batch by batch."""
    model.eval()
    total = 0.0
    for part in batch_slices(len(data), batch):
        x = strategy.to_device(data.x[part])
        with strategy.autocast():
            logits = model(workload.prepare(x))
        total += workload.score(logits, data.y[part])
    model.train()
    return total


# --- the run -----------------------------------------------------------------------------------
class TrainProgress:
    """Rank 0's live line (steps, loss, items/s, ETA), refreshed at most every 0.5 s on a
    terminal; off a terminal (a log, a pipe), a line whenever SLOW_S passed since the last,
    so a run of slow steps (a CPU pipeline) is never silent for long. The loss is read from
    the device only when a line is drawn."""

    SLOW_S = 5.0

    def __init__(self, total: int, item: str, enabled: bool) -> None:
        self.bar = Progress(total, "train", enabled=enabled)
        self.enabled = enabled
        self.live = enabled and self.bar.tty
        self.item = item
        self._t, self._items = time.perf_counter(), 0

    def step(self, done: int, loss_sum: torch.Tensor | None, n_local: int, items: int) -> None:
        """loss_sum: this rank's summed step loss, or None where the loss lives elsewhere."""
        now = time.perf_counter()
        if not self.enabled:
            return
        if self.live and now - self._t < 0.5 and done < self.bar.total:
            return
        if not self.live and now - self._t < self.SLOW_S:
            return
        rate = (items - self._items) / max(now - self._t, 1e-9)
        self._t, self._items = now, items
        fields = {f"{self.item}_per_s": rate}
        if loss_sum is not None:
            fields = {"loss": float(loss_sum) / max(n_local, 1), **fields}
        (self.bar.update if self.live else self.bar.milestone)(done, **fields)

    def milestone(self, done: int, **fields: float) -> None:
        self.bar.milestone(done, **fields)


class Trainer:
    """One rank's training run: steps, epochs, guards, checkpoints and resume."""

    def __init__(
        self,
        strategy: TrainHost,
        workload: Workload,
        model: nn.Module,
        plan: TrainPlan,
        timer: PhaseTimer,
        history: TrainHistory,
        step: TrainStep | None = None,
    ) -> None:
        self.strategy, self.cfg, self.model, self.plan = strategy, strategy.cfg, model, plan
        self.timer, self.history, self.workload = timer, history, workload
        self.stepper = step if step is not None else TorchStep(strategy, workload, model, plan)
        self.pos = Position(loss_sum=torch.zeros((), device=strategy.device, dtype=torch.float64))
        self.guard = NonFiniteGuard(strategy.device)
        self.saver = ckpt.Checkpointer.for_run(self.cfg, strategy.is_root)
        self.sync = device_sync(strategy.device)
        per_epoch = plan.source.steps_per_epoch()
        self.n_steps = self.cfg.epochs * per_epoch
        if self.cfg.steps is not None:
            self.n_steps = min(self.n_steps, self.cfg.steps)
        self.trained = 0  # items trained by this process (throughput excludes resumed work)
        self.excluded = 0.0  # seconds inside an epoch spent on checkpoints, not training
        self.full_items = 0  # items of this epoch's largest step so far (_before_step)
        self.first_step = 0  # history.steps when this process started (resume)
        self.progress = self._progress()

    @property
    def opt(self) -> torch.optim.Optimizer:
        """The torch step's optimizer (--fast captures it into its graph)."""
        return self.stepper.opt

    def _progress(self) -> TrainProgress:
        enabled = self.strategy.is_root and not self.cfg.quiet
        return TrainProgress(self.n_steps - self.first_step, self.workload.item, enabled)

    @property
    def finished(self) -> bool:
        return self.history.steps >= self.n_steps

    def run(self) -> Timings:
        if self.cfg.resume is not None:
            self._resume()
            self.first_step = self.history.steps
            self.progress = self._progress()
        timings = self.timings = Timings()
        self.model.train()
        self.trained_s = 0.0  # training seconds of the finished epochs
        # Every rank starts the clock together: a rank that started late (importing, reading
        # its data) was charged to the others' first collective (a loaded host: rank 0's scatter
        # 0.717 s of a 0.858 s one-epoch mpi-dp run), never to the steps.
        self.strategy.comm.barrier()
        while self.pos.epoch < self.cfg.epochs and not self.finished:
            self.epoch_t0 = time.perf_counter()
            wall, lap = self._epoch()
            timings.add(wall, lap, getattr(self.timer, "last_device_lap", None))
            self.trained_s += wall
            self._end_epoch()
        self.model.eval()
        return timings

    def _mark(self) -> None:
        """(training seconds, items) at a step's end: host clock, no device sync (a GPU step
        may still run; the epoch's closing sync bounds that)."""
        now = time.perf_counter() - self.epoch_t0 - self.excluded
        self.timings.marks.append((self.trained_s + now, self.trained))

    def _before_step(self, items: int) -> None:
        """Before a partial batch that follows full ones in this epoch: the last step's mark
        taken again after a device sync. train/headline.py leaves the partial step out of the
        steady rate, so the full steps' queued GPU work must end inside their own window (a
        CUDA graph's replays queue in ~0.1 ms each; the partial step's wall absorbed them)."""
        if 0 < items < self.full_items:
            self.sync()
            self.timings.marks.pop()
            self._mark()
        self.full_items = max(self.full_items, items)

    def _epoch(self) -> tuple[float, dict[str, float]]:
        self.sync()
        start, self.excluded, self.full_items = time.perf_counter(), 0.0, 0
        for step in self.plan.source.epoch(self.pos.epoch, self.pos.step):
            self._before_step(step.items)
            loss = self.train_step(step)
            self.pos.loss_sum += loss
            self.pos.items += step.items
            self.pos.step += 1
            self.history.steps += 1
            self.trained += step.items
            self._after_step(loss, step)
            if self.finished:
                break
        self.sync()
        return time.perf_counter() - start - self.excluded, self.stepper.lap(self.timer)

    def train_step(self, step: Step) -> torch.Tensor:
        """One optimizer step, by the pluggable step (tests stop a run here)."""
        return self.stepper(step)

    def _mark_step(self) -> None:
        """The step's mark; at step --warmup, the steady window's earliest start (headline.py),
        taken after the device's queue drained, as a plain loop syncs before it starts its
        timer (a GPU-bound step queued a step ahead put ~3% of ddp's 30-step window before
        it)."""
        if len(self.timings.marks) + 1 == self.cfg.warmup:
            self.sync()
        self._mark()

    def _after_step(self, loss: torch.Tensor, step: Step) -> None:
        self._mark_step()
        notify_step()
        done = self.history.steps
        self.guard.observe(loss, done)
        shown = loss if self.stepper.loss_here else None
        self.progress.step(done - self.first_step, shown, len(step.local), self.trained)
        if self.saver.due(done, last=self.finished):
            self._checkpoint()
        elif self.guard.full():
            self._check_finite()

    def _end_epoch(self) -> None:
        self._check_finite()
        hist = self.history
        hist.items = self.trained
        hist.loss.append(self.strategy.all_sum(float(self.pos.loss_sum)) / max(self.pos.items, 1))
        hist.accuracy.append(self.plan.evaluate(self.model))
        if self.plan.epoch_end is not None:
            self.plan.epoch_end(self.pos.epoch, self.model)
        held = "heldout_loss" if self.workload.task == "next-token" else "heldout_acc"
        self.progress.milestone(
            hist.steps - self.first_step,
            epoch=self.pos.epoch + 1,
            loss=hist.loss[-1],
            **{held: hist.accuracy[-1]},
        )
        self.pos = Position(self.pos.epoch + 1, 0, self.pos.loss_sum.zero_(), 0)

    # --- guards and checkpoints ------------------------------------------------------------
    def _check_finite(self) -> None:
        bad = self.guard.check(self.strategy.comm)
        if bad is not None:
            where = self.saver.path if self.saver.written else None
            raise TrainingDiverged.at(bad, self.history.steps, where)

    def _checkpoint(self) -> None:
        start = time.perf_counter()
        self._check_finite()
        if not all_finite(self.stepper.weights(), self.strategy.comm):
            where = self.saver.path if self.saver.written else None
            raise TrainingDiverged.weights(self.history.steps, where)
        state = ckpt.export_training_state(self)
        if state is not None:
            self.saver.save(state)
            if not self.cfg.quiet:
                print(
                    f"checkpoint: step {self.history.steps} -> {self.saver.path}", file=sys.stderr
                )
        self.excluded += time.perf_counter() - start

    def _resume_threads(self, state: dict) -> None:
        """A CPU resume on as many ranks without --threads takes the checkpoint's thread count:
        the count this host's load would pick now may sum the steps in another order, and the
        resumed run would leave the uninterrupted one's bits. Another rank count cannot repeat
        them anyway and keeps its own choice."""
        n, s = state.get("threads"), self.strategy
        if (
            self.cfg.threads is not None
            or not isinstance(n, int)
            or n < 1
            or getattr(s, "thread_choice", None) is None  # a torch strategy's choice
            or getattr(s, "reference", False)  # serial: NumPy's BLAS, not torch's threads
            or s.device.type != "cpu"
            or state["world_size"] != s.comm.size
        ):
            return
        torch.set_num_threads(n)  # TorchStrategy.close() puts the process's count back
        s.thread_choice = threads.from_checkpoint(n)

    def _resume(self) -> None:
        state = ckpt.load_checkpoint(self.cfg.resume)
        skip = ckpt.check_resume(state, self)
        self._resume_threads(state)
        ckpt.import_training_state(self, state, skip)
        if self.finished:
            raise UsageError(
                f"--resume {self.cfg.resume}: the checkpoint is at step {self.history.steps}, "
                f"the end of this run's {self.n_steps} steps; raise --epochs or --steps"
            )
        per_epoch = self.plan.source.steps_per_epoch()
        if self.pos.step > per_epoch:  # a position no run of this schedule reaches
            raise UsageError(
                f"--resume {self.cfg.resume}: a scalelab checkpoint with wrong contents: "
                f"{self.pos.items} items into an epoch of {per_epoch} steps"
            )
        if self.pos.epoch >= self.cfg.epochs:  # else no step runs and nothing is recorded
            raise UsageError(
                f"--resume {self.cfg.resume}: the checkpoint is in epoch {self.pos.epoch + 1}, "
                f"past the end of this run's {self.cfg.epochs} epoch(s); raise --epochs"
            )


def run_training(
    strategy: TrainHost,
    workload: Workload,
    model: nn.Module,
    plan: TrainPlan,
    result_model: nn.Module | None = None,
    make_trainer: Callable[..., Trainer] | None = None,
    step: TrainStep | None = None,
) -> RunOutput:
    """Train with plan and package the run for the runner (phases gathered on the root).
    make_trainer: a Trainer subclass (or partial) that runs the steps its own way (--fast);
    step: the pluggable step (None: TorchStep, torch's autograd step on model)."""
    history = TrainHistory()
    make = make_trainer or Trainer
    extra = {} if step is None else {"step": step}
    trainer = make(strategy, workload, model, plan, strategy.timer, history, **extra)
    timings = trainer.run()
    notes = {**plan.notes, "global_batch": plan.source.global_batch}
    if trainer.saver.written:
        notes["checkpoint"] = str(trainer.saver.path)
    if strategy.cfg.resume is not None:
        notes["resumed_from"] = strategy.cfg.resume
    return RunOutput(
        timings,
        strategy.comm.gather_object(timings.phase_totals()),
        None,
        round(history.items / max(len(timings.walls), 1)),
        bytes_moved=strategy.timer.bytes_moved(),
        history=history,
        model=plan.module if result_model is None else result_model,
        notes=notes,
    )


def train_epochs(
    strategy: TrainHost,
    workload: Workload,
    model: nn.Module,
    train: Inputs,
    heldout: Inputs,
    timer: PhaseTimer,
    history: TrainHistory,
    plan: TrainPlan | None = None,
    make_trainer: Callable[..., Trainer] | None = None,
) -> Timings:
    """Train for cfg.epochs (or cfg.steps); one timing lap per epoch, evaluation untimed.
    make_trainer: as in run_training (--fast)."""
    plan = plan or default_plan(strategy, workload, model, train, heldout)
    return (make_trainer or Trainer)(strategy, workload, model, plan, timer, history).run()
