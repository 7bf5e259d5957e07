"""What every torch-executing strategy shares: device placement, precision, the timed
inference step and the training loop. Distributed strategies override the hooks where data
and gradients cross ranks (shard, reduce_gradients, all_sum) and nothing else."""

from __future__ import annotations

import os
from contextlib import AbstractContextManager, nullcontext

import numpy as np
import torch
from torch import nn

from scalelab.errors import UsageError
from scalelab.instrument import host_checks, threads
from scalelab.instrument.timer import PhaseTimer, device_sync, timed_iterations
from scalelab.precision import get_precision
from scalelab.results import RunOutput, TrainHistory
from scalelab.strategies.base import Strategy
from scalelab.train.loop import default_plan, train_epochs
from scalelab.workloads.base import Inputs, Workload

# SCALELAB_DETERMINISTIC=1: a CUDA run repeats itself bitwise (cuDNN's algorithm chosen by
# heuristics, not timed; deterministic kernels where torch has them, a warning where not).
# Two eager ResNet-18 DDP runs otherwise end 6 steps apart by a third of their update.
DETERMINISTIC_ENV = "SCALELAB_DETERMINISTIC"


def set_deterministic(mode: bool, warn_only: bool) -> None:
    """torch.use_deterministic_algorithms, called only where the setting changes: the call
    imports torch._inductor (to set its config too), and with it dynamo and sympy, 2.6 s of CPU
    on a 2-core host, which every rank paid at close to put back the setting it never changed."""
    now = (torch.are_deterministic_algorithms_enabled(),
           torch.is_deterministic_algorithms_warn_only_enabled())  # fmt: skip
    if now != (mode, warn_only):
        torch.use_deterministic_algorithms(mode, warn_only=warn_only)


def resolve_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA GPU is visible to torch on this machine")
    return torch.device(name)


