"""A tensor-parallel plan derived from a model's repeated blocks (workloads/blocks.py): in
each block, the attention module (a module with a head count attribute, `heads`, `n_heads`,
`num_heads`, ...) has its q, k, v projections sharded column-wise by heads and its output
projection row-wise; the Linears outside it (the MLP) have their up/gate projections
column-wise and the down projection row-wise. Each rank then holds heads/N heads, and the
attention module's head count is set to that; everything outside the blocks (embeddings,
the head) is replicated.

A fused qkv Linear (out = 3 x width: q, k, v side by side) is sharded by heads too: its rows
are reordered so that rank r's contiguous shard holds q, k and v of its own heads
(ColwiseParallel shards contiguous rows), and put back in the user's order whenever the
weights leave the run (to_user). torch's nn.MultiheadAttention is swapped first for an
equivalent module with one such Linear (tensor_heads.py).

`--tp-plan MODULE:OBJECT` gives a user's own plan instead: a dict of module-name patterns
(fnmatch, as parallelize_module reads them) to torch ParallelStyles, or a callable returning
one from the model; the head counts of the attention modules it shards are set as above.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from scalelab.errors import UsageError
from scalelab.strategies.tensor_heads import RENAMES, swap_attention
from scalelab.workloads import model_spec
from scalelab.workloads.blocks import attention_modules, head_attrs, repeated_blocks

OUT_NAMES = ("out_proj", "o_proj", "proj", "c_proj", "wo", "dense", "out")


@dataclass
class HeadPlan:
    styles: dict[str, ParallelStyle]  # module name (or pattern) -> its style
    heads: dict[str, list[str]] = field(default_factory=dict)  # attention -> head attributes
    fused: dict[str, int] = field(default_factory=dict)  # fused qkv Linear -> its width C
    swapped: list[str] = field(default_factory=list)  # nn.MultiheadAttention names swapped

    def pairs(self) -> list[list[str]]:
        return [[n, type(s).__name__] for n, s in self.styles.items()]


def derive_plan(model: nn.Module, n: int, user: str | None = None) -> HeadPlan:
    """The plan for n ranks, after swapping the model's nn.MultiheadAttention (in place).
    A head count or width the ranks do not divide: one line naming the module."""
    swapped = swap_attention(model)
    if user is not None:
        styles = _user_styles(user, model)
        plan = HeadPlan(styles, swapped=swapped)
        for name in attention_modules(model):
            lins = _linears(model, name)
            sharded = {c: st for c, _ in lins for k, st in styles.items()
                       if _matches(k, f"{name}.{c}")}  # fmt: skip
            if not sharded:
                continue
            plan.heads[name] = head_attrs(model.get_submodule(name))
            out = next((c for c, _ in lins if c in OUT_NAMES), lins[-1][0])
            width = dict(lins)[out].out_features
            for child, lin in lins:  # a fused qkv Linear column-wise: by heads, as derived
                col = isinstance(sharded.get(child), ColwiseParallel)
                if col and lin.out_features == 3 * width:
                    plan.fused[f"{name}.{child}"] = width
        _check(model, plan, n)
        return plan
    found = repeated_blocks(model)
    if found is None:
        raise UsageError("tensor --engine torch: the model has no stack of repeated blocks")
    plan = HeadPlan({}, swapped=swapped)
    for block in found[1]:
        _plan_block(model, block, plan)
    if not plan.styles:
        raise UsageError(f"tensor --engine torch: {found[1][0]} holds no Linear to shard")
    _check(model, plan, n)
    return plan


def _plan_block(model: nn.Module, block: str, plan: HeadPlan) -> None:
    attn = [a for a in attention_modules(model) if a.startswith(block + ".")]
    inside = set()
    for a in attn:
        lins = _linears(model, a)
        inside.update(f"{a}.{c}" for c, _ in lins)
        out = next((c for c, _ in lins if c in OUT_NAMES), lins[-1][0])
        width = dict(lins)[out].out_features
        for child, lin in lins:
            plan.styles[f"{a}.{child}"] = RowwiseParallel() if child == out else ColwiseParallel()
            if child != out and lin.out_features == 3 * width:
                plan.fused[f"{a}.{child}"] = width
        plan.heads[a] = head_attrs(model.get_submodule(a))
    rest = [(n, m) for n, m in model.get_submodule(block).named_modules()
            if isinstance(m, nn.Linear) and f"{block}.{n}" not in inside]  # fmt: skip
    if len(rest) < 2:
        return
    width = min(m.in_features for _, m in rest)  # the block's width: up/gate read it
    down = [n for n, m in rest if m.in_features != width] or [rest[-1][0]]
    for name, _ in rest:
        style = RowwiseParallel() if name in down else ColwiseParallel()
        plan.styles[f"{block}.{name}"] = style


def _linears(model: nn.Module, name: str) -> list[tuple[str, nn.Linear]]:
    return [(c, m) for c, m in model.get_submodule(name).named_children()
            if isinstance(m, nn.Linear)]  # fmt: skip


def _matches(pattern: str, name: str) -> bool:
    from fnmatch import fnmatch

    return len(pattern.split(".")) == len(name.split(".")) and all(
        fnmatch(a, p) for a, p in zip(name.split("."), pattern.split("."))
    )


def _check(model: nn.Module, plan: HeadPlan, n: int) -> None:
    for name, attrs in plan.heads.items():
        m = model.get_submodule(name)
        for attr in attrs:
            if getattr(m, attr) % n:
                raise UsageError(f"tensor: {name} has {attr}={getattr(m, attr)} heads, "
                                 f"which {n} ranks do not divide")  # fmt: skip
    for name, style in plan.styles.items():
        if "*" in name or "?" in name:
            continue
        lin = model.get_submodule(name)
        size = lin.out_features if isinstance(style, ColwiseParallel) else lin.in_features
        if isinstance(lin, nn.Linear) and size % n:
            raise UsageError(f"tensor: {name} has {size} features to shard, which {n} ranks "
                             "do not divide")  # fmt: skip


def _user_styles(spec: str, model: nn.Module) -> dict[str, ParallelStyle]:
    obj = model_spec.load_object(spec, "--tp-plan")
    if callable(obj):
        obj = obj(model)
    if not isinstance(obj, dict) or not all(
        isinstance(k, str) and isinstance(v, ParallelStyle) for k, v in obj.items()
    ):
        raise UsageError(f"--tp-plan {spec}: expected a dict of module names to ParallelStyle")
    return dict(obj)


# --- the fused qkv rows: rank r's contiguous shard holds q, k and v of its heads ----------
def qkv_order(width: int, n: int) -> torch.Tensor:
    """Row indices of a fused (3C, C) weight in sharded order: for each rank r, its C/N rows
    of q, then of k, then of v."""
    c = width // n
    return torch.cat([torch.arange(r * c, (r + 1) * c) + p * width
                      for r in range(n) for p in range(3)])  # fmt: skip


def reorder_fused(model: nn.Module, plan: HeadPlan, n: int) -> None:
    """The fused Linears' rows into sharded order (before parallelize_module), head counts
    set to each rank's share."""
    with torch.no_grad():
        for name, width in plan.fused.items():
            lin = model.get_submodule(name)
            order = qkv_order(width, n).to(lin.weight.device)
            for p in (lin.weight, lin.bias):
                if p is not None:
                    p.copy_(p[order])
    for name, attrs in plan.heads.items():
        m = model.get_submodule(name)
        for attr in attrs:
            setattr(m, attr, getattr(m, attr) // n)


def fused_keys(plan: HeadPlan) -> dict[str, int]:
    """state_dict key (the parallel model's) -> the fused Linear's width C."""
    return {f"{name}.{p}": w for name, w in plan.fused.items() for p in ("weight", "bias")}


def to_user(state: dict[str, torch.Tensor], plan: HeadPlan, n: int) -> dict:
    """The parallel model's whole tensors as the user's model names and orders them."""
    out = {}
    keys = fused_keys(plan)
    for k, v in state.items():
        if k in keys and torch.is_tensor(v):
            v = v[torch.argsort(qkv_order(keys[k], n))]
        out[_user_key(k, plan)] = v
    return out


def from_user(state: dict[str, torch.Tensor], plan: HeadPlan, n: int) -> dict:
    """The inverse of to_user: the user's state under the parallel model's names and order."""
    back = {_user_key(k, plan): k for k in _model_keys(plan, state)}
    out = {}
    keys = fused_keys(plan)
    for k, v in state.items():
        key = back.get(k, k)
        out[key] = v[qkv_order(keys[key], n)] if key in keys else v
    return out


def _model_keys(plan: HeadPlan, state: dict) -> list[str]:
    keys = list(state)
    for name in plan.swapped:
        keys += [f"{name}.{new}" for new in RENAMES]
    return keys


def _user_key(key: str, plan: HeadPlan) -> str:
    for name in plan.swapped:
        for new, old in RENAMES.items():
            if key == f"{name}.{new}":
                return f"{name}.{old}"
    return key


def param_orders(model: nn.Module, plan: HeadPlan) -> dict[int, int]:
    """Optimizer parameter index -> fused width, for the fused Linears' parameters."""
    keys = fused_keys(plan)
    return {i: keys[n] for i, (n, _) in enumerate(model.named_parameters()) if n in keys}
