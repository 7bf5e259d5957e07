"""A rank that srun started, watched from its own task: who died, where, of what, when.

Under `srun -n N scalelab run ...` srun is the launcher and nothing of scalelab outlives a
killed rank: srun prints `task 1: Killed` and keeps waiting, while the other ranks wait in
their halo exchange or collective for ever (MPICH over pmi2 does not notice the peer is gone).
So each srun task keeps a thin parent (the task srun sees) that runs the rank as its one child
with the task's environment and file descriptors unchanged (PMI_FD included), and waits:

- the child killed by a signal: the parent prints the dead-rank line (`scalelab: rank 1 on n2
  died (signal 9) during halo; job aborted after 0.8 s`, phase from the child's status page),
  appends the `failed` record, and ends the step with `scancel JOB.STEP` so no rank hangs;
- the child's one line (a refusal, a failure) comes to the parent as a note, as under
  mpiexec: a refusal (every rank refuses alike) is printed by task 0 only;
- the parent itself signalled (scancel, a time limit, the step ended by a dead peer): quiet;
  so is a child that aborted (SIGABRT) or failed because a peer died, once the dead rank's
  task cancels the step (PEER_GRACE_S).

The parent does not start ranks (srun did); it is what torchrun's per-node agent is to its
workers, for one worker.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from scalelab.comm import job_status, slurm
from scalelab.comm.launch import inside_torchrun
from scalelab.orchestration import jobs

if TYPE_CHECKING:
    from collections.abc import Callable

    from scalelab.config import RunConfig

CHILD_VAR = "SCALELAB_SRUN_CHILD"
BATCH_RECORDS_VAR = "SCALELAB_BATCH_RECORDS"  # set by generated sbatch scripts
PEER_GRACE_S = 3.0
CONT_WAIT_S = 2.0  # scancel's SIGTERM after its SIGCONT
# A node agent whose ranks failed without a signal waits this long for the agent of the node
# where a rank was killed to name it and cancel the step (torchrun notices a dead worker,
# stops its others and reports: seconds).
AGENT_GRACE_S = 20.0
FORWARD_S = 1.0  # a stop signal goes on to the launcher when its ranks still run this later
WATCHED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCONT)


def should_watch(launcher: str | None) -> bool:
    """A multi-rank strategy started by srun as one of several tasks, not yet watched (and
    not a rank of a launcher scalelab started itself)."""
    return (
        launcher is not None
        and slurm.srun_launched()
        and CHILD_VAR not in os.environ
        and job_status.JOB_DIR_VAR not in os.environ
        and not os.environ.get("SCALELAB_LAUNCHED")
    )


def watch(argv: list[str], cfg: RunConfig, results: Path | None) -> tuple[int, dict | None]:
    """Run `scalelab ARGV` as this task's rank: (the task's exit code, the record the rank
    handed over: task 0's)."""
    folder = tempfile.mkdtemp(prefix="scalelab-task-")
    env = {**os.environ, CHILD_VAR: "1", job_status.JOB_DIR_VAR: folder}
    stopped: list[int] = []
    previous = {s: signal.signal(s, lambda n, _f: stopped.append(n)) for s in WATCHED}
    before = _lines(results)
    _prepare_record()
    try:
        # The child gets Slurm's signals itself (the step's processes are all signalled).
        cmd = [sys.executable, "-m", "scalelab", *argv]
        # The rank dies with its watcher (SIGKILL on the watcher's death): a killed task
        # leaves no rank behind it, running on after scancel.
        child = subprocess.Popen(
            cmd, env=env, close_fds=False, preexec_fn=jobs.dies_with_parent(signal.SIGKILL)
        )
        code = child.wait()
        ended = time.time()
        outcome = _outcome(Path(folder), code, ended, stopped, cfg, results, before)
        return outcome, jobs.handed_record(Path(folder))
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        shutil.rmtree(folder, ignore_errors=True)


