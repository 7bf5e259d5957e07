"""The whole training state of `pipeline --engine torch` as one process would hold it.

Each rank's optimizer is built over the whole model (train/loop.py's Trainer), so parameter
indices and state_dict keys are the model's own; a rank trains only its stages' parameters.
Export: replica 0's ranks send what they own (parameters, buffers, optimizer state by
parameter index) to the root, which lays it over its own copy. Import: every rank loads the
whole state (other stages' entries are never read again)."""

from __future__ import annotations

from typing import Any

import torch


def _owned(strategy: Any) -> tuple[set[str], set[int]]:
    """state_dict keys and optimizer parameter indices of this rank's stages."""
    mine = {id(t) for piece in strategy.pieces.values()
            for t in (*piece.parameters(), *piece.buffers())}  # fmt: skip
    keys = {k for k, t in strategy.model.state_dict(keep_vars=True).items() if id(t) in mine}
    indices = {i for i, p in enumerate(strategy.model.parameters()) if id(p) in mine}
    return keys, indices


def export_state(strategy: Any, opt: torch.optim.Optimizer | None) -> tuple[dict, Any] | None:
    """(model state, optimizer state) on the root; None elsewhere. Collective."""
    keys, indices = _owned(strategy)
    mine = None
    if strategy.groups.dp_rank == 0:
        state = strategy.model.state_dict()
        model_part = {k: state[k].detach().cpu() for k in keys}
        opt_part = {}
        if opt is not None:
            opt_part = {i: _cpu(s) for i, s in opt.state_dict()["state"].items() if i in indices}
        mine = (model_part, opt_part)
    parts = strategy.comm.gather_object(mine)
    if parts is None:
        return None
    whole = {k: v.detach().cpu() for k, v in strategy.model.state_dict().items()}
    opt_state: dict[int, Any] = {}
    for part in parts:
        if part is not None:
            whole.update(part[0])
            opt_state.update(part[1])
    if opt is None:
        return whole, None
    return whole, {"state": opt_state, "param_groups": opt.state_dict()["param_groups"]}


def import_state(strategy: Any, opt: torch.optim.Optimizer, state: dict, opt_state: dict) -> None:
    strategy.model.load_state_dict(state)
    opt.load_state_dict(opt_state)


def _cpu(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v.detach().cpu() if torch.is_tensor(v) else v for k, v in state.items()}
