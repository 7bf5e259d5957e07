"""The block view of a user model whose forward is not a straight chain of its children (a
transformer: an embedding plus a position parameter added in the root's forward, a stack of
blocks with residual adds inside, a norm and a head).

From the traced call tree (module_layers.trace) and the repeated block stack
(blocks.repeated_blocks): the module calls before the first block, each block, the calls
after the last block, each a layer in call order; parameters owned by the root (or by the
containers around the stack: a learned position table) are one `parameter` layer before the
first block. A call whose subtree holds a block (nn.TransformerEncoder around its layers) is
opened up. FLOPs per layer are FlopCounterMode's count inside the call, as for a chain.

These layers do not compose as a chain (the root's own ops sit between them): a pipeline cuts
such a model with torch.distributed.pipelining's tracer at the layers' module names
(`cut_points` says which names a cut may start at: a module called once, not the first).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from scalelab.workloads import module_layers as ml
from scalelab.workloads.blocks import repeated_blocks
from scalelab.workloads.layers import Layer


class RootParams(nn.Module):
    """The parameters the model's root (or a container around its blocks) owns itself, as one
    layer: the same Parameter objects, under their dotted names with '.' -> '__'."""

    def __init__(self, params: dict[str, nn.Parameter]) -> None:
        super().__init__()
        self.names = list(params)
        for name, p in params.items():
            self.register_parameter(name.replace(".", "__"), p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x  # not a step of the forward: the root's own ops use these

    def extra_repr(self) -> str:
        return ", ".join(self.names)


@dataclass
class BlockView:
    stack: str  # the container's dotted name ("body.layers")
    blocks: list[str]  # the blocks' dotted names
    layers: list[Layer]
    calls: list[ml.Call | None]  # the call each layer computes (None: the root's parameters)
    cut_points: frozenset[str]  # layer paths a stage may begin at


def root_params(model: nn.Module, stack: str) -> dict[str, nn.Parameter]:
    """Parameters owned directly by the root or by a container on the way to the stack."""
    owners = [""] + [".".join(stack.split(".")[: i + 1]) for i in range(stack.count(".") + 1)]
    owners = [o for o in owners if o != stack] if stack else [""]
    modules = dict(model.named_modules())
    out: dict[str, nn.Parameter] = {}
    for owner in owners:
        for name, p in modules[owner].named_parameters(recurse=False):
            out[f"{owner}.{name}" if owner else name] = p
    return out


def block_view(root: ml.Call) -> BlockView | str | None:
    """The block view of a traced model; None without a repeated block stack; a reason (str)
    when the stack is there but the blocks do not run one after another."""
    found = repeated_blocks(root.module)
    if found is None:
        return None
    stack, names = found
    calls: list[ml.Call] = []
    _walk(root, set(names), calls)
    seen = [c for c in calls if c.path in names]
    if [c.path for c in seen] != names:
        return f"its blocks {stack}.* do not run once each, in order"
    for a, b in zip(seen, seen[1:]):
        if not b.inputs or b.inputs[0] is not carried(a.output):
            return f"{b.path} does not read what {a.path} returned"
    params = root_params(root.module, stack)
    first = calls.index(seen[0])
    layers = [_layer(c, c.path in names) for c in calls]
    views: list[ml.Call | None] = list(calls)
    if params:
        layers.insert(first, Layer(_params_name(params), "parameter", RootParams(params)))
        views.insert(first, None)
    counts = _call_counts(root)
    cuts = frozenset(x.path for x in layers[1:] if x.path is not None and counts[x.path] == 1)
    return BlockView(stack=stack, blocks=names, layers=layers, calls=views, cut_points=cuts)


def carried(output: object) -> object:
    """What a block hands the next one: its output, or the first element of a tuple (a layer
    returning (hidden, attention weights), as older Hugging Face layers do; torch's tracer
    cuts between such blocks and sends only what the next stage reads)."""
    return output[0] if isinstance(output, tuple) and output else output


def _params_name(params: dict[str, nn.Parameter]) -> str:
    return ",".join(params) if len(params) <= 2 else f"{next(iter(params))},+{len(params) - 1}"


def _walk(call: ml.Call, names: set[str], out: list[ml.Call]) -> None:
    """The calls under `call` in order: blocks, and calls whose subtree holds no block."""
    for child in call.children:
        if child.path not in names and _holds(child.path, names):
            _walk(child, names, out)
        else:
            out.append(child)


def _holds(path: str, names: set[str]) -> bool:
    return any(not path or n.startswith(path + ".") for n in names)


def _call_counts(root: ml.Call) -> dict[str, int]:
    counts: dict[str, int] = {}
    todo = [root]
    while todo:
        call = todo.pop()
        counts[call.path] = counts.get(call.path, 0) + 1
        todo.extend(call.children)
    return counts


def _layer(call: ml.Call, block: bool) -> Layer:
    return ml.describe(call, block=block or bool(call.children))


def layer_params(layer: Layer) -> int:
    return sum(p.numel() for p in layer.module.parameters())
