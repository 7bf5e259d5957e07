"""`tensor`: the MLP's hidden units split over N ranks (the pipeline model: pipeline.py).
The same model serves `tensor --engine torch` on the mlp (DTensor shards fc1 column-wise and
fc2 row-wise: the same hidden-unit split, its all-reduce over gloo); DTensor on other models
shards only their Linear pairs and replicates the rest, which this model does not describe.

tensor, per step: the fixed part of t(B) and 1/N of the rest (each rank has 1/N of the
hidden units, so 1/N of the FLOPs at the full batch), and one all-reduce of the (B, classes)
partial logits (+1 value for the L2 term) over MPI; its backward sends nothing.
"""

from __future__ import annotations

from scalelab.errors import UsageError
from scalelab.predict.models.base import (
    MODELS,
    Context,
    OverMPI,
    StrategyModel,
    Wire,
    output_width,
)
from scalelab.predict.models.mesh2d import replicated
from scalelab.predict.scenario import Prediction, Scenario


@MODELS.register("tensor", "the MLP's hidden units over ranks: one all-reduce per step")
class TensorModel(OverMPI):
    def infeasible(self, scenario: Scenario) -> str | None:
        dp = max(1, scenario.cfg.dp)
        if scenario.ranks % dp:
            return f"{scenario.ranks} ranks do not split into --dp {dp} replicas"
        if scenario.ranks // dp > scenario.cfg.hidden:
            return f"{scenario.ranks // dp} ranks but only {scenario.cfg.hidden} hidden units"
        return None

    def wire(self, scenario: Scenario) -> Wire:
        """The hand-written split over MPI; DTensor (--engine torch) over torch.distributed."""
        if scenario.cfg.engine == "torch":
            return StrategyModel.wire(self, scenario)
        return super().wire(scenario)

    def predict(self, ctx: Context, s: Scenario) -> Prediction:
        """--dp D: D replicas of the N-rank tensor group (mesh2d.py)."""
        if s.cfg.workload != "mlp":
            raise UsageError(
                f"predict models tensor parallelism of the mlp only (its hidden units split); "
                f"{s.cfg.workload} with its Linear pairs sharded, the rest replicated, has none yet"
            )
        return replicated(ctx, s, self._predict_split, self.wire(s).backend)

    def _predict_split(self, ctx: Context, s: Scenario) -> Prediction:
        compute = ctx.compute(s)
        wire = self.wire(s)
        nbytes = (s.cfg.batch * output_width(s) + 1) * 4
        reduce = ctx.fabric(s, wire.backend).allreduce(nbytes, s.ranks) if s.ranks > 1 else 0.0
        phases = compute.phases(s.cfg.batch)  # the fixed part does not shrink with the split
        phases["compute"] /= s.ranks
        phases["allreduce"] = reduce + (wire.stage(ctx.figures, nbytes) if s.ranks > 1 else 0.0)
        phases["overhead"] = compute.overhead_s
        return Prediction(s, phases, frozenset({"allreduce"}), compute.sources, list(compute.notes))
