"""Gradient all-reduce in buckets, overlapped with backward.

Backward visits layers last to first; a layer's gradient is ready once backward has done its
share of the work (backward FLOPs taken proportional to forward FLOPs). Buckets fill in that
order (DDP: the first bucket closes at 1 MiB, later ones at --bucket-mb MiB; a bucket closes
when it reaches its cap). Each bucket's all-reduce starts when its last gradient is ready and
the previous all-reduce has finished (one communication stream):

    start_k = max(ready_k, end_(k-1)),   end_k = start_k + allreduce(bytes_k)
    exposed = max(0, end_last - backward)

so only what does not fit under the rest of backward (at least the last bucket) is on the
critical path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

MiB = 1 << 20
DDP_FIRST_BUCKET = MiB  # torch.distributed's _DEFAULT_FIRST_BUCKET_BYTES


@dataclass(frozen=True)
class Bucket:
    nbytes: float
    ready: float  # fraction of backward done when the bucket's last gradient is ready


def buckets(
    layers: list[tuple[str, int, int]], itemsize: int, first: float, cap: float
) -> list[Bucket]:
    """layers: (name, params, forward FLOPs per item) in forward order."""
    total = sum(f for _, _, f in layers) or 1
    out, size, done, limit = [], 0.0, 0.0, first
    for _, params, flops in reversed(layers):
        done += flops / total
        size += params * itemsize
        if size >= limit:
            out.append(Bucket(size, min(done, 1.0)))
            size, limit = 0.0, cap
    if size:
        out.append(Bucket(size, 1.0))
    return out


def exposed_allreduce(
    plan: list[Bucket], backward_s: float, allreduce: Callable[[float], float]
) -> tuple[float, float]:
    """(seconds of all-reduce in total, seconds left after backward ends)."""
    end, busy = 0.0, 0.0
    for b in plan:
        t = allreduce(b.nbytes)
        end = max(b.ready * backward_s, end) + t
        busy += t
    return busy, max(0.0, end - backward_s)
