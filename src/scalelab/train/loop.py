"""The training loop every torch strategy shares; strategies plug in where data and gradients
move (shard, reduce_gradients), so one process and N ranks train the same way."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
from torch import nn

from scalelab.instrument.progress import Progress
from scalelab.instrument.timer import PhaseTimer, Timings
from scalelab.workloads.base import Inputs, Workload

if TYPE_CHECKING:
    from scalelab.strategies.base import TrainHistory
    from scalelab.strategies.torch_base import TorchStrategy


def batch_order(n: int, epoch: int, seed: int) -> torch.Tensor:
    """The shuffled item order of one epoch, identical for every strategy and rank count."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))


def batch_slices(n: int, batch: int) -> list[slice]:
    """Consecutive batches of the epoch; the last one may be short (kept, not dropped)."""
    return [slice(start, min(start + batch, n)) for start in range(0, n, batch)]


def total_steps(n: int, batch: int, epochs: int, limit: int | None) -> int:
    steps = epochs * len(batch_slices(n, batch))
    return steps if limit is None else min(steps, limit)


def train_step(
    strategy: TorchStrategy,
    workload: Workload,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    batch: Inputs,
    timer: PhaseTimer,
) -> torch.Tensor:
    """One optimizer step on this rank's share of a global batch; returns the summed loss
    (loss * local items, detached) so epoch means weigh short batches correctly."""
    local = strategy.shard(batch)
    weight = len(local) / len(batch)  # this rank's share of the global mean loss
    with timer.phase("h2d"):
        x, y = strategy.to_device(local.x), strategy.to_device(local.y)
    with timer.phase("compute"):
        with timer.phase("forward"), strategy.autocast():
            loss = workload.loss(model, model(workload.prepare(x)), y)
        with timer.phase("backward"):
            (loss * weight).backward()
        strategy.reduce_gradients(model, timer)
        with timer.phase("step"):
            opt.step()
            opt.zero_grad(set_to_none=True)
    return loss.detach() * len(local)


@torch.no_grad()
def evaluate(
    strategy: TorchStrategy, workload: Workload, model: nn.Module, data: Inputs, batch: int
) -> float:
    """Held-out accuracy (fraction of items whose arg-max class is the label)."""
    model.eval()
    correct = 0
    for part in batch_slices(len(data), batch):
        x = strategy.to_device(data.x[part])
        with strategy.autocast():
            pred = model(workload.prepare(x)).argmax(dim=1).cpu()
        correct += int((pred == data.y[part]).sum())
    model.train()
    return correct / max(len(data), 1)


def train_epochs(
    strategy: TorchStrategy,
    workload: Workload,
    model: nn.Module,
    train: Inputs,
    heldout: Inputs,
    timer: PhaseTimer,
    history: TrainHistory,
) -> Timings:
    """Train for cfg.epochs (or cfg.steps); one timing lap per epoch, evaluation untimed."""
    cfg = strategy.cfg
    opt = workload.optimizer(model)
    n_steps = total_steps(len(train), cfg.batch, cfg.epochs, cfg.steps)
    progress = Progress(n_steps, "train", enabled=strategy.is_root and not cfg.quiet)
    timings = Timings()
    model.train()
    for epoch in range(cfg.epochs):
        order = batch_order(len(train), epoch, cfg.seed)
        loss_sum, items = torch.zeros((), dtype=torch.float64, device=strategy.device), 0
        timer.sync()
        start = time.perf_counter()
        for part in batch_slices(len(train), cfg.batch):
            idx = order[part]
            loss_sum += train_step(
                strategy, workload, model, opt, Inputs(train.x[idx], train.y[idx]), timer
            )
            items += len(idx)
            history.steps += 1
            progress.update(history.steps)
            if history.steps >= n_steps:
                break
        timer.sync()
        timings.add(time.perf_counter() - start, timer.lap())
        history.items += items
        history.loss.append(strategy.all_sum(float(loss_sum)) / items)
        history.accuracy.append(evaluate(strategy, workload, model, heldout, max(cfg.batch, 500)))
        progress.milestone(
            history.steps, epoch=epoch + 1, loss=history.loss[-1], heldout_acc=history.accuracy[-1]
        )
        if history.steps >= n_steps:
            break
    model.eval()
    return timings
