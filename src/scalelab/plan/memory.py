"""Bytes one rank holds under a candidate: the `fit` model's estimate (scalelab.orchestration.fit:
parameters, gradients and optimizer state, plus every layer's output for the batch kept for
backward) at the rank's share of the model and of the batch.

    data parallel (mpi-dp, ddp), batch split     all parameters, ceil(B / N) items
    spatial split                                all parameters, B items over N slabs
    broadcast split                              all parameters, all B items
    pipeline, K stages                           1/K of parameters and activations
                                                 (every micro-batch of the step in flight)
    tensor, N ranks                              1/N of parameters and activations
    a model of repeated blocks (a transformer)   pipeline: the parameters of the rank's
                                                 stages as the torch engine cuts it; tensor:
                                                 the blocks' parameters over N, embeddings,
                                                 norms and head whole (predict/models/blocks)
    --dp D replicas of K stages or N tp ranks    1/K or 1/N of the parameters, B / D items
                                                 per replica shared as above
    ddp on 2+ ranks, training                    as data parallel, plus a second set of
                                                 DDP's gradient buckets (rebuilt on the
                                                 second step beside the first)
    fsdp, N ranks, --dp-replicate R (HSDP)       parameters, gradients, optimizer state
                                                 1/(N/R) each, plus the whole weights of the
                                                 largest unit twice (the gathered unit and
                                                 the prefetched next; a unit: the largest
                                                 layer and --fsdp-unit-mb), or with
                                                 --reshard-after-forward off all the weights
                                                 (gathered from forward until backward);
                                                 ceil(B / N) items; training: the larger of
                                                 the forward's end (no gradients yet) and
                                                 the backward's (no activations left)

Inference keeps weights only (no gradients or optimizer state). An estimate, not a
measurement: allocator slack, workspace and the framework's own memory are not counted.
"""

from __future__ import annotations

import dataclasses
import math

from scalelab import strategies
from scalelab.config import RunConfig
from scalelab.errors import UsageError
from scalelab.layout.torch_schedule import stage_ids, virtual_stages
from scalelab.orchestration.fit import estimate_bytes
from scalelab.precision import get_precision
from scalelab.predict.models import blocks
from scalelab.predict.scenario import build_workload
from scalelab.workloads import WORKLOADS

STRATEGIES = ("ddp", "fsdp", "hsdp", "pipeline", "tensor")  # what `fit --find ranks` answers


