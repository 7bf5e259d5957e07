"""One `phase(name)` context manager for every timed region.

It feeds the per-rank phase totals (host clock, device synchronised at both ends), CUDA events
on GPU (device seconds per phase), an NVTX range of the same name (visible in Nsight Systems)
and, while a `--trace` profiler runs, a `torch.profiler.record_function` label of the same
name. Phases nest: `with phase("train"): with phase("backward")` books "train/backward".
Disabled timers yield straight away, and the optional feeds are switched on by the
instrumentation session (`HUB`), so instrumentation costs nothing when off.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from scalelab.instrument.spans import SPANS
from scalelab.instrument.stats import describe


@dataclass
class InstrumentHub:
    """Process-wide switches the instrumentation session turns on (one process = one rank).

    labels: wrap each phase in torch.profiler.record_function (only while a trace runs).
    intervals: when a list, every phase appends (path, start, end) in perf_counter seconds,
        so NVML samples can be attributed to phases.
    step_hooks: called once per iteration / optimizer step (the profiler's schedule clock).
    """

    labels: bool = False
    beacon: Callable[[str], None] | None = None  # a launched rank's "now in phase X" report
    intervals: list[tuple[str, float, float]] | None = None
    step_hooks: list[Callable[[], None]] = field(default_factory=list)


HUB = InstrumentHub()


def notify_step() -> None:
    """One iteration (inference) or optimizer step (training) ended."""
    for hook in HUB.step_hooks:
        hook()


class DeviceSync:
    """The barrier a host clock needs before it can be read: kernels are asynchronous on CUDA.
    Callable; `.device` tells a PhaseTimer where to record CUDA events.

    scope: what a phase boundary waits for.
      "device"  every stream of the device (the default: host seconds are device seconds).
      "none"    nothing: the host runs ahead and keeps the device's queue full; phases are
                timed by their CUDA events alone (the host seconds are only enqueue time).
                For loops of many short device phases, where a barrier per phase would leave
                the GPU idle while the host launches the next one (a pipeline stage's
                micro-batches: 0.66x plain PyTorch at M=8 on one H100 with a barrier each).
      `barrier()` is what an iteration's end waits for: the phase barrier itself, and with
      scope "none" the current stream (a pipeline stage's sends in flight stay in flight)."""

    def __init__(self, device: torch.device, scope: str = "device") -> None:
        assert scope in ("device", "none"), scope
        self.device = device
        self.scope = scope

    def __call__(self) -> None:
        if self.device.type == "cuda" and self.scope == "device":
            torch.cuda.synchronize(self.device)

    def barrier(self) -> None:
        if self.scope == "device":
            self()
        elif self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()


def device_sync(device: torch.device, scope: str = "device") -> DeviceSync:
    return DeviceSync(device, scope)


class PhaseTimer:
    """Accumulates wall seconds per phase path until `lap()` hands them over and resets.

    events: record CUDA events around each phase (device seconds in `last_device_lap`);
        None: on when `sync` is a DeviceSync for a CUDA device.
    """

    def __init__(
        self,
        sync: Callable[[], None] = lambda: None,
        enabled: bool = True,
        nvtx: bool = False,
        events: bool | None = None,
    ) -> None:
        self.sync = sync
        self.enabled = enabled
        self.nvtx = nvtx and torch.cuda.is_available()
        device = getattr(sync, "device", None)
        on_cuda = device is not None and device.type == "cuda"
        self.events = (on_cuda if events is None else events) and torch.cuda.is_available()
        self._stack: list[str] = []
        self._current: dict[str, float] = defaultdict(float)
        self._bytes: dict[str, int] = defaultdict(int)
        self._pending: list[tuple[str, Any, Any]] = []  # (path, start event, end event)
        self.last_device_lap: dict[str, float] = {}
        # The last lap's phases as (path, start ms, end ms) from its first phase's start, in
        # the order they ran: one rank's timeline of an iteration (gaps are idle or unphased).
        self.last_device_spans: list[tuple[str, float, float]] = []

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        path = "/".join([*self._stack, name])
        if HUB.beacon is not None:
            HUB.beacon(path)
        self.sync()
        if self.nvtx:
            torch.cuda.nvtx.range_push(path)
        label = torch.profiler.record_function(path) if HUB.labels else None
        if label is not None:
            label.__enter__()
        events = self._record_start() if self.events else None
        start = time.perf_counter()
        log = SPANS.log
        span = log.open(path, start) if log is not None else None
        self._stack.append(name)
        try:
            if SPANS.slow_compute_s and name == "compute":  # the test hook's straggler
                time.sleep(SPANS.slow_compute_s)
            yield
        finally:
            if events is not None:
                events[1].record()
                self._pending.append((path, *events))
            self.sync()
            end = time.perf_counter()
            self._current[path] += end - start
            self._stack.pop()
            if span is not None:
                log.close(span, end)
            if HUB.intervals is not None:
                HUB.intervals.append((path, start, end))
            if label is not None:
                label.__exit__(None, None, None)
            if self.nvtx:
                torch.cuda.nvtx.range_pop()

    @staticmethod
    def _record_start() -> tuple[Any, Any]:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        return start, end

    def settle(self) -> None:
        """Wait for this rank's queued device work before reading the clock at an iteration's
        end, whatever the phase boundaries wait for."""
        getattr(self.sync, "barrier", self.sync)()

    def add_bytes(self, name: str, nbytes: int) -> None:
        """Book bytes moved under a phase name (transfers, messages)."""
        self._bytes[name] += int(nbytes)

    def lap(self) -> dict[str, float]:
        """Phase seconds since the last lap; resets the counters. The CUDA-event seconds of
        the same phases land in `last_device_lap` (empty without events)."""
        out = dict(self._current)
        self._current.clear()
        device: dict[str, float] = defaultdict(float)
        spans = []
        origin = self._pending[0][1] if self._pending else None
        for path, start, end in self._pending:
            end.synchronize()
            device[path] += start.elapsed_time(end) / 1e3  # elapsed_time is in ms
            spans.append((path, origin.elapsed_time(start), origin.elapsed_time(end)))
        self._pending.clear()
        self.last_device_lap = dict(device)
        self.last_device_spans = spans
        return out

    def discard(self) -> None:
        """Forget everything measured so far: phases, events, bytes (untimed set-up work)."""
        self.lap()
        self._bytes.clear()

    def bytes_moved(self) -> dict[str, int]:
        return dict(self._bytes)


class EventTimer(PhaseTimer):
    """Phases timed by their CUDA events alone, with no barrier at phase boundaries (scope
    "none"): a lap reports device seconds. The host keeps the device's queue full."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device_sync(device, "none"), nvtx=True, events=True)

    def lap(self) -> dict[str, float]:
        host = super().lap()
        return self.last_device_lap or host


def _medians(laps: list[dict[str, float]]) -> dict[str, float]:
    names = sorted({name for lap in laps for name in lap})
    return {n: statistics.median(lap.get(n, 0.0) for lap in laps) for n in names}


@dataclass
class Timings:
    """Per-iteration wall times and phase laps of one rank, with their medians.

    device_laps: CUDA-event seconds per phase, one dict per iteration (GPU runs only).
    marks: training only: (training seconds so far, items trained so far) at each optimizer
        step's end, on the host clock (evaluation and checkpoints excluded), so the record can
        tell warm-up and capture from the steady part (train/headline.py).
    """

    walls: list[float] = field(default_factory=list)
    laps: list[dict[str, float]] = field(default_factory=list)
    device_laps: list[dict[str, float]] = field(default_factory=list)
    marks: list[tuple[float, int]] = field(default_factory=list)

    def add(self, wall: float, lap: dict[str, float], device: dict | None = None) -> None:
        self.walls.append(wall)
        self.laps.append(lap)
        if device:
            self.device_laps.append(device)

    @property
    def wall_median(self) -> float:
        """The wall of the median-wall iteration (the lower median for an even count): a
        wall one real iteration had, which the phases the record keeps lie inside."""
        return statistics.median_low(self.walls)

    def median_index(self) -> int:
        """The median-wall iteration (the lower median: its wall is wall_median, so its
        phases, timed inside it, add up to at most the reported wall)."""
        order = sorted(range(len(self.walls)), key=self.walls.__getitem__)
        return order[(len(order) - 1) // 2]

    def iteration_phases(self) -> dict[str, float]:
        """The phases of the median-wall iteration: one real iteration, so they add up to
        at most its wall (medians per phase, from different iterations, need not)."""
        return dict(self.laps[self.median_index()]) if self.laps else {}

    def iteration_wall(self) -> float:
        return self.walls[self.median_index()]

    def phase_medians(self) -> dict[str, float]:
        return _medians(self.laps)

    def device_phase_medians(self) -> dict[str, float]:
        return _medians(self.device_laps)

    def phase_totals(self) -> dict[str, float]:
        totals: dict[str, float] = {}
        for lap in self.laps:
            for name, seconds in lap.items():
                totals[name] = totals.get(name, 0.0) + seconds
        return totals

    def spread(self) -> dict[str, float]:
        """n, median, q1, q3, iqr, mean, stdev, cv, min, max of the walls (stats.describe)."""
        return describe(self.walls)


def timed_iterations(
    step: Callable[[], object],
    timer: PhaseTimer,
    warmup: int,
    iters: int,
    barrier: Callable[[], None] = lambda: None,
) -> tuple[Timings, object]:
    """Warm up, then time `iters` calls of step: sync + barrier before each clock read.

    Returns the timings and the last step's result (used for the correctness check, which
    therefore happens outside the timed region). Each call ends with `notify_step()`, outside
    the timed wall (the profiler's schedule advances there).
    """
    result = None
    progress = _iteration_progress(warmup, iters)
    for i in range(warmup):
        result = step()
        notify_step()
        progress.tick(i + 1)
    timer.lap()  # discard warm-up phases
    timings = Timings()
    for i in range(iters):
        progress.tick(warmup + i)  # before the barrier: outside the next timed wall
        timer.settle()
        barrier()
        with _no_collection():
            start = time.perf_counter()
            result = step()
            timer.settle()
            wall = time.perf_counter() - start
        timings.add(wall, timer.lap(), timer.last_device_lap)
        notify_step()
    progress.tick(warmup + iters)
    return timings, result


@contextmanager
def _no_collection() -> Iterator[None]:
    """No cyclic garbage collection inside a timed iteration, as timeit does: in a process
    with a large heap (a notebook, a test session, a caller's own program) one collection
    costs milliseconds and starts at whichever allocation crosses the threshold, often the
    timer's own bookkeeping between phases, so the wall would hold time no phase holds. The
    collection runs after the iteration instead (its garbage is still counted)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _iteration_progress(warmup: int, iters: int):
    """Rank 0's progress over warm-up + timed iterations (a line every few seconds when they
    are slow: a big model on CPU)."""
    from scalelab.comm.job_status import this_rank
    from scalelab.instrument.progress import Progress

    label = f"infer ({warmup} warm-up + {iters} timed)"
    return Progress(warmup + iters, label, enabled=this_rank() == 0)
