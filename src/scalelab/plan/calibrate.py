"""The measurements a ranking lacks (`--calibrate-missing`), and running any measurement.

A candidate's compute is calibrated on a one-rank measurement of its *family* (same workload,
sizes, precision, threads per rank: predict/scenario.py). For each family no measurement
covers, this runs one rank at the smallest and the largest per-rank batch the family's
candidates need (two batch sizes give the model its fixed + per-item law; one when they
agree):

    inference   mpi --split batch --ranks 1 (GPU: mpi-gpu); a spatial candidate also needs a
                one-rank spatial run (its per-layer times come from that run's timeline)
    training    mpi-dp --ranks 1 (GPU: ddp --ranks 1 with the candidate's own knobs)

and, when a ddp candidate on several ranks has no measured multi-rank ddp run of its family,
the smallest of them: DDP's per-step host cost has no ceiling (docs/PREDICT.md); the same for
a torch-engine pipeline candidate: its runtime's forward host work (one rank, one stage,
GPipe, at the candidate's micro-batches), and a
DTensor candidate of a model of repeated blocks: DTensor's host work per all-reduce. A candidate
whose rank computes a smaller model is calibrated on that model (the strategy model's
`calibrated_on`): a tensor rank of the mlp on `tensor --ranks 1` at its shard's ceil(H/N)
units and its replica's batch (the hand-written split: it splits the mlp only; a block
model's tensor candidates are calibrated on the plain run). A one-rank fsdp or `tensor
--engine torch` run in the pool does not stand for a family's plain run (it calibrates its
strategy's host cost; Pool.candidates), and DTensor's multi-rank run is asked for even where
a one-rank DTensor run could calibrate its host cost (predict prefers the multi-rank run: it
sees the collectives on a real group). Each is run a few times in rounds and the median run
kept (measure_medians).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from scalelab.config import RunConfig
from scalelab.orchestration.sweep import Point, run_point, slow_note
from scalelab.plan.applies import refusal
from scalelab.plan.space import PlanSpec
from scalelab.predict.calibration import (
    Pool,
    anchor_key,
    dtensor_calibrated,
    host_calibrated,
)
from scalelab.predict.figures import Figures
from scalelab.predict.model_registry import modelled_by
from scalelab.predict.models.blocks import is_block_model
from scalelab.predict.scenario import Scenario
from scalelab.record import append_record
from scalelab.strategies import STRATEGIES

if TYPE_CHECKING:
    from scalelab.instrument.concurrency import StepKernel


def needed_batch(cfg: RunConfig) -> int:
    """Items one rank computes at once under cfg (the batch its compute law is read at)."""
    replica = max(1, cfg.batch // max(1, cfg.dp))  # --dp D: each replica B / D items
    if STRATEGIES.get(cfg.strategy).pipelined:
        return max(1, replica // min(cfg.microbatches, replica))
    if STRATEGIES.get(cfg.strategy).ddp_buckets:
        return max(cfg.batch // cfg.ranks, 1)
    if STRATEGIES.get(cfg.strategy).by_heads:
        return replica
    if cfg.split in ("spatial", "broadcast"):
        return cfg.batch
    return math.ceil(cfg.batch / cfg.ranks)


def one_rank(spec: PlanSpec, cfg: RunConfig, batch: int, split: str = "batch") -> RunConfig:
    """The one-rank run that calibrates cfg's family at `batch` items (cfg as `calibrated_on`
    gives it)."""
    if STRATEGIES.get(cfg.strategy).by_heads and cfg.workload == "mlp":
        # One rank of the hand-written split at its shard's size: the shard's step with the
        # split's own per-step work (its L2 share, the logits' all-reduce), which a plain
        # mlp of that width does not do (on this 2-core host: 2.5 ms a step against 3.3 ms
        # for a rank of the 2-rank split).
        return spec.config(strategy="tensor", engine="scalelab", dp=1, tp=None, ranks=1,
                           batch=batch, threads=cfg.threads, dtype=cfg.dtype,
                           hidden=cfg.hidden)  # fmt: skip
    if cfg.train:
        strategy = "ddp" if spec.gpu else "mpi-dp"
        keep = {"fast": cfg.fast, "compile": cfg.compile, "amp": cfg.amp} if spec.gpu else {}
        return spec.config(strategy=strategy, ranks=1, batch=batch, threads=cfg.threads,
                           dtype=cfg.dtype, hidden=cfg.hidden, **keep)  # fmt: skip
    strategy = "mpi-gpu" if spec.gpu else "mpi"
    return spec.config(strategy=strategy, ranks=1, batch=batch, split=split,
                       threads=cfg.threads, dtype=cfg.dtype, hidden=cfg.hidden)  # fmt: skip


def missing(spec: PlanSpec, pool: Pool, cfgs: list[RunConfig], per_node: int) -> list[RunConfig]:
    """The measurements (see the module docstring) that no point in the pool stands for,
    for the candidates that would start (a refused one needs none: a user's model with no
    convolution trunk gets no one-rank spatial run)."""
    fams: dict[tuple, list[RunConfig]] = {}
    for cfg in [calibrated_on(c) for c in cfgs if refusal(c) is None]:
        fams.setdefault(Scenario(cfg, cfg.ranks, per_node).family(), []).append(cfg)
    todo: list[RunConfig] = []
    for fam, members in fams.items():
        have = [p for p in pool.singles if p.family == fam and p.bare]
        batches = sorted({needed_batch(c) for c in members})
        if not have:
            todo += [one_rank(spec, members[0], b) for b in sorted({batches[0], batches[-1]})]
        spatial = [c for c in members if c.split == "spatial" and not c.train]
        if spatial and not any(p.split == "spatial" for p in have):
            todo.append(one_rank(spec, spatial[0], spatial[0].batch, split="spatial"))
        todo += _host_anchors(pool, members, per_node)
    return _unique(todo)


def lacking_comm(statuses: list[str]) -> list[str]:
    """The backends whose communication fits the ceilings lack, from the ranking's reasons
    for leaving candidates out (figures.Figures.comm_fit: `... lacks comm.nccl.allreduce`)."""
    import re

    found = {m for text in statuses for m in re.findall(r"lacks comm\.([\w-]+)\.", str(text))}
    return sorted(found)


def comm_command(backend: str, ceilings: str, ranks: int = 2) -> list[str]:
    """The command that measures `backend`'s fits into the ceilings file (--comm-only keeps
    every other figure the file holds)."""
    return ["scalelab", "ceilings", "--ranks", str(ranks), "--backend", backend, "--comm-only",
            "-o", ceilings]  # fmt: skip


def calibrated_on(cfg: RunConfig) -> RunConfig:
    """The run cfg's compute is calibrated on (predict's strategy model says)."""
    from scalelab.predict.model_registry import modelled_as
    from scalelab.predict.models.base import model_for

    return model_for(cfg.strategy).calibrated_on(cfg) if modelled_as(cfg.strategy) else cfg


def _host_anchors(pool: Pool, members: list[RunConfig], per_node: int) -> list[RunConfig]:
    """Host-side costs have no ceiling (DDP's per step, torch pipelining's per forward):
    one measured multi-rank run per strategy model of the family calibrates each, the one
    predict's model reads (Pool.host_anchor)."""
    todo = _pipelining_host(pool, members, per_node)
    anchored = [c for c in members if host_calibrated(c)]
    for model in sorted({modelled_by(c.strategy) for c in anchored} - {"pipeline"}):
        first = min((c for c in anchored if modelled_by(c.strategy) == model),
                    key=anchor_key)  # fmt: skip
        if pool.host_anchor(Scenario(first, first.ranks, per_node)) is None:
            todo.append(first)
    return todo + _dtensor_anchor(pool, members, per_node)


