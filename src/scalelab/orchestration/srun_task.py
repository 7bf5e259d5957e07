"""A rank that srun started, watched from its own task: who died, where, of what, when.

Under `srun -n N scalelab run ...` srun prints `task 1: Killed` for a killed rank and waits,
while the others wait in their halo exchange or collective for ever. So each srun task keeps
a thin parent (the task srun sees) running the rank as its one child, environment and file
descriptors unchanged (PMI_FD included), and waits:
- the child killed by a signal: the parent says the dead-rank line (`scalelab: rank 1 on n2
  died (signal 9) during halo; job aborted after 0.8 s`, the phase from the child's status
  page), appends the `failed` record and ends the step (`scancel JOB.STEP`);
- the child's one line (a refusal, a failure) comes as a note, as under mpiexec; a refusal
  (every rank refuses alike) is said by task 0 only;
- the parent itself signalled (scancel, a time limit, a dead peer's cancel), or a child that
  aborted or failed because a peer died, once that peer's task cancels the step
  (PEER_GRACE_S): quiet, the MPI library's own abort stack kept back;
- a peer task on this node killed (nobody left to name its rank): its node's parents watch
  each other's folders and the step's tasks, and one names it, records it and cancels.

A one-task step that starts its own ranks (`srun -n1 scalelab run ... --ranks 2`) runs its
launcher under `agent`, as a node's torchrun: a stop is passed on, recorded and exits 143.
The parent starts no rank (srun did): it is to its rank what torchrun's agent is to a worker.
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

from scalelab.comm import job_status
from scalelab.comm import slurm_env as slurm
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
# MPICH's error stack: `internal_Scatterv_c(149)....: MPI_Scatterv(...) failed`, its abort.
MPI_ABORT = re.compile(r"^\w+\(\d+\)\.*:|Fatal error in |MPI_Abort|OFI poll failed")
PUMP_DRAIN_S = 5.0
PEER_POLL_S = 0.5  # how often a watcher looks for a killed task of its step on its node
SAID_S = 1.0  # a said line's time to reach srun before the step is cancelled
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
    step = _step_folder()
    folder = str(step / f"task{job_status.this_rank()}.{os.getpid()}")
    os.mkdir(folder)
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
            cmd,
            env=env,
            close_fds=False,
            stderr=subprocess.PIPE,
            preexec_fn=jobs.dies_with_parent(signal.SIGKILL),
        )
        held: list[str] = []
        pump = threading.Thread(target=_pump, args=(child.stderr, held), daemon=True)
        pump.start()
        code = _wait_watching_peers(child, step, stopped, cfg, results)
        ended = time.time()
        if code is None:  # a peer task died: named, recorded, the step cancelled; our rank
            _clean(step, Path(folder))  # first: its PMI abort may SIGKILL this task at once
            child.kill()  # waits for the dead one (in MPI_Init it may not heed a SIGTERM)
            child.wait()
            return (stop_code(stopped) if stopped else 1), None
        if code > 0:  # a failure: what the pump held back may be all that explains it
            pump.join(timeout=PUMP_DRAIN_S)
            if not stopped and not jobs.notes(Path(folder)):
                _say("".join(held).rstrip("\n"))
        # a killed rank is named here before anything waits: a peer's PMI abort may SIGKILL
        # this task the moment the rank died (_name); the drain came first once, and on 2 busy
        # cores neither the line nor the record got written
        outcome = _outcome(Path(folder), code, ended, stopped, cfg, results, before)
        pump.join(timeout=PUMP_DRAIN_S)  # the rank's last lines on their way to srun
        return outcome, jobs.handed_record(Path(folder))
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        _clean(step, Path(folder))


def _clean(step: Path, folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)
    for marker in step.glob("named*"):  # a dead peer's: the step is over
        with contextlib.suppress(OSError):
            marker.unlink()
    with contextlib.suppress(OSError):
        step.rmdir()  # the last task of the step on this node


def _pump(source, held: list[str]) -> None:
    """The rank's stderr on to this task's, but for its MPI library's abort (a peer's death
    makes it; the dead rank's watcher names it): `held` keeps it for a failure nobody explains."""
    for raw in iter(source.readline, b""):
        line = raw.decode(errors="replace")
        if MPI_ABORT.search(line) or any(p.search(line) for p in jobs.NOISE):
            held.append(line)
        else:
            with contextlib.suppress(OSError, ValueError):
                sys.stderr.write(line)
                sys.stderr.flush()


# --- the step's tasks on this node watch each other ------------------------------------------
# Each watcher keeps its rank's folder at STEP_DIR/task<RANK>.<WATCHER PID> and removes it when
# it ends, however its rank ended. A folder whose watcher is gone was left by a task that was
# killed (the task srun started, SIGKILLed: its rank dies with it): its peers, waiting in
# MPI_Wait or MPI_Init over shared memory, would never notice. A watcher on the same node
# does, names it from the folder's status page, records it and cancels the step.
def _step_folder() -> Path:
    job, step = os.environ.get("SLURM_JOB_ID", "0"), os.environ.get("SLURM_STEP_ID", "0")
    path = Path(tempfile.gettempdir()) / f"scalelab-step-{job}.{step}"
    path.mkdir(mode=0o700, exist_ok=True)
    return path


