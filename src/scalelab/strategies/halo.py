"""Halo exchange for a domain decomposition along one spatial axis: the messages of a rank's
plan (scalelab.layout.halo: the geometry, ownership and plans, re-exported here), posted
non-blocking, and the edge padding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from scalelab.comm.base import Comm, Request
from scalelab.instrument.spans import annotate
from scalelab.layout.halo import (  # noqa: F401  (re-exported)
    Geometry,
    RankRows,
    bounds,
    check_neighbours,
    first_in_bounds,
    max_ranks,
    out_bounds,
    plan_layer,
    plan_trunk,
)


# --- exchange ----------------------------------------------------------------------------------
def _rows(x: torch.Tensor, axis: int, start: int, stop: int) -> torch.Tensor:
    return x.narrow(axis, start, stop - start)


@dataclass
class HaloMessages:
    """One layer's messages for one rank: what to send and receive, in pairwise-safe order."""

    sends: list[tuple[int, int, int]]  # (peer, first local row, row count)
    recvs: list[tuple[int, int]]  # (peer, row count), above first


def messages(plan: Sequence[RankRows], rank: int) -> HaloMessages:
    rows = plan[rank]
    length = rows.own[1] - rows.own[0]
    sends = []
    if rank > 0 and plan[rank - 1].halo_down:  # the rank above reads my first rows
        sends.append((rank - 1, 0, plan[rank - 1].halo_down))
    if rank + 1 < len(plan) and plan[rank + 1].halo_up:  # the rank below reads my last rows
        n = plan[rank + 1].halo_up
        sends.append((rank + 1, length - n, n))
    recvs = [(rank - 1, rows.halo_up)] if rows.halo_up else []
    recvs += [(rank + 1, rows.halo_down)] if rows.halo_down else []
    return HaloMessages(sends, recvs)


def post(comm: Comm, ops: list[tuple[str, int, torch.Tensor]], tag: int) -> list[Request]:
    """Start sends and receives. Per peer, the lower rank sends first and the higher receives
    first: engines that run one pair's messages in order on one stream (NCCL) cannot then
    deadlock, and MPI does not care."""

    def order(op: tuple[str, int, torch.Tensor]) -> tuple[int, int]:
        kind, peer, _ = op
        first = "send" if comm.rank < peer else "recv"
        return peer, 0 if kind == first else 1

    reqs = []
    for kind, peer, buf in sorted(ops, key=order):
        # tags tell the two directions apart when both neighbours are the same rank
        direction = 0 if (peer < comm.rank) == (kind == "recv") else 1
        start = comm.isend if kind == "send" else comm.irecv
        reqs.append(start(buf, peer, tag=2 * tag + direction))
    return reqs


def exchange(
    comm: Comm, wire, timer, x: torch.Tensor, axis: int, plan: Sequence[RankRows], tag: int
) -> torch.Tensor:
    """This rank's slab of x (own rows along axis) -> the rows its outputs read, halos included.

    wire: the split's Transport (stages rows through pinned host buffers when the comm cannot
    take device memory: phases d2h and h2d); timer: the rank's PhaseTimer. Packing, the
    messages and the assembly are the `halo` phase. Returns (..., halo_up + kept + halo_down,
    ...) along axis; edge padding is the caller's.
    """
    rows, msgs = plan[comm.rank], messages(plan, comm.rank)
    if not msgs.sends and not msgs.recvs:
        return _rows(x, axis, *rows.keep)
    sends = [(peer, _rows(x, axis, start, start + n)) for peer, start, n in msgs.sends]
    if wire.staged:  # the d2h copy packs the rows into a pinned buffer
        sends = [(peer, wire.to_wire(t)) for peer, t in sends]
    with timer.phase("halo"):
        ops = [("send", peer, t.contiguous()) for peer, t in sends]
        bufs = {peer: wire.empty(_shape(x, axis, n), x.dtype) for peer, n in msgs.recvs}
        ops += [("recv", peer, buf) for peer, buf in bufs.items()]
        received = sum(b.nbytes for b in bufs.values())
        annotate(op="halo", bytes=received, peers=sorted(bufs), layer=tag)
        for req in post(comm, ops, tag):
            req.wait()
    timer.add_bytes("halo", received)
    got = {peer: wire.from_wire(buf) for peer, buf in bufs.items()}
    with timer.phase("halo"):
        parts = [got[comm.rank - 1]] if comm.rank - 1 in got else []
        parts.append(_rows(x, axis, *rows.keep))
        parts += [got[comm.rank + 1]] if comm.rank + 1 in got else []
        return parts[0] if len(parts) == 1 else torch.cat(parts, axis)


def _shape(x: torch.Tensor, axis: int, n: int) -> tuple[int, ...]:
    shape = list(x.shape)
    shape[axis] = n
    return tuple(shape)


def edge_pad(x: torch.Tensor, axis: int, top: int, bottom: int, value: float) -> torch.Tensor:
    """Padding rows on the true edges only (interior ranks got real rows as halos)."""
    if top == 0 and bottom == 0:
        return x
    shape = list(x.shape)
    parts = []
    if top:
        shape[axis] = top
        parts.append(x.new_full(tuple(shape), value))
    parts.append(x)
    if bottom:
        shape[axis] = bottom
        parts.append(x.new_full(tuple(shape), value))
    return torch.cat(parts, axis)
