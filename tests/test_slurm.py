"""`scalelab slurm`: generated sbatch scripts, checked by bash itself (syntax) and by running
them against stand-in srun/scontrol/python3 that record the argument vectors they receive, so
the quoting is proven by the shell rather than by string matching. No cluster needed."""

import os
import shlex
import subprocess

import pytest

from scalelab.analysis.sweep import load_study, points

STUDY = """
[study]
name = "slurm t"
[grid]
workload = ["mlp"]
strategy = ["local", "mpi", "ddp"]
ranks = [8]
[fixed]
hidden = 16
ckpt_dir = "my dir/it's $HOME"
"""

FAKES = {
    # srun: drop its own options, run the command once (enough to see the argument vector)
    "srun": '#!/bin/bash\nwhile [[ "$1" == --* ]]; do shift; done\nexec "$@"\n',
    # scontrol: many nodes, so a reader that stops early (head -n 1) would SIGPIPE it
    "scontrol": '#!/bin/bash\necho node-a; seq -f "node-%g" 1 20000\n',
    # python3: write each argument NUL-terminated to a fresh file
    "python3": '#!/bin/bash\nf=$(mktemp -p "$ARGS_DIR")\nfor a in "$@"; do printf "%s\\0" "$a"; '
    'done > "$f"\n',
}


@pytest.fixture
def study(tmp_path):
    path = tmp_path / "study.toml"
    path.write_text(STUDY)
    return path


def _generate(cli, tmp_path, study, *extra):
    out = tmp_path / "jobs"
    code, stdout, err = cli(
        "slurm",
        study,
        "--nodes",
        2,
        "--gpus-per-node",
        4,
        "--partition",
        "gpu-a",
        "--time",
        "00:30:00",
        "-o",
        out,
        "--out",
        tmp_path / "res" / "r.jsonl",
        *extra,
    )
    assert code == 0, err
    return out, stdout


def _run_script(tmp_path, script, **env):
    bin_dir, args_dir = tmp_path / "fakebin", tmp_path / "args"
    bin_dir.mkdir(exist_ok=True)
    args_dir.mkdir(exist_ok=True)
    for f in args_dir.iterdir():
        f.unlink()
    for name, body in FAKES.items():
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    full_env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
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
    for s in [*scripts, out / "submit_all.sh"]:
        subprocess.run(["bash", "-n", str(s)], check=True)  # valid shell
    local, mpi, ddp = (s.read_text() for s in scripts)
    assert "#SBATCH --ntasks=1" in local and "#SBATCH --nodes=1" in local
    assert "#SBATCH --partition=gpu-a" in mpi and "#SBATCH --gpus-per-node=4" in mpi
    assert "#SBATCH --nodes=2" in mpi and "#SBATCH --ntasks=8" in mpi
    assert "srun --nodes=2 --ntasks=8 --ntasks-per-node=4 python3 -m scalelab run" in mpi
    assert "#SBATCH --ntasks-per-node=1" in ddp and "head=$(scontrol show hostnames" in ddp
    assert "--nnodes=2 --nproc-per-node=4 --rdzv-backend=c10d" in ddp
    assert "# export NCCL_DEBUG=INFO" in ddp and "# export UCX_TLS=" in ddp  # commented
    submit = (out / "submit_all.sh").read_text().splitlines()
    assert [shlex.split(ln)[1] for ln in submit[2:]] == [str(s.resolve()) for s in scripts]


def test_arguments_survive_the_shell(cli, tmp_path, study):
    """The script, run by bash, hands python exactly the point's arguments: a value with a
    space, a quote and a $ arrives intact; the rendezvous expands to the first node."""
    out, _ = _generate(cli, tmp_path, study)
    pts = points(load_study(study, tmp_path / "res" / "r.jsonl"))
    want = lambda p: [*p.argv(), "--out", str(tmp_path / "res" / "r.jsonl")]  # noqa: E731
    argv = _run_script(tmp_path, out / "point_002.sbatch")  # mpi: srun runs python directly
    assert argv == ["-m", "scalelab", *want(pts[1])]
    assert "my dir/it's $HOME" in argv
    argv = _run_script(tmp_path, out / "point_003.sbatch")  # ddp: one torchrun per node
    assert argv[:2] == ["-m", "torch.distributed.run"]
    assert "--rdzv-endpoint=node-a:29500" in argv and "--rdzv-id=4242" in argv
    assert argv[argv.index("scalelab") - 1 :] == ["-m", "scalelab", *want(pts[2])]


def test_job_array(cli, tmp_path, study):
    out, stdout = _generate(cli, tmp_path, study, "--array")
    script = out / "array.sbatch"
    text = script.read_text()
    subprocess.run(["bash", "-n", str(script)], check=True)
    assert "#SBATCH --array=1-3" in text and "#SBATCH --nodes=2" in text
    assert "#SBATCH --ntasks=8" in text  # the largest point's allocation
    pts = points(load_study(study, tmp_path / "res" / "r.jsonl"))
    argv = _run_script(tmp_path, script, SLURM_ARRAY_TASK_ID="2")
    assert argv == ["-m", "scalelab", *pts[1].argv(), "--out", str(tmp_path / "res" / "r.jsonl")]


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--nodes", "1", "--gpus-per-node", "4"], "needs 8 ranks but 1 nodes x 4 per node give 4"),
        (["--time", "half an hour"], "--time 'half an hour'"),
        (["--partition", "gpu a"], "--partition 'gpu a': unexpected characters"),
        (["--nodes", "3", "--tasks-per-node", "3"], "torchrun needs ranks (8) divisible by nodes"),
    ],
)
def test_bad_options_one_line_exit_2(cli, tmp_path, study, args, needle):
    code, _, err = cli("slurm", study, "-o", tmp_path / "jobs", *args)
    assert code == 2 and len(err.strip().splitlines()) == 1 and needle in err, err
