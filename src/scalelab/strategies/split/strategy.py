"""`SplitStrategy`: the torch strategy whose inference is divided over ranks by a split.

Subclasses choose the comm (`make_comm`) and the device (`pick_device`); everything else,
including the per-rank table and the record's per-rank phases, bytes and critical path, is
shared, so `mpi`, `mpi-gpu` and `nccl` cannot drift apart.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from scalelab.config import RunConfig
from scalelab.errors import UsageError
from scalelab.instrument.rank_table import (
    RankReport,
    TimelineTimer,
    accounting,
    critical_path,
    format_rank_table,
)
from scalelab.instrument.timer import Timings, device_sync, timed_iterations
from scalelab.results import RunOutput
from scalelab.strategies.split.base import SPLITS, Split
from scalelab.strategies.split.overlap import OverlapSplit
from scalelab.strategies.split.transport import Transport
from scalelab.strategies.torch_base import TorchStrategy
from scalelab.workloads.base import WORKLOADS, Inputs, Workload


class SplitStrategy(TorchStrategy):
    """Inference over ranks; `--split` picks how the batch is divided."""

    reads = ("split", "gpus")
    takes_split = True

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.timer = TimelineTimer(device_sync(self.device), nvtx=self.device.type == "cuda")
        self.wire = Transport(self.comm, self.device, self.timer)
        self.split: Split | None = None

    @staticmethod
    def split_class(cfg: RunConfig) -> type[Split]:
        return OverlapSplit if cfg.overlap else SPLITS.get(cfg.split)

    @classmethod
    def preflight(cls, cfg: RunConfig) -> int:
        """Topology checks before a launcher starts any rank (run.py calls this); returns the
        global batch. Ranks repeat them in validate() with the size the launcher gave."""
        cls.check_devices(cfg)
        cls.split_class(cfg).check(cfg, WORKLOADS.get(cfg.workload)(cfg), cfg.ranks)
        return cfg.batch

    @classmethod
    def check_devices(cls, cfg: RunConfig) -> None:
        """Device and library checks that need no rank (subclasses)."""

    def validate(self, workload: Workload) -> None:
        self.split = self.split_class(self.cfg)(self, workload)
        self.split.validate()

    def train(self, workload: Workload, model: nn.Module, data: Any) -> RunOutput:
        raise UsageError(
            f"strategy {self.name} splits inference; train over ranks with mpi-dp or ddp"
        )

    def infer(self, workload: Workload, model: nn.Module, inputs: Inputs | None) -> RunOutput:
        if self.split is None:
            self.validate(workload)
        split = self.split
        split.setup(self.place(model), inputs)

        def step() -> torch.Tensor | None:
            self.timer.begin()
            with torch.inference_mode(), self.autocast():  # spatial calls the ops itself
                return split.step()

        timings, out = timed_iterations(
            step, self.timer, self.cfg.warmup, self.cfg.iters, barrier=self.comm.barrier
        )
        reports = self._gather_reports(timings)
        if not self.is_root:
            return RunOutput(timings, None, None, self.cfg.batch)
        return self._root_output(workload, timings, out, reports)

    def _gather_reports(self, timings: Timings) -> list[RankReport] | None:
        walls = timings.walls
        median_iter = timings.median_index()
        runs = self.cfg.warmup + self.cfg.iters
        mine = RankReport(
            rank=self.comm.rank,
            wall_s=timings.wall_median,
            phases=timings.iteration_phases(),
            bytes={k: v // runs for k, v in self.timer.bytes_moved().items()},
            timeline=self.timer.history[1 + median_iter],  # history[0]: the warm-up lap
            extra=self.split.rank_extra(),
            iteration_wall_s=walls[median_iter],
            iteration=timings.laps[median_iter],
        )
        got = self.comm.gather_object(mine.to_dict())
        return None if got is None else [RankReport(**r) for r in got]

    def _root_output(
        self, workload: Workload, timings: Timings, out: Any, reports: list[RankReport]
    ) -> RunOutput:
        total: dict[str, int] = {}
        for r in reports:
            for k, v in r.bytes.items():
                total[k] = total.get(k, 0) + v
        notes = {
            "split": self.split.name,
            "backend": self.comm.backend,
            "transport": self.wire.mode,
            "rank_walls_s": [r.wall_s for r in reports],
            "rank_bytes": [r.bytes for r in reports],
            "rank_timeline": [r.timeline for r in reports],
            "accounting": accounting(reports),
            "critical_path": critical_path(reports),
            **self.split.notes(),
            **self.notes(),
        }
        if any(r.extra for r in reports):
            notes["rank_extra"] = [r.extra for r in reports]
        if not self.cfg.quiet:
            overlap = f" --overlap --chunks {self.cfg.chunks}" if self.cfg.overlap else ""
            title = (
                f"{workload.name} {self.name} --split {self.cfg.split}{overlap} x{self.comm.size}"
            )
            print(format_rank_table(reports, self.cfg.batch, workload.item, title), flush=True)
        output = np.asarray(out) if out is not None else None
        return RunOutput(
            timings, [r.phases for r in reports], output, self.cfg.batch, total, notes=notes
        )

    def notes(self) -> dict[str, Any]:
        """Strategy-specific facts for the record (the transport decision, ...)."""
        return {}
