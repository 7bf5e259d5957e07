"""`pipeline` (layers cut into K stages, M micro-batches) and `tensor` (the MLP's hidden units
split over N ranks).

pipeline, one step of B items, K = ranks stages, M micro-batches of m = B / M:
    t_s        the slowest stage's time per micro-batch: t(m) x its share of the layers,
               stages cut where they balance the cost table's roofline times (contiguous
               layers, minimising the largest stage; the run's --balance auto equalises
               measured times the same way)
    compute    M t_s;  bubble (K - 1) t_s: the fill and drain of GPipe and 1F1B alike, i.e.
               the bubble fraction (K-1)/(M+K-1) of the formula
    p2p        the activations crossing each cut on the fill path (m x the cut layer's output,
               compute dtype), and their gradients back when training; the other micro-batches'
               sends overlap compute
tensor, per step: the fixed part of t(B) and 1/N of the rest (each rank has 1/N of the
hidden units, so 1/N of the FLOPs at the full batch), and one all-reduce of the (B, classes)
partial logits (+1 value for the L2 term) over MPI; its backward sends nothing.
"""

from __future__ import annotations

from scalelab.precision import get_precision
from scalelab.predict.compute_model import build_workload, roofline_layers
from scalelab.predict.models.base import (
    MODELS,
    Context,
    OverMPI,
    StrategyModel,
    output_width,
)
from scalelab.predict.scenario import Prediction, Scenario


def balanced_loads(weights: list[float], k: int) -> tuple[list[float], list[int]]:
    """Cut weights into k contiguous groups minimising the largest sum: (sums, last index of
    every group but the last). Dynamic programme over prefix sums."""
    n = len(weights)
    pre = [0.0]
    for w in weights:
        pre.append(pre[-1] + w)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    cut = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    for j in range(1, k + 1):
        for i in range(j, n + 1):
            for m in range(j - 1, i):
                cost = max(best[j - 1][m], pre[i] - pre[m])
                if cost < best[j][i]:
                    best[j][i], cut[j][i] = cost, m
    bounds, i = [], n
    for j in range(k, 0, -1):
        bounds.append(cut[j][i])
        i = cut[j][i]
    bounds = sorted(bounds)[1:] + [n]
    starts = [0, *bounds[:-1]]
    return [pre[b] - pre[a] for a, b in zip(starts, bounds)], [b - 1 for b in bounds[:-1]]


@MODELS.register("pipeline", "GPipe/1F1B stages: micro-batches, bubble, stage-to-stage sends")
class PipelineModel(StrategyModel):
    def infeasible(self, scenario: Scenario) -> str | None:
        layers = len(build_workload(scenario.cfg).cost_table())
        if scenario.ranks > layers:
            return f"{scenario.ranks} stages but the model has {layers} layers"
        return None

    def predict(self, ctx: Context, s: Scenario) -> Prediction:
        cfg, k = s.cfg, s.ranks
        m = min(cfg.microbatches, cfg.batch)
        micro = cfg.batch / m
        compute = ctx.compute(s)
        roof = roofline_layers(s, ctx.figures, micro)
        loads, cuts = balanced_loads([t for _, t in roof], k)
        t_stage = compute.seconds(micro) * max(loads) / max(sum(loads), 1e-30)
        phases = {"compute": m * t_stage, "bubble": (k - 1) * t_stage}
        phases["p2p"] = self._fill_sends(ctx, s, cuts, micro) if k > 1 else 0.0
        phases["overhead"] = compute.overhead_s
        pred = Prediction(s, phases, frozenset({"p2p"}), compute.sources, list(compute.notes))
        pred.extra = {"slowest_stage_share": max(loads) / max(sum(loads), 1e-30)}
        return pred

    def _fill_sends(self, ctx: Context, s: Scenario, cuts: list[int], micro: float) -> float:
        costs = build_workload(s.cfg).cost_table()
        itemsize = get_precision(s.precision).itemsize
        fabric = ctx.fabric(s, self.wire(s).backend)
        t = 0.0
        for stage, last in enumerate(cuts):
            nbytes = micro * costs[last].out_elems * itemsize
            crosses = stage // s.per_node != (stage + 1) // s.per_node
            t += fabric.p2p(nbytes, crosses) * (2 if s.cfg.train else 1)
        return t


@MODELS.register("tensor", "the MLP's hidden units over ranks: one all-reduce per step")
class TensorModel(OverMPI):
    def infeasible(self, scenario: Scenario) -> str | None:
        if scenario.ranks > scenario.cfg.hidden:
            return f"{scenario.ranks} ranks but only {scenario.cfg.hidden} hidden units"
        return None

    def predict(self, ctx: Context, s: Scenario) -> Prediction:
        compute = ctx.compute(s)
        wire = self.wire(s)
        nbytes = (s.cfg.batch * output_width(s) + 1) * 4
        reduce = ctx.fabric(s, wire.backend).allreduce(nbytes, s.ranks) if s.ranks > 1 else 0.0
        phases = compute.phases(s.cfg.batch)  # the fixed part does not shrink with the split
        phases["compute"] /= s.ranks
        phases["allreduce"] = reduce + (wire.stage(ctx.figures, nbytes) if s.ranks > 1 else 0.0)
        phases["overhead"] = compute.overhead_s
        return Prediction(s, phases, frozenset({"allreduce"}), compute.sources, list(compute.notes))
