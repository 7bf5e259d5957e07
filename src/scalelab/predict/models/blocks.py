"""Costs of a model built from repeated blocks (a transformer: workloads/block_layers.py's
block view, one cost row per block), shared by the pipeline and tensor models and by plan's
memory estimate.

    pipeline   the torch engine's own cut (`--balance auto`): the rows balanced by
               FlopCounter's FLOPs, then each stage moved to begin at a module the tracer
               splits before (layout/partition.snap_counts); `--cut NAMES` as given.
               The activation a cut sends is the input of the module the next stage begins
               at (a block's input: B x T x C per micro-batch).
    tensor     the plan the ranks would run (strategies/tensor_plans/: a model's declared
               HF plan, else the derived heads plan), read through tensor_plans/shares.py:
               of each block row, the share of its projections the plan splits divides by
               the tp ranks, the rest of the row runs whole; a row outside the blocks runs
               whole unless the plan shards its module (a declared plan's embedding or
               head), then it divides. Per block the plan splits, two all-reduces of the
               block's activation (B x T x C) forward, after the attention's output
               projection and after the MLP's down projection (RowwiseParallel), and two
               more backward when training (the gradients of the column-wise projections'
               inputs); per sharded row outside the blocks, one of its output forward (an
               embedding's partial sums; a head's logits gathered, an all-gather counted as
               an all-reduce of the same bytes: an upper bound) and, training, one of its
               input. A block's own norms count in its row: FlopCounter counts them as a few
               FLOPs per value, far below its matmuls.
"""

from __future__ import annotations

import dataclasses
import functools

from scalelab.config import RunConfig
from scalelab.errors import UsageError
from scalelab.layout.partition import (
    LayerProfile,
    balance_auto,
    bounds,
    cut_counts,
    memory_model,
    snap_counts,
)
from scalelab.predict.compute_model import ComputeModel, roofline_layers
from scalelab.predict.scenario import Scenario, build_workload
from scalelab.workloads.base import LayerCost
from scalelab.workloads.blocks import undivided_heads as _undivided

BLOCK = "block"  # the kind of a block's row in the block view


def is_block_model(cfg: RunConfig) -> bool:
    """The workload is a user's model seen through its block view."""
    return getattr(build_workload(cfg), "blocks", None) is not None


def block_rows(cfg: RunConfig) -> list[LayerCost]:
    return build_workload(cfg).cost_table()


def stage_counts(cfg: RunConfig, stages: int) -> tuple[list[int], str]:
    """(layers per stage, where the cut comes from) as the torch engine cuts a block model:
    --cut when it names stages - 1 modules, else FLOP-balanced and snapped to the cut points."""
    workload = build_workload(cfg)
    layers = workload.layers(workload.meta_model())
    names = [n for n in (cfg.cut or "").split(",") if n.strip()]
    if cfg.cut and len(names) == stages - 1:
        return cut_counts(cfg.cut, [x.path for x in layers], stages), "--cut"
    rows = workload.cost_table()
    profiles = [LayerProfile(r.name, float(r.flops), 0, 0) for r in rows]
    counts = balance_auto(profiles, stages, memory_model(None, stages, 1, False, "gpipe"))
    why = "balanced by FLOPs and begun at modules, as the torch engine's --balance auto cuts"
    return snap_counts(counts, layers, workload.blocks.cut_points), why


def cut_elems(cfg: RunConfig, counts: list[int]) -> list[int]:
    """Values per item crossing each cut: the input of the first row of the next stage."""
    rows = block_rows(cfg)
    return [rows[start].in_elems for start, _ in bounds(counts)[1:]]


def stage_params(cfg: RunConfig, counts: list[int]) -> list[int]:
    """Parameters each stage holds."""
    rows = block_rows(cfg)
    return [sum(r.params for r in rows[a:b]) for a, b in bounds(counts)]


def row_seconds(ctx, s: Scenario, compute: ComputeModel, batch: float) -> list[float]:
    """Seconds of each cost-table row at `batch` items: the one-rank time split by the
    calibration's measured layers when they are the cost table's, else by roofline."""
    costs = build_workload(s.cfg).cost_table()
    measured = compute.layer_times(batch)
    if [name for name, _ in measured] == [c.name for c in costs]:
        return [t for _, t in measured]
    roof = [t for _, t in roofline_layers(s, ctx.figures, batch)]
    scale = compute.seconds(batch) / max(sum(roof), 1e-30)
    return [t * scale for t in roof]


def shares(cfg: RunConfig) -> list[float]:
    """Per cost row, the fraction of its work the tensor plan divides over the tp ranks:
    a block's projections' share the plan splits, 1 for a row whose module the plan shards,
    0 for a row it leaves whole. Without a plan (no heads plan applies), every block whole
    divides, as the heads plan would split it."""
    from scalelab.strategies.tensor_plans.derived import tp_degree

    return list(_shares(build_workload(cfg), tp_degree(cfg), cfg.tp_plan))


@functools.lru_cache(maxsize=64)
def _shares(workload, tp: int, tp_plan: str | None) -> tuple[float, ...]:
    """shares() once per model and plan: deriving a plan builds the model on the meta device
    (validate asks for hundreds of records of a few models)."""
    import torch

    from scalelab.strategies.tensor_plans import shares as plan_shares

    cfg = dataclasses.replace(workload.cfg, tp=tp, tp_plan=tp_plan)
    rows = workload.cost_table()
    try:
        plan = plan_shares.plan_of(cfg, workload)
    except UsageError:  # tp does not divide the heads: refused by undivided_heads, not here
        plan = None
    if plan is None:
        return tuple(1.0 if r.kind == BLOCK else 0.0 for r in rows)
    with torch.device("meta"):
        per_block = plan_shares.block_shares(workload.build_model(), plan)
    styled = set(plan_shares.sharded_modules(plan))
    return tuple(
        per_block.get(r.name, 1.0) if r.kind == BLOCK else float(r.name in styled) for r in rows
    )


def tp_params(cfg: RunConfig, tp: int) -> float:
    """Parameters one tensor rank holds: each row's sharded share over tp, the rest whole."""
    return sum(r.params * (f / tp + 1 - f) for r, f in zip(block_rows(cfg), shares(cfg)))


def tp_allreduces(cfg: RunConfig, batch: float, itemsize: int) -> list[float]:
    """Bytes of every all-reduce of one step of `batch` items: per block the plan splits, two
    forward (the block's output activation, B x T x C), two more backward when training; per
    sharded row outside the blocks, its output forward and, training, its input backward."""
    per_block = 4 if cfg.train else 2
    out = []
    for r, f in zip(block_rows(cfg), shares(cfg)):
        if f <= 0:
            continue
        if r.kind == BLOCK:
            out += [batch * r.out_elems * itemsize] * per_block
        else:
            out += [batch * r.out_elems * itemsize] + (
                [batch * r.in_elems * itemsize] if cfg.train else []
            )
    return out


def undivided_heads(cfg: RunConfig, tp: int) -> str | None:
    """The heads plan's refusal: the attention module whose heads tp ranks do not divide."""
    return _undivided(build_workload(cfg).meta_model(), tp)
