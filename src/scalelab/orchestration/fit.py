"""What fits on one device: the largest deepstack (convs, fcs), the largest batch, and the
fewest pipeline stages for a stack that does not fit (the model-parallel seed, Task 1).

A *trial* runs one configuration and either returns its median step time or raises
torch.OutOfMemoryError; the searches only see that. Two trials exist:

- `DeviceTrial`: real training steps on a device. On CUDA an optional byte limit is enforced by
  the caching allocator itself (torch.cuda.set_per_process_memory_fraction), so an H200 can
  play the seed's 10.91 GB GTX 1080 Ti. Everything a failed try allocated is freed before the
  next (references dropped, gc, torch.cuda.empty_cache), or one OOM would poison the rest.
- `EstimatedLimit`: a fake allocator for CPU (there is no allocator to run out of): it charges
  the configuration's estimated bytes (parameters, gradients, optimizer state, activations,
  from the workload's cost table) against a limit, raising torch.OutOfMemoryError when over,
  and holds them until `release()`, like memory a failed step left behind.

Searches grow the size by doubling until a try fails, then bisect between the last success
and the first failure: O(log n) tries, assuming bigger never fits where smaller did not.
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from scalelab.config import RunConfig
from scalelab.layout.profiling import cap_allocator
from scalelab.precision import get_precision
from scalelab.workloads import WORKLOADS


@dataclass
class FitPoint:
    convs: int
    fcs: int
    batch: int
    fits: bool
    seconds: float | None = None  # median step time when it fits
    peak_bytes: int | None = None  # allocator peak (CUDA) or estimate (fake allocator)
    error: str | None = None  # the out-of-memory message when it does not


class Trial(Protocol):
    def __call__(self, cfg: RunConfig) -> tuple[float, int | None]:
        """(median step seconds, peak bytes) of cfg; raises torch.OutOfMemoryError."""

    def release(self) -> None:
        """Free whatever the last try left allocated."""


def attempt(trial: Trial, cfg: RunConfig) -> FitPoint:
    """One try; the OOM is caught here, and memory released whatever happened."""
    point = FitPoint(cfg.convs, cfg.fcs, cfg.batch, fits=False)
    try:
        point.seconds, point.peak_bytes = trial(cfg)
        point.fits = True
    except torch.OutOfMemoryError as exc:
        point.error = str(exc).splitlines()[0][:200] if str(exc) else "out of memory"
    # `exc` and the traceback holding the failed step's frames (and tensors) are gone here.
    trial.release()
    return point


def largest(fits: Callable[[int], bool], start: int = 1, most: int | None = None) -> int:
    """Largest n >= start with fits(n) (0 if start does not fit): double, then bisect."""
    good, bad, n = 0, None, start
    while bad is None:
        if most is not None and n > most:
            if good == most or fits(most):
                return most
            bad = most
        elif fits(n):
            good, n = n, n * 2
        else:
            bad = n
    while bad - good > 1:
        mid = (good + bad) // 2
        if fits(mid):
            good = mid
        else:
            bad = mid
    return good


class Search:
    """Runs tries through one trial and keeps every point, in the order tried."""

    def __init__(self, trial: Trial, base: RunConfig, report: Callable[[FitPoint], None]):
        self.trial, self.base, self.report = trial, base, report
        self.points: list[FitPoint] = []

    def fits(self, **change) -> bool:
        known = next((p for p in self.points if _matches(p, change, self.base)), None)
        if known is not None:
            return known.fits
        point = attempt(self.trial, replace(self.base, **change))
        self.points.append(point)
        self.report(point)
        return point.fits

    def stack(self, most: int | None = None) -> tuple[int, int]:
        """Largest n with (n, n) fitting, then its neighbours (n+1, n) and (n, n+1), as the
        seed's table: which of the two kinds of layer tips it over."""
        n = largest(lambda k: self.fits(convs=k, fcs=k), most=most)
        if n:
            self.fits(convs=n + 1, fcs=n)
            self.fits(convs=n, fcs=n + 1)
            self.fits(convs=n + 1, fcs=n + 1)
        return n, n

    def batch(self, most: int | None = None) -> int:
        return largest(lambda b: self.fits(batch=b), most=most)


