"""How cluster jobs end, without a cluster: what `scalelab slurm` and `sweep` refuse before
anything is queued, a point's identity (its node layout, the threads Slurm gives it), the
exit code a cancelled task reports, the ranks a host holds under srun, a nested launcher
refused inside an srun step, and a watched process dying with its watcher.
tests/test_slurm_cluster_ends.py runs the same endings on a real two-node Slurm."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from scalelab.cli import slurm_point
from scalelab.config import RunConfig
from scalelab.instrument.host_checks import ranks_on_host
from scalelab.orchestration import jobs, srun_task
from scalelab.record import read_records

pytestmark = pytest.mark.slurm

REFUSED = """
[study]
name = "refused"
[grid]
strategy = ["ddp"]
[fixed]
workload = "mlp"
train = true
ranks = 3
batch = 100
"""


def test_slurm_and_sweep_refuse_what_run_refuses(cli, tmp_path):
    """batch 100 over 3 ddp ranks: `run` refuses it before torchrun starts; `slurm` and
    `sweep` refuse the study alike, in one line, before any job is written or point run."""
    (tmp_path / "s.toml").write_text(REFUSED)
    out = tmp_path / "r.jsonl"
    for cmd in (["slurm", "-o", tmp_path / "jobs"], ["sweep"]):
        code, _, err = cli(cmd[0], tmp_path / "s.toml", "--out", out, *cmd[1:])
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert "point 1 (strategy=ddp)" in err and "does not divide over 3 ranks" in err, err
    assert not out.exists() and not (tmp_path / "jobs").exists()


POINT = """
[study]
name = "alloc"
[grid]
hidden = [8]
[fixed]
workload = "mlp"
strategy = "local"
batch = 4
"""
BATCH_STEP = {"SLURM_JOB_ID": "91", "SLURM_CPUS_ON_NODE": "1", "SLURM_JOB_NUM_NODES": "1"}


def test_sweep_inside_an_allocation_and_node_layouts(cli, tmp_path, monkeypatch):
    """In a batch script Slurm gives the run its thread count (1 CPU here): the point, which
    left --threads unset, ran ok and is not marked FAILED, nor run again. The same point in a
    two-node job is another point (its layout differs): still to run there."""
    for var in [v for v in os.environ if v.startswith("SLURM_") and v != "SLURM_CONF"]:
        monkeypatch.delenv(var)
    for k, v in BATCH_STEP.items():
        monkeypatch.setenv(k, v)
    (tmp_path / "s.toml").write_text(POINT)
    out = tmp_path / "r.jsonl"
    code, stdout, err = cli("sweep", tmp_path / "s.toml", "--out", out)
    assert code == 0 and "FAILED" not in stdout, stdout + err
    (rec,) = read_records(out)
    assert rec["status"] == "ok" and rec["config"]["threads"] == 1 and rec["slurm"]["nodes"] == 1
    code, stdout, _ = cli("sweep", tmp_path / "s.toml", "--out", out)
    assert "skipped" in stdout and len(read_records(out)) == 1
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "2")
    code, stdout, _ = cli("sweep", tmp_path / "s.toml", "--out", out, "--dry-run")
    assert code == 0 and "] todo " in stdout, stdout
    cfg = RunConfig(workload="mlp", strategy="local", batch=4, hidden=8, quiet=True)
    assert not slurm_point.is_done(cfg, out)  # what a generated 2-node job asks
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "1")
    assert slurm_point.is_done(cfg, out)


def test_mpiexec_inside_an_srun_step_is_refused(tmp_path):
    """`srun -n1 scalelab run ... --strategy mpi --ranks 2`: mpiexec's nested srun waited for
    the step's own CPUs for ever. Refused in one line, nothing written."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(SLURM_JOB_ID="92", SLURM_STEP_ID="0", SLURM_STEP_NUM_TASKS="1", SLURM_PROCID="0")
    out = tmp_path / "r.jsonl"
    cmd = [sys.executable, "-m", "scalelab", "run", "alexnet", "--strategy", "mpi", "--ranks"]
    cmd += ["2", "--image-size", "67", "--batch", "2", "--iters", "1", "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert "inside an srun step of 1 task(s)" in line and "srun -n 2 --mpi=pmi2" in line
    assert not out.exists()


def test_ranks_per_host_under_srun():
    """`srun -N2 -n2`: one rank on each node, not 2 on this one (the oversubscription warning
    every multi-node run gave); one node of `-n 4` with 3 here: 3."""
    step = {"SLURM_JOB_ID": "9", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2"}
    assert ranks_on_host(2, {**step, "SLURM_STEP_TASKS_PER_NODE": "1(x2)"}) == 1
    step = {**step, "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_TASKS_PER_NODE": "3,1"}
    assert ranks_on_host(4, {**step, "SLURM_NODEID": "0"}) == 3
    assert ranks_on_host(4, {"LOCAL_WORLD_SIZE": "2", **step}) == 2  # the launcher's count
    assert ranks_on_host(2, {}) == 2  # no launcher, no Slurm: one host


def test_a_cancelled_task_reports_sigterm_not_sigcont():
    """scancel sends SIGCONT, then SIGTERM: the task reports 143 (128 + 15), not 146."""
    assert srun_task.stop_code([signal.SIGCONT, signal.SIGTERM]) == 143
    stopped = [signal.SIGCONT]
    threading.Timer(0.2, stopped.append, args=(signal.SIGTERM,)).start()
    assert srun_task.stop_code(stopped) == 143
    assert srun_task.stop_code([signal.SIGUSR1]) == 128 + signal.SIGUSR1


WATCHER = """
import subprocess, sys, time
from scalelab.orchestration.jobs import dies_with_parent
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"],
                         preexec_fn=dies_with_parent())
print(child.pid, flush=True)
time.sleep(300)
"""


def test_a_watched_process_dies_with_its_watcher():
    """The watcher (srun's task, or scalelab around a launcher) SIGKILLed: what it started
    dies too, instead of running on as an orphan that scancel no longer reaches."""
    watcher = subprocess.Popen([sys.executable, "-c", WATCHER], stdout=subprocess.PIPE, text=True)
    child = int(watcher.stdout.readline())
    watcher.kill()
    watcher.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(child):
        time.sleep(0.05)
    assert not _alive(child)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_an_interactive_step_stopped_by_slurm_leaves_one_record(tmp_path, monkeypatch):
    """`srun -n2 scalelab run ...` stopped by scancel or its time limit: task 0 writes the one
    record (the other tasks, and a generated job whose script records it, write none)."""
    for var in ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "93")
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    monkeypatch.delenv(srun_task.BATCH_RECORDS_VAR, raising=False)
    cfg, out = RunConfig(workload="mlp", strategy="mpi-dp", ranks=2), tmp_path / "r.jsonl"
    stop = [signal.SIGTERM]
    assert srun_task._outcome(tmp_path, -15, time.time(), stop, cfg, out) == 143
    (rec,) = read_records(out)
    assert rec["status"] == "failed" and "step 93.0 was stopped by Slurm" in rec["error"]
    monkeypatch.setenv(srun_task.BATCH_RECORDS_VAR, "1")
    out.unlink()
    assert srun_task._outcome(tmp_path, -15, time.time(), stop, cfg, out) == 143
    assert not out.exists()
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.delenv(srun_task.BATCH_RECORDS_VAR)
    assert srun_task._outcome(tmp_path, -15, time.time(), stop, cfg, out) == 143
    assert not out.exists()


# `scontrol show job -o` in the trap of a job being stopped (Slurm 22.05, two emulated nodes):
# a time limit, then scancel; a requeued job's Restarts counts its attempts.
SHOWN = "JobId=45685572 JobName=t.sh UserId=root(0) JobState=COMPLETING Reason={} Restarts={}"


@pytest.mark.parametrize(
    ("reason", "restarts", "attempt", "near", "cause"),
    [
        ("TimeLimit", 0, "0", False, "its time limit"),
        ("None", 0, "0", False, "scancel"),
        ("None", 0, "0", True, "scancel"),  # warned, then cancelled before the limit
        ("None", 1, "0", False, "requeued: it runs again"),
        ("TimeLimit", 1, "1", False, "its time limit"),  # the requeued attempt timed out
        ("Prolog", 0, "0", False, "cancelled: Prolog"),
        (None, 0, "0", True, "its time limit"),  # scontrol could not say; USR1 came
        (None, 0, "0", False, "time limit or scancel"),
    ],
)
def test_a_stopped_jobs_cause_is_read_from_scontrol(
    tmp_path, monkeypatch, reason, restarts, attempt, near, cause
):
    """A job under 10 minutes gets no early warning: its record said "time limit or scancel".
    Now scontrol's Reason tells them apart (and Restarts a requeue)."""
    from scalelab.comm import slurm_env as slurm

    stub = tmp_path / "scontrol"
    text = "" if reason is None else SHOWN.format(reason, restarts)
    stub.write_text(f'#!/bin/bash\n[ "$4" = 45685572 ] && echo "{text}"\n')
    stub.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    info = slurm.job_info("45685572")
    assert (info.get("Reason"), info.get("JobState")) == (
        (reason, "COMPLETING") if reason else (None, None)
    )
    assert slurm.stop_cause(info, near, {"SLURM_RESTART_COUNT": attempt}) == cause
    assert slurm.job_info("") == {}  # no job id: nobody's fields


def test_a_one_process_strategy_under_several_srun_tasks_is_refused(cli, tmp_path, monkeypatch):
    """`srun -n2 scalelab run alexnet` (a one-process strategy) wrote two identical records:
    refused, said once (by task 0), nothing written."""
    out = tmp_path / "r.jsonl"
    step = {"SLURM_JOB_ID": "94", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2"}
    for task, said in (("0", 1), ("1", 0)):
        for k, v in {**step, "SLURM_PROCID": task}.items():
            monkeypatch.setenv(k, v)
        code, _, err = cli("run", "mlp", "--batch", "2", "--out", out)
        assert code == 2 and len(err.strip().splitlines()) == said, err
        assert not said or "runs in one process, but srun started 2 tasks" in err
    assert not out.exists()


def test_quiet_slurm_prints_nothing(cli, tmp_path):
    (tmp_path / "s.toml").write_text(POINT)
    code, out, err = cli("slurm", tmp_path / "s.toml", "-q", "-o", tmp_path / "j")
    assert code == 0 and out == "" and err == "" and (tmp_path / "j" / "submit_all.sh").exists()


def test_records_name_their_job_and_nodes_apart():
    """The same config on 1 and on 2 nodes: two experiments (scaling does not merge them);
    each record's Slurm job (array task, requeued attempt) and nodes are columns of the
    frame the report and runs.csv show."""
    from scalelab.analysis.frame import experiment_key, records_frame

    cfg = RunConfig(workload="mlp", strategy="mpi-dp", ranks=2).to_dict()
    one = {"workload": "mlp", "strategy": "mpi-dp", "config": cfg, "status": "ok"}
    two = {**one, "slurm": {"job_id": "7", "array_job_id": "5", "array_task_id": 2,
                            "nodes": 2, "restart": 1}}  # fmt: skip
    plain = {**one, "slurm": {"job_id": "8", "nodes": 1}}
    assert experiment_key(one) == experiment_key(plain) != experiment_key(two)
    df = records_frame([one, two, plain])
    assert list(df["nodes"]) == [1, 2, 1]
    assert list(df["slurm_job"].fillna("-")) == ["-", "5_2+1", "8"]


def test_a_rank_killed_before_its_status_page_is_not_rank_minus_one(tmp_path):
    """MPICH boxes a killed process by pid; one that died before it wrote its status page
    has no rank scalelab knows: `a rank`, not `rank -1`."""
    from scalelab.orchestration.jobs import explain

    box = ["BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES", "PID 4321 RUNNING AT nodeA",
           "KILLED BY SIGNAL: 9 (Killed)"]  # fmt: skip
    out = explain(tmp_path, box, 9, time.time(), "mpi")
    assert out.message == "scalelab: a rank on nodeA died (signal 9) during setup", out.message


def test_a_killed_peer_task_on_this_node_is_found_once(tmp_path, monkeypatch):
    """The folders of a step's tasks on one node (task<RANK>.<WATCHER PID>): one whose
    watcher is alive is not dead, one whose watcher is gone is (once: one watcher claims it);
    a peer that never made a folder is dead once `scontrol listpids` no longer lists it."""
    alive = tmp_path / f"task0.{os.getpid()}"
    gone_proc = subprocess.Popen([sys.executable, "-c", "pass"])
    gone_proc.wait()  # reaped: its pid is gone
    killed = tmp_path / f"task1.{gone_proc.pid}"
    for folder in (alive, killed):
        folder.mkdir()
    listed = {0, 1, 2}
    monkeypatch.setattr(srun_task, "_step_tasks_here", lambda: set(listed))
    seen: set[int] = set()
    assert srun_task._dead_peer(tmp_path, {1, 2}, seen) == (1, killed)
    assert srun_task._claim(tmp_path, 1) and not srun_task._claim(tmp_path, 1)
    killed.rename(tmp_path / "elsewhere")
    assert srun_task._dead_peer(tmp_path, {1, 2}, seen) is None  # task 2 still listed
    listed.discard(2)  # killed before its watcher made a folder
    assert srun_task._dead_peer(tmp_path, {1, 2}, seen) == (2, None)


def test_a_launcher_ending_while_its_children_are_read_raises_nothing(monkeypatch):
    """The forwarding timer reads the task's launchers' children from /proc; a launcher that
    ends between looking for its folder and scanning it must read as no children (it raised
    FileNotFoundError out of the timer's thread: a traceback on a scancelled step)."""
    child = subprocess.Popen(["sleep", "30"])
    try:
        assert child.pid in jobs.child_pids(os.getpid())  # the real /proc reading
    finally:
        child.kill()
        child.wait()
    assert child.pid not in jobs.child_pids(os.getpid())
    assert jobs.child_pids(child.pid) == []  # ended: nothing, no error
    # the folder is there when looked for, gone when scanned (either way of scanning it)
    for name in ("listdir", "scandir"):
        real = getattr(os, name)

        def vanished(path=".", real=real):
            if str(path).startswith("/proc/") and str(path).endswith("/task"):
                raise FileNotFoundError(path)
            return real(path)

        monkeypatch.setattr(os, name, vanished)
    assert jobs.child_pids(os.getpid()) == []
    srun_task._forward(signal.SIGTERM)  # no launcher left to pass it to: returns quietly
