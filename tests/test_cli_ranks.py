"""The launched job keeps the CLI's word: a refusal on the ranks reaches the user as that one
line (exit 2, no launcher banner, no record), and a killed rank is named with its host, signal
and phase, under mpiexec and under torchrun (real launchers, real SIGKILL)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import uuid

import pytest

from rank_procs import find_rank, wait_past_setup
from scalelab.record import read_records

# Under mpiexec rank 0 may be computing when rank 1 dies: hydra kills it at once and boxes it,
# and the line then names both (test_job_explain lays that race out).
DEAD = re.compile(
    r"^scalelab: rank (?:1|0 or 1) on (\S+) died( \(signal 9\))? during (\S+);"
    r"( the launcher killed the others at once, so which died first is unknown;)?"
    r" job aborted after [\d.]+ s$"
)


def scalelab(*args: str, env=None, **kw) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "scalelab", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, **kw)


@pytest.mark.parametrize(
    "args",
    [
        ("alexnet", "--strategy", "pipeline", "--stages", "3", "--ranks", "2"),  # torchrun
        ("alexnet", "--strategy", "mpi", "--split", "spatial", "--ranks", "9"),  # mpiexec
    ],
    ids=["torchrun", "mpiexec"],
)
def test_a_refusal_on_the_ranks_is_one_line_and_exit_2(tmp_path, args):
    out = tmp_path / "runs.jsonl"
    done = scalelab("run", *args, "--image-size", "67", "--batch", "2", "--out", str(out))
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("scalelab run: error: "), done.stderr
    assert not out.exists()


@pytest.mark.mpi
@pytest.mark.parametrize(
    "args",
    [
        ("alexnet", "--strategy", "mpi", "--split", "spatial", "--image-size", "67"),
        ("mlp", "--strategy", "ddp", "--train", "--steps", "100000", "--hidden", "16"),
    ],
    ids=["mpiexec", "torchrun"],
)
def test_a_killed_rank_is_named_with_host_signal_and_phase(tmp_path, args):
    token, out = uuid.uuid4().hex, tmp_path / "runs.jsonl"
    cmd = [sys.executable, "-m", "scalelab", "run", *args, "--ranks", "2", "--batch", "4"]
    cmd += ["--iters", "1000000", "--warmup", "0", "--quiet", "--out", str(out)]
    env = {**os.environ, "SCALELAB_TEST_TOKEN": token}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        pid = find_rank(token, 1, timeout=120)
        wait_past_setup(pid, timeout=120)
        os.kill(pid, signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 1, stderr
    assert stdout == ""  # no launcher banner on stdout
    last = stderr.strip().splitlines()[-1]
    match = DEAD.match(last)
    assert match, stderr
    assert match.group(1) in (socket.gethostname(), "localhost", socket.getfqdn())
    # Only MPICH may end without the signal: rank 0's MPI call fails on the dead rank and its
    # MPI_Abort can end mpiexec before hydra reports the kill (test_job_explain lays it out).
    assert match.group(2) or "mpi" in args, stderr
    # two ranks named only with the reason why, and only under mpiexec
    assert ("rank 0 or 1" in last) == bool(match.group(4)) and (not match.group(4) or "mpi" in args)
    assert "Traceback" not in stderr and "BAD TERMINATION" not in stderr
    (rec,) = read_records(out)
    assert rec["status"] == "failed"
