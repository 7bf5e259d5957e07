"""`--overlap`: the batch split pipelined in chunks, so transfers hide under compute.

Each rank's share is cut into `--chunks` pieces. The root posts every input chunk as a
non-blocking send (chunk-major: everyone's first chunk goes first) and every output chunk as
a non-blocking receive; each rank posts receives for all its input chunks up front. A chunk
then flows over three CUDA streams:

    copy-in stream    h2d of chunk k (pinned host -> device; skipped for device buffers)
    compute stream    forward of chunk k          (waits on chunk k's h2d event)
    copy-out stream   d2h of chunk k's output     (waits on chunk k's compute event)

while the host waits for chunk k+1's message and sends chunk k-1's output, so MPI, the PCIe
copies and the kernels run at the same time. On a CPU rank the same code runs the chunks one
after another (nothing to overlap with but the MPI library's own progress).

How much it hid: the step's communication intervals (h2d, d2h, host blocked on messages) are
intersected with its compute intervals (CUDA events on one device timeline, host clocks
aligned at the step start): hidden = |comm ∩ compute|, exposed = |comm| - hidden.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from scalelab.comm.base import even_counts
from scalelab.strategies.halo import bounds
from scalelab.strategies.split.batch import BatchSplit
from scalelab.workloads.base import Inputs

IN_TAG, OUT_TAG = 100, 10_000
LANES = ("h2d", "compute", "d2h")

Interval = tuple[float, float]


def union(intervals: list[Interval]) -> list[Interval]:
    """Disjoint, sorted cover of the intervals."""
    out: list[list[float]] = []
    for a, b in sorted(i for i in intervals if i[1] > i[0]):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def measure(intervals: list[Interval]) -> float:
    return sum(b - a for a, b in union(intervals))


def intersection(xs: list[Interval], ys: list[Interval]) -> float:
    """|union(xs) ∩ union(ys)|."""
    total = 0.0
    for a, b in union(xs):
        for c, d in union(ys):
            total += max(0.0, min(b, d) - max(a, c))
    return total


@dataclass
class Job:
    """One chunk in flight: its output buffer, its finishing event, its timing marks."""

    out: torch.Tensor
    done: object = None  # CUDA event of the last copy (None on CPU: already done)
    marks: dict[str, list] = field(default_factory=dict)  # lane -> [(start, end)] events/times


class Lanes:
    """Three CUDA streams (copy-in, compute, copy-out) and the step's time origin."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.h2d, self.compute, self.d2h = (torch.cuda.Stream(device) for _ in range(3))

    def start(self) -> None:
        self.t0 = time.perf_counter()
        if self.cuda:
            self.e0 = self.event()

    def event(self) -> torch.cuda.Event:
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def now(self) -> float:
        return time.perf_counter() - self.t0


