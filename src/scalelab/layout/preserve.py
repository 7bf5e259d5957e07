"""Timing passes leave no trace: the pipeline's `--balance auto` profile and `--rebalance`
rounds run forward and backward on the real model, which in training mode updates
BatchNorm's running statistics (and its batch count) and draws dropout masks from torch's
RNG. `kept_state` snapshots what such a pass may change (parameters, buffers, gradients,
optimizer state, the CPU and CUDA RNG) and puts it back, so the trained model is what one
process trains from the same weights.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn


def _snapshot(module: nn.Module) -> tuple[dict[str, torch.Tensor], list[torch.Tensor | None]]:
    state = {k: v.detach().clone() for k, v in module.state_dict(keep_vars=True).items()}
    grads = [None if p.grad is None else p.grad.detach().clone() for p in module.parameters()]
    return state, grads


@torch.no_grad()
def _restore(module: nn.Module, saved: tuple[dict, list]) -> None:
    """Copy the saved values into the module's tensors where they are now (a pass may have
    moved the module to another device or dtype: the copy casts, the placement stays)."""
    state, grads = saved
    for key, now in module.state_dict(keep_vars=True).items():
        now.data.copy_(state[key])
    for p, g in zip(module.parameters(), grads, strict=True):
        p.grad = None if g is None else g.to(device=p.device, dtype=p.dtype)


@contextmanager
def kept_state(
    modules: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer] = ()
) -> Iterator[None]:
    """Run the body, then restore modules' parameters, buffers and gradients, optimizers'
    state and the RNG to what they were before it (also when it raises)."""
    saved = [_snapshot(m) for m in modules]
    opt_saved: list[Any] = [
        {k: {n: _clone(v) for n, v in s.items()} for k, s in o.state.items()} for o in optimizers
    ]
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            for m, s in zip(modules, saved, strict=True):
                _restore(m, s)
            for o, s in zip(optimizers, opt_saved, strict=True):
                o.state.clear()
                o.state.update(s)


def _clone(v: Any) -> Any:
    return v.detach().clone() if isinstance(v, torch.Tensor) else v
