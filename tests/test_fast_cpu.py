"""The fast path on a machine without a GPU: Triton kernels through Triton's interpreter, the
pipeline's plumbing and fallbacks, `--fast` falling back cleanly, and `scalelab bench`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scalelab.config import RunConfig
from scalelab.fast import build_fast
from scalelab.fast.pipeline import choose
from scalelab.fast.registry import Candidate, Plan, Stage
from scalelab.oracle.check import relative_error
from scalelab.workloads import WORKLOADS
from scalelab.workloads.base import state_dict_float64

ROOT = Path(__file__).resolve().parents[1]
BF16_TOL = 5e-2  # precision.py's bf16 tolerance against the float64 oracle
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def interpreted():
    """Every kernel checked under TRITON_INTERPRET=1 in a child process (the variable must be
    set before triton is imported, which would leak into other tests here)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "programs" / "fast_interpret.py")],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


KERNELS = (
    "block1", "block1-vs-onehot", "conv1d", "layernorm", "epilogue2d", "lrn_pool2d",
    "space_to_depth",
)  # fmt: skip


@pytest.mark.parametrize("kernel", KERNELS)
def test_triton_kernel_matches_torch_reference(interpreted, kernel):
    """Each kernel on odd shapes, fp32 (tight) and bf16; poisoned outputs: no element unwritten."""
    cases = [c for c in interpreted["cases"] if c["name"].split()[0] == kernel]
    assert len(cases) >= 2, f"no cases for {kernel}"
    for case in cases:
        where = f"{case['name']} (seed {interpreted['seed']})"
        assert case["unwritten"] == 0, f"{where}: {case['unwritten']} elements never written"
        assert case["relerr"] <= case["tol"], f"{where}: relerr {case['relerr']:.2e}"


def test_alexnet_fast_path_with_triton_kernels_matches_oracle(interpreted):
    run = interpreted["pipelines"]["alexnet"]
    assert {run["parts"][f"epi{i}"] for i in range(1, 6)} == {"triton"}  # the kernels ran
    assert run["relerr"] < BF16_TOL


def _workload(name, **kw):
    cfg = RunConfig(workload=name, dtype="bf16", quiet=True, **kw)
    return WORKLOADS.get(name)(cfg)


@pytest.mark.parametrize(
    "name, kw",
    [
        ("charcnn", {"batch": 2}),
        ("alexnet", {"batch": 2, "image_size": 67}),
        ("resnet18", {"batch": 3}),
        ("mlp", {"batch": 5, "hidden": 32}),
        ("deepstack", {"batch": 2, "image_size": 8, "convs": 2, "fcs": 1}),
    ],
)
def test_fast_plumbing_matches_float64_oracle(name, kw):
    """Every workload's stages with their torch candidates (cuDNN-layout convs, space-to-depth
    c1, permuted fc weights, folded batch norm) give the oracle's logits within bf16."""
    workload = _workload(name, **kw)
    model = workload.build_model()
    before = state_dict_float64(model)
    fast = build_fast(workload, model, CPU, kernels=False, graphs=False, log=lambda s: None)
    x = workload.inputs(kw["batch"]).x
    out = fast(x)
    assert out.dtype == torch.float32
    ref = workload.reference_forward(before, x.numpy())
    assert relative_error(out.double().numpy(), ref) < BF16_TOL
    after = state_dict_float64(model)  # the caller's model is never modified
    assert all((before[k] == after[k]).all() for k in before)
    if name == "alexnet":
        assert fast.parts["c1"] == "cudnn-s2d"  # the space-to-depth rewrite was the one used


def test_pipeline_rejects_wrong_and_failing_candidates():
    """A candidate that disagrees with torch or raises is logged once and not used."""

    def broken(x):
        raise RuntimeError("kernel failed to compile")

    stage = Stage(
        "double",
        [
            Candidate("torch", lambda x: 2 * x),
            Candidate("wrong", lambda x: 2 * x + 1),
            Candidate("raises", broken),
            Candidate("right", lambda x: x + x),
        ],
    )
    lines = []
    pipeline, choices = choose(Plan([stage]), torch.ones(4), CPU, True, False, lines.append)
    assert choices[0].name == "right"
    assert set(choices[0].rejected) == {"wrong", "raises"}
    assert "relerr" in choices[0].rejected["wrong"]
    assert "kernel failed to compile" in choices[0].rejected["raises"]
    assert len(lines) == 2 and all("falling back" in line for line in lines)
    assert torch.equal(pipeline(torch.arange(3.0)), torch.tensor([0.0, 2.0, 4.0]))


