"""fsdp's optimizer on local shards against torch's optimizer on the DTensors, under torchrun
(tests/test_fsdp.py): `python fsdp_local_step.py`. Two copies of one small model, each
fully_shard-ed (rows that do not split evenly over the ranks); one steps its optimizer as
torch does, the other through LocalShardOptimizer. Rank 0 prints one JSON line per optimizer:
the largest parameter and optimizer-state differences (full tensors) after 3 steps, and the
state's types."""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from scalelab.strategies.fsdp_step import LocalShardOptimizer

OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-2),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "adamax": lambda ps: torch.optim.Adamax(ps, lr=1e-2),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2, initial_accumulator_value=0.1),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.5, centered=True),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=1e-2),
    "radam": lambda ps: torch.optim.RAdam(
        ps, lr=1e-2, decoupled_weight_decay=True, weight_decay=0.1
    ),
}  # every optimizer fsdp_step.ELEMENTWISE names


def model(mesh) -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()
    for layer in (m[0], m[2]):
        fully_shard(layer, mesh=mesh)
    return fully_shard(m, mesh=mesh)


def full(t):
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach()


def main() -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    x = torch.randn(3, 4, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    for name, make in OPTIMIZERS.items():
        ref, ours = model(mesh), model(mesh)
        opt_ref, inner = make(ref.parameters()), make(ours.parameters())
        opt = LocalShardOptimizer(inner)
        for k in range(3):
            for m, o in ((ref, opt_ref), (ours, opt)):
                m(x[k]).square().sum().backward()
                o.step()
                o.zero_grad()
        params = max(
            float((full(a) - full(b)).abs().max())
            for a, b in zip(ref.parameters(), ours.parameters())
        )
        opt.publish()  # what a checkpoint does before it reads the optimizer
        opts = StateDictOptions(full_state_dict=True)
        sd_ref = get_optimizer_state_dict(ref, opt_ref, options=opts)["state"]
        sd_ours = get_optimizer_state_dict(ours, inner, options=opts)["state"]
        state = max(
            float((torch.as_tensor(v) - torch.as_tensor(sd_ours[n][k])).abs().max())
            for n, s in sd_ref.items()
            for k, v in s.items()
        )
        kinds = sorted({type(v).__name__ for s in inner.state.values() for v in s.values()})
        keys = all(isinstance(p, DTensor) for p in inner.state)
        moved = max(float((full(p) - full(q)).abs().max())
                    for p, q in zip(ours.parameters(), model(mesh).parameters()))  # fmt: skip
        said = {"optimizer": name, "params": params, "state": state, "kinds": kinds,
                "keys_dtensor": keys, "moved": moved}  # fmt: skip
        if dist.get_rank() == 0:
            print(json.dumps(said), flush=True)
    dist.barrier()  # no rank tears down while its peer still talks to it
    dist.destroy_process_group()
    sys.stdout.flush()
    # Skip interpreter finalization: gloo's worker threads can still be releasing tensors
    # then, which aborted rank 1 once in CI ("terminate called without an active exception",
    # SIGABRT: pytorch/pytorch#179291), as pipe_check.py and torchpp_check.py do.
    os._exit(0)


if __name__ == "__main__":
    main()
