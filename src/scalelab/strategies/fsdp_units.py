"""What fsdp (strategies/fsdp.py) decides about a model before torch's fully_shard takes it:
the units it shards one at a time, the device mesh, and the training state as one process
holds it (torch.distributed.checkpoint.state_dict: full state dicts in and out).

A unit is what FSDP all-gathers before its forward and reduce-scatters after its backward;
one per repeated block (the children of a ModuleList/Sequential that are all of one class: a
ResNet stage's BasicBlocks, a transformer's layers), else one per layer with parameters of the
workload's layer list (an MLP's Linear layers); the root is sharded last and takes whatever
parameters no unit holds.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from scalelab.errors import UsageError
from scalelab.workloads.blocks import every_block, holds_parameters
from scalelab.workloads.layers import Layer

# torch's fsdp, DTensor and distributed state-dict modules are imported where they are used:
# together they cost a second at import, which every scalelab process (each rank of every
# strategy, `scalelab --help`) would pay through the strategy registry.
if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def _full() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True)


# --- units -------------------------------------------------------------------------------------
def shard_units(model: nn.Module, layers: list[Layer]) -> list[nn.Module]:
    """The modules fully_shard wraps before the root: repeated blocks, else the layer list's
    layers with parameters (never the root itself; the root takes what is left)."""
    blocks = [b for b in every_block(model) if b is not model]
    if blocks:
        return blocks
    own = {id(m) for m in model.modules()}
    seen: set[int] = set()
    units = []
    for layer in layers:
        m = layer.module
        if m is model or id(m) not in own or id(m) in seen or not holds_parameters(m):
            continue
        seen.add(id(m))
        units.append(m)
    return units


def group_units(found: list[nn.Module], unit_mb: float, itemsize: int) -> list[list[nn.Module]]:
    """Consecutive units joined k at a time, k the fewest whose gathered parameters (itemsize
    bytes each: the dtype FSDP gathers) reach unit_mb MB on average; 0: one unit each.
    Every unit costs the host its hooks, copies and collectives each pass (forward, backward
    gather, reduce-scatter): a small block's compute does not hide them, and the step waits on
    the host; fewer, larger units trade a little peak memory (two units gathered) for that."""
    if unit_mb <= 0 or len(found) < 2:
        return [[u] for u in found]
    sizes = [sum(p.numel() for p in u.parameters()) * itemsize for u in found]
    k = max(1, min(len(found), math.ceil(unit_mb * 2**20 / max(sum(sizes) / len(found), 1))))
    return [found[i : i + k] for i in range(0, len(found), k)]


def reshard_policy(choice: str, n_units: int) -> list[bool]:
    """Each unit's reshard_after_forward, in forward order. "auto" (torchtitan's default):
    every unit but the last frees its gathered parameters after forward; the last one's
    backward starts right after the forward ends, so gathering it again would only add an
    all-gather to the step. "on": every unit reshards (ZeRO-3); "off": none (ZeRO-2-like)."""
    if choice == "auto":
        return [i < n_units - 1 for i in range(n_units)]
    return [choice == "on"] * n_units


def make_mesh(device: torch.device, world: int, replicate: int) -> DeviceMesh:
    """1-D (shard over every rank) or, with --dp-replicate R > 1, HSDP's 2-D mesh
    (R, world / R): parameters sharded along "shard", gradients all-reduced along
    "replicate"."""
    if world % replicate:
        raise UsageError(
            f"--dp-replicate {replicate} does not divide the {world} ranks "
            "(HSDP shards over ranks / R in each of R replicas)"
        )
    from torch.distributed.device_mesh import init_device_mesh

    if device.type == "cuda":
        torch.cuda.set_device(device)  # FSDP allocates its buffers on the current device
    if replicate == 1:
        return init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))
    shape = (replicate, world // replicate)
    return init_device_mesh(device.type, shape, mesh_dim_names=("replicate", "shard"))


# --- what a rank holds -------------------------------------------------------------------------
def local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def held_bytes(model: nn.Module, opt: torch.optim.Optimizer | None) -> dict[str, int]:
    """Bytes of the sharded state this rank actually holds: its parameter shards, gradient
    shards and optimizer state (momentum, Adam's moments: DTensors like the parameters)."""
    params = sum(_nbytes(local(p)) for p in model.parameters())
    grads = sum(_nbytes(local(p.grad)) for p in model.parameters() if p.grad is not None)
    state = 0
    if opt is not None:
        for s in opt.state.values():
            state += sum(_nbytes(local(v)) for v in s.values() if isinstance(v, torch.Tensor))
    return {"params": params, "grads": grads, "optimizer": state}


def reshard(model: nn.Module) -> None:
    """Free every unit's gathered parameters (a forward without resharding, as an evaluation
    under --reshard-after-forward off, leaves them whole until the next backward)."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# --- the training state as one process holds it ---------------------------------------------
def _param_names(model: nn.Module, opt: torch.optim.Optimizer) -> list[list[str]]:
    """Each optimizer group's parameter names, in the group's order (DSD keys by name; a
    one-process optimizer state_dict by position over the groups)."""
    name_of = {id(p): n for n, p in model.named_parameters()}
    return [[name_of[id(p)] for p in g["params"]] for g in opt.param_groups]


def export_full(model: nn.Module, opt: torch.optim.Optimizer, is_root: bool) -> Any:
    """(model state_dict, optimizer state_dict) as one process holds them, on the root (None
    elsewhere); collective: every rank all-gathers its shards."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, opt, options=_full())
    if not is_root:
        return None
    index = {n: i for i, n in enumerate(n for g in _param_names(model, opt) for n in g)}
    state = {index[n]: s for n, s in optim_sd["state"].items()}
    groups = [{**g, "params": [index[n] for n in g["params"]]} for g in optim_sd["param_groups"]]
    return model_sd, {"state": state, "param_groups": groups}


def import_full(model: nn.Module, opt: torch.optim.Optimizer, model_sd: dict, optim: dict) -> None:
    """Load one-process state dicts (every rank holds them: each keeps its shard)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    names = [n for g in _param_names(model, opt) for n in g]
    state = {names[i]: s for i, s in optim["state"].items()}
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in optim["param_groups"]]
    set_state_dict(
        model,
        opt,
        model_state_dict=model_sd,
        optim_state_dict={"state": state, "param_groups": groups},
        options=StateDictOptions(full_state_dict=True),
    )


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state_dict on the root (all-gathered, on the CPU; empty elsewhere)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_full())


class WholeParams:
    """What a workload's loss sees of the sharded model (mlp's L2 term reads its weights):
    each parameter whole, all-gathered only when the loss asks for it; the gradient flows
    back into this rank's shard (the backward of Shard -> Replicate keeps each rank's part),
    where FSDP adds the reduce-scattered loss gradient to it."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def named_parameters(self) -> Any:
        from torch.distributed.tensor import DTensor

        for name, p in self.module.named_parameters():
            yield name, p.full_tensor() if isinstance(p, DTensor) else p

    def parameters(self) -> Any:
        return (p for _, p in self.named_parameters())
