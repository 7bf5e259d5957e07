"""`fsdp`: FSDP2 training (torch's fully_shard), and HSDP with --dp-replicate R.

Per optimizer step on N ranks with b items each, S = N / R ranks sharding each replica:

    compute        t(b), the whole one-GPU step, as ddp's (the sharded optimizer's step on
                   1/S of the state is counted as the one-GPU optimizer's: an upper bound)
    allgather      each unit's weights (P_u x the compute dtype's bytes) gathered from its S
                   shards before its forward and, resharded (--reshard-after-forward on),
                   again before its backward: a ring all-gather, half an all-reduce's traffic
    reducescatter  each unit's gradients (storage bytes) reduce-scattered over S after its
                   backward; with R > 1 then the 1/S shard all-reduced over the R replicas

Overlap (the phases are the exposed parts): the collectives share the links, one at a time in
issue order; all-gathers are issued ahead (FSDP prefetches the next unit: in backward its
gather goes before the current unit's reduce-scatter), a unit's compute waits for its own
gather; a reduce-scatter follows its unit's backward, and only what outlasts backward is
exposed.
Units are the layers with parameters (the cost table's rows): for a model sharded per
repeated block the units are coarser than that, so fewer, larger collectives.

    fsdp_host      what FSDP adds to a step on the host and in copies, none of which a
                   ceiling measures: each unit's pre-forward and post-backward hooks, the
                   copy of its shard into the gather buffer and out of it into the unsharded
                   parameters, the gradients' copy into the reduce-scatter buffer, the
                   optimizer's step on the shards. Calibrated on one GPU: a one-rank fsdp run
                   of the family and unit size (every hook and copy runs, the collectives are
                   local) less the bare step at its batch, H = t_fsdp1(b) - t(b), taken as
                   constant per step (the copies' bytes move from 1/1 to 1/S of the
                   weights: an upper bound). Without such a run H = 0 and the prediction
                   says it is a lower bound.
"""

from __future__ import annotations

from collections.abc import Callable

from scalelab.precision import get_precision
from scalelab.predict.models.base import (
    MODELS,
    Context,
    StrategyModel,
    param_layers,
    storage_bytes,
)
from scalelab.predict.models.ddp import BACKWARD_SHARE
from scalelab.predict.scenario import Prediction, Scenario

COMM = frozenset({"allgather", "reducescatter"})
# Host work above this share of the compute: the one-rank calibration under-states the step
# (2x H200, a 1e9-parameter stack of 62 units: host 2.0x the compute, predicted 44% short).
HOST_BOUND = 0.5
Cost = Callable[[float], float]


def overlap(
    units: list[tuple[int, int]], step_s: float, gather: Cost, scatter: Cost, reshard: bool
) -> dict[str, float]:
    """units: (parameters, forward FLOPs) per unit in forward order; gather and scatter: a
    unit's parameter count -> seconds. Returns busy and exposed
    seconds of all-gathers and reduce-scatters over one step."""
    total = sum(f for _, f in units) or 1
    fwd, bwd = (1 - BACKWARD_SHARE) * step_s, BACKWARD_SHARE * step_s
    net = comp = busy_ag = busy_rs = stall_ag = 0.0  # net: when the links are free
    for params, flops in units:  # forward: each gather queued ahead, compute waits for it
        t = gather(params)
        net, busy_ag = net + t, busy_ag + t
        stall_ag += max(0.0, net - comp)
        comp = max(comp, net) + fwd * flops / total
    back = list(reversed(units))
    net = max(net, comp)
    ready = comp
    if reshard and back:  # the first backward unit's gather, after forward
        t = gather(back[0][0])
        net, busy_ag, ready = net + t, busy_ag + t, net + t
    for i, (params, flops) in enumerate(back):
        stall_ag += max(0.0, ready - comp)
        comp = max(comp, ready)
        if reshard and i + 1 < len(back):  # prefetch: the next unit's gather goes first
            t = gather(back[i + 1][0])
            net, busy_ag = max(net, comp) + t, busy_ag + t
            ready = net
        comp += bwd * flops / total
        t = scatter(params)
        net, busy_rs = max(net, comp) + t, busy_rs + t
        ready = ready if reshard else comp
    return {
        "allgather_busy": busy_ag,
        "allgather": stall_ag,
        "reducescatter_busy": busy_rs,
        "reducescatter": max(0.0, net - comp),
    }


def collectives(s: Scenario) -> int:
    """The collectives FSDP issues per step: per unit an all-gather before forward, another
    before backward where the unit resharded after forward (every unit under "on", all but
    the last under "auto", none under "off": strategies/fsdp_units.reshard_policy), and a
    reduce-scatter after backward."""
    units = len(param_layers(s))
    resharded = {"on": units, "off": 0}.get(s.cfg.reshard_after_forward, max(0, units - 1))
    return max(1, 2 * units + resharded)


