"""Your own model (--model MODULE:FACTORY): three networks scalelab does not ship
(tests/programs/user_nets.py: a residual CNN with BatchNorm, a 1-D conv net over int64 token
ids with an Embedding, an MLP with LayerNorm and dropout) under every strategy that applies.

References: the same module in float64 on the CPU in eval mode (inference, every strategy's
--check); one float64 process (training: 2 ranks must train what it trains). BatchNorm in
training normalises over each shard's items (DDP without SyncBatchNorm does the same), so for
the residual CNN 2-rank mpi-dp is compared with a 2-micro-batch pipeline (the same 4-item
groups), not with one process.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from programs.train_helpers import PROGRAMS, launcher, records_and_weights, relerr, run
from programs.user_nets import rescnn
from scalelab.config import RunConfig
from scalelab.record import read_records
from scalelab.run.runner import execute

NETS = PROGRAMS / "user_nets.py"
MODELS = {
    "rescnn": {"model": f"{NETS}:rescnn", "input_shape": "3,12,12"},
    "tokconv": {"model": f"{NETS}:tokconv", "input_shape": "10", "input_dtype": "int64",
                "vocab": 40},
    "mlp": {"model": f"{NETS}:mlp", "input_shape": "3,4"},
}  # fmt: skip
INFER = dict(workload="model", batch=6, iters=1, warmup=0, check=True, quiet=True, threads=1)
# Dropout off for training (its masks are random per rank); LayerNorm stays.
TRAIN = dict(workload="model", train=True, train_size=24, heldout_size=8, batch=8, epochs=1,
             lr=0.2, dtype="fp64", quiet=True, threads=1)  # fmt: skip
SPATIAL = ["--strategy", "mpi", "--split", "spatial", "--ranks", "2"]
TRAIN_ARGS = {"mlp": {"model_arg": ["p=0.0"]}}


def _train(name: str, **kw) -> dict:
    return {**TRAIN, **MODELS[name], **TRAIN_ARGS.get(name, {}), **kw}


def _launch(kind: str, runs: dict, out: Path) -> tuple[dict, dict]:
    program = PROGRAMS / ("train_runs.py" if kind == "mpi" else "user_runs.py")
    cmd = [*launcher(kind, 2), str(program), str(out), json.dumps(runs)]
    proc = run(cmd, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return records_and_weights(out)


def _local(name: str, out: Path, **kw) -> tuple[dict, dict]:
    cfg = RunConfig(**{**_train(name, **kw), "save_weights": str(out / f"{name}.pt")})
    return execute(cfg, None).record, torch.load(out / f"{name}.pt")


@pytest.mark.parametrize("name", list(MODELS))
def test_local_fp64_and_fp32_match_the_module_in_float64(name):
    for dtype, tol in (("fp64", 1e-12), ("fp32", 1e-5)):
        rec = execute(RunConfig(**INFER, **MODELS[name], dtype=dtype), None).record
        assert rec["check_passed"] and rec["relerr"] <= tol, (dtype, rec["relerr"])
        assert rec["reference"] == "module-fp64" and rec["flops_per_item"] > 0


@pytest.mark.mpi
def test_mpi_ranks_infer_and_train_as_one_process(tmp_path):
    """mpiexec -n 2: --split batch inference checked in fp64; mpi-dp trains what one fp64
    process trains (the BN net: what a 2-micro-batch pipeline trains, same item groups)."""
    runs = {}
    for name, spec in MODELS.items():
        runs[f"{name}-batch"] = {**INFER, **spec, "strategy": "mpi", "ranks": 2, "dtype": "fp64"}
        runs[f"{name}-dp"] = {**_train(name), "strategy": "mpi-dp", "ranks": 2}
    recs, weights = _launch("mpi", runs, tmp_path / "mpi")
    for name in MODELS:
        batch = recs[f"{name}-batch"]
        assert batch["ranks"] == 2 and batch["check_passed"], (name, batch["relerr"])
        assert batch["relerr"] <= 1e-12 and batch["digest"] == batch["reference_digest"]
    (tmp_path / "one").mkdir()
    for name in ("tokconv", "mlp"):
        local, w = _local(name, tmp_path / "one")
        assert relerr(weights[f"{name}-dp"], w) < 1e-10, name
        np.testing.assert_allclose(recs[f"{name}-dp"]["loss"], local["loss"], rtol=1e-10)
    pipe = execute(RunConfig(**_train("rescnn"), strategy="pipeline", stages=1,
                             microbatches=2), None).record  # fmt: skip
    np.testing.assert_allclose(recs["rescnn-dp"]["loss"], pipe["loss"], rtol=1e-10)


@pytest.mark.mpi
def test_torchrun_ranks_nccl_ddp_pipeline_and_tensor(tmp_path):
    """torchrun 2 ranks on gloo: nccl --split batch, the pipeline (2 stages, cut at module
    boundaries) and DTensor's Linear pairs checked in fp64; ddp and the pipeline train what
    one fp64 process trains."""
    runs = {}
    for name, spec in MODELS.items():
        fp64 = {**INFER, **spec, "ranks": 2, "dtype": "fp64"}
        runs[f"{name}-nccl"] = {**fp64, "strategy": "nccl"}
        runs[f"{name}-pipe"] = {**fp64, "strategy": "pipeline", "stages": 2, "microbatches": 2}
        runs[f"{name}-ddp"] = {**_train(name), "strategy": "ddp", "ranks": 2, "batch": 8}
        runs[f"{name}-pipetrain"] = {**_train(name), "strategy": "pipeline", "ranks": 2,
                                     "stages": 2, "microbatches": 2}  # fmt: skip
    runs["mlp-tensor"] = {**INFER, **MODELS["mlp"], "strategy": "tensor", "engine": "torch",
                          "ranks": 2, "dtype": "fp64"}  # fmt: skip
    recs, weights = _launch("torchrun", runs, tmp_path / "tr")
    for name in [*(f"{m}-{s}" for m in MODELS for s in ("nccl", "pipe")), "mlp-tensor"]:
        assert recs[name]["check_passed"] and recs[name]["relerr"] <= 1e-12, name
    assert recs["rescnn-pipe"]["pipeline"]["stages"] == 2
    (tmp_path / "one").mkdir()
    for name in ("tokconv", "mlp"):
        _, w = _local(name, tmp_path / "one")
        for how in ("ddp", "pipetrain"):
            assert relerr(weights[f"{name}-{how}"], w) < 1e-10, (name, how)
    # BatchNorm over 4-item groups: the 2-stage pipeline's micro-batches (as mpi-dp's shards)
    pipe = execute(RunConfig(**_train("rescnn"), strategy="pipeline", stages=1,
                             microbatches=2), None).record  # fmt: skip
    np.testing.assert_allclose(recs["rescnn-pipetrain"]["loss"], pipe["loss"], rtol=1e-10)


@pytest.mark.parametrize(
    "name, args, needle",
    [
        ("tokconv", SPATIAL, "stops at ids, cast: its items have no channel axis"),
        ("mlp", SPATIAL, "stops at fc1.reshape, reshape"),
        ("rescnn", ["--strategy", "tensor", "--engine", "torch"], "fc is the last Linear"),
        ("mlp", ["--strategy", "tensor"], "--engine torch"),
    ],
)
def test_strategies_that_cannot_apply_say_which_layer_stops_them(cli, name, args, needle):
    code, out, err = cli("run", *_flags(MODELS[name]), *args, "--no-record")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert needle in err


def test_spatial_splits_the_local_run_and_gathers_the_rest(cli, tmp_path):
    """The residual CNN's stem (conv, BatchNorm, ReLU) is cut into row slabs with halos; the
    residual block and the head run on the root after the gather: fp64 equals the module."""
    out = tmp_path / "runs.jsonl"
    code, _, err = cli("run", *_flags(MODELS["rescnn"]), *SPATIAL, "--dtype", "fp64",
                       "--check", "--out", out)  # fmt: skip
    assert code == 0, err
    (rec,) = read_records(out)
    assert rec["check_passed"] and rec["relerr"] < 1e-12 and rec["split"] == "spatial"
    assert rec["reference"] == "module-fp64"


def test_a_model_that_is_not_a_chain_is_not_cut(cli):
    code, _, err = cli("run", "--model", f"{NETS}:branchy", "--input-shape", "3,4",
                       "--strategy", "pipeline", "--no-record")  # fmt: skip
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "b does not read what came before it" in err or "not a chain" in err, err


@pytest.mark.parametrize(
    "spec, shape, needle",
    [
        ("no_such_module_xyz:net", "3", "no module named 'no_such_module_xyz'"),
        (f"{NETS.parent}/missing.py:net", "3", "no such file"),
        (f"{NETS}:nope", "3", "has no attribute 'nope'"),
        (f"{NETS}:raises", "3", "the factory raised ValueError: no such width"),
        (f"{NETS}:not_a_module", "3", "returned int, not a torch.nn.Module"),
        (f"{NETS}:mlp", "5,5", "a (1, 5, 5) float32 input fails in its forward"),
        (f"{NETS}:mlp", "3,x", "expected sizes like 3,32,32"),
        ("torch:nn", "3", "not a callable"),
    ],
)
def test_bad_factories_give_one_line_and_exit_2(cli, tmp_path, spec, shape, needle):
    out_file = tmp_path / "runs.jsonl"
    code, out, err = cli("run", "--model", spec, "--input-shape", shape, "--out", out_file)
    assert code == 2 and out == "" and not out_file.exists()
    assert len(err.strip().splitlines()) == 1 and needle in err, err


def test_a_vocab_past_the_models_embedding_is_refused_in_one_line(cli, tmp_path):
    """--vocab 64 for a GPT whose embedding has 32 rows: ids up to 63 would end in an
    IndexError inside a strategy; refused before any work, naming the embedding."""
    gpt = Path(__file__).resolve().parents[1] / "examples" / "models" / "gpt.py"
    out_file = tmp_path / "runs.jsonl"
    code, out, err = cli("run", "--model", f"{gpt}:gpt", "--model-arg", "vocab=32",
                         "--model-arg", "seq=8", "--model-arg", "width=8", "--model-arg",
                         "heads=2", "--model-arg", "depth=1", "--input-shape", "8",
                         "--input-dtype", "int64", "--vocab", "64", "--out", out_file)  # fmt: skip
    assert code == 2 and out == "" and not out_file.exists()
    want = "--vocab 64: token ids reach 63 but the model's embedding 'tok' has 32 rows"
    assert len(err.strip().splitlines()) == 1 and want in err, err


def test_layers_predict_and_fit_give_numbers(cli):
    flags = _flags(MODELS["rescnn"])
    code, out, _ = cli("layers", *flags)
    assert code == 0
    rows = {line.split()[0]: line.split() for line in out.splitlines()[1:]}
    assert {"stem", "bn", "res", "fc"} <= set(rows) and rows["res"][1] == "block"
    # the conv: 2 * 6 * 3 * 9 * 12 * 12 FLOPs per item at batch 8
    assert float(rows["stem"][4]) == pytest.approx(2 * 6 * 3 * 9 * 144 * 8 / 1e6, abs=0.05)
    assert int(rows["total"][1].replace(",", "")) == sum(p.numel() for p in rescnn().parameters())
    ceilings = Path(__file__).parent / "fixtures" / "predict" / "ceilings_h200x2.json"
    code, out, _ = cli("predict", *flags, "--strategy", "mpi", "--ranks", "1,2",
                       "--ceilings", ceilings, "--no-plots")  # fmt: skip
    assert code == 0 and "throughput" in out
    code, out, _ = cli("fit", *flags, "--find", "batch", "--most", "16")
    assert code == 0 and "largest batch estimated to fit: 16 (estimated, not run)" in out


def test_model_args_and_an_importable_module(cli, monkeypatch):
    """MODULE as a dotted name on sys.path; --model-arg values read as literals."""
    monkeypatch.syspath_prepend(str(PROGRAMS))
    code, out, _ = cli("layers", "--model", "user_nets:rescnn", "--model-arg", "width=3",
                       "--model-arg", "classes=7", "--input-shape", "3,8,8")  # fmt: skip
    assert code == 0
    fc = next(line.split() for line in out.splitlines() if line.startswith("fc "))
    assert fc[2] == "7" and fc[3] == str(3 * 7 + 7)


def _flags(spec: dict) -> list[str]:
    out = []
    for key, value in spec.items():
        out += [f"--{key.replace('_', '-')}", str(value)]
    return out


def _torchvision_models() -> None:
    """Skip unless torchvision imports (a wheel built for another torch raises RuntimeError
    at import: 'operator torchvision::nms does not exist')."""
    try:
        import torchvision.models  # noqa: F401
    except Exception as exc:
        pytest.skip(f"torchvision not usable here: {type(exc).__name__}: {exc}")


@pytest.mark.mpi
@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v2"])
def test_torchvision_models_at_64x64(cli, tmp_path, name):
    """torchvision's own networks just work, local and over MPI ranks."""
    _torchvision_models()
    out = tmp_path / "runs.jsonl"
    flags = ["--model", f"torchvision.models:{name}", "--input-shape", "3,64,64", "--batch", "2",
             "--iters", "1", "--warmup", "0", "--check", "--out", out]  # fmt: skip
    for strategy in (["--strategy", "local"], ["--strategy", "mpi", "--ranks", "2"]):
        code, _, err = cli("run", *flags, *strategy)
        assert code == 0, err
    recs = [json.loads(line) for line in (tmp_path / "runs.jsonl").read_text().splitlines()]
    assert [r["ranks"] for r in recs] == [1, 2] and all(r["check_passed"] for r in recs)


def test_an_entry_point_model_is_listed_and_runs(tmp_path):
    """A package's `scalelab.workloads` entry point: listed by `scalelab list`, run by name."""
    info = tmp_path / "usernets-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: usernets\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[scalelab.workloads]\ntinymlp = user_nets:mlp\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(PROGRAMS)])}
    scalelab = [sys.executable, "-m", "scalelab"]
    listed = subprocess.run([*scalelab, "list"], capture_output=True, text=True, env=env)
    assert "tinymlp" in listed.stdout and "user_nets:mlp" in listed.stdout
    ran = subprocess.run([*scalelab, "run", "tinymlp", "--input-shape", "3,4", "--check",
                          "--iters", "1", "--warmup", "0", "--no-record", "--json"],
                         capture_output=True, text=True, env=env)  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    rec = json.loads(ran.stdout)
    assert rec["workload"] == "tinymlp" and rec["check_passed"]