class OverlapSplit(BatchSplit):
    name = "batch"  # the same split, pipelined (--overlap)

    def setup(self, model: nn.Module, inputs: Inputs | None) -> None:
        super().setup(model, inputs)
        # Phases time the host timeline; the step synchronises the device itself at its end.
        self.timer.sync = lambda: None
        self.lanes = Lanes(self.strategy.device)
        starts = bounds(self.counts)
        self.chunks = [
            [(starts[r] + o, c) for o, c in zip(bounds(cs), cs) if c > 0]
            for r, cs in enumerate(even_counts(n, self.cfg.chunks) for n in self.counts)
        ]
        meta = (tuple(inputs.x.shape[1:]), inputs.x.dtype) if inputs is not None else None
        self.in_tail, self.in_dtype = self.comm.bcast_object(meta)
        probe = self.workload.synthetic_inputs(1, 0).x.to(self.strategy.device)
        with torch.inference_mode():
            y = self.forward(probe)  # (1, classes): the output's shape and dtype
        self.out_tail, self.out_dtype = tuple(y.shape[1:]), y.dtype
        self.log: list[tuple] = []  # per step: (start event, lane marks, host comm waits)

    def notes(self) -> dict:
        return {"counts": self.counts, "chunks": self.cfg.chunks}

    def step(self) -> torch.Tensor | None:
        self.lanes.start()
        self.comm_marks: list[Interval] = []
        if self.comm.is_root:
            out, jobs = self._root_step()
        else:
            out, jobs = self._rank_step()
        self._account(jobs)
        return out

    # --- the root: sends every chunk, computes its own, receives every output ----------------
    def _root_step(self) -> tuple[torch.Tensor, list[Job]]:
        x = self.wire.host_to_wire(self.host_x)
        out = self.wire.empty((self.cfg.batch, *self.out_tail), self.out_dtype)
        with self.timer.phase("scatter"):
            sends = [
                self.comm.isend(x[s : s + c], r, tag=IN_TAG + k)
                for k in range(max(map(len, self.chunks)))
                for r in range(1, self.comm.size)
                if k < len(self.chunks[r])
                for s, c in [self.chunks[r][k]]
            ]
            recvs = [
                self.comm.irecv(out[s : s + c], r, tag=OUT_TAG + k)
                for r in range(1, self.comm.size)
                for k, (s, c) in enumerate(self.chunks[r])
            ]
        with self.timer.phase("compute"):  # queued on the streams, returns at once on GPU
            jobs = [self._launch(x[s : s + c], out[s : s + c]) for s, c in self.chunks[0]]
        self._wait("wait", sends)
        with self.timer.phase("compute"):
            for job in jobs:
                self._finish(job)
        self._wait("gather", recvs)
        self.timer.add_bytes("gather", sum(c for r in self.chunks[1:] for _, c in r) * _row(out))
        return self.wire.to_host64(out), jobs

    # --- every other rank: receive chunk k, queue it, send chunk k-1's output -----------------
    def _rank_step(self) -> tuple[None, list[Job]]:
        mine = self.chunks[self.rank]
        with self.timer.phase("scatter"):
            bufs = [self.wire.empty((c, *self.in_tail), self.in_dtype) for _, c in mine]
            outs = [self.wire.empty((c, *self.out_tail), self.out_dtype) for _, c in mine]
            recvs = [self.comm.irecv(b, 0, tag=IN_TAG + k) for k, b in enumerate(bufs)]
        self.timer.add_bytes("scatter", sum(b.nbytes for b in bufs))
        jobs, sends = [], []
        for k, buf in enumerate(bufs):
            self._wait("wait", [recvs[k]])
            with self.timer.phase("compute"):
                jobs.append(self._launch(buf, outs[k]))
            if k > 0:  # chunk k is queued behind k-1: the device stays busy while we send
                sends.append(self._send(jobs[k - 1], k - 1))
        if jobs:
            sends.append(self._send(jobs[-1], len(jobs) - 1))
        self._wait("gather", sends)
        return None, jobs

    def _send(self, job: Job, k: int):
        with self.timer.phase("compute"):
            self._finish(job)
        with self.timer.phase("gather"):
            return self.comm.isend(job.out, 0, tag=OUT_TAG + k)

    def _wait(self, phase: str, reqs: list) -> None:
        with self.timer.phase(phase):
            start = self.lanes.now()
            for req in reqs:
                req.wait()
            self.comm_marks.append((start, self.lanes.now()))

    # --- one chunk over the three streams ------------------------------------------------------
    def _launch(self, xw: torch.Tensor, outw: torch.Tensor) -> Job:
        job = Job(outw)
        if not self.lanes.cuda:
            start = self.lanes.now()
            outw.copy_(self.forward(xw))
            job.marks["compute"] = [(start, self.lanes.now())]
            return job
        lanes, staged = self.lanes, self.wire.staged
        lanes.h2d.wait_stream(torch.cuda.current_stream())  # a received message is ready
        with torch.cuda.stream(lanes.h2d):
            e0 = lanes.event()
            x = xw.to(self.strategy.device, non_blocking=True) if staged else xw
            e1 = lanes.event()
        lanes.compute.wait_event(e1)
        with torch.cuda.stream(lanes.compute):
            x.record_stream(lanes.compute)  # allocated on the copy-in stream
            e2 = lanes.event()
            y = self.forward(x)
            e3 = lanes.event()
        lanes.d2h.wait_event(e3)
        with torch.cuda.stream(lanes.d2h):
            y.record_stream(lanes.d2h)
            e4 = lanes.event()
            outw.copy_(y, non_blocking=True)
            e5 = lanes.event()
        if staged:
            self.timer.add_bytes("h2d", xw.nbytes)
            self.timer.add_bytes("d2h", outw.nbytes)
            job.marks = {"h2d": [(e0, e1)], "d2h": [(e4, e5)]}
        job.marks["compute"] = [(e2, e3)]
        job.done = e5
        return job

    def _finish(self, job: Job) -> None:
        if job.done is not None:
            job.done.synchronize()

    def _account(self, jobs: list[Job]) -> None:
        """Keep this step's marks; rank_extra() turns them into seconds after the run, so
        the event queries cost the timed step nothing."""
        marks = {lane: [m for j in jobs for m in j.marks.get(lane, [])] for lane in LANES}
        self.log.append((getattr(self.lanes, "e0", None), marks, self.comm_marks))

    def rank_extra(self) -> dict:
        """Median over the timed steps of compute, comm, hidden and exposed seconds."""
        if self.lanes.cuda:
            torch.cuda.synchronize()
        stats = [self._hidden(*entry) for entry in self.log[-self.cfg.iters :]]
        med = {k: statistics.median(s[k] for s in stats) for k in stats[0]}
        med["hidden_fraction"] = med["hidden_s"] / med["comm_s"] if med["comm_s"] > 0 else 0.0
        return {"overlap": med}

    def _hidden(self, e0, marks: dict[str, list], comm_marks: list[Interval]) -> dict:
        def sec(m) -> float:
            return m if isinstance(m, float) else e0.elapsed_time(m) / 1e3

        spans = {lane: [(sec(a), sec(b)) for a, b in ms] for lane, ms in marks.items()}
        comm = spans["h2d"] + spans["d2h"] + comm_marks
        hidden = intersection(comm, spans["compute"])
        return {
            "compute_s": measure(spans["compute"]),
            "comm_s": measure(comm),
            "hidden_s": hidden,
            "exposed_s": measure(comm) - hidden,
        }


def _row(t: torch.Tensor) -> int:
    """Bytes per row (dim 0) of t."""
    return t[:1].nbytes if t.shape[0] else 0
