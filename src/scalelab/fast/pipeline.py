"""Choosing each stage's implementation: validate against plain torch, time, keep the fastest.

On the real input, stage by stage: run the torch candidate (the reference), run every other
candidate, reject one that raises or disagrees with the reference by more than TOLERANCE
(relative L2), time the survivors with CUDA events and keep the fastest. A kernel that fails
here (a compile error on a new GPU, a wrong result) is logged once and routed around, so the
fast path never returns a number the torch path would not. Without timing (CPU, Triton's
interpreter) the first agreeing non-torch candidate wins, so tests exercise the kernels.

The winner of each timed choice is kept in the on-disk tuning cache (tuning.py) under the
stage's name, input shape and dtype and its candidates; a later process validates the cached
winner (and the torch reference) and skips the timing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from scalelab.fast import tuning
from scalelab.fast.kernels import kernel_enabled
from scalelab.fast.registry import Candidate, Plan, Stage, StageFn
from scalelab.fast.timing import median_time, sync

# Two bf16 roundings of the same math differ by ~4e-3 relative L2 (measured on every kernel);
# a logic error (wrong tap, window or channel) is O(1).
TOLERANCE = 2e-2


@dataclass
class Choice:
    stage: str
    name: str
    seconds: dict[str, float] = field(default_factory=dict)  # per timed candidate
    rejected: dict[str, str] = field(default_factory=dict)  # candidate -> why
    cached: bool = False  # the winner came from the tuning cache (no timing this time)


class Pipeline:
    """The chosen stage functions, applied in order."""

    def __init__(self, fns: list[StageFn]) -> None:
        self.fns = fns

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        for fn in self.fns:
            x = fn(x)
        return x


def relerr(out: torch.Tensor, ref: torch.Tensor) -> float:
    if out.shape != ref.shape:
        return float("inf")
    ref32 = ref.float()
    return float((out.float() - ref32).norm() / ref32.norm().clamp_min(1e-30))


def choose(
    plan: Plan,
    x: torch.Tensor,
    device: torch.device,
    kernels: bool,
    timing: bool,
    log: Callable[[str], None],
    tag: str = "",
) -> tuple[Pipeline, list[Choice]]:
    """Pick every stage's implementation on input x (transport form, on device).

    tag names the fast path (the workload) in tuning-cache keys."""
    fns, choices = [], []
    with torch.inference_mode():
        for stage in plan.stages:
            choice, fn, x = _choose_stage(stage, x, device, kernels, timing, log, tag)
            fns.append(fn)
            choices.append(choice)
    return Pipeline(fns), choices


def _usable(cand: Candidate, kernels: bool) -> bool:
    return cand.kernel is None or (kernels and kernel_enabled(cand.kernel))


def _choose_stage(
    stage: Stage,
    x: torch.Tensor,
    device: torch.device,
    kernels: bool,
    timing: bool,
    log: Callable[[str], None],
    tag: str = "",
) -> tuple[Choice, StageFn, torch.Tensor]:
    ref, *others = [c for c in stage.candidates if _usable(c, kernels)]
    choice = Choice(stage.name, ref.name)
    outputs = {ref.name: ref.fn(x)}
    key = tuning.entry_key(tag, stage.name, tuple(x.shape), x.dtype, [c.name for c in others])
    cached = tuning.lookup(device.type, key) if timing and others else None
    names = {c.name for c in others} | {ref.name}
    if cached in names:  # validate only the cached winner; no timing
        others = [c for c in others if c.name == cached]
        choice.cached = True
    agreeing = []
    for cand in others:
        reason, out = _validate(cand, x, outputs[ref.name], device)
        if reason is not None:
            choice.rejected[cand.name] = reason
            choice.cached = False  # the cached winner no longer agrees: time what is left
            log(f"fast path: {stage.name}: {cand.name} not used ({reason}); falling back")
            continue
        agreeing.append(cand)
        outputs[cand.name] = out
    best = agreeing[0] if agreeing else ref
    if timing and not choice.cached:
        for cand in [ref, *agreeing]:
            choice.seconds[cand.name] = median_time(cand.fn, [x], device, warmup=1, iters=3)
        best = min([ref, *agreeing], key=lambda c: choice.seconds[c.name])
        if len(choice.seconds) > 1:
            tuning.store(device.type, key, best.name)
    choice.name = best.name
    return choice, best.fn, outputs[best.name]


def _validate(
    cand: Candidate, x: torch.Tensor, ref: torch.Tensor, device: torch.device
) -> tuple[str | None, torch.Tensor | None]:
    """(None, output) when cand agrees with the reference output, else (reason, None)."""
    try:
        out = cand.fn(x)
        sync(device)
    except Exception as exc:  # compile errors, unsupported shapes: route around the kernel
        first = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ""
        return f"{type(exc).__name__}: {first}", None
    err = relerr(out, ref)
    if not err <= TOLERANCE:
        return f"relerr {err:.1e} against torch, over {TOLERANCE:.0e}", None
    return None, out
