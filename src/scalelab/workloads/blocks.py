"""The stack of repeated blocks in a model's module tree: what a transformer is built from
(`h.0..N-1`, `blocks.*`, nn.TransformerEncoder's `layers.*`).

One small function with no knowledge of who uses it: the block view of a user model's layers
(workloads/block_layers.py: one layer per block, for the pipeline's cut points and the cost
table), and one FSDP unit per block. The attention modules in it and their head counts
(`attention_modules`, `head_attrs`): what the tensor-parallel plan shards by heads
(strategies/tensor_plans/) and what predict checks the ranks divide.
"""

from __future__ import annotations

from torch import nn

# Attributes a module's head count goes by (the attention module of a block holds one).
HEADS = ("heads", "n_heads", "num_heads", "n_head", "nhead", "num_attention_heads",
         "n_kv_heads", "num_key_value_heads")  # fmt: skip


def repeated_blocks(module: nn.Module) -> tuple[str, list[str]] | None:
    """(the container's dotted name, its blocks' dotted names) of the model's repeated block
    stack, None when it has none.

    The stack is an nn.ModuleList or nn.Sequential of at least two children, all of one class,
    holding parameters. Among several (a ModuleList of experts inside each block), the
    shallowest wins, then the one with the most children: the blocks of the model, not the
    pieces of a block. The root itself counts (name "").
    """
    best: tuple[int, int, str, list[str]] | None = None
    for name, m in module.named_modules():
        if not isinstance(m, (nn.ModuleList, nn.Sequential)):
            continue
        kids = list(m.named_children())
        if len(kids) < 2 or len({type(child) for _, child in kids}) != 1:
            continue
        if not any(True for _ in kids[0][1].parameters()):
            continue
        depth = 0 if not name else name.count(".") + 1
        key = (depth, -len(kids))
        if best is None or key < best[:2]:
            best = (depth, -len(kids), name, [f"{name}.{k}" if name else k for k, _ in kids])
    return None if best is None else (best[2], best[3])


def every_block(module: nn.Module) -> list[nn.Module]:
    """The blocks of every repeated stack, not only the model's main one: the outermost
    children of ModuleList/Sequential containers whose >= 2 children are all of one class and
    all hold parameters, in module order (ResNet's four stages give their 8 blocks; fsdp wraps
    each as a unit)."""
    found: list[nn.Module] = []
    inside: set[int] = set()  # modules below a block already taken
    for m in module.modules():
        if id(m) in inside:
            continue
        kids = list(m.children()) if isinstance(m, (nn.ModuleList, nn.Sequential)) else []
        same = len(kids) >= 2 and len({type(k) for k in kids}) == 1
        if same and all(holds_parameters(k) for k in kids):
            found.extend(kids)
            inside.update(id(d) for k in kids for d in k.modules())
    return found


def holds_parameters(m: nn.Module) -> bool:
    return any(True for _ in m.parameters())


def attention_modules(model: nn.Module) -> list[str]:
    """Modules with a head count attribute and Linear children of their own."""
    return [n for n, m in model.named_modules()
            if head_attrs(m) and any(isinstance(c, nn.Linear) for c in m.children())]  # fmt: skip


def head_attrs(m: nn.Module) -> list[str]:
    """The head count attributes m holds (ints, not bools)."""
    return [a for a in HEADS if isinstance(getattr(m, a, None), int)
            and not isinstance(getattr(m, a), bool)]  # fmt: skip


def undivided_heads(model: nn.Module, n: int) -> str | None:
    """The one line naming the first attention module whose heads n ranks do not divide."""
    for name in attention_modules(model):
        m = model.get_submodule(name)
        for attr in head_attrs(m):
            if getattr(m, attr) % n:
                return heads_refusal(name, attr, getattr(m, attr), n)
    return None


def heads_refusal(module: str, attr: str, value: int, n: int) -> str:
    """The one wording of a head count (or width) that n tensor ranks do not divide."""
    return f"tensor: {module} has {attr}={value}, which {n} ranks do not divide"