@MODELS.register("fsdp", "FSDP2: per-unit all-gather and reduce-scatter, overlapped")
class FSDPModel(StrategyModel):
    def infeasible(self, scenario: Scenario) -> str | None:
        g, n, r = scenario.global_batch, scenario.ranks, scenario.cfg.dp_replicate
        if g % n:
            return f"global batch {g} does not divide over {n} ranks"
        if n % r:
            return f"--dp-replicate {r} does not divide {n} ranks"
        return None

    def predict(self, ctx: Context, s: Scenario) -> Prediction:
        pred = self.without_host(ctx, s)
        if s.ranks > 1 and self._group_host(ctx, s, pred):
            return pred
        compute = ctx.compute(s)
        step = compute.seconds(s.rank_batch)
        single = ctx.pool.fsdp_single(s)
        law = compute.law
        if single is None or law is None or law.point.sources == single.sources:
            pred.notes.append(
                "fsdp: FSDP's host cost not calibrated (no one-rank fsdp run of this "
                "configuration beside a plain one): a lower bound"
            )
            return pred
        host = max(0.0, single.compute_s - compute.seconds(single.batch))
        pred.phases["fsdp_host"] = host
        pred.calibration.update(dict.fromkeys(single.sources, "FSDP host cost"))
        pred.notes.append(
            f"fsdp: FSDP's host cost {host * 1e3:.3g} ms/step, calibrated on the one-rank "
            f"fsdp run {single.source} (batch {single.batch})"
        )
        if s.ranks > 1 and host > HOST_BOUND * step:
            pred.notes.append(
                f"fsdp: FSDP's host work is {host / step:.2g}x the compute here: with a real "
                "process group it grows per unit (2.2x one rank's on 2x H200, 62 units: "
                "docs/PERFORMANCE.md), so this step is likely a lower bound"
            )
        return pred

    def _group_host(self, ctx: Context, s: Scenario, pred: Prediction) -> bool:
        """FSDP's host cost under a real process group, calibrated on a measured multi-rank
        fsdp run of the family with the same units, resharding and replicas (Pool.fsdp_anchor):
        its step less the model's step without host work, G = measured - (t(b) + exposed
        collectives), held constant per step as DDP's host cost is. One rank's run does not
        show it: there every all-gather and reduce-scatter is a copy over a group of one, where
        on a real group each is an NCCL launch the next unit's hooks wait on, and the copies in
        and out of the gather buffers run beside the collectives' kernels (a 62-unit stack on
        2x H200: 122 ms of host work a step on two ranks, 56 ms on one; with the re-gather
        before backward off, 75 ms). False when the pool holds no such run."""
        m = ctx.pool.fsdp_anchor(s)
        if m is None:
            return False
        own = ctx.of_run(m.source)  # its step less its own compute (Context.of_run)
        bare = ctx.once(("fsdp host", m.source), lambda: self.without_host(own, m.scenario))
        # An anchor that reshards otherwise issued another number of collectives, each with
        # its host work (its launch, the copies into and out of its buffer, the hooks that
        # wait on it): its cost is scaled by the ratio of the collectives per step.
        host = max(0.0, m.seconds - bare.seconds) * collectives(s) / collectives(m.scenario)
        pred.phases["fsdp_host"] = host
        pred.calibration[m.source] = "FSDP host cost"
        pred.notes.append(
            f"fsdp: FSDP's host cost {host * 1e3:.3g} ms/step under a process group, "
            f"calibrated on {m.source} ({m.scenario.ranks} ranks, {m.scenario.rank_batch:g} "
            "per rank)"
        )
        return True

    def without_host(self, ctx: Context, s: Scenario) -> Prediction:
        """The step without FSDP's host cost: the compute and the exposed collectives."""
        compute = ctx.compute(s)
        step = compute.seconds(s.rank_batch)
        phases = {**compute.phases(s.rank_batch), "allgather": 0.0, "reducescatter": 0.0}
        extra: dict = {}
        if s.ranks > 1:
            times = self.comm_times(ctx, s, step)
            phases["allgather"], phases["reducescatter"] = (
                times["allgather"],
                times["reducescatter"],
            )
            extra = {k: v for k, v in times.items() if k.endswith("_busy")}
        pred = Prediction(s, phases, COMM, compute.sources, list(compute.notes))
        pred.extra = extra
        return pred

    def comm_times(self, ctx: Context, s: Scenario, step: float) -> dict[str, float]:
        fabric = ctx.fabric(s, self.wire(s).backend)
        replicas = s.cfg.dp_replicate
        shard = s.ranks // replicas
        low = get_precision(s.precision).itemsize  # gathered in the compute dtype
        store = storage_bytes(s)  # reduced in the storage dtype

        def gather(params: float) -> float:
            return fabric.allreduce(params * low, shard) / 2 if shard > 1 else 0.0

        def scatter(params: float) -> float:
            rs = fabric.allreduce(params * store, shard) / 2 if shard > 1 else 0.0
            return rs + fabric.allreduce(params * store / shard, replicas)

        units = [(p, f) for _, p, f in param_layers(s)]
        return overlap(units, step, gather, scatter, s.cfg.reshard_after_forward != "off")
