"""2-D layouts (`--dp D` with `--stages S` or `--tp N`, strategies/mesh.py): D replicas of a
pipeline or tensor-parallel group, gradients summed over the D replicas after backward.

Per step: the inner group's own prediction at its share of the batch (B / D items, S or N
ranks), then one flat all-reduce over the D replicas of the gradients one rank holds (its
stage's parameters, or 1/N of them), exposed: the mesh reduces after the backward ends. The
all-reduce spans nodes when a replica's ranks do (replicas are the outer mesh dimension, so
rank r of every replica sits S or N ranks apart).
"""

from __future__ import annotations

import dataclasses

from scalelab.predict.models.base import Context, param_layers, storage_bytes
from scalelab.predict.scenario import Prediction, Scenario


def replicated(
    ctx: Context, s: Scenario, inner_predict, backend: str, rank_params=None
) -> Prediction:
    """s at D x inner ranks: inner_predict(ctx, inner scenario) plus the dp all-reduce.
    rank_params(inner ranks): the parameters one rank holds, when not an even share."""
    dp = max(1, s.cfg.dp)
    if dp == 1:
        return inner_predict(ctx, s)
    inner_ranks = max(1, s.ranks // dp)
    cfg = dataclasses.replace(s.cfg, dp=1, batch=max(1, s.cfg.batch // dp), ranks=inner_ranks)
    pred = inner_predict(ctx, dataclasses.replace(s, ranks=inner_ranks, cfg=cfg))
    phases = dict(pred.phases)
    nbytes = gradient_bytes(s, inner_ranks)
    if rank_params is not None:
        nbytes = rank_params(inner_ranks) * storage_bytes(s)
    if s.cfg.train:
        phases["dp_allreduce"] = ctx.fabric(s, backend).allreduce(nbytes, dp)
    out = dataclasses.replace(pred, scenario=s, phases=phases)
    out.comm_phases = pred.comm_phases | {"dp_allreduce"}
    out.notes = [*pred.notes, f"{dp} data-parallel replicas of {inner_ranks} ranks; "
                 f"{nbytes / 1e6:.3g} MB of gradients per rank all-reduced over {dp}"]  # fmt: skip
    return out


def gradient_bytes(s: Scenario, inner_ranks: int) -> float:
    """Gradient bytes one rank of a replica holds: the model's parameters over its ranks (the
    balanced share; a pipeline's slowest stage may hold more or fewer)."""
    params = sum(p for _, p, _ in param_layers(s))
    return params * storage_bytes(s) / inner_ranks
