"""How many torch intra-op threads a CPU run gets when the user gave no --threads.

torch's default is one thread per physical core, whatever else the host runs. On a busy host
those threads spin waiting for cores their peers' threads hold: a small CNN's check on a
2-core host under load took 91.96 ms at torch's default and 1.15 ms at one thread.
So a run without --threads takes the CPUs free for it: the CPUs its job may use on this host
(host_checks.cpu_allowance), minus what other processes kept busy over a short sample of
/proc/stat, shared by the ranks on the host; never more than torch's own default, never
fewer than one per rank (a busy host: one per rank). The choice and why go in the record
(`threads`) and the run's summary.
"""

from __future__ import annotations

import importlib.util
import math
import os
import time
from dataclasses import asdict, dataclass
from typing import Any

from scalelab.comm.slurm_env import THREADS_VAR
from scalelab.instrument import host_checks

SAMPLE_S = 0.1  # how long the host is watched before a run: long enough for 10 clock ticks


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    # "--threads", "chosen", "Slurm", "checkpoint" (a resume), "torch default" (a GPU run),
    # "BLAS default" (serial)
    source: str
    why: str

    def as_record(self) -> dict[str, Any]:
        return asdict(self)


def others_busy(cpus: list[int], seconds: float = SAMPLE_S) -> float | None:
    """CPUs' worth of work on `cpus` over `seconds` while this process sleeps: other
    processes' (the job's other ranks, still starting, count too: a conservative choice)."""
    before = host_checks.cpu_busy()
    start = time.perf_counter()
    time.sleep(seconds)
    after = host_checks.cpu_busy()
    elapsed = time.perf_counter() - start
    if before is None or after is None or elapsed <= 0:
        return None
    return max(sum(after.get(c, 0.0) - before.get(c, 0.0) for c in cpus), 0.0) / elapsed


def choose(allowed: float, limited_by: str, ranks_here: int, others: float | None,
           default: int) -> ThreadChoice:  # fmt: skip
    """Threads per rank from the CPUs free: floor((allowed - others) / ranks_here), between
    1 and torch's `default`."""
    if others is None:  # no /proc/stat: what the job may use, shared by its ranks
        free, seen = allowed, f"{allowed:g} CPUs ({limited_by}), load unknown"
    else:
        free = max(allowed - others, 0.0)
        seen = f"{free:.1f} of {allowed:g} CPUs ({limited_by}) free, others kept {others:.2f} busy"
    per_rank = min(max(math.floor(free / max(ranks_here, 1) + 0.25), 1), max(default, 1))
    idle = min(max(math.floor(allowed / max(ranks_here, 1)), 1), max(default, 1))
    head = "host busy: " if per_rank < idle else ""  # the load, not the host, set it
    why = f"{head}{seen}, {ranks_here} rank(s) on this host; torch's default {default}"
    return ThreadChoice(threads=per_rank, source="chosen", why=why)


def pick(user: int | None, device: str, ranks_here: int, default: int) -> ThreadChoice:
    """The thread count for this rank: the user's, else (CPU) the free CPUs' share."""
    if user is not None:
        return given(user)
    if device != "cpu":
        why = f"{device} run: host threads mostly wait for the device"
        return ThreadChoice(threads=default, source="torch default", why=why)
    allowed, limited_by = host_checks.cpu_allowance()
    if min(default, allowed / max(ranks_here, 1)) <= 1:  # one whatever the load: no look
        why = (f"{allowed:g} CPUs ({limited_by}), {ranks_here} rank(s) on this host; torch's "
               f"default {default}: one per rank whatever the load")  # fmt: skip
        return ThreadChoice(threads=1, source="chosen", why=why)
    others = others_busy(host_checks.affinity_cpus())
    return choose(allowed, limited_by, ranks_here, others, default)


def given(user: int, env: dict[str, str] | None = None) -> ThreadChoice:
    """The count the run was given: by --threads, or (no --threads in a Slurm job) the CPUs
    Slurm gave the task, which comm.launch.settle_config put in the config."""
    env = os.environ if env is None else env
    if env.get(THREADS_VAR) == str(user):
        why = "the CPUs Slurm gave this task (--cpus-per-task, else its share of the node's)"
        return ThreadChoice(threads=user, source="Slurm", why=why + "; --threads sets it")
    return ThreadChoice(threads=user, source="--threads", why="given by --threads")


def from_checkpoint(n: int) -> ThreadChoice:
    """A CPU resume without --threads: the count the checkpoint trained with. The bits of a
    step depend on it (MKL on a Xeon sums a 32x784 by 784x8 GEMM in another order at 1 and at
    2 threads), and a resume promises the uninterrupted run's bits."""
    why = "the count the checkpoint trained with, so the resumed steps sum as the first did"
    return ThreadChoice(threads=n, source="checkpoint", why=why)


def blas() -> ThreadChoice:
    """The serial (NumPy float64) strategy's threads: NumPy's BLAS held to one thread where
    threadpoolctl is installed, else the BLAS's own default (the whole host, busy or not)."""
    if importlib.util.find_spec("threadpoolctl") is not None:
        why = "the float64 reference: NumPy's BLAS held to one thread (threadpoolctl)"
        return ThreadChoice(threads=1, source="chosen", why=why)
    why = ("threadpoolctl is not installed: NumPy's BLAS takes its own default, up to every "
           "core whatever the load (pip install threadpoolctl holds it to one)")  # fmt: skip
    return ThreadChoice(threads=os.cpu_count() or 1, source="BLAS default", why=why)


def summary_line(rec: dict[str, Any]) -> str | None:
    got = rec.get("threads")
    if not isinstance(got, dict):
        return None
    tail = "; --threads sets it" if got["source"] in ("chosen", "checkpoint") else ""
    return f"  threads: {got['threads']} per rank ({got['source']}: {got['why']}{tail})"
