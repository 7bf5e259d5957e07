"""`tensor`: the MLP's hidden units split over N ranks (the pipeline model: pipeline.py).
The same model serves `tensor --engine torch` on the mlp (DTensor shards fc1 column-wise and
fc2 row-wise: the same hidden-unit split, its all-reduce over gloo), and on a model of
repeated blocks (a transformer, sharded by heads: blocks.py, `_predict_heads` below); DTensor
on other models shards only their Linear pairs and replicates the rest, which this model does
not describe.

tensor, per step: one rank's compute, and one all-reduce of the (B, classes) partial logits
(+1 value for the L2 term) over MPI; its backward sends nothing. A rank computes what one
rank of the split computes on its own at ceil(H/N) hidden units and the full batch B (fc1's
rows and fc2's columns of its units, their gradients and SGD step, its L2 share; the largest
shard sets the pace), so its compute is calibrated on a one-rank run of that width when the
pool has one (`shard_config`; plan's --calibrate-missing measures `tensor --ranks 1 --hidden
ceil(H/N)`). Without it, the fixed + per-item law of the whole mlp is
split: 1/N of the per-item part, and the fixed part kept whole. That fallback is an upper
bound on time: a CPU step's "fixed" part at these batches is mostly the weights' own traffic
(reading W1, writing its gradient, the SGD update), which does shrink with 1/N of the units;
on a 2-core host it predicted the 2-rank split of MNIST's mlp 38% slow.
"""

from __future__ import annotations

import dataclasses

from scalelab.config import RunConfig
from scalelab.errors import UsageError
from scalelab.precision import get_precision
from scalelab.predict.calibration import CalPoint
from scalelab.predict.models import blocks
from scalelab.predict.models.base import (
    MODELS,
    Context,
    OverMPI,
    StrategyModel,
    Wire,
    output_width,
)
from scalelab.predict.models.ddp import BACKWARD_SHARE
from scalelab.predict.models.mesh2d import replicated
from scalelab.predict.scenario import Prediction, Scenario


