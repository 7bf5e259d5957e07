"""`pipeline`: the model's layers cut into K stages, one step of B items in M micro-batches of
m = B / M, run by the GPipe or 1F1B schedule.

    partition  the run's own: the record's `pipeline.balance` (layers per stage, over the
               layer list of the workload's layers()), else an explicit --balance, else
               (--balance auto) the cut that balances the roofline times (the run balances
               measured times the same way)
    t_s(m)     stage s's time per micro-batch: the one-rank time t(m) at the micro-batch
               size (calibration.py: t(m) = t_a + c (m - b_a), anchored at the measured batch
               nearest m, so the per-step fixed cost of a 64-image step is not scaled down to
               m) split over the cost table's layers by their measured times (a per-layer
               record) or roofline shares at m; s's share is the sum over its layers
    schedule   the same op lists the run executes (planning/schedule.py),
               simulated with forward t_s / 3 and backward 2 t_s / 3 per op (training FLOPs
               are 3x the forward; inference: forward t_s) and the activation send of one
               micro-batch across a cut on every dependency between stages
    phases     compute: the slowest stage's busy time M t_s; bubble: the rest of the
               schedule without sends (fill, drain and waiting behind unequal stages);
               p2p: what the sends add to it; overhead: the one-rank record's host time
With equal stages and free sends the schedule is (M + K - 1) t_s, the textbook bubble
(K - 1) / (M + K - 1); unequal stages are simulated, not bounded.
"""

from __future__ import annotations

import dataclasses

from scalelab.errors import UsageError
from scalelab.planning.partition import (
    LayerProfile,
    balance_auto,
    bounds,
    memory_model,
    parse_balance,
)
from scalelab.planning.schedule import SCHEDULES, simulate
from scalelab.precision import get_precision
from scalelab.predict.compute_model import ComputeModel, build_workload, roofline_layers
from scalelab.predict.models.base import MODELS, Context, StrategyModel
from scalelab.predict.models.mesh2d import replicated
from scalelab.predict.scenario import Prediction, Scenario

FORWARD_SHARE = 1 / 3  # a training op: forward 1, backward 2 forward-equivalents


def layer_names(scenario: Scenario) -> list[str]:
    """The name of each layer the pipeline cuts, as the run lists them (the workload's
    layers(); the model is built on the meta device: no weights are allocated)."""
    workload = build_workload(scenario.cfg)
    return [layer.name for layer in workload.layers(workload.meta_model())]


def row_layers(scenario: Scenario) -> list[int | None]:
    """The index in layer_names of the layer computing each cost-table row, paired by the
    layer's name; None for rows no layer computes (a softmax left to the loss)."""
    workload = build_workload(scenario.cfg)
    index = {name: i for i, name in enumerate(layer_names(scenario))}
    owners = [index[layer.name] for layer, _ in workload.layer_costs()]
    return owners + [None] * len(workload.tail_costs())


def row_stages(scenario: Scenario, counts: list[int]) -> list[int]:
    """The stage of every cost-table row (rows no layer computes go last)."""
    spans = bounds(counts)
    stage = lambda i: next(s for s, (a, b) in enumerate(spans) if a <= i < b)  # noqa: E731
    return [len(counts) - 1 if i is None else stage(i) for i in row_layers(scenario)]


def balanced_loads(weights: list[float], k: int) -> tuple[list[float], list[int]]:
    """Cut weights into k contiguous groups minimising the largest sum: (sums, last index of
    every group but the last). The strategy's own cut (`--balance auto`, no memory bound)."""
    profiles = [LayerProfile(str(i), w, 0, 0) for i, w in enumerate(weights)]
    counts = balance_auto(profiles, k, memory_model(None, k, 1, False, "gpipe"))
    spans = bounds(counts)
    return [sum(weights[a:b]) for a, b in spans], [b - 1 for _, b in spans[:-1]]


def partition(scenario: Scenario, row_times: list[float]) -> tuple[list[int], str]:
    """(layers per stage, where the cut comes from): the run's, an explicit --balance, or the
    roofline-balanced cut of the layer list (cut points after the balanced rows)."""
    k, n_layers = scenario.ranks, len(layer_names(scenario))
    if scenario.balance is not None:
        return list(scenario.balance), "the run's partition"
    spec, why = scenario.cfg.balance, "cut where the roofline times balance"
    if spec.strip() != "auto" and len(spec.split(",")) == k:
        return parse_balance(spec, n_layers, k), "--balance"
    if spec.strip() != "auto":  # a --balance for another stage count (predict --ranks 1,2,4)
        why += f"; --balance {spec} is not {k} stages"
    _, cuts = balanced_loads(row_times, k)
    return _layer_counts(scenario, cuts, n_layers), why


def _layer_counts(scenario: Scenario, row_cuts: list[int], n_layers: int) -> list[int]:
    """Layer counts putting each stage's last cost row last in the stage."""
    owners = row_layers(scenario)
    stops = [(n_layers - 1 if owners[c] is None else owners[c]) + 1 for c in row_cuts]
    stops.append(n_layers)
    return [b - a for a, b in zip([0, *stops[:-1]], stops)]


