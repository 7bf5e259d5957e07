"""The pluggable step of the training loop (train/loop.py's Trainer): one optimizer step on
this rank's share of a batch, returning the summed loss, and the training state that step
keeps (weights, optimizer buffers) for checkpoints. `TorchStep` is torch's autograd step, the
default; serial plugs in the float64 NumPy SGD (strategies/serial.py), the pipelines their
schedule's step (strategies/pipeline/schedule_step.py, torch_engine.py)."""

from __future__ import annotations

import sys
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from scalelab.instrument.timer import PhaseTimer
from scalelab.train.sources import Step
from scalelab.workloads.base import Workload

if TYPE_CHECKING:
    from scalelab.train.host import TrainHost
    from scalelab.train.train_plan import TrainPlan


def grad_scaler(strategy: TrainHost) -> torch.amp.GradScaler:
    """fp16 autocast on CUDA needs loss scaling; everywhere else the scaler is a no-op."""
    fp16 = strategy.precision.autocast is torch.float16 and strategy.device.type == "cuda"
    return torch.amp.GradScaler(strategy.device.type, enabled=fp16)


def train_step(
    strategy: TrainHost,
    plan: TrainPlan,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    step: Step,
    timer: PhaseTimer,
    scaler: torch.amp.GradScaler,
) -> torch.Tensor:
    """One optimizer step on this rank's share; returns the summed loss (loss * local items,
    detached, on the device) so epoch means weigh short batches correctly."""
    local = step.local
    with timer.phase("h2d"):
        x, y = strategy.to_device(local.x), strategy.to_device(local.y)
    with timer.phase("compute"):
        if len(local) == 0:  # a short last batch left this rank nothing; it still reduces
            loss = _zero_grads(model)
        else:
            with timer.phase("forward"), strategy.autocast():
                loss = plan.loss(model, model(plan.prepare(x)), y)
            with timer.phase("backward"):
                scaler.scale(loss if step.weight == 1.0 else loss * step.weight).backward()
        strategy.reduce_gradients(model, timer)
        with timer.phase("step"):
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
    return loss.detach() * len(local)


class TrainStep(ABC):
    """The pluggable step: one optimizer step on this rank's share of a batch, and the state
    that step keeps (weights, optimizer buffers) for checkpoints. The Trainer runs the epochs,
    guards, checkpoints, resume and progress around any of them: torch's autograd step
    (TorchStep), the float64 NumPy reference (serial), a pipeline schedule's step.

    loss_here: whether this rank's returned loss is the step's (a pipeline's lives on the
    last stage; the progress line on rank 0 then leaves the loss out)."""

    loss_here: bool = True

    @abstractmethod
    def __call__(self, step: Step) -> torch.Tensor:
        """The summed loss (loss * local items, detached, float64-able, on the device)."""

    @abstractmethod
    def weights(self) -> list[torch.Tensor]:
        """This rank's trained tensors (the NaN guard checks them before a checkpoint)."""

    @abstractmethod
    def export_state(self) -> tuple[dict, dict] | None:
        """(model state_dict as one process holds it, optimizer state) on the root; None
        elsewhere. Collective."""

    @abstractmethod
    def import_state(self, model: dict, optimizer: dict) -> None:
        """Load a checkpoint's state; this run's hyperparameters (--lr, ...) win."""

    def scaler_state(self) -> dict:
        return {}

    def load_scaler(self, state: dict) -> None:
        """Loss-scaler state (fp16 on CUDA only)."""

    def lap(self, timer: PhaseTimer) -> dict[str, float]:
        """The phases of the epoch just ended (a step that laps per step overrides this)."""
        return timer.lap()


def single_tensor_if_mixed(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer with torch's foreach kernels off where its parameters mix DTensor
    shards and plain tensors (tensor parallelism: replicated embeddings, norms and heads beside
    sharded Linears). On CUDA torch picks foreach by default and it refuses the mix ("got mixed
    torch.Tensor and DTensor", seen on 2x H200 training the GPT under tensor parallelism); the
    single-tensor loop computes the same update, tensor by tensor. CPU runs never took foreach.
    A process that never imported DTensor holds none (importing it only to ask costs ~1 s)."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is None:
        return opt
    kinds = {isinstance(p, dtensor.DTensor) for g in opt.param_groups for p in g["params"]}
    if len(kinds) > 1:
        for group in opt.param_groups:
            group["foreach"] = False
    return opt


class TorchStep(TrainStep):
    """One autograd step: forward, backward, the strategy's gradient reduction, the optimizer."""

    def __init__(
        self, strategy: TrainHost, workload: Workload, model: nn.Module, plan: TrainPlan
    ) -> None:
        self.strategy, self.model, self.plan, self.timer = strategy, model, plan, strategy.timer
        self.opt = single_tensor_if_mixed(workload.optimizer(model))
        self.stepper: Any = self.opt  # what steps it (fsdp: the optimizer on local shards)
        self.scaler = grad_scaler(strategy)

    def __call__(self, step: Step) -> torch.Tensor:
        return train_step(
            self.strategy, self.plan, self.model, self.stepper, step, self.timer, self.scaler
        )

    def weights(self) -> list[torch.Tensor]:
        return [p.detach() for p in self.model.parameters()]

    def export_state(self) -> tuple[dict, dict] | None:
        if self.plan.export_state is not None:
            return self.plan.export_state(self.model, self.opt)
        if not self.strategy.is_root:
            return None
        return self.plan.module.state_dict(), self.opt.state_dict()

    def import_state(self, model: dict, optimizer: dict) -> None:
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in self.opt.param_groups]
        if self.plan.import_state is not None:
            self.plan.import_state(self.model, self.opt, model, optimizer)
        else:
            self.plan.module.load_state_dict(model)
            self.opt.load_state_dict(optimizer)
        for group, h in zip(self.opt.param_groups, hyper):
            group.update(h)

    def scaler_state(self) -> dict:
        return self.scaler.state_dict()

    def load_scaler(self, state: dict) -> None:
        if self.scaler.is_enabled() and state:
            self.scaler.load_state_dict(state)


def _zero_grads(model: nn.Module) -> torch.Tensor:
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    return torch.zeros((), device=next(model.parameters()).device)
