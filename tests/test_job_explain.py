"""The one line explaining a failed launcher job (orchestration/jobs.explain), from a job
folder written as the ranks write it (status pages, notes) and the launcher text as MPICH's
hydra prints it. The real kill under mpiexec and torchrun is in test_cli_ranks; here the
races it meets at random are laid out one by one."""

from __future__ import annotations

import pytest

from scalelab.comm.job_status import STATUS_BYTES
from scalelab.orchestration.jobs import explain

PIDS = {0: 4100, 1: 4101, 2: 4102}
BEAT, ENDED = 1000.0, 1000.5  # the ranks' last phase change; the launcher's end
# rank 0's MPI_Wait reading from rank 1's memory after rank 1 was killed (ESRCH)
MPI_PEER_GONE = (
    "scalelab run: internal error: Exception: Other MPI error, error stack: "
    "internal_Wait(105).....: MPI_Wait(request=0x7f14, status=0x1) failed "
    "MPIDI_CMA_copy_data(68):  copy_iovs(224).........: process_vm_readv failed (errno 3) "
    "(a bug: please report it; SCALELAB_DEBUG=1: traceback)"
)
EXIT_STRING = "YOUR APPLICATION TERMINATED WITH THE EXIT STRING:"
ABORT = (
    "Abort(3) on node 0 (rank 0 in comm 0): application called "
    "MPI_Abort(MPI_COMM_WORLD, 3) - process 0"
)


def box(pid: int, code: int) -> list[str]:
    """MPICH hydra's BAD TERMINATION box (pmiserv_cb.c), as jobs._pump keeps it back."""
    return [
        "=" * 83,
        "=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES",
        f"=   PID {pid} RUNNING AT nodeA",
        f"=   EXIT CODE: {code}",
        "=   CLEANING UP REMAINING PROCESSES",
        "=   YOU CAN IGNORE THE BELOW CLEANUP MESSAGES",
        "=" * 83,
    ]


def job(tmp_path, ranks: int, notes: dict[int, tuple[int, str]]):
    """A job folder: every rank's status page (in phase halo) and the notes given."""
    for rank in range(ranks):
        line = f"{PIDS[rank]} nodeA {BEAT:.3f} halo".encode().ljust(STATUS_BYTES)
        (tmp_path / f"rank{rank}.status").write_bytes(line)
    for rank, (code, text) in notes.items():
        (tmp_path / f"note.rank{rank}").write_text(f"{code}\n{text}")
    return tmp_path


def test_a_killed_rank_is_named_when_mpich_boxes_it_without_the_exit_string(tmp_path):
    """Rank 1 killed; rank 0's MPI_Wait fails on it and its MPI_Abort ends mpiexec after the
    box but before "EXIT STRING: Killed (signal 9)": the box's EXIT CODE is the signal."""
    folder = job(tmp_path, 2, {0: (3, MPI_PEER_GONE)})
    out = explain(folder, [ABORT, *box(PIDS[1], 9)], 3, ENDED, "mpi")
    assert (out.code, out.message) == (
        1,
        "scalelab: rank 1 on nodeA died (signal 9) during halo; job aborted after 0.5 s",
    )


@pytest.mark.parametrize("ranks, named", [(2, "rank 0 or 1"), (3, "one of ranks 0-2")])
def test_ranks_killed_at_once_are_named_together_not_the_lowest_alone(tmp_path, ranks, named):
    """Rank 1 killed while the others compute (no MPI call to fail in, so no line of their
    own): hydra's proxy SIGKILLs them at once and boxes the lowest rank it killed, rank 0.
    Naming rank 0 would be a guess; the line names every rank that may have died first."""
    folder = job(tmp_path, ranks, {})
    captured = [*box(PIDS[0], 9), f"{EXIT_STRING} Killed (signal 9)"]
    out = explain(folder, captured, 9, ENDED, "mpi")
    assert (out.code, out.message) == (
        1,
        f"scalelab: {named} on nodeA died (signal 9) during halo; the launcher killed the "
        "others at once, so which died first is unknown; job aborted after 0.5 s",
    )


