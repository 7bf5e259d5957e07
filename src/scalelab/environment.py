"""The machine a record was measured on: hardware, drivers, libraries and the git commit."""

from __future__ import annotations

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


def mpi_library() -> str | None:
    """The MPI library's own version line, without initialising MPI in this process."""
    try:
        import mpi4py
    except ImportError:
        return None
    if "mpi4py.MPI" not in sys.modules:
        mpi4py.rc.initialize = False  # MPI_Get_library_version may be called before MPI_Init
    from mpi4py import MPI

    return MPI.Get_library_version().splitlines()[0].strip()


@lru_cache(maxsize=1)
def git_commit() -> dict[str, Any]:
    """Commit of the scalelab checkout this code runs from.

    SCALELAB_GIT_COMMIT, when set, names the commit a copied tree came from and wins: a copy
    can travel with a stale .git (a remote machine's copy carried the session's first HEAD
    under a newer working tree, and every record said that HEAD, "dirty"). Otherwise git's
    HEAD; None without either.
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


@lru_cache(maxsize=1)
def collect() -> dict[str, Any]:
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
        "mpi_library": mpi_library(),
        **gpu_info(),
        **git_commit(),
    }
