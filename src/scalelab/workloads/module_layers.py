"""A torch module's layers and their costs, read from the module itself (user models).

One traced forward (batch 1, eval mode) records every module call in order: its input, its
output and the FLOPs `torch.utils.flop_counter` counted inside it (flops.py: attention counted
from its shapes, a formula that fails counts its op 0 with a warning). A module expands into its
children when its forward is a straight chain of them: the first child reads the module's
input, each next child reads what the previous one returned, the module returns what the last
one returned (a contiguous reshape in between, like `x.flatten(1)`, becomes a glue layer).
Anything else (a residual add, a branch, an op between children, own parameters, a child with
parameters called twice) keeps the module whole, as one `block` layer. nn.Sequential is the
simplest chain; a leaf module is a layer by itself.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from scalelab.workloads.flops import GuardedCounter
from scalelab.workloads.layers import Layer

POINT = (nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Sigmoid, nn.Tanh, nn.LeakyReLU, nn.ELU,
         nn.Hardswish, nn.Hardsigmoid, nn.Mish, nn.Identity, nn.Dropout, nn.Dropout1d,
         nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout)  # fmt: skip
BATCHNORM = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
CONV = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
MAXPOOL = (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d)
AVGPOOL = (nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d)
GLOBAL_KINDS = (
    (nn.Linear, "linear"),
    (nn.Flatten, "flatten"),
    (nn.Embedding, "embedding"),
    ((nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d), "avgpool"),
    ((nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d), "maxpool"),
)
NORM_FLOPS = {"batchnorm": 2, "layernorm": 5}  # per element (eval BN: x * scale + shift)


@dataclass
class Call:
    """One module call of the traced forward."""

    path: str  # dotted path in the model ("" for the model itself)
    module: nn.Module
    inputs: tuple  # positional args as called
    output: object
    flops: int = 0
    children: list[Call] = field(default_factory=list)


class Reshape(nn.Module):
    """Glue for a contiguous reshape the forward makes between two children: (N, ...) ->
    (N, *shape)."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.shape = tuple(shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(x.shape[0], *self.shape)

    def extra_repr(self) -> str:
        return f"shape={self.shape}"


def trace(model: nn.Module, x: torch.Tensor) -> Call:
    """The call tree of model(x): every module call with its in/out tensors and FLOPs."""
    names = {id(m): n for n, m in model.named_modules()}
    stack: list[Call] = []
    root: list[Call] = []
    guarded = GuardedCounter()  # torch's FlopCounterMode; no formula of it raises
    counter = guarded.mode

    def pre(module: nn.Module, args: tuple) -> None:
        call = Call(names.get(id(module), "?"), module, args, None, -counter.get_total_flops())
        (stack[-1].children if stack else root).append(call)
        stack.append(call)

    def post(module: nn.Module, args: tuple, output: object) -> None:
        call = stack.pop()
        call.inputs, call.output = args, output  # after the pre-hooks (the token-id cast)
        call.flops += counter.get_total_flops()

    handles = [m.register_forward_pre_hook(pre) for m in model.modules()]
    handles += [m.register_forward_hook(post) for m in model.modules()]
    try:
        with torch.no_grad(), attention_counted(), counter:
            model(x)
    finally:
        for h in handles:
            h.remove()
    guarded.warn(type(model).__name__)
    return root[0]


@contextmanager
def attention_counted() -> Iterator[None]:
    """torch's fast path off while FLOPs are counted: in eval under no_grad,
    nn.MultiheadAttention and nn.TransformerEncoderLayer run one fused op
    (`_native_multi_head_attention`, `_transformer_encoder_layer_fwd`) that FlopCounterMode
    does not count (an encoder's attention counted 0 FLOPs). Off, the same
    projections and attention run as the linear and scaled_dot_product_attention ops it
    counts: the same arithmetic the fused path does."""
    mha = getattr(torch.backends, "mha", None)
    if mha is None or not hasattr(mha, "set_fastpath_enabled"):
        yield
        return
    before = mha.get_fastpath_enabled()
    mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        mha.set_fastpath_enabled(before)


def derive_layers(call: Call) -> tuple[list[Layer], list[Call | None], str | None]:
    """(layers, the call each computes (None for glue), why the model is not a chain or None).

    Layers compose to the model's forward. The reason names the first module that stays a
    block: "layer1.0: its forward is not a chain of its children (...)"."""
    layers: list[Layer] = []
    calls: list[Call | None] = []
    first_block: list[str] = []
    _expand(call, layers, calls, first_block)
    return layers, calls, (first_block[0] if first_block else None)


def _expand(call: Call, layers: list[Layer], calls: list, blocks: list[str]) -> None:
    why = None if not call.children else _not_a_chain(call)
    if not call.children or why is not None:
        if why is not None:
            blocks.append(f"{call.path or 'the model'}: {why}")
        layers.append(describe(call, block=why is not None))
        calls.append(call)
        return
    prev = call.inputs[0]
    for child in call.children:
        if child.inputs[0] is not prev:  # a contiguous reshape (checked by _not_a_chain)
            layers.append(Layer(f"{child.path}.reshape", "reshape", Reshape(
                tuple(child.inputs[0].shape[1:]))))  # fmt: skip
            calls.append(None)
        _expand(child, layers, calls, blocks)
        prev = child.output
    if call.output is not prev:
        layers.append(Layer(f"{call.path or 'output'}.reshape", "reshape",
                            Reshape(tuple(call.output.shape[1:]))))  # fmt: skip
        calls.append(None)


