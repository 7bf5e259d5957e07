"""`serial`: the NumPy float64 reference path, one process, one BLAS thread (the seed's V1).

It is both the slowest baseline every speedup is measured against and the oracle itself run
as a strategy: its output is the float64 reference by construction.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import numpy as np
import torch
from torch import nn

from scalelab.errors import UsageError
from scalelab.instrument import threads
from scalelab.instrument.timer import PhaseTimer, timed_iterations
from scalelab.precision import get_precision
from scalelab.results import RunOutput
from scalelab.strategies.base import STRATEGIES, Strategy
from scalelab.train.loop import GlobalBatches, TrainPlan, TrainStep, require_labels, run_training
from scalelab.train.sources import Step
from scalelab.workloads.base import WORKLOADS, Inputs, Workload, state_dict_float64


def single_blas_thread() -> AbstractContextManager:
    """Pin NumPy's BLAS to one thread where threadpoolctl can reach it."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # optional: the run still works, on however many threads BLAS uses
        return nullcontext()
    return threadpool_limits(limits=1)


@STRATEGIES.register("serial", "NumPy float64 reference, one process, one thread (seed V1)")
class SerialStrategy(Strategy):
    name = "serial"
    device = torch.device("cpu")
    reads = ("checkpoint",)  # the one training loop checkpoints its NumPy step too
    reference = True

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.precision = get_precision("fp64")  # the oracle computes in float64, whatever asked
        self.timer = PhaseTimer()
        self.thread_choice = threads.blas()  # the record's `threads`, like the torch runs'

    def validate(self, workload: Workload) -> None:
        if not workload.has_reference():
            have = ", ".join(n for n in WORKLOADS.names() if WORKLOADS.get(n).has_reference())
            raise UsageError(
                f"strategy serial needs a NumPy reference, which {workload.name} "
                f"lacks (workloads with one: {have})"
            )
        if self.cfg.device != "cpu":
            raise UsageError("strategy serial runs on the CPU only; drop --device")

    def infer(self, workload: Workload, model: nn.Module, inputs: Inputs | None) -> RunOutput:
        assert inputs is not None
        params, x = state_dict_float64(model), inputs.x.numpy()

        def step() -> np.ndarray:
            with self.timer.phase("compute"):
                return workload.reference_forward(params, x)

        with single_blas_thread():
            timings, out = timed_iterations(step, self.timer, self.cfg.warmup, self.cfg.iters)
        return RunOutput(timings, [timings.iteration_phases()], np.asarray(out), len(inputs))

    def train(
        self, workload: Workload, model: nn.Module, data: tuple[Inputs, Inputs] | None
    ) -> RunOutput:
        """The shared Trainer (the same batches in the same order as the torch strategies;
        checkpoints, --resume, the NaN stop) with the float64 NumPy SGD step."""
        assert data is not None
        train, heldout = data
        require_labels(train, heldout)
        step = ReferenceStep(self, workload, state_dict_float64(model))
        plan = TrainPlan(
            source=GlobalBatches(self, train, self.cfg.batch, self.cfg.seed),
            evaluate=lambda _: reference_accuracy(workload, step.params, heldout),
            module=model,
            prepare=workload.prepare,
            loss=workload.loss,
            n_train=len(train),
        )
        with single_blas_thread():
            out = run_training(self, workload, model, plan, step=step)
        model.load_state_dict({k: torch.from_numpy(v) for k, v in step.params.items()})
        out.model = model
        return out

    # --- what the shared training loop asks of a strategy ----------------------------------
    def shard(self, batch: Inputs) -> Inputs:
        return batch

    def all_sum(self, value: float) -> float:
        return value


class ReferenceStep(TrainStep):
    """One float64 SGD step by the workload's hand-derived NumPy backward. The state is the
    float64 parameters themselves (plain SGD: no optimizer buffers)."""

    def __init__(self, strategy: SerialStrategy, workload: Workload, params: dict) -> None:
        self.timer, self.workload, self.params = strategy.timer, workload, params

    def __call__(self, step: Step) -> torch.Tensor:
        local = step.local
        with self.timer.phase("compute"):
            loss = self.workload.reference_train_step(self.params, local.x.numpy(), local.y.numpy())
        return torch.tensor(loss * len(local), dtype=torch.float64)

    def weights(self) -> list[torch.Tensor]:
        return [torch.from_numpy(v) for v in self.params.values()]

    def export_state(self) -> tuple[dict, dict]:
        model = {k: torch.from_numpy(v.copy()) for k, v in self.params.items()}
        return model, {"state": {}, "param_groups": []}

    def import_state(self, model: dict, optimizer: dict) -> None:
        self.params.update({k: v.double().numpy().copy() for k, v in model.items()})


def reference_accuracy(workload: Workload, params: dict[str, np.ndarray], data: Inputs) -> float:
    logits = workload.reference_forward(params, data.x.numpy())
    return float((logits.argmax(axis=1) == data.y.numpy()).mean())
