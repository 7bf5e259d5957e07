"""How single-threaded processes slow each other down on this host: the `cpu_concurrency`
section of ceilings.json.

MPI ranks on CPUs (one thread each) share the host's cores, SMT siblings, caches and memory
bandwidth, so k ranks computing at once each run slower than one alone. This measures that
directly: `k` worker processes (one torch thread each) start the same convolution at the same
instant and time it for a fixed window; the slowdown at k is the median over them of each
one's mean call time, over the time of one process alone:

    "cpu_concurrency": {
      "ranks":        [1, 2, 4, ...],     # processes computing at once (powers of 2, cores)
      "slowdown":     [1.0, s2, s4, ...], # median per-process time at k / time at k = 1
      "slowdown_max": [1.0, ...],         # the slowest process at k / time at k = 1
      "seconds":      [t1, t2, ...],      # median over processes of mean seconds per call
      "kernel": str, "method": str        # what was timed and how
      # a workload's step (StepKernel) only:
      "step": {"workload": str, "model": str | None, "train": bool, "dtype": str,
               "batch": int, "threads": int},              # what the step ran
      "slowdown_lockstep": [1.0, ...],    # median over rounds of the round's slowest call / alone
      "seconds_lockstep": [t1, ...],      # that median in seconds ([0]: the median call alone)
      "lockstep_rounds": [int, ...]       # rounds timed at each k
    }

A step curve is timed in lockstep rounds, as bulk-synchronous ranks run: each round the parent
starts all k workers on ONE call at the same instant and waits for every one of them (each
replies the seconds from that instant to the end of its call). A process's mean over the
rounds gives "seconds", "slowdown" and "slowdown_max" as for the window; the slowest call of
each round, its median over the rounds, gives "slowdown_lockstep": the slowdown of a step
that waits for its slowest rank EVERY step, which is above the slowest process's mean (max of
means <= mean of maxes), more so as k grows.
The rounds replace the window (rounds for the window's length, at least 5 of them): a level
costs about the window, or 5 calls where 3 (the window's least) would have run.

The kernel is a convolution (`Kernel`) for `scalelab ceilings`; `scalelab plan` times its own
workload's step instead (`StepKernel`: a training step or a forward of the model at one
rank's batch): how much processes slow each other depends on what they run (on a 2-core host
the convolution showed no slowdown at 2 processes while two ranks of MNIST's mlp ran their
steps 1.15-1.6x slower than one alone).

The workers are started once (importing torch takes a second) and reused for every k, and
for every later curve of the same kernel in the process (`Workers.kept`); they
are plain subprocesses talking JSON lines over stdin/stdout, so nothing depends on how the
parent was started (`python -m scalelab`, pytest, under a launcher). Workers are not pinned to
cores: the OS places them, as it places MPI ranks started without a binding.
"""

from __future__ import annotations

import atexit
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar

from scalelab.config import RunConfig


@dataclass(frozen=True)
class Kernel:
    """conv2d of a (batch, channels, size, size) float32 input with a 3x3 kernel, padding 1:
    an AlexNet/VGG-like layer whose activations (MBs) go past the private caches."""

    batch: int = 8
    channels: int = 64
    size: int = 56

    @property
    def flops(self) -> int:
        return 2 * self.batch * self.size**2 * self.channels**2 * 9

    def describe(self, threads: int = 1) -> str:
        b, c, s = self.batch, self.channels, self.size
        return (
            f"torch conv2d fp32, input ({b}, {c}, {s}, {s}) * weight ({c}, {c}, 3, 3), "
            f"padding 1 ({self.flops / 1e9:.3g} GFLOP), {threads} torch thread(s) per process"
        )

    def spec(self) -> dict[str, Any]:
        """What a worker builds the kernel from (JSON)."""
        return {"conv": [self.batch, self.channels, self.size]}


