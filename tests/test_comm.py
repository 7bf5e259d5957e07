"""The comm layer under real launchers: mpiexec -n 2/3 (mpi4py) and torchrun (gloo)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from scalelab.comm import SelfComm, even_counts
from scalelab.comm.launch import find_mpiexec, torchrun_command

PROGRAM = str(Path(__file__).parent / "programs" / "comm_check.py")


def _run(cmd, timeout=120):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def test_even_counts():
    assert even_counts(7, 3) == [3, 2, 2]
    assert even_counts(2, 3) == [1, 1, 0]
    assert sum(even_counts(1000, 7)) == 1000


def test_self_comm_is_identity():
    import torch

    c, x = SelfComm(), torch.arange(6).reshape(3, 2)
    assert c.scatterv(x, [3]) is x and c.gatherv(x) is x and c.allreduce(x) is x
    assert c.gather_object(5) == [5] and c.size == 1 and c.is_root


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_mpi_collectives(ranks):
    proc = _run([find_mpiexec(), "-n", str(ranks), sys.executable, PROGRAM, "mpi"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    # Ranks' lines may interleave in the launcher's forwarded stdout: look for each one.
    assert sorted(map(int, re.findall(r"rank (\d+) ok", proc.stdout))) == list(range(ranks))


@pytest.mark.mpi
def test_gloo_collectives_under_torchrun():
    proc = _run([*torchrun_command(3), PROGRAM, "gloo"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert sorted(map(int, re.findall(r"rank (\d+) ok", proc.stdout))) == [0, 1, 2]