def _wait_watching_peers(
    child, step: Path, stopped: list[int], cfg: RunConfig, results: Path | None
) -> int | None:
    """The child's exit code, or None when a peer task on this node died first (said here).
    Once Slurm stops the step (`stopped`), peers ending is expected: no longer looked for."""
    peers = {int(t) for t in os.environ.get("SLURM_GTIDS", "").split(",") if t.isdigit()}
    peers.discard(job_status.this_rank())
    seen: set[int] = set()  # peers whose folder this watcher saw: they ended as they should
    while True:
        with contextlib.suppress(subprocess.TimeoutExpired):
            return child.wait(timeout=PEER_POLL_S)
        if stopped or not peers:
            continue
        dead = _dead_peer(step, peers, seen)
        if dead is not None and _claim(step, dead[0]):
            _say_dead_peer(dead, cfg, results)
            return None


def _dead_peer(step: Path, peers: set[int], seen: set[int]) -> tuple[int, Path | None] | None:
    """(rank, folder) of a killed peer task on this node: its watcher gone, its folder left,
    or (killed before it made one) gone from the step's tasks here."""
    for folder in step.glob("task*.*"):
        rank, _, pid = folder.name[len("task") :].partition(".")
        if rank.isdigit() and pid.isdigit():
            seen.add(int(rank))
            if not _alive(int(pid)) and folder.exists():  # a watcher removes it on its way out
                return int(rank), folder
    if not peers - seen:  # every peer made its folder: the folders say it all
        return None
    running = _step_tasks_here()
    gone = sorted(peers - seen - running) if running else []
    return (gone[0], None) if gone else None


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0] not in "ZX"
    except (OSError, IndexError):
        return False


def _step_tasks_here() -> set[int]:
    """The step's tasks still running on this node (their global ranks; empty when scontrol
    cannot say)."""
    step = f"{os.environ.get('SLURM_JOB_ID')}.{os.environ.get('SLURM_STEP_ID')}"
    try:
        out = subprocess.run(
            ["scontrol", "listpids", step], capture_output=True, text=True, timeout=20
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return set()
    rows = [line.split() for line in out.splitlines()[1:]]
    return {int(r[4]) for r in rows if len(r) == 5 and r[4].isdigit()}


def _claim(step: Path, rank: int) -> bool:
    """One watcher names a dead peer: the one that creates its marker."""
    with contextlib.suppress(OSError):
        os.close(os.open(step / f"named{rank}", os.O_CREAT | os.O_EXCL))
        return True
    return False


def _say_dead_peer(dead: tuple[int, Path | None], cfg: RunConfig, results: Path | None) -> None:
    rank, folder = dead
    status = jobs.statuses(folder) if folder is not None else {}
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
    _name(jobs.dead_line((rank, _node(), None), status, time.time(), vanished=True), cfg, results)


def _node() -> str:  # this node as Slurm names it (as srun -w takes it), else the host's
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


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
        _name(_dead_line(folder, code, ended), cfg, results)
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


def _dead_line(folder: Path, code: int, ended: float) -> str:
    """This task's rank, killed by signal -code: who, where, of what, in which phase."""
    return jobs.dead_line((job_status.this_rank(), _node(), -code), jobs.statuses(folder), ended)


def _name(line: str, cfg: RunConfig, results: Path | None) -> None:
    """A death said and recorded first (a few ms: a peer's MPI library may abort the step
    through PMI the moment the rank died, and Slurm SIGKILLs every task), then the wait for
    slurmstepd to take the line (jobs.until_read) and the cancel."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
    if results is not None:
        _record(cfg, results, line)
    jobs.until_read(sys.stderr)
    _end_step()


def _say(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
    jobs.until_read(sys.stderr)


def _end_step() -> None:
    """The other ranks would wait for the dead one for ever: cancel this step (SIGTERM, then
    SIGKILL after KillWait), SAID_S after the line said: slurmstepd forwards it on its own time."""
    step = f"{os.environ.get('SLURM_JOB_ID')}.{os.environ.get('SLURM_STEP_ID')}"
    time.sleep(SAID_S)
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
            later = threading.Timer(FORWARD_S, _forward, (n,))
            later.daemon = True  # the task may end first: nothing left to pass it to
            later.start()

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
    launchers = jobs.child_pids(os.getpid())
    if any(jobs.child_pids(pid) for pid in launchers):
        for pid in launchers:
            with contextlib.suppress(OSError):
                os.kill(pid, sig)


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