@dataclass(frozen=True)
class StepKernel:
    """One step of a workload as one rank runs it: cfg's model at `batch` items, a training
    step (forward, loss, backward, optimizer step) when cfg trains, else a forward."""

    cfg: RunConfig
    batch: int

    def describe(self, threads: int = 1) -> str:
        what = "training step" if self.cfg.train else "forward"
        name = self.cfg.model or self.cfg.workload
        return f"one {what} of {name} at batch {self.batch}, {threads} torch thread(s) per process"

    def spec(self) -> dict[str, Any]:
        return {"step": {"cfg": self.cfg.to_dict(), "batch": self.batch}}

    def step(self, threads: int = 1) -> dict[str, Any]:
        """What the curve timed, for a prediction to check it is its own rank's step."""
        c = self.cfg
        return {"workload": c.workload, "model": c.model, "train": bool(c.train),
                "dtype": c.dtype, "batch": self.batch, "threads": threads}  # fmt: skip

    def build(self) -> Callable[[], None]:
        """The step as a call, its model and inputs built (what a worker times)."""
        return _build(self.spec())


DEFAULT, QUICK = Kernel(8), Kernel(2)
METHOD = (
    "k worker processes (one thread each) start the kernel at the same instant and call it "
    "back to back for {window:g} s each; per process the mean call time (the window over its "
    "calls: a call shorter than the scheduler's time slice shows time-slicing in the mean, not "
    "in the median); slowdown(k) = "
    "median over the k processes / the time of one process alone"
)
LOCKSTEP = (
    "k worker processes (one thread each) run the kernel in lockstep rounds: each round all k "
    "start ONE call at the same instant and the next round starts once all k are done, rounds "
    "for {window:g} s and at least {rounds} of them; a call's time counted from the round's "
    "start instant (a process the scheduler runs late counts its wait); per process the mean "
    "call time over the rounds; slowdown(k) = median over the k processes / the time of one "
    "process alone; slowdown_max(k) = the slowest process's mean / alone; "
    "slowdown_lockstep(k) = median over the rounds of the round's slowest call / the median "
    "call alone"
)
MIN_ROUNDS = 5


def levels(cores: int) -> list[int]:
    """1, 2, 4, ... up to the cores, and the core count itself."""
    out, k = [], 1
    while k < cores:
        out.append(k)
        k *= 2
    return [*out, cores]


def measure(
    cores: int, quick: bool = False, kernel: Kernel | StepKernel | None = None, threads: int = 1
) -> dict[str, Any]:
    """The cpu_concurrency section for k over levels(cores // threads), timing `kernel`
    (default: the convolution) in processes of `threads` torch threads each."""
    return measure_curves(cores, 1, quick, kernel, threads)[0]


