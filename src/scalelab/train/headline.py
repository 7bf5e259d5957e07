"""Training's headline numbers: how long it took, and how fast it ran once warmed up.

`time_to_train_s` is the whole training (every epoch's wall, evaluation and checkpoints
excluded): what a user waits for. `steady_throughput` leaves out the warm-up: the first
steps pay for lazy initialisation, a CUDA graph's capture, autotuning, so items over the whole
run understate the rate the loop settles at (a 3-epoch `ddp --fast` run: 3,268 img/s overall,
~54,000 steady). The steady part starts after the last step, among the first half, that took
longer than WARM_FACTOR x the median step, and never before step `warmup` + 1 (--warmup: the
steps a user or a peer loop leaves out, 2 by default; the second step at the least); it is
timed from that step's end (a mark the loop takes after a device sync at step `warmup`) to
the end of training. A step of a partial batch (an epoch's last, when
the batch does not divide the data) is left out of the steady part too: its shapes are new,
so cuDNN's autotuner (cudnn.benchmark) and a CUDA graph's capture start over for it (on an
H100, 13 steps of 512 resnet18-cifar images took 0.31 s and the final 320-image step about
1.4 s). Without step marks (serial, pipeline), the epochs decide: the first epoch is the
warm-up when there are two or more.
"""

from __future__ import annotations

import statistics
from typing import Any

from scalelab.instrument.timer import Timings

WARM_FACTOR = 2.0
MIN_STEPS = 4


def warm_steps(durations: list[float], warmup: int = 1) -> int:
    """How many leading steps are warm-up: the slow ones among the first half, at least
    `warmup` (and 1), never all of them."""
    median = statistics.median(durations)
    half = durations[: len(durations) // 2]
    slow = [i for i, d in enumerate(half) if d > WARM_FACTOR * median]
    return min(max(max(slow, default=0) + 1, warmup), len(durations) - 1)


def headline(timings: Timings, items: int, warmup: int = 1) -> dict[str, Any]:
    """time_to_train_s, steady_throughput and `steady` (where it starts, what it covers)."""
    total = sum(timings.walls)
    out: dict[str, Any] = {"time_to_train_s": total}
    marks = timings.marks
    if len(marks) >= MIN_STEPS:
        times = [t for t, _ in marks]
        durations = [b - a for a, b in zip([0.0, *times], times)]
        sizes = [b - a for a, b in zip([0, *(n for _, n in marks)], (n for _, n in marks))]
        warm = warm_steps(durations, warmup)
        full = [i for i in range(warm, len(marks)) if sizes[i] == max(sizes)]
        steady = {"from_step": warm + 1, "steps": len(full), "basis": "steps"}
        if len(full) < len(marks) - warm:
            steady["partial_steps_left_out"] = len(marks) - warm - len(full)
        steady_items = sum(sizes[i] for i in full)
        steady_s = sum(durations[i] for i in full)
        if len(full) == len(marks) - warm:  # every step full: to the end of training
            t0, done = marks[warm - 1]
            steady_items, steady_s = items - done, total - t0
    elif len(timings.walls) >= 2:
        first = timings.walls[0]
        per_epoch = items / len(timings.walls)  # epochs of equal size but maybe the last
        steady = {"from_epoch": 2, "epochs": len(timings.walls) - 1, "basis": "epochs"}
        steady_items, steady_s = items - per_epoch, total - first
    else:
        steady = {"from_step": 1, "basis": "whole run (too few steps to leave warm-up out)"}
        steady_items, steady_s = items, total
    steady.update(items=steady_items, seconds=steady_s)
    out["steady"] = steady
    out["steady_throughput"] = steady_items / steady_s if steady_s > 0 else float("nan")
    return out


def describe_start(steady: dict[str, Any]) -> str:
    """'from step 3' / 'from epoch 2' / 'whole run (...)' for summaries and tables."""
    if steady.get("basis") == "steps":
        return f"from step {steady['from_step']}"
    if steady.get("basis") == "epochs":
        return f"from epoch {steady['from_epoch']}"
    return str(steady.get("basis", "?"))
