"""An attention forward that reads its width off its input: nanoGPT's

    B, T, C = x.size()                                    # C: the full width (x is replicated)
    q, k, v = self.c_attn(x).split(self.n_embd, dim=2)    # (B, T, C/N) each on a rank
    k = k.view(B, T, self.n_head, C // self.n_head)       # needs C/N // (heads/N) = head dim
    y = y.transpose(1, 2).contiguous().view(B, T, C)      # (B, T, C/N): c_proj's local input

With `n_head` and `n_embd` set to the rank's share no attribute makes `C` right: the input is
the full width. So the attention module receives its input as a `LocalWidth` tensor: the same
values, whose `size()`/`shape` report the rank's width in the last dimension; every other use
(its projections, any arithmetic) sees the plain tensor (autograd flows through as_subclass).
Installed on the attention modules whose width attributes the plan divides.
"""

from __future__ import annotations

import torch
from torch import nn

_SHAPES = {torch.Tensor.size, torch.Tensor.shape.__get__}


def _plain(v):
    return v.as_subclass(torch.Tensor) if isinstance(v, LocalWidth) else v


class LocalWidth(torch.Tensor):
    """A tensor whose size reports `local_width` in its last dimension."""

    local_width: int

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SHAPES and isinstance(args[0], LocalWidth):
            with torch._C.DisableTorchFunctionSubclass():
                full = torch.Size((*args[0].shape[:-1], args[0].local_width))
            dims = args[1:] or tuple(kwargs.values())
            return full if not dims else full[dims[0]]
        args = tuple(_plain(a) for a in args)
        kwargs = {k: _plain(v) for k, v in kwargs.items()}
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def _narrow_input(width: int):
    def hook(module, args, kwargs):
        if args and isinstance(args[0], torch.Tensor) and not isinstance(args[0], LocalWidth):
            x = args[0].as_subclass(LocalWidth)
            x.local_width = width
            return (x, *args[1:]), kwargs
        return None

    return hook


def _unwrap(module, args, kwargs):
    return tuple(_plain(a) for a in args), {k: _plain(v) for k, v in kwargs.items()}


def install(model: nn.Module, attention: dict[str, int]) -> None:
    """attention module name -> the rank's width: its input reports that width, its children
    get the plain tensor."""
    for name, width in attention.items():
        m = model.get_submodule(name)
        m.register_forward_pre_hook(_narrow_input(width), with_kwargs=True)
        for child in m.children():
            child.register_forward_pre_hook(_unwrap, with_kwargs=True, prepend=True)
