"""The machine a record was measured on: hardware, drivers, libraries and the git commit."""

from __future__ import annotations

import importlib.util
import os
import platform
import socket
import subprocess
import sys
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity, which its children inherit)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpu_info() -> dict[str, Any]:
    if not torch.cuda.is_available():
        return {"gpu_count": 0, "gpu_name": None, "driver": None}
    return {
        "gpu_count": torch.cuda.device_count(),
        "gpu_name": torch.cuda.get_device_name(0),
        "driver": nvidia_driver(),
    }


def nvidia_driver() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else version
    except Exception:  # nvidia-ml-py absent or no NVML: fall back to nvidia-smi
        pass
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
        return out.stdout.splitlines()[0].strip()
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


MPI_FIX = 'load your MPI (`module load <your MPI>`) or install MPICH: pip install "scalelab[mpich]"'


def _mpi_module():
    """mpi4py's MPI module, imported without initialising MPI (None without mpi4py, or when
    mpi4py finds no MPI library: mpi_problem says why)."""
    try:
        import mpi4py
    except ImportError:
        return None
    if "mpi4py.MPI" not in sys.modules:
        mpi4py.rc.initialize = False  # MPI_Get_library_version may be called before MPI_Init
    try:
        from mpi4py import MPI
    except RuntimeError:  # mpi4py's "cannot load MPI library": none on the loader's path
        return None
    return MPI


def mpi_problem() -> str | None:
    """Why MPI strategies cannot run here, in one line (None: mpi4py loads an MPI library).
    Loads the library (not MPI_Init): call it only where MPI is about to be used."""
    missing = "MPI strategies need mpi4py and an MPI library: " + MPI_FIX
    if importlib.util.find_spec("mpi4py") is None:
        return missing
    try:
        import mpi4py
    except ImportError:
        return missing
    if "mpi4py.MPI" in sys.modules:
        return None
    mpi4py.rc.initialize = False  # loading is not initialising: comm/mpi.import_mpi does that
    mpi4py.rc.finalize = False
    try:
        from mpi4py import MPI  # noqa: F401
    except RuntimeError as exc:
        why = " ".join(str(exc).split("\n")[1:2]) or str(exc)
        return f"mpi4py {mpi4py.__version__} finds no MPI library ({why}): {MPI_FIX}"
    return None


def mpi_library() -> str | None:
    """The MPI library's own version line, without initialising MPI in this process."""
    MPI = _mpi_module()
    return None if MPI is None else MPI.Get_library_version().splitlines()[0].strip()


def mpi_library_path() -> Path | None:
    """The libmpi this process loaded through mpi4py (the one its ranks will use)."""
    if _mpi_module() is None:
        return None
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return None
    libs = [ln.split()[-1] for ln in maps if "/libmpi" in ln.split()[-1]]
    return Path(libs[0]) if libs else None


def mpiexec_of_library() -> Path | None:
    """The mpiexec installed with mpi4py's MPI library (<prefix>/lib/libmpi.so ->
    <prefix>/bin/mpiexec), so ranks start under the launcher that speaks its PMI."""
    lib = mpi_library_path()
    if lib is None:
        return None
    for prefix in (lib.parent.parent, lib.resolve().parent.parent):
        for name in ("mpiexec", "mpirun"):
            if (prefix / "bin" / name).exists():
                return prefix / "bin" / name
    return None


def mpi_pmi(version: str) -> list[str]:
    """The process-management interfaces (srun --mpi=...) a library speaks, best first:
    Open MPI speaks PMIx; MPICH speaks PMI-1/PMI-2 unless it was built against PMIx (the
    PyPI wheel aborts under srun --mpi=pmix with "unsupported PMI version PMIx")."""
    if "Open MPI" in version:
        return ["pmix"]
    if "MPICH" in version or "Intel" in version:
        configure = next((ln for ln in version.splitlines() if "configure" in ln.lower()), "")
        return ["pmix", "pmi2"] if "pmix" in configure.lower() else ["pmi2"]
    return []


def query_cuda_aware(MPI) -> bool:
    """Whether the MPI library accepts device pointers (MPIX_Query_cuda_support where the
    library has it: Open MPI and MPICH builds with CUDA)."""
    try:
        return bool(MPI.Query_cuda_support())
    except (AttributeError, NotImplementedError, RuntimeError):
        return False


def mpi_cuda_aware(version: str) -> bool | None:
    """Whether the library accepts device pointers: asked of the library once MPI runs
    (MPIX_Query_cuda_support), else read from its build (MPICH's configure line, Open MPI's
    ompi_info); None when it cannot tell."""
    MPI = _mpi_module()
    if MPI is not None and MPI.Is_initialized():
        return query_cuda_aware(MPI)
    if "MPICH" in version:
        return "--with-cuda" in version
    if "Open MPI" in version:
        try:
            out = subprocess.run(
                ["ompi_info", "--parsable", "--all"], capture_output=True, text=True, timeout=20
            ).stdout
        except (OSError, subprocess.SubprocessError):
            return None
        return "mpi_built_with_cuda_support:value:true" in out
    return None


# An env without MPI has the same fields as one with it: a record's shape does not depend on
# whether this process happened to load the library before the record was made.
NO_MPI: dict[str, Any] = {"mpi_library": None, "mpi_pmi": None, "mpi_cuda_aware": None,
                          "mpiexec": None}  # fmt: skip


def mpi_info() -> dict[str, Any]:
    """Which MPI (version line), which PMI it speaks, CUDA-awareness and its mpiexec; when
    mpi4py is installed but finds no library, `mpi_problem` says so and how to fix it."""
    MPI = _mpi_module()
    if MPI is None:
        problem = mpi_problem() if importlib.util.find_spec("mpi4py") is not None else None
        return {**NO_MPI, **({"mpi_problem": problem} if problem else {})}
    version = MPI.Get_library_version()
    mpiexec = mpiexec_of_library()
    return {
        "mpi_library": version.splitlines()[0].strip(),
        "mpi_pmi": mpi_pmi(version),
        "mpi_cuda_aware": mpi_cuda_aware(version),
        "mpiexec": None if mpiexec is None else str(mpiexec),
    }


@lru_cache(maxsize=1)
def git_commit() -> dict[str, Any]:
    """Commit of the scalelab checkout this code runs from.

    SCALELAB_GIT_COMMIT, when set, names the commit a copied tree came from and wins: a copy
    can travel with a stale .git (an older HEAD under a newer working tree, which would have
    every record name that HEAD, "dirty"). Otherwise git's HEAD; None without either.
    """
    if os.environ.get("SCALELAB_GIT_COMMIT"):
        return {"git_commit": os.environ["SCALELAB_GIT_COMMIT"], "git_dirty": None}
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(
            ["git", "-C", str(here), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(here), "status", "--porcelain", "--", "."],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {"git_commit": None, "git_dirty": None}
    return {"git_commit": head, "git_dirty": bool(dirty.strip())}


@lru_cache(maxsize=2)
def collect(load_mpi: bool = False) -> dict[str, Any]:
    """The environment a record carries. The MPI library is named when this process already
    loaded it (an MPI run) or load_mpi asks (`scalelab env`): a run that needs no MPI never
    loads it (mpi4py without a library on the loader's path would end it)."""
    mpi = mpi_info() if load_mpi or "mpi4py.MPI" in sys.modules else NO_MPI
    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None,
        "numpy": np.__version__,
        **mpi,
        **gpu_info(),
        **git_commit(),
    }
