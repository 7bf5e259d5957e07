"""Shared by the torch-engine tests: run tests/programs/torchpp_check.py under torchrun."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from scalelab.comm.launch import torchrun_command

PROGRAM = str(Path(__file__).parent / "programs" / "torchpp_check.py")


def torchrun(ranks: int, *args: str, timeout: int = 600) -> list[dict]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [*torchrun_command(ranks), PROGRAM, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + first_error(proc.stderr)
    assert proc.stdout.count(" ok") >= ranks
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def first_error(stderr: str) -> str:
    """The stderr tail, led by the first rank error's lines: a rank that raises leaves, and
    its peer's gloo "Connection closed by peer" would otherwise fill the kept tail."""
    lines = stderr.splitlines()
    first = next((i for i, line in enumerate(lines)
                  if "Error:" in line and "closed by peer" not in line), None)  # fmt: skip
    head = "" if first is None else "\n".join(lines[max(first - 20, 0) : first + 5]) + "\n...\n"
    return head + stderr[-3000:]


def check_training(r: dict) -> None:
    assert r["moved"] > 1e-3, r
    assert r["weight_diff"] < 1e-10 * max(r["moved"], 1.0), r
    assert r["loss"] == pytest.approx(r["ref_loss"], rel=1e-10)
