"""Starting ranks: detect an existing launcher, or start mpiexec / torchrun ourselves.

scalelab never implements a launcher: `scalelab run ... --ranks N` outside a launcher re-runs
the same command line under `mpiexec -n N` (MPI strategies) or `torchrun --nproc-per-node N`
(torch.distributed strategies), and returns its exit code.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from scalelab.comm.job_report import JobOutcome, run_job
from scalelab.errors import UsageError

MPI_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MPI_LOCALRANKID")


def inside_mpi_launcher() -> bool:
    return any(v in os.environ for v in MPI_RANK_VARS) or "SLURM_PROCID" in os.environ


def inside_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ
    )


def inside_launcher(launcher: str) -> bool:
    return inside_mpi_launcher() if launcher == "mpi" else inside_torchrun()


def find_mpiexec() -> str:
    """The mpiexec that belongs to mpi4py's library: beside this Python first (pip's mpich),
    then PATH (a system Open MPI or MPICH)."""
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.exists():
        return str(beside)
    found = shutil.which("mpiexec") or shutil.which("mpirun")
    if found is None:
        raise UsageError("no mpiexec found: install an MPI library (pip install -e '.[mpi]')")
    return found


def mpiexec_command(ranks: int) -> tuple[list[str], dict[str, str]]:
    exe = find_mpiexec()
    env = dict(os.environ)
    version = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout
    cmd = [exe, "-n", str(ranks)]
    if "Open MPI" in version or "OpenRTE" in version:
        cmd.append("--oversubscribe")  # more ranks than cores must start, not refuse
        if os.geteuid() == 0:
            env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    cmd += os.environ.get("SCALELAB_MPIEXEC_ARGS", "").split()
    return cmd, env


def torchrun_command(ranks: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={ranks}",
    ]


def relaunch(launcher: str, ranks: int, argv: list[str]) -> int:
    """Run `scalelab ARGV` under the launcher with `ranks` processes; return its exit code."""
    return relaunch_job(launcher, ranks, argv).code


def relaunch_job(launcher: str, ranks: int, argv: list[str]) -> JobOutcome:
    """relaunch, with the one line that explains a failed job (a refusal, a dead rank)."""
    if launcher == "mpi":
        cmd, env = mpiexec_command(ranks)
        cmd += [sys.executable, "-m", "scalelab", *argv]
    else:
        cmd, env = torchrun_command(ranks) + ["-m", "scalelab", *argv], dict(os.environ)
    env.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off (shared hosts)
    env["SCALELAB_LAUNCHED"] = "1"
    return run_job(cmd, env, launcher)
