"""What a tensor-parallel plan shards, for the cost model (predict) to read instead of assuming
every block is sharded whole: the modules it shards, and per repeated block the share of the
block's projection work the plan splits over the tp ranks.

A projection's forward is 2 x in x out FLOPs per token, so its parameter count weighs it; the
attention scores (2 x T x width per token, twice) follow the q/k/v projections: they are split
when those are. What is not in a style (norms, embeddings, the head under a derived plan) is
computed whole on every rank.
"""

from __future__ import annotations

import torch
from torch import nn

from scalelab.strategies.tensor_plans import attention as att
from scalelab.strategies.tensor_plans import derived
from scalelab.workloads.blocks import repeated_blocks


def sharded_modules(plan: derived.HeadPlan) -> list[str]:
    """The modules the plan shards, by name (its styles' keys)."""
    return list(plan.styles)


def block_shares(model: nn.Module, plan: derived.HeadPlan) -> dict[str, float]:
    """Repeated block name -> the fraction of its projections' weights (their FLOPs per token)
    the plan shards; 1.0: the whole block divides by the tp ranks."""
    found = repeated_blocks(model)
    out = {}
    for block in found[1] if found else []:
        inside = model.get_submodule(block).named_modules()
        sizes = {f"{block}.{n}" if n else block: _size(m) for n, m in inside
                 if att.is_projection(m)}  # fmt: skip
        whole = sum(sizes.values())
        out[block] = sum(s for n, s in sizes.items() if n in plan.styles) / whole if whole else 0.0
    return out


def plan_of(cfg, workload) -> derived.HeadPlan | None:
    """The plan the ranks would put on the workload's model at cfg's tp degree (on the meta
    device; None: sharded by Linear pairs, not by a plan)."""
    from scalelab.strategies.tensor_plans.proof import by_heads

    n = derived.tp_degree(cfg)
    with torch.device("meta"):
        model = workload.build_model()
        if not by_heads(cfg, workload, model):
            return None
        return derived.derive_plan(model, n, cfg.tp_plan)


def _size(m: nn.Module) -> int:
    i, o = att.in_out(m)
    return i * o
