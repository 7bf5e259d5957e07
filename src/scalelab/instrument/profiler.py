"""`--trace DIR`: a torch.profiler capture per rank, one Chrome/Perfetto trace `rank{r}.json.gz`.

The profiler follows a wait/warmup/active schedule clocked by `timer.notify_step()` (each
inference iteration, each optimizer step), so the recorded window holds steady-state steps,
not the first cold ones. Every `PhaseTimer.phase` inside it becomes a `record_function` label
of the same path ("compute", "train/backward"), next to the operator and kernel events.

The files load in Perfetto (ui.perfetto.dev) and in HolisticTraceAnalysis
(`TraceAnalysis(trace_dir=DIR)`): HTA reads the rank from the top-level `distributedInfo`,
which torch writes under torch.distributed and which we add ourselves under MPI.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from scalelab.errors import UsageError
from scalelab.instrument.timer import HUB


@dataclass(frozen=True)
class TraceSchedule:
    """Steps skipped, warmed up (profiler on, events dropped) and recorded, in that order."""

    wait: int
    warmup: int
    active: int

    @classmethod
    def fit(cls, warm_steps: int, steady_steps: int, most_active: int = 3) -> TraceSchedule:
        """Record up to most_active of the steady steps, warming the profiler up on the last
        warm step (untimed iterations), so the window never falls past the run's end."""
        warmup = 1 if warm_steps >= 1 else 0
        wait = max(warm_steps - warmup, 0)
        return cls(wait, warmup, max(1, min(most_active, steady_steps)))


def trace_path(folder: str | Path, rank: int) -> Path:
    return Path(folder) / f"rank{rank}.json.gz"


class TraceSession:
    """Context manager: profile this rank and write its trace when the window closes."""

    def __init__(
        self,
        folder: str | Path,
        rank: int,
        world_size: int,
        backend: str,
        plan: TraceSchedule,
        cuda: bool,
    ) -> None:
        self.path = trace_path(folder, rank)
        self.plan = plan
        self.dist_info = {"backend": backend, "rank": rank, "world_size": world_size}
        self.cuda = cuda
        self.written = False
        self._prof: profile | None = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UsageError(f"--trace {folder}: cannot create the folder ({exc})") from None

    def _ready(self, prof: profile) -> None:
        prof.export_chrome_trace(str(self.path))  # .gz suffix: torch gzips it
        self.written = True

    def __enter__(self) -> TraceSession:
        activities = [ProfilerActivity.CPU]
        if self.cuda:
            activities.append(ProfilerActivity.CUDA)
        self._prof = profile(
            activities=activities,
            schedule=schedule(**asdict(self.plan), repeat=1),
            on_trace_ready=self._ready,
            record_shapes=True,
        )
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            # HTA tells ranks apart by this key; torch adds it only under torch.distributed.
            self._prof.preset_metadata_json("distributedInfo", json.dumps(self.dist_info))
        self._prof.__enter__()
        HUB.labels = True
        HUB.step_hooks.append(self._prof.step)
        return self

    def __exit__(self, *exc: Any) -> None:
        HUB.labels = False
        HUB.step_hooks.remove(self._prof.step)
        self._prof.__exit__(*exc)

    def notes(self) -> dict[str, Any]:
        return {"file": str(self.path) if self.written else None, "schedule": asdict(self.plan)}
