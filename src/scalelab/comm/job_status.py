"""A launched job's rank side: the status page each rank keeps in the job folder
(SCALELAB_JOB_DIR) and the one line it hands to the launching process.

Each rank keeps a small status file there: its pid, host and the phase it is in (one write
into a memory-mapped page per phase: it survives the rank's death and costs no syscall). A
rank that refuses the configuration, or fails, writes its one line there instead of printing
it. The launching side (orchestration/jobs.py) reads both when the job ends badly.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import socket
import time
from pathlib import Path

JOB_DIR_VAR = "SCALELAB_JOB_DIR"
RANK_VARS = ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID")
STATUS_BYTES = 256
RECORD_FILE = "record.json"
CHECK_FAILED = ": check failed: "  # in the one line of a run whose check failed (exit 1)
_beacon: mmap.mmap | None = None
# A rank's failure that a vanished peer caused: MPICH's shared-memory copy from a process
# that no longer exists (process_vm_readv: errno 3, ESRCH), or a socket the peer's death
# closed (ch3 and ofi over tcp, UCX, gloo).
PEER_GONE = re.compile(
    r"errno 3\b|No such process|reset by (remote )?peer|closed by peer|Broken pipe"
    r"|Communication error with rank|Socket closed",
    re.I,
)
# An MPI library's error (mpi4py's MPI.Exception: "Other MPI error, error stack: ..."): its
# text is cut at MPI_MAX_ERROR_STRING, often before the cause (MPICH over OFI/tcp when the peer
# of an allreduce was SIGKILLed), so it cannot tell a dead peer from its own fault. A
# Waitall whose receives failed says only MPI_ERR_IN_STATUS (MPICH: "See the MPI_ERROR field
# in MPI_Status for the error code"; Open MPI: "MPI_ERR_IN_STATUS: error code in status"),
# as rank 0's halo exchange did when rank 1 was SIGKILLed.
MPI_ERROR = re.compile(r"\bMPI error, error stack:|MPI_ERROR field in MPI_Status|MPI_ERR_IN_STATUS")


# --- the rank's side -----------------------------------------------------------------------
def this_rank() -> int:
    return next((int(os.environ[v]) for v in RANK_VARS if os.environ.get(v, "").isdigit()), 0)


def start_beacon() -> bool:
    """Inside a job scalelab launched: open this rank's status page (True when opened)."""
    global _beacon
    folder = os.environ.get(JOB_DIR_VAR)
    if not folder or _beacon is not None or not Path(folder).is_dir():
        return False
    path = Path(folder) / f"rank{this_rank()}.status"
    with open(path, "wb") as f:
        f.write(b" " * STATUS_BYTES)
    with open(path, "r+b") as f:
        _beacon = mmap.mmap(f.fileno(), STATUS_BYTES)
    beacon("setup")
    return True


def beacon(phase: str) -> None:
    if _beacon is None:
        return
    line = f"{os.getpid()} {socket.gethostname()} {time.time():.3f} {phase}".encode()
    _beacon[:STATUS_BYTES] = line[:STATUS_BYTES].ljust(STATUS_BYTES)


def report(line: str, code: int) -> bool:
    """A rank's one line for the user, handed to the launching process (True) when there is
    one; the caller prints it itself otherwise."""
    folder = os.environ.get(JOB_DIR_VAR)
    if not folder or not Path(folder).is_dir():
        return False
    tmp = Path(folder) / f".note{this_rank()}.{os.getpid()}"
    tmp.write_text(f"{code}\n{line}")
    os.replace(tmp, Path(folder) / f"note.rank{this_rank()}")
    return True


# How long a failed rank under a watcher or launcher waits before it aborts the job. Its
# failure may be a peer's death (a halo exchange with a rank SIGKILLed under srun): MPICH's
# MPI_Abort goes through PMI and Slurm SIGKILLs every task at once, the dead rank's watcher
# with them, before it said who died (1 CI run in 3 on a loaded 2-core host said nothing).
# The dead rank's side names it and cancels the step well inside this; a rank that failed
# alone ends this much later.
PEER_NAMES_S = 3.0


def before_abort(code: int) -> None:
    """A reported failure's pause before the abort (PEER_NAMES_S): refusals (2) go at once,
    every rank refuses alike."""
    if code != 2 and os.environ.get(JOB_DIR_VAR):
        time.sleep(PEER_NAMES_S)


def is_check_failure(line: str) -> bool:
    """A rank's line saying the run finished and its check failed: no rank died."""
    return CHECK_FAILED in line


def launcher_records(error: str) -> bool:
    """A failure a dead peer caused, in a job scalelab launched or watches: the launching
    side names the dead rank and writes the one record of the job, not this rank. An MPI
    library's error is left to it too: its launcher or watcher names the dead rank if there is
    one, and records this rank's line if not."""
    if not os.environ.get(JOB_DIR_VAR):
        return False
    return may_blame_a_peer(error)


def may_blame_a_peer(error: str) -> bool:
    """The error says a peer vanished, or is the MPI library's own (which may be one)."""
    return PEER_GONE.search(error) is not None or MPI_ERROR.search(error) is not None


def hand_over_record(record: dict) -> bool:
    """The root rank's record, for the launching process to print (True) when there is one:
    under --json only it writes stdout, so stdout stays one JSON document."""
    folder = os.environ.get(JOB_DIR_VAR)
    if not folder or not Path(folder).is_dir():
        return False
    tmp = Path(folder) / f".record.{os.getpid()}"
    tmp.write_text(json.dumps(record))
    os.replace(tmp, Path(folder) / RECORD_FILE)
    return True
