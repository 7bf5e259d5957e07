"""Whether a candidate would start at all: the refusals `scalelab run` makes before it
launches any rank, in the strategy's and the workload's own words, so a candidate that
cannot run is left out with the line a user would have got:

    config sections   every option the strategy would not read, each section's rules
                      (runner.check_config: --batch vs --dp x --microbatches, schedules)
    topology          the split's own check (ranks vs items, a slab thinner than a halo, a
                      model with no convolution trunk: it names the layer the trunk stops
                      at); the strategy's preflight for the others (ddp's per-rank batch,
                      tensor's --dp x --tp mesh, the hand-written tensor split's mlp only)
    the workload      Workload.check_strategy: a user's model its pipeline cannot cut, or
                      with no Linear pair to shard, names the layer that stops it

Device checks (is a GPU visible) are not made: a plan for GPUs may be drawn on a laptop.
"""

from __future__ import annotations

from scalelab.config import RunConfig
from scalelab.errors import UsageError
from scalelab.run.runner import check_config
from scalelab.strategies import STRATEGIES
from scalelab.workloads import WORKLOADS


def refusal(cfg: RunConfig) -> str | None:
    """The one line `scalelab run` would refuse cfg with before launching (None: it starts)."""
    try:
        check_config(cfg)
        workload = WORKLOADS.get(cfg.workload)(cfg)
        workload.check_strategy(cfg.strategy, cfg, **STRATEGIES.get(cfg.strategy).model_needs(cfg))
        _topology(cfg, workload)
    except UsageError as exc:
        return str(exc)
    return None


def _topology(cfg: RunConfig, workload) -> None:
    strategy = STRATEGIES.get(cfg.strategy)
    split_class = getattr(strategy, "split_class", None)
    if split_class is not None:  # the split's check needs no comm and no device
        split_class(cfg).check(cfg, workload, cfg.ranks)
        return
    preflight = getattr(strategy, "preflight", None)
    if preflight is not None:
        preflight(cfg)
    if STRATEGIES.get(cfg.strategy).traced_by_torch(cfg):
        _dtensor_pairs(cfg, workload)


def _dtensor_pairs(cfg: RunConfig, workload) -> None:
    """DTensor shards the Linear pairs the workload marks; none: nothing to shard (the ranks
    would refuse it in validate(), after the launch)."""
    import torch

    from scalelab.strategies.tensor_dtensor import linear_pairs

    with torch.device("meta"):
        model = workload.build_model()
        from scalelab.strategies.tensor_plans.proof import by_heads

        if by_heads(cfg, workload, model):
            from scalelab.strategies.tensor_plans.derived import derive_plan  # heads refused

            derive_plan(model, cfg.tp or max(cfg.ranks // cfg.dp, 1), cfg.tp_plan)
            return
        pairs = linear_pairs(workload, model)
    if not pairs:
        raise UsageError(f"tensor --engine torch: {workload.name} marks no Linear pair to shard")
