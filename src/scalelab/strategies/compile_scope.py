"""`--compile`: what torch.compile wraps, the same way for local, ddp and fsdp.

A model with a repeated block stack (a transformer's layers, ResNet's BasicBlocks) is compiled
block by block, in place (`nn.Module.compile`: the state_dict keys stay the model's own), as
torchtitan and torchtune compile their transformers:

- identical blocks share one compiled graph (dynamo guards on the block's code, not on which
  instance it is), so a 12-block GPT compiles one block, not twelve;
- DDP's all-reduce hooks and FSDP's all-gathers and reduce-scatters sit between blocks, in
  eager code, where they overlap the next block's compute. A compiled *whole* DDP model
  is instead split by DDPOptimizer into one graph per gradient bucket, so Inductor cannot
  fuse across bucket boundaries and the bucket all-reduces wait on graph boundaries (measured
  on 4x H200 at GPT-2 small's shape: 1,694.5 sequences/s compiled against 1,895.2 eager);
- fsdp wraps each compiled block with fully_shard afterwards (dynamo skips FSDP2's hooks).

A model without such a stack is compiled whole. What was chosen goes into the record as
`compile`: the scope, how many blocks, and the compiled graphs Inductor built.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from scalelab.workloads.blocks import every_block


def compile_blocks(module: nn.Module, backend: str = "inductor") -> dict[str, Any] | None:
    """Compile each repeated block of module in place with torch.compile's backend; what was
    compiled, or None (and nothing compiled) when the model has no repeated blocks."""
    blocks = [b for b in every_block(module) if b is not module]
    if not blocks:
        return None
    for block in blocks:
        block.compile(backend=backend)
    kinds = sorted({type(b).__name__ for b in blocks})
    return {"scope": "per-block", "blocks": len(blocks), "block_types": kinds, "backend": backend}


def compile_whole(
    module: nn.Module, in_place: bool = False, backend: str = "inductor"
) -> tuple[nn.Module, dict[str, Any]]:
    """The whole module compiled, and what was compiled: a wrapper (its state_dict keys are
    its `_orig_mod`'s), or with in_place the module itself (fsdp shards it afterwards)."""
    notes = {"scope": "whole", "blocks": 0, "block_types": [], "backend": backend}
    if in_place:
        module.compile(backend=backend)
        return module, notes
    return torch.compile(module, backend=backend), notes


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far (recompiles count again)."""
    from torch._dynamo.utils import counters  # private but stable since 2.0; only read here

    return int(counters["stats"]["unique_graphs"])
