"""Grouping a model's ordered layers (workloads/layers.py, `Workload.layers`) into pipeline
stages: by an explicit list (`--balance 5,7`) or by measured per-layer time subject to each
stage fitting its device's memory (`--balance auto`), and re-cutting from timed stages
(`--rebalance`). Pure arithmetic on LayerProfiles: the measuring is profiling.py's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from scalelab.errors import UsageError


def bounds(counts: Sequence[int]) -> list[tuple[int, int]]:
    """Stage s holds layers [start, stop): counts (5, 7) -> [(0, 5), (5, 12)]."""
    out, start = [], 0
    for c in counts:
        out.append((start, start + c))
        start += c
    return out


def cut_counts(spec: str, paths: Sequence[str | None], stages: int) -> list[int]:
    """`--cut a.b.2,a.b.4`: the per-stage layer counts of a cut before those modules (the
    layers' dotted paths), checked: stages - 1 names, each a layer, in forward order."""
    names = [n.strip() for n in spec.split(",") if n.strip()]
    if len(names) != stages - 1:
        raise UsageError(f"--cut {spec}: {stages} stages need {stages - 1} module names")
    starts = []
    for name in names:
        if name not in paths:
            known = ", ".join(p for p in paths if p)
            raise UsageError(f"--cut {name}: no layer is that module (layers: {known})")
        starts.append(list(paths).index(name))
    if starts[0] == 0 or starts != sorted(set(starts)):
        raise UsageError(f"--cut {spec}: name modules in forward order, after the first layer")
    edges = [0, *starts, len(paths)]
    return [b - a for a, b in zip(edges, edges[1:])]


def snap_counts(counts: list[int], layers: Sequence, cut_points: frozenset[str]) -> list[int]:
    """The cut moved so each stage begins at a module torch's tracer can split before (a
    layer, with its dotted `path`, whose module runs once: the block view's cut points): a
    boundary elsewhere moves to the next such layer. The torch engine's cut of a block model,
    and predict's."""
    starts = []
    for start, _ in bounds(counts)[1:]:
        while start < len(layers) and layers[start].path not in cut_points:
            start += 1
        if start >= len(layers) or (starts and start <= starts[-1]):
            points = ", ".join(x.path for x in layers if x.path in cut_points)
            raise UsageError(
                f"pipeline: cannot cut the model into {len(counts)} stages at module "
                f"boundaries (cut points: {points})"
            )
        starts.append(start)
    edges = [0, *starts, len(layers)]
    return [b - a for a, b in zip(edges, edges[1:])]


def given_counts(
    balance: str, cut: str | None, paths: Sequence[str | None], stages: int
) -> list[int] | None:
    """The cut the user gave (--cut names, or --balance counts); None for --balance auto."""
    if cut is not None:
        if balance.strip() != "auto":
            raise UsageError("--cut and --balance both choose the cut; give one")
        return cut_counts(cut, paths, stages)
    return parse_balance(balance, len(paths), stages)


def parse_balance(spec: str, n_layers: int, stages: int) -> list[int] | None:
    """`--balance`: None for "auto", else the explicit per-stage layer counts, checked."""
    if spec.strip() == "auto":
        return None
    try:
        counts = [int(part) for part in spec.split(",")]
    except ValueError:
        raise UsageError(f"--balance must be 'auto' or a list like 5,7; got {spec!r}") from None
    if len(counts) != stages or min(counts) < 1 or sum(counts) != n_layers:
        raise UsageError(
            f"--balance {spec}: need {stages} counts >= 1 summing to the model's {n_layers} layers"
        )
    return counts


@dataclass(frozen=True)
class LayerProfile:
    """One layer measured on one micro-batch.

    seconds: forward (+ backward when training); param_bytes: its parameters; in_bytes and
    act_bytes: its input and output; saved_*: what autograd keeps for its backward, the input,
    the output (ReLU) and other tensors it made (pool indices, dropout masks, autocast
    copies), in bytes; view: its output shares its input's memory (flatten, a no-op cast).
    """

    name: str
    seconds: float
    param_bytes: int
    act_bytes: int
    in_bytes: int = 0
    saved_input: bool = False
    saved_output: bool = False
    saved_other: int = 0
    view: bool = False


class _StageBytes:
    """Running memory of a stage as layers are appended to it: saved activations of one
    micro-batch, a tensor kept by two neighbours counted once (ReLU's saved output is the next
    convolution's saved input), plus the largest input + output pair alive while computing."""

    def __init__(self) -> None:
        self.params = self.saved = self.peak = 0
        self.out_saved = False  # the last layer's output is already kept

    def add(self, p: LayerProfile) -> None:
        if p.saved_input and not self.out_saved:
            self.saved += p.in_bytes
        self.saved += p.saved_other + (p.act_bytes if p.saved_output else 0)
        self.out_saved = p.saved_output or (p.view and (self.out_saved or p.saved_input))
        self.params += p.param_bytes
        self.peak = max(self.peak, p.in_bytes + p.act_bytes)


@dataclass(frozen=True)
class MemoryModel:
    """Bytes a stage needs: state_factor * params + in_flight[s] * saved activations of one
    micro-batch + the working pair. Training keeps weights and grads (+ a momentum buffer),
    inference weights only; GPipe keeps all M micro-batches' activations, 1F1B at most K - s
    on stage s."""

    capacity: float | None  # bytes per device; None: unconstrained
    state_factor: float
    in_flight: tuple[int, ...]  # per stage

    def total(self, acc: _StageBytes, stage: int) -> float:
        return self.state_factor * acc.params + self.in_flight[stage] * acc.saved + acc.peak

    def stage_bytes(self, layers: Sequence[LayerProfile], stage: int) -> float:
        acc = _StageBytes()
        for p in layers:
            acc.add(p)
        return self.total(acc, stage)

    def fits(self, layers: Sequence[LayerProfile], stage: int) -> bool:
        return self.capacity is None or self.stage_bytes(layers, stage) <= self.capacity


def memory_model(
    capacity: float | None,
    stages: int,
    microbatches: int,
    train: bool,
    schedule: str,
    momentum: float = 0.0,
) -> MemoryModel:
    if not train:
        return MemoryModel(capacity, 1.0, (0,) * stages)
    factor = 2.0 + (1.0 if momentum else 0.0)
    if schedule == "1f1b":
        in_flight = tuple(min(stages - s, microbatches) for s in range(stages))
    else:
        in_flight = (microbatches,) * stages
    return MemoryModel(capacity, factor, in_flight)


def _pack(
    profiles: Sequence[LayerProfile], stages: int, mem: MemoryModel, most_s: float
) -> list[int] | None:
    """Greedy: fill stage after stage while its time stays <= most_s and it fits memory.
    None when the layers need more than `stages` stages."""
    counts, i, n = [], 0, len(profiles)
    for s in range(stages):
        acc, seconds, j = _StageBytes(), 0.0, i
        while j < n:
            acc.add(profiles[j])
            seconds += profiles[j].seconds
            over = mem.capacity is not None and mem.total(acc, s) > mem.capacity
            # A relative slack: the bound may be a compensated sum of these floats (Python
            # 3.12's sum()), which their running sum can round above (2.45 against
            # 2.4499999999999997 for [0.7, 0.7, 0.05, 0.7, 0.2, 0.1]).
            if (seconds > most_s * (1 + 1e-12) or over) and j > i:
                break
            if over:  # one layer alone does not fit
                return None
            j += 1
        counts.append(j - i)
        i = j
        if i == n:
            return counts
    return None


def _split_to(counts: list[int], stages: int) -> list[int]:
    """Halve the largest stages until there are `stages` (a part of a stage that fits fits)."""
    counts = list(counts)
    while len(counts) < stages:
        big = max(range(len(counts)), key=lambda s: counts[s])
        half = counts[big] // 2
        counts[big : big + 1] = [counts[big] - half, half]
    return counts


def balance_auto(profiles: Sequence[LayerProfile], stages: int, mem: MemoryModel) -> list[int]:
    """Contiguous split into `stages` non-empty parts with the smallest slowest-stage time
    such that every stage fits mem.capacity: bisection on that time, each probe a greedy
    pack (O(n) per probe, so stacks of thousands of layers split in milliseconds)."""
    n = len(profiles)
    if n < stages:
        raise UsageError(f"pipeline: {stages} stages but the model has only {n} layers")
    lo, hi = max(p.seconds for p in profiles), sum(p.seconds for p in profiles)
    best = _pack(profiles, stages, mem, hi)
    if best is None:
        cap = mem.capacity / 2**30 if mem.capacity else float("inf")
        raise UsageError(
            f"pipeline: no split of {n} layers into {stages} stages fits {cap:.2f} GiB per "
            "device; use more stages or a smaller batch"
        )
    for _ in range(60):
        if hi - lo <= 1e-9 * hi:
            break
        mid = (lo + hi) / 2
        found = _pack(profiles, stages, mem, mid)
        if found is None:
            lo = mid
        else:
            hi, best = mid, found
    return _split_to(best, stages)


def fit_layer_seconds(
    profiles: Sequence[LayerProfile], timed: Sequence[tuple[Sequence[int], Sequence[float]]]
) -> list[LayerProfile]:
    """The profile corrected by every cut timed so far, timed = [(counts, stage seconds)].

    The cut points seen split the layers into segments; each segment's profiled seconds get
    one scale factor, and each timed stage says that its segments' scaled seconds add up to
    its measured time: a least-squares fit, each equation relative to its measurement. One
    cut gives every stage its measured/profiled ratio. Two cuts pin down what the layers
    between them cost on either side, which one ratio per stage cannot: VGG-16's re-cuts on
    2 H200s went 18 -> 13 -> 17 (never 14, the best) when each round used only its own."""
    n = len(profiles)
    points = sorted({0, n} | {b for counts, _ in timed for _, b in bounds(counts)})
    segments = list(zip(points[:-1], points[1:]))
    prof = np.array([sum(p.seconds for p in profiles[a:b]) for a, b in segments])
    rows, rhs = [], []
    for counts, measured in timed:
        for (a, b), seconds in zip(bounds(counts), measured):
            if seconds <= 0:
                continue  # nothing measured: no equation
            rows.append([pf / seconds if a <= sa and sb <= b else 0.0
                         for (sa, sb), pf in zip(segments, prof)])  # fmt: skip
            rhs.append(1.0)
    scale = np.ones(len(segments))
    if rows:
        fitted = np.linalg.lstsq(np.array(rows), np.array(rhs), rcond=None)[0]
        seen = np.array(rows).any(axis=0) & (prof > 0)
        # A segment no equation covers, or one the fit drives to <= 0, keeps its profile.
        scale = np.where(seen & (fitted > 0), fitted, 1.0)
    out: list[LayerProfile] = []
    for (a, b), k in zip(segments, scale):
        out += [replace(p, seconds=p.seconds * float(k)) for p in profiles[a:b]]
    return out


def recut_step(
    profiles: Sequence[LayerProfile],
    rounds: list[dict],
    timed: dict[tuple[int, ...], float],
    counts: Sequence[int],
    measured: Sequence[float],
    last: bool,
    mem: MemoryModel,
) -> tuple[list[int], bool]:
    """The root's step of a --rebalance loop (both pipeline engines): record this cut's stage
    seconds in rounds and timed, then (the next cut fitted to every cut timed, False), or (the
    fastest cut timed, True) once the rounds are spent or the fit proposes a cut already timed."""
    rounds.append({"balance": list(counts), "stage_s": list(measured)})
    timed[tuple(counts)] = max(measured)
    proposal = rebalance(profiles, [(r["balance"], r["stage_s"]) for r in rounds], mem)
    done = last or tuple(proposal) in timed
    return (list(min(timed, key=timed.get)) if done else proposal), done


def rebalance(
    profiles: Sequence[LayerProfile],
    timed: Sequence[tuple[Sequence[int], Sequence[float]]],
    mem: MemoryModel,
) -> list[int]:
    """balance_auto again on the profile fitted to the cuts timed so far (fit_layer_seconds).
    Layers timed one by one miss what they cost in place (a VGG-16 2-stage cut from the
    profile computed 55 ms against 37 ms a step on 2 H200s); whole stages do not."""
    return balance_auto(fit_layer_seconds(profiles, timed), len(timed[-1][0]), mem)


def min_stages(
    profiles: Sequence[LayerProfile],
    make_mem: Callable[[int], MemoryModel],
    most: int,
    least: int = 1,
) -> int | None:
    """Smallest K in least..most with a memory-feasible split (make_mem(K): K's model)."""
    for k in range(least, min(most, len(profiles)) + 1):
        if _pack(profiles, k, make_mem(k), float("inf")) is not None:
            return k
    return None
