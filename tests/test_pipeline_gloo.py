"""The pipeline over 2 and 3 real gloo ranks against one process (tests/programs/pipe_check.py):
the same logits, weights and losses, the textbook bubble of a sleeping stack, and a record
with every stage."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

from scalelab.comm.launch import torchrun_command
from scalelab.record import read_records

PROGRAM = str(Path(__file__).parent / "programs" / "pipe_check.py")


# --- real ranks -------------------------------------------------------------------------------


def _torchrun(ranks: int, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [*torchrun_command(ranks), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_pipeline_over_gloo_equals_one_process(ranks, tmp_path):
    """Inference: the same logits; training: the same weights after the same steps, the same
    losses; a sleeping stack: the textbook bubble; through the runner: the oracle check and
    a record with every stage (tests/programs/pipe_check.py)."""
    results = tmp_path / "runs.jsonl"
    proc = _torchrun(ranks, PROGRAM, str(results))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    # Ranks print concurrently: their lines can interleave mid-line, so find the words.
    assert sorted(re.findall(r"rank (\d+) ok", proc.stdout)) == [str(r) for r in range(ranks)]
    lines = proc.stdout.splitlines()
    outcomes = [json.loads(line) for line in lines if line.startswith("{")]
    assert len(outcomes) == 4
    for r in outcomes:
        tol = 1e-10 if r.get("dtype", "fp32") == "fp64" else 1e-5
        if "check_passed" in r:
            assert r["check_passed"] and r["relerr"] < 1e-12, r
            continue
        assert len(r["balance"]) == ranks, r
        if "weight_diff" not in r:
            assert r["relerr"] < tol, r
            continue
        assert r["moved"] > 1e-3 and r["weight_diff"] < tol * r["moved"], r
        np.testing.assert_allclose(r["loss_pipe"], r["loss_local"], rtol=tol)
        assert r["acc_pipe"] == r["acc_local"]
        if r["workload"] == "sleepstack":  # equal stage times: the textbook bubble
            assert r["bubble_simulated"] == pytest.approx(r["bubble_formula"], abs=0.02), r
            assert r["bubble_formula"] - 0.01 < r["bubble_measured"] < r["bubble_formula"] + 0.06
    if ranks == 2:
        (rec,) = read_records(results)
        assert rec["strategy"] == "pipeline" and rec["ranks"] == 2 and rec["check_passed"]
        assert len(rec["rank_phases"]) == 2 and rec["bytes"]["send"] > 0
        notes = rec["pipeline"]
        assert notes["bubble_formula"] == pytest.approx(1 / 4)
        assert [s["rank"] for s in notes["stage"]] == [0, 1]
        assert sum(notes["balance"]) == len(notes["layer_profile"])
