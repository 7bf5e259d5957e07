"""mpi-dp under mpiexec -n 1/2/3 trains exactly what one process trains.

References are independent of the strategy under test: the serial strategy's NumPy float64
SGD (hand-derived gradients) and torch on one process (`local`). The data do not divide
evenly: 203 items in batches of 32 (last batch 11), split 11/11/10 and 4/4/3 over 3 ranks.
"""

import json
import sys
import time

import numpy as np
import pytest
import torch

from programs.train_helpers import (
    COMMON,
    N_PARAMS,
    PROGRAMS,
    launch_runs,
    oracle_weights,
    records_and_weights,
    relerr,
    run,
)
from scalelab.comm.launch import find_mpiexec
from scalelab.config import RunConfig
from scalelab.record import read_records
from scalelab.run.runner import execute


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """serial's records (loss curve) and local fp32 trained in this process; oracle weights."""
    out = tmp_path_factory.mktemp("one")
    for name, strategy in (("serial", "serial"), ("local32", "local")):
        cfg = RunConfig(strategy=strategy, save_weights=str(out / f"{name}.pt"), **COMMON)
        execute(cfg, out / "runs.jsonl")
    recs, weights = records_and_weights(out)
    weights["oracle"] = oracle_weights(RunConfig(**COMMON))
    return recs, weights


RUNS = {
    "dp64": {"strategy": "mpi-dp", "dtype": "fp64"},
    "dp64nb": {"strategy": "mpi-dp", "dtype": "fp64", "nonblocking": True},
    "dp32": {"strategy": "mpi-dp"},
}


# 97 items in batches of 32: the last batch holds 1 item, so 2 of 3 ranks get none that step.
TINY = {"strategy": "mpi-dp", "dtype": "fp64", "train_size": 97}
TINY_LAST = {"tiny": TINY, "tinynb": {**TINY, "nonblocking": True}}


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """RUNS under mpiexec -n RANKS, each rank count launched once for all tests."""
    cache: dict[int, tuple[dict, dict]] = {}

    def get(ranks: int) -> tuple[dict, dict]:
        if ranks not in cache:
            runs = {**RUNS, **(TINY_LAST if ranks == 3 else {})}
            cache[ranks] = launch_runs("mpi", ranks, runs, tmp_path_factory.mktemp(f"r{ranks}"))
        return cache[ranks]

    return get


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_same_training_as_one_process(ranks, one_process, launched):
    ref_recs, ref_w = one_process
    recs, weights = launched(ranks)
    serial = ref_recs["serial"]
    for name in ("dp64", "dp64nb"):
        assert recs[name]["ranks"] == ranks and recs[name]["steps"] == serial["steps"] == 14
        assert relerr(weights[name], ref_w["oracle"]) < 1e-10, name
        np.testing.assert_allclose(recs[name]["loss"], serial["loss"], rtol=1e-10)
        assert recs[name]["accuracy"] == serial["accuracy"]
    assert relerr(weights["dp32"], ref_w["local32"]) < 1e-5
    np.testing.assert_allclose(recs["dp32"]["loss"], ref_recs["local32"]["loss"], rtol=1e-5)
    assert relerr(weights["dp32"], ref_w["oracle"]) > 1e-9  # fp32 really ran in fp32


@pytest.mark.mpi
def test_scatter_once_per_epoch_and_bytes(launched):
    """One Scatterv round per epoch carrying the rank's whole share; Allreduce of P values."""
    recs, _ = launched(2)
    rec = recs["dp32"]
    assert rec["scatter_rounds"] == 2  # epochs, not steps (14)
    root_items = sum(-(-min(32, 203 - s) // 2) for s in range(0, 203, 32))  # ceil halves
    assert rec["bytes"]["scatter"] == 2 * root_items * (784 + 8)  # uint8 pixels + int64 label
    assert rec["bytes_per_step"]["allreduce"] == N_PARAMS * 4
    assert rec["bytes"]["allreduce"] == 14 * N_PARAMS * 4
    assert rec["nonblocking"] is False and "reduce_started_while_pending" not in rec
    # --nonblocking: layer 2's Iallreduce started while layer 1's gradient was still pending.
    assert recs["dp64nb"]["reduce_started_while_pending"] == {"fc2": ["fc1"], "fc1": []}


@pytest.mark.mpi
def test_real_mnist_two_ranks_reach_090_precision(mnist_dir):
    cmd = [
        sys.executable, "-m", "scalelab", "run", "mlp", "--strategy", "mpi-dp", "--ranks", "2",
        "--train", "--data-dir", str(mnist_dir), "--hidden", "64", "--batch", "50",
        "--epochs", "5", "--lr", "1.0", "--threads", "1", "--no-record", "--json", "--quiet",
    ]  # fmt: skip
    proc = run(cmd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rec = json.loads(proc.stdout.strip().splitlines()[-1])
    assert rec["ranks"] == 2 and rec["items"] == 5 * 8000
    assert rec["accuracy"][-1] >= 0.90, rec["accuracy"]


@pytest.mark.mpi
def test_killed_rank_stops_all_and_resume_is_bitwise(tmp_path):
    """Rank 1 is SIGKILLed before its 15th step (mid-epoch 2); mpiexec brings rank 0 down
    within 60 s; resuming from rank 0's last checkpoint (step 12) ends with the uninterrupted
    run's weights and loss curve, bit for bit."""
    args = [
        "run", "mlp", "--strategy", "mpi-dp", "--ranks", "2", "--train", "--hidden", "16",
        "--train-size", "300", "--heldout-size", "50", "--batch", "32", "--epochs", "2",
        "--lr", "0.5", "--momentum", "0.9", "--threads", "1", "--quiet", "--ckpt-every", "4",
        "--ckpt-dir", str(tmp_path / "ckpt"), "--out", str(tmp_path / "runs.jsonl"),
    ]  # fmt: skip
    whole = run([sys.executable, "-m", "scalelab", *args, "--save-weights", str(tmp_path / "a.pt")])
    assert whole.returncode == 0, whole.stderr[-3000:]
    for f in (tmp_path / "ckpt").iterdir():
        f.unlink()
    start = time.monotonic()
    killer = [find_mpiexec(), "-n", "2", sys.executable, str(PROGRAMS / "train_killed.py")]
    killed = run([*killer, "15", "1", *args])
    assert killed.returncode != 0 and time.monotonic() - start < 60
    (ckpt,) = (tmp_path / "ckpt").glob("*.pt")
    assert torch.load(ckpt)["position"] == {"epoch": 1, "step": 2, "steps": 12, "items": 64}
    resume = ["--resume", str(ckpt), "--save-weights", str(tmp_path / "b.pt")]
    resumed = run([sys.executable, "-m", "scalelab", *args, *resume])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = torch.load(tmp_path / "a.pt"), torch.load(tmp_path / "b.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)
    first, last = read_records(tmp_path / "runs.jsonl")
    assert first["loss"] == last["loss"] and first["accuracy"] == last["accuracy"]
    assert last["steps"] == 20 and last["items"] == 300 - 64  # trained after the resume


@pytest.mark.mpi
def test_ranks_without_items_in_a_short_last_batch(launched):
    recs, weights = launched(3)
    oracle = oracle_weights(RunConfig(**{**COMMON, "train_size": 97}))
    for name in ("tiny", "tinynb"):
        assert recs[name]["steps"] == 8
        assert relerr(weights[name], oracle) < 1e-10, name