def _pipelining_host(pool: Pool, members: list[RunConfig], per_node: int) -> list[RunConfig]:
    """torch pipelining's forward host work (predict/models/pipeline.py): one rank, one
    stage, GPipe (its forwards issued back to back show a host-bound forward), at the first
    torch-engine pipeline candidate's batch and micro-batches; one GPU suffices."""
    pipes = [c for c in members if STRATEGIES.get(c.strategy).pipelined_by_torch(c)]
    if not pipes:
        return []
    first = min(pipes, key=anchor_key)
    if pool.pipelining_host(Scenario(first, first.ranks, per_node)) is not None:
        return []
    return [dataclasses.replace(first, ranks=1, stages=1, schedule="gpipe", virtual_stages=1,
                                dp=1, balance="auto", cut=None)]  # fmt: skip


def _dtensor_anchor(pool: Pool, members: list[RunConfig], per_node: int) -> list[RunConfig]:
    """DTensor's host work per all-reduce of a model of repeated blocks (predict's tensor
    model by heads): its fewest-rank candidate of one replica, when the pool has no such run."""
    heads = [c for c in members if dtensor_calibrated(c) and is_block_model(c)]
    if not heads:
        return []
    first = min(heads, key=lambda c: (c.ranks, c.batch))
    return [first] if pool.dtensor_anchor(Scenario(first, first.ranks, per_node)) is None else []


def _unique(cfgs: list[RunConfig]) -> list[RunConfig]:
    seen, out = set(), []
    for cfg in cfgs:
        if repr(cfg) not in seen:
            seen.add(repr(cfg))
            out.append(cfg)
    return out


def measure(cfg: RunConfig, results: Path, timeout: float | None = None) -> dict | str:
    """Run cfg as `scalelab run` (its launcher started as on the command line), appending
    its record to `results`; the record, or the error line of a run that failed."""
    cfg = dataclasses.replace(cfg, quiet=True)
    point = Point(0, {}, cfg)
    line = f"  running: scalelab {' '.join(point.argv())}..."
    with slow_note(logging.getLogger("scalelab.plan").info, line):
        outcome = run_point(point, results, timeout)
    return outcome.record if outcome.record is not None else (outcome.error or "failed")


