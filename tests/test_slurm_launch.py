"""What scalelab reads from Slurm's environment: who launched it, how many ranks, the
rendezvous, the CPUs per task, the job a record belongs to, and which MPI and PMI it has.
Environments are the ones Slurm 22.05 sets (tests/test_slurm_cluster.py runs the real thing)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from scalelab import environment
from scalelab.comm import launch, mpi
from scalelab.comm import slurm_env as slurm
from scalelab.config import RunConfig
from scalelab.record import new_record

pytestmark = pytest.mark.slurm

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

BATCH = {  # an sbatch -n 2 script, as Slurm 22.05 sets it up (no SLURM_STEP_ID)
    "SLURM_JOB_ID": "77",
    "SLURM_PROCID": "0",
    "SLURM_NTASKS": "2",
    "SLURM_CPUS_ON_NODE": "2",
    "SLURM_TASKS_PER_NODE": "2",
    "SLURM_JOB_NODELIST": "n1",
    "SLURM_JOB_PARTITION": "debug",
    "SLURM_JOB_NUM_NODES": "1",
}
STEP = {  # task 3 of `srun -N2 -n4` (2 per node), in job 77 with 8 CPUs per node
    **BATCH,
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "3",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_NTASKS": "4",
    "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
    "SLURM_CPUS_ON_NODE": "8",
    "SLURM_STEP_NODELIST": "n[3-4]",
    "SLURM_JOB_NODELIST": "n[3-4]",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_ARRAY_TASK_ID": "5",
}
LAUNCHER_VARS = [*launch.MPI_RANK_VARS, *launch.LOCAL_SIZE_VARS, "RANK", "WORLD_SIZE"]
LAUNCHER_VARS += ["MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "TORCHELASTIC_RUN_ID", "PMI_SIZE"]


@pytest.fixture
def env(monkeypatch):
    """Set a Slurm environment (and nothing of any other launcher) for one test."""
    for var in list(os.environ):
        if (var.startswith("SLURM_") and var != "SLURM_CONF") or var in LAUNCHER_VARS:
            monkeypatch.delenv(var)

    def use(values):
        for k, v in values.items():
            monkeypatch.setenv(k, v)

    return use


def test_hostlists_and_tasks_per_node():
    assert slurm.expand_hostlist("n[1-3,7],gpu01") == ["n1", "n2", "n3", "n7", "gpu01"]
    assert slurm.expand_hostlist("a[08-10]x") == ["a08x", "a09x", "a10x"]
    spec = {"SLURM_STEP_TASKS_PER_NODE": "3(x2),1"}
    assert slurm.tasks_on_this_node({**spec, "SLURM_NODEID": "1"}) == 3
    assert slurm.tasks_on_this_node({**spec, "SLURM_NODEID": "2"}) == 1


def test_the_batch_step_is_not_a_launcher(env):
    """`scalelab run --ranks 2` inside an sbatch script starts its own ranks ("--ranks 2 but
    the launcher started 1" before)."""
    env(BATCH)
    assert slurm.step_tasks() is None and not launch.inside_mpi_launcher()
    assert not launch.inside_launcher("torchrun")
    cfg = launch.settle_config(RunConfig(workload="mlp", strategy="mpi-dp", ranks=2), "mpi")
    assert cfg.ranks == 2 and cfg.threads == 2  # the batch step's 2 CPUs, one process


def test_srun_tasks_are_the_ranks(env):
    """`srun -n 4 scalelab run ...` without --ranks is a 4-rank run (the record said ranks 4
    but config.ranks 1), with the CPUs Slurm gave each task as threads (torch's default
    oversubscribed them: 1.53 s a pass against 0.14 s)."""
    env(STEP)
    assert launch.inside_mpi_launcher() and slurm.step_tasks() == 4
    cfg = launch.settle_config(RunConfig(workload="alexnet", strategy="mpi"), "mpi")
    assert (cfg.ranks, cfg.threads) == (4, 4)  # 8 CPUs on the node, 2 tasks on it
    mine = launch.settle_config(RunConfig(workload="alexnet", strategy="mpi", threads=1), "mpi")
    assert mine.threads == 1
    env({"SLURM_CPUS_PER_TASK": "3"})
    assert launch.settle_config(RunConfig(workload="alexnet", strategy="mpi"), "mpi").threads == 3


def test_one_task_step_starts_its_own_ranks(env):
    env({**STEP, "SLURM_STEP_NUM_TASKS": "1", "SLURM_NTASKS": "1"})
    assert not launch.inside_mpi_launcher()


def test_torch_rendezvous_from_slurm(env):
    """Under srun, torch.distributed takes rank, world and local rank from Slurm, meets on the
    step's first node, at a port derived from the job id."""
    env(STEP)
    launch.adopt_srun_step("torchrun")
    try:
        assert launch.inside_torchrun()
        got = {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
        assert got == {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "n3"}
        assert os.environ["MASTER_PORT"] == str(20000 + 77)
        assert slurm.rendezvous_port(20077) != slurm.rendezvous_port(20078)
    finally:
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            os.environ.pop(k, None)


def test_records_carry_the_job(env):
    env(STEP)
    job = new_record(status="ok")["slurm"]
    assert job["job_id"] == "77" and job["array_task_id"] == 5
    assert (job["node_list"], job["partition"], job["nodes"], job["tasks"]) == (
        "n[3-4]",
        "debug",
        2,
        4,
    )


def test_no_slurm_no_job_field(env):
    assert "slurm" not in new_record(status="ok")
    assert launch.default_threads() is None


VERSIONS = {
    "Open MPI v4.1.5, package: Open MPI builder, ident: 4.1.5": ["pmix"],
    "MPICH Version: 5.0.2\nMPICH configure: --with-device=ch4:ucx,ofi --with-pm=hydra": ["pmi2"],
    "MPICH Version: 4.1\nMPICH configure: --with-pmix=/opt/pmix --with-pm=no": ["pmix", "pmi2"],
}


@pytest.mark.parametrize("version, pmi", VERSIONS.items())
def test_which_pmi_a_library_speaks(version, pmi):
    assert environment.mpi_pmi(version) == pmi


WHEEL = "MPICH Version:      5.0.2\nMPICH Device:       ch4:ucx ofi\nMPICH configure: ..."
UCX_ONLY = "MPICH Version:      4.2.0\nMPICH Device:       ch4:ucx\n"
PMI2_TASK = {**STEP, "SLURM_MPI_TYPE": "pmi2", "PMI_FD": "11", "PMI_RANK": "0", "PMI_SIZE": "2"}


@pytest.mark.parametrize(
    "env, version, want",
    [
        (PMI2_TASK, WHEEL, {"MPIR_CVAR_CH4_NETMOD": "ofi"}),  # UCX's card would hang Slurm
        ({**PMI2_TASK, "MPICH_CH4_NETMOD": "ucx"}, WHEEL, {}),  # the user's choice stays
        ({**PMI2_TASK, "MPIR_CVAR_CH4_NETMOD": "ucx"}, WHEEL, {}),
        ({**PMI2_TASK, "MPI_LOCALNRANKS": "2"}, WHEEL, {}),  # Hydra's PMI server inside a step
        ({**STEP, "SLURM_MPI_TYPE": "pmix"}, WHEEL, {}),
        (STEP, WHEEL, {}),  # no PMI at all: refused later (check_spans_srun)
        ({}, WHEEL, {}),  # mpiexec outside Slurm
        (PMI2_TASK, UCX_ONLY, {}),  # nothing to switch to
        (PMI2_TASK, "Open MPI v4.1.5, package: Open MPI builder, ident: 4.1.5", {}),
    ],
)
def test_mpich_under_srun_pmi2_uses_ofi_unless_told(env, version, want):
    """Slurm's pmi2 plugin reads a PMI-1 request in one 1024-byte read; UCX's 4096-byte
    business card goes in lines up to ~1084 bytes and hangs MPI_Init (OFI's: 72 bytes)."""
    assert mpi.slurm_pmi2_netmod(env, version) == want


def test_env_names_mpi_pmi_and_cuda_awareness(cli):
    pytest.importorskip("mpi4py")
    code, out, _ = cli("env")
    assert code == 0
    for key in ("mpi_library", "mpi_pmi", "mpi_cuda_aware", "mpiexec"):
        assert key in out


def test_the_mpiexec_of_mpi4pys_library_comes_first(monkeypatch, tmp_path):
    """A site MPI loaded for mpi4py brings its own mpiexec; the venv's (pip's MPICH) and
    PATH's come after it."""
    site = tmp_path / "site" / "bin" / "mpiexec"
    site.parent.mkdir(parents=True)
    site.write_text("#!/bin/sh\n")
    monkeypatch.setattr(environment, "mpiexec_of_library", lambda: site)
    assert launch.find_mpiexec() == str(site)


def test_the_library_mpiexec_is_found_beside_libmpi():
    pytest.importorskip("mpi4py")
    lib = environment.mpi_library_path()
    if lib is None:
        pytest.skip("no libmpi loaded")
    found = environment.mpiexec_of_library()
    assert found is not None and found.parent.parent in (
        lib.parent.parent,
        lib.resolve().parent.parent,
    )


def test_mpi_extra_is_mpi4py_only():
    """`.[mpi]` uses the site MPI; MPICH comes with `.[mpich]` (the laptop command)."""
    extras = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    extras = extras["project"]["optional-dependencies"]
    assert [d.split(">")[0] for d in extras["mpi"]] == ["mpi4py"]
    assert any(d.startswith("mpich") for d in extras["mpich"])
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    assert '".[mpich,plot]"' in readme and '".[mpich,test,hf]"' in readme


def test_a_rank_aborted_by_a_dead_peer_stays_quiet_when_the_step_is_cancelled(
    monkeypatch, tmp_path, capsys
):
    """Task 0's rank dies of SIGABRT (UCX aborting on a killed peer): the dead rank's task
    cancels the step within the grace and task 0 says nothing; with no cancel coming, the
    abort is this rank's own and is named, and the step is ended."""
    import signal
    import threading

    from scalelab.orchestration import srun_task

    ended = []
    monkeypatch.setattr(srun_task, "_end_step", lambda: ended.append(True))
    monkeypatch.setattr(srun_task, "PEER_GRACE_S", 1.0)
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURMD_NODENAME", "n1")
    cfg = RunConfig(workload="alexnet", strategy="mpi", ranks=2)
    cancelled: list[int] = []  # the dead rank's task's scancel reaches this task a bit later
    threading.Timer(0.05, lambda: cancelled.append(signal.SIGTERM)).start()
    code = srun_task._outcome(tmp_path, -signal.SIGABRT, 0.0, cancelled, cfg, None)
    assert code == 128 + signal.SIGTERM and not ended and capsys.readouterr().err == ""
    code = srun_task._outcome(tmp_path, -signal.SIGABRT, 0.0, [], cfg, None)
    err = capsys.readouterr().err
    assert code == 1 and ended and err.startswith("scalelab: rank 0 on n1 died (signal 6)")


def test_rendezvous_ports_stay_below_the_ports_linux_gives_clients():
    """Linux gives outgoing connections local ports from 32768-60999 (ip_local_port_range's
    default): a rendezvous port there may be held by any client socket on the head node, and
    a two-node ddp point under load then failed (both agents took themselves for clients of
    a store nobody served). The batch script's shell line gives the port Python gives."""
    assert max(slurm.rendezvous_port(j) for j in range(slurm.RDZV_PORT_SPAN)) < 32768
    assert min(slurm.rendezvous_port(j) for j in range(slurm.RDZV_PORT_SPAN)) >= 1024
    for job in (0, 77, 46174046, 2**31 - 1):
        shell = f"SLURM_JOB_ID={job}; {slurm.RDZV_PORT_SHELL}; echo $port"
        out = subprocess.run(["bash", "-c", shell], capture_output=True, text=True, check=True)
        assert int(out.stdout) == slurm.rendezvous_port(job)