def test_kernel_candidates_skipped_when_triton_unavailable():
    stage = Stage("s", [Candidate("torch", lambda x: x), Candidate("triton", None, "conv1d")])
    _, choices = choose(Plan([stage]), torch.ones(2), CPU, False, False, print)
    assert choices[0].name == "torch" and not choices[0].rejected


def test_fast_flag_falls_back_on_cpu_with_one_line(cli):
    code, out, err = cli("run", "charcnn", "--fast", "--batch", "2", "--check", "--no-record")
    assert code == 0, err
    lines = [line for line in err.splitlines() if "fast path" in line]
    assert len(lines) == 1
    assert "unavailable" in lines[0] and "plain torch path" in lines[0]
    assert "check: relerr" in out and "ok" in out


def test_fast_training_falls_back_on_cpu_with_one_line(cli):
    common = ["--train", "--steps", "2", "--hidden", "16", "--train-size", "120"]
    common += ["--heldout-size", "40", "--batch", "32", "--no-record", "--json"]
    common += ["--threads", "1"]  # compared bit for bit: one summation order (test_checkpoint)
    code, out, err = cli("run", "mlp", "--fast", *common)
    assert code == 0, err
    lines = [line for line in err.splitlines() if "fast training" in line]
    assert len(lines) == 1 and "CUDA graphs unavailable" in lines[0]
    plain = cli("run", "mlp", *common)[1]
    # The fallback is the plain loop: the same losses, bit for bit.
    assert json.loads(out.splitlines()[-1])["loss"] == json.loads(plain.splitlines()[-1])["loss"]


REQUIRED = {
    "workload",
    "mode",
    "batch",
    "gpu",
    "peers",
    "best_peer",
    "eager_throughput",
    "fast_throughput",
    "ratio",
    "ratio_eager",
    "tflops",
    "relerr",
    "tolerance",
    "relerr_basis",
    "git_commit",
}
MLP_BENCH = ["bench", "mlp", "--batch", "16", "--train-size", "48", "--hidden", "16"]


def test_bench_writes_records_and_table(cli, tmp_path):
    args = ["--iters", "3", "--warmup", "1", "--out", tmp_path, "--quiet"]
    code, out, err = cli(*MLP_BENCH, *args, "--peers", "eager_fp32,eager")
    assert code == 0, err
    rec = json.loads((tmp_path / "mlp-train.json").read_text())
    assert set(rec) >= REQUIRED and rec["status"] == "ok" and rec["mode"] == "train"
    assert rec["peers"] == ["eager_fp32", "eager"]
    best = max(rec[f"{k}_throughput"] for k in rec["peers"])
    assert rec[f"{rec['best_peer']}_throughput"] == best
    assert rec["ratio"] == pytest.approx(rec["fast_throughput"] / best)
    assert rec["ratio_eager"] == pytest.approx(rec["fast_throughput"] / rec["eager_throughput"])
    timing = rec["timing"]["fast"]
    assert rec["fast_throughput"] == pytest.approx(48 / timing["median_s"])
    assert timing["n"] == 3 and timing["iqr_s"] >= 0 and timing["cv"] >= 0
    assert rec["tflops"] == pytest.approx(rec["fast_throughput"] * rec["flops_per_item"] / 1e12)
    # the loss-trajectory basis: fp32 follows float64 to rounding, bf16 to ~1e-3
    assert len(rec["losses_float64"]) == len(rec["losses_fast"]) == 3  # 48 items / 16
    assert rec["eager_fp32_relerr"] < 1e-5
    assert 0 < rec["eager_relerr"] < BF16_TOL
    assert rec["tolerance"] == pytest.approx(max(2e-3, 4 * rec["eager_relerr"]))
    assert rec["relerr"] <= rec["tolerance"]
    assert "mlp" in out and "ratio" in out
    code, out, _ = cli("bench", "--table", tmp_path)
    assert code == 0 and "mlp" in out


