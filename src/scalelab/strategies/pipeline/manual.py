"""`pipeline --placement manual`: naive model parallelism, the seed's Task 1 split.

One process; the layers cut into --stages groups, group s moved to GPU s with `.to(device)`,
and the whole batch walked through them in turn (no micro-batches). Only one GPU works at any
time: with K equal stages each idles (K-1)/K of the step, which the record shows as each
stage's busy share of the forward (`pipeline.stage_busy`). On CPU every stage sits on the
CPU (a functional check of the split, nothing to idle).

The model returns its output on the first device, so the shared inference step and training
loop (strategies/torch_base.py, train/loop.py) run it unchanged: inputs and labels live on
the first device, and only the logits (N, classes) travel back from the last one.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from scalelab.comm import Comm, SelfComm
from scalelab.errors import UsageError
from scalelab.instrument.timer import PhaseTimer
from scalelab.layout import partition as part
from scalelab.layout import profiling
from scalelab.results import RunOutput
from scalelab.strategies.pipeline.placements import PLACEMENTS
from scalelab.strategies.pipeline.report import summary_line
from scalelab.strategies.torch_base import TorchStrategy
from scalelab.workloads.base import Inputs, Workload
from scalelab.workloads.layers import Layer


class SyncAll:
    """The PhaseTimer barrier for several devices: every GPU the stages use."""

    def __init__(self, devices: list[torch.device]) -> None:
        self.devices = sorted({d for d in devices if d.type == "cuda"}, key=str)
        self.device = devices[0]

    def __call__(self) -> None:
        for d in self.devices:
            torch.cuda.synchronize(d)


class ManualSplit(nn.Module):
    """Stages on devices; forward hands the activation from device to device.

    x: (N, ...) on any device -> stage 0 on devices[0] -> ... -> logits back on devices[0].
    """

    def __init__(self, stages: list[nn.Module], devices: list[torch.device], timer) -> None:
        super().__init__()
        self.stages = nn.ModuleList(stages)
        self.devices = devices
        self.timer = timer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for s, (stage, device) in enumerate(zip(self.stages, self.devices)):
            with self.timer.phase(f"copy{s}"):
                x = x.to(device)
            with self.timer.phase(f"stage{s}"):
                x = stage(x)
        return x.to(self.devices[0])


class ManualPlacement(TorchStrategy):
    """Registered through `pipeline` (`--placement manual`)."""

    name = "pipeline"
    reads = PLACEMENTS["manual"].reads

    def make_comm(self) -> Comm:
        return SelfComm()

    def pick_device(self) -> torch.device:
        self.devices = stage_devices(self.cfg.device, self.cfg.stages)
        return self.devices[0]

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        cuda = self.device.type == "cuda"
        self.timer = PhaseTimer(SyncAll(self.devices), nvtx=cuda, events=False)

    def validate(self, workload: Workload) -> None:
        if self.cfg.ranks != 1:
            raise UsageError("--placement manual runs one process over several GPUs; drop --ranks")

    def place(self, model: nn.Module) -> nn.Module:
        cfg = self.cfg
        layers = self.workload.layers(model)
        counts = part.given_counts(cfg.balance, cfg.cut, [x.path for x in layers], cfg.stages)
        if counts is None:
            counts = self._auto_counts(layers)
        self.counts = counts
        stages = []
        for (start, stop), device in zip(part.bounds(counts), self.devices):
            stage = nn.Sequential(*[layer.module for layer in layers[start:stop]])
            stages.append(stage.to(device=device, dtype=self.precision.storage))
        self.layer_names = [[layers[a].name, layers[b - 1].name] for a, b in part.bounds(counts)]
        return ManualSplit(stages, self.devices, self.timer)

    def _auto_counts(self, layers: list[Layer]) -> list[int]:
        """Equal measured time per stage, each stage within its GPU's memory (measured on a
        whole batch: naive model parallelism runs the batch in one piece)."""
        x = self.workload.prepare(self.workload.synthetic_inputs(self.cfg.batch, self.cfg.seed).x)
        x = x.to(self.device, self.precision.storage)
        profile = profiling.profile_layers(
            layers, x, self.device, self.precision.storage, self.cfg.train, self.autocast
        )
        capacity = profiling.device_capacity(self.device)
        mem = part.memory_model(
            capacity, self.cfg.stages, 1, self.cfg.train, "gpipe", self.cfg.momentum
        )
        return part.balance_auto(profile, self.cfg.stages, mem)

    # The workload is needed to cut the model; the shared paths call place() without it.
    def infer(self, workload: Workload, model: nn.Module, inputs: Inputs | None) -> RunOutput:
        self.workload = workload
        return self._with_notes(super().infer(workload, model, inputs))

    def train(self, workload, model, data) -> RunOutput:
        self.workload = workload
        return self._with_notes(super().train(workload, model, data))

    def _with_notes(self, out: RunOutput) -> RunOutput:
        """Each stage's forward seconds per iteration and its share of the iteration's wall
        (training: the forward part of each step; backward runs through autograd as one)."""
        timings, train = out.timings, out.history is not None
        prefix = "compute/forward/" if train else "compute/"
        if train:  # laps are epoch totals: per step = total / steps
            steps = max(out.history.steps, 1)
            wall = sum(timings.walls) / steps
            per_stage = [
                sum(lap.get(f"{prefix}stage{s}", 0.0) for lap in timings.laps) / steps
                for s in range(len(self.devices))
            ]
        else:
            wall = timings.wall_median
            med = timings.phase_medians()
            per_stage = [med.get(f"{prefix}stage{s}", 0.0) for s in range(len(self.devices))]
        out.notes["pipeline"] = {
            "placement": "manual",
            "stages": len(self.devices),
            "devices": [str(d) for d in self.devices],
            "balance": list(self.counts),
            "stage_layers": self.layer_names,
            "stage_forward_s": per_stage,
            "stage_busy": [t / wall if wall > 0 else 0.0 for t in per_stage],
        }
        if not self.cfg.quiet:
            print(summary_line(out.notes), file=sys.stderr, flush=True)
        return out


def stage_devices(device: str, stages: int) -> list[torch.device]:
    """GPU s for stage s; the CPU for every stage on --device cpu."""
    if device != "cuda":
        return [torch.device("cpu")] * stages
    if not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA GPU is visible to torch on this machine")
    gpus = torch.cuda.device_count()
    if stages > gpus:
        raise UsageError(f"--placement manual: {stages} stages but {gpus} GPUs in this process")
    return [torch.device("cuda", s) for s in range(stages)]
