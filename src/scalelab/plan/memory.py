"""Bytes one rank holds under a candidate: the `fit` model's estimate (scalelab.orchestration.fit:
parameters, gradients and optimizer state, plus every layer's output for the batch kept for
backward) at the rank's share of the model and of the batch.

    data parallel (mpi-dp, ddp), batch split     all parameters, ceil(B / N) items
    spatial split                                all parameters, B items over N slabs
    broadcast split                              all parameters, all B items
    pipeline, K stages                           1/K of parameters and activations
                                                 (every micro-batch of the step in flight)
    tensor, N ranks                              1/N of parameters and activations
    --dp D replicas of K stages or N tp ranks    1/K or 1/N of the parameters, B / D items
                                                 per replica shared as above

Inference keeps weights only (no gradients or optimizer state). An estimate, not a
measurement: allocator slack, workspace and the framework's own memory are not counted.
"""

from __future__ import annotations

import dataclasses
import math

from scalelab.config import RunConfig
from scalelab.orchestration.fit import estimate_bytes


def rank_share(cfg: RunConfig) -> tuple[float, float]:
    """(share of the parameters, items of activations) one rank holds."""
    n = cfg.ranks
    batch = cfg.batch  # all ranks together, for every strategy
    if cfg.strategy in ("pipeline", "tensor"):
        inner = max(1, n // max(1, cfg.dp))  # stages or tp ranks of one replica
        return 1 / inner, batch / n
    if cfg.split == "spatial" and cfg.strategy in ("mpi", "mpi-gpu", "nccl"):
        return 1.0, batch / n
    if cfg.split == "broadcast" and cfg.strategy in ("mpi", "mpi-gpu", "nccl"):
        return 1.0, float(batch)
    return 1.0, float(math.ceil(batch / n))


def device_bytes(cfg: RunConfig) -> int:
    """Estimated bytes per rank (see the module docstring)."""
    params, acts = estimate_bytes(dataclasses.replace(cfg, batch=1))
    if not cfg.train:
        params //= 2 + (1 if cfg.momentum else 0)  # weights only
    share, items = rank_share(cfg)
    return int(params * share + acts * items)
