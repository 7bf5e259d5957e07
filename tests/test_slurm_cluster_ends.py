"""How jobs end on a real Slurm (the two emulated nodes of tests/slurm/cluster.sh): each
ending leaves one line and one record, nothing hangs, nothing is left running.
tests/test_slurm_ends.py checks the same logic without a cluster."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from rank_procs import environ, wait_past_setup
from scalelab.instrument.spans import SLOW_RANK_ENV
from scalelab.record import read_records
from test_slurm_cluster import ALEXNET, PY, slurm, wait_for

pytestmark = pytest.mark.slurm


def processes_with(token: str, var: str = "", value: str = "") -> list[int]:
    """pids started with SCALELAB_TEST_TOKEN=token (and var=value, where given)."""
    out = []
    for entry in Path("/proc").iterdir():
        env = environ(entry.name) if entry.name.isdigit() else None
        ours = env is not None and env.get(b"SCALELAB_TEST_TOKEN") == token.encode()
        if ours and (not var or env.get(var.encode()) == value.encode()):
            out.append(int(entry.name))
    return out


def wait_until(what, timeout: float, why: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = what()
        if got:
            return got
        time.sleep(0.2)
    pytest.fail(why)


@pytest.mark.usefixtures("slurm_conf")
def test_srun_mpiexec_refused_and_a_killed_task_ends_its_step(tmp_path):
    """`srun -n1 ... --strategy mpi --ranks 2` hung for ever in mpiexec's nested srun: now one
    line, exit 2. Under `srun -N1 -n2 --mpi=pmi2`, SIGKILL to the task srun started for rank 1
    (its watcher; rank 1 dies with it) left rank 0 waiting in MPI_Init or MPI_Wait until
    scancel: now rank 0's watcher on the same node names rank 1, its node (the one Slurm chose
    for the step: n1 or n2) and its phase, records it once and cancels the step, and no process
    of the job is left."""
    out = tmp_path / "r.jsonl"
    proc = slurm(["srun", "-n1", PY, "-m", "scalelab", *ALEXNET, "--ranks", "2"], tmp_path, 120)
    said = [ln for ln in proc.stderr.splitlines() if ln.startswith("scalelab")]
    assert proc.returncode == 2 and len(said) == 1 and "inside an srun step" in said[0]

    token = uuid.uuid4().hex
    args = [*ALEXNET[:-5], "--iters", "1000000", "--warmup", "0", "--quiet", "--out", str(out)]
    cmd = ["srun", "-N1", "-n2", "--mpi=pmi2", PY, "-m", "scalelab", *args]
    env = {**os.environ, "SCALELAB_TEST_TOKEN": token}  # OFI, as scalelab takes under pmi2
    job = subprocess.Popen(cmd, cwd=tmp_path, env=env, text=True, stderr=subprocess.PIPE)
    try:
        rank = wait_until(
            lambda: [p for p in processes_with(token, "PMI_RANK", "1") if _has_job_dir(p)],
            180,
            "rank 1 never started",
        )[0]
        node = _node_of(rank)
        watcher = int(Path(f"/proc/{rank}/stat").read_text().split(") ")[1].split()[1])
        os.kill(watcher, signal.SIGKILL)  # at start-up or mid-run, as the load has it
        _, stderr = job.communicate(timeout=90)  # no scancel: the step ends by itself
        wait_until(lambda: not processes_with(token), 60, "a process of the job was left")
    finally:
        if job.poll() is None:
            job.kill()
            job.communicate()
    said = [ln for ln in stderr.splitlines() if ln.startswith("scalelab")]
    dead = rf"scalelab: rank 1 on {node} died during \S+"
    assert len(said) == 1 and re.match(dead, said[0]), stderr
    assert "internal_" not in stderr and "MPI_Abort" not in stderr, stderr  # MPICH's own stack
    (rec,) = read_records(out)
    assert rec["status"] == "failed" and rec["error"] == said[0].removeprefix("scalelab: ")


@pytest.mark.usefixtures("slurm_conf")
def test_a_one_task_step_that_starts_its_ranks_ends_each_way(tmp_path, mnist_dir):
    """`srun -N1 -n1 -c2 scalelab run mlp --strategy ddp --ranks 2` (scalelab starts torchrun
    inside the one task), twice at once: one scancelled (it died of SIGTERM, no record: now
    exit 143 and a record saying scancel), one with rank 1 SIGKILLed
    (named on the node Slurm chose for it, not `localhost`)."""
    token = uuid.uuid4().hex
    env = {**os.environ, "SCALELAB_TEST_TOKEN": token, **IDLE_LONG}
    args = [*MLP_LONG, "--data-dir", str(mnist_dir)]
    jobs = {}
    for name in ("cancelled", "killed"):
        cmd = ["srun", "-J", f"{name}{token[:8]}", "-N1", "-n1", "-c2", PY, "-m", "scalelab"]
        cmd += [*args, "--out", str(tmp_path / f"{name}.jsonl")]
        jobs[name] = subprocess.Popen(cmd, cwd=tmp_path, env=env, text=True, stderr=subprocess.PIPE)
    try:
        ranks = {}
        for name in jobs:
            ranks[name] = wait_until(
                lambda name=name: [
                    p
                    for p in processes_with(token, "RANK", "1")
                    if _in_step(p, f"{name}{token[:8]}")
                ],
                240,
                f"rank 1 of the {name} step never started",
            )[0]
        node = _node_of(ranks["killed"])
        for pid in ranks.values():
            wait_past_setup(pid, timeout=240)
        slurm(["scancel", "-n", f"cancelled{token[:8]}"], tmp_path)
        os.kill(ranks["killed"], signal.SIGKILL)
        errs = {name: job.communicate(timeout=120)[1] for name, job in jobs.items()}
        wait_until(lambda: not processes_with(token), 60, "a process of the jobs was left")
    finally:
        for job in jobs.values():
            if job.poll() is None:
                job.kill()
                job.communicate()
    assert jobs["cancelled"].returncode == 143 and "Traceback" not in errs["cancelled"]
    (rec,) = read_records(tmp_path / "cancelled.jsonl")
    assert rec["status"] == "failed" and re.fullmatch(
        r"step \d+\.0 was stopped by Slurm \(scancel\)", rec["error"]
    ), rec["error"]
    said = [ln for ln in errs["killed"].splitlines() if ln.startswith("scalelab")]
    dead = rf"scalelab: rank 1 on {node} died \(signal 9\) during \S+; job aborted after"
    assert len(said) == 1 and re.match(dead, said[0]), errs["killed"]
    assert "ChildFailedError" not in errs["killed"] and "Traceback" not in errs["killed"]
    (rec,) = read_records(tmp_path / "killed.jsonl")
    assert rec["status"] == "failed" and rec["error"] == said[0].removeprefix("scalelab: ")


# The long points only have to be running when they are ended (a time limit of a minute, a
# scancel, a killed rank): rank 0 sleeps 0.1 s in each compute phase and its peer waits for it
# in the all-reduce, so they idle instead of taking the cores the rest of the suite runs on.
# (Slower to stop, the scancelled one-task step's torchrun once ended while the task read its
# /proc entry: a traceback, since fixed in jobs.child_pids and tested in test_slurm_ends.py.)
IDLE_LONG = {SLOW_RANK_ENV: "0:0.1"}
MLP_LONG = ["run", "mlp", "--train", "--strategy", "ddp", "--ranks", "2", "--epochs", "100000"]
MLP_LONG += ["--hidden", "16", "--batch", "20", "--train-size", "200", "--heldout-size", "100"]
MLP_LONG += ["--quiet"]


def _node_of(pid: int) -> str:
    """The Slurm node a step's process runs on: -N1 lets Slurm choose n1 or n2."""
    node = (environ(pid) or {}).get(b"SLURMD_NODENAME", b"").decode()
    assert node in ("n1", "n2"), f"pid {pid} is on no Slurm node: {node!r}"
    return node