@MODELS.register("pipeline", "GPipe/1F1B stages: the run's partition, simulated schedule, sends")
class PipelineModel(StrategyModel):
    def infeasible(self, scenario: Scenario) -> str | None:
        try:
            layers = len(layer_names(scenario))
        except UsageError as exc:
            return str(exc)
        dp = max(1, scenario.cfg.dp)
        if scenario.ranks % dp:
            return f"{scenario.ranks} ranks do not split into --dp {dp} replicas"
        if scenario.ranks // dp > layers:
            return f"{scenario.ranks // dp} stages but the model has {layers} layers"
        return None

    def predict(self, ctx: Context, s: Scenario) -> Prediction:
        """--dp D: D replicas of the S-stage pipeline (mesh2d.py)."""
        unmodelled(s.cfg)
        return replicated(ctx, s, self._predict_stages, self.wire(s).backend)

    def _predict_stages(self, ctx: Context, s: Scenario) -> Prediction:
        cfg, k = s.cfg, s.ranks
        m = min(cfg.microbatches, cfg.batch)
        micro = cfg.batch / m
        compute = ctx.compute(_at_batch(s, micro))
        rows = self._row_times(ctx, s, compute, micro)
        counts, cut_from = partition(s, rows)
        owner = row_stages(s, counts)
        t_stage = [sum(t for t, o in zip(rows, owner) if o == st) for st in range(k)]
        fwd = [t * (FORWARD_SHARE if cfg.train else 1.0) for t in t_stage]
        bwd = [t - f for t, f in zip(t_stage, fwd)]
        send = self._send(ctx, s, owner, micro) if k > 1 else 0.0
        bare = simulate(cfg.schedule, m, fwd, bwd, cfg.train, 0.0)
        full = simulate(cfg.schedule, m, fwd, bwd, cfg.train, send)
        slow = max(range(k), key=lambda st: bare.busy[st])
        phases = {
            "compute": bare.busy[slow],
            "bubble": _clean(bare.makespan - bare.busy[slow]),
            "p2p": _clean(full.makespan - bare.makespan),
            "overhead": compute.overhead_s,
        }
        pred = Prediction(s, phases, frozenset({"p2p"}), compute.sources, list(compute.notes))
        pred.notes.append(f"pipeline stages: {counts} layers ({cut_from})")
        where = self._stage_text(s, counts, slow, t_stage[slow])
        pred.where = {"compute": where, "bubble": where}
        pred.extra = {"slowest_stage": slow, "slowest_stage_share": t_stage[slow] / sum(t_stage)}
        return pred

    @staticmethod
    def _row_times(ctx: Context, s: Scenario, compute: ComputeModel, micro: float) -> list[float]:
        """Seconds of each cost-table row per micro-batch: the one-rank time t(m) split by the
        calibration's measured layers when they are the cost table's, else by roofline."""
        costs = build_workload(s.cfg).cost_table()
        measured = compute.layer_times(micro)
        if [name for name, _ in measured] == [c.name for c in costs]:
            return [t for _, t in measured]
        roof = [t for _, t in roofline_layers(s, ctx.figures, micro)]
        scale = compute.seconds(micro) / max(sum(roof), 1e-30)
        return [t * scale for t in roof]

    def _send(self, ctx: Context, s: Scenario, owner: list[int], micro: float) -> float:
        """One micro-batch's activations over the costliest cut (compute dtype); the same
        bytes come back as gradients in training, on the same link."""
        costs = build_workload(s.cfg).cost_table()
        itemsize = get_precision(s.precision).itemsize
        fabric = ctx.fabric(s, self.wire(s).backend)
        worst = 0.0
        for st in range(s.ranks - 1):
            last = max(i for i, o in enumerate(owner) if o == st) if st in owner else 0
            crosses = st // s.per_node != (st + 1) // s.per_node
            worst = max(worst, fabric.p2p(micro * costs[last].out_elems * itemsize, crosses))
        return worst

    @staticmethod
    def _stage_text(s: Scenario, counts: list[int], slow: int, seconds: float) -> str:
        names = layer_names(s)
        a, b = bounds(counts)[slow]
        return (
            f"slowest stage: rank {slow} of {s.ranks}, {names[a]}..{names[b - 1]}, "
            f"{seconds * 1e3:.3g} ms per micro-batch"
        )


def unmodelled(cfg) -> None:
    """Refuse what the simulation does not cover: it replays scalelab's own op lists (GPipe,
    1F1B; torch's engine runs those same orders), one stage per rank. The other schedules'
    orders are torch's (a live schedule object's pipeline_order), not simulated here."""
    if cfg.schedule not in SCHEDULES:
        raise UsageError(
            f"predict simulates the {'/'.join(SCHEDULES)} schedules only; "
            f"--schedule {cfg.schedule} has no model yet"
        )
    if cfg.virtual_stages > 1:
        raise UsageError(f"predict has no model of --virtual-stages {cfg.virtual_stages} yet")


def _at_batch(s: Scenario, batch: float) -> Scenario:
    """The scenario with a per-step batch of `batch` items, so calibration anchors at the
    measured batch nearest the micro-batch."""
    return dataclasses.replace(s, cfg=dataclasses.replace(s.cfg, batch=max(1, round(batch))))


def _clean(seconds: float) -> float:
    """A difference of two simulated makespans: rounding residue below a nanosecond is 0."""
    return seconds if seconds > 1e-9 else 0.0