def _outcome(
    folder: Path,
    code: int,
    ended: float,
    stopped: list[int],
    cfg: RunConfig,
    results: Path | None,
    before: int = 0,
) -> int:
    rank = job_status.this_rank()
    if code == 0:
        return 0
    if stopped:  # scancel, a time limit, or a dead peer's task ended the step: not ours to say
        return _stopped(stopped, rank == 0, cfg, results, before)
    if code == -signal.SIGABRT:
        # An MPI library aborting because a peer vanished (UCX's shared-memory copy from a
        # killed peer: "process_vm_readv ... No such process"): the dead rank's task is
        # cancelling the step; a rank that aborted on its own still gets named below.
        _wait_for(stopped, PEER_GRACE_S)
        if stopped:
            return _stopped(stopped, rank == 0, cfg, results, before)
    if code < 0:
        host = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
        line = jobs.dead_line((rank, host, -code), jobs.statuses(folder), ended)
        _say(line)
        if results is not None:
            _record(cfg, results, line)
        _end_step()
        return 1
    notes = jobs.notes(folder)
    if notes and notes[0][0] != 2 and not job_status.is_check_failure(notes[0][1]):
        # A rank that failed because a peer died (gloo's "connection closed"): the dead
        # rank's task is cancelling the step and says why; give its signal time to come.
        _wait_for(stopped, PEER_GRACE_S)
        if stopped:
            return _stopped(stopped, rank == 0, cfg, results, before)
    if notes and (notes[0][0] != 2 or rank == 0):
        _say(notes[0][1])
    if (
        notes
        and notes[0][0] != 2
        and rank == 0
        and results is not None
        and _lines(results) == before
    ):
        _record(cfg, results, notes[0][1])  # the ranks left it to us: a peer vanished unnamed
    return code


def _stopped(
    stopped: list[int], task0: bool, cfg: RunConfig, results: Path | None, before: int
) -> int:
    """Slurm stopped the step (scancel, a time limit) or a dead rank's task cancelled it. The
    step's one record: the dead rank's, written before it cancelled, else task 0 writes that
    Slurm stopped it (an interactive srun has no batch script to say so)."""
    code = stop_code(stopped)
    if os.environ.get(BATCH_RECORDS_VAR):  # a generated job's script records it (run_point)
        return code
    if task0 and results is not None and _lines(results) == before:
        step = f"{os.environ.get('SLURM_JOB_ID')}.{os.environ.get('SLURM_STEP_ID')}"
        cause = slurm.stop_cause(slurm.job_info(os.environ.get("SLURM_JOB_ID", "")))
        _record(cfg, results, f"step {step} was stopped by Slurm ({cause})")
    return code


def stop_code(stopped: list[int]) -> int:
    """128 + the signal that stopped the task. scancel sends SIGCONT before SIGTERM (a stopped
    task must wake to die): the SIGTERM that follows is the cause, so wait a moment for it."""
    if all(s == signal.SIGCONT for s in stopped):
        end = time.monotonic() + CONT_WAIT_S
        while all(s == signal.SIGCONT for s in stopped) and time.monotonic() < end:
            time.sleep(0.05)
    cause = next((s for s in stopped if s != signal.SIGCONT), stopped[0])
    return 128 + int(cause)


def _wait_for(stopped: list[int], seconds: float) -> None:
    end = time.monotonic() + seconds
    while not stopped and time.monotonic() < end:
        time.sleep(0.05)


