"""`serial`: the NumPy float64 reference path, one process, one BLAS thread (the seed's V1).

It is both the slowest baseline every speedup is measured against and the oracle itself run
as a strategy: its output is the float64 reference by construction.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager, nullcontext

import numpy as np
import torch
from torch import nn

from scalelab.errors import UsageError
from scalelab.instrument.progress import Progress
from scalelab.instrument.timer import PhaseTimer, Timings, timed_iterations
from scalelab.precision import get_precision
from scalelab.strategies.base import STRATEGIES, RunOutput, Strategy, TrainHistory
from scalelab.train.loop import batch_order, batch_slices, total_steps
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
    reads = ()  # its NumPy loop has no checkpoints yet (issue 20's one loop gives it them)

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.precision = get_precision("fp64")  # the oracle computes in float64, whatever asked
        self.timer = PhaseTimer()

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
        assert data is not None
        train, heldout = data
        params = state_dict_float64(model)
        history = TrainHistory()
        with single_blas_thread():
            timings = self._train_epochs(workload, params, train, heldout, history)
        model.load_state_dict({k: torch.from_numpy(v) for k, v in params.items()})
        items = round(history.items / max(len(timings.walls), 1))
        return RunOutput(
            timings, [timings.phase_totals()], None, items, history=history, model=model
        )

    def _train_epochs(
        self,
        workload: Workload,
        params: dict[str, np.ndarray],
        train: Inputs,
        heldout: Inputs,
        history: TrainHistory,
    ) -> Timings:
        """The same batches in the same order as the torch loop, in float64 NumPy."""
        cfg = self.cfg
        n_steps = total_steps(len(train), cfg.batch, cfg.epochs, cfg.steps)
        progress = Progress(n_steps, "train (serial)", enabled=not cfg.quiet)
        timings = Timings()
        for epoch in range(cfg.epochs):
            order, loss_sum, items = batch_order(len(train), epoch, cfg.seed).numpy(), 0.0, 0
            start = time.perf_counter()
            for part in batch_slices(len(train), cfg.batch):
                idx = order[part]
                with self.timer.phase("compute"):
                    loss = workload.reference_train_step(
                        params, train.x[idx].numpy(), train.y[idx].numpy()
                    )
                loss_sum, items = loss_sum + loss * len(idx), items + len(idx)
                history.steps += 1
                progress.update(history.steps)
                if history.steps >= n_steps:
                    break
            timings.add(time.perf_counter() - start, self.timer.lap())
            history.end_epoch(
                items, loss_sum / items, reference_accuracy(workload, params, heldout), progress
            )
            if history.steps >= n_steps:
                break
        return timings


def reference_accuracy(workload: Workload, params: dict[str, np.ndarray], data: Inputs) -> float:
    logits = workload.reference_forward(params, data.x.numpy())
    return float((logits.argmax(axis=1) == data.y.numpy()).mean())