def test_a_rank_boxed_by_rank_number_is_named_with_its_signal(tmp_path):
    """MPICH 3/4 and Intel MPI box the killed rank by number, with "KILLED BY SIGNAL"."""
    folder = job(tmp_path, 2, {0: (3, MPI_PEER_GONE)})
    captured = [
        "=" * 83,
        "=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES",
        f"=   RANK 1 PID {PIDS[1]} RUNNING AT nodeA",
        "=   KILLED BY SIGNAL: 9 (Killed)",
        "=" * 83,
    ]
    out = explain(folder, captured, 9, ENDED, "mpi")
    assert (out.code, out.message) == (
        1,
        "scalelab: rank 1 on nodeA died (signal 9) during halo; job aborted after 0.5 s",
    )


def test_a_rank_that_vanished_unreported_is_named_over_the_peer_it_broke(tmp_path):
    """The same race, earlier: rank 0's MPI_Abort ends mpiexec before hydra saw the kill, so
    MPICH prints only the Abort line. The rank with no line is named; no signal is known."""
    folder = job(tmp_path, 2, {0: (3, MPI_PEER_GONE)})
    out = explain(folder, [ABORT], 3, ENDED, "mpi")
    assert (out.code, out.message) == (
        1,
        "scalelab: rank 1 on nodeA died during halo; job aborted after 0.5 s",
    )


def test_a_rank_that_vanished_is_named_over_an_mpi_error_naming_no_cause(tmp_path):
    """Seen in CI: rank 1 SIGKILLed while rank 0 waited in a halo exchange; rank 0's Waitall
    raised MPI_ERR_IN_STATUS, whose text names no cause, and its MPI_Abort ended mpiexec
    before hydra saw the kill. The silent rank is named (it was an internal error, exit 3)."""
    line = "scalelab run: failed: MPI: See the MPI_ERROR field in MPI_Status for the error code"
    folder = job(tmp_path, 2, {0: (1, line)})
    captured = ["MPICH: Builtin communicator 44000000 has pending 1 references.", ABORT]
    out = explain(folder, captured, 1, ENDED, "mpi")
    assert (out.code, out.message) == (
        1,
        "scalelab: rank 1 on nodeA died during halo; job aborted after 0.5 s",
    )


@pytest.mark.parametrize(
    "ranks, notes, captured, launcher, expected",
    [
        # rank 0's own bug: rank 1 is silent only because MPI_Abort's cleanup killed it
        (2, {0: (3, "scalelab run: internal error: KeyError: 'w'")}, [ABORT], "mpi", 0),
        # rank 1 left its own line: the box's "EXIT CODE: 1" (an older hydra) is its exit
        (2, {1: (1, "scalelab run: failed: out of memory: x")}, box(PIDS[1], 1), "mpi", 1),
        # two silent ranks: which one vanished first is unknown, rank 0's line stands
        (3, {0: (3, MPI_PEER_GONE)}, [ABORT], "mpi", 0),
        # torchrun's reading is its own failure summary (unchanged here)
        (2, {0: (3, MPI_PEER_GONE)}, [], "torchrun", 0),
    ],
    ids=["own-bug", "own-line", "two-silent", "torchrun"],
)
def test_a_ranks_own_line_stands_when_no_rank_was_killed_unreported(
    tmp_path, ranks, notes, captured, launcher, expected
):
    folder = job(tmp_path, ranks, notes)
    out = explain(folder, captured, 3, ENDED, launcher)
    assert (out.code, out.message) == notes[expected]


def torchrun_summary(*entries: tuple[int, int]) -> list[str]:
    """torchrun's failure summary (elastic/multiprocessing/errors), (rank, exitcode) each,
    the last under "Root Cause"."""
    lines = ["Failures:"]
    for i, (rank, code) in enumerate(entries):
        if i == len(entries) - 1:
            lines += ["-" * 60, "Root Cause (first observed failure):"]
        lines += [f"[{i}]:", "  host      : nodeA", f"  rank      : {rank} (local_rank: {rank})",
                  f"  exitcode  : {code} (pid: {PIDS[rank]})", "  error_file: <N/A>"]  # fmt: skip
    return lines


