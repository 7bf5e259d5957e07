"""`--split spatial`: the conv trunk cut into row slabs, halos exchanged before every window.

Per iteration (strategies/split/spatial.py; geometry from strategies/halo.py, the same plan
the run uses, so rows and halo volumes are exact):

    scatter   the input's rows, as the batch split (transport form, 1 byte per value)
    compute   sum over layers l of max over ranks r of  t_l * rows(l, r) / rows(l)
              + the input expansion (prepare) on each rank's rows incl. halo + head / N
              (a dense head, in weight blocks) or + tail (any other tail: the root runs
              it whole after the gather);
              every halo exchange is a synchronisation point, so each layer waits for its
              slowest rank (uneven rows: 13 rows over 8 ranks leaves some rank 2 = granularity)
    halo      per window layer, max over ranks of the messages it receives:
              alpha + (halo rows x C_in x width x B x itemsize) / beta per neighbour
              (intra- or inter-node link; staged through the host on mpi-gpu)
    allreduce two (B,) float64 sums per LayerNorm; one (B, fc_out) float32 for a dense head
    gather    every rank's (B, classes) partial logits to the root; before a tail, the final
              maps (B, C, rows, ...) instead
t_l: the one-rank record's own per-layer compute times (its timeline), else roofline shares.
"""

from __future__ import annotations

import math
from typing import Any

from scalelab.errors import UsageError
from scalelab.layout.halo import plan_trunk
from scalelab.layout.trunk import Trunk, trunk_for
from scalelab.predict.models.base import Context, Wire, item_bytes, output_width, storage_bytes
from scalelab.predict.models.split import COMM, SPLIT_CHECKS, SPLITS, scatter_in
from scalelab.predict.scenario import Prediction, Scenario, build_workload

PREPARE, HEAD = "prepare", "head"


def trunk_of(scenario: Scenario) -> Trunk:
    return trunk_for(build_workload(scenario.cfg), None)


def spatial_infeasible(scenario: Scenario) -> str | None:
    """Why the trunk cannot be cut over the scenario's ranks (rows per rank too few)."""
    try:
        plan_trunk(trunk_of(scenario).geometries(), scenario.ranks)
    except UsageError as exc:
        return str(exc).split(";")[0]
    return None


SPLIT_CHECKS["spatial"] = spatial_infeasible


def timeline_layers(rec: dict[str, Any], trunk: Trunk) -> tuple[tuple[str, float], ...] | None:
    """Per-step compute seconds of a one-rank spatial record, from its rank timeline: the
    input expansion, one segment per step (three per LayerNorm), the rest is the head."""
    timeline = (rec.get("rank_timeline") or [None])[0]
    if not timeline:
        return None
    segs = [end - start for name, start, end in timeline if name == "compute"]
    widths = [3 if step.kind == "norm" else 1 for step in trunk.steps]
    if len(segs) < 1 + sum(widths):
        return None
    rows, i = [(PREPARE, segs[0])], 1
    for step, w in zip(trunk.steps, widths):
        rows.append((step.name, sum(segs[i : i + w])))
        i += w
    rows.append((HEAD, sum(segs[i:])))
    return tuple(rows)


def _layer_split(layers: list[tuple[str, float]], trunk: Trunk) -> tuple[float, list[float], float]:
    """(prepare, per-step, head) seconds; cost-table rows outside the trunk are the head."""
    times = dict(layers)
    steps = [times.get(s.name, 0.0) for s in trunk.steps]
    names = {s.name for s in trunk.steps} | {PREPARE}
    head = sum(t for name, t in layers if name not in names)
    return times.get(PREPARE, 0.0), steps, head


def critical_compute(layers, trunk: Trunk, plans, n: int) -> float:
    prepare, steps, head = _layer_split(layers, trunk)
    geoms = trunk.geometries()
    t = max(prepare * (p.need[1] - p.need[0]) / geoms[0].in_size for p in plans[0])
    for t_l, plan, g in zip(steps, plans, geoms):
        t += max(t_l * (p.out[1] - p.out[0]) / max(g.out_size, 1) for p in plan)
    # A dense head runs in weight blocks over the ranks; any other tail (global pooling,
    # residual blocks) runs whole on the root after the gather, while the others wait.
    return t + (head if trunk.rest else head / n)


