"""The CLI end to end: every bad input gets one line, exit 2, no traceback, no record."""

import gzip
import json
import struct
import subprocess
import sys

import pytest
import torch

from scalelab.record import read_records


def _assert_usage_error(result, needle, results_file):
    code, out, err = result
    assert code == 2, (code, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], err
    assert "Traceback" not in err
    assert not results_file.exists()


@pytest.mark.parametrize(
    "args, needle",
    [
        (["run", "nosuchnet"], "unknown workload 'nosuchnet'"),
        (["run", "alexnet", "--strategy", "warp"], "unknown strategy 'warp'"),
        (["run", "alexnet", "--dtype", "fp8"], "unknown dtype 'fp8'"),
        (["run", "alexnet", "--batch", "0"], "--batch must be >= 1"),
        (["run", "alexnet", "--batch", "two"], "invalid int value"),
        (["run", "alexnet", "--image-size", "40"], "image-size"),
        (["run", "alexnet", "--data-dir", "/no/such/dir"], "no such directory"),
        (["run", "alexnet", "--strategy", "serial", "--device", "cuda"], "CPU only"),
        (["run", "mlp", "--sync-bn"], "add --train"),
    ],
)
def test_bad_input_one_line_exit_2(cli, tmp_path, args, needle):
    results = tmp_path / "runs.jsonl"
    _assert_usage_error(cli(*args, "--out", results), needle, results)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_gpu(cli, tmp_path):
    results = tmp_path / "runs.jsonl"
    _assert_usage_error(
        cli("run", "mlp", "--device", "cuda", "--out", results), "no CUDA GPU", results
    )


def test_corrupt_mnist(cli, tmp_path):
    (tmp_path / "t10k-images-idx3-ubyte").write_bytes(struct.pack(">IIII", 1234, 1, 28, 28))
    (tmp_path / "t10k-labels-idx1-ubyte").write_bytes(struct.pack(">II", 2049, 1) + b"\x03")
    results = tmp_path / "runs.jsonl"
    _assert_usage_error(
        cli("run", "mlp", "--batch", "1", "--data-dir", tmp_path, "--out", results),
        "magic",
        results,
    )


def test_truncated_mnist(cli, tmp_path):
    with gzip.open(tmp_path / "t10k-images-idx3-ubyte.gz", "wb") as f:
        f.write(struct.pack(">IIII", 2051, 10, 28, 28) + bytes(100))  # 10 images promised
    with gzip.open(tmp_path / "t10k-labels-idx1-ubyte.gz", "wb") as f:
        f.write(struct.pack(">II", 2049, 10) + bytes(10))
    results = tmp_path / "runs.jsonl"
    code, out, err = cli("run", "mlp", "--batch", "1", "--data-dir", tmp_path, "--out", results)
    assert code == 2 and len(err.strip().splitlines()) == 1 and not results.exists()


def test_csv_unknown_label(cli, tmp_path):
    (tmp_path / "test.csv").write_text('label,title,description\n3,"a","b"\n9,"c","d"\n')
    results = tmp_path / "runs.jsonl"
    code, out, err = cli("run", "charcnn", "--batch", "2", "--data-dir", tmp_path, "--out", results)
    assert code == 2 and "label" in err and "3" in err and not results.exists()


def test_run_writes_record_and_json_last_line(cli, tmp_path):
    results = tmp_path / "runs.jsonl"
    code, out, err = cli(
        "run",
        "alexnet",
        "--batch",
        "2",
        "--image-size",
        "67",
        "--check",
        "--iters",
        "5",
        "--warmup",
        "1",
        "--json",
        "--out",
        results,
    )
    assert code == 0, err
    rec = json.loads(out.strip().splitlines()[-1])
    (stored,) = read_records(results)
    assert stored == rec
    for key in (
        "config",
        "env",
        "git_commit",
        "wall_s",
        "throughput",
        "phases",
        "relerr",
        "digest",
    ):
        assert key in rec
    assert rec["relerr"] < 1e-5 and rec["check_passed"]
    assert set(rec["phases"]) == {"h2d", "compute", "d2h"}
    # Phases account for the wall time of an iteration (sync at every boundary on CPU). Of 5
    # iterations the record keeps the lower median's phases: one the OS preempted between two
    # phases (its wall longer) is not it on a loaded host.
    assert sum(rec["phases"].values()) == pytest.approx(rec["wall_s"], rel=0.05)


def test_console_script_exit_code():
    """The installed entry point, as a user runs it (not the in-process main)."""
    proc = subprocess.run(
        [sys.executable, "-m", "scalelab", "run", "alexnet", "--batch", "-3"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == "scalelab run: error: --batch must be >= 1, got -3"


def test_list_names_everything(cli):
    code, out, _ = cli("list")
    assert code == 0
    for name in (
        "alexnet",
        "charcnn",
        "mlp",
        "resnet18",
        "resnet18-cifar",
        "vgg16",
        "deepstack",
        "serial",
        "local",
    ):
        assert f"  {name} " in out


def test_named_commit_wins_over_a_stale_git(monkeypatch):
    """A tree copied to a device machine can carry an old .git; the commit the copy was made
    from (SCALELAB_GIT_COMMIT) is what records must say. Without it, this checkout's HEAD."""
    from scalelab import environment

    monkeypatch.delenv("SCALELAB_GIT_COMMIT", raising=False)
    environment.git_commit.cache_clear()  # one answer per process, cached
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    assert environment.git_commit()["git_commit"] == head.strip()
    monkeypatch.setenv("SCALELAB_GIT_COMMIT", "0" * 40)
    environment.git_commit.cache_clear()
    assert environment.git_commit() == {"git_commit": "0" * 40, "git_dirty": None}
    environment.git_commit.cache_clear()


def test_an_env_has_the_same_fields_whether_or_not_mpi_was_loaded():
    """A record's env must not depend on whether an earlier step of this process happened to
    load MPI (a Slurm stop record, made without it, is compared field by field)."""
    pytest.importorskip("mpi4py")
    from scalelab import environment

    loaded = environment.mpi_info()  # loads the library, as an MPI run would
    if loaded["mpi_library"] is None:
        pytest.skip("mpi4py finds no MPI library here")
    assert list(environment.NO_MPI) == list(loaded)