def measure_medians(
    cfgs: list[RunConfig],
    results: Path,
    repeats: int,
    run: Callable[[RunConfig], dict | str],
    echo: Callable[[str], None] = lambda _: None,
) -> list[dict | str]:
    """Each cfg measured `repeats` times in rounds (order rotated per round, as verify.py),
    and the run of median throughput appended to `results` as the calibration point: one
    run on a shared host can be slowed by load from elsewhere, the median of three rarely
    is. Per cfg: that record, or the last error when every run failed."""
    runs: list[list[dict]] = [[] for _ in cfgs]
    errors: list[str] = ["not run" for _ in cfgs]
    for r in range(repeats):
        for i in [(i + r) % len(cfgs) for i in range(len(cfgs))]:
            out = run(cfgs[i])
            if isinstance(out, dict):
                runs[i].append(out)
            else:
                errors[i] = out
            shown = f"{rate(out):.4g}/s" if isinstance(out, dict) else f"FAILED: {out}"
            echo(f"  round {r + 1}/{repeats}: {_label(cfgs[i])}: {shown}")
    chosen: list[dict | str] = []
    for recs, error in zip(runs, errors):
        median = median_run(recs)
        if median is not None:
            append_record(results, median)
        chosen.append(error if median is None else median)
    return chosen


def median_run(runs: list[dict]) -> dict | None:
    """The run of median throughput (the lower middle of an even count); None for none."""
    if not runs:
        return None
    return sorted(runs, key=rate)[(len(runs) - 1) // 2]


def rate(rec: dict) -> float:
    """A run's items per second as a plan compares them: a training run's steady rate
    (train/headline.py: the warm-up left out, as the calibration's step is: a user trains
    for hours, and 100 steps of resnet18-cifar --compile on an H100 are mostly compiling),
    an inference run's median iteration."""
    steady = rec.get("steady_throughput") if rec.get("mode") == "train" else None
    return float(steady if steady is not None and math.isfinite(steady) else rec["throughput"])


def _label(cfg: RunConfig) -> str:
    from scalelab.plan.rank import label

    return label(cfg)


def contention_kernel(spec: PlanSpec) -> StepKernel:
    """What the plan's contention curve times: the step one rank of the plain configuration
    computes (its calibration run's model, one thread, its per-rank batch)."""
    from scalelab.instrument.concurrency import StepKernel
    from scalelab.plan.candidates import plain

    cfg = calibrated_on(plain(spec))
    return StepKernel(dataclasses.replace(cfg, threads=1), needed_batch(cfg))


def contention_threads(spec: PlanSpec) -> list[int]:
    """Threads per rank of the candidates with several ranks on a node (1 always): a curve
    is measured for each (`host_contention`)."""
    return sorted({1} | {t for n, t in spec.layouts() if t and min(n, spec.per_node) > 1})


def host_contention(
    figures: Figures,
    cores: int,
    path: Path,
    repeats: int = 3,
    kernel: StepKernel | None = None,
    threads: list[int] | tuple[int, ...] = (1,),
) -> Figures:
    """The figures with this host's `cpu_concurrency` curve measured now (`repeats` times,
    the median slowdown at each process count kept; saved to `path`), timing `kernel` (the
    workload's own step: contention_kernel): on a shared host how much ranks slow each other
    changes with the load from elsewhere, and one 0.4 s snapshot of it can be off by several
    times. For each thread count above 1 in `threads`, a curve of processes of that many
    threads as well (`by_threads`): two ranks of two threads on 4 cores of the 16-core device
    computed ~1.6x slower than one, where single-threaded processes at 4 showed 1.06x more
    than at 2."""
    curve = _median_curve(cores, repeats, kernel, 1)
    curve["by_threads"] = {
        str(t): _median_curve(cores, repeats, kernel, t)
        for t in threads
        if t > 1 and cores // t > 1
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(curve, indent=1))
    return with_contention(figures, path)


def _median_curve(cores: int, repeats: int, kernel, threads: int) -> dict:
    from scalelab.instrument import concurrency

    curves = concurrency.measure_curves(cores, repeats, kernel=kernel, threads=threads)
    curve = dict(curves[0])
    for key in ("slowdown", "slowdown_max", "seconds", "slowdown_lockstep", "seconds_lockstep"):
        if key in curve:  # slowdown_lockstep: a step's curve only (timed in lockstep rounds)
            curve[key] = [float(x) for x in np.median([c[key] for c in curves], axis=0)]
    curve["method"] += f"; the median of {repeats} such curves, one after another"
    return curve


def with_contention(figures: Figures, path: Path) -> Figures:
    """The figures with the curve saved at `path` in place of the ceilings' own."""
    curve = json.loads(path.read_text())
    return Figures({**figures.data, "cpu_concurrency": curve}, figures.path,
                   f" (cpu_concurrency: {path})")  # fmt: skip
