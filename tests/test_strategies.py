"""Every single-process strategy computes the same function as the float64 oracle."""

import numpy as np
import pytest

from scalelab.config import RunConfig
from scalelab.run.runner import execute

SMALL = {
    "alexnet": {"image_size": 67, "batch": 3},
    "charcnn": {"batch": 2},
    "mlp": {"batch": 5, "hidden": 32},
    "resnet18": {"batch": 2},
    "resnet18-cifar": {"batch": 2, "image_size": 12},
    "vgg16": {"batch": 2, "image_size": 32, "num_classes": 10},
    "deepstack": {"batch": 2, "image_size": 8, "convs": 3, "fcs": 1},
}


def _run(workload, **kw):
    cfg = RunConfig(
        workload=workload, iters=1, warmup=0, check=True, quiet=True, **{**SMALL[workload], **kw}
    )
    return execute(cfg, None).record


@pytest.mark.parametrize("workload", sorted(SMALL))
def test_serial_and_local_agree(workload):
    serial = _run(workload, strategy="serial")
    local32 = _run(workload, strategy="local", dtype="fp32")
    local64 = _run(workload, strategy="local", dtype="fp64")
    assert serial["relerr"] == 0.0  # the serial strategy *is* the oracle
    assert local32["relerr"] < 1e-5 and local64["relerr"] < 1e-12
    assert serial["digest"] == local32["digest"] == local64["digest"]


@pytest.mark.parametrize("dtype, bound", [("bf16", 5e-2), ("fp16", 1e-2)])
def test_low_precision_autocast_within_tolerance(dtype, bound):
    rec = _run("alexnet", strategy="local", dtype=dtype)
    assert 0 < rec["relerr"] < bound  # nonzero: autocast really ran in low precision


def test_mlp_training_serial_equals_local_fp64():
    """The NumPy float64 SGD and torch fp64 SGD follow the same batches to the same weights."""
    common = dict(
        workload="mlp",
        train=True,
        epochs=2,
        steps=7,
        batch=64,
        hidden=16,
        lr=0.5,
        train_size=300,
        heldout_size=100,
        quiet=True,
    )
    serial = execute(RunConfig(strategy="serial", **common), None)
    local = execute(RunConfig(strategy="local", dtype="fp64", **common), None)
    assert serial.record["steps"] == local.record["steps"] == 7
    np.testing.assert_allclose(serial.record["loss"], local.record["loss"], rtol=1e-10)
    assert serial.record["accuracy"] == local.record["accuracy"]
