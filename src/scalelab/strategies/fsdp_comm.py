"""fsdp's all-gathers and reduce-scatters timed: FSDP2's own collectives, wrapped.

FSDP all-gathers a unit's parameters before its forward (and again before its backward when
it resharded) and reduce-scatters its gradients after its backward, on side streams (GPU) or
gloo's threads (CPU) while compute goes on; their time hides inside `compute`. `CommTimer`
hands each FSDP module an all-gather and a reduce-scatter that call torch's defaults
(`FSDPModule.set_custom_all_gather` / `set_custom_reduce_scatter`) and time every call:

    gloo (CPU)  host clock: from the call to its completion (the work's future's callback
                when FSDP issued it asynchronously; the call's return otherwise);
    NCCL (GPU)  CUDA events on the stream FSDP issues the collective on, read at the end.

What this measures is each collective's own duration, not how much of it compute hid: the
record's `fsdp_comm` totals are total communication time (exposed + overlapped together).
Each call becomes a span on the timeline's `comm` lane. On a GPU the timer is installed only
under --timeline or --trace (like DDP's bucket timer): custom collectives take FSDP's other
code path, which slowed a 1e9-parameter step on 2x H200 from 150.7 to 175.3 ms, so an
ordinary run reports the untimed step.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch
from torch import nn

from scalelab.instrument.spans import SPANS

try:  # torch's default collectives (FSDP2 internals; absent: fsdp runs untimed)
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
        DefaultAllGather,
        DefaultReduceScatter,
    )
except ImportError:  # pragma: no cover - an older or newer torch
    DefaultAllGather = DefaultReduceScatter = None  # type: ignore[assignment,misc]


class CommTimer:
    """Totals per kind ("allgather", "reducescatter"): seconds, calls, bytes."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.totals = {
            k: {"s": 0.0, "calls": 0, "bytes": 0} for k in ("allgather", "reducescatter")
        }
        self._pending: list[tuple] = []  # CUDA: (kind, bytes, start, step, begin, end)
        self._lock = threading.Lock()
        self.installed = False

    def install(self, model: nn.Module) -> bool:
        """Give every FSDP module of model the timed collectives; False where torch lacks them."""
        from torch.distributed.fsdp import FSDPModule

        if DefaultAllGather is None:
            return False
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_custom_all_gather(_TimedAllGather(self))
                m.set_custom_reduce_scatter(_TimedReduceScatter(self))
        self.installed = True
        return True

    def time(self, kind: str, nbytes: int, call: Any) -> Any:
        start, step = time.perf_counter(), SPANS.log.iteration if SPANS.log else 0
        begin = _event() if self.cuda else None
        work = call()
        if begin is not None:
            with self._lock:
                self._pending.append((kind, nbytes, start, step, begin, _event()))
        elif work is not None:  # asynchronous on gloo: done when its future completes
            work.get_future().then(
                lambda _: self._book(kind, nbytes, start, time.perf_counter() - start, step)
            )
        else:
            self._book(kind, nbytes, start, time.perf_counter() - start, step)
        return work

    def _book(self, kind: str, nbytes: int, start: float, seconds: float, step: int) -> None:
        with self._lock:
            t = self.totals[kind]
            t["s"] += seconds
            t["calls"] += 1
            t["bytes"] += nbytes
        if SPANS.log is not None:
            SPANS.log.add(kind, start, start + seconds, "comm", step, bytes=nbytes)

    def notes(self) -> dict[str, Any]:
        """This rank's totals over the run (reads pending CUDA events: waits for them)."""
        with self._lock:
            pending, self._pending = self._pending, []
        for kind, nbytes, start, step, begin, end in pending:
            end.synchronize()
            self._book(kind, nbytes, start, begin.elapsed_time(end) / 1e3, step)
        if not self.installed:
            return {"clock": "not timed (on a GPU only under --timeline or --trace)"}
        out: dict[str, Any] = {"clock": "cuda events" if self.cuda else "host"}
        for kind, t in self.totals.items():
            out.update({f"{kind}_s": t["s"], f"{kind}_calls": t["calls"],
                        f"{kind}_bytes": t["bytes"]})  # fmt: skip
        return out


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _event() -> Any:
    event = torch.cuda.Event(enable_timing=True)
    event.record()  # on the current stream: FSDP's all-gather / reduce-scatter stream
    return event


if DefaultAllGather is not None:

    class _TimedAllGather(DefaultAllGather):
        def __init__(self, timer: CommTimer) -> None:
            super().__init__()
            self.timer = timer

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            inner = super().__call__
            return self.timer.time(
                "allgather",
                _nbytes(output_tensor),
                lambda: inner(output_tensor, input_tensor, group, async_op),
            )

    class _TimedReduceScatter(DefaultReduceScatter):
        def __init__(self, timer: CommTimer) -> None:
            super().__init__()
            self.timer = timer

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            inner = super().__call__
            return self.timer.time(
                "reducescatter",
                _nbytes(input_tensor),
                lambda: inner(output_tensor, input_tensor, group, op, async_op),
            )
