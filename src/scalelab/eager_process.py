"""A process that never compiles does not import torch._dynamo.

torch wraps ~300 of its own functions in `torch._disable_dynamo` (the optimizer's
`add_param_group` and `zero_grad`, the Python meta kernels of addmm, relu and round, DTensor's
constructor, activation checkpointing), so that dynamo never traces into them. The wrapper
imports torch._dynamo at its first call and caches `torch._dynamo.disable(fn)` on the function
as `fn.__dynamo_disable`. That import costs 1.6-2.0 s of CPU (sympy, torch.fx passes, the
inductor config), as much as `import torch` itself, for a wrapper that does nothing while
nothing is being compiled: every process that probes a model on the meta device (a user's model,
plan, predict, fit, fsdp's and the pipeline's meta builds) or builds an optimizer paid it.
`stay_eager()` puts the function itself in that cache (its first call then runs it directly),
for the wrappers torch has made so far and for every one it makes later. A training step still
imports dynamo (torch.optim's `step` wrapper calls `torch._dynamo.graph_break()`), and so do
DDP's constructor and torch's pipelining tracer: those processes pay it as before.

The moment anything imports torch._dynamo (a `--compile` run, `bench`'s compiled peers, a user's
model that compiles itself, DDP's constructor, torch.export), every seeded cache is emptied
first and the decorator restored, so from then on torch wraps them as it always did: nothing
that is compiled ever sees a seeded function. Where torch changes how the wrapper caches, the
seed is simply never read and the import happens as before.

An optimizer's `step` imports it too: torch.optim wraps every `step` in `_use_grad`, which
imports torch._dynamo to call `graph_break()` (a no-op unless dynamo is tracing the step).
`eager_step(opt)` gives the optimizer a step that sets the same grad mode and calls the same
update and hooks without that import, and calls torch's own wrapper instead once
torch._dynamo is loaded (a compiled step then sees torch's graph breaks). An MPI rank that
trains (mpi-dp, the scheduled pipeline, tensor) and a one-process training run save the
import; ddp's constructor and FSDP2's sharding import dynamo themselves.
"""

from __future__ import annotations

import gc
import importlib.abc
import sys
import types
from collections.abc import Callable
from typing import Any

import torch
import torch._compile

_CACHE = "__dynamo_disable"  # the attribute torch._compile's wrapper caches its disable in
_DYNAMO = "torch._dynamo"


def _noop() -> None:
    return None


_WRAPPER_CODE = torch._compile._disable_dynamo(_noop).__code__  # every wrapper's code object
_FREE = _WRAPPER_CODE.co_freevars  # ("fn", "recursive")
_seeded: list[Callable[..., Any]] = []
_original = torch._compile._disable_dynamo


def _seed(wrapper: Any) -> None:
    """The function a wrapper calls is its closure's `fn` (not `__wrapped__`, which torch._refs
    rewrites on some of them)."""
    if getattr(wrapper, "__code__", None) is not _WRAPPER_CODE or "fn" not in _FREE:
        return
    fn = wrapper.__closure__[_FREE.index("fn")].cell_contents
    if getattr(fn, _CACHE, None) is None:
        setattr(fn, _CACHE, fn)
        _seeded.append(fn)


def _seeding(fn: Callable[..., Any] | None = None, recursive: bool = True) -> Any:
    """torch._disable_dynamo, whose wrappers are seeded as they are made."""
    if fn is None:
        return lambda f: _seeding(f, recursive)
    wrapper = _original(fn, recursive)
    _seed(wrapper)
    return wrapper


class _RestoreBeforeDynamo(importlib.abc.MetaPathFinder):
    """Empties the seeded caches and restores the decorator before torch._dynamo loads. It
    stays on sys.meta_path afterwards (idle): the import system is iterating that list."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name == _DYNAMO:
            restore()
        return None


_finder = _RestoreBeforeDynamo()


def stay_eager() -> None:
    """Seed every dynamo-disable wrapper torch has made and will make (idempotent); a no-op
    once torch._dynamo is loaded."""
    if _DYNAMO in sys.modules:
        return
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
    torch._compile._disable_dynamo = _seeding
    torch._disable_dynamo = _seeding
    for obj in gc.get_objects():
        if type(obj) is types.FunctionType and obj.__code__ is _WRAPPER_CODE:
            _seed(obj)


def restore() -> None:
    """torch's own behaviour back: the caches empty, the decorator torch's."""
    torch._compile._disable_dynamo = _original
    torch._disable_dynamo = _original
    while _seeded:
        fn = _seeded.pop()
        if getattr(fn, _CACHE, None) is fn:
            delattr(fn, _CACHE)


def seeded() -> int:
    """How many wrappers are seeded now (0 once restored)."""
    return len(_seeded)


def _use_grad_code() -> Any:
    import torch.optim.optimizer as optimizer_module  # the submodule, not torch.optim's names

    wrap = getattr(optimizer_module, "_use_grad_for_differentiable", None)
    return None if wrap is None else wrap(_noop).__code__


_USE_GRAD_CODE = _use_grad_code()  # the code of torch.optim's `_use_grad` wrapper


def eager_step(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """opt, whose step skips `_use_grad`'s torch._dynamo import while dynamo is not loaded.

    torch patched the class's step at construction: profile_hook_step(_use_grad(update)),
    each with `__wrapped__`. Where the chain is not that (another torch, an optimizer of its
    own), opt is returned as it is. The instance's step is a bound method (LR schedulers
    rewrap `opt.step.__func__`)."""
    hooked = type(opt).step
    use_grad = getattr(hooked, "__wrapped__", None)
    update = getattr(use_grad, "__wrapped__", None)
    if (
        _USE_GRAD_CODE is None
        or not getattr(hooked, "hooked", False)
        or getattr(use_grad, "__code__", None) is not _USE_GRAD_CODE
        or update is None
    ):
        return opt

    def in_grad_mode(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        before = torch.is_grad_enabled()
        torch.set_grad_enabled(self.defaults["differentiable"])  # as _use_grad does
        try:
            return update(self, *args, **kwargs)
        finally:
            torch.set_grad_enabled(before)

    with_hooks = torch.optim.Optimizer.profile_hook_step(in_grad_mode)

    def step(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        if _DYNAMO in sys.modules:  # something compiles: torch's own step, graph breaks included
            return hooked(self, *args, **kwargs)
        return with_hooks(self, *args, **kwargs)

    opt.step = types.MethodType(step, opt)  # type: ignore[method-assign]
    return opt
