"""A job Slurm stops records why within KillWait (SIGTERM to SIGKILL: 20 s on the test
cluster), even on a loaded node: `slurm_point prepare` (the job's start) writes the point's
failed record but its reason, and `slurm_point stopped` (the SIGTERM trap) only reads it,
asks scontrol and appends, never importing torch. Its record is the one the point's own
parse writes. tests/test_slurm_cluster_ends.py stops real jobs on a two-node Slurm."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from scalelab.cli import slurm_point
from scalelab.record import append_record, failed_record, read_records

pytestmark = pytest.mark.slurm

SHOWN = "JobId=7101 JobName=p JobState=COMPLETING Reason=TimeLimit Restarts=0"
JOB = {"SLURM_JOB_ID": "7101", "SLURM_JOB_NODELIST": "n1", "SLURM_JOB_NUM_NODES": "1"}
PER_RECORD = {"id", "time"}  # a fresh id and time for every record made


def _helper(tmp_path, *argv, importtime=False, **env):
    stub = tmp_path / "bin" / "scontrol"
    stub.parent.mkdir(exist_ok=True)
    stub.write_text(f'#!/bin/bash\n[ "$4" = 7101 ] && echo "{SHOWN}"\n')
    stub.chmod(0o755)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    path = f"{stub.parent}:{os.environ['PATH']}"
    flags = ["-X", "importtime"] if importtime else []
    return subprocess.run(
        [sys.executable, *flags, "-m", "scalelab.cli.slurm_point", *map(str, argv)],
        env={**clean, **JOB, **env, "PATH": path},
        capture_output=True,
        text=True,
        timeout=300,
    )


def _imported(importtime_stderr: str) -> set[str]:
    """The modules `python -X importtime` says were imported."""
    lines = importtime_stderr.splitlines()
    return {ln.split("|")[-1].strip() for ln in lines if ln.startswith("import time:")}


def test_a_stopped_job_records_its_stop_without_torch(tmp_path, monkeypatch):
    out = tmp_path / "r.jsonl"
    args = ["run", "mlp", "--batch", "4", "--hidden", "8", "--out", out]
    prep = tmp_path / "point.json"
    got = _helper(tmp_path, "prepare", prep, *args)
    assert got.returncode == 1 and prep.exists() and not out.exists(), got.stderr  # not done

    got = _helper(tmp_path, "stopped", "", prep, *args, importtime=True)
    assert got.returncode == 0, got.stderr
    imported = _imported(got.stderr)
    assert {"scalelab.record", "scalelab.comm.slurm_env"} <= imported  # importtime saw the helper
    heavy = {m for m in imported if m.split(".")[0] in ("torch", "numpy")}
    assert not heavy and "scalelab.config" not in imported, sorted(imported)
    (rec,) = read_records(out)

    # What the point's own parse wrote for this stop (the path before `prepare`).
    for k, v in JOB.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    cfg, results = slurm_point.point_config([str(a) for a in args])
    reason = "job 7101 was stopped by Slurm (its time limit)"
    append_record(tmp_path / "old.jsonl", failed_record(cfg, reason, source="slurm"))
    (want,) = read_records(tmp_path / "old.jsonl")
    assert results == out and list(rec) == list(want)  # the same fields, in the same order
    assert {k: v for k, v in rec.items() if k not in PER_RECORD | {"env"}} == {
        k: v for k, v in want.items() if k not in PER_RECORD | {"env"}
    }
    # env is read when each record is made: the same fields, the host's identity the same
    # (what moves with the moment, such as memory free, is left out of the comparison)
    assert list(rec["env"]) == list(want["env"])
    for key in ("hostname", "platform", "python", "cpu", "torch", "git_commit"):
        assert rec["env"].get(key) == want["env"].get(key), key

    # This attempt has its record: a second SIGTERM (or `failed` after it) adds none.
    assert _helper(tmp_path, "stopped", "", prep, *args).returncode == 0
    assert len(read_records(out)) == 1


def test_a_stop_before_prepare_parses_the_point(tmp_path):
    """SIGTERM before `prepare` wrote its file (a slow setup line): the point's arguments
    give the record, as before; the requeued attempt (restart 1) gets its own."""
    out = tmp_path / "r.jsonl"
    args = ["run", "mlp", "--batch", "4", "--out", out]
    got = _helper(tmp_path, "stopped", "1", tmp_path / "absent.json", *args)
    assert got.returncode == 0, got.stderr
    got = _helper(
        tmp_path, "stopped", "1", tmp_path / "absent.json", *args, SLURM_RESTART_COUNT="1"
    )
    assert got.returncode == 0, got.stderr
    first, second = read_records(out)
    assert first["error"] == second["error"] == "job 7101 was stopped by Slurm (its time limit)"
    assert (first["slurm"]["restart"], second["slurm"]["restart"]) == (0, 1)
    assert first["config"] == second["config"] and first["config"]["batch"] == 4
