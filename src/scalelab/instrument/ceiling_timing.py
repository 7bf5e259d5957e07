"""How ceilings are timed: a measurement pass's sizes (Plan) and the best of repeated blocks
of back-to-back calls, each block long enough to swamp the clock and the first call."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from scalelab.instrument.timer import PhaseTimer, timed_iterations

MiB = 1 << 20


@dataclass(frozen=True)
class Plan:
    """Sizes and repeats of one measurement pass (default or --quick) on one device kind."""

    gemm_sizes: tuple[int, ...]
    copy_bytes: tuple[int, ...]
    transfer_bytes: int
    cpu_gemm_sizes: tuple[int, ...]
    cpu_copy_bytes: int  # per thread
    block_s: float  # each timed block runs at least this long (many calls of short kernels)
    repeats: int  # timed blocks; the best is kept
    max_call_s: float  # skip larger GEMMs once one call would take longer than this

    @classmethod
    def make(cls, device: torch.device, quick: bool) -> Plan:
        if device.type == "cuda":
            if quick:
                return cls((2048, 4096), (256 * MiB,), 64 * MiB, (512,), 16 * MiB, 0.01, 3, 1.0)
            return cls(
                (2048, 4096, 8192), (256 * MiB, 1024 * MiB), 256 * MiB, (512, 1024),
                64 * MiB, 0.02, 5, 1.0,
            )  # fmt: skip
        if quick:
            return cls((128, 256), (16 * MiB,), 0, (256,), 8 * MiB, 0.01, 3, 0.05)
        return cls((256, 512, 1024), (64 * MiB,), 0, (256, 512), 32 * MiB, 0.03, 5, 0.25)


def _block(fn: Callable[[], object], calls: int) -> Callable[[], None]:
    def run() -> None:
        for _ in range(calls):
            fn()

    return run


def calls_filling(fn: Callable[[], object], sync: Callable[[], None], block_s: float) -> int:
    """How many back-to-back calls last block_s: grow the count until a timed block does
    (timeit's autorange), so slow first calls (thread wake-up, lazy init) do not mislead."""
    calls = 1
    while calls < 10_000:
        timings, _ = timed_iterations(_block(fn, calls), PhaseTimer(sync), warmup=0, iters=1)
        took = timings.wall_median
        if took >= block_s:
            break
        calls = min(
            10_000, calls * 10, max(calls * 2, math.ceil(calls * block_s / max(took, 1e-9)))
        )
    return calls


def seconds_per_call(fn: Callable[[], object], sync: Callable[[], None], plan: Plan) -> float:
    """Seconds of one fn() call: find how many calls fill plan.block_s, then time
    plan.repeats blocks after a warm-up block (sync before each clock read) and keep the best
    block. A ceiling is what the machine can do: on a shared machine noise only adds time, so
    the best block estimates it (STREAM's convention), where a run's median would not."""
    return best_and_spread(fn, sync, plan)[0]


def best_and_spread(
    fn: Callable[[], object], sync: Callable[[], None], plan: Plan
) -> tuple[float, float]:
    """(seconds of one call, as seconds_per_call; the spread of the plan.repeats blocks: the
    median block over the best, less one). A ceiling is the best block, and the spread says
    how far the others fell from it: two `ceilings --quick` runs minutes apart gave an fp32
    GEMM of 194 and 94.8 GF/s on one loaded host), and a large spread is the sign within one run."""
    calls = calls_filling(fn, sync, plan.block_s)
    timings, _ = timed_iterations(_block(fn, calls), PhaseTimer(sync), 1, plan.repeats)
    walls = sorted(timings.walls)
    return walls[0] / calls, walls[len(walls) // 2] / walls[0] - 1
