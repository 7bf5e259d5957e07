"""A launched job, seen from the process that launched it (`scalelab run --ranks N`).

It gives the job a folder (SCALELAB_JOB_DIR) where each rank keeps its status page and
its one line (comm/job_status.py). When the launcher ends badly, it prints exactly one line:
the first rank's refusal (exit 2), a rank's failure (its code), or the rank that died, on
which host, of which signal, in which phase (`scalelab: rank 1 on HOST died (signal 9) during
halo; job aborted after 0.8 s`). The launchers' own banners (torchrun's ChildFailedError
traceback, MPICH's BAD TERMINATION box, MPI_Abort lines) are read for the facts and not
forwarded.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from scalelab.comm.job_status import (
    JOB_DIR_VAR,
    RECORD_FILE,
    is_check_failure,
    may_blame_a_peer,
)
from scalelab.comm.launch import die_with_parent, mpiexec_command, torchrun_command


def child_pids(pid: int) -> list[int]:
    """pid's child processes; none once it has ended, even while its /proc entry is read (a
    launcher ending there raised out of the forwarding timer: a traceback on stderr)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    out = []
    for task in tasks:
        with contextlib.suppress(OSError, ValueError):
            out += [int(p) for p in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
    return out


def dies_with_parent(sig: int = signal.SIGKILL):
    """A Popen preexec_fn: the child gets `sig` when the process that started it dies, so a
    killed watcher or launcher leaves no rank running behind it."""
    parent = os.getpid()
    return lambda: die_with_parent(sig, parent)


def handed_record(folder: Path) -> dict | None:
    path = folder / RECORD_FILE
    return json.loads(path.read_text()) if path.exists() else None


# --- the launching side --------------------------------------------------------------------
NOISE = [
    re.compile(p)
    for p in (
        r"^[IWEDF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ ",  # torch's glog-style lines
        r"^\*{10,}\s*$",
        r"^Setting OMP_NUM_THREADS environment variable",
        r"^=+\s*$",
        r"^=   ",  # MPICH's BAD TERMINATION box
        r"^YOUR APPLICATION TERMINATED WITH THE EXIT STRING",
        r"^This typically refers to a problem with your application",
        r"^Please see the FAQ page for debugging suggestions",
        r"^Abort\(\d+\) on node \d+",
        r"application called MPI_Abort",
        r"^\[(proxy|mpiexec)[:@]",
        r"^\[unset\]:",
        r"^(prterun|mpirun|mpiexec|[a-z]+run) noticed that process rank",
        r"^-{40,}\s*$",
    )
]
PIPE_DRAIN_S = 30.0
TORCH_FAILURE = re.compile(r"^Traceback \(most recent call last\):|ChildFailedError")


@dataclass
class JobOutcome:
    code: int
    message: str | None = None  # the one line printed for a failed job
    captured: list[str] = field(default_factory=list)  # the launcher's lines kept back
    record: dict | None = None  # the record the root rank handed over (hand_over_record)
    killed: bool = False  # a rank of this launcher died of a signal (message names it)


def run_job(cmd: list[str], env: dict[str, str], launcher: str, say: bool = True) -> JobOutcome:
    """Run the launcher command with a job folder; forward the ranks' output, keep back the
    launcher's own, and turn a failure into one line (printed unless `say` is False: the
    caller decides). The launcher gets SIGTERM if this process dies (it stops its ranks)."""
    folder = tempfile.mkdtemp(prefix="scalelab-job-")
    env = {**env, JOB_DIR_VAR: folder}
    try:
        proc = subprocess.Popen(
            cmd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            preexec_fn=dies_with_parent(signal.SIGTERM),
        )
        captured: list[str] = []
        pumps = [
            threading.Thread(target=_pump, args=(proc.stdout, sys.stdout, captured), daemon=True),
            threading.Thread(target=_pump, args=(proc.stderr, sys.stderr, captured), daemon=True),
        ]
        for t in pumps:
            t.start()
        code = proc.wait()
        for t in pumps:  # bounded: a rank outliving its launcher may hold the pipes open
            t.join(timeout=PIPE_DRAIN_S)
        ended = time.time()
        record = handed_record(Path(folder))
        if code == 0:
            return JobOutcome(0, record=record)
        outcome = explain(Path(folder), captured, code, ended, launcher)
        outcome.record = record
        if say:
            sys.stderr.write(outcome.message + "\n")
            sys.stderr.flush()
        return outcome
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _pump(source, sink, captured: list[str]) -> None:
    """Forward lines; launcher lines (and everything after torchrun's failure traceback
    starts) are kept back in captured. Blank lines wait for the next forwarded line, so a
    banner's blank frame is kept back with it."""
    swallowing, blanks = False, 0
    for raw in iter(source.readline, b""):
        line = raw.decode(errors="replace")
        swallowing = swallowing or bool(TORCH_FAILURE.search(line) and _torch_failed(captured))
        if swallowing or any(p.search(line) for p in NOISE):
            captured.append(line.rstrip("\n"))
            blanks = 0
        elif not line.strip():
            blanks += 1
        else:
            _write(sink, "\n" * blanks + line)
            blanks = 0


def _write(sink, text: str) -> None:
    try:
        sink.write(text)
        sink.flush()
    except (BrokenPipeError, ValueError):
        pass


def _torch_failed(captured: list[str]) -> bool:
    """torchrun reported its workers failed, or that it was stopped (its SignalException
    traceback follows: the stop is said by whoever stopped it)."""
    said = ("failed", "death signal")
    return any("torch/distributed/elastic" in c and any(w in c for w in said) for c in captured)


def explain(
    folder: Path, captured: list[str], code: int, ended: float, launcher: str
) -> JobOutcome:
    """The one line: a rank's refusal first (exit 2: every rank refused alike), then a failed
    check (the job finished: the root exited 1 after its record, which torchrun and mpiexec
    report as a rank's exit; nobody died), then a rank killed by a signal (the others'
    failures follow from it), then, under mpiexec, a rank that vanished without a line while
    the others' lines say a peer vanished, then a rank's own failure line, then the rank the
    launcher saw exit, else the launcher's code."""
    said = notes(folder)
    refusals = [n for n in said if n[0] == 2]
    status = statuses(folder)
    # Ranks that left no line: scalelab's own error path always writes one before it exits,
    # so these were killed (or were stopped by the launcher when a peer failed).
    silent = set(status) - {int(p.name[len("note.rank") :]) for p in folder.glob("note.rank*")}
    dead = _dead_rank(captured, status, silent)
    if refusals:
        return JobOutcome(2, refusals[0][1], captured)
    checks = [n for n in said if n[0] == 1 and is_check_failure(n[1])]
    if checks:
        return JobOutcome(1, checks[0][1], captured)
    if dead is not None and dead[2] is not None:
        alike = _killed_alike(dead, status, silent) if launcher == "mpi" else []
        return JobOutcome(1, dead_line(dead, status, ended, alike=alike), captured, killed=True)
    vanished = _vanished_rank(said, silent, status) if launcher == "mpi" else None
    if dead is None and vanished is not None:
        return JobOutcome(1, dead_line(vanished, status, ended, vanished=True), captured)
    if said:
        return JobOutcome(said[0][0], said[0][1], captured)
    if dead is not None:
        return JobOutcome(1, dead_line(dead, status, ended), captured)
    name = "mpiexec" if launcher == "mpi" else launcher
    return JobOutcome(1, f"scalelab: job failed: {name} exited with code {code}", captured)


def _vanished_rank(
    said: list[tuple[int, str]], silent: set[int], status: dict
) -> tuple[int, str, None] | None:
    """(rank, host, None) of the one rank that left no line while every line the others
    left says a peer vanished or is the MPI library's error (whose text may name no cause).
    A survivor's MPI call can fail on the killed rank and its MPI_Abort end mpiexec before
    hydra reports the kill: then MPICH prints only the Abort line (no BAD TERMINATION box,
    no signal). With several silent ranks (the launcher's cleanup kills the rest too)
    which one vanished first is unknown: None."""
    if not said or len(silent) != 1 or not all(may_blame_a_peer(line) for _, line in said):
        return None
    (rank,) = silent
    return rank, status[rank][1], None


def _killed_alike(dead: tuple[int, str, int | None], status: dict, silent: set[int]) -> list[int]:
    """The other silent ranks on the boxed rank's host that could have died first. Hydra's
    proxy SIGKILLs its ranks that are still running as soon as one dies, then boxes the
    lowest-ranked of the killed, not the first: rank 1 killed while rank 0 computes (no MPI
    call to fail in) reads "PID <rank 0's> ... EXIT CODE: 9". A rank that noticed the death
    first left its own line and is not silent; among the silent the order is unknown."""
    rank = dead[0]
    if rank not in silent:
        return []
    return sorted(r for r in silent if r > rank and status[r][1] == status[rank][1])


def notes(folder: Path) -> list[tuple[int, str]]:
    """(exit code, line) the ranks handed over, lowest rank first."""
    out = []
    for path in sorted(folder.glob("note.rank*"), key=lambda p: int(p.name[len("note.rank") :])):
        first, _, line = path.read_text().partition("\n")
        out.append((int(first), line))
    return out


def dead_line(
    dead: tuple[int | None, str, int | None],
    status: dict,
    ended: float,
    vanished: bool = False,
    alike: list[int] | None = None,
) -> str:
    """The dead rank's line; vanished: it died of a signal nobody reported; alike: other
    ranks killed at once, any of which may have died first (then no one rank is named)."""
    rank, host, signal = dead
    _, st_host, beat, phase = status.get(rank, (None, host, None, "setup"))
    after = f"; job aborted after {max(0.0, ended - beat):.1f} s" if beat else ""
    how = f"died (signal {signal})" if signal else ("died" if vanished else "exited")
    who = f"rank {rank}" if rank is not None else "a rank"
    if alike:
        who, after = (
            _one_of([rank, *alike]),
            ("; the launcher killed the others at once, so which died first is unknown" + after),
        )
    return f"scalelab: {who} on {host or st_host} {how} during {phase}{after}"


def _one_of(ranks: list[int]) -> str:
    """'rank 0 or 1', 'one of ranks 0-63', 'one of ranks 0, 2, 5'."""
    if len(ranks) == 2:
        return f"rank {ranks[0]} or {ranks[1]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"one of ranks {ranks[0]}-{ranks[-1]}"
    return "one of ranks " + ", ".join(map(str, ranks))


def statuses(folder: Path) -> dict[int, tuple[int, str, float, str]]:
    """rank -> (pid, host, time of the last phase change, phase)."""
    out = {}
    for path in folder.glob("rank*.status"):
        parts = path.read_bytes().decode(errors="replace").split(None, 3)
        if len(parts) == 4:
            out[int(path.name[4:-7])] = (int(parts[0]), parts[1], float(parts[2]), parts[3].strip())
    return out


def _torchrun_failures(summary: str) -> list[tuple[int, str, int | None]]:
    """(rank, host, signal) of each entry of torchrun's error summary, in its order (the root
    cause last)."""
    out = []
    for entry in re.split(r"^\s*\[\d+\]:\s*$", summary, flags=re.M)[1:]:
        rank, host, code = (
            re.search(p, entry)
            for p in (r"rank\s*:\s*(\d+)", r"host\s*:\s*(\S+)", r"exitcode\s*:\s*(-?\d+)")
        )
        if rank and code:
            c = int(code.group(1))
            out.append((int(rank.group(1)), host.group(1) if host else "?", -c if c < 0 else None))
    return out


def _dead_rank(
    captured: list[str], status: dict, silent: set[int]
) -> tuple[int, str, int | None] | None:
    """(rank, host, signal) of the rank whose death ended the job, from the launcher's text."""
    text = "\n".join(captured)
    # torchrun: its failure entries ("Failures:" and "Root Cause (first observed failure)").
    # A rank killed by a signal wins over the root cause: a peer's all-reduce can raise
    # "Connection closed by peer" and exit before torchrun notices the killed rank. SIGTERM
    # is torchrun's own stop of the survivors, never a cause: with no other signal, the rank
    # that exited by itself is (its own line then names the failure), whatever torchrun's
    # "root cause" says (without error files it can name a SIGTERM'd survivor: rank 1's gloo
    # error under torch 2.11 read "rank 0 died (signal 15) during setup").
    entries = _torchrun_failures(text.split("Failures:", 1)[1]) if "Failures:" in text else []
    if entries:
        killed = [e for e in entries if e[2] not in (None, 15)]
        exited = [e for e in entries if e[2] is None]
        return (killed or exited or entries)[0 if killed else -1]
    # Open MPI: "... noticed that process rank 1 with PID 0 on node X exited on signal 9"
    m = re.search(r"process rank (\d+) with PID \d+ on node (\S+) exited on signal (\d+)", text)
    if m:
        return int(m.group(1)), m.group(2), int(m.group(3))
    # MPICH: "PID 123 RUNNING AT host" and, when killed, "EXIT STRING: Killed (signal 9)";
    # MPICH 3/4 and Intel MPI box each killed rank: "RANK 1 PID 123 RUNNING AT host",
    # "KILLED BY SIGNAL: 9 (Killed)".
    pid = re.search(r"(?:RANK (\d+) )?PID (\d+) RUNNING AT (\S+)", text)
    if pid:
        # None: killed before it wrote its status page, so which rank it was is unknown
        by_pid = {s[0]: r for r, s in status.items()}.get(int(pid.group(2)))
        rank_of = int(pid.group(1)) if pid.group(1) else by_pid
        return rank_of, pid.group(3), _mpich_signal(text, rank_of in silent)
    return None


def _mpich_signal(text: str, silent: bool) -> int | None:
    """The signal that killed the rank MPICH's BAD TERMINATION box names. Its "EXIT CODE: N"
    is that process's raw wait status (MPICH 5.0's hydra boxes only processes that did not
    exit), but older hydras box an exit(N) alike; a rank that left no line of its own did not exit
    through scalelab's error path, so there N is the signal (low 7 bits; 0x80: core). The
    "EXIT STRING: ... (signal N)" line (the OR of every rank's status) comes last and is
    missing when a survivor's MPI_Abort, failing on the dead rank, ends mpiexec first."""
    box = re.search(r"EXIT CODE: (\d+)", text)
    if silent and box and int(box.group(1)) & 0x7F:
        return int(box.group(1)) & 0x7F
    sig = re.search(r"(?:signal|SIGNAL:) (\d+)", text)  # "EXIT CODE: 9" alone may be exit(9)
    return int(sig.group(1)) if sig else None


# --- relaunching this command line under a launcher --------------------------------------
def relaunch(launcher: str, ranks: int, argv: list[str]) -> int:
    """Run `scalelab ARGV` under the launcher with `ranks` processes; return its exit code."""
    return relaunch_job(launcher, ranks, argv).code


def relaunch_job(launcher: str, ranks: int, argv: list[str], say: bool = True) -> JobOutcome:
    """relaunch, with the one line that explains a failed job (a refusal, a dead rank)."""
    if launcher == "mpi":
        cmd, env = mpiexec_command(ranks)
        cmd += [sys.executable, "-m", "scalelab", *argv]
    else:
        cmd, env = torchrun_command(ranks) + ["-m", "scalelab", *argv], dict(os.environ)
    env.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off (shared hosts)
    env["SCALELAB_LAUNCHED"] = "1"
    return run_job(cmd, env, launcher, say=say)


def until_read(stream: TextIO, most_s: float = 2.0) -> None:
    """Until whoever reads `stream`'s pipe (slurmstepd, which forwards it to srun) has taken
    what was written, so that a line said just before this task cancels its step is not
    still in the pipe when the cancel ends the step (once in CI a killed rank's line was
    missing from srun's stderr, its step CANCELLED right after its watcher said it).
    FIONREAD says how many bytes a pipe still holds; not a pipe (a terminal, a file): done."""
    import fcntl
    import stat
    import struct
    import termios

    try:
        if not stat.S_ISFIFO(os.fstat(stream.fileno()).st_mode):
            return
    except (OSError, ValueError):
        return
    end = time.monotonic() + most_s
    while time.monotonic() < end:
        try:
            held = struct.unpack("i", fcntl.ioctl(stream.fileno(), termios.FIONREAD, b"\0" * 4))
        except (OSError, ValueError):
            return
        if held[0] == 0:
            return
        time.sleep(0.005)