def tail_bytes(scenario: Scenario, trunk: Trunk) -> int:
    """Bytes of the trunk's final maps over the batch, gathered on the root before a tail:
    batch x channels x rows x trailing x itemsize (activations outside autocast)."""
    trailing = tuple(trunk.in_trailing)
    for step in trunk.steps:
        trailing = step.out_trailing(trailing)
    rows = trunk.geometries()[-1].out_size
    values = trunk.steps[-1].out_channels * rows * math.prod(trailing)
    return scenario.cfg.batch * values * storage_bytes(scenario)


def halo_bytes(scenario: Scenario, trunk: Trunk, plans) -> list[list[int]]:
    """Bytes each rank receives at each window step: rows x channels x trailing x batch x
    itemsize (the first exchange carries the 1-byte transport form)."""
    x = build_workload(scenario.cfg).synthetic_inputs(1, 0).x  # (1, C, H, W) or (1, L)
    channels = x.shape[1] if x.dim() > 2 else 1
    trailing, itemsize = tuple(trunk.in_trailing), x.element_size()
    out = []
    for i, (step, plan) in enumerate(zip(trunk.steps, plans)):
        if step.kind == "window":
            row = channels * math.prod(trailing) * scenario.cfg.batch * itemsize
            out.append([(p.halo_up + p.halo_down) * row for p in plan])
        channels, trailing = step.out_channels, step.out_trailing(trailing)
        itemsize = storage_bytes(scenario) if i == 0 else itemsize
    return out


def halo_seconds(ctx: Context, s: Scenario, wire: Wire, trunk: Trunk, plans) -> float:
    fabric, per = ctx.fabric(s, wire.backend), s.per_node
    total = 0.0
    windows = [p for step, p in zip(trunk.steps, plans) if step.kind == "window"]
    for plan, got in zip(windows, halo_bytes(s, trunk, plans)):
        worst = 0.0
        for r, rows in enumerate(plan):
            msgs = [(r - 1, rows.halo_up), (r + 1, rows.halo_down)]
            share = [h for _, h in msgs if h]
            t = sum(fabric.p2p(got[r] * h / sum(share), r // per != q // per) for q, h in msgs if h)
            worst = max(worst, t + wire.stage(ctx.figures, got[r]))
        total += worst
    return total


@SPLITS.register("spatial", "halo-exchange domain decomposition of the conv trunk")
def spatial_split(ctx: Context, s: Scenario, wire: Wire) -> Prediction:
    cfg, n = s.cfg, s.ranks
    trunk = trunk_of(s)
    plans = plan_trunk(trunk.geometries(), n)
    compute = ctx.compute(s, spatial=True)
    layers = compute.layer_times(cfg.batch)
    fabric, wide = ctx.fabric(s, wire.backend), 4  # reductions travel as float32 or wider
    costs = build_workload(cfg).cost_table()
    fc_out = next((c.out_elems for c in costs if c.kind == "linear"), 0)
    norms = sum(step.kind == "norm" for step in trunk.steps)
    head_sum = 0 if trunk.rest else cfg.batch * fc_out * wide  # a tail sums nothing
    allreduce = 2 * norms * fabric.allreduce(8 * cfg.batch, n)
    allreduce += fabric.allreduce(head_sum, n) if head_sum else 0.0
    # the root gathers every rank's partial logits, or the final maps a tail starts from
    gathered = tail_bytes(s, trunk) if trunk.rest else cfg.batch * output_width(s) * wide * n
    phases = {
        "scatter": scatter_in(ctx, s, wire, cfg.batch * item_bytes(s)),
        "compute": critical_compute(layers, trunk, plans, n),
        "halo": halo_seconds(ctx, s, wire, trunk, plans),
        "allreduce": allreduce + (wire.stage(ctx.figures, head_sum) if n > 1 else 0.0),
        "gather": fabric.scatter(gathered, n),
        "overhead": compute.overhead_s,
    }
    return Prediction(s, phases, COMM, compute.sources, list(compute.notes))