@MODELS.register("tensor", "the MLP's hidden units over ranks: one all-reduce per step")
class TensorModel(OverMPI):
    def infeasible(self, scenario: Scenario) -> str | None:
        dp = max(1, scenario.cfg.dp)
        if scenario.ranks % dp:
            return f"{scenario.ranks} ranks do not split into --dp {dp} replicas"
        if self._by_heads(scenario.cfg):
            return blocks.undivided_heads(scenario.cfg, scenario.ranks // dp)
        if scenario.ranks // dp > scenario.cfg.hidden:
            return f"{scenario.ranks // dp} ranks but only {scenario.cfg.hidden} hidden units"
        return None

    @staticmethod
    def _by_heads(cfg: RunConfig) -> bool:
        """DTensor over a model of repeated blocks: the heads plan (no --tp-plan of the user's,
        whose sharding this model does not know)."""
        return cfg.engine == "torch" and cfg.tp_plan is None and blocks.is_block_model(cfg)

    def calibrated_on(self, cfg: RunConfig) -> RunConfig:
        if cfg.workload != "mlp":
            return cfg
        return shard_config(cfg, max(1, cfg.ranks // max(1, cfg.dp)))

    def wire(self, scenario: Scenario) -> Wire:
        """The hand-written split over MPI; DTensor (--engine torch) over torch.distributed."""
        if scenario.cfg.engine == "torch":
            return StrategyModel.wire(self, scenario)
        return super().wire(scenario)

    def predict(self, ctx: Context, s: Scenario) -> Prediction:
        """--dp D: D replicas of the N-rank tensor group (mesh2d.py)."""
        if self._by_heads(s.cfg):
            grads = lambda inner: blocks.tp_params(s.cfg, inner)  # noqa: E731
            return replicated(ctx, s, self._predict_heads, self.wire(s).backend, grads)
        if s.cfg.workload != "mlp":
            raise UsageError(
                f"predict models tensor parallelism of the mlp only (its hidden units split) "
                f"and of models of repeated blocks (by heads); {s.cfg.workload} with its "
                "Linear pairs sharded, the rest replicated, has none yet"
            )
        return replicated(ctx, s, self._predict_split, self.wire(s).backend)

    def _predict_heads(self, ctx: Context, s: Scenario) -> Prediction:
        """A block model over N ranks by heads (blocks.py), plus DTensor's host work per
        all-reduce when a measured run of the family calibrates it (_dtensor_host). One rank
        pays it too: DTensor over a one-device mesh still dispatches every sharded op."""
        pred = self._heads_bare(ctx, s)
        n_reduce = int(pred.extra.pop("allreduces"))
        issued = self._forward_issue(ctx, s, pred)
        if issued is not None:
            return issued
        per, source, note = self._dtensor_host(ctx, s)
        pred.phases["dtensor_host"] = per * n_reduce
        pred.notes.append(note)
        if source is not None:
            pred.calibration[source] = "DTensor host cost"
        return pred

    def _forward_issue(self, ctx: Context, s: Scenario, pred: Prediction) -> Prediction | None:
        """DTensor's host work where the multi-rank run that calibrates it (as _dtensor_host
        picks it) timed its forward: the host issues every sharded op of the
        forward (dispatch, redistribution, each collective's launch) whatever the rank count
        and batch, the same ops of the same plan, so the forward takes the longer of its
        device time and H, that run's forward seconds per step; the backward (autograd's
        engine) runs on the device. dtensor_host = max(0, H - the forward's device time).
        The example GPT's forward took 72 ms a step on 2 and on 4 H200 ranks, 59-79 ms on 2 over
        three 2x H200 calls, 77 ms on one rank, where its device time is 22-67 ms. None when
        that run did not time its forward (inference, older records)."""
        m = ctx.pool.dtensor_anchor(s)
        if ctx.pool.dtensor_single(s) is not None and (m is None or s.ranks == 1):
            return None  # a one-rank run calibrates: its excess per all-reduce (_one_rank_host)
        run = m
        if run is None or run.forward_s is None or not s.cfg.train:
            return None
        fwd = (1 - BACKWARD_SHARE) * (pred.phases.get("launch", 0.0) + pred.phases["compute"])
        pred.phases["dtensor_host"] = max(0.0, run.forward_s - fwd)
        pred.calibration[run.source] = "DTensor host cost"
        pred.notes.append(
            f"DTensor's forward issued by the host in {run.forward_s * 1e3:.3g} ms a step (the "
            f"forward of {run.source}), against {fwd * 1e3:.3g} ms of device time here"
        )
        return pred

    def _heads_bare(self, ctx: Context, s: Scenario) -> Prediction:
        """The blocks' share of the one-rank compute over N, the rest whole; the blocks'
        all-reduces of their activations over the fabric."""
        n, batch = s.ranks, s.cfg.batch
        compute = ctx.compute(s)
        rows = blocks.row_seconds(ctx, s, compute, batch)
        split = blocks.shares(s.cfg)
        total = max(sum(rows), 1e-30)
        share = sum(t * f for t, f in zip(rows, split)) / total  # of the compute, the plan's
        phases = compute.phases(batch)
        phases["compute"] *= share / n + (1 - share)
        sizes = blocks.tp_allreduces(s.cfg, batch, get_precision(s.precision).itemsize)
        fabric = ctx.fabric(s, self.wire(s).backend)
        phases["allreduce"] = sum(fabric.allreduce(b, n) for b in sizes) if n > 1 else 0.0
        phases["overhead"] = compute.overhead_s
        pred = Prediction(s, phases, frozenset({"allreduce"}), compute.sources, list(compute.notes))
        per_block = 4 if s.cfg.train else 2
        pred.notes.append(
            f"tensor by heads: what the plan shards ({share:.0%} of the compute) over the "
            f"ranks, the rest replicated; {per_block} all-reduces per block of its activation "
            f"({sizes[0] / 1e6 if sizes else 0:.3g} MB), {len(sizes)} per step"
        )
        if compute.fixed_s > 0:
            pred.notes.append("compute: the calibrated fixed cost per step kept whole")
        pred.extra = {"allreduce_bytes": float(sum(sizes) if n > 1 else 0), "tp_share": share,
                      "allreduces": float(len(sizes))}  # fmt: skip
        return pred

    def _dtensor_host(self, ctx: Context, s: Scenario) -> tuple[float, str | None, str]:
        """(seconds per all-reduce, the run it comes from, a note): DTensor's own host work
        (dispatching every sharded op, redistributing, launching each collective), which no
        ceiling measures, calibrated like DDP's host cost: what one measured multi-rank run
        of the family (Pool.dtensor_anchor) takes beyond the bare prediction of it, per
        all-reduce of that run (the work grows with the blocks, as the all-reduces do).
        Without such a run, the same from a one-rank run of the family (_one_rank_host); a
        one-rank scenario is that run's own configuration, so its run wins there."""
        m = ctx.pool.dtensor_anchor(s)
        single = ctx.pool.dtensor_single(s)
        if single is not None and (m is None or s.ranks == 1):
            return self._one_rank_host(ctx, s, single)
        if m is None:
            return 0.0, None, NO_DTENSOR_HOST
        bare = ctx.once(("dtensor host", m.source), lambda: self._heads_bare(ctx, m.scenario))
        per = max(0.0, m.seconds - bare.seconds) / max(1.0, bare.extra["allreduces"])
        note = (
            f"DTensor host cost {per * 1e3:.3g} ms per all-reduce, calibrated on {m.source} "
            f"({m.scenario.ranks} ranks, batch {m.scenario.cfg.batch})"
        )
        return per, m.source, note

    def _one_rank_host(self, ctx: Context, s: Scenario, single: CalPoint):
        """DTensor's host cost per all-reduce from a one-rank `tensor --engine torch` run of
        the family (Pool.dtensor_single): its step less the bare step at its batch (the
        compute law's, from the family's plain one-rank runs), over the all-reduces its step
        issues (each a collective over a group of one). It sees DTensor's dispatch and
        redistribution, not the collectives' own host cost on a real group (the caveat
        FSDP's one-rank calibration has): a lower bound on several ranks."""
        one = Scenario(single.cfg, 1, 1)
        law = ctx.compute(one).law
        if law is None or single.source in law.point.sources:  # the family's only one-rank point
            return 0.0, None, NO_DTENSOR_BESIDE.format(source=single.source)
        bare = ctx.once(("dtensor host", single.source), lambda: self._heads_bare(ctx, one))
        seconds = single.compute_s + single.overhead_s
        per = max(0.0, seconds - bare.seconds) / max(1.0, bare.extra["allreduces"])
        note = (
            f"DTensor host cost {per * 1e3:.3g} ms per all-reduce, calibrated on the one-rank "
            f"run {single.source} (batch {single.batch})"
        )
        if s.ranks > 1:
            note += ONE_RANK_BOUND
        return per, single.source, note

    def _predict_split(self, ctx: Context, s: Scenario) -> Prediction:
        wire = self.wire(s)
        nbytes = (s.cfg.batch * output_width(s) + 1) * 4
        reduce = ctx.fabric(s, wire.backend).allreduce(nbytes, s.ranks) if s.ranks > 1 else 0.0
        shard = self.calibrated_on(s.cfg)  # s is one replica's group here: its ranks are N
        compute = ctx.compute(dataclasses.replace(s, cfg=shard))
        if compute.law is not None:  # a one-rank run of one rank's shard: its step as measured
            phases = compute.phases(s.cfg.batch)
        else:
            compute = ctx.compute(s)
            phases = compute.phases(s.cfg.batch)  # the fixed part kept whole (an upper bound)
            phases["compute"] /= s.ranks
            compute.notes.append(
                f"compute: the whole mlp's law split {s.ranks} ways, its fixed part kept whole "
                f"(no one-rank run at --hidden {shard.hidden}, one rank's shard, to calibrate "
                "on; plan --calibrate-missing measures it)"
            )
        phases["allreduce"] = reduce + (wire.stage(ctx.figures, nbytes) if s.ranks > 1 else 0.0)
        phases["overhead"] = compute.overhead_s
        return Prediction(s, phases, frozenset({"allreduce"}), compute.sources, list(compute.notes))


NO_DTENSOR_HOST = (
    "DTensor host cost not calibrated (no measured tensor --engine torch run of this family, "
    "multi-rank or one-rank beside a plain one): each all-reduce costs the fabric's time "
    "alone, which leaves out DTensor's own work per sharded op (pass --calibrate with such a "
    "run; plan --calibrate-missing measures a multi-rank one)"
)
# A 3-block GPT, fp64 training on the 2-core CPU host over gloo: 2 ranks measured 37.7 and
# 47.8 ms a step against 22.8 and 21.8 ms predicted from one-rank runs (noisy, shared host).
ONE_RANK_BOUND = (
    ": a one-rank run does not see the collectives' own host cost on a real group, so this "
    "step is likely a lower bound (2 CPU ranks over gloo took 1.7-2.2x it: docs/PREDICT.md)"
)
NO_DTENSOR_BESIDE = (
    "DTensor host cost not calibrated: the one-rank tensor --engine torch run {source} is "
    "the family's only one-rank point, so it calibrates the compute and nothing is left to "
    "tell DTensor's host work from it (measure a plain one-rank run beside it)"
)


def shard_config(cfg: RunConfig, ranks: int) -> RunConfig:
    """The one-rank mlp that computes what one of `ranks` tensor ranks computes: the largest
    shard's ceil(H / ranks) hidden units (the slowest rank sets the pace) at the same batch."""
    return dataclasses.replace(cfg, hidden=-(-cfg.hidden // max(1, ranks)))
