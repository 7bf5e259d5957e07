"""`pipeline`: the model's layers cut into K stages (K x V under torch's multi-stage schedules:
V per rank), one step of B items in M micro-batches of m = B / M, run by the GPipe or 1F1B
schedule, or under `--engine torch` by any of torch's (interleaved-1f1b, looped-bfs,
zero-bubble, zbv, dualpipev).

    partition  the run's own: the record's `pipeline.balance` (layers per stage, over the
               layer list of the workload's layers()), else an explicit --balance, else
               (--balance auto) the cut that balances the roofline times (the run balances
               measured times the same way)
    t_s(m)     stage s's time per micro-batch: the one-rank time t(m) at the micro-batch
               size (calibration.py: t(m) = t_a + c (m - b_a), anchored at the measured batch
               nearest m, so the per-step fixed cost of a 64-image step is not scaled down to
               m) split over the cost table's layers by their measured times (a per-layer
               record) or roofline shares at m; s's share is the sum over its layers
    schedule   the same op lists the run executes (layout/schedule.py),
               simulated with forward t_s / 3 and backward 2 t_s / 3 per op (training FLOPs
               are 3x the forward; inference: forward t_s) and the activation send of one
               micro-batch across a cut on every dependency between stages
    phases     compute: the slowest stage's busy time M t_s; bubble: the rest of the
               schedule without sends (fill, drain and waiting behind unequal stages);
               p2p: what the sends add to it; overhead: the one-rank record's host time
With equal stages and free sends the schedule is (M + K - 1) t_s, the textbook bubble
(K - 1) / (M + K - 1); unequal stages are simulated, not bounded.

torch's multi-stage schedules are replayed from the lists torch lowers for them, transfers
included (layout/torch_schedule.py: torch_order(comms=True), replay): each of the K x V
stages takes its share of the rows; the split backward's input and weight halves (I, W) each
take half of the backward. Its runtime posts every transfer on its own, on one stream per pair
of ranks, each done when both ends reach it; on a GPU the engine's timing syncs the device
before each action, which waits for every transfer posted so far (lock-step ranks: VGG-16's
interleaved step measured 157.7 ms where the transfer-free dependency replay gave 89.8 ms).
With equal stages, free sends and no device sync, interleaved 1F1B over V stages per rank
comes to M + (K - 1) / V micro-batch times (Narayanan et al. 2021), the zero-bubble schedules
below it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from scalelab.errors import UsageError
from scalelab.layout.partition import (
    LayerProfile,
    balance_auto,
    bounds,
    memory_model,
    parse_balance,
)
from scalelab.layout.schedule import SCHEDULES, simulate
from scalelab.precision import get_precision
from scalelab.predict.calibration import MultiPoint
from scalelab.predict.compute_model import ComputeModel, build_workload
from scalelab.predict.models import blocks
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


def partition(
    scenario: Scenario, row_times: list[float], stages: int | None = None
) -> tuple[list[int], str]:
    """(layers per stage, where the cut comes from): the run's, an explicit --balance, or the
    roofline-balanced cut of the layer list (cut points after the balanced rows), over
    `stages` (default: one per rank)."""
    k, n_layers = stages or scenario.ranks, len(layer_names(scenario))
    if scenario.balance is not None:
        return list(scenario.balance), "the run's partition"
    if blocks.is_block_model(scenario.cfg):  # cut by torch's tracer at module boundaries
        return blocks.stage_counts(scenario.cfg, k)
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
    counts = [b - a for a, b in zip([0, *stops[:-1]], stops)]
    # A stage of rows no layer computes (the loss's) would hold no layer, which no engine
    # runs: it takes the last layer of the nearest stage before it that can spare one.
    for st in range(len(counts) - 1, 0, -1):
        while counts[st] < 1:
            donor = max((i for i in range(st) if counts[i] > 1), default=None)
            if donor is None:
                break
            counts[donor] -= 1
            counts[donor + 1] += 1
            for i in range(donor + 1, st):  # pass it along to st
                counts[i] -= 1
                counts[i + 1] += 1
    return counts


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
        stages = scenario.ranks // dp * held_stages(scenario.cfg)
        if stages > layers:
            return f"{stages} stages but the model has {layers} layers"
        if blocks.is_block_model(scenario.cfg):
            try:  # the workload's own refusal (--engine scalelab), then the tracer's cut
                build_workload(scenario.cfg).check_strategy("pipeline", scenario.cfg, stages=True)
                blocks.stage_counts(scenario.cfg, stages)
            except UsageError as exc:
                return str(exc)
        return None

    def predict(self, ctx: Context, s: Scenario) -> Prediction:
        """--dp D: D replicas of the S-stage pipeline (mesh2d.py)."""
        unmodelled(s.cfg)
        return replicated(ctx, s, self._predict_stages, self.wire(s).backend)

    def _predict_stages(self, ctx: Context, s: Scenario) -> Prediction:
        lay = self._layout(ctx, s)
        k, compute = s.ranks, lay.compute
        host, source, note = self._host(ctx, s, lay) if lay.torch else ({}, None, None)
        bare_s, busy = lay.replay(0.0, {})
        hosted_s, _ = lay.replay(0.0, host)
        full_s, _ = lay.replay(lay.send, host)
        slow = max(range(k), key=lambda r: busy[r])
        phases = {
            "compute": busy[slow],
            "bubble": _clean(bare_s - busy[slow]),
            "host": _clean(hosted_s - bare_s),
            "p2p": _clean(full_s - hosted_s),
            "overhead": compute.overhead_s,
        }
        pred = Prediction(s, phases, frozenset({"p2p"}), compute.sources, list(compute.notes))
        pred.notes.append(f"pipeline stages: {lay.counts} layers ({lay.cut_from})")
        pred.notes += [n for n in (note, self._refit(ctx, source)) if n]
        if source is not None:
            pred.calibration[source.source] = "pipelining host cost"
        mine = [st for st in range(len(lay.held)) if lay.held[st] == slow]
        seconds = sum(lay.t_stage[st] for st in mine)
        where = self._stage_text(s, lay.counts, slow, mine, seconds)
        pred.where = {"compute": where, "bubble": where}
        pred.extra = {"slowest_stage": slow, "slowest_stage_share": busy[slow] / sum(busy),
                      "cut_bytes": max(lay.cut_bytes, default=0.0)}  # fmt: skip
        return pred

    def _layout(self, ctx: Context, s: Scenario) -> _Layout:
        """The replica's stages: their times per micro-batch, the schedule's order, the send."""
        cfg, k, v = s.cfg, s.ranks, held_stages(s.cfg)
        m = min(cfg.microbatches, cfg.batch)
        micro = cfg.batch / m
        compute = ctx.compute(_at_batch(s, micro))
        rows = blocks.row_seconds(ctx, s, compute, micro)
        counts, cut_from = partition(s, rows, k * v)
        owner = row_stages(s, counts)
        t_stage = [sum(t for t, o in zip(rows, owner) if o == st) for st in range(k * v)]
        fwd = [t * (FORWARD_SHARE if cfg.train else 1.0) for t in t_stage]
        bwd = [t - f for t, f in zip(t_stage, fwd)]
        torch = cfg.engine == "torch"
        if not torch:  # scalelab's own op lists (GPipe, 1F1B)

            def replay_own(send: float, host: dict) -> tuple[float, list[float]]:
                sim = simulate(cfg.schedule, m, fwd, bwd, cfg.train, send)
                return sim.makespan, list(sim.busy)

            held, run = list(range(k)), replay_own
        else:  # torch's order for its schedules, the multi-stage ones with their transfers
            from scalelab.layout.torch_schedule import NO_EVAL, replay, torch_order

            actions = torch_order(cfg.schedule, k, v, m, comms=True)
            if not cfg.train and cfg.schedule not in NO_EVAL:  # eval(): the forwards alone
                forward = ("F", "SEND_F", "RECV_F")
                actions = {r: [a for a in acts if a[1] in forward] for r, acts in actions.items()}
            holder = {a[0]: r for r, acts in actions.items() for a in acts}  # stage -> rank
            held = [holder[st] for st in range(k * v)]
            seconds = _action_seconds(fwd, bwd, cfg)

            def replay_torch(send: float, host: dict) -> tuple[float, list[float]]:
                makespan, busy = replay(actions, seconds, k * v, send, host=host)
                return makespan, [busy[r] for r in range(k)]

            run = replay_torch
        costs = build_workload(s.cfg).cost_table()
        itemsize = get_precision(s.precision).itemsize
        cuts = [micro * n * itemsize for n in self._cut_elems(s, owner, costs, len(held) - 1)]
        send = self._send(ctx, s, cuts, held) if k > 1 else 0.0
        return _Layout(compute, counts, cut_from, t_stage, held, send, run, torch, cuts)

    def _host(self, ctx: Context, s: Scenario, lay: _Layout) -> tuple[dict, object, str]:
        """({(stage, "F"): seconds}, the run they come from, a note): the host time torch's
        pipelining runtime takes to issue one micro-batch's forward through each stage
        (its Python: every module call, the stage's input and output handling), calibrated
        on a torch-engine pipeline run of the family (Pool.pipelining_host: a one-rank run
        first). H = that run's forward actions per micro-batch summed over its stages; a
        stage issues its share of it, its share of the rows' device time. The backward is
        autograd's C++ engine and is taken as device-bound. A forward whose device time
        exceeds its host share is device-bound (the replay takes the later: HostLead)."""
        point = ctx.pool.pipelining_host(s)
        if point is None:
            return {}, None, NO_HOST
        total = sum(lay.t_stage) or 1.0
        share = {(st, "F"): point.forward_host_s * t / total for st, t in enumerate(lay.t_stage)}
        run = point.scenario if isinstance(point, MultiPoint) else Scenario(point.cfg, 1, 1)
        note = (
            f"torch pipelining forward host work {point.forward_host_s * 1e3:.3g} ms per "
            f"micro-batch through every layer, from {point.source} ({run.ranks} rank(s), "
            f"--schedule {run.cfg.schedule}); each stage issues its share of it, ahead of "
            "its device"
        )
        return share, point, note

    def _refit(self, ctx: Context, point) -> str | None:
        """A note when the model does not reproduce the run its host cost came from (5%)."""
        if point is None:
            return None
        return ctx.once(("pipelining refit", point.source), lambda: self._refit_note(ctx, point))

    def _refit_note(self, ctx: Context, point) -> str | None:
        if isinstance(point, MultiPoint):
            scen, measured = point.scenario, point.seconds
        else:
            scen = Scenario(point.cfg, 1, per_node=1)
            measured = point.compute_s
        lay = self._layout(ctx, scen)
        host, _, _ = self._host(ctx, scen, lay)
        predicted = lay.replay(lay.send, host)[0] + lay.compute.overhead_s
        off = predicted / measured - 1
        if abs(off) <= 0.05:
            return None
        return (
            f"the model does not reproduce its pipelining calibration run {point.source}: "
            f"{predicted * 1e3:.4g} ms against {measured * 1e3:.4g} ms measured ({off:+.0%}); "
            "its stage times are not what the one-rank law and the host share give"
        )

    def _send(self, ctx: Context, s: Scenario, cuts: list[float], held: list[int]) -> float:
        """One micro-batch's activations over the costliest cut (cuts: bytes per cut, in the
        compute dtype); the same bytes come back as gradients in training, on the same link.
        held: the rank of each stage (a cut between stages on different nodes crosses the
        network)."""
        fabric = ctx.fabric(s, self.wire(s).backend)
        worst = 0.0
        for st in range(len(held) - 1):
            crosses = held[st] // s.per_node != held[st + 1] // s.per_node
            worst = max(worst, fabric.p2p(cuts[st], crosses))
        return worst

    @staticmethod
    def _cut_elems(s: Scenario, owner: list[int], costs: list, n_cuts: int) -> list[int]:
        """Values per item each cut sends: the output of the stage's last row, or for a block
        model the input of the module the next stage begins at (the row before it may be the
        root's own parameters, which output nothing themselves)."""
        if blocks.is_block_model(s.cfg):
            return [costs[owner.index(st + 1)].in_elems for st in range(n_cuts)]
        out = []
        for st in range(n_cuts):
            last = max(i for i, o in enumerate(owner) if o == st) if st in owner else 0
            out.append(costs[last].out_elems)
        return out

    @staticmethod
    def _stage_text(
        s: Scenario, counts: list[int], slow: int, stages: list[int], seconds: float
    ) -> str:
        names = layer_names(s)
        spans = bounds(counts)
        held = ", ".join(f"{names[spans[st][0]]}..{names[spans[st][1] - 1]}" for st in stages)
        return (
            f"slowest stage: rank {slow} of {s.ranks}, {held}, "
            f"{seconds * 1e3:.3g} ms per micro-batch"
        )


NO_HOST = (
    "torch pipelining host work not calibrated (no torch-engine pipeline run of this family): "
    "each forward takes its device time, a lower bound at small micro-batches (plan "
    "--calibrate-missing measures a one-rank run: pipeline --engine torch --ranks 1 "
    "--schedule gpipe)"
)


@dataclass(frozen=True)
class _Layout:
    """One replica's stages as a schedule replay needs them."""

    compute: ComputeModel
    counts: list[int]  # layers per stage
    cut_from: str
    t_stage: list[float]  # seconds per micro-batch, per stage
    held: list[int]  # the rank of each stage
    send: float  # the fabric's time for one micro-batch's activations over the worst cut
    # (send, host seconds per (stage, kind)) -> (makespan, device-busy seconds per rank)
    replay: Callable[[float, dict], tuple[float, list[float]]]
    torch: bool  # --engine torch: its runtime's host work is calibrated (PipelineModel._host)
    cut_bytes: list[float]  # one micro-batch's activation across each cut


def held_stages(cfg) -> int:
    """Stages per rank: torch's schedules hold V (the V-shaped ones 2), the others one."""
    if cfg.engine != "torch":
        return 1
    from scalelab.layout.torch_schedule import virtual_stages

    return virtual_stages(cfg.schedule, cfg.virtual_stages)


def _action_seconds(fwd: list[float], bwd: list[float], cfg) -> dict[tuple[int, str], float]:
    """One micro-batch's seconds per (stage, action kind). The split backward's input and
    weight gradients (I, W) each take half the backward: both are one matmul per Linear of
    the forward's size. A forward-only pass of the schedules torch cannot run in eval
    (layout/torch_schedule.NO_EVAL) runs their backward as well: 2 forwards' worth."""
    out = {}
    for st, (f, b) in enumerate(zip(fwd, bwd)):
        b = b if cfg.train else 2 * f
        out.update({(st, "F"): f, (st, "B"): b, (st, "I"): b / 2, (st, "W"): b / 2})
    return out


def unmodelled(cfg) -> None:
    """Refuse what the simulation does not cover: the hand engine runs scalelab's own op
    lists (GPipe, 1F1B), one stage per rank; torch's other schedules run under --engine
    torch only (the strategy refuses them otherwise), and are replayed from torch's order."""
    if cfg.engine == "torch":
        held_stages(cfg)  # torch_stages' refusal of a --virtual-stages the schedule cannot hold
        return
    if cfg.schedule not in SCHEDULES:
        raise UsageError(
            f"predict simulates the {'/'.join(SCHEDULES)} schedules of the hand engine; "
            f"--schedule {cfg.schedule} runs under --engine torch"
        )
    if cfg.virtual_stages > 1:
        raise UsageError("--virtual-stages needs --engine torch")


def _at_batch(s: Scenario, batch: float) -> Scenario:
    """The scenario with a per-step batch of `batch` items, so calibration anchors at the
    measured batch nearest the micro-batch."""
    return dataclasses.replace(s, cfg=dataclasses.replace(s.cfg, batch=max(1, round(batch))))


def _clean(seconds: float) -> float:
    """A difference of two simulated makespans: rounding residue below a nanosecond is 0."""
    return seconds if seconds > 1e-9 else 0.0
