"""The CLI's conventions, each against the real command: no wrong "ok" (non-finite weights or
outputs fail and write no weights), --json stdout is one JSON document, a closed pipe ends
quietly, -q silences progress, outputs are checked before any work, every exit code is one of
the contract's."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

from scalelab.config import RunConfig
from scalelab.record import read_records
from scalelab.weights import save_weights
from scalelab.workloads import WORKLOADS

MLP = ["run", "mlp", "--hidden", "4", "--batch", "4", "--iters", "1", "--warmup", "0"]
TRAIN = [*MLP, "--train", "--steps", "2", "--train-size", "16", "--heldout-size", "8"]


def _nan_weights(path):
    model = WORKLOADS.get("mlp")(RunConfig(workload="mlp", hidden=4)).build_model()
    with torch.no_grad():
        next(iter(model.parameters())).fill_(float("nan"))
    save_weights(model, str(path))


def test_non_finite_outputs_fail_the_run_with_a_record(cli, tmp_path):
    _nan_weights(tmp_path / "w.safetensors")
    code, out, err = cli(
        *MLP, "--weights", tmp_path / "w.safetensors", "--out", tmp_path / "r.jsonl"
    )
    assert code == 1 and len(err.strip().splitlines()) == 1 and "NaN or inf" in err
    (rec,) = read_records(tmp_path / "r.jsonl")
    assert rec["status"] == "failed" and "NaN or inf" in rec["error"]


def test_non_finite_training_writes_no_weights(cli, tmp_path):
    _nan_weights(tmp_path / "w.pt")
    saved = tmp_path / "trained.pt"
    code, _, err = cli(
        *TRAIN,
        "--weights",
        tmp_path / "w.pt",
        "--save-weights",
        saved,
        "--out",
        tmp_path / "r.jsonl",
    )
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert not saved.exists()
    assert all(r["status"] == "failed" for r in read_records(tmp_path / "r.jsonl"))


def test_save_weights_on_inference_writes_the_weights_it_ran(cli, tmp_path):
    code, _, err = cli(*MLP, "--save-weights", tmp_path / "w.pt", "--no-record")
    assert code == 0, err
    built = WORKLOADS.get("mlp")(RunConfig(workload="mlp", hidden=4)).build_model().state_dict()
    saved = torch.load(tmp_path / "w.pt")
    assert saved.keys() == built.keys()
    assert all(torch.equal(saved[k], built[k]) for k in built)


def test_refusals_are_one_line_exit_2_and_write_nothing(cli, tmp_path):
    (tmp_path / "file").write_text("x")
    cases = [
        [*MLP, "--momentum", "nan"],
        [*MLP, "--lr", "1e300"],
        [*MLP, "--seed", str(2**64)],
        [*MLP, "--out", tmp_path / "file" / "r.jsonl"],
        [*MLP, "--out", tmp_path],
        [*TRAIN, "--save-weights", tmp_path / "file" / "w.pt"],
        [*TRAIN, "--ckpt-every", "1", "--ckpt-dir", tmp_path / "file" / "c"],
    ]
    for args in cases:
        before = sorted(tmp_path.rglob("*"))
        code, out, err = cli(*args)
        assert code == 2 and len(err.strip().splitlines()) == 1, (args, err)
        assert sorted(tmp_path.rglob("*")) == before, args


def test_json_stdout_is_one_document(cli, tmp_path):
    code, out, err = cli(*TRAIN, "--json", "--out", tmp_path / "r.jsonl")
    assert code == 0 and json.loads(out)["status"] == "ok"
    assert "final loss" in err  # the human summary went to stderr
    code, out, err = cli(*TRAIN, "--lr", "0.1,0.2", "--json", "--out", tmp_path / "r.jsonl")
    assert code == 0 and [r["config"]["lr"] for r in json.loads(out)] == [0.1, 0.2]


@pytest.mark.mpi
@pytest.mark.parametrize(
    "extra",
    [
        ["--strategy", "mpi-dp", "--lr", "0.1,0.2", "--no-record"],  # mpiexec, a comma list
        ["--strategy", "ddp", "--lr", "0.1", "--out", "r.jsonl"],  # torchrun, one run
    ],
    ids=["mpiexec-list-no-record", "torchrun-one"],
)
def test_json_under_a_launcher_is_one_document(tmp_path, extra):
    """The ranks print nothing on stdout: the root rank hands its record to the launching
    process, which prints the one document (a list for a comma list) after the job."""
    cmd = [sys.executable, "-m", "scalelab", *TRAIN, "--ranks", "2", "--json", *extra]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)  # the whole of stdout
    records = doc if isinstance(doc, list) else [doc]
    want = [0.1, 0.2] if "0.1,0.2" in extra else [0.1]
    assert [r["config"]["lr"] for r in records] == want
    assert all(r["status"] == "ok" and r["ranks"] == 2 for r in records)
    assert "final loss" in done.stderr  # the summaries went to stderr
    assert ("r.jsonl" in extra) == (tmp_path / "r.jsonl").exists()


def test_env_json_is_one_document(cli):
    code, out, _ = cli("env", "--json")
    assert code == 0 and isinstance(json.loads(out), dict)


def test_quiet_keeps_progress_off(cli, tmp_path):
    _, _, loud = cli(*TRAIN, "--out", tmp_path / "r.jsonl")
    _, _, quiet = cli(*TRAIN, "-q", "--out", tmp_path / "r.jsonl")
    assert "train 2/2" in loud and "train 2/2" not in quiet


def test_a_closed_pipe_ends_quietly():
    shell = f"{sys.executable} -m scalelab layers vgg16 | head -2"
    done = subprocess.run(["bash", "-o", "pipefail", "-c", shell], capture_output=True, text=True)
    assert len(done.stdout.splitlines()) == 2
    assert done.stderr == "" and done.returncode == 0


def test_an_internal_error_is_exit_3(cli, monkeypatch):
    """A bug (an exception no layer turned into a refusal) is exit 3, one line, not 1."""
    import scalelab.cli.commands.layers as layers

    def broken(*args, **kwargs):
        raise KeyError("a bug")

    monkeypatch.setattr(layers, "workload_config", broken)
    monkeypatch.delenv("SCALELAB_DEBUG", raising=False)
    code, _, err = cli("layers", "alexnet")
    assert code == 3 and len(err.strip().splitlines()) == 1 and "internal error" in err


def test_an_mpi_librarys_error_is_a_failed_run_not_a_bug(cli, monkeypatch):
    """mpi4py's MPI.Exception (here MPI_ERR_IN_STATUS, what a halo exchange's Waitall raised
    on rank 0 when rank 1 was killed) is the run failing in the library: exit 1, one line."""
    mpi = pytest.importorskip("mpi4py.MPI")
    import scalelab.cli.commands.layers as layers

    def in_mpi(*args, **kwargs):
        raise mpi.Exception(mpi.ERR_IN_STATUS)

    monkeypatch.setattr(layers, "workload_config", in_mpi)
    monkeypatch.delenv("SCALELAB_DEBUG", raising=False)
    code, _, err = cli("layers", "alexnet")
    assert code == 1 and err.strip().splitlines() == [
        "scalelab layers: failed: MPI: See the MPI_ERROR field in MPI_Status for the error code"
    ], err


@pytest.mark.parametrize(
    "command,shown,hidden",
    [
        ("layers", ["--batch", "--hidden", "--image-size"], ["--lr", "--ranks", "--out"]),
        ("fit", ["--convs", "--microbatches", "--mem-limit"], ["--split", "--bucket-mb", "--tp"]),
        ("predict", ["--ranks", "--bucket-mb", "--stages"], ["--lr", "--seed", "--ckpt-dir"]),
        ("versions", ["--batch", "--ranks", "--train", "--all"], ["--stages", "--tp", "--resume"]),
    ],
)
def test_help_shows_only_the_options_a_command_reads(cli, command, shown, hidden):
    code, out, _ = cli(command, "--help")
    flags = set(re.findall(r"^\s+(--[a-z-]+)", out, re.MULTILINE))
    assert code == 0 and set(shown) <= flags and not set(hidden) & flags, sorted(flags)