def test_torchruns_sigterm_of_a_survivor_never_stands_for_the_cause(tmp_path):
    """Rank 1 raised (its own line) and exited 1; torchrun SIGTERM'd rank 0 and, with no
    error files, named rank 0 as the root cause: rank 1's line is the one printed."""
    line = "scalelab run: rank 1 failed: RuntimeError: gloo: Pair is not connected"
    folder = job(tmp_path, 2, {1: (1, line)})
    out = explain(folder, torchrun_summary((1, 1), (0, -15)), 1, ENDED, "torchrun")
    assert (out.code, out.message) == (1, line)


def test_a_refusal_comes_before_a_killed_rank(tmp_path):
    folder = job(tmp_path, 2, {0: (2, "scalelab run: error: --halo 9 is thicker than a slab")})
    captured = [
        *box(PIDS[1], 9),
        f"{EXIT_STRING} Killed (signal 9)",
    ]
    out = explain(folder, captured, 9, ENDED, "mpi")
    assert (out.code, out.message) == (2, "scalelab run: error: --halo 9 is thicker than a slab")


# MPICH over OFI/tcp when the allreduce's peer was SIGKILLed (seen under srun --mpi=pmi2):
# mpi4py's text is cut at MPI_MAX_ERROR_STRING before any cause is named.
MPI_CUT = (
    "Exception: Other MPI error, error stack:\ninternal_Allreduce_c(342)......: "
    "MPI_Allreduce_c(sendbuf=MPI_IN_PLACE, count=8192, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD) "
    "failed\nMPID_Allreduce(483)......: \nMPIR_Allreduce_allcomm_auto(4817)......"
)


@pytest.mark.parametrize(
    ("error", "launched", "left_to_launcher"),
    [
        (MPI_PEER_GONE, True, True),
        (MPI_CUT, True, True),  # two records in one srun study before: the rank's and the watcher's
        (MPI_CUT, False, False),  # no launcher or watcher to write it: the rank does
        ("MPI: See the MPI_ERROR field in MPI_Status for the error code", True, True),
        ("MPI_ERR_IN_STATUS: error code in status", True, True),  # Open MPI's words
        ("ValueError: shapes (4, 3) and (2, 3) do not match", True, False),
    ],
)
def test_which_rank_failures_the_launching_side_records(
    monkeypatch, tmp_path, error, launched, left_to_launcher
):
    from scalelab.comm.job_status import JOB_DIR_VAR, launcher_records

    if launched:
        monkeypatch.setenv(JOB_DIR_VAR, str(tmp_path))
    else:
        monkeypatch.delenv(JOB_DIR_VAR, raising=False)
    assert launcher_records(error) is left_to_launcher


def test_a_line_said_before_a_cancel_waits_until_its_pipe_is_read(tmp_path):
    """jobs.until_read: a watcher's last line must leave its pipe (for slurmstepd, then srun)
    before it cancels its step. It waits while the pipe holds unread bytes, up to its bound;
    returns at once once they are read, and for a file (no pipe to wait on)."""
    import os
    import time

    from scalelab.orchestration.jobs import until_read

    read_end, write_end = os.pipe()
    with os.fdopen(write_end, "w") as out:
        out.write("scalelab: rank 1 on n2 died (signal 9)\n")
        out.flush()
        t0 = time.monotonic()
        until_read(out, most_s=0.3)
        assert time.monotonic() - t0 >= 0.3  # nobody read it: waited the whole bound
        os.read(read_end, 100)
        t0 = time.monotonic()
        until_read(out, most_s=5.0)
        assert time.monotonic() - t0 < 1.0  # read: at once
    os.close(read_end)
    with open(tmp_path / "f", "w") as f:
        f.write("x")
        t0 = time.monotonic()
        until_read(f, most_s=5.0)
        assert time.monotonic() - t0 < 1.0
