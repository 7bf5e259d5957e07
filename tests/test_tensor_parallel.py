"""tensor (W1 rows / W2 columns over MPI ranks) under mpiexec -n 1/2/3 trains exactly what one
process trains, moves N*C+1 values a step instead of mpi-dp's P, and checkpoints the whole MLP.

References: the float64 NumPy SGD (oracle_weights), torch in one process (`local`, fp32 and
fp64 with momentum), the float64 forward oracle (--check) and mpi-dp's record of the same run.
"""

import numpy as np
import pytest

from programs.train_helpers import (
    COMMON,
    N_PARAMS,
    launch_runs,
    oracle_weights,
    records_and_weights,
    relerr,
)
from scalelab.config import RunConfig
from scalelab.errors import UsageError
from scalelab.run.runner import execute

MOMENTUM = {"momentum": 0.9, "dtype": "fp64"}
RUNS = {
    "tp64": {"strategy": "tensor", "dtype": "fp64"},
    "tp32": {"strategy": "tensor"},
    "tpm64": {"strategy": "tensor", **MOMENTUM},
}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    out = tmp_path_factory.mktemp("one")
    for name, kw in (("local32", {}), ("localm64", MOMENTUM)):
        cfg = RunConfig(strategy="local", save_weights=str(out / f"{name}.pt"), **COMMON, **kw)
        execute(cfg, out / "runs.jsonl")
    recs, weights = records_and_weights(out)
    weights["oracle"] = oracle_weights(RunConfig(**COMMON))
    return recs, weights


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """RUNS under mpiexec -n RANKS, once per rank count. 2 ranks also run inference with
    --check, mpi-dp on the same data, and a momentum run stopped at step 5 with a checkpoint;
    3 ranks resume that 2-rank checkpoint."""
    cache: dict[int, tuple[dict, dict]] = {}
    ckpt = tmp_path_factory.mktemp("ckpt")

    def extra(ranks: int) -> dict:
        if ranks == 2:
            return {
                "infer": {"strategy": "tensor", "train": False, "check": True, "batch": 7},
                "dp32": {"strategy": "mpi-dp"},
                "stop5": {"strategy": "tensor", **MOMENTUM, "steps": 5, "ckpt_dir": str(ckpt)},
            }
        if ranks == 3:
            get(2)
            (path,) = ckpt.glob("*.pt")
            return {"resumed": {"strategy": "tensor", **MOMENTUM, "resume": str(path)}}
        return {}

    def get(ranks: int) -> tuple[dict, dict]:
        if ranks not in cache:
            out = tmp_path_factory.mktemp(f"r{ranks}")
            cache[ranks] = launch_runs("mpi", ranks, {**RUNS, **extra(ranks)}, out)
        return cache[ranks]

    return get


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_same_training_as_one_process(ranks, one_process, launched):
    ref_recs, ref_w = one_process
    recs, weights = launched(ranks)
    assert recs["tp64"]["ranks"] == ranks and recs["tp64"]["steps"] == 14
    assert relerr(weights["tp64"], ref_w["oracle"]) < 1e-10
    assert relerr(weights["tpm64"], ref_w["localm64"]) < 1e-10
    np.testing.assert_allclose(recs["tpm64"]["loss"], ref_recs["localm64"]["loss"], rtol=1e-10)
    assert recs["tpm64"]["accuracy"] == ref_recs["localm64"]["accuracy"]
    assert relerr(weights["tp32"], ref_w["local32"]) < 1e-5
    np.testing.assert_allclose(recs["tp32"]["loss"], ref_recs["local32"]["loss"], rtol=1e-5)


@pytest.mark.mpi
def test_inference_matches_float64_oracle(launched):
    recs, _ = launched(2)
    assert recs["infer"]["check_passed"] and recs["infer"]["relerr"] < 1e-5


@pytest.mark.mpi
def test_bytes_per_step_against_mpi_dp_on_the_same_run(launched):
    recs, _ = launched(2)
    tp, dp = recs["tp32"], recs["dp32"]
    per_step = (32 * 10 + 1) * 4  # logits (B x C) + the L2 scalar, fp32
    assert tp["bytes_per_step"] == {"allreduce": per_step, "mpi_dp": N_PARAMS * 4}
    assert dp["bytes_per_step"]["allreduce"] == tp["bytes_per_step"]["mpi_dp"]
    # Measured over the run: 12 full steps and 2 of the last batch's 11 items.
    assert tp["bytes"]["allreduce"] == 12 * per_step + 2 * (11 * 10 + 1) * 4
    assert dp["bytes"]["allreduce"] / tp["bytes"]["allreduce"] > 50
    assert tp["bytes"]["bcast"] == (203 + 60) * (784 + 8)  # inputs replicated once


@pytest.mark.mpi
def test_checkpoint_from_two_ranks_resumes_on_three(launched):
    """The checkpoint holds the whole MLP and momentum buffers (gathered); 3 ranks re-split
    them and finish with the uninterrupted run's weights (to float64 rounding)."""
    _, ref_w = launched(1)
    recs, weights = launched(3)
    assert recs["resumed"]["steps"] == 14 and recs["resumed"]["resumed_from"]
    assert relerr(weights["resumed"], ref_w["tpm64"]) < 1e-12


def test_refuses_what_it_cannot_split():
    with pytest.raises(UsageError, match="mlp"):
        execute(RunConfig(workload="charcnn", strategy="tensor", train=True), None)
    with pytest.raises(UsageError, match="--nonblocking"):
        execute(RunConfig(workload="mlp", strategy="tensor", nonblocking=True), None)
