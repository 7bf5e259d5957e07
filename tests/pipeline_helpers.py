"""Shared by the pipeline tests: the small deepstack they cut, its workload, and `scalelab
run` in a fresh process, bounded in time, returning the run's record."""

from __future__ import annotations

import subprocess
import sys

import pytest

from scalelab.config import RunConfig
from scalelab.record import read_records
from scalelab.workloads import WORKLOADS

STACK = {"image_size": 8, "convs": 3, "fcs": 1, "num_classes": 10}


def _workload(name: str, **kw):
    return WORKLOADS.get(name)(RunConfig(workload=name, **kw))


def _cli(tmp_path, *args):
    out = tmp_path / "runs.jsonl"
    cmd = [sys.executable, "-m", "scalelab", "run", *args, "--out", str(out)]
    try:
        # bounded well inside the GPU suite's 300 s: once a 2-GPU run of the pipeline tests
        # (62 s alone) was still running when the suite was killed, its output lost with it
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else e.stderr or ""
        pytest.fail(f"scalelab run {' '.join(args)} ran past 180 s; stderr ends:\n{err[-3000:]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read_records(out)[-1]
