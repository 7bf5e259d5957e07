"""scalelab on a real Slurm (22.05, Debian's packages): two emulated nodes n1 and n2 on this
host, brought up by tests/slurm/cluster.sh. Every run here is started by srun or sbatch as a
cluster user would, and compared with the same run on one node."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from rank_procs import find_rank, wait_past_setup
from scalelab.record import read_records

pytestmark = pytest.mark.slurm

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "tests" / "slurm" / "cluster.sh"
PY = sys.executable
ALEXNET = ["run", "alexnet", "--strategy", "mpi", "--split", "spatial", "--image-size", "67"]
ALEXNET += ["--batch", "2", "--iters", "1", "--warmup", "0", "--check"]


# slurm_conf (conftest.py): the two-node cluster, brought up once per test run and shared by
# every module that asks for it; SLURM_CONF set while a module's tests run.


def slurm(cmd, cwd, timeout=300, **env):
    return subprocess.run(
        cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **env}
    )


def scalelab_srun(srun_args, args, cwd):
    return slurm(["srun", *srun_args, PY, "-m", "scalelab", *args], cwd)


def one_record(path):
    (rec,) = read_records(path)
    return rec


def test_srun_without_pmi_is_refused_in_one_line(slurm_conf, tmp_path):
    """No --mpi plugin (MpiDefault=none): each task would be a 1-rank world and append its own
    record. Refused: exit 2, one line naming srun --mpi=pmi2, nothing written."""
    out = tmp_path / "r.jsonl"
    proc = scalelab_srun(["-N2", "-n2"], [*ALEXNET, "--out", str(out)], tmp_path)
    said = [ln for ln in proc.stderr.splitlines() if ln.startswith("scalelab")]
    assert proc.returncode == 2, proc.stderr
    assert len(said) == 1 and "srun --mpi=pmi2" in said[0], proc.stderr
    assert not out.exists()


NETMOD = """
import os
from scalelab.comm.mpi import import_mpi
world = import_mpi().COMM_WORLD
print(world.Get_rank(), world.Get_size(), os.environ.get("MPIR_CVAR_CH4_NETMOD"))
"""


def test_mpich_under_srun_pmi2_runs_over_ofi(slurm_conf, tmp_path):
    """In the environment Slurm's pmi2 plugin gives a task, the wheel's MPICH is told to use
    OFI (UCX's business card can outgrow slurmstepd's 1024-byte PMI-1 read and hang MPI_Init)
    and the two tasks are one world. (A user's MPIR_CVAR_CH4_NETMOD stays: test_slurm_launch;
    not launched here, as UCX could hang.)"""
    cmd = ["srun", "-N2", "-n2", "--ntasks-per-node=1", "--mpi=pmi2", PY, "-c", NETMOD]
    proc = slurm(cmd, tmp_path, timeout=120)
    assert sorted(proc.stdout.splitlines()) == ["0 2 ofi", "1 2 ofi"], proc.stderr


def test_mpi_spatial_across_two_nodes_equals_one_node(slurm_conf, tmp_path):
    """alexnet, height split over 2 ranks on n1+n2 (pmi2): the same digest as on one node; the
    record says 2 ranks in its config too, 1 thread (the one CPU Slurm gave each task, said to
    come from Slurm) and the job it ran in."""
    two, one = tmp_path / "two.jsonl", tmp_path / "one.jsonl"
    proc = scalelab_srun(
        ["-N2", "-n2", "--ntasks-per-node=1", "--mpi=pmi2"], [*ALEXNET, "--out", str(two)], tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    # On n1 by name: left to Slurm, a 1-node job goes to whichever node is free, and under
    # load the previous test's job may still be completing on n1 (its ranks being killed):
    # then this one ran on n2 and `node_list == "n1"` failed (in 1 full CI run; never alone).
    one_node = ["-N1", "-n2", "--nodelist=n1", "--mpi=pmi2"]
    proc = scalelab_srun(one_node, [*ALEXNET, "--out", str(one)], tmp_path)
    assert proc.returncode == 0, proc.stderr
    a, b = one_record(two), one_record(one)
    assert a["ranks"] == a["config"]["ranks"] == 2 and a["config"]["threads"] == 1
    assert a["threads"]["source"] == "Slurm", a["threads"]  # not --threads: none was given
    assert a["check_passed"] and a["digest"] == b["digest"] == a["reference_digest"]
    job = a["slurm"]
    assert (job["node_list"], job["nodes"], job["tasks"], job["partition"]) == (
        "n[1-2]",
        2,
        2,
        "debug",
    )
    assert job["job_id"].isdigit() and b["slurm"]["node_list"] == "n1"
    # one rank on each node: no "2 processes on 1 CPUs" (the world size taken as ranks here)
    assert not any(re.match(r"\d+ processes (on|x) ", w) for w in a["warnings"]), a["warnings"]


def test_a_rank_killed_under_srun_is_named_and_the_step_ends(slurm_conf, tmp_path):
    """srun -N2 -n2 --mpi=pmi2, rank 1 (on n2) SIGKILLed mid-run: without a watcher srun only
    says `task 1: Killed` and rank 0 waits in its halo exchange for ever. Now: one scalelab line
    naming rank 1, n2, signal 9 and the phase; the step ends; a failed record saying so."""
    out = tmp_path / "r.jsonl"
    args = [*ALEXNET[:-5], "--iters", "1000000", "--warmup", "0", "--quiet", "--out", str(out)]
    cmd = ["srun", "-N2", "-n2", "--ntasks-per-node=1", "--mpi=pmi2", PY, "-m", "scalelab", *args]
    # OFI, as scalelab takes under pmi2 (UCX's MPI_Init fails there in 1 launch of 2 to 4:
    # comm/mpi.slurm_pmi2_netmod). Rank 0's MPICH sees the death at once and aborts the step
    # through PMI, which Slurm does with SIGKILL: rank 1's watcher names it first (its record's
    # slow parts were made while the rank ran).
    token = uuid.uuid4().hex
    env = {**os.environ, "SCALELAB_TEST_TOKEN": token}
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        pid = find_rank(token, 1, timeout=180)
        assert wait_past_setup(pid, timeout=180, stop=lambda: proc.poll() is not None)
        os.kill(pid, signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    said = [ln for ln in stderr.splitlines() if ln.startswith("scalelab")]
    assert len(said) == 1, stderr
    dead = r"^scalelab: rank 1 on n2 died \(signal 9\) during (\S+); job aborted after [\d.]+ s$"
    match = re.match(dead, said[0])
    assert match and match.group(1) != "setup", stderr
    assert proc.returncode != 0 and "Traceback" not in stderr and stdout == ""
    records = read_records(out)
    assert len(records) == 1, [r.get("error") for r in records]
    (rec,) = records
    assert rec["status"] == "failed" and "rank 1 on n2 died (signal 9)" in rec["error"]


STUDY = """
[study]
name = "cluster"
[grid]
strategy = ["mpi-dp", "ddp"]
[fixed]
epochs = 1
workload = "mlp"
train = true
ranks = 2
hidden = 16
batch = 20
train_size = 200
heldout_size = 100
data_dir = "{mnist}"
"""
MLP = ["run", "mlp", "--train", "--ranks", "2", "--hidden", "16", "--batch", "20"]
MLP += ["--train-size", "200", "--heldout-size", "100", "--quiet"]


def wait_for(jobs, cwd, timeout=420):
    """Until no job of `jobs` is pending or running (MinJobAge keeps finished ones listed)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        out = slurm(["squeue", "-h", "-o", "%i %T", "-j", ",".join(jobs)], cwd).stdout
        if not out.strip():
            return
        time.sleep(3)
    pytest.fail(f"jobs {jobs} still queued after {timeout} s: {out}")


