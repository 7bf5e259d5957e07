"""DDP's gradient all-reduces as phases of their own: a comm hook that times every bucket.

DDP all-reduces gradients in buckets while backward still runs, so their time hides inside
`compute/backward`. `BucketTimer` wraps the all-reduce DDP would run (or a --grad-compress
hook) and times each bucket from the moment DDP hands it over (the bucket is ready on this
rank: its arrival) to the moment its reduced values are back:

    gloo (CPU)  host clock: perf_counter at the hook's call and in the future's callback,
                which gloo runs when the work has completed;
    NCCL (GPU)  CUDA events on the current stream: one before the all-reduce is queued, one
                in the callback (torch runs it on a stream that waits for the NCCL work), read
                when the step's events have completed; the slice is placed at the host time
                of the hook's call.

Each bucket becomes a span on the timeline's `comm` lane (bytes, bucket index) and adds to
the rank's `ddp_comm` totals in the record.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from scalelab.instrument.spans import SPANS

Hook = Callable[[Any, Any], torch.futures.Future]


class BucketTimer:
    """Times DDP buckets: register `net.register_comm_hook(None, timer.hook)`."""

    def __init__(self, inner: Hook | None, device: torch.device) -> None:
        self.inner = inner or default_hooks.allreduce_hook
        self.cuda = device.type == "cuda"
        self.seconds = 0.0
        self.calls = 0
        self.bytes: dict[int, int] = {}  # bucket index -> bytes of its flat buffer
        self._pending: list[tuple] = []  # CUDA: (index, bytes, start, step, events) to read
        self._lock = threading.Lock()

    # No annotations: DDP checks a hook's `bucket` and return annotations against the real
    # classes, and this module's annotations are strings.
    def hook(self, state, bucket):
        buf = bucket.buffer()  # (numel,) the bucket's gradients, flat
        index, nbytes = bucket.index(), buf.numel() * buf.element_size()
        start, step = time.perf_counter(), SPANS.log.iteration if SPANS.log else 0
        begin = _event() if self.cuda else None
        fut = self.inner(state, bucket)

        def done(f: torch.futures.Future) -> torch.Tensor:
            if begin is None:
                self._book(index, nbytes, start, time.perf_counter() - start, step)
            else:
                with self._lock:
                    self._pending.append((index, nbytes, start, step, begin, _event()))
            return f.value()

        return fut.then(done)

    def _book(self, index: int, nbytes: int, start: float, seconds: float, step: int) -> None:
        with self._lock:
            self.seconds += seconds
            self.calls += 1
            self.bytes[index] = nbytes
        log = SPANS.log
        if log is not None:
            log.add("allreduce", start, start + seconds, "comm", step, bytes=nbytes, bucket=index)

    def settle(self) -> None:
        """Read the CUDA events of finished buckets (a step's end; waits for them)."""
        with self._lock:
            pending, self._pending = self._pending, []
        for index, nbytes, start, step, begin, end in pending:
            end.synchronize()
            self._book(index, nbytes, start, begin.elapsed_time(end) / 1e3, step)

    def notes(self) -> dict[str, Any]:
        """This rank's totals: all-reduce seconds, calls and bytes per bucket."""
        self.settle()
        return {
            "allreduce_s": self.seconds,
            "calls": self.calls,
            "bucket_bytes": [self.bytes[i] for i in sorted(self.bytes)],
            "clock": "cuda events" if self.cuda else "host",
        }


def _event() -> Any:
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event
