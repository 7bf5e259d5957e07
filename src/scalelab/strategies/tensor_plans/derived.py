"""The tensor-parallel plan of a model built from repeated blocks, from one of three sources,
in this order: a user's `--tp-plan MODULE:OBJECT` (a dict of module-name patterns, fnmatch as
parallelize_module reads them, to torch ParallelStyles, or a callable returning one from the
model); the plan the model declares (declared.py: Hugging Face's); else one derived from its
blocks: in each block, the attention module (attention.py: a head count and projections) has
its q, k, v projections sharded column-wise by heads and its output projection row-wise; the
projections outside it (the MLP) have their up/gate projections column-wise and the down
projection row-wise. Everything outside the blocks (embeddings, the head) is replicated, so a
head tied to the embedding stays tied. Modules holding a parameter tied to another module's
stay replicated under any plan.

Whatever the source, the attention modules it shards have the shape attributes their forward
reads set to each rank's share (head counts; widths equal to the full width, whose forward
then sees its input at the rank's width: local_width.py), and a fused qkv projection (out = 3
x width: q, k, v side by side) is sharded by heads: its rows are reordered so that rank r's
contiguous shard holds q, k and v of its own heads (ColwiseParallel shards contiguous rows),
and put back in the user's order whenever the weights leave the run (to_user). torch's
nn.MultiheadAttention is swapped first for an equivalent module with one such Linear
(mha_swap.py); transformers' Conv1D takes the Conv1D styles (conv1d.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fnmatch import fnmatch

import torch
from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from scalelab.errors import UsageError
from scalelab.strategies.tensor_plans import attention as att
from scalelab.strategies.tensor_plans import conv1d, declared, local_width
from scalelab.strategies.tensor_plans.mha_swap import RENAMES, swap_attention
from scalelab.workloads import model_spec
from scalelab.workloads.blocks import head_attrs, heads_refusal, repeated_blocks

OUT_NAMES = ("out_proj", "o_proj", "proj", "c_proj", "wo", "dense", "out")


def tp_degree(cfg) -> int:
    """The tensor-parallel degree of cfg: --tp, else every rank of one replica (--dp)."""
    return cfg.tp if cfg.tp is not None else max(cfg.ranks // max(cfg.dp, 1), 1)


@dataclass
class HeadPlan:
    styles: dict[str, ParallelStyle]  # module name -> its style
    heads: dict[str, list[str]] = field(default_factory=dict)  # module -> attributes // N
    fused: dict[str, int] = field(default_factory=dict)  # fused qkv projection -> its width C
    conv1d: list[str] = field(default_factory=list)  # fused ones that are Conv1D: W (in, out)
    narrow: dict[str, int] = field(default_factory=dict)  # attention -> its width C (local_width)
    swapped: list[str] = field(default_factory=list)  # nn.MultiheadAttention names swapped
    source: str = "derived"  # derived, declared (the model's own), --tp-plan

    def pairs(self) -> list[list[str]]:
        return [[n, type(s).__name__] for n, s in self.styles.items()]


def derive_plan(model: nn.Module, n: int, user: str | None = None) -> HeadPlan:
    """The plan for n ranks, after swapping the model's nn.MultiheadAttention (in place).
    A head count or width the ranks do not divide: one line naming the module."""
    swapped = swap_attention(model)
    own = declared.declared(model)
    if user is not None:
        plan = HeadPlan(_expand(model, _user_styles(user, model)), source="--tp-plan")
    elif own:
        plan = HeadPlan(_expand(model, declared.styles(own)), source="declared")
    else:
        plan = HeadPlan({})
        found = repeated_blocks(model)
        if found is None:
            raise UsageError("tensor --engine torch: the model has no stack of repeated blocks")
        for block in found[1]:
            _plan_block(model, block, plan)
        if not plan.styles:
            raise UsageError(f"tensor --engine torch: {found[1][0]} holds no Linear to shard")
    if not plan.styles:
        raise UsageError(
            f"tensor: the {plan.source} plan matches no module of the model (names as "
            "named_modules() gives them); pass --tp-plan MODULE:OBJECT"
        )
    plan.swapped = swapped
    _untie(model, plan)
    _attention(model, plan)
    plan.styles = {k: conv1d.for_module(s, model.get_submodule(k)) for k, s in plan.styles.items()}
    _check(model, plan, n)
    return plan


def parallelize(model: nn.Module, mesh, plan: HeadPlan) -> nn.Module:
    """The plan put on the model (in place): fused rows in sharded order, shape attributes to
    each rank's share, attention inputs at the rank's width, then torch's parallelize_module."""
    n = mesh.size()
    reorder_fused(model, plan, n)
    local_width.install(model, {a: w // n for a, w in plan.narrow.items()})
    return parallelize_module(model, mesh, plan.styles)


def _expand(model: nn.Module, styles: dict[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """Patterns -> the module names they match (the first pattern matching a module wins)."""
    out = {}
    for name, _ in model.named_modules():
        hit = next((s for k, s in styles.items() if name and _matches(k, name)), None)
        if hit is not None:
            out[name] = hit
    return out


def _plan_block(model: nn.Module, block: str, plan: HeadPlan) -> None:
    attn = [a for a in att.attention_modules(model) if a.startswith(block + ".") or a == block]
    inside = set()
    for a in attn:
        lins = att.projections(model, a)
        inside.update(f"{a}.{c}" for c, _ in lins)
        out = next((c for c, _ in lins if c in OUT_NAMES), lins[-1][0])
        width = att.in_out(dict(lins)[out])[1]
        for child, lin in lins:  # a block that is its own attention: its MLP's down reads more
            row = child == out or att.in_out(lin)[0] != width
            plan.styles[f"{a}.{child}"] = RowwiseParallel() if row else ColwiseParallel()
    rest = [(nm, m) for nm, m in model.get_submodule(block).named_modules()
            if att.is_projection(m) and f"{block}.{nm}" not in inside]  # fmt: skip
    if len(rest) < 2:
        return
    width = min(att.in_out(m)[0] for _, m in rest)  # the block's width: up/gate read it
    down = [nm for nm, m in rest if att.in_out(m)[0] != width] or [rest[-1][0]]
    for name, _ in rest:
        style = RowwiseParallel() if name in down else ColwiseParallel()
        plan.styles[f"{block}.{name}"] = style


def _untie(model: nn.Module, plan: HeadPlan) -> None:
    """Modules holding a parameter another module holds too stay replicated (tied)."""
    owners: dict[int, set[str]] = {}
    for name, m in model.named_modules():
        for p in m.parameters(recurse=False):
            owners.setdefault(id(p), set()).add(name)
    tied = {nm for names in owners.values() if len(names) > 1 for nm in names}
    plan.styles = {k: s for k, s in plan.styles.items() if k not in tied}


def _attention(model: nn.Module, plan: HeadPlan) -> None:
    """The attention modules the plan shards: attributes to divide, fused rows, narrow input."""
    for a in att.attention_modules(model):
        lins = att.projections(model, a)
        sharded = {c: plan.styles[f"{a}.{c}"] for c, _ in lins if f"{a}.{c}" in plan.styles}
        if not any(_splits_heads(s) for s in sharded.values()):
            continue
        m = model.get_submodule(a)
        out = next((c for c, _ in lins if isinstance(sharded.get(c), RowwiseParallel)), None)
        width = att.in_out(dict(lins)[out])[1] if out is not None else None
        widths = att.width_attrs(m, width) if width is not None else []
        plan.heads[a] = head_attrs(m) + widths
        if widths:
            plan.narrow[a] = width
        col = [(c, lin) for c, lin in lins if _splits_heads(sharded.get(c))]
        if any(att.in_out(lin)[1] == width for _, lin in col):
            col = []  # separate q, k, v: no fused projection (a 3x MLP is not one)
        for child, lin in col:
            if att.in_out(lin)[1] == 3 * (width or -1):
                plan.fused[f"{a}.{child}"] = width
                if att.is_conv1d(lin):
                    plan.conv1d.append(f"{a}.{child}")


def _splits_heads(style: ParallelStyle | None) -> bool:
    """A column split whose output stays sharded: the attention after it sees the rank's heads.
    One that gathers its output (HF's colwise_gather_output: Phi-3's fused qkv_proj) hands on
    every head, so the head counts stay whole and a fused projection keeps its row order."""
    if not isinstance(style, ColwiseParallel):
        return False
    return not isinstance(style.output_layouts[0], Replicate)


def _matches(pattern: str, name: str) -> bool:
    return len(pattern.split(".")) == len(name.split(".")) and all(
        fnmatch(a, p) for a, p in zip(name.split("."), pattern.split("."))
    )


def _check(model: nn.Module, plan: HeadPlan, n: int) -> None:
    for name, attrs in plan.heads.items():
        m = model.get_submodule(name)
        for attr in attrs:
            if getattr(m, attr) % n:
                raise UsageError(heads_refusal(name, attr, getattr(m, attr), n))
    for name, style in plan.styles.items():
        m = model.get_submodule(name)
        if not att.is_projection(m):
            continue
        size = att.in_out(m)[1] if isinstance(style, ColwiseParallel) else att.in_out(m)[0]
        parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
        hd = getattr(parent, "head_dim", None)
        step = hd if isinstance(style, ColwiseParallel) and type(hd) is int else 1
        if size % (n * step):
            what = f"{size // step} heads of {step}" if step > 1 else f"{size} features"
            raise UsageError(f"tensor: {name} has {what} to shard, which {n} ranks do not "
                             "divide; pass fewer --tp ranks or --tp-plan")  # fmt: skip


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


def permute(t: torch.Tensor, how: tuple[int, int], n: int, back: bool = False) -> torch.Tensor:
    """A fused parameter (or its optimizer state) into sharded order, or back to the user's;
    how = (width C, the dim holding q|k|v: 0 for a Linear's (3C, C), 1 for a Conv1D's (C, 3C))."""
    if t.dim() == 0:
        return t
    width, dim = how
    order = qkv_order(width, n).to(t.device)
    return t.index_select(dim, torch.argsort(order) if back else order)


def reorder_fused(model: nn.Module, plan: HeadPlan, n: int) -> None:
    """The fused projections' rows into sharded order (before parallelize_module), the
    shape attributes (head counts, widths) set to each rank's share."""
    keys = fused_keys(plan)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in keys:
                p.copy_(permute(p, keys[name], n))
    for name, attrs in plan.heads.items():
        m = model.get_submodule(name)
        for attr in attrs:
            setattr(m, attr, getattr(m, attr) // n)


def fused_keys(plan: HeadPlan) -> dict[str, tuple[int, int]]:
    """state_dict key (the parallel model's) -> (the fused projection's width C, its q|k|v
    dim)."""
    out = {}
    for name, w in plan.fused.items():
        out[f"{name}.weight"] = (w, 1 if name in plan.conv1d else 0)
        out[f"{name}.bias"] = (w, 0)
    return out


def to_user(state: dict[str, torch.Tensor], plan: HeadPlan, n: int) -> dict:
    """The parallel model's whole tensors as the user's model names and orders them."""
    out = {}
    keys = fused_keys(plan)
    for k, v in state.items():
        if k in keys and torch.is_tensor(v):
            v = permute(v, keys[k], n, back=True)
        out[_user_key(k, plan)] = v
    return out


def from_user(state: dict[str, torch.Tensor], plan: HeadPlan, n: int) -> dict:
    """The inverse of to_user: the user's state under the parallel model's names and order."""
    back = {_user_key(k, plan): k for k in _model_keys(plan, state)}
    out = {}
    keys = fused_keys(plan)
    for k, v in state.items():
        key = back.get(k, k)
        out[key] = permute(v, keys[key], n) if key in keys else v
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


def param_orders(model: nn.Module, plan: HeadPlan) -> dict[int, tuple[int, int]]:
    """Optimizer parameter index -> (fused width, q|k|v dim), for the fused parameters."""
    keys = fused_keys(plan)
    return {i: keys[n] for i, (n, _) in enumerate(model.named_parameters()) if n in keys}