def test_bench_counts_a_language_models_tokens_and_mfu(cli, tmp_path):
    """A token model's record carries tokens/s (items/s x T) for the fast path and its best
    peer, and MFU = FLOPs per token x tokens/s / the run's GEMM ceiling, the FLOPs per token
    within 1% of the closed form (matmuls, forward 24w^2 + 4Tw per block and 2wV for the
    head, backward twice the forward). The table prints the line."""
    w, depth, t, vocab = 32, 2, 16, 64
    gpt = Path(__file__).resolve().parents[1] / "examples" / "models" / "gpt.py"
    model = [f"--model={gpt}:gpt", "--model-arg=lm=True", f"--model-arg=depth={depth}"]
    model += [f"--model-arg=width={w}", "--model-arg=heads=2", f"--model-arg=seq={t}"]
    model += [f"--model-arg=vocab={vocab}", f"--input-shape={t}", "--input-dtype=int64"]
    args = ["--mode=train", "--batch=4", "--train-size=8", "--iters=2", "--warmup=1"]
    code, out, err = cli("bench", *model, f"--vocab={vocab}", *args, "--peers=eager_fp32",
                         "--out", tmp_path, "--quiet")  # fmt: skip
    assert code == 0, err
    rec = json.loads((tmp_path / "model-train.json").read_text())
    assert rec["tokens_per_s"] == pytest.approx(rec["fast_throughput"] * t)
    assert rec["peer_tokens_per_s"] == pytest.approx(rec["eager_fp32_throughput"] * t)
    closed = 3 * (depth * (24 * w * w + 4 * t * w) + 2 * w * vocab)
    mfu = rec["mfu"]
    assert mfu["flops_per_token"] == pytest.approx(closed, rel=0.01)
    ceiling = rec["gemm_ceiling_tflops"] * 1e12
    assert mfu["measured"] == pytest.approx(mfu["flops_per_token"] * rec["tokens_per_s"] / ceiling)
    assert "datasheet" not in mfu  # a CPU has no datasheet row
    assert f"{rec['tokens_per_s']:,.0f} tok/s" in out and "MFU" in out


def test_bench_check_can_fail(cli, tmp_path, monkeypatch):
    """A fast path further from float64 than its tolerance is `failed`, exit 1. The tolerance
    is squeezed to zero so the (correct) CPU step's bf16 rounding is over it."""
    from scalelab.fast import bench_check

    monkeypatch.setattr(bench_check, "FLOOR", 0.0)
    monkeypatch.setattr(bench_check, "SPREAD", 0.0)
    code, out, err = cli(*MLP_BENCH, "--iters", "2", "--peers", "eager", "--out", tmp_path)
    rec = json.loads((tmp_path / "mlp-train.json").read_text())
    assert code == 1 and rec["status"] == "failed" and rec["tolerance"] == 0.0
    assert "check failed" in rec["error"] and "check failed" in err and "FAIL" in out


def test_bench_default_peers_leave_emulated_bf16_out_on_a_cpu(monkeypatch):
    """A CPU without bf16 units emulates it (~16x slower than fp32): fp32 eager alone; with
    them, bf16 eager too; never Inductor's minutes-long C++ compile on a CPU; all on a GPU."""
    import torch

    from scalelab.fast import bench

    assert bench.default_peers("cuda") == ("eager_fp32", "eager", "compile", "compile_max")
    for native, want in ((False, ("eager_fp32",)), (True, ("eager_fp32", "eager"))):
        monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda n=native: n)
        assert bench.default_peers("cpu") == want


def test_bench_check_rules():
    from scalelab.fast import bench_check

    assert bench_check.deviation([2.0, 1.5], [2.0, 1.0]) == pytest.approx(0.25)
    assert bench_check.deviation([2.0, float("nan")], [2.0, 1.0]) == float("inf")
    assert bench_check.train_tolerance(1e-4) == bench_check.FLOOR
    assert bench_check.train_tolerance(0.01) == pytest.approx(0.04)


def test_bench_peers_are_validated(cli):
    code, _, err = cli(*MLP_BENCH, "--peers", "eager,turbo")
    assert code == 2 and "--peers" in err and len(err.strip().splitlines()) == 1
    code, _, err = cli(*MLP_BENCH, "--iters", "1")
    assert code == 2 and "--iters" in err


