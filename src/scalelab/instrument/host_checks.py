"""Is this run's time worth believing? Checks of the host a run had, for its `warnings` list.

- oversubscription: more processes (or processes x torch threads) on this host than CPUs the
  job may use: the union of its ranks' affinity masks (a launcher may bind each rank to its
  own cores), the cgroup CPU quota, the Slurm allocation, the smallest;
- host load: CPU time other processes took on our CPUs while the run ran (from /proc/stat,
  minus every rank's own CPU time), more than the CPUs our run left free;
- spread: the timed repetitions' CV over stats.SPREAD_CV.

The record keeps the warnings and the numbers behind them (`host`); the root prints one
stderr line. pyperf's `system tune` checks and its "the benchmark seems unstable" are the model.
"""

from __future__ import annotations

import os
import resource
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scalelab.comm import slurm_env as slurm
from scalelab.instrument.stats import SPREAD_CV, describe

# CPUs' worth of other processes' work beyond what our run left free before a run is warned.
LOAD_MARGIN_CPUS = 0.25
LOCAL_SIZE_VARS = ("LOCAL_WORLD_SIZE", "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE")


def affinity_cpus() -> list[int]:
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def cgroup_quota(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """CPUs the cgroup's quota allows (v2 cpu.max, v1 cfs_quota_us / cfs_period_us)."""
    try:
        v2 = root / "cpu.max"
        if v2.is_file():
            quota, period = v2.read_text().split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return quota / period if quota > 0 else None
    except (OSError, ValueError):
        return None


def slurm_cpus(env: dict[str, str] | None = None) -> int | None:
    env = os.environ if env is None else env
    value = env.get("SLURM_CPUS_ON_NODE")
    return int(value) if value and value.isdigit() else None


def cpu_allowance(
    env: dict[str, str] | None = None, cpus: Sequence[int] | None = None
) -> tuple[float, str]:
    """(CPUs this job may use on this host, what limits it); `cpus`: the union of its ranks'
    affinity masks here (default: this process's)."""
    limits = [(float(len(affinity_cpus() if cpus is None else cpus)), "affinity")]
    quota = cgroup_quota()
    if quota is not None:
        limits.append((quota, "cgroup quota"))
    slurm = slurm_cpus(env)
    if slurm is not None:
        limits.append((float(slurm), "Slurm allocation"))
    return min(limits)


def ranks_on_host(size: int, env: dict[str, str] | None = None) -> int:
    """Ranks sharing this host: the launcher's local size, else srun's tasks on this node
    (SLURM_STEP_TASKS_PER_NODE: `srun -N2 -n2` puts one on each), else all of them."""
    env = os.environ if env is None else env
    for var in LOCAL_SIZE_VARS:
        if env.get(var, "").isdigit():
            return int(env[var])
    if slurm.step_tasks(env) == size and env.get("SLURM_STEP_TASKS_PER_NODE"):
        return slurm.tasks_on_this_node(env)  # srun started the ranks: one task each
    return size


# --- host load while the run ran ----------------------------------------------------------
def cpu_busy(stat: Path = Path("/proc/stat")) -> dict[int, float] | None:
    """Busy (non-idle, non-iowait) seconds of every CPU since boot; None off Linux."""
    try:
        lines = stat.read_text().splitlines()
    except OSError:
        return None
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for line in lines:
        parts = line.split()
        if parts and parts[0].startswith("cpu") and parts[0][3:].isdigit():
            values = [int(v) for v in parts[1:9]]  # user nice system idle iowait irq softirq steal
            out[int(parts[0][3:])] = (sum(values) - values[3] - values[4]) / tick
    return out


@dataclass(frozen=True)
class Place:
    """Where one rank ran: its host, its affinity mask, its CPU seconds over the run."""

    host: str
    cpus: tuple[int, ...]
    cpu_s: float


def local(places: Sequence[Place], host: str) -> tuple[list[Place], list[int]]:
    """(the ranks on `host`, the union of their masks: the CPUs the job may use there)."""
    here = [p for p in places if p.host == host]
    return here, sorted({c for p in here for c in p.cpus})


def own_cpu_seconds() -> float:
    """This process's CPU seconds, every thread, and its waited-for children."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


@dataclass
class HostProbe:
    """Started before a run's work on every rank; `stop()` gives this rank's CPU seconds."""

    cpus: list[int]
    wall0: float
    busy0: dict[int, float] | None  # every CPU's: the ranks here may hold other masks
    own0: float
    loadavg: float | None

    @classmethod
    def start(cls) -> HostProbe:
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        return cls(affinity_cpus(), time.perf_counter(), cpu_busy(), own_cpu_seconds(), load)

    def own_cpu_s(self) -> float:
        return own_cpu_seconds() - self.own0

    def place(self) -> Place:
        return Place(socket.gethostname(), tuple(self.cpus), self.own_cpu_s())

    def host_load(self, job_cpu_s: float, cpus: Sequence[int] | None = None) -> dict[str, Any]:
        """What the run's CPUs (`cpus`: every rank's here; default this process's) did
        meanwhile: others' CPU seconds over the run, as CPUs. `job_cpu_s`: the CPU seconds
        of the job's processes on this host."""
        cpus = self.cpus if cpus is None else cpus
        seconds = time.perf_counter() - self.wall0
        busy1 = cpu_busy()
        out: dict[str, Any] = {"cpus": len(cpus), "seconds": seconds,
                               "loadavg_before": self.loadavg, "job_cpu_s": job_cpu_s}  # fmt: skip
        if busy1 is not None and self.busy0 is not None and seconds > 0:
            busy = sum(busy1.get(c, 0.0) - self.busy0.get(c, 0.0) for c in cpus)
            out["others_cpus"] = max(busy - job_cpu_s, 0.0) / seconds  # others' average CPUs
        return out


# --- the warnings ---------------------------------------------------------------------------
def oversubscription(
    ranks_here: int, threads: int, allowance: tuple[float, str], bound: int | None = None
) -> list[str]:
    """`bound`: the CPUs the launcher bound each rank to, where it bound them."""
    cpus, why = allowance
    if ranks_here > cpus:
        return [f"{ranks_here} processes on {cpus:g} CPUs ({why}): ranks wait for cores"]
    if ranks_here * threads > cpus:
        fix = "pass --threads to cap them"
        if bound is not None and bound < threads:
            fix = (f"the launcher bound each rank to {bound} CPU(s): mpirun --bind-to none or "
                   f"--map-by slot:PE={threads}, srun --cpus-per-task={threads}")  # fmt: skip
        return [
            f"{ranks_here} processes x {threads} torch threads on {cpus:g} CPUs ({why}): "
            f"threads wait for cores ({fix})"
        ]
    return []


def load_warning(load: dict[str, Any], need_cpus: float) -> list[str]:
    """Warn when others took more of our CPUs than the run left free (plus a margin)."""
    others = load.get("others_cpus")
    if others is None:
        return []
    free = load["cpus"] - min(need_cpus, load["cpus"])
    if others > free + LOAD_MARGIN_CPUS:
        return [
            f"host busy: other processes kept {others:.2f} of {load['cpus']} CPUs busy during "
            f"the run (it needed {min(need_cpus, load['cpus']):g})"
        ]
    return []


def spread_warning(walls: Sequence[float], what: str = "iterations") -> list[str]:
    stats = describe(walls)
    if stats["n"] >= 3 and stats["cv"] > SPREAD_CV:
        return [
            f"unstable timing: CV {stats['cv']:.0%} over {stats['n']} {what} "
            f"(threshold {SPREAD_CV:.0%}; min {stats['min'] * 1e3:.3g} ms, "
            f"max {stats['max'] * 1e3:.3g} ms)"
        ]
    return []


# A rank's wall this much above the run's (and RANK_WALL_SLACK_S beyond it) is reported.
RANK_WALL_RATIO = 1.25
RANK_WALL_SLACK_S = 0.002


def rank_wall_warning(wall: float, rank_walls: Sequence[float | None] | None) -> list[str]:
    """A rank whose wall is well above the run's wall (rank 0's): the ranks started or ran
    apart, and the record's wall and throughput are rank 0's view of it (seen: a rank's
    0.624 s beside the record's 0.241 s, unflagged)."""
    walls = [(r, w) for r, w in enumerate(rank_walls or []) if w is not None]
    if not walls or not wall:
        return []
    rank, top = max(walls, key=lambda rw: rw[1])
    if top <= wall * RANK_WALL_RATIO or top - wall <= RANK_WALL_SLACK_S:
        return []
    return [f"rank skew: rank {rank}'s wall {top * 1e3:.4g} ms is {top / wall:.2f}x the run's "
            f"{wall * 1e3:.4g} ms (rank 0's): ranks started or ran apart"]  # fmt: skip


def run_checks(
    size: int,
    threads: int,
    walls: Sequence[float],
    load: dict[str, Any] | None,
    what: str,
    places: Sequence[Place] = (),
) -> tuple[list[str], dict[str, Any]]:
    """(warnings, the numbers behind them) for a run of `size` ranks; `places`: every rank's
    (gathered; else this process's mask stands for the ranks here)."""
    here_places, union = local(places, socket.gethostname())
    allowance = cpu_allowance(cpus=union or None)
    here = ranks_on_host(size)
    host = {"allowed_cpus": allowance[0], "limited_by": allowance[1], "ranks_here": here,
            "torch_threads": threads, **(load or {})}  # fmt: skip
    bound = None
    if any(len(p.cpus) < len(union) for p in here_places):  # the launcher bound each rank
        host["rank_cpus"] = [list(p.cpus) for p in here_places]
        bound = max(len(p.cpus) for p in here_places)
    warnings = oversubscription(here, threads, allowance, bound)
    if load is not None:
        warnings += load_warning(load, here * threads)
    warnings += spread_warning(walls, what)
    return warnings, host


def emit(warnings: Sequence[str], stream=None) -> None:
    """The one stderr line a warned run prints."""
    if warnings:
        (stream or sys.stderr).write("scalelab: warning: " + "; ".join(warnings) + "\n")
