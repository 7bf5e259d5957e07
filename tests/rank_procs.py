"""Finding a launched rank's process by its environment, for the tests that kill one mid-run
(test_cli_ranks, test_mpi_strategies, test_slurm_cluster). The test starts the job with
SCALELAB_TEST_TOKEN=<uuid> in its environment, so only its own processes match."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

RANK_VARS = ("RANK", "PMI_RANK", "SLURM_PROCID")  # torchrun, mpiexec/PMI, srun


def environ(pid: int | str) -> dict[bytes, bytes] | None:
    """The process's environment, or None when it is gone or not ours to read."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except (OSError, ValueError):
        return None
    return dict(v.split(b"=", 1) for v in raw.split(b"\0") if b"=" in v)


def find_rank(token: str, rank: int, timeout: float, marker: str = "SCALELAB_JOB_DIR") -> int:
    """pid of the process started with SCALELAB_TEST_TOKEN=token whose rank variable (any of
    RANK_VARS) is `rank` and which has `marker` set: the rank itself (SCALELAB_JOB_DIR: it
    has a job folder; SCALELAB_LAUNCHED: started by scalelab's launcher), not its launcher."""
    want = str(rank).encode()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for entry in Path("/proc").iterdir():
            env = environ(entry.name) if entry.name.isdigit() else None
            if (
                env is not None
                and env.get(b"SCALELAB_TEST_TOKEN") == token.encode()
                and any(env.get(v.encode()) == want for v in RANK_VARS)
                and marker.encode() in env
            ):
                return int(entry.name)
        time.sleep(0.2)
    pytest.fail(f"rank {rank} never started")


def wait_past_setup(pid: int, timeout: float, stop=None) -> bool:
    """Until the rank's status page (in its job folder) names a phase after setup: mid-run
    (True). False when `stop()`, given, says so first (the launch ended or went wrong)."""
    env = environ(pid) or {}
    rank = next((env[v.encode()] for v in RANK_VARS if v.encode() in env), b"0").decode()
    status = Path(env[b"SCALELAB_JOB_DIR"].decode()) / f"rank{rank}.status"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if status.exists() and status.read_bytes().split()[3:4] not in ([], [b"setup"]):
            return True
        if stop is not None and stop():
            return False
        time.sleep(0.1)
    pytest.fail("the rank never entered a phase")
