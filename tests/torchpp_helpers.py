"""Shared by the torch-engine tests: run tests/programs/torchpp_check.py under torchrun."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from scalelab.comm.launch import torchrun_command

PROGRAM = str(Path(__file__).parent / "programs" / "torchpp_check.py")


# Seen about once in ten launches of the `pp` suite under CI load, never alone: a rank's gloo
# pair reports "Connection closed by peer" mid-schedule because the other rank exited. The
# exiting rank's own error has not been caught yet (its traceback scrolls out of the kept
# tail); until it is, such a launch is run once more, and a second one fails the test.
TRANSPORT_CRASH = "Connection closed by peer"


def torchrun(ranks: int, *args: str, timeout: int = 600) -> list[dict]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [*torchrun_command(ranks), PROGRAM, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0 and TRANSPORT_CRASH in proc.stderr:
        print(f"torchpp: relaunched after a transport crash:\n{proc.stderr[:4000]}")
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.count(" ok") >= ranks
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def check_training(r: dict) -> None:
    assert r["moved"] > 1e-3, r
    assert r["weight_diff"] < 1e-10 * max(r["moved"], 1.0), r
    assert r["loss"] == pytest.approx(r["ref_loss"], rel=1e-10)
