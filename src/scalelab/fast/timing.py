"""Device timing for the fast path and `scalelab bench`: CUDA events on GPU, perf_counter on CPU.

Events are recorded on the stream around each call, so a GPU starved by a slow host (eager
launch overhead) is charged for its idle gaps; one synchronisation at the end reads them all.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from scalelab.instrument.progress import Progress


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(
    fn: Callable[[Any], object],
    args: Sequence[Any],
    device: torch.device,
    warmup: int,
    iters: int,
    progress: Progress | None = None,
) -> list[float]:
    """Seconds of each of `iters` calls fn(args[i % len(args)]) after `warmup` untimed ones.

    Rotating through several inputs keeps one batch from sitting in cache between calls.
    `progress` (total warmup + iters) ticks between calls, outside the timed ones; on a GPU
    the calls are queued, so it ticks only through the warm-up.
    """
    tick = progress.tick if progress is not None else lambda done: None
    for i in range(warmup):
        fn(args[i % len(args)])
        tick(i + 1)
    sync(device)
    if device.type != "cuda":
        out = []
        for i in range(iters):
            start = time.perf_counter()
            fn(args[i % len(args)])
            out.append(time.perf_counter() - start)
            tick(warmup + i + 1)
        return out
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(iters)
    ]
    for i, (start, end) in enumerate(events):
        start.record()
        fn(args[i % len(args)])
        end.record()
    sync(device)
    return [start.elapsed_time(end) / 1e3 for start, end in events]


def median_time(
    fn: Callable[[Any], object], args: Sequence[Any], device: torch.device, warmup: int, iters: int
) -> float:
    return statistics.median(time_calls(fn, args, device, warmup, iters))
