"""Training features around the shared loop: checkpoints (atomic, resumable, checked), the
NaN/inf stop, reproducibility, comma-list studies, progress and the CPU-vs-GPU report."""

import json
import sys

import numpy as np
import pytest
import torch

from scalelab.cli.commands.run import substitute
from scalelab.config import RunConfig
from scalelab.errors import UsageError
from scalelab.orchestration.compare_devices import compare_devices, relerr
from scalelab.record import read_records
from scalelab.record_schema import problem
from scalelab.run.runner import execute
from scalelab.train import checkpoint as ckpt
from scalelab.train.guards import TrainingDiverged
from scalelab.workloads.base import state_dict_float64

# One torch thread: runs compared bit for bit here must sum in one order. Without --threads
# each run takes the CPUs free at its start, and MKL on a Xeon sums this MLP's 32x784 by 784x8
# GEMM differently at 1 and 2 threads (the same seed's epoch-1 loss 2.144952697753906 against
# 2.1449527486165363 in a CI run on a busy host).
SMALL = dict(
    workload="mlp", train=True, hidden=8, train_size=150, heldout_size=40, batch=32,
    epochs=2, lr=0.5, momentum=0.9, quiet=True, threads=1,
)  # fmt: skip
SCALELAB = [sys.executable, "-m", "scalelab"]
ARGS = [
    "run", "mlp", "--train", "--hidden", "8", "--train-size", "150", "--heldout-size", "40",
    "--batch", "32", "--epochs", "2", "--lr", "0.5", "--momentum", "0.9", "--quiet",
    "--threads", "1",
]  # fmt: skip


def trained(tmp_path, name, **kw):
    path = tmp_path / f"{name}.pt"
    rec = execute(RunConfig(**{**SMALL, "save_weights": str(path), **kw}), None).record
    return rec, torch.load(path)


def test_resume_mid_epoch_is_bitwise(tmp_path):
    """Stop at step 7 (epoch 2, step 2) with a checkpoint, resume: the uninterrupted run's
    weights, loss curve and held-out accuracy, bit for bit. Both trained at 2 threads; the
    resume has no --threads and takes the checkpoint's 2, whatever this host's load picks."""
    whole, w_whole = trained(tmp_path, "whole", threads=2)
    trained(tmp_path, "part", threads=2, steps=7, ckpt_dir=str(tmp_path / "ck"))
    (path,) = (tmp_path / "ck").glob("*.pt")
    state = torch.load(path)
    assert state["position"] == {"epoch": 1, "step": 2, "steps": 7, "items": 64}
    assert state["threads"] == 2
    resumed, w_resumed = trained(tmp_path, "resumed", threads=None, resume=str(path))
    assert resumed["threads"]["threads"] == 2 and resumed["threads"]["source"] == "checkpoint"
    given, _ = trained(tmp_path, "given", threads=1, resume=str(path))
    assert given["threads"] == {"threads": 1, "source": "--threads", "why": "given by --threads"}
    assert all(torch.equal(w_whole[k], w_resumed[k]) for k in w_whole)
    assert resumed["loss"] == whole["loss"] and resumed["accuracy"] == whole["accuracy"]
    assert resumed["steps"] == whole["steps"] == 10 and resumed["items"] == 150 - 64


def test_checkpoint_every_n_steps_and_at_the_end(tmp_path):
    saved = []
    real = ckpt.Checkpointer.save
    ckpt.Checkpointer.save = lambda self, s: saved.append(s["position"]["steps"]) or real(self, s)
    try:
        trained(tmp_path, "a", ckpt_every=3, ckpt_dir=str(tmp_path / "ck"))
    finally:
        ckpt.Checkpointer.save = real
    assert saved == [3, 6, 9, 10]


def test_interrupted_write_leaves_the_last_checkpoint_whole(tmp_path, monkeypatch):
    saver = ckpt.Checkpointer(tmp_path / "c.pt", 1, True)
    saver.save({"format": ckpt.FORMAT, "n": torch.arange(3)})

    def dies_midway(obj, f):
        f.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", dies_midway)
    with pytest.raises(OSError):
        saver.save({"format": ckpt.FORMAT, "n": torch.arange(5)})
    assert torch.equal(ckpt.load_checkpoint(tmp_path / "c.pt")["n"], torch.arange(3))
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"]  # no temporary left behind


@pytest.fixture(scope="module")
def a_checkpoint(tmp_path_factory):
    """A mid-epoch checkpoint (step 7 of 10) of SMALL."""
    out = tmp_path_factory.mktemp("ck")
    execute(RunConfig(**SMALL, steps=7, ckpt_dir=str(out)), None)
    (path,) = out.glob("*.pt")
    return path


