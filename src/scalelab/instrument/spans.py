"""Every phase of a rank as a span on one clock: what `scalelab timeline` draws and what the
wait/transfer attribution (analysis/waits.py) reads.

While a `SpanLog` is installed in the instrumentation hub (`--timeline`, `--trace`), every
`PhaseTimer.phase` opens and closes a span (perf_counter seconds, the iteration it ran in);
code inside a phase adds facts to it with `annotate(bytes=..., peers=..., op=...)` (halo
messages, pipeline micro-batch indices). Work that runs beside the phases (DDP's bucket
all-reduces, finished on gloo's or NCCL's thread) is added whole with `SpanLog.add` on its
own lane. With no log installed `annotate` is one attribute read.

Clocks: `clock_offset(comm)` measures, at start, each rank's perf_counter offset to the root's
by ping-pong through the comm (the round with the smallest round trip; the error is at most
half of it), so spans of every rank land on the root's clock.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from scalelab.errors import UsageError

MAX_SPANS = 20_000  # per rank; later spans are counted, not kept (a record stays small)
PING_ROUNDS = 8
PING_TAG = 7919
SLOW_RANK_ENV = "SCALELAB_TEST_SLOW_RANK"  # "RANK:SECONDS": that rank sleeps in every compute


@dataclass
class SpanLog:
    """One rank's spans: [name, start s, end s, lane, iteration, args] in perf_counter time."""

    limit: int = MAX_SPANS
    spans: list[list[Any]] = field(default_factory=list)
    iteration: int = 0
    dropped: int = 0
    _open: list[list[Any]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def open(self, name: str, start: float) -> list[Any]:
        span = [name, start, start, "main", self.iteration, {}]
        self._open.append(span)
        return span

    def close(self, span: list[Any], end: float) -> None:
        span[2] = end
        if self._open and self._open[-1] is span:
            self._open.pop()
        self._keep(span)

    def add(
        self, name: str, start: float, end: float, lane: str, iteration: int, **args: Any
    ) -> None:
        """A span that ran beside the phases (another thread, a device stream)."""
        self._keep([name, start, end, lane, iteration, args])

    def annotate(self, **args: Any) -> None:
        if self._open:
            self._open[-1][5].update(args)

    def step(self) -> None:
        self.iteration += 1

    def _keep(self, span: list[Any]) -> None:
        with self._lock:
            if len(self.spans) < self.limit:
                self.spans.append(span)
            else:
                self.dropped += 1

    def rows(self, offset: float, origin: float) -> list[list[Any]]:
        """Spans on the root's clock, seconds from origin, rounded to 0.1 us (record size)."""
        with self._lock:
            spans = sorted(self.spans, key=lambda s: s[1])
        return [
            [n, round(s + offset - origin, 7), round(e - s, 7), lane, it, args]
            for n, s, e, lane, it, args in spans
        ]


class _Hub:
    """The installed log (one process = one rank) and the test hook's delay."""

    log: SpanLog | None = None
    slow_compute_s: float = 0.0


SPANS = _Hub()


def annotate(**args: Any) -> None:
    """Facts about the phase now open (bytes, peers, op, micro-batch) for the timeline."""
    log = SPANS.log
    if log is not None:
        log.annotate(**args)


def slow_rank_delay(rank: int) -> float:
    """The test hook: seconds this rank sleeps at the start of every `compute` phase, from
    SCALELAB_TEST_SLOW_RANK=RANK:SECONDS (a straggler made on purpose); 0 when unset."""
    value = os.environ.get(SLOW_RANK_ENV)
    if not value:
        return 0.0
    try:
        who, seconds = value.split(":")
        return float(seconds) if int(who) == rank else 0.0
    except ValueError:
        raise UsageError(f"{SLOW_RANK_ENV}={value!r}: expected RANK:SECONDS") from None


def clock_offset(comm: Any) -> tuple[float, float]:
    """(offset, round trip) in seconds: root's perf_counter = this rank's + offset.

    The root answers each rank in turn; a rank sends its clock, the root replies with its own,
    and the rank takes the reply as read at the round trip's midpoint. Collective: every rank
    calls it."""
    if comm.size == 1:
        return 0.0, 0.0
    buf = torch.zeros(1, dtype=torch.float64, device=comm.device)
    if comm.rank == 0:
        for peer in range(1, comm.size):
            for _ in range(PING_ROUNDS):
                comm.irecv(buf, peer, PING_TAG).wait()
                buf.fill_(time.perf_counter())
                comm.isend(buf, peer, PING_TAG).wait()
        return 0.0, 0.0
    best = (0.0, float("inf"))
    for _ in range(PING_ROUNDS):
        t0 = time.perf_counter()
        buf.fill_(t0)
        comm.isend(buf, 0, PING_TAG).wait()
        comm.irecv(buf, 0, PING_TAG).wait()
        t1 = time.perf_counter()
        root = float(buf.item())
        if t1 - t0 < best[1]:
            best = (root - (t0 + t1) / 2, t1 - t0)
    return best
