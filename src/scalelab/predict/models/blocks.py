"""Costs of a model built from repeated blocks (a transformer: workloads/block_layers.py's
block view, one cost row per block), shared by the pipeline and tensor models and by plan's
memory estimate.

    pipeline   the torch engine's own cut (`--balance auto`): the rows balanced by
               FlopCounter's FLOPs, then each stage moved to begin at a module the tracer
               splits before (layout/partition.snap_counts); `--cut NAMES` as given.
               The activation a cut sends is the input of the module the next stage begins
               at (a block's input: B x T x C per micro-batch).
    tensor     the heads plan (strategies/tensor_plan.py): every block's attention by heads
               and its MLP, so a block row's compute and parameters divide by the tp ranks;
               what runs outside the blocks (embeddings, a position table, the final norm,
               the head) is replicated. Per block two all-reduces of the block's activation
               (B x T x C) forward, after the attention's output projection and after the
               MLP's down projection (RowwiseParallel), and two more backward when training
               (the gradients of the column-wise projections' inputs). A block's own norms
               count in its row: FlopCounter counts them as a few FLOPs per value, far below
               its matmuls.
"""

from __future__ import annotations

from scalelab.config import RunConfig
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


def sharded(cfg: RunConfig) -> list[bool]:
    """Per cost row: does the heads plan shard it (a block) or replicate it."""
    return [r.kind == BLOCK for r in block_rows(cfg)]


def tp_params(cfg: RunConfig, tp: int) -> float:
    """Parameters one tensor rank holds: the blocks' over tp, the rest whole."""
    rows = block_rows(cfg)
    return sum(r.params / tp if r.kind == BLOCK else r.params for r in rows)


def tp_allreduces(cfg: RunConfig, batch: float, itemsize: int) -> list[float]:
    """Bytes of every all-reduce of one step of `batch` items: per block two forward (the
    block's output activation, B x T x C), two more backward when training."""
    per_block = 4 if cfg.train else 2
    rows = [r for r in block_rows(cfg) if r.kind == BLOCK]
    return [batch * r.out_elems * itemsize for r in rows for _ in range(per_block)]


def undivided_heads(cfg: RunConfig, tp: int) -> str | None:
    """The heads plan's refusal: the attention module whose heads tp ranks do not divide."""
    return _undivided(build_workload(cfg).meta_model(), tp)