@pytest.mark.parametrize(
    "change, needle",
    [
        (["--hidden", "16"], "fc1.weight is 8x784 in the checkpoint but 16x784"),
        (["--seed", "3"], "needs the same seed"),
        (["--batch", "48"], "not a multiple of this run's global batch 48"),
    ],
)
def test_resume_refuses_what_it_cannot_honour(cli, tmp_path, a_checkpoint, change, needle):
    args = [*ARGS, *change, "--resume", a_checkpoint, "--out", tmp_path / "r.jsonl"]
    code, out, err = cli(*args)
    assert code == 2 and len(err.strip().splitlines()) == 1 and needle in err, err
    assert not (tmp_path / "r.jsonl").exists()


def test_resume_refuses_other_workloads_and_foreign_files(cli, tmp_path, a_checkpoint):
    code, _, err = cli("run", "charcnn", "--train", "--resume", a_checkpoint)
    assert code == 2 and "the checkpoint trains mlp, this run trains charcnn" in err
    torch.save({"fc1.weight": torch.zeros(2)}, tmp_path / "weights.pt")
    code, _, err = cli(*ARGS, "--resume", tmp_path / "weights.pt")
    assert code == 2 and "not a scalelab training checkpoint" in err
    (tmp_path / "junk.pt").write_bytes(b"junk")
    code, _, err = cli(*ARGS, "--resume", tmp_path / "junk.pt")
    assert code == 2 and "not a readable checkpoint" in err


def test_world_size_policy(a_checkpoint):
    """Another rank count is allowed and said; a position the new global batch cannot reach
    is refused (a 3-rank run whose global batch is 48)."""
    state = torch.load(a_checkpoint)  # 1 rank, global batch 32, 64 items of epoch 2 done
    cfg = RunConfig(**SMALL)
    assert ckpt.resume_step(state, cfg, world=2, global_batch=32, n_train=150) == 2
    assert ckpt.resume_step(state, cfg, world=4, global_batch=64, n_train=150) == 1
    assert "1-rank checkpoint on 2 ranks (allowed" in ckpt.world_size_note(state, 2, 32)
    assert ckpt.world_size_note(state, 1, 32) is None
    with pytest.raises(UsageError, match="not a multiple"):
        ckpt.resume_step(state, cfg, world=3, global_batch=48, n_train=150)


def test_nan_loss_stops_naming_the_step_and_keeps_the_last_good_checkpoint(cli, tmp_path):
    """lr 1e25: step 1 is finite, its update overflows fp32, step 2's loss is inf."""
    base = [*ARGS, "--lr", "1e25", "--ckpt-every", "1", "--ckpt-dir", tmp_path / "ck"]
    code, out, err = cli(*base, "--steps", "1", "--out", tmp_path / "ok.jsonl")
    assert code == 0 and np.isfinite(read_records(tmp_path / "ok.jsonl")[0]["loss"][0])
    code, out, err = cli(*base, "--out", tmp_path / "runs.jsonl")
    assert code == 1 and len(err.strip().splitlines()) == 1
    assert "loss is NaN or inf at step 2" in err and "is intact" in err
    (path,) = (tmp_path / "ck").glob("*.pt")
    state = ckpt.load_checkpoint(path)
    assert state["position"]["steps"] == 1
    assert all(torch.isfinite(v).all() for v in state["model"].values())
    (rec,) = read_records(tmp_path / "runs.jsonl")
    assert rec["status"] == "failed" and "TrainingDiverged" in rec["error"]


def test_same_seed_same_curve():
    a = execute(RunConfig(**SMALL), None).record
    b = execute(RunConfig(**SMALL), None).record
    c = execute(RunConfig(**SMALL, seed=1), None).record
    assert a["loss"] == b["loss"] and a["accuracy"] == b["accuracy"]
    assert a["loss"] != c["loss"]


def test_comma_lists_run_the_product_one_record_each(cli, tmp_path):
    results = tmp_path / "runs.jsonl"
    code, out, err = cli(*ARGS, "--lr", "0.1,0.5", "--hidden", "4,8", "--out", results)
    assert code == 0, err
    recs = read_records(results)
    got = sorted((r["config"]["lr"], r["config"]["hidden"]) for r in recs)
    assert got == [(0.1, 4), (0.1, 8), (0.5, 4), (0.5, 8)]
    assert all(len(r["loss"]) == len(r["accuracy"]) == 2 for r in recs)
    assert "[4/4] --hidden 8 --lr 0.5" in out  # each result labelled, then one table
    table = out.split("\nrun ", 1)[1].splitlines()
    assert len(table) == 5 and table[4].startswith("--hidden 8 --lr 0.5  ok")
    single = execute(RunConfig(**{**SMALL, "lr": 0.1, "hidden": 4}), None).record
    assert next(r for r in recs if r["config"]["hidden"] == 4)["loss"] == single["loss"]


