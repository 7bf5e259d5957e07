"""One pipeline stage executing its schedule's op list for one batch.

Activations go forward (rank s -> s+1) and their gradients back (s+1 -> s) with
torch.distributed point-to-point, always through `batch_isend_irecv` (used directly: the Comm
interface has single isend/irecv but no grouped ones). Always: NCCL runs batched p2p on the
group's communicator but single isend/irecv on a separate two-rank one, so a batched send met
by a single receive would never match. Communication happens at the transition between two
ops, as in Megatron-LM's schedules: the send that ends op i and the receive that op i+1 needs
are posted together. Receives are waited for at once (phase "recv": the stage is idle, the
bubble); sends complete in the background and are drained at the end of the batch ("send").

Two lanes, one process group (so one NCCL communicator and stream) per direction: `down`
carries every message from a lower rank to a higher one (activations, labels), `up` the rest
(gradients, the inference output). On one shared stream a pair's exchanges become
rendezvous: 1F1B's steady state posts {send activation, receive gradient} against the peer's
{send gradient, receive activation}, and a stage could not start its backward until its own
activation had also crossed, so both stages paid every transfer each cycle (VGG-16 on 2
H200s: 0.18 ms of a 4.4 ms cycle, 51 MB each way). Apart, a send never waits behind a
receive, and a message only meets others of its own direction, posted in the same order on
both ends, so nothing can wait in a cycle (downward traffic ends at the last stage, which only
receives it; upward at the first).

Channels-last activations travel as their NHWC memory (a permuted, contiguous view), so the
receiving stage gets channels-last tensors without a layout copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from scalelab.strategies.pipeline_schedule import Op

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
    lanes: tuple[Any, Any] = (None, None)  # process groups (down, up); None: the default group

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
    def exchange(
        self,
        sends: list[tuple[torch.Tensor, int]],
        recvs: list[tuple[torch.Tensor, int]],
        phase: str = "recv",
    ) -> None:
        """Post sends and receives, one batch per lane; wait for the lanes that receive
        (under `phase`), leave the others' sends in flight."""
        rank = self.ctx.rank
        batches: dict[int, list[dist.P2POp]] = {}  # lane (0 down, 1 up) -> its ops
        for t, peer in sends:
            lane = int(peer < rank)
            batches.setdefault(lane, []).append(
                dist.P2POp(dist.isend, t, peer, self.ctx.lanes[lane])
            )
            self.ctx.timer.add_bytes("send", t.numel() * t.element_size())
        receiving = set()
        for b, peer in recvs:
            lane = int(peer > rank)
            batches.setdefault(lane, []).append(
                dist.P2POp(dist.irecv, b, peer, self.ctx.lanes[lane])
            )
            receiving.add(lane)
        waits = []
        for lane, ops in sorted(batches.items()):
            works = dist.batch_isend_irecv(ops)
            (waits if lane in receiving else self.pending).extend(works)
        if waits:
            with self.ctx.timer.phase(phase):
                for w in waits:
                    w.wait()

    def connect(self, peers: list[int]) -> None:
        """Open the point-to-point links to every peer, both ways, before any timed work.

        NCCL connects a pair's point-to-point channels lazily, inside the first grouped call
        that needs them, and that connect is a handshake both ranks must be inside NCCL for.
        GPipe's first backward send (stage s+1 -> s) is met by a receive stage s posted long
        before, in a group with its last forward send; stage s then waits for the device, out
        of NCCL, while stage s+1 waits in the connect: both hang (seen on 2 H200s). One
        symmetric exchange per pair here, where every rank posts all of its pairs in one
        group, leaves every later call to find its links ready. Each lane has its own."""
        ctx = self.ctx
        if not peers:
            return
        one = lambda: torch.zeros(1, device=ctx.device)  # noqa: E731
        for lane in ctx.lanes:
            ops = [dist.P2POp(dist.isend, one(), peer, lane) for peer in peers]
            ops += [dist.P2POp(dist.irecv, one(), peer, lane) for peer in peers]
            for work in dist.batch_isend_irecv(ops):
                work.wait()

    def drain(self) -> None:
        if self.pending:
            with self.ctx.timer.phase("send"):
                for w in self.pending:
                    w.wait()
            self.pending.clear()

    def _recv_for(self, op: Op | None, batch: StageBatch) -> list[tuple[torch.Tensor, int]]:
        """The receive op needs before it can start (none on the pipeline's ends)."""
        ctx = self.ctx
        if op is None:
            return []
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
            if ctx.last:
                y.backward()
            else:
                torch.autograd.backward(y, from_wire(buf, ctx.channels_last))
        return [] if ctx.first else [(to_wire(x.grad, ctx.channels_last), ctx.rank - 1)]

    # --- one batch -----------------------------------------------------------------------
    def run(self, ops: list[Op], batch: StageBatch, train: bool) -> StageBatch:
        recv = self._recv_for(ops[0] if ops else None, batch)
        self.exchange([], recv)
        for i, (kind, m) in enumerate(ops):
            buf = recv[0][0] if recv else None
            if kind == "F":
                sends = self.forward(m, buf, batch, train)
            else:
                sends = self.backward(m, buf)
            recv = self._recv_for(ops[i + 1] if i + 1 < len(ops) else None, batch)
            self.exchange(sends, recv)
        self.drain()
        return batch
