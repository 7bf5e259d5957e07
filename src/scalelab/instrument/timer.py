"""One `phase(name)` context manager for every timed region.

It feeds the per-rank phase totals and, on CUDA, an NVTX range of the same name (visible in
Nsight Systems). Phases nest: `with phase("train"): with phase("backward")` books
"train/backward". Disabled timers yield straight away, so instrumentation costs nothing off.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


def device_sync(device: torch.device) -> Callable[[], None]:
    """The barrier a host clock needs before it can be read: kernels are asynchronous on CUDA."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


class PhaseTimer:
    """Accumulates wall seconds per phase path until `lap()` hands them over and resets."""

    def __init__(
        self, sync: Callable[[], None] = lambda: None, enabled: bool = True, nvtx: bool = False
    ) -> None:
        self.sync = sync
        self.enabled = enabled
        self.nvtx = nvtx and torch.cuda.is_available()
        self._stack: list[str] = []
        self._current: dict[str, float] = defaultdict(float)
        self._bytes: dict[str, int] = defaultdict(int)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        path = "/".join([*self._stack, name])
        self.sync()
        if self.nvtx:
            torch.cuda.nvtx.range_push(path)
        start = time.perf_counter()
        self._stack.append(name)
        try:
            yield
        finally:
            self.sync()
            self._current[path] += time.perf_counter() - start
            self._stack.pop()
            if self.nvtx:
                torch.cuda.nvtx.range_pop()

    def add_bytes(self, name: str, nbytes: int) -> None:
        """Book bytes moved under a phase name (transfers, messages)."""
        self._bytes[name] += int(nbytes)

    def lap(self) -> dict[str, float]:
        """Phase seconds since the last lap; resets the counters."""
        out = dict(self._current)
        self._current.clear()
        return out

    def bytes_moved(self) -> dict[str, int]:
        return dict(self._bytes)


@dataclass
class Timings:
    """Per-iteration wall times and phase laps of one rank, with their medians."""

    walls: list[float] = field(default_factory=list)
    laps: list[dict[str, float]] = field(default_factory=list)

    def add(self, wall: float, lap: dict[str, float]) -> None:
        self.walls.append(wall)
        self.laps.append(lap)

    @property
    def wall_median(self) -> float:
        return statistics.median(self.walls)

    def phase_medians(self) -> dict[str, float]:
        names = sorted({name for lap in self.laps for name in lap})
        return {n: statistics.median(lap.get(n, 0.0) for lap in self.laps) for n in names}

    def phase_totals(self) -> dict[str, float]:
        totals: dict[str, float] = {}
        for lap in self.laps:
            for name, seconds in lap.items():
                totals[name] = totals.get(name, 0.0) + seconds
        return totals

    def spread(self) -> dict[str, float]:
        return {
            "min": min(self.walls),
            "max": max(self.walls),
            "stdev": statistics.pstdev(self.walls) if len(self.walls) > 1 else 0.0,
        }


def timed_iterations(
    step: Callable[[], object],
    timer: PhaseTimer,
    warmup: int,
    iters: int,
    barrier: Callable[[], None] = lambda: None,
) -> tuple[Timings, object]:
    """Warm up, then time `iters` calls of step: sync + barrier before each clock read.

    Returns the timings and the last step's result (used for the correctness check, which
    therefore happens outside the timed region).
    """
    result = None
    for _ in range(warmup):
        result = step()
    timer.lap()  # discard warm-up phases
    timings = Timings()
    for _ in range(iters):
        timer.sync()
        barrier()
        start = time.perf_counter()
        result = step()
        timer.sync()
        wall = time.perf_counter() - start
        timings.add(wall, timer.lap())
    return timings, result