def test_comma_list_errors_and_argv_rewrite(cli, tmp_path):
    code, _, err = cli(*ARGS, "--lr", "0.1,x", "--out", tmp_path / "r.jsonl")
    assert code == 2 and "invalid float value: '0.1,x'" in err
    code, _, err = cli(*ARGS, "--batch", "8,0", "--out", tmp_path / "r.jsonl")
    assert code == 2 and "--batch must be >= 1" in err and not (tmp_path / "r.jsonl").exists()
    # a value refused by the strategy, not the parser: refused before the first value runs
    code, _, err = cli(*ARGS, "--ranks", "1,2", "--out", tmp_path / "r.jsonl")
    assert code == 2 and not (tmp_path / "r.jsonl").exists()
    assert err.strip() == (
        "scalelab run: error: strategy local runs in one process: --ranks 2 needs a strategy "
        "of ranks (scalelab list)"
    )
    argv = ["run", "mlp", "--lr", "0.1,0.5", "--ranks=1,2"]
    assert substitute(argv, "--lr", 0.5) == ["run", "mlp", "--lr", "0.5", "--ranks=1,2"]
    assert substitute(argv, "--ranks", 2)[-1] == "--ranks=2"


def test_progress_reports_epochs_on_stderr(cli, tmp_path):
    args = [a for a in ARGS if a != "--quiet"]
    code, out, err = cli(*args, "--no-record")
    assert code == 0
    lines = [line for line in err.splitlines() if "epoch=" in line]
    assert len(lines) == 2 and lines[0].startswith("train 5/10 epoch=1 loss=")


def test_compare_devices_matches_two_separate_runs(tmp_path):
    """The report's per-epoch differences are those of two independent runs' weights (one
    torch thread, SMALL's: on a busy host two runs without it summed in different orders,
    fp32 relerr 6.2e-8 against 5.8e-8)."""
    cfg = RunConfig(**{**SMALL, "momentum": 0.0})
    report = compare_devices(cfg, [("cpu", "fp64"), ("cpu", "fp32")])
    assert [row["epoch"] for row in report.rows] == [1, 2]
    for epochs in (1, 2):
        ref = execute(
            RunConfig(
                **{
                    **SMALL,
                    "momentum": 0.0,
                    "epochs": epochs,
                    "dtype": "fp64",
                    "save_weights": str(tmp_path / "a.pt"),
                }
            ),
            None,
        ).record
        other = execute(
            RunConfig(
                **{
                    **SMALL,
                    "momentum": 0.0,
                    "epochs": epochs,
                    "save_weights": str(tmp_path / "b.pt"),
                }
            ),
            None,
        ).record
        a = state_dict_float64_file(tmp_path / "a.pt")
        b = state_dict_float64_file(tmp_path / "b.pt")
        row = report.rows[epochs - 1]
        assert row["relerr"]["all"] == pytest.approx(relerr(b, a, list(a)), rel=1e-6)
        assert row["loss"] == pytest.approx([ref["loss"][-1], other["loss"][-1]], rel=1e-12)
    assert 1e-9 < report.rows[-1]["relerr"]["all"] < 1e-4  # fp32 rounding, grown a little
    assert "relative weight difference, cpu fp32 against cpu fp64" in report.table()
    assert report.record["mode"] == "compare-devices" and json.dumps(report.record)
    # the readers accept what the writer wrote (the GPU run once wrote a record without items)
    assert problem(json.loads(json.dumps(report.record))) is None
    assert report.record["items"] == ref["items"]  # the same 2 epochs as the last fp64 run


def state_dict_float64_file(path):
    return {k: v.double().numpy() for k, v in torch.load(path).items()}


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_compare_devices_needs_a_gpu(cli):
    code, _, err = cli(*ARGS, "--compare-devices")
    assert code == 2 and "needs a CUDA GPU" in err