def _matches(point: FitPoint, change: dict, base: RunConfig) -> bool:
    want = {"convs": base.convs, "fcs": base.fcs, "batch": base.batch, **change}
    return (point.convs, point.fcs, point.batch) == (want["convs"], want["fcs"], want["batch"])


# --- trials ------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class DeviceTrial:
    """cfg.warmup + cfg.iters training steps (inference steps for unlabelled workloads) of a
    model built directly on the device; the median of the timed ones."""

    def __init__(self, device: torch.device, limit_bytes: float | None = None) -> None:
        self.device = device
        cap_allocator(device, limit_bytes)

    def __call__(self, cfg: RunConfig) -> tuple[float, int | None]:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        seconds = self._steps(cfg)
        peak = torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None
        return seconds, peak

    def _steps(self, cfg: RunConfig) -> float:
        # Everything the step allocates lives in this frame, so an OOM unwinding it frees it.
        workload = WORKLOADS.get(cfg.workload)(cfg)
        precision = get_precision(cfg.dtype)
        with torch.device(self.device):
            model = workload.build_model().to(precision.storage)
        data = workload.synthetic_inputs(cfg.batch, cfg.seed)
        x = data.x.to(self.device)
        y = None if data.y is None else data.y.to(self.device)
        opt = workload.optimizer(model) if y is not None else None
        model.train(y is not None)
        times = []
        for _ in range(cfg.warmup + cfg.iters):
            _sync(self.device)
            start = time.perf_counter()
            with torch.set_grad_enabled(y is not None), _autocast(self.device, precision):
                out = model(workload.prepare(x).to(precision.storage))
                loss = workload.loss(model, out, y) if y is not None else None
            if loss is not None:
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            del out, loss
            _sync(self.device)
            times.append(time.perf_counter() - start)
        return statistics.median(times[cfg.warmup :])

    def release(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _autocast(device: torch.device, precision) -> AbstractContextManager:
    if precision.autocast is None:
        return nullcontext()
    return torch.autocast(device.type, dtype=precision.autocast)


def estimate_bytes(cfg: RunConfig) -> tuple[int, int]:
    """(parameter-side, activation-side) bytes of one training step of cfg, from the cost
    table: weights + grads (+ momentum buffer), and the input plus every layer's output for the
    batch (kept for the backward pass)."""
    workload = WORKLOADS.get(cfg.workload)(cfg)
    rows = workload.cost_table()
    itemsize = get_precision(cfg.dtype).itemsize
    state = 2 + (1 if cfg.momentum else 0)
    params = state * itemsize * sum(r.params for r in rows)
    acts = itemsize * cfg.batch * (rows[0].in_elems + sum(r.out_elems for r in rows))
    return params, acts


FAKE_ALLOCATOR = "fake allocator"  # how its refusals start: an estimate, not a run


class EstimatedLimit:
    """The fake allocator (see the module docstring). inner: the trial that runs a step that
    fits (None: report the estimate only, seconds NaN)."""

    def __init__(
        self,
        limit_bytes: float,
        inner: Trial | None = None,
        estimate: Callable[[RunConfig], tuple[int, int]] = estimate_bytes,
    ) -> None:
        self.limit = limit_bytes
        self.inner = inner
        self.estimate = estimate
        self.live = 0  # bytes "allocated" and not yet released

    def _allocate(self, nbytes: int) -> None:
        if self.live + nbytes > self.limit:
            free = self.limit - self.live
            raise torch.OutOfMemoryError(
                f"{FAKE_ALLOCATOR}: tried to allocate {nbytes / 2**20:.1f} MiB with "
                f"{free / 2**20:.1f} MiB free of a {self.limit / 2**20:.1f} MiB limit"
            )
        self.live += nbytes

    def __call__(self, cfg: RunConfig) -> tuple[float, int | None]:
        params, acts = self.estimate(cfg)
        self._allocate(params)  # the model is built first ...
        self._allocate(acts)  # ... then the forward keeps its activations
        if self.inner is None:
            return math.nan, params + acts
        seconds, _ = self.inner(cfg)
        return seconds, params + acts

    def release(self) -> None:
        self.live = 0
        if self.inner is not None:
            self.inner.release()