def rank_share(cfg: RunConfig) -> tuple[float, float]:
    """(share of the parameters, items of activations) one rank holds."""
    n = cfg.ranks
    batch = cfg.batch  # all ranks together, for every strategy
    if strategies.STRATEGIES.get(cfg.strategy).shards_parameters:
        return 1 / max(1, n // cfg.dp_replicate), float(math.ceil(batch / n))
    kind = strategies.STRATEGIES.get(cfg.strategy)
    if kind.splits_model:
        inner = max(1, n // max(1, cfg.dp))  # stages or tp ranks of one replica
        return block_share(cfg, inner) or 1 / inner, batch / n
    if cfg.split == "spatial" and kind.takes_split:
        return 1.0, batch / n
    if cfg.split == "broadcast" and kind.takes_split:
        return 1.0, float(batch)
    return 1.0, float(math.ceil(batch / n))


def block_share(cfg: RunConfig, inner: int) -> float | None:
    """A block model's share of the parameters on its fullest rank under pipeline or tensor
    (None: not a block model, or a cut the model refuses, which applies.py reports)."""
    if not hasattr(WORKLOADS.get(cfg.workload), "blocks") or not blocks.is_block_model(cfg):
        return None
    whole = max(1, sum(r.params for r in blocks.block_rows(cfg)))
    # by heads (a --tp-plan of the user's: an even share)
    if strategies.STRATEGIES.get(cfg.strategy).by_heads:
        return blocks.tp_params(cfg, inner) / whole if cfg.tp_plan is None else None
    try:
        v = virtual_stages(cfg.schedule, cfg.virtual_stages) if cfg.engine == "torch" else 1
        counts, _ = blocks.stage_counts(cfg, inner * v)
    except UsageError:
        return None
    params = blocks.stage_params(cfg, counts)
    held = [sum(params[s] for s in stage_ids(cfg.schedule, r, inner, v)) for r in range(inner)]
    return max(held) / whole


def device_bytes(cfg: RunConfig) -> int:
    """Estimated bytes per rank at its peak (see the module docstring)."""
    parts = breakdown(cfg)
    if strategies.STRATEGIES.get(cfg.strategy).shards_parameters and cfg.train:
        # Gradients are freed every step (zero_grad(set_to_none)): at the end of forward the
        # gathered weights and every activation are alive but no gradient; at the end of
        # backward every gradient shard is, while the activations are gone and only the
        # units being reduced (and prefetched) are gathered. Measured on 2x H100 and 2x H200,
        # 1.0e9 parameters: resharded 6.04 GiB (the backward end), not resharded 7.88 GiB
        # (the forward end: the whole weights beside the shards and the momentum).
        forward = parts["params"] + parts["optimizer"] + parts["gathered"] + parts["activations"]
        backward = parts["params"] + parts["grads"] + parts["optimizer"] + _unit_bytes(cfg)[1]
        return max(forward, backward)
    return sum(parts.values())


def _unit_bytes(cfg: RunConfig) -> tuple[int, int]:
    """fsdp's gathered weights: (all of them, the largest unit's twice: gathered and
    prefetched, at most all). A unit is a layer, or with --fsdp-unit-mb M blocks joined
    until their mean reaches M MB: under M MB and one more block (fsdp_units.group_units)."""
    rows = build_workload(cfg).cost_table()
    itemsize, whole = get_precision(cfg.dtype).itemsize, sum(r.params for r in rows)
    largest = itemsize * max(r.params for r in rows)
    unit = largest + max(0, int(cfg.fsdp_unit_mb * 2**20))
    return itemsize * whole, min(itemsize * whole, 2 * unit)


def gathered_bytes(cfg: RunConfig) -> int:
    """fsdp: the whole weights a rank holds beside its shards while a unit computes."""
    if not strategies.STRATEGIES.get(cfg.strategy).shards_parameters:
        return 0
    every, two = _unit_bytes(cfg)
    return every if cfg.reshard_after_forward == "off" else two


def breakdown(cfg: RunConfig) -> dict[str, int]:
    """Estimated bytes per rank by kind: parameters, gradients, DDP's gradient buckets,
    optimizer state (the rank's share), gathered (fsdp's whole units), activations.

    DDP keeps all-reduce buckets as large as the gradients (the gradients are views of them:
    gradient_as_bucket_view), and on its second step's forward it rebuilds them in the order
    the gradients arrived while the first set is still alive: the allocator's trace at the
    peak (2x H200, 1.0e9 parameters, fp32, SGD with momentum: 15.37 GiB) holds the weights,
    the buckets allocated when DDP wrapped the model, the rebuilt ones and the momentum,
    four copies of the weights ("grads" and "buckets" here)."""
    params, acts = estimate_bytes(dataclasses.replace(cfg, batch=1))
    state = 2 + (1 if cfg.momentum else 0)  # weights, gradients (, momentum): estimate_bytes
    weights = params // state
    share, items = rank_share(cfg)
    train = cfg.train
    # one rank trains the bare module
    ddp = strategies.STRATEGIES.get(cfg.strategy).ddp_buckets and cfg.ranks > 1
    return {
        "params": int(weights * share),
        "grads": int(weights * share) if train else 0,
        "buckets": int(weights) if train and ddp else 0,
        "optimizer": int(weights * share) if train and cfg.momentum else 0,
        "gathered": gathered_bytes(cfg),
        "activations": int(acts * items),
    }


def as_strategy(cfg: RunConfig, name: str, ranks: int) -> RunConfig | None:
    """cfg on `ranks` ranks under one of STRATEGIES (hsdp: fsdp with 2 replicas); None where
    that rank count cannot run it (hsdp on an odd count)."""
    if name == "hsdp":
        if ranks % 2 or ranks < 4:
            return None
        return dataclasses.replace(cfg, strategy="fsdp", ranks=ranks, dp_replicate=2)
    extra = {"stages": ranks} if name == "pipeline" else {}
    return dataclasses.replace(cfg, strategy=name, ranks=ranks, dp_replicate=1, **extra)


def smallest_ranks(cfg: RunConfig, name: str, limit: float, most: int = 4096) -> int | None:
    """The fewest ranks (powers of two up to `most`) whose estimated bytes per rank fit
    `limit` under strategy `name`; None if none does. ddp never shrinks with more ranks
    beyond its activations: it answers 1 or, while the batch's share shrinks, more."""
    n = 1
    while n <= most:
        here = as_strategy(cfg, name, n)
        if here is not None and n <= max(cfg.batch, 1) and device_bytes(here) <= limit:
            return n
        n *= 2
    return None
