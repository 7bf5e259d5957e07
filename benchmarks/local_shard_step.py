"""fsdp's optimizer step on local shards (strategies/fsdp_step.LocalShardOptimizer: a twin of
the optimizer built once over the local tensors, handed each step's gradient shards) against
an optimizer built once over the local tensors by hand (what peer_gpt_train.py's `+localopt`
does): the host milliseconds of one step, on one gloo rank, for the example GPT's 150
parameters (tiny widths: the step is host work). The two take turns, median of 30 steps each.

    PYTHONPATH=src python benchmarks/local_shard_step.py
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

GPT = Path(__file__).resolve().parents[1] / "examples" / "models" / "gpt.py"


def main() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)
    from torch.distributed.fsdp import fully_shard

    from scalelab.strategies.fsdp_step import LocalShardOptimizer

    spec = importlib.util.spec_from_file_location("gpt", GPT)
    gpt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpt)
    model = gpt.gpt(vocab=64, seq=16, width=32, heads=2, depth=12)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    params = list(model.parameters())
    x = torch.randint(0, 64, (2, 16))

    def run(kind: str) -> float:
        if kind == "built once":
            local = [p._local_tensor for p in params]
            opt = torch.optim.SGD(local, lr=0.01, momentum=0.9)
        else:
            opt = LocalShardOptimizer(torch.optim.SGD(params, lr=0.01, momentum=0.9))
        times = []
        for _ in range(30):
            model(x).float().sum().backward()
            t0 = time.perf_counter()
            if kind == "built once":  # the gradients handed over, as the peer does
                for p, t in zip(params, local):
                    t.grad = p.grad._local_tensor
                model.zero_grad(set_to_none=True)
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - t0)
        return 1e3 * statistics.median(times)

    print(f"{len(params)} parameters, one gloo rank, ms per optimizer step (median of 30):")
    for kind in ("built once", "LocalShardOptimizer") * 2:
        print(f"  {kind}: {run(kind):.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