def test_bench_one_failing_workload_keeps_the_others(cli, tmp_path):
    """--image-size is wrong for charcnn: its record says why, alexnet is still measured."""
    code, out, err = cli(
        "bench",
        "charcnn",
        "alexnet",
        "--image-size",
        "67",
        "--batch",
        "1",
        "--iters",
        "2",
        "--warmup",
        "0",
        "--oracle-items",
        "1",
        "--peers",
        "eager",
        "--out",
        tmp_path,
        "--quiet",
    )
    assert code == 1
    failed = json.loads((tmp_path / "charcnn-default.json").read_text())
    assert failed["status"] == "failed" and "image-size" in failed["error"]
    ok = json.loads((tmp_path / "alexnet-infer.json").read_text())
    assert ok["status"] == "ok" and ok["relerr"] < BF16_TOL and ok["peers"] == ["eager"]
    assert "FAILED" in out and "alexnet" in out


def test_bench_unknown_workload_is_one_line_exit_2(cli):
    code, _, err = cli("bench", "nosuch")
    assert code == 2 and "unknown workload" in err and len(err.strip().splitlines()) == 1


def test_bench_refuses_a_model_the_factory_rejects_before_measuring(cli, tmp_path):
    """A --model whose factory raises: one line, exit 2, before the GEMM ceiling is measured
    or a workload announced, and no record written."""
    gpt = Path(__file__).resolve().parents[1] / "examples" / "models" / "gpt.py"
    code, _, err = cli("bench", f"--model={gpt}:gpt", "--model-arg=n_layer=2",
                       "--input-shape=8", "--input-dtype=int64", "--vocab=64",
                       "--out", tmp_path / "out")  # fmt: skip
    lines = [ln for ln in err.strip().splitlines() if not ln.startswith("bench: no CUDA GPU")]
    assert code == 2 and len(lines) == 1 and "unexpected keyword argument 'n_layer'" in lines[0]
    assert not (tmp_path / "out").exists()


def test_fast_path_only_for_the_workloads_own_module():
    """A wrapped or sharded model (tensor strategy) must not have its weights read by name."""
    from scalelab.fast import own_model

    workload = _workload("alexnet", batch=1, image_size=67)
    model = workload.build_model()
    assert own_model(workload, model)
    assert not own_model(workload, torch.nn.Sequential(model))
    model.fc8 = torch.nn.Linear(4096, 500)  # half the classes: a shard
    assert not own_model(workload, model)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_fast_trainer_follows_plain_loop(cli, monkeypatch, momentum):
    """FastTrainer's logic on CPU (the graph replay run eagerly): warm-up restored, data
    prepared once, the short last batch, momentum. fp32: losses equal the plain loop's."""
    import scalelab.fast.captured_step as fast_train

    monkeypatch.setattr(fast_train, "unsupported", lambda *a: None)
    common = ["mlp", "--train", "--epochs", "2", "--batch", "50", "--train-size", "230"]
    common += ["--heldout-size", "40", "--hidden", "16", "--momentum", str(momentum)]
    common += ["--no-record", "--json", "--quiet"]
    code, out, err = cli("run", *common, "--fast")
    assert code == 0, err
    fast = json.loads(out.splitlines()[-1])
    plain = json.loads(cli("run", *common)[1].splitlines()[-1])
    assert fast["steps"] == plain["steps"] == 10 and fast["items"] == plain["items"]
    assert fast["loss"] == pytest.approx(plain["loss"], rel=1e-5)
    assert fast["accuracy"] == plain["accuracy"]


def test_lrn_pool2d_autotuning_keeps_tiles_ptxas_compiles():
    """C = 300 (CP 512) at BW 32 stalled the GPU suite in ptxas: wide channel counts keep only
    the narrower tiles; AlexNet's (C 96, 256) keep every candidate. In a child process, since
    importing triton here would fix TRITON_INTERPRET for the other tests."""
    code = (
        "from scalelab.fast.kernels.lrn_pool2d import TUNING, _fitting, MAX_TILE\n"
        "import json\n"
        "print(json.dumps({cp: sorted({c.kwargs['BW'] for c in _fitting(TUNING, {}, CP=cp)})"
        " for cp in (128, 256, 512, 4096)}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    widths = json.loads(out.stdout.strip().splitlines()[-1])
    assert widths == {"128": [8, 16, 32], "256": [8, 16, 32], "512": [8, 16], "4096": [8]}