def running(job, cwd):
    """Until the job's first step runs (its point started), not just the job: a job is
    RUNNING before its batch script has started, and a scancel then ends it before the script
    could install the trap that records it."""
    for _ in range(240):
        if f"{job}.0" in slurm(["squeue", "-h", "-s", "-o", "%i", "-j", job], cwd).stdout:
            return
        time.sleep(1)
    pytest.fail(f"job {job} never started its step")


def by_point(records):
    return {(r["strategy"], r["config"]["epochs"]): r for r in records}


def test_study_as_arrays_on_two_nodes(slurm_conf, tmp_path, mnist_dir, cli):
    """A sweep submitted with submit_all.sh (one array per allocation): mpi-dp (srun
    --mpi=pmi2) and ddp (torchrun c10d), one rank on each of n1 and n2, train on MNIST to the
    losses of their one-node runs (mpi-dp: `scalelab run --ranks 2` in a batch script; ddp:
    `srun -n 2`); the report job runs after all points and shows them. Submitted again, a
    finished point is skipped. (How jobs end otherwise: test_slurm_cluster_ends.)"""
    (tmp_path / "study.toml").write_text(STUDY.format(mnist=mnist_dir))
    res = tmp_path / "res" / "runs.jsonl"
    code, _, err = cli(
        "slurm",
        tmp_path / "study.toml",
        "--nodes",
        "2",
        "--tasks-per-node",
        "1",
        "--array",
        "--time",
        "00:10:00",
        "--python",
        PY,
        "-o",
        tmp_path / "jobs",
        "--out",
        res,
    )
    assert code == 0, err
    one_node = [
        [
            "sbatch",
            "--parsable",
            "-N1",
            "-n2",
            "-o",
            "mpidp.out",
            "--wrap",
            " ".join(
                [
                    PY,
                    "-m",
                    "scalelab",
                    *MLP,
                    "--strategy",
                    "mpi-dp",
                    "--data-dir",
                    str(mnist_dir),
                    "--out",
                    "one.jsonl",
                ]
            ),
        ],
        [
            "sbatch",
            "--parsable",
            "-N1",
            "-n2",
            "-o",
            "ddp.out",
            "--wrap",
            " ".join(
                [
                    "srun",
                    PY,
                    "-m",
                    "scalelab",
                    *MLP,
                    "--strategy",
                    "ddp",
                    "--data-dir",
                    str(mnist_dir),
                    "--out",
                    "one.jsonl",
                ]
            ),
        ],
    ]
    refs = [slurm(cmd, tmp_path).stdout.strip() for cmd in one_node]
    proc = slurm(["bash", str(tmp_path / "jobs" / "submit_all.sh")], tmp_path)
    assert proc.returncode == 0, proc.stderr
    arrays, report = proc.stdout.split("submitted ")[1].split("; report job ")
    mpidp, ddp = arrays.split()
    report = report.split()[0]
    wait_for([mpidp, ddp, report, *refs], tmp_path)

    got = by_point(read_records(res))
    ref = by_point(read_records(tmp_path / "one.jsonl"))
    for strategy in ("mpi-dp", "ddp"):
        two, one = got[(strategy, 1)], ref[(strategy, 1)]
        assert two["status"] == "ok" and two["slurm"]["node_list"] == "n[1-2]"
        assert two["loss"] == pytest.approx(one["loss"], rel=1e-6), strategy
    page = (tmp_path / "jobs" / "report" / "index.html").read_text()
    assert f">{mpidp}_1<" in page and f">{ddp}_2<" in page  # it ran after both points

    before = len(read_records(res))
    again = slurm(
        ["sbatch", "--parsable", "--wait", "--array=1", str(tmp_path / "jobs" / "array_01.sbatch")],
        tmp_path,
    )
    assert again.returncode == 0, again.stderr
    assert len(read_records(res)) == before
    log = next((tmp_path / "jobs" / "logs").glob(f"*{again.stdout.strip()}_1.out")).read_text()
    assert "ok record already: skipped" in log
    code, out, err = cli("scaling", res)
    assert code == 0, err