class TorchStrategy(Strategy):
    """Runs the torch model on one device per process."""

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        if cfg.amp is not None:  # --amp bf16: fp32 weights, bf16 autocast (as --dtype bf16)
            self.precision = get_precision(cfg.amp)
        self.device = self.pick_device()
        self.compile_notes: dict | None = None  # --compile: what was compiled (the record's)
        # Process-wide torch settings this run changes, put back by close(): a run inside a
        # longer-lived process (a test, a sweep in one interpreter) must not leave them behind.
        self._saved_threads = torch.get_num_threads()
        self._saved_backends = (
            torch.backends.cuda.matmul.allow_tf32,
            torch.backends.cudnn.allow_tf32,
            torch.backends.cudnn.benchmark,
            torch.backends.cudnn.deterministic,
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        )
        # No --threads on a CPU: the CPUs free for this run, shared by the ranks here, rather
        # than torch's one thread per core (50-200x slower on a busy 2-core host).
        self.thread_choice = threads.pick(
            cfg.threads,
            self.device.type,
            host_checks.ranks_on_host(self.comm.size),
            self._saved_threads,
        )
        if self.thread_choice.threads != self._saved_threads:
            torch.set_num_threads(self.thread_choice.threads)
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = self.precision.tf32
            torch.backends.cudnn.allow_tf32 = self.precision.tf32
            deterministic = os.environ.get(DETERMINISTIC_ENV) == "1"
            torch.backends.cudnn.benchmark = not deterministic
            if deterministic:
                os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS's rule
                torch.backends.cudnn.deterministic = True
                set_deterministic(True, warn_only=True)
        if self.precision.autocast is torch.float16 and self.device.type == "cpu" and cfg.train:
            raise UsageError("--dtype fp16 training needs a GPU (no grad scaler on CPU); use bf16")
        self.timer = PhaseTimer(device_sync(self.device), nvtx=self.device.type == "cuda")

    def pick_device(self) -> torch.device:
        return resolve_device(self.cfg.device)

    def close(self) -> None:
        torch.set_num_threads(self._saved_threads)
        (
            torch.backends.cuda.matmul.allow_tf32,
            torch.backends.cudnn.allow_tf32,
            torch.backends.cudnn.benchmark,
            torch.backends.cudnn.deterministic,
            deterministic,
            warn_only,
        ) = self._saved_backends
        set_deterministic(deterministic, warn_only)
        super().close()

    # --- hooks distributed strategies override ---------------------------------------------
    def shard(self, batch: Inputs) -> Inputs:
        """This rank's share of a global training batch."""
        return batch

    def reduce_gradients(self, model: nn.Module, timer: PhaseTimer) -> None:
        """Combine gradients across ranks (identity in one process)."""

    def all_sum(self, value: float) -> float:
        return value

    # --- helpers ---------------------------------------------------------------------------
    def autocast(self) -> AbstractContextManager:
        if self.precision.autocast is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.precision.autocast)

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cuda" and not t.is_cuda:
            return t.pin_memory().to(self.device, non_blocking=True)
        return t.to(self.device)

    def place(self, model: nn.Module) -> nn.Module:
        return model.to(device=self.device, dtype=self.precision.storage)

    def compiled(self, model: nn.Module) -> nn.Module:
        """--compile: the model compiled per block, or whole (compile_scope.py); the choice is
        kept for the record. Without --compile the model itself."""
        if not self.cfg.compile:
            return model
        from scalelab.strategies.compile_scope import compile_blocks, compile_whole

        self.compile_notes = compile_blocks(model, self.cfg.compile_backend)
        if self.compile_notes is None:
            model, self.compile_notes = compile_whole(model, backend=self.cfg.compile_backend)
        return model

    def compile_loss(self, workload: Workload) -> None:
        """--compile: the workload's loss compiled beside the model where it pays (a
        language model's cross-entropy: measured on one H200 at GPT-2 small's shape, 378 ->
        458 sequences/s and 17 -> 10.5 GB peak); said in the record's `compile`."""
        if self.cfg.compile and workload.compile_loss(self.cfg.compile_backend):
            self.compile_notes = {**(self.compile_notes or {}), "loss": "compiled"}

    def compile_record(self) -> dict:
        """The record's `compile` field: the scope chosen and the graphs dynamo built."""
        if self.compile_notes is None:
            return {}
        from scalelab.strategies.compile_scope import compiled_graphs

        return {"compile": {**self.compile_notes, "graphs": compiled_graphs()}}

    def forward(self, workload: Workload, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self.cfg.fast:
            return self.fast_forward(workload, model, x)
        with torch.inference_mode(), self.autocast():
            return model(workload.prepare(x).to(self.precision.storage))

    def fast_forward(self, workload: Workload, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """--fast: scalelab.fast's fused, graph-captured forward, built on first use."""
        from scalelab.fast import accelerate  # Triton loads only when asked for

        paths = self.__dict__.setdefault("_fast_paths", {})
        if id(model) not in paths:
            paths[id(model)] = accelerate(workload, model, self.cfg, self.device)
        return paths[id(model)](x)

    # --- the two modes ---------------------------------------------------------------------
    def infer(self, workload: Workload, model: nn.Module, inputs: Inputs | None) -> RunOutput:
        assert inputs is not None
        model = self.compiled(self.place(model))
        host_x = inputs.x.pin_memory() if self.device.type == "cuda" else inputs.x

        def step() -> torch.Tensor:
            with self.timer.phase("h2d"):
                x = host_x.to(self.device, non_blocking=True)
            with self.timer.phase("compute"):
                out = self.forward(workload, model, x)
            with self.timer.phase("d2h"):
                return out.to("cpu", torch.float64)

        timings, out = timed_iterations(step, self.timer, self.cfg.warmup, self.cfg.iters)
        return RunOutput(
            timings,
            [timings.iteration_phases()],
            np.asarray(out),
            len(inputs),
            {"h2d": inputs.x.nbytes},
            notes=self.compile_record(),
        )

    def _own_hooks(self) -> str | None:
        """Why this strategy's training step is not the one-process step --fast captures."""
        if type(self).reduce_gradients is not TorchStrategy.reduce_gradients:
            return f"strategy {self.name} reduces gradients across ranks inside the step"
        if type(self).shard is not TorchStrategy.shard:
            return f"strategy {self.name} draws its batches its own way"
        return None

    def train(
        self, workload: Workload, model: nn.Module, data: tuple[Inputs, Inputs] | None
    ) -> RunOutput:
        assert data is not None
        train, heldout = data
        model = self.place(model)
        net = self.compiled(model)  # model itself, or its whole compiled wrapper
        self.compile_loss(workload)
        history = TrainHistory()
        plan = default_plan(self, workload, model, train, heldout)
        make_trainer = None
        if self.cfg.fast:
            from scalelab.fast.captured_step import local_fast_trainer

            compiled = "with --compile (a compiled model in a captured step is not supported yet)"
            why = self._own_hooks() or (compiled if self.cfg.compile else None)
            make_trainer = local_fast_trainer(self, workload, plan, train, why)
        timings = train_epochs(
            self, workload, net, train, heldout, self.timer, history, plan, make_trainer
        )
        items_per_epoch = history.items / max(len(timings.walls), 1)
        return RunOutput(
            timings,
            self.comm.gather_object(timings.phase_totals()),
            None,
            round(items_per_epoch),
            history=history,
            model=model,
            notes=self.compile_record(),
        )
