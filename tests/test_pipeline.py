"""The pipeline strategy in one process and its options: the layer lists against the models'
own forward, manual placement against `local` and the oracle, a one-stage pipeline, bad
options (one line, exit 2), and --compile: refused by eager strategies, and on 2 gloo ranks
training like one eager process."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline_helpers import STACK, _cli, _workload
from scalelab.config import RunConfig
from scalelab.run.runner import execute

# --- layer lists -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, kw",
    [
        ("deepstack", STACK),
        ("vgg16", {"image_size": 32, "num_classes": 10}),
        ("vgg16", {"image_size": 32, "num_classes": 5, "swap_relu_pool": True}),
        ("alexnet", {"image_size": 67, "num_classes": 10}),
        ("alexnet", {"image_size": 67, "num_classes": 10, "swap_relu_pool": True}),
    ],
)
def test_layer_lists_compose_to_the_models_forward(name, kw):
    w = _workload(name, **kw)
    model = w.build_model().double()
    layers = w.layers(model)
    x = w.prepare(w.synthetic_inputs(2, seed=1).x)
    with torch.no_grad():
        want = model(x)
        h = x
        for layer in layers:
            h = layer.module.double()(h)
    assert torch.equal(h, want)
    params = {id(p) for layer in layers for p in layer.module.parameters()}
    assert params == {id(p) for p in model.parameters()}  # the model's own weights


def test_unsequential_model_is_refused():
    from scalelab.errors import UsageError
    from scalelab.workloads.base import Workload

    class Wrapped(torch.nn.Module):  # one child, a forward of its own: no layer list
        def __init__(self):
            super().__init__()
            self.inner = torch.nn.Linear(2, 2)

    w = _workload("deepstack", **STACK)
    with pytest.raises(UsageError, match="not a sequence of layers"):
        Workload.layers(w, Wrapped())  # the base default, as a workload without layers()


@pytest.mark.mpi
def test_compiled_stages_train_like_one_eager_process(tmp_path):
    """--compile on 2 gloo ranks: Inductor really compiled each stage (graphs counted in the
    record), the re-cut timed the compiled stages, and in fp64 the losses equal an eager
    single process's to rounding (fusion reorders no reduction across the batch here)."""
    stack = ["deepstack", "--image-size", "8", "--convs", "3", "--fcs", "1", "--num-classes", "10"]
    common = ["--train", "--batch", "6", "--steps", "2", "--train-size", "12",
              "--heldout-size", "6", "--dtype", "fp64", "--quiet"]  # fmt: skip
    local = _cli(tmp_path, *stack, "--strategy", "local", *common)
    pipe = _cli(tmp_path, *stack, "--strategy", "pipeline", "--ranks", "2", "--stages", "2",
                "--microbatches", "3", "--compile", *common)  # fmt: skip
    assert pipe["pipeline"]["compiled"] and pipe["pipeline"]["balance_rounds"]
    assert all(s["compiled_graphs"] >= 1 for s in pipe["pipeline"]["stage"])
    np.testing.assert_allclose(pipe["loss"], local["loss"], rtol=1e-12)


def test_compile_is_refused_by_eager_strategies(cli, tmp_path):
    results = tmp_path / "runs.jsonl"
    code, _, err = cli("run", "mlp", "--strategy", "mpi", "--compile", "--out", results)
    assert code == 2 and "ddp, fsdp, local, pipeline" in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert not results.exists()


# --- one-process paths ------------------------------------------------------------------------


def _run(**kw):
    base = dict(workload="deepstack", quiet=True, iters=1, warmup=0, **STACK)
    return execute(RunConfig(**{**base, **kw}), None)


def test_manual_placement_matches_the_oracle_and_local_training(tmp_path):
    rec = _run(strategy="pipeline", placement="manual", stages=3, dtype="fp64", check=True).record
    assert rec["relerr"] < 1e-12
    notes = rec["pipeline"]
    assert notes["placement"] == "manual" and len(notes["stage_layers"]) == 3
    assert 0 < sum(notes["stage_busy"]) <= 1.0  # one stage works at a time
    train = dict(train=True, steps=2, train_size=8, heldout_size=2, batch=4, dtype="fp64")
    a = _run(strategy="pipeline", placement="manual", stages=2, balance="5,9", **train)
    b = _run(strategy="local", **train)
    np.testing.assert_allclose(a.record["loss"], b.record["loss"], rtol=1e-12)


def test_one_stage_pipeline_runs_in_process():
    rec = _run(strategy="pipeline", stages=1, microbatches=3, batch=5, dtype="fp64", check=True)
    assert rec.record["relerr"] < 1e-12
    assert rec.record["pipeline"]["bubble_formula"] == 0.0


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--stages", "2"], "pass --ranks 2"),
        (["--stages", "1", "--balance", "3,4"], "--balance 3,4"),
        (["--stages", "1", "--microbatches", "9", "--batch", "4"], "smaller than --microbatches"),
        (["--stages", "1", "--schedule", "zigzag"], "unknown --schedule"),
        (["--placement", "telepathy"], "unknown --placement"),
    ],
)
def test_bad_pipeline_options_one_line_exit_2(cli, tmp_path, args, needle):
    results = tmp_path / "runs.jsonl"
    code, out, err = cli("run", "deepstack", "--strategy", "pipeline", *args, "--out", results)
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err
    assert not results.exists()


def test_regularised_loss_is_refused(cli, tmp_path):
    code, _, err = cli(
        "run", "mlp", "--strategy", "pipeline", "--stages", "1", "--train", "--no-record"
    )
    assert code == 2 and "cross-entropy" in err
