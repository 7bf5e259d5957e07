"""`scalelab slurm`: generated sbatch scripts, checked by bash itself (syntax) and by running
them against stand-in srun/scontrol/python3/sbatch that record the argument vectors they
receive (tests/slurm_helpers.py), so the quoting is proven by the shell rather than by string
matching: launchers, arrays, CPUs and GPUs per task, the MPI plugin, sbatch options, time
limits, node lists and bad options. No cluster needed: tests/test_slurm_cluster.py runs the
scripts on a real Slurm."""

import os
import shlex
import subprocess
import sys

import pytest

import slurm_helpers
from scalelab.orchestration.sweep import load_study, points
from slurm_helpers import _generate

pytestmark = pytest.mark.slurm

# the stand-in binaries (autouse: first on PATH for every test here) and the study, named
# in this module so that pytest gives them to its tests
fake_bin, study = slurm_helpers.fake_bin, slurm_helpers.study


def _run_script(tmp_path, script, **env):
    args_dir = tmp_path / "args"
    args_dir.mkdir(exist_ok=True)
    for f in args_dir.iterdir():
        f.unlink()
    full_env = {
        **os.environ,
        "ARGS_DIR": str(args_dir),
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "node-[a-b]",
        **env,
    }
    proc = subprocess.run(
        ["bash", str(script)], env=full_env, cwd=tmp_path, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    (got,) = list(args_dir.iterdir())
    return got.read_bytes().decode().split("\0")[:-1]


def test_one_script_per_point_with_the_right_launcher(cli, tmp_path, study):
    out, stdout = _generate(cli, tmp_path, study)
    scripts = sorted(out.glob("point_*.sbatch"))
    assert len(scripts) == 3 and "submit_all.sh" in stdout
    for s in [*scripts, out / "submit_all.sh", out / "report.sbatch"]:
        subprocess.run(["bash", "-n", str(s)], check=True)  # valid shell
    local, mpi, ddp = (s.read_text() for s in scripts)
    assert "#SBATCH --ntasks=1" in local and "#SBATCH --nodes=1" in local
    assert "#SBATCH --partition=gpu-a" in mpi and "#SBATCH --gpus-per-node=4" in mpi
    assert "#SBATCH --nodes=2" in mpi and "#SBATCH --ntasks=8" in mpi
    # MPICH (this machine's library) speaks pmi2: chosen although srun also offers pmix
    assert "srun --nodes=2 --ntasks=8 --ntasks-per-node=4 --mpi=pmi2 python3 -m scalelab" in mpi
    assert "#SBATCH --ntasks-per-node=1" in ddp and "head=$(scontrol show hostnames" in ddp
    # one scalelab per node, which starts and watches that node's torchrun
    assert "srun --nodes=2 --ntasks=2 --ntasks-per-node=1 python3 -m scalelab)" in ddp
    assert '--nnodes 2 "--rdzv-endpoint=$head:$port" "--rdzv-id=$SLURM_JOB_ID")' in ddp
    assert "# export NCCL_DEBUG=INFO" in ddp and "# export UCX_TLS=" in ddp  # commented
    assert "%x-%j.out" in mpi


def test_arguments_survive_the_shell(cli, tmp_path, study):
    """The script, run by bash, hands python exactly the point's arguments: a value with a
    space, a quote and a $ arrives intact; the rendezvous expands to the first node and a port
    derived from the job id (two DDP jobs on one node used to collide on 29500)."""
    out, _ = _generate(cli, tmp_path, study)
    pts = points(load_study(study, tmp_path / "res" / "r.jsonl"))
    want = lambda p: [*p.argv(), "--out", str(tmp_path / "res" / "r.jsonl")]  # noqa: E731
    argv = _run_script(tmp_path, out / "point_002.sbatch")  # mpi: srun runs python directly
    assert argv == ["-m", "scalelab", *want(pts[1])]
    assert "my dir/it's $HOME" in argv
    argv = _run_script(tmp_path, out / "point_003.sbatch")  # ddp: one scalelab per node
    rdzv = ["--nnodes", "2", "--rdzv-endpoint=node-a:24242", "--rdzv-id=4242"]
    assert argv == ["-m", "scalelab", *want(pts[2]), *rdzv]
    other = _run_script(tmp_path, out / "point_003.sbatch", SLURM_JOB_ID="4243")
    assert "--rdzv-endpoint=node-a:24243" in other


def test_arrays_sized_per_point(cli, tmp_path, study):
    """One array per allocation size: each task gets its own point's allocation (not the
    largest point's), logs named by array job and task (%A_%a)."""
    out, _ = _generate(cli, tmp_path, study, "--array")
    scripts = sorted(out.glob("array_*.sbatch"))
    texts = [s.read_text() for s in scripts]
    for s in scripts:
        subprocess.run(["bash", "-n", str(s)], check=True)
    assert [t.count("#SBATCH --array=") for t in texts] == [1, 1, 1]
    local, mpi, ddp = texts
    assert "#SBATCH --array=1\n" in local and "#SBATCH --ntasks=1\n" in local
    assert "#SBATCH --nodes=1\n" in local
    assert "#SBATCH --array=2\n" in mpi and "#SBATCH --ntasks=8\n" in mpi
    assert all("%x-%A_%a.out" in t for t in texts)
    pts = points(load_study(study, tmp_path / "res" / "r.jsonl"))
    argv = _run_script(tmp_path, scripts[1], SLURM_ARRAY_TASK_ID="2")
    assert argv == ["-m", "scalelab", *pts[1].argv(), "--out", str(tmp_path / "res" / "r.jsonl")]


DDP_STUDY = """
[grid]
strategy = ["ddp", "mpi"]
[fixed]
workload = "mlp"
ranks = 4
threads = 3
"""


def test_cpus_per_task_and_threads_from_ranks(cli, tmp_path):
    """A DDP job (one torchrun task per node) asks for its ranks x threads CPUs, not 1; an MPI
    job (one task per rank) for the threads; OMP_NUM_THREADS is the threads per rank."""
    (tmp_path / "s.toml").write_text(DDP_STUDY)
    code, _, err = cli("slurm", tmp_path / "s.toml", "--nodes", "2", "-o", tmp_path / "j")
    assert code == 0, err
    ddp, mpi = (p.read_text() for p in sorted((tmp_path / "j").glob("point_*")))
    assert "#SBATCH --cpus-per-task=6" in ddp and "--ranks 4 " in ddp and "--nnodes 2 " in ddp
    assert "#SBATCH --cpus-per-task=3" in mpi and "#SBATCH --ntasks=4" in mpi
    assert "export OMP_NUM_THREADS=3" in ddp and "export OMP_NUM_THREADS=3" in mpi
    # no --python: the interpreter scalelab runs in (it has scalelab; python3 may not)
    assert f"PY={shlex.quote(sys.executable)}\n" in ddp


def test_mpi_plugin_follows_the_library(cli, tmp_path, study, monkeypatch):
    """pmix where the library speaks it and srun offers it; pmi2 where srun lacks pmix; an
    explicit --mpi-plugin wins where srun offers it, and is refused where it does not."""
    from scalelab import environment

    monkeypatch.setattr(environment, "mpi_info", lambda: {"mpi_pmi": ["pmix"]})
    out, _ = _generate(cli, tmp_path, study)
    assert "--mpi=pmix" in (out / "point_002.sbatch").read_text()
    monkeypatch.setattr(environment, "mpi_info", lambda: {"mpi_pmi": ["pmix", "pmi2"]})
    monkeypatch.setenv("MPI_LIST", "none pmi2")
    out, _ = _generate(cli, tmp_path, study)
    assert "--mpi=pmi2" in (out / "point_002.sbatch").read_text()
    monkeypatch.setenv("MPI_LIST", "none pmi2 cray_shasta")
    out, _ = _generate(cli, tmp_path, study, "--mpi-plugin", "cray_shasta")
    assert "--mpi=cray_shasta" in (out / "point_002.sbatch").read_text()
    # one srun lacks: every MPI step would fail at once, so refused before anything is queued
    code, _, err = cli("slurm", study, "--nodes", "2", "--mpi-plugin", "pmix", "-o", tmp_path / "x")
    assert code == 2 and "--mpi-plugin pmix: this Slurm's srun offers none, pmi2" in err, err
    assert not (tmp_path / "x").exists()


def test_sbatch_options_pass_through(cli, tmp_path, study):
    extra = ["--mem", "64G", "--exclusive", "--qos", "high", "--constraint", "a100"]
    extra += ["--gpus-per-task", "1", "--gpu-bind", "closest", "--account", "proj-1"]
    out, _ = _generate(cli, tmp_path, study, *extra)
    text = (out / "point_002.sbatch").read_text()
    for line in [
        "--mem=64G",
        "--exclusive",
        "--qos=high",
        "--constraint=a100",
        "--gpus-per-task=1",
        "--gpu-bind=closest",
        "--account=proj-1",
    ]:
        assert f"#SBATCH {line}\n" in text, line


def test_submit_all_passes_its_options_and_chains_the_report(cli, tmp_path, study):
    """submit_all.sh hands its arguments to every sbatch, then submits the report job with
    --dependency=afterany on every point job (it runs however they ended)."""
    out, _ = _generate(cli, tmp_path, study)
    args_dir = tmp_path / "args"
    args_dir.mkdir()
    env = {**os.environ, "ARGS_DIR": str(args_dir)}
    proc = subprocess.run(
        ["bash", str(out / "submit_all.sh"), "--qos=high", "--mem", "8G"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    calls = [(args_dir / f"sbatch-{i}").read_text().split() for i in range(1, 5)]
    assert all(c[1:4] == ["--qos=high", "--mem", "8G"] for c in calls)
    assert [c[-1] for c in calls] == [
        str(p.resolve()) for p in [*sorted(out.glob("point_*")), out / "report.sbatch"]
    ]
    assert "--dependency=afterany:1:2:3" in calls[3]
    assert "python3 -m scalelab report " in (out / "report.sbatch").read_text()


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--nodes", "1", "--gpus-per-node", "4"], "needs 8 ranks but 1 nodes x 4 per node give 4"),
        (["--time", "half an hour"], "--time 'half an hour'"),
        (["--time", "0"], "--time '0': expected a limit above 0"),  # 0: Slurm's no limit
        (["--time", "00:61:00"], "--time '00:61:00'"),  # Slurm: 01:01:00
        (["--partition", "gpu a"], "--partition 'gpu a': unexpected characters"),
        (["--nodes", "3", "--tasks-per-node", "3"], "torchrun needs ranks (8) divisible by nodes"),
        (["--cpus-per-task", "-2"], "--cpus-per-task must be >= 1, got -2"),
        (["--tasks-per-node", "0"], "--tasks-per-node must be >= 1, got 0"),
        (["--mem", "lots"], "--mem 'lots'"),
        (["--qos", "a;b"], "--qos 'a;b': unexpected characters"),
        (["--nodes", "1,0"], "--nodes '1,0': expected a node count >= 1"),
        (["--nodes", "two"], "--nodes 'two': expected a node count >= 1"),
    ],
)
def test_bad_options_one_line_exit_2(cli, tmp_path, study, args, needle):
    code, _, err = cli("slurm", study, "-o", tmp_path / "jobs", *args)
    assert code == 2 and len(err.strip().splitlines()) == 1 and needle in err, err
    assert not (tmp_path / "jobs").exists()


def test_gpu_points_need_a_gpu_request(cli, tmp_path):
    """A --device cuda point in jobs that ask for no GPU is refused before anything is written."""
    study = DDP_STUDY.replace("threads = 3", 'device = "cuda"').replace(', "mpi"', "")
    (tmp_path / "s.toml").write_text(study)  # (mpi on cuda: refused as `run` refuses it)
    code, _, err = cli("slurm", tmp_path / "s.toml", "--gpus-per-node", "0", "-o", tmp_path / "j")
    assert code == 2 and "--device cuda but the jobs ask for no GPU" in err, err
    assert not (tmp_path / "j").exists()


def test_time_limits_as_slurm_reads_them(cli, tmp_path, study):
    """UNLIMITED is written (no early warning: no limit to warn of); 1-2 is a day and two
    hours, so a warning 2 minutes ahead of it is asked for."""
    out, _ = _generate(cli, tmp_path, study, "--time", "UNLIMITED")
    text = (out / "point_001.sbatch").read_text()
    assert "#SBATCH --time=UNLIMITED\n" in text and "--signal" not in text
    out, _ = _generate(cli, tmp_path, study, "--time", "1-2")
    assert "#SBATCH --signal=B:USR1@120\n" in (out / "point_001.sbatch").read_text()


def test_gpus_per_task_counts_a_torchrun_tasks_ranks(cli, tmp_path):
    """--gpus-per-task is per rank: a DDP point's task is one torchrun per node running 2
    ranks there, so it asks for 2 GPUs (it asked for 1 while 2 ranks wanted one each)."""
    study = DDP_STUDY.replace("threads = 3", 'device = "cuda"').replace(', "mpi"', "")
    (tmp_path / "s.toml").write_text(study)
    code, _, err = cli("slurm", tmp_path / "s.toml", "--nodes", "2", "--gpus-per-task", "1",
                       "-o", tmp_path / "j")  # fmt: skip
    assert code == 0, err
    ddp = (tmp_path / "j" / "point_001.sbatch").read_text()
    assert "#SBATCH --gpus-per-task=2\n" in ddp and "--nnodes 2 " in ddp


def test_a_node_list_writes_each_point_once_per_layout(cli, tmp_path, study):
    """--nodes 1,2 (was refused): the 8-rank mpi and ddp points once on one node and once
    spread over two, the one-process point once; each job asks for its nodes and launches
    over them; the array form groups them the same way."""
    out = tmp_path / "jobs"
    code, _, err = cli("slurm", study, "--nodes", "1,2", "-o", out, "--python", "python3")
    assert code == 0, err
    names = sorted(p.name for p in out.glob("point_*"))
    assert names == [f"point_00{i}_n{n}.sbatch" for i, n in
                     [(1, 1), (2, 1), (2, 2), (3, 1), (3, 2)]]  # fmt: skip
    for name in names:
        text, nodes = (out / name).read_text(), name[-8]
        assert f"#SBATCH --nodes={nodes}\n" in text and f"-n{nodes}\n" in text
    assert (
        "launch=(srun --nodes=2 --ntasks=8 --ntasks-per-node=4 --mpi="
        in (out / "point_002_n2.sbatch").read_text()
    )
    assert (
        "launch=(srun --nodes=2 --ntasks=2 --ntasks-per-node=1 "
        in (out / "point_003_n2.sbatch").read_text()
    )  # ddp: one torchrun per node
    submit = (out / "submit_all.sh").read_text()
    assert submit.count("sbatch --parsable") == 6  # five points and the report
    for name in names:
        assert str((out / name).resolve()) in submit
    arrays = tmp_path / "arrays"
    code, _, err = cli("slurm", study, "--nodes", "1,2", "--array", "-o", arrays)
    assert code == 0, err
    texts = [p.read_text() for p in sorted(arrays.glob("array_*"))]
    assert sorted(t.split("--nodes=")[1][0] for t in texts) == ["1", "1", "1", "2", "2"]
