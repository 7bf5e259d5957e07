"""Point-to-point and all-reduce timing by message size over any Comm, and the alpha-beta
(latency-bandwidth) fit `t(n) = alpha + n / beta` of the results.

Run by every rank under a launcher (`scalelab ceilings --ranks N`). Rank 0 decides how many
calls fill a timed block and broadcasts it, so all ranks loop the same number of times; a
barrier starts each block; the time kept for a size is the slowest rank's best block time
per call (a collective ends when its last rank ends; the best block, as for every ceiling,
because noise on a shared machine only adds time). p2p is a ping-pong between ranks 0 and
1 (other ranks only join the barriers); its time is half the round trip.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from scalelab.comm.base import Comm
from scalelab.instrument.timer import device_sync


def message_sizes(largest: int, smallest: int = 8, factor: int = 4) -> list[int]:
    """Bytes per message: smallest, smallest*factor, ... up to largest."""
    sizes, n = [], smallest
    while n <= largest:
        sizes.append(n)
        n *= factor
    return sizes


def fit_alpha_beta(points: list[tuple[float, float]] | list[list[float]]) -> tuple[float, float]:
    """Least-squares (alpha seconds, beta bytes/s) of t = alpha + n / beta over (n, t) points.

    Residuals are relative (each row divided by its t), so an 8-byte latency point weighs as
    much as a 64 MiB bandwidth point; exact data is recovered exactly. A negative alpha (noise
    on a latency-free link) is clamped to 0 and the slope refitted through the origin; a slope
    that is not positive (times that do not grow with the size, on a busy host) becomes the
    best rate seen, so beta stays finite.
    """
    n = np.array([p[0] for p in points], dtype=np.float64)
    t = np.array([p[1] for p in points], dtype=np.float64)
    if len(n) < 2:
        raise ValueError("an alpha-beta fit needs at least two message sizes")
    design = np.stack([1 / t, n / t], axis=1)  # (points, 2): rows of [1, n] / t
    (alpha, slope), *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
    if alpha < 0:
        alpha = 0.0
        w = n / t
        slope = float(np.sum(w) / np.sum(w * w))
    if slope <= 0:  # times that do not grow with the size (a busy host): no bandwidth term fits;
        # the best rate seen stands for it, finite (a ceilings file with beta = inf is refused)
        slope = float(np.min(t / np.maximum(n, 1.0)))
    return float(alpha), 1.0 / slope


class CommBench:
    """Times one rank's share of the collectives; every rank must call the same methods."""

    def __init__(self, comm: Comm, device: torch.device, block_s: float, repeats: int) -> None:
        self.comm, self.device = comm, device
        self.sync = device_sync(device)
        self.block_s, self.repeats = block_s, repeats

    def _calls_per_block(self, fn: Callable[[], None]) -> int:
        fn()  # warm (connection setup, buffer registration)
        self.sync()
        self.comm.barrier()
        start = time.perf_counter()
        fn()
        self.sync()
        once = time.perf_counter() - start
        calls = max(1, min(10_000, math.ceil(self.block_s / max(once, 1e-7))))
        return self.comm.bcast_object(calls if self.comm.is_root else None)

    def seconds_per_call(self, fn: Callable[[], None]) -> float | None:
        """Slowest rank's best-block seconds per call (root); None on other ranks."""
        calls = self._calls_per_block(fn)
        blocks = []
        for _ in range(self.repeats):
            self.comm.barrier()
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            self.sync()
            blocks.append((time.perf_counter() - start) / calls)
        bests = self.comm.gather_object(min(blocks))
        return max(bests) if bests is not None else None

    def allreduce(self, nbytes: int) -> float | None:
        x = torch.zeros(max(nbytes // 4, 1), dtype=torch.float32, device=self.device)
        return self.seconds_per_call(lambda: self.comm.allreduce(x))

    def p2p(self, nbytes: int) -> float | None:
        buf = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
        rank = self.comm.rank

        def ping_pong() -> None:
            if rank == 0:
                self.comm.isend(buf, 1, tag=7).wait()
                self.comm.irecv(buf, 1, tag=8).wait()
            elif rank == 1:
                self.comm.irecv(buf, 0, tag=7).wait()
                self.comm.isend(buf, 0, tag=8).wait()

        round_trip = self.seconds_per_call(ping_pong)
        return None if round_trip is None else round_trip / 2

    def sweep(self, op: str, sizes: list[int], progress=None) -> dict[str, Any] | None:
        """{alpha_s, beta_Bps, points} for op over sizes (root); None on other ranks."""
        points = []
        for i, n in enumerate(sizes, 1):
            seconds = getattr(self, op)(n)
            points.append([n, seconds])
            if progress is not None:
                progress.update(i)
        if not self.comm.is_root:
            return None
        alpha, beta = fit_alpha_beta(points)
        return {"alpha_s": alpha, "beta_Bps": beta, "points": points}


def measure_comm(
    comm: Comm, device: torch.device, sizes: list[int], block_s: float, repeats: int, progress=None
) -> dict[str, Any] | None:
    """The `comm[backend]` section of ceilings.json (root rank; None elsewhere)."""
    bench = CommBench(comm, device, block_s, repeats)
    result = {
        "ranks": comm.size,
        "device": device.type,
        "allreduce": bench.sweep("allreduce", sizes, progress),
        "p2p": bench.sweep("p2p", sizes, progress),
    }
    return result if comm.is_root else None
