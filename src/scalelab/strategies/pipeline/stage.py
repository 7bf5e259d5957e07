"""One pipeline stage executing its schedule's op list for one batch.

Activations go forward (rank s -> s+1) and their gradients back (s+1 -> s) with
torch.distributed point-to-point, always through `batch_isend_irecv` (used directly: the Comm
interface has single isend/irecv but no grouped ones). Always: NCCL runs batched p2p on the
group's communicator but single isend/irecv on a separate two-rank one, so a batched send met
by a single receive would never match. Communication happens at the transition between two
ops, as in Megatron-LM's schedules: the send that ends op i and the receive that op i+1 needs
are posted together. Receives are waited for at once (phase "recv": the stage is idle, the
bubble); sends complete in the background and are drained at the end of the batch ("send").

Every directed link (src -> dst) is its own process group, so its own NCCL communicator and
stream, and on each rank a link only ever sends or only ever receives. On one shared
communicator a pair's exchanges were rendezvous: 1F1B's steady state posts {send activation,
receive gradient} against the peer's {send gradient, receive activation}, so a stage could not
start its backward before its own activation had also crossed, and both stages paid every
transfer each cycle (VGG-16 on 2 H200s: 0.18 ms of a 4.4 ms cycle, 51 MB each way). Apart, a
send never queues behind a receive, messages on a link are posted in the same order at both
ends, and nothing can wait in a cycle. A receive is posted when the op before it ends, not
earlier: posted one op ahead (Megatron-LM's overlapped p2p), the transfer would overlap that
op, but NCCL's receive kernel then spins on its SMs through the whole op, and VGG-16's FC
stage backward took 3.3-4.0 ms instead of 2.6 on an H200 (1.63x plain PyTorch, not 1.77x).

Channels-last activations travel as their NHWC memory (a permuted, contiguous view), so the
receiving stage gets channels-last tensors without a layout copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from scalelab.instrument.spans import annotate
from scalelab.layout.schedule import Op

Meta = tuple[tuple[int, ...], torch.dtype]  # per-item shape and dtype of a stage's output


def to_wire(t: torch.Tensor, channels_last: bool) -> torch.Tensor:
    if channels_last and t.dim() == 4:
        return t.permute(0, 2, 3, 1).contiguous()  # (N, H, W, C): a view when NHWC already
    return t.contiguous()


def wire_buffer(n: int, meta: Meta, channels_last: bool, device: torch.device) -> torch.Tensor:
    tail, dtype = meta
    if channels_last and len(tail) == 3:
        c, h, w = tail
        return torch.empty((n, h, w, c), dtype=dtype, device=device)
    return torch.empty((n, *tail), dtype=dtype, device=device)


def pipeline_links(stages: int) -> list[tuple[int, int]]:
    """Every directed link (src, dst) a pipeline's messages use: neighbours both ways
    (activations down, gradients up), first and last both ways (labels, inference output)."""
    links = {(s, s + 1) for s in range(stages - 1)} | {(s + 1, s) for s in range(stages - 1)}
    if stages > 1:
        links |= {(0, stages - 1), (stages - 1, 0)}
    return sorted(links)


def make_lanes(stages: int) -> dict[tuple[int, int], Any]:
    """One process group per link. new_group is collective: every rank creates every group,
    in this one order, members or not."""
    return {link: dist.new_group(sorted(link)) for link in pipeline_links(stages)}


def from_wire(buf: torch.Tensor, channels_last: bool) -> torch.Tensor:
    return buf.permute(0, 3, 1, 2) if channels_last and buf.dim() == 4 else buf


@dataclass
class StageContext:
    """What a stage executor needs from the strategy."""

    rank: int
    stages: int
    device: torch.device
    module: nn.Module
    in_meta: Meta | None  # None on the first stage (it prepares the batch itself)
    out_meta: Meta
    timer: Any  # PhaseTimer
    autocast: Any  # () -> context manager
    channels_last: bool
    lanes: dict[tuple[int, int], Any] = field(default_factory=dict)  # (src, dst) -> group

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.stages - 1


@dataclass
class StageBatch:
    """One batch as this stage sees it: micro-batch sizes everywhere; prepared micro-batch
    inputs on the first stage; labels on the last (training)."""

    sizes: list[int]
    inputs: list[torch.Tensor] | None = None
    labels: list[torch.Tensor] | None = None
    loss_fn: Any = None  # (module, logits, y) -> mean loss over the micro-batch (training)
    outputs: list[torch.Tensor] = field(default_factory=list)  # last stage, inference
    loss_sum: torch.Tensor | None = None  # last stage, training: sum of loss * items


class StageExecutor:
    def __init__(self, ctx: StageContext) -> None:
        self.ctx = ctx
        self.pending: list[Any] = []  # send works in flight
        self.saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # m -> (input, output)

    # --- point-to-point --------------------------------------------------------------------
    def post(
        self, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]]
    ) -> list[Any]:
        """Post sends and receives, one batch per link; the sends stay in flight (drained at
        the end), the receives' works are returned to be waited for."""
        rank, lanes = self.ctx.rank, self.ctx.lanes
        batches: dict[tuple[int, int], list[dist.P2POp]] = {}
        for t, peer in sends:
            link = (rank, peer)
            op = dist.P2POp(dist.isend, t, peer, lanes.get(link))
            batches.setdefault(link, []).append(op)
            self.ctx.timer.add_bytes("send", t.numel() * t.element_size())
        for b, peer in recvs:
            link = (peer, rank)
            batches.setdefault(link, []).append(dist.P2POp(dist.irecv, b, peer, lanes.get(link)))
        if not lanes and len(batches) > 1:  # no links (one default group): one batch
            batches = {(rank, rank): [op for ops in batches.values() for op in ops]}
        receives: list[Any] = []
        for link, ops in batches.items():
            works = dist.batch_isend_irecv(ops)
            (self.pending if link[0] == rank and link[1] != rank else receives).extend(works)
        return receives

    def wait(self, works: list[Any], phase: str = "recv", **facts: Any) -> None:
        """facts: what the timeline's slice says about the message (bytes, peer, mb)."""
        if works:
            with self.ctx.timer.phase(phase):
                annotate(**facts)
                for w in works:
                    w.wait()

    def exchange(
        self,
        sends: list[tuple[torch.Tensor, int]],
        recvs: list[tuple[torch.Tensor, int]],
        phase: str = "recv",
    ) -> None:
        """Post sends and receives; wait for the receives (under `phase`)."""
        self.wait(self.post(sends, recvs), phase)

    def connect(self) -> None:
        """Open every link of this rank before any timed work.

        NCCL connects a communicator's point-to-point channels lazily, inside the first
        grouped call, and that connect is a handshake both ranks must be inside NCCL for (the
        first call in a group must involve all its ranks). Left to the schedule, GPipe's first
        backward send met a receive posted long before while the receiver waited for its
        device, out of NCCL: both hung (seen on 2 H200s). Here each link carries one message
        both ways, link by link in one global order (so every pair meets)."""
        ctx = self.ctx
        one = lambda: torch.zeros(1, device=ctx.device)  # noqa: E731
        for src, dst in sorted(ctx.lanes):
            if ctx.rank not in (src, dst):
                continue
            peer, group = (dst if src == ctx.rank else src), ctx.lanes[(src, dst)]
            ops = [dist.P2POp(dist.isend, one(), peer, group),
                   dist.P2POp(dist.irecv, one(), peer, group)]  # fmt: skip
            for work in dist.batch_isend_irecv(ops):
                work.wait()

    def drain(self) -> None:
        if self.pending:
            with self.ctx.timer.phase("send"):
                for w in self.pending:
                    w.wait()
            self.pending.clear()

    def _recv_for(self, op: Op, batch: StageBatch) -> list[tuple[torch.Tensor, int]]:
        """The receive op needs before it can start (none on the pipeline's ends)."""
        ctx = self.ctx
        kind, m = op
        if kind == "F" and not ctx.first:
            buf = wire_buffer(batch.sizes[m], ctx.in_meta, ctx.channels_last, ctx.device)
            return [(buf, ctx.rank - 1)]
        if kind == "B" and not ctx.last:
            buf = wire_buffer(batch.sizes[m], ctx.out_meta, ctx.channels_last, ctx.device)
            return [(buf, ctx.rank + 1)]
        return []

    # --- the two ops ---------------------------------------------------------------------
    def forward(self, m: int, buf: torch.Tensor | None, batch: StageBatch, train: bool):
        ctx = self.ctx
        if ctx.first:
            x = batch.inputs[m]
        else:
            x = from_wire(buf, ctx.channels_last)
            x = x.detach().requires_grad_(train)
        with ctx.timer.phase("forward"), torch.set_grad_enabled(train), ctx.autocast():
            annotate(mb=m)
            y = ctx.module(x)
            if train and ctx.last:
                # This micro-batch's share of the batch's mean loss: sum_m n_m/N * mean_m.
                n, total = batch.sizes[m], sum(batch.sizes)
                loss = batch.loss_fn(ctx.module, y, batch.labels[m])
                part = loss.detach().to(torch.float64) * n
                batch.loss_sum = part if batch.loss_sum is None else batch.loss_sum + part
                y = loss * (n / total)
        if train:
            self.saved[m] = (x, y)
        elif ctx.last:
            batch.outputs.append(y)
        return [] if ctx.last else [(to_wire(y.detach(), ctx.channels_last), ctx.rank + 1)]

    def backward(self, m: int, buf: torch.Tensor | None):
        ctx = self.ctx
        x, y = self.saved.pop(m)
        with ctx.timer.phase("backward"):
            annotate(mb=m)
            if ctx.last:
                y.backward()
            elif y.requires_grad:  # a first stage without parameters: nothing to differentiate
                torch.autograd.backward(y, from_wire(buf, ctx.channels_last))
        return [] if ctx.first else [(to_wire(x.grad, ctx.channels_last), ctx.rank - 1)]

    # --- one batch -----------------------------------------------------------------------
    def run(self, ops: list[Op], batch: StageBatch, train: bool) -> StageBatch:
        """The op list: at each transition the ending op's sends and the next op's receive
        are posted, and the receive is waited for (on the device) before the next op."""
        recv = self._post_recv(ops[0], batch) if ops else (None, [])
        for i, (kind, m) in enumerate(ops):
            buf, works = recv
            peer = self.ctx.rank - 1 if kind == "F" else self.ctx.rank + 1
            nbytes = 0 if buf is None else buf.nbytes
            self.wait(works, bytes=nbytes, peer=peer, op=f"recv {kind}", mb=m)
            sends = self.forward(m, buf, batch, train) if kind == "F" else self.backward(m, buf)
            self.post(sends, [])
            if i + 1 < len(ops):
                recv = self._post_recv(ops[i + 1], batch)
        self.drain()
        return batch

    def _post_recv(self, op: Op, batch: StageBatch) -> tuple[torch.Tensor | None, list[Any]]:
        recv = self._recv_for(op, batch)
        return (recv[0][0] if recv else None), self.post([], recv)
