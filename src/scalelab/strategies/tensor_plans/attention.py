"""What attention is to a tensor-parallel plan: a module holding a head count attribute and
projections of its own (nn.Linear, or transformers' Conv1D whose weight is stored (in, out)),
and the shape attributes its forward reads, which must follow the shard on each rank."""

from __future__ import annotations

from torch import nn

from scalelab.workloads.blocks import head_attrs

# Attributes a forward reads as the attention's width (nanoGPT's n_embd, GPT-2's embed_dim and
# split_size, BERT's all_head_size): set to the rank's width when they equal the full one.
WIDTHS = ("n_embd", "embed_dim", "split_size", "all_head_size", "hidden_size", "d_model",
          "inner_dim")  # fmt: skip


def is_conv1d(m: nn.Module) -> bool:
    """transformers' Conv1D (and look-alikes): y = x @ weight + bias, weight (in, out)."""
    w = getattr(m, "weight", None)
    return type(m).__name__ == "Conv1D" and hasattr(m, "nf") and w is not None and w.dim() == 2


def is_projection(m: nn.Module) -> bool:
    return isinstance(m, nn.Linear) or is_conv1d(m)


def in_out(m: nn.Module) -> tuple[int, int]:
    """(input features, output features) of a projection."""
    if is_conv1d(m):
        return m.weight.shape[0], m.weight.shape[1]
    return m.in_features, m.out_features


def projections(model: nn.Module, name: str) -> list[tuple[str, nn.Module]]:
    """The projections that are direct children of module `name`: (child name, module)."""
    return [(c, m) for c, m in model.get_submodule(name).named_children() if is_projection(m)]


def attention_modules(model: nn.Module) -> list[str]:
    """Modules with a head count attribute and projections of their own."""
    return [n for n, m in model.named_modules()
            if head_attrs(m) and any(is_projection(c) for c in m.children())]  # fmt: skip


def width_attrs(m: nn.Module, width: int) -> list[str]:
    """The width attributes m holds that equal the attention's full width."""
    return [a for a in WIDTHS if type(getattr(m, a, None)) is int and getattr(m, a) == width]