def _say(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _end_step() -> None:
    """The other ranks would wait for the dead one for ever: cancel this step (its tasks get
    SIGTERM, then SIGKILL after KillWait)."""
    step = f"{os.environ.get('SLURM_JOB_ID')}.{os.environ.get('SLURM_STEP_ID')}"
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        subprocess.run(["scancel", "--quiet", step], capture_output=True, timeout=60)


# --- torchrun under srun: one agent per node ------------------------------------------------
def is_node_agent(launcher: str | None, nnodes: int) -> bool:
    """`srun --ntasks-per-node=1 scalelab run ... --nnodes N`: this task starts this node's
    torchrun (it is not a rank, and takes no rank from Slurm)."""
    return launcher == "torchrun" and nnodes > 1 and slurm.srun_launched() and not inside_torchrun()


def agent(
    start: Callable[[], jobs.JobOutcome], cfg: RunConfig, results: Path | None
) -> tuple[int, dict | None]:
    """Run this node's launcher (start(), which prints nothing: torchrun, or mpiexec for a
    one-task step's ranks) and end as the step should: the node where a rank died names it
    once, records it and cancels the step; the others stay quiet once stopped; a refusal is
    said by task 0 only; a stop (scancel, the time limit) goes on to the launcher, which
    stops its ranks, and is recorded with its cause; nothing waits without bound."""
    stopped: list[int] = []

    def stop(n: int, _frame) -> None:
        stopped.append(n)
        if n in (signal.SIGTERM, signal.SIGINT):
            threading.Timer(FORWARD_S, _forward, (n,)).start()

    previous = {s: signal.signal(s, stop) for s in WATCHED}
    before = _lines(results)
    _prepare_record()
    try:
        outcome = start()
        return _agent_outcome(outcome, stopped, cfg, results, before), outcome.record
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _forward(sig: int) -> None:
    """A stop that reached this task alone (`kill` of it; scancel and the time limit signal
    every process of the step, and the ranks, which keep no handler, are gone by now): send
    it on to the launcher, which stops its ranks. Not at once: a second SIGTERM while
    torchrun stops its workers breaks its shutdown into a traceback."""
    launchers = _children(os.getpid())
    if any(_children(pid) for pid in launchers):
        for pid in launchers:
            with contextlib.suppress(OSError):
                os.kill(pid, sig)


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError, ValueError):
            out += [int(p) for p in (task / "children").read_text().split()]
    return out


def _agent_outcome(outcome, stopped, cfg, results, before: int) -> int:
    task0 = os.environ.get("SLURM_PROCID", "0") == "0"
    alone = slurm.step_tasks() == 1  # no peer task to name a death or cancel the step
    if outcome.code == 0:
        return 0
    if stopped:
        return _stopped(stopped, task0, cfg, results, before)
    if outcome.code == 2:  # every node's ranks refused alike
        if task0:
            _say(outcome.message)
        return 2
    if not outcome.killed and not alone:  # a peer's death, most likely: its agent says it
        _wait_for(stopped, AGENT_GRACE_S)
        if stopped:
            return _stopped(stopped, task0, cfg, results, before)
    line = outcome.message
    node = os.environ.get("SLURMD_NODENAME")
    if outcome.killed and node:  # torchrun names the host by its own name, not Slurm's node
        line = re.sub(r" on \S+ died", f" on {node} died", line, count=1)
    _say(line)
    if results is not None and (outcome.killed or (task0 and _lines(results) == before)):
        _record(cfg, results, line)
    if not alone:
        _end_step()
    return outcome.code


def _lines(path: Path | None) -> int:
    return len(path.read_bytes().splitlines()) if path is not None and path.exists() else 0


def _prepare_record() -> None:
    """A failed record's slow parts (the environment, the git commit: subprocesses), made in
    a thread while the rank runs: a peer's MPICH may abort the step through PMI the moment
    this rank dies, and Slurm then SIGKILLs this task too; the record must be written by then."""
    threading.Thread(target=_cache_record_parts, daemon=True).start()


def _cache_record_parts() -> None:
    from scalelab import environment, record  # noqa: F401  (imported ahead, as the two below)

    environment.collect()  # both cached for the record
    environment.git_commit()


def _record(cfg: RunConfig, results: Path, line: str) -> None:
    from scalelab.record import append_record, failed_record

    append_record(results, failed_record(cfg, line.removeprefix("scalelab: ")))