def measure_curves(
    cores: int,
    repeats: int,
    quick: bool = False,
    kernel: Kernel | StepKernel | None = None,
    threads: int = 1,
) -> list[dict[str, Any]]:
    """`repeats` curves as `measure` gives them, one after another, from one pool of workers:
    a worker's start (torch's import, the kernel's build) costs more than a curve's windows."""
    default, window = (QUICK, 0.1) if quick else (DEFAULT, 0.4)
    kernel = kernel or default
    ks = levels(max(cores // threads, 1))
    pool = Workers.kept(ks[-1], kernel, threads)
    if not isinstance(kernel, StepKernel):  # the ceilings' convolution: the window, as always
        with pool.closed_on_error():  # per curve, per k: seconds of each process
            runs = [[pool.run(k, window) for k in ks] for _ in range(repeats)]
        method = METHOD.format(window=window)
        return [{**curve(ks, per_k, kernel.describe(threads), method), "threads": threads}
                for per_k in runs]  # fmt: skip
    with pool.closed_on_error():  # per curve, per k: per round, seconds of each process
        rounds = [[pool.lockstep(k, window) for k in ks] for _ in range(repeats)]
    method = LOCKSTEP.format(window=window, rounds=MIN_ROUNDS)
    what, step = kernel.describe(threads), kernel.step(threads)
    return [{**lockstep_curve(ks, per_k, what, method), "threads": threads, "step": step}
            for per_k in rounds]  # fmt: skip


def curve(ks: list[int], per_k: list[list[float]], kernel: str, method: str) -> dict[str, Any]:
    """The section from per-process call times at each k (per_k[i]: k = ks[i] values)."""
    medians = [statistics.median(times) for times in per_k]
    base = medians[0]
    return {
        "ranks": list(ks),
        "slowdown": [m / base for m in medians],
        "slowdown_max": [max(times) / base for times in per_k],
        "seconds": medians,
        "kernel": kernel,
        "method": method,
    }


def lockstep_curve(
    ks: list[int], per_k: list[list[list[float]]], kernel: str, method: str
) -> dict[str, Any]:
    """The section from lockstep rounds (per_k[i]: rounds at k = ks[i], each k call times):
    the window's fields from each process's mean over the rounds, and slowdown_lockstep."""
    means = [[statistics.fmean(p) for p in zip(*rounds, strict=True)] for rounds in per_k]
    out = curve(ks, means, kernel, method)
    slowest = [statistics.median(max(r) for r in rounds) for rounds in per_k]
    out["seconds_lockstep"] = slowest  # [0]: the median call alone (robust to a stray round)
    out["slowdown_lockstep"] = [t / slowest[0] for t in slowest]
    out["lockstep_rounds"] = [len(rounds) for rounds in per_k]
    return out


class Workers:
    """n worker subprocesses of `threads` torch threads each, holding the kernel's tensors,
    warmed up and waiting."""

    # Pools kept for the rest of the process by (workers, kernel, threads): `plan` measures the
    # same curve again beside every verify round, and a pool's start (n imports of torch,
    # the model built) cost more than the curve's windows. Closed at exit.
    _kept: ClassVar[dict[str, Workers]] = {}

    @classmethod
    def kept(cls, n: int, kernel: Kernel | StepKernel, threads: int = 1) -> Workers:
        """The live pool for (n, kernel, threads), started on first use."""
        # the CPUs this process may use now: workers inherit them (a pool started pinned to
        # one core measures that core, not the host)
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        key = json.dumps([n, kernel.spec(), threads, cpus], sort_keys=True, default=str)
        pool = cls._kept.get(key)
        if pool is None or any(p.poll() is not None for p in pool.procs):
            pool = cls._kept[key] = cls(n, kernel, threads)
        return pool

    @classmethod
    def close_kept(cls) -> None:
        while cls._kept:
            cls._kept.popitem()[1].close()

    @contextmanager
    def closed_on_error(self) -> Iterator[None]:
        """A pool whose measurement failed is closed (and started afresh next time)."""
        try:
            yield
        except BaseException:
            self.close()
            raise

    def __init__(self, n: int, kernel: Kernel | StepKernel, threads: int = 1) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
        cmd = [sys.executable, "-c", "from scalelab.instrument.concurrency import worker; worker()"]
        self.procs = [
            subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
            for _ in range(n)
        ]
        for p in self.procs:
            self._send(p, {"kernel": kernel.spec(), "threads": threads})
        for p in self.procs:
            self._reply(p)  # "ready": imported, tensors built, one warm-up call done
        self.cpu_seconds: list[float] = []  # of the last run(), per worker

    def run(self, k: int, window: float) -> list[float]:
        """Mean call seconds of each of the first k workers, all started together (their CPU
        seconds per call are kept in self.cpu_seconds: wall over CPU says how much of its
        core a worker had)."""
        start = time.time() + 0.05 + 0.002 * k  # time enough to reach every worker first
        for p in self.procs[:k]:
            self._send(p, {"start": start, "window": window})
        replies = [self._reply(p) for p in self.procs[:k]]
        self.cpu_seconds = [float(r["cpu_seconds"]) for r in replies]
        return [float(r["seconds"]) for r in replies]

    def lockstep(self, k: int, window: float, least: int = MIN_ROUNDS) -> list[list[float]]:
        """Rounds of the first k workers each starting ONE call at the same instant, the next
        round once all k replied, until `window` seconds passed and at least `least` rounds
        ran: per round, each worker's seconds from the round's start instant to the end of its
        call (a worker the scheduler runs late counts its wait, as a rank's step would)."""
        rounds: list[list[float]] = []
        began = time.perf_counter()
        while len(rounds) < least or time.perf_counter() - began < window:
            start = time.time() + 0.003 + 0.0001 * k  # time to reach every worker first
            for p in self.procs[:k]:
                self._send(p, {"start": start, "calls": 1})
            rounds.append([float(self._reply(p)["span"]) for p in self.procs[:k]])
        return rounds

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.stdin.close()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()

    @staticmethod
    def _send(p: subprocess.Popen, msg: dict) -> None:
        p.stdin.write(json.dumps(msg) + "\n")
        p.stdin.flush()

    @staticmethod
    def _reply(p: subprocess.Popen) -> dict:
        line = p.stdout.readline()
        if not line:
            raise RuntimeError(f"cpu_concurrency worker exited (code {p.wait()})")
        return json.loads(line)


atexit.register(Workers.close_kept)


def worker() -> None:
    """A worker's loop: build the kernel, then per request wait for the start instant and
    time calls for the window (or exactly `calls` of them: a lockstep round); reply with the
    mean call seconds (see METHOD)."""
    import torch

    first = json.loads(sys.stdin.readline())
    torch.set_num_threads(first.get("threads", 1))
    call = _build(first["kernel"])
    for _ in range(2):  # warm-up: allocations, the optimizer's state
        call()
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req, arrived = json.loads(line), time.time()
        # A round's worker spins to its start (as an MPI rank polls in a collective): a sleep's
        # wake-up, late by up to a time slice on a busy host, would count in its span.
        spin = 0.002 if "calls" in req else 0.0
        while (left := req["start"] - time.time()) > 0:
            if left > spin:
                time.sleep(min(left - spin, 0.01))
        times, began, cpu0 = [], time.perf_counter(), time.process_time()
        least, window = req.get("calls", 3), req.get("window", 0.0)  # "calls": exactly that many
        while len(times) < least or time.perf_counter() - began < window:
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
        cpu = (time.process_time() - cpu0) / len(times)
        out = {"seconds": statistics.fmean(times), "cpu_seconds": cpu}
        if "calls" in req:  # a round: from the common start (or the request's arrival, when it
            # came after it: the parent's lag, not the step's) to the end of its calls
            out["span"] = time.time() - max(req["start"], arrived)
        print(json.dumps(out), flush=True)


def _build(spec: dict[str, Any]) -> Callable[[], None]:
    """The kernel's call from its spec (Kernel.spec, StepKernel.spec)."""
    import torch

    if "conv" in spec:
        b, c, s = spec["conv"]
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(b, c, s, s, generator=gen)  # (b, c, s, s)
        w = torch.randn(c, c, 3, 3, generator=gen)

        def conv() -> None:
            with torch.no_grad():
                torch.nn.functional.conv2d(x, w, padding=1)

        return conv
    from scalelab.precision import get_precision
    from scalelab.workloads import WORKLOADS

    cfg = RunConfig(**spec["step"]["cfg"])
    workload = WORKLOADS.get(cfg.workload)(cfg)
    dtype = get_precision(cfg.dtype).storage
    model = workload.build_model().to(dtype)
    inputs = workload.synthetic_inputs(spec["step"]["batch"], 0)
    x = workload.prepare(inputs.x)  # (batch, *item shape)
    x = x.to(dtype) if x.is_floating_point() else x
    if not cfg.train:

        def forward() -> None:
            with torch.no_grad():
                model(x)

        return forward
    model.train()
    opt = workload.optimizer(model)

    def step() -> None:
        opt.zero_grad()
        workload.loss(model, model(x), inputs.y).backward()
        opt.step()

    return step
