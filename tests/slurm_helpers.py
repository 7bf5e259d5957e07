"""Shared by the tests of `scalelab slurm`'s generated scripts (test_slurm.py,
test_slurm_script_ends.py): a study, the stand-in srun/scontrol/python3/sbatch that record the
argument vectors they receive (first on PATH for every test of a file that names the
`fake_bin` fixture), and the generation of a study's jobs."""

import os

import pytest

STUDY = """
[study]
name = "slurm t"
[grid]
workload = ["mlp"]
strategy = ["local", "mpi", "ddp"]
ranks = [8]
[fixed]
hidden = 16
save_weights = "my dir/it's $HOME"
"""

FAKES = {
    # srun: answer --mpi=list from $MPI_LIST; else drop its own options and run the command
    # once (enough to see the argument vector)
    "srun": '#!/bin/bash\nif [ "$1" = --mpi=list ]; then printf "MPI plugin types are...\\n";'
    ' for p in $MPI_LIST; do printf "\\t%s\\n" "$p"; done; exit 0; fi\n'
    'while [[ "$1" == --* ]]; do shift; done\nexec "$@"\n',
    # scontrol: many nodes, so a reader that stops early (head -n 1) would SIGPIPE it
    "scontrol": '#!/bin/bash\necho node-a; seq -f "node-%g" 1 20000\n',
    # python3: the point helper says "not done"; a run writes each argument NUL-terminated to
    # a fresh file
    "python3": '#!/bin/bash\n[ "$2" = scalelab.cli.slurm_point ] && exit 1\n'
    'f=$(mktemp -p "$ARGS_DIR")\nfor a in "$@"; do printf "%s\\0" "$a"; done > "$f"\n',
    # sbatch: record its arguments one per line, answer a job id
    "sbatch": '#!/bin/bash\nn=$(ls "$ARGS_DIR" | wc -l)\nprintf "%s\\n" "$@" > '
    '"$ARGS_DIR/sbatch-$((n + 1))"\necho $((n + 1))\n',
}


@pytest.fixture(autouse=True)
def fake_bin(tmp_path, monkeypatch):
    """The fakes first on PATH, for generation (srun --mpi=list) and for running scripts."""
    bin_dir = tmp_path / "fakebin"
    bin_dir.mkdir()
    for name, body in FAKES.items():
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("MPI_LIST", "pmix none cray_shasta pmi2")
    return bin_dir


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
        "--python",
        "python3",
        *extra,
    )
    assert code == 0, err
    return out, stdout