def _not_a_chain(call: Call) -> str | None:
    """Why call's forward is not a straight chain of its children (None: it is one)."""
    if any(True for _ in call.module.parameters(recurse=False)):
        return "it holds parameters of its own"
    if len(call.inputs) != 1 or not torch.is_tensor(call.inputs[0]):
        return "it takes more than one input"
    seen: set[int] = set()
    prev = call.inputs[0]
    for child in call.children:
        if len(child.inputs) != 1 or not _same_or_reshape(child.inputs[0], prev):
            if len(child.inputs) == 1 and _reordered(child.inputs[0], prev):
                return (f"{child.path} reads a transpose or permute of what came before it, "
                        f"done in {call.path or 'the model'}'s forward")  # fmt: skip
            return f"{child.path} does not read what came before it (a branch or residual)"
        if id(child.module) in seen and any(True for _ in child.module.parameters()):
            return f"{child.path} is called twice (shared weights)"
        seen.add(id(child.module))
        prev = child.output
        if not torch.is_tensor(prev):
            return f"{child.path} returns {type(prev).__name__}, not a tensor"
    if not _same_or_reshape(call.output, prev):
        return "its output is not its last child's output"
    return None


def _reordered(b: object, a: object) -> bool:
    """b holds a's values in another order (a transpose, permute or flip; one item)."""
    if not (torch.is_tensor(a) and torch.is_tensor(b)) or a.shape[0] != b.shape[0]:
        return False
    if a.numel() != b.numel() or a.dtype != b.dtype or a.shape == b.shape and torch.equal(a, b):
        return False
    return bool(torch.equal(a.flatten().sort().values, b.flatten().sort().values))


def _same_or_reshape(b: object, a: object) -> bool:
    """b is a, or a contiguous reshape of a keeping the batch dimension."""
    if b is a:
        return True
    if not (torch.is_tensor(a) and torch.is_tensor(b)) or a.dtype != b.dtype:
        return False
    return (
        a.is_contiguous() and b.is_contiguous() and a.numel() == b.numel()
        and a.shape[0] == b.shape[0] and a.data_ptr() == b.data_ptr()
    )  # fmt: skip


def describe(call: Call, block: bool = False) -> Layer:
    """A Layer for one module: kind, reach along the split axis and window geometry."""
    m, name = call.module, call.path or "model"
    if block:
        return Layer(name, "block", m, "global", path=call.path)
    if isinstance(m, CONV + MAXPOOL + AVGPOOL):
        return _windowed(name, m, call.path)
    if isinstance(m, BATCHNORM):
        return Layer(name, "batchnorm", m, "point", path=call.path)
    if isinstance(m, POINT):
        return Layer(name, type(m).__name__.lower(), m, "point", path=call.path)
    if isinstance(m, nn.LayerNorm):
        whole = tuple(m.normalized_shape) == tuple(call.output.shape[1:])
        reach = "norm" if whole and call.output.dim() > 2 else "global"
        return Layer(name, "layernorm", m, reach, path=call.path)
    kind = next((k for types, k in GLOBAL_KINDS if isinstance(m, types)), None)
    return Layer(name, kind or type(m).__name__.lower(), m, "global", path=call.path)


def _windowed(name: str, m: nn.Module, path: str) -> Layer:
    """Conv and pooling: a window along the split axis when square, undilated, zero-padded."""
    kind = "conv" if isinstance(m, CONV) else "maxpool" if isinstance(m, MAXPOOL) else "avgpool"
    dims = 1 if isinstance(m, (nn.Conv1d, nn.MaxPool1d, nn.AvgPool1d)) else 2
    dims = 3 if isinstance(m, (nn.Conv3d, nn.MaxPool3d, nn.AvgPool3d)) else dims
    k, s, p = (_per_axis(getattr(m, a), dims) for a in ("kernel_size", "stride", "padding"))
    s = s or k  # pooling's stride defaults to its kernel
    dilation = _per_axis(getattr(m, "dilation", 1), dims)
    uniform = all(v is not None and len(set(v)) == 1 for v in (k, s, p))
    plain = uniform and set(dilation or (0,)) == {1} and not getattr(m, "ceil_mode", False)
    plain = plain and getattr(m, "padding_mode", "zeros") == "zeros"
    if not plain:
        return Layer(name, kind, m, "global", path=path)
    return Layer(name, kind, m, "window", k[0], s[0], p[0], path=path)


def _per_axis(value: object, dims: int) -> tuple[int, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):  # padding="same"/"valid": no fixed number
        return (0,) * dims if value == "valid" else None
    return tuple(value) if isinstance(value, (tuple, list)) else (int(value),) * dims


def per_item_elems(t: object) -> int:
    return math.prod(t.shape[1:]) if torch.is_tensor(t) else 0


def is_elementwise(layer: Layer) -> bool:
    """Acts on each element alone (ReLU, GELU, dropout in eval): commutes with any sharding."""
    return layer.reach == "point" and layer.kind != "batchnorm" and layer.kind != "cast"


def layer_flops(layer: Layer, call: Call | None) -> int:
    """FlopCounter's count (2 per multiply-add); element-wise layers count their elements."""
    if call is None:
        return 0
    if call.flops:
        return call.flops
    if layer.kind in ("reshape", "flatten", "identity") or layer.kind.startswith("dropout"):
        return 0
    return NORM_FLOPS.get(layer.kind, 1) * per_item_elems(call.output)