def _in_step(pid: int, name: str) -> bool:
    return (environ(pid) or {}).get(b"SLURM_JOB_NAME") == name.encode()


STUDY = """
[study]
name = "ends"
[grid]
strategy = ["mpi-dp", "ddp"]
epochs = [1, 100000]
[fixed]
workload = "mlp"
train = true
ranks = 2
hidden = 16
batch = 20
train_size = 200
heldout_size = 100
data_dir = "{mnist}"
"""


@pytest.mark.usefixtures("slurm_conf")
def test_a_mixed_study_ends_each_way_with_one_record_per_attempt(tmp_path, mnist_dir, cli):
    """One study of mpi-dp (srun --mpi=pmi2) and ddp (srun -> one scalelab per node ->
    torchrun) points on n1+n2, ended every way a job ends:
    - mpi-dp, 1 epoch: ok;
    - mpi-dp, long, its limit cut to 1 minute: "its time limit" (no early warning needed);
    - the same point in a second job, scancelled: "scancel";
    - ddp, 1 epoch, requeued: a record of its first attempt (requeued), its log kept; then
      the early time warning (USR1, --time 00:10:00) while it runs: it runs on to ok;
    - ddp, long, a rank SIGKILLed: one line naming it, not torchrun's ChildFailedError;
    - srun failing itself (a plugin it lacks): the step's srun line in a failed record;
    one record per job and attempt, all in `report`, and no process left."""
    (tmp_path / "s.toml").write_text(STUDY.format(mnist=mnist_dir))
    res, jobs = tmp_path / "res.jsonl", tmp_path / "jobs"
    code, _, err = cli("slurm", tmp_path / "s.toml", "--nodes", "2", "--time", "00:10:00",
                       "-o", jobs, "--out", res)  # fmt: skip
    assert code == 0, err
    scripts = [jobs / f"point_00{i}.sbatch" for i in (1, 2, 3, 4)]
    cancel, bogus = jobs / "cancel.sbatch", jobs / "bogus.sbatch"
    cancel.write_text(scripts[1].read_text())  # the long mpi-dp point again
    long_ddp = scripts[3].read_text()
    bogus.write_text(long_ddp.replace("launch=(srun ", "launch=(srun --mpi=bogus "))
    token = uuid.uuid4().hex
    env = {"SCALELAB_TEST_TOKEN": token, **IDLE_LONG}
    ids = [slurm(["sbatch", "--parsable", str(s)], tmp_path, **env).stdout.strip() for s in
           (*scripts, cancel, bogus)]  # fmt: skip
    mpi_ok, timed_out, ddp_ok, killed_job, cancelled, bogus_job = ids
    wait_until(lambda: _step_running(timed_out, tmp_path), 240, "the timed point never ran")
    assert (
        slurm(["scontrol", "update", f"JobId={timed_out}", "TimeLimit=1"], tmp_path).returncode == 0
    )
    wait_until(lambda: _step_running(cancelled, tmp_path), 240, "the cancelled one never ran")
    slurm(["scancel", cancelled], tmp_path)
    wait_until(lambda: _step_running(ddp_ok, tmp_path), 240, "the short ddp point never ran")
    slurm(["scontrol", "requeue", ddp_ok], tmp_path)  # attempt 0 stopped, attempt 1 runs
    wait_until(lambda: _state(ddp_ok, tmp_path) == "PENDING", 120, "never requeued")
    wait_until(lambda: _start_now(ddp_ok, tmp_path), 240, "the requeued point never ran")
    slurm(["scancel", "--signal=USR1", "--batch", ddp_ok], tmp_path)
    rank = wait_until(
        lambda: [p for p in processes_with(token, "RANK", "1") if _torchrun_worker(p, killed_job)],
        240,
        "rank 1 of the long point never started",
    )[0]
    wait_past_setup(rank, timeout=240)
    node = _node_of(rank)
    os.kill(rank, signal.SIGKILL)
    wait_for(ids, tmp_path)

    got = read_records(res)
    recs = {r["slurm"]["job_id"]: r for r in got}  # the last attempt's
    expected = {(job, 0) for job in ids} | {(ddp_ok, 1)}  # the requeued job's second attempt
    assert len(got) == 7 and _attempts(got) == expected, _attempts_said(got, expected)
    assert recs[mpi_ok]["status"] == "ok" and recs[mpi_ok]["strategy"] == "mpi-dp"
    for job, why in ((timed_out, "its time limit"), (cancelled, "scancel")):
        assert recs[job]["status"] == "failed" and recs[job]["strategy"] == "mpi-dp"
        assert recs[job]["error"] == f"job {job} was stopped by Slurm ({why})"
    first = next(r for r in got if r["slurm"]["job_id"] == ddp_ok and r["slurm"]["restart"] == 0)
    assert first["status"] == "failed" and "(requeued: it runs again)" in first["error"]
    assert recs[ddp_ok]["status"] == "ok" and recs[ddp_ok]["config"]["epochs"] == 1
    assert recs[ddp_ok]["slurm"]["restart"] == 1  # and after USR1 it ran on to ok
    assert "JobState=COMPLETED" in slurm(["scontrol", "show", "job", ddp_ok], tmp_path).stdout
    assert "DUE TO JOB REQUEUE" in _log(jobs, ddp_ok)  # the first attempt's log is kept
    dead = rf"rank 1 on {node} died \(signal 9\) during \S+; job aborted after"
    assert recs[killed_job]["status"] == "failed" and re.match(dead, recs[killed_job]["error"])
    log = _log(jobs, killed_job)
    assert len(re.findall(dead, log)) == 1 and "ChildFailedError" not in log, log
    assert "Traceback" not in log, log
    assert recs[bogus_job]["status"] == "failed"
    assert "the job step exited with code" in recs[bogus_job]["error"]
    assert "srun: error" in recs[bogus_job]["error"] and "bogus" in recs[bogus_job]["error"]
    assert not processes_with(token)
    code, _, err = cli("report", res, "-o", tmp_path / "report")
    page = (tmp_path / "report" / "index.html").read_text()
    assert code == 0 and "died (signal 9)" in page and "srun: error" in page, err
    assert "(its time limit)" in page and "(scancel)" in page and "requeued" in page
    assert all(f">{job}<" in page for job in ids)  # the Slurm job of each record