def test_diverged_error_names_the_checkpoint():
    msg = str(TrainingDiverged.at(17, 20, None))
    assert "step 17" in msg and "No checkpoint" in msg
    assert state_dict_float64  # (imported for symmetry with the other training tests)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compare_cpu_and_gpu_fp32(cli, tmp_path):
    """The seed's question on the device: fp32 weights drift apart by rounding, the loss and
    held-out precision barely notice."""
    results = tmp_path / "runs.jsonl"
    code, out, err = cli(*ARGS, "--compare-devices", "--hidden", "64", "--out", results)
    assert code == 0, err
    assert "relative weight difference, cuda fp32 against cpu fp32" in out
    (rec,) = read_records(results)
    rows = rec["compare"]
    assert all(0 < row["relerr"]["all"] < 1e-2 for row in rows)
    assert rows[-1]["loss"][1] == pytest.approx(rows[-1]["loss"][0], rel=1e-3)


# --- kill and resume: serial and the pipeline run in the same Trainer ------------------------
def _kill_and_resume(tmp_path, args, kill_at, kill_rank, launch, expect_ckpt_step):
    """Train straight; train again with checkpoints and SIGKILL one rank before its
    kill_at-th step; resume from the last checkpoint: the weights equal the straight run's.
    Returns (the straight run's record, the resumed run's record, the checkpoint)."""
    from programs.train_helpers import PROGRAMS, run

    args = [*args, "--out", str(tmp_path / "runs.jsonl")]
    ck = ["--ckpt-every", "3", "--ckpt-dir", str(tmp_path / "ck")]
    whole = run([*SCALELAB, *args, "--save-weights", str(tmp_path / "a.pt")])
    assert whole.returncode == 0, whole.stderr[-3000:]
    killed = run([*launch, str(PROGRAMS / "train_killed.py"), str(kill_at), str(kill_rank),
                  *args, *ck])  # fmt: skip
    assert killed.returncode != 0
    (path,) = (tmp_path / "ck").glob("*.pt")
    state = torch.load(path)
    assert state["position"]["steps"] == expect_ckpt_step
    resumed = run([*SCALELAB, *args, *ck, "--resume", str(path),
                   "--save-weights", str(tmp_path / "b.pt")])  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = torch.load(tmp_path / "a.pt"), torch.load(tmp_path / "b.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    first, last = (r for r in read_records(tmp_path / "runs.jsonl") if r["status"] == "ok")
    assert first["loss"] == last["loss"] and first["accuracy"] == last["accuracy"]
    return first, last, state


def test_serial_kill_and_resume_is_bitwise(tmp_path):
    """serial's float64 NumPy SGD in the shared Trainer: checkpoints and --resume (before,
    both were ignored and a "resumed" run trained from scratch)."""
    args = [a for a in ARGS if a not in ("--momentum", "0.9")] + ["--strategy", "serial"]
    whole, resumed, state = _kill_and_resume(tmp_path, args, 8, 0, [sys.executable], 6)
    assert whole["steps"] == resumed["steps"] == 10 and resumed["resumed_from"]
    assert resumed["items"] == 150 - 32  # trained after the resume: epoch 2 from its step 2
    assert state["model"]["fc1.weight"].dtype == torch.float64  # the oracle's own numbers


@pytest.mark.mpi
@pytest.mark.parametrize(
    "engine",
    [
        ["--balance", "7,7"],
        # torch's ZBV schedule: each rank holds 2 of the 4 stages (0 and 3, 1 and 2), whose
        # parameters and momentum buffers travel through torch_state.export_state.
        ["--engine", "torch", "--schedule", "zbv", "--balance", "4,3,4,3"],
    ],
    ids=["scalelab", "torch-zbv"],
)
def test_pipeline_kill_and_resume_is_bitwise(tmp_path, engine):
    """2 ranks on gloo with momentum (each stage's optimizer buffers travel in the
    checkpoint): rank 1 SIGKILLed before its 8th step, resumed from step 6."""
    from programs.train_helpers import launcher

    args = [
        "run", "deepstack", "--strategy", "pipeline", "--ranks", "2", "--train",
        "--image-size", "8", "--convs", "3", "--fcs", "1", "--num-classes", "10",
        "--batch", "8", "--microbatches", "2", "--train-size", "40", "--heldout-size", "8",
        "--epochs", "2", "--lr", "0.05", "--momentum", "0.9", *engine,
        "--threads", "1", "--quiet",
    ]  # fmt: skip
    whole, resumed, state = _kill_and_resume(tmp_path, args, 8, 1, launcher("torchrun", 2), 6)
    assert whole["steps"] == resumed["steps"] == 10 and resumed["resumed_from"]
    momentum = state["optimizer"]["state"]
    assert len(momentum) == len(state["optimizer"]["param_groups"][0]["params"]) > 0
