"""Choosing the cut: a given --balance, or --balance auto (each layer timed on one
micro-batch on the root, split by time within memory), then --rebalance rounds that time the
cut in real pipelined passes and re-cut (partition.recut_step). Also the shapes crossing each
boundary, learnt by running one item through stage after stage."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from scalelab.comm.base import even_counts
from scalelab.layout import partition as part
from scalelab.layout import profiling
from scalelab.strategies.pipeline.stage import Meta, make_lanes
from scalelab.strategies.pipeline.stage_plan import StagePlan
from scalelab.workloads.base import Inputs
from scalelab.workloads.layers import Layer

if TYPE_CHECKING:
    from scalelab.strategies.pipeline.host import PipelineHost

__all__ = ["initial_plan", "make_lanes", "probe_shapes", "rebalance"]


def _say(s: PipelineHost, done: int, total: int, what: str) -> None:
    """A line on the root before each slow setup stage (CPU: seconds to minutes each)."""
    if s.is_root and not s.cfg.quiet:
        print(f"pipeline setup {done}/{total}: {what}", file=sys.stderr, flush=True)


def initial_plan(s: PipelineHost, layers: list[Layer], sample: torch.Tensor | None) -> StagePlan:
    """The cut before any --rebalance round: --balance as given, or auto on the root."""
    cfg = s.cfg
    counts = part.given_counts(cfg.balance, cfg.cut, [x.path for x in layers], cfg.stages)
    plan = StagePlan(layers, counts or [], auto=counts is None)
    if counts is None:
        if s.is_root:
            _say(s, 1, 2 + cfg.rebalance, f"timing {len(layers)} layers on one micro-batch")
            auto_counts(s, plan, sample)
        plan.counts = s.comm.bcast_object(plan.counts if s.is_root else None)
    return plan


def auto_counts(s: PipelineHost, plan: StagePlan, sample: torch.Tensor) -> None:
    """Root: measure every layer on one micro-batch, then split by time within memory."""
    cfg = s.cfg
    n = even_counts(len(sample), cfg.microbatches)[0]
    x = s.prepare(sample[:n].to(s.device))
    plan.profile = profiling.profile_layers(
        plan.layers, x, s.device, s.precision.storage, cfg.train, s.autocast,
        channels_last=cfg.channels_last,
    )  # fmt: skip
    plan.mem = part.memory_model(
        profiling.device_capacity(s.device, profiling.env_mem_limit()),
        cfg.stages, cfg.microbatches, cfg.train, cfg.schedule, cfg.momentum,
    )  # fmt: skip
    plan.counts = part.balance_auto(plan.profile, cfg.stages, plan.mem)


def rebalance(s: PipelineHost, sample: torch.Tensor | None) -> None:
    """--rebalance R: time the cut in a real pipelined pass, re-cut the profile fitted to
    every cut timed so far (partition.rebalance), time the new cut; at most R times. Keep
    the fastest cut timed (the smallest slowest stage). A re-cut that lands on a cut
    already timed ends the search early. Every cut tried is recorded with its times."""
    timed: dict[tuple[int, ...], float] = {}  # cut -> its slowest stage's seconds
    plan, rounds = s.plan, s.cfg.rebalance
    for round_ in range(rounds + 1):
        _say(s, round_ + 2, 2 + rounds, f"timing the cut {plan.counts} in a pipelined pass")
        measured = s.comm.gather_object(time_stage(s, sample))
        decision = None
        if s.is_root:
            decision = part.recut_step(
                plan.profile, plan.rounds, timed, plan.counts, measured,
                round_ == rounds, plan.mem,
            )  # fmt: skip
        counts, done = s.comm.bcast_object(decision)
        if counts != plan.counts:
            s.place(counts, sample)
        if done:
            return


def time_stage(s: PipelineHost, sample: torch.Tensor | None) -> float:
    """This stage's forward (+ backward) seconds per micro-batch inside a real pipelined
    pass of the sample batch, schedule and point-to-point and all (training: zero labels,
    no optimizer step, the gradients dropped). The second of two passes counts: the first
    allocates, autotunes and, under --compile, compiles the cut (CPU: one pass). Timed
    alone, a stage does not run as it runs in place: VGG-16's FC stage took ~1.5x its
    in-pipeline time per micro-batch on an H200 (cause not found), and a re-cut from those
    times kept a 60/40 split of the work (docs/PERFORMANCE.md)."""
    n = s.comm.bcast_object(len(sample) if s.is_root else None)
    # On a CPU nothing autotunes or compiles (without --compile): one pass is as good as
    # two there, and a rebalance round of a 5-step CPU run cost as much as the steps.
    passes = 1 if s.device.type == "cpu" and not s.cfg.compile else 2
    for _ in range(passes):
        s.timer.lap()
        if s.cfg.train:
            labels = s.workload.blank_targets(n)
            batch = Inputs(s.device_batch(sample), labels) if s.is_root else None
            s.pipelined_pass(batch, n)
        else:
            s.forward_batch(sample, n)
        s.timer.settle()
    lap = s.timer.lap()
    s.timer.discard()
    s.placed.module.zero_grad(set_to_none=True)
    return (lap.get("forward", 0.0) + lap.get("backward", 0.0)) / min(s.cfg.microbatches, n)


def probe_shapes(s: PipelineHost, stage: nn.Module, sample: torch.Tensor | None) -> list[Meta]:
    """Each stage's output (per-item shape, dtype), learnt by running one item through
    stage after stage (stage r > 0 on zeros of the shape stage r-1 announced)."""
    metas: list[Any] = []
    for r in range(s.comm.size):
        meta = None
        if s.comm.rank == r:
            if r == 0:
                x = s.prepare(sample[:1].to(s.device))
            else:
                tail, dtype = metas[-1]
                x = torch.zeros((1, *tail), dtype=dtype, device=s.device)
            with torch.no_grad(), s.autocast():
                y = stage.eval()(x)
            stage.train(s.cfg.train)
            meta = (tuple(y.shape[1:]), y.dtype)
        metas.append(s.comm.bcast_object(meta, root=r))
    return metas