def _attempts(got: list[dict]) -> set[tuple[str, int]]:
    return {(r["slurm"]["job_id"], int(r["slurm"]["restart"] or 0)) for r in got}


def _attempts_said(got: list[dict], expected: set[tuple[str, int]]) -> str:
    """Which (job, restart) has no record, and what each record found says (one short line
    each; a string, so pytest prints it whole)."""
    found = [(r["slurm"]["job_id"], r["slurm"]["restart"], r["status"], (r.get("error") or "")[:70])
             for r in got]  # fmt: skip
    return (
        f"missing (job, restart): {sorted(expected - _attempts(got))}; "
        f"unexpected: {sorted(_attempts(got) - expected)}; {len(got)} records (job, restart, "
        "status, error):\n" + "\n".join(map(str, found))
    )


def _log(jobs: Path, job: str) -> str:
    return next((jobs / "logs").glob(f"*-{job}.out")).read_text()


def _state(job: str, cwd) -> str:
    return slurm(["squeue", "-h", "-j", job, "-o", "%T"], cwd).stdout.strip()


def _start_now(job: str, cwd) -> bool:
    """True once the requeued job's step runs; until then its start time is set to now
    (`scontrol update` calls sbatch's --begin StartTime): Slurm puts it 2 minutes ahead (the
    credential lifetime) once the first attempt's batch step has finished."""
    if _step_running(job, cwd):
        return True
    if _state(job, cwd) == "PENDING":
        done = slurm(["scontrol", "update", f"JobId={job}", "StartTime=now"], cwd)
        # the job may start between the state read and the update (seen under load): then
        # the update has nothing to do, and the next poll finds its step
        assert done.returncode == 0 or "no longer pending" in done.stderr, done.stderr
    time.sleep(1)
    return False


def _step_running(job: str, cwd) -> bool:
    return f"{job}.0" in slurm(["squeue", "-h", "-s", "-j", job, "-o", "%i"], cwd).stdout


def _torchrun_worker(pid: int, job: str) -> bool:
    env = environ(pid) or {}
    return b"TORCHELASTIC_RUN_ID" in env and env.get(b"SLURM_JOB_ID") == job.encode()


def _has_job_dir(pid: int) -> bool:
    return b"SCALELAB_JOB_DIR" in (environ(pid) or {})


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False
