"""A model's own tensor-parallel plan, as Hugging Face models declare it: the config's
`base_model_tp_plan` and the model's `_tp_plan` (transformers merges both, with its children's,
into the instance's `_tp_plan` at init), module-name patterns to style names:

    "layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise",
    "lm_head": "colwise_gather_output" (alias "colwise_rep"), "embed_tokens": "embedding_rowwise"

Each maps onto torch's ParallelStyles with local outputs (use_local_output=True, as torchtitan
and transformers run them), so the forward's `view(*shape, -1, head_dim)` reshapes see each
rank's heads: grouped-query key/value projections split by their own heads, as the plan says.
The patterns are put under the path the HF model sits at inside the user's module (`model.`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from scalelab.errors import UsageError


class ReplicatedGradSum(ParallelStyle):
    """HF's "replicated_with_grad_allreduce": the module's parameters whole on every rank, each
    gradient summed over the tensor group as backward reaches it. Qwen3's q_norm and k_norm
    (RMSNorm weights of head_dim) run on each rank's own heads, so a rank's gradient is its
    heads' share: left alone, a 2-rank fp64 run trained q_norm 1.8e-4 away from one process."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        group = device_mesh.get_group()
        for p in module.parameters():
            if p.requires_grad:
                p.register_hook(partial(_summed, group=group))
        return module


def _summed(grad: torch.Tensor, group) -> torch.Tensor:
    total = grad.clone()  # a hook must not change the gradient autograd hands it
    dist.all_reduce(total, group=group)
    return total


# HF style name -> the torch style (None: the module stays replicated on every rank).
STYLES: dict[str, Callable[[], ParallelStyle] | None] = {
    "colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
    "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
    "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
    "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
    "embedding_colwise": lambda: ColwiseParallel(output_layouts=Replicate()),
    "replicate": None,
    "local_params": None,
    "replicated_with_grad_allreduce": ReplicatedGradSum,
}


def declared(model: nn.Module) -> dict[str, str] | None:
    """The outermost declared plan in the model's tree, its patterns under that module's path
    (None: no module declares one)."""
    for name, m in model.named_modules():
        plan = _plan_of(m)
        if plan:
            prefix = f"{name}." if name else ""
            return {prefix + k: v for k, v in plan.items()}
    return None


def _plan_of(m: nn.Module) -> dict[str, str]:
    own = getattr(m, "_tp_plan", None)
    if isinstance(own, dict) and own:
        return dict(own)
    base = getattr(getattr(m, "config", None), "base_model_tp_plan", None)
    if not isinstance(base, dict) or not base:
        return {}
    prefix = getattr(m, "base_model_prefix", "")
    under = f"{prefix}." if prefix and isinstance(getattr(m, prefix, None), nn.Module) else ""
    return {under + k: v for k, v in base.items()}


def styles(plan: dict[str, str]) -> dict[str, ParallelStyle]:
    """The declared plan as torch styles by pattern; a style with no DTensor equivalent here:
    one line naming it."""
    out = {}
    for pattern, name in plan.items():
        if name not in STYLES:
            raise UsageError(
                f"tensor: the model declares {pattern}: {name!r}, which scalelab does not map "
                "onto DTensor; pass --tp-plan MODULE:OBJECT (module patterns to ParallelStyles)"
            )
        if STYLES[name] is not None:
            out[pattern] = STYLES[name]()
    return out
