"""Starting ranks: detect an existing launcher, or start mpiexec / torchrun ourselves.

scalelab never implements a launcher: `scalelab run ... --ranks N` outside a launcher re-runs
the same command line under `mpiexec -n N` (MPI strategies) or `torchrun --nproc-per-node N`
(torch.distributed strategies), and returns its exit code.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from scalelab.comm import slurm_env as slurm
from scalelab.errors import UsageError

if TYPE_CHECKING:
    from scalelab.config import RunConfig

MPI_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MPI_LOCALRANKID")
# Processes per launcher task on this node (mpiexec's and torchrun's own counts).
LOCAL_SIZE_VARS = ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")


PR_SET_PDEATHSIG = 1
try:
    _LIBC = ctypes.CDLL(None, use_errno=True)  # resolved before any fork (preexec_fn)
except OSError:  # pragma: no cover - no C library to ask
    _LIBC = None


def die_with_parent(sig: int = signal.SIGKILL, parent: int | None = None) -> None:
    """This process gets `sig` when its parent dies (Linux PR_SET_PDEATHSIG): a rank dies with
    the launcher or watcher that started it. `parent`: the pid expected as parent; if it is
    gone already (the death came before this call: orphaned to init), the signal comes now."""
    prctl = getattr(_LIBC, "prctl", None)
    if prctl is None:
        return
    prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if os.getppid() == 1 or (parent is not None and os.getppid() != parent):
        os.kill(os.getpid(), sig)


def inside_mpi_launcher() -> bool:
    """mpiexec started this process, or srun did as one of several tasks (the batch script
    and a one-task step are not launchers: there scalelab starts its own ranks)."""
    return any(v in os.environ for v in MPI_RANK_VARS) or slurm.srun_launched()


def inside_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ
    )


def adopt_srun_step(launcher: str | None) -> None:
    """Under srun with several tasks and no torchrun, a torch.distributed strategy takes its
    rank, world and rendezvous from Slurm (env:// variables, set once for this process)."""
    if launcher == "torchrun" and slurm.srun_launched() and not inside_torchrun():
        os.environ.update(slurm.torch_env())


def launcher_world() -> int | None:
    """Processes the launcher around this one started (None: no launcher)."""
    for var in ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return slurm.step_tasks() if slurm.srun_launched() else None


def default_threads() -> int | None:
    """torch threads per rank when --threads is not given: the CPUs Slurm gave this task,
    shared by the ranks a launcher inside the task started on this node (None outside Slurm:
    torch's own default)."""
    cpus = slurm.cpus_per_task()
    if cpus is None:
        return None
    local = next((int(os.environ[v]) for v in LOCAL_SIZE_VARS if os.environ.get(v)), 1)
    return max(1, cpus // max(1, local))


def inside_launcher(launcher: str) -> bool:
    return inside_mpi_launcher() if launcher == "mpi" else inside_torchrun()


def refuse_nested_launch(launcher: str, ranks: int) -> None:
    """Inside an srun step, mpiexec (MPICH's hydra, Open MPI's mpirun) starts its ranks with a
    nested srun that waits for CPUs this step holds: for ever ("Requested nodes are busy")."""
    tasks = slurm.step_tasks()
    if launcher == "mpi" and tasks is not None:
        raise UsageError(
            f"--ranks {ranks} inside an srun step of {tasks} task(s): mpiexec would wait for "
            f"ever for a nested srun; let srun start the ranks (srun -n {ranks} --mpi=pmi2 "
            "scalelab run ...) or run scalelab from the batch script"
        )


def find_mpiexec() -> str:
    """The mpiexec that belongs to mpi4py's MPI library (a site MPI loaded through
    LD_LIBRARY_PATH or `module load` brings its own), then the one beside this Python (pip's
    mpich wheel), then PATH."""
    from scalelab.environment import mpiexec_of_library

    own = mpiexec_of_library()
    if own is not None:
        return str(own)
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.exists():
        return str(beside)
    found = shutil.which("mpiexec") or shutil.which("mpirun")
    if found is None:
        raise UsageError(
            "no mpiexec found: load your cluster's MPI, or install MPICH (pip install -e "
            "'.[mpich]')"
        )
    return found


def mpiexec_command(ranks: int) -> tuple[list[str], dict[str, str]]:
    exe = find_mpiexec()
    env = dict(os.environ)
    version = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout
    cmd = [exe, "-n", str(ranks)]
    extra = os.environ.get("SCALELAB_MPIEXEC_ARGS", "").split()
    if "Open MPI" in version or "OpenRTE" in version:
        cmd.append("--oversubscribe")  # more ranks than cores must start, not refuse
        if not any(a.lstrip("-") == "bind-to" for a in extra):
            # Open MPI binds each of up to 2 ranks to one core: --threads 2 then ran two
            # threads on one core (two ranks of two threads measured 1.5x slower than one
            # rank alone on 4 cores of the H100 VM). The OS places ranks and their threads,
            # as under MPICH's hydra, torchrun and the one-rank runs a plan calibrates on.
            cmd += ["--bind-to", "none"]
        if os.geteuid() == 0:
            env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    elif ranks > _usable_cpus():
        # A rank waiting in a collective polls in a loop: with more ranks than cores each
        # waiting rank takes a core from one still computing (3 MPICH ranks on one core: 7.2 s
        # for 2.5 s of work; 3.0 s with a nanosleep between polls). Open MPI yields by itself
        # when oversubscribed; MPICH is told to.
        env.setdefault(MPICH_YIELD_VAR, "1")
    return cmd + extra, env


# MPICH: sleep between polls of a waiting rank (an MPI_T control variable, read at MPI_Init).
MPICH_YIELD_VAR = "MPIR_CVAR_ENABLE_HEAVY_YIELD"


def _usable_cpus() -> int:
    # imported here: environment.py imports torch, and this module stays importable without
    # it (what a Slurm job asks in its kill grace imports comm/ only)
    from scalelab.environment import usable_cpus

    return usable_cpus()


def torchrun_command(ranks: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={ranks}",
    ]


def settle_config(cfg: RunConfig, launcher: str | None) -> RunConfig:
    """cfg as this process will run it under the launcher around it: the ranks that launcher
    started (`srun -n 4 scalelab run ...` without --ranks is a 4-rank run, and its record says
    so) and, without --threads, the CPUs Slurm gave the task."""
    adopt_srun_step(launcher)
    changes: dict[str, int] = {}
    world = launcher_world() if launcher is not None and inside_launcher(launcher) else None
    if cfg.ranks == 1 and world is not None and world > 1:
        changes["ranks"] = world
    threads = default_threads() if cfg.threads is None else None
    os.environ.pop(slurm.THREADS_VAR, None)
    if threads is not None:
        changes["threads"] = threads
        os.environ[slurm.THREADS_VAR] = str(threads)  # the rank says where it came from
    return dataclasses.replace(cfg, **changes) if changes else cfg
