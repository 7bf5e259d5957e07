"""`ddp`: DistributedDataParallel training; `mpi-dp`: the same over MPI with one flat buffer.

ddp, per optimizer step on N ranks with b items each:

    compute    t(b), the whole one-GPU step (forward, backward, optimizer) at b per rank
    allreduce  the gradients (P parameters x storage bytes) in DDP's buckets, each all-reduced
               as soon as backward has produced it (gradients.py); only what outlasts
               backward (2/3 of the step) is exposed
    ddp_host   D, the host cost DDP adds to every step (reducer hooks, bucket bookkeeping,
               collective launches): one GPU trains the bare model and never pays it, and
               in a launch-bound step nothing hides it. No ceiling measures it, so it is
               calibrated on one measured multi-GPU run (the fewest ranks, then the
               smallest per-rank batch): D = measured - t(b) - exposed all-reduce. Without
               such a run D = 0 and the prediction says so.

mpi-dp: compute t(B/N), then one all-reduce of the flat gradient buffer over MPI (host
buffers; staged d2h + h2d on GPUs); --nonblocking all-reduces layer by layer under backward.
"""

from __future__ import annotations

from scalelab.predict.models.base import (
    MODELS,
    Context,
    OverMPI,
    StrategyModel,
    param_layers,
    storage_bytes,
)
from scalelab.predict.models.gradients import DDP_FIRST_BUCKET, MiB, buckets, exposed_allreduce
from scalelab.predict.scenario import Prediction, Scenario

BACKWARD_SHARE = 2 / 3  # backward costs two forwards: 2 of a step's 3 forward-equivalents
COMM = frozenset({"allreduce"})
NO_HOST_COST = (
    "DDP host cost per step not calibrated (no measured multi-GPU ddp run of this "
    "configuration): multi-GPU times are a lower bound when the step is launch-bound"
)


EXPOSED = (
    "allreduce_ms is the exposed all-reduce (what outlasts backward), the part summed into ms; "
    "allreduce_total_ms is the whole, allreduce_hidden_pct of it hidden under backward"
)


@MODELS.register("ddp", "DistributedDataParallel: bucketed all-reduce under backward")
class DDPModel(StrategyModel):
    def infeasible(self, scenario: Scenario) -> str | None:
        g = scenario.global_batch
        if g % scenario.ranks:
            return f"global batch {g} does not divide over {scenario.ranks} ranks"
        return None

    def predict(self, ctx: Context, scenario: Scenario) -> Prediction:
        pred = self.without_host(ctx, scenario)
        if scenario.ranks > 1:
            host, source, note = self.host_cost(ctx, scenario)
            pred.phases["ddp_host"] = host
            if source is not None:
                pred.calibration[source] = "DDP host cost"
            pred.notes.append(note)
        return pred

    def without_host(self, ctx: Context, s: Scenario) -> Prediction:
        compute = ctx.compute(s)
        step = compute.seconds(s.rank_batch)
        fabric = ctx.fabric(s, self.wire(s).backend) if s.ranks > 1 else None
        plan = buckets(param_layers(s), storage_bytes(s), DDP_FIRST_BUCKET, s.cfg.bucket_mb * MiB)
        busy, exposed = 0.0, 0.0
        if fabric is not None:
            # --grad-compress: each bucket travels as 16-bit values (the buckets are still cut
            # by the gradients' storage size).
            on_wire = 2 / storage_bytes(s) if s.cfg.grad_compress else 1.0
            reduce = lambda n: fabric.allreduce(n * on_wire, s.ranks)  # noqa: E731
            busy, exposed = exposed_allreduce(plan, BACKWARD_SHARE * step, reduce)
        phases = {**compute.phases(s.rank_batch), "allreduce": exposed}
        pred = Prediction(s, phases, COMM, compute.sources, list(compute.notes))
        hidden = 100 * (1 - exposed / busy) if busy > 0 else float("nan")
        # allreduce_ms (a phase, summed into ms) is the exposed part; the whole beside it
        pred.extra = {"allreduce_total_ms": busy * 1e3, "allreduce_hidden_pct": hidden,
                      "buckets": len(plan)}  # fmt: skip
        if busy > 0:
            pred.notes.append(EXPOSED)
        return pred

    def host_cost(self, ctx: Context, s: Scenario) -> tuple[float, str | None, str]:
        """(D seconds per step, the measured run it comes from, a note)."""
        m = ctx.pool.host_anchor(s)
        if m is None:
            return 0.0, None, NO_HOST_COST
        own = ctx.of_run(m.source)  # its step less its own compute
        bare = ctx.once(("ddp host", m.source), lambda: self.without_host(own, m.scenario))
        host = max(0.0, m.seconds - bare.seconds)
        note = (
            f"DDP host cost {host * 1e3:.3g} ms/step, calibrated on {m.source} "
            f"({m.scenario.ranks} ranks, {m.scenario.rank_batch:g} per rank)"
        )
        return host, m.source, note


@MODELS.register("mpi-dp", "data parallel over MPI: one flat all-reduce (or per layer)")
class MPIDPModel(OverMPI):
    def infeasible(self, scenario: Scenario) -> str | None:
        if scenario.ranks > scenario.cfg.batch:
            return f"{scenario.ranks} ranks but only {scenario.cfg.batch} items per step"
        return None

    def predict(self, ctx: Context, s: Scenario) -> Prediction:
        compute = ctx.compute(s)
        step = compute.seconds(-(-s.cfg.batch // s.ranks))
        wire, layers = self.wire(s), param_layers(s)
        fabric = ctx.fabric(s, wire.backend) if s.ranks > 1 else None
        exposed = 0.0
        if fabric is not None:
            per_layer = s.cfg.nonblocking
            cap = 0 if per_layer else float("inf")
            plan = buckets(layers, storage_bytes(s), cap, cap)

            def reduce(n: float) -> float:
                return fabric.allreduce(n, s.ranks) + wire.stage(ctx.figures, n)

            _, exposed = exposed_allreduce(plan, BACKWARD_SHARE * step, reduce)
        phases = {**compute.phases(-(-s.cfg.batch // s.ranks)), "allreduce": exposed}
        phases["overhead"] = compute.overhead_s
        return Prediction(s, phases, COMM, compute.sources, list(compute.notes))
