"""`run --train --check`: training under a strategy against the same steps in one
float64 process, weights and buffers compared; and the timing passes that must leave no
trace in the model (the pipeline's --balance auto and --rebalance passes in training mode).
"""

from __future__ import annotations

import json
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
from torch import nn

from programs.train_helpers import PROGRAMS, launcher, run
from scalelab.config import RunConfig
from scalelab.layout.preserve import kept_state
from scalelab.layout.profiling import profile_layers
from scalelab.record import read_records
from scalelab.run.runner import execute, format_summary
from scalelab.train.sync_bn import AllReduceBatchNorm, convert
from scalelab.workloads.layers import Layer

NETS = PROGRAMS / "user_nets.py"
BN = dict(workload="model", model=f"{NETS}:rescnn", input_shape="3,12,12", train=True,
          train_size=16, heldout_size=4, batch=8, epochs=1, lr=0.2, dtype="fp64", quiet=True,
          threads=1)  # fmt: skip


# The user MLP (LayerNorm, dropout: the check turns it off and says so) has no BatchNorm.
MLP = dict(BN, model=f"{NETS}:mlp", input_shape="3,4", check=True)
RES = dict(BN, check=True)


def _launch(kind: str, ranks: int, runs: dict, out: Path, code: int = 0) -> dict:
    """Several runs in one launch (the ranks start once); the records by run name. The
    launch exits 1 when a check failed (tests/programs/check_runs.py)."""
    program = PROGRAMS / "check_runs.py"
    proc = run([*launcher(kind, ranks), str(program), str(out), json.dumps(runs)], timeout=400)
    assert proc.returncode == code, proc.stderr[-3000:]
    recs = read_records(out / "runs.jsonl")
    assert len(recs) == len(runs), proc.stderr[-3000:]
    return dict(zip(runs, recs, strict=True))


def _passes(rec: dict) -> None:
    tc = rec["train_check"]
    assert rec["status"] == "ok" and rec["check_passed"], tc
    assert rec["relerr"] <= rec["tolerance"] == 1e-12 and "fp64 floor" in tc["basis"], tc
    assert rec["reference"] == "train-fp64-one-process" and not tc["counts_differ"], tc


def _fails_by_batchnorm(rec: dict, over: str) -> None:
    tc = rec["train_check"]
    assert rec["status"] == "check-failed" and not rec["check_passed"], tc
    bn = tc["batchnorm"]
    assert bn["modules"] == ["bn", "res.bn1", "res.bn2"] and over in bn["normalises_over"], bn
    assert bn["running_stats_relerr"] > 1e-3 and "--sync-bn" in tc["cause"], tc


def _trained(tmp_path, name: str, **kw) -> dict[str, torch.Tensor]:
    path = tmp_path / f"{name}.pt"
    execute(RunConfig(**{**BN, **kw, "save_weights": str(path)}), None)
    return torch.load(path)


def test_one_process_checks_fp32_against_its_own_rounding_and_names_micro_batches():
    """local fp32: held to the fp32 floor or 10 x what one fp32 process loses (here it is that
    process), the basis recorded; a pipeline of 2 micro-batches on the BatchNorm net fails by
    design, naming the modules and offering --microbatches 1; the summary says both."""
    fp32 = execute(RunConfig(**{**MLP, "dtype": "fp32"}), None).record
    tc = fp32["train_check"]
    assert fp32["check_passed"] and 0 < fp32["relerr"] == tc["one_process_relerr"] < 1e-5, tc
    assert fp32["tolerance"] == max(1e-5, 10 * fp32["relerr"]) and "fp32" in tc["basis"]
    assert "relerr" in format_summary(fp32) and tc["dropout_off"] == ["drop"]
    report = execute(RunConfig(**RES, strategy="pipeline", stages=1, microbatches=2), None)
    rec = report.record
    assert report.exit_code == 1 and rec["status"] == "check-failed"
    bn = rec["train_check"]["batchnorm"]
    assert bn["modules"] == ["bn", "res.bn1", "res.bn2"] and "micro-batch" in bn["normalises_over"]
    assert "--microbatches 1" in format_summary(rec) and "FAILED" in format_summary(rec)


def test_profiling_a_layer_leaves_its_state_and_the_rng_as_they_were():
    bn, drop = nn.BatchNorm1d(3).double(), nn.Dropout(0.5)
    before = {k: v.clone() for k, v in bn.state_dict().items()}
    x = torch.randn(4, 3, dtype=torch.float64)
    rng = torch.get_rng_state()
    layers = [Layer("bn", "norm", bn), Layer("drop", "dropout", drop)]
    profile_layers(layers, x, torch.device("cpu"),
                   torch.float64, True, nullcontext)  # fmt: skip
    for key, value in bn.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert torch.equal(torch.get_rng_state(), rng)


def test_kept_state_restores_optimizer_state_and_gradients():
    lin = nn.Linear(2, 2)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1, momentum=0.9)
    lin(torch.ones(1, 2)).sum().backward()
    opt.step()
    state = {k: v.clone() for k, v in lin.state_dict().items()}
    grad = lin.weight.grad.clone()
    buf = opt.state[lin.weight]["momentum_buffer"].clone()
    with kept_state([lin], [opt]):
        lin(torch.ones(1, 2)).sum().backward()
        opt.step()
    assert all(torch.equal(v, state[k]) for k, v in lin.state_dict().items())
    assert torch.equal(lin.weight.grad, grad)
    assert torch.equal(opt.state[lin.weight]["momentum_buffer"], buf)


def test_pipeline_balancing_leaves_batchnorm_statistics_as_one_process(tmp_path):
    """--balance auto (the default) times every layer on a micro-batch in training mode: with
    one micro-batch the pipeline trains exactly what one process trains, running statistics
    and batch counts included (they were up to 0.244 off, counts 5-7 instead of 3). The torch
    engine's balancing is checked on 2 ranks with the --check launches below."""
    one = _trained(tmp_path, "one")
    pipe = _trained(tmp_path, "pipe", strategy="pipeline", stages=1, microbatches=1)
    assert int(one["bn.num_batches_tracked"]) == 2
    for key, value in one.items():
        assert torch.allclose(pipe[key], value, rtol=1e-12, atol=1e-14), key


@pytest.mark.mpi
def test_torchrun_strategies_and_meshes_train_what_one_process_trains(tmp_path):
    """4 gloo ranks in one launch (starting ranks costs more than these runs): ddp, the
    scheduled pipeline, DTensor's tensor parallelism and the 2-D meshes dp2 x pp2 (the torch
    engine) and dp2 x tp2 pass the check on the user MLP (dropout off, said). On the BatchNorm
    net ddp fails by design (the modules, the difference, --sync-bn offered) and passes with
    --sync-bn; the torch engine with one micro-batch passes: its --balance auto and torch's
    shape inference leave BatchNorm's statistics as one process leaves them."""
    four, torch_engine = {**MLP, "ranks": 4}, {"engine": "torch"}
    runs = {
        "ddp": {**four, "strategy": "ddp"},
        "pipe": {**four, "strategy": "pipeline", "stages": 4, "microbatches": 2},
        "tensor": {**four, **torch_engine, "strategy": "tensor", "tp": 4},
        "dp_pp": {**four, **torch_engine, "strategy": "pipeline", "dp": 2, "stages": 2,
                  "microbatches": 2},
        "dp_tp": {**four, **torch_engine, "strategy": "tensor", "dp": 2, "tp": 2},
        "bn_ddp": {**RES, "ranks": 4, "strategy": "ddp"},
        "bn_ddp_sync": {**RES, "ranks": 4, "strategy": "ddp", "sync_bn": True},
        "bn_pipe_torch": {**RES, **torch_engine, "ranks": 4, "strategy": "pipeline",
                          "stages": 4, "microbatches": 1},
        "fp32_inside": {**MLP, "model": f"{NETS}:fp32_norm_mlp", "ranks": 4, "strategy": "ddp"},
    }  # fmt: skip
    recs = _launch("torchrun", 4, runs, tmp_path, code=1)
    verdicts = {n: (r["status"], r.get("relerr"), r.get("error")) for n, r in recs.items()}
    for name in ("ddp", "pipe", "tensor", "dp_pp", "dp_tp", "bn_ddp_sync", "bn_pipe_torch"):
        assert recs[name]["status"] == "ok", verdicts
        _passes(recs[name])
    assert recs["ddp"]["train_check"]["dropout_off"] == ["drop"]
    assert recs["dp_pp"]["config"]["dp"] == recs["dp_tp"]["config"]["tp"] == 2
    _fails_by_batchnorm(recs["bn_ddp"], "each rank's share")
    assert recs["bn_ddp_sync"]["train_check"]["sync_bn"] is True
    # A norm computing in float32 inside an fp64 model: each rank's share of its gradient
    # rounds to fp32 apart from the whole batch's; judged at the fp32 floor, the module named.
    inside = recs["fp32_inside"]
    assert inside["status"] == "ok" and inside["check_passed"], verdicts
    assert 1e-12 < inside["relerr"] <= inside["tolerance"] == 1e-5, verdicts
    assert inside["train_check"]["float32_inside"] == ["2"], inside["train_check"]
    assert "fp32 floor" in inside["train_check"]["basis"]


@pytest.mark.mpi
def test_mpi_dp_checked_batchnorm_synced_and_a_wrong_training_fails(tmp_path):
    """mpiexec -n 2: mpi-dp passes on the MLP; on the BatchNorm net it fails by design and
    passes with --sync-bn (AllReduceBatchNorm over MPI: SyncBatchNorm does not run on CPU);
    a model whose gradient differs per rank (scaled by 1 + rank in training) fails: status
    check-failed, and the launch exits 1 as `scalelab run` does (RunReport.exit_code)."""
    runs = {
        "dp": {**MLP, "ranks": 2, "strategy": "mpi-dp"},
        "bn": {**RES, "ranks": 2, "strategy": "mpi-dp"},
        "bn_sync": {**RES, "ranks": 2, "strategy": "mpi-dp", "sync_bn": True},
        "wrong": {**MLP, "model": f"{NETS}:per_rank", "ranks": 2, "strategy": "mpi-dp"},
    }
    recs = _launch("mpi", 2, runs, tmp_path, code=1)
    _passes(recs["dp"])
    _passes(recs["bn_sync"])
    _fails_by_batchnorm(recs["bn"], "each rank's share")
    wrong = recs["wrong"]
    assert wrong["status"] == "check-failed" and wrong["relerr"] > 1e-3, wrong["train_check"]
    assert "batchnorm" not in wrong["train_check"] and not wrong["train_check"]["cause"]


def test_allreduce_batchnorm_is_batchnorm_in_one_process():
    """With the identity as the all-reduce (one rank), outputs, input gradients and running
    statistics are plain BatchNorm's; eval mode uses the running statistics."""
    torch.manual_seed(0)
    x = torch.randn(6, 3, 4, 4, dtype=torch.float64, requires_grad=True)
    ref = nn.BatchNorm2d(3).double()
    synced = convert(nn.Sequential(nn.BatchNorm2d(3).double()), lambda t: t)[0]
    assert isinstance(synced, AllReduceBatchNorm)
    weight = torch.randn(6, 3, 4, 4, dtype=torch.float64)
    grads = []
    for m in (synced, ref):
        (m(x) * weight).sum().backward()
        grads.append(x.grad.clone())
        x.grad = None
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-12, atol=1e-12)
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(synced.state_dict()[key], value, rtol=1e-14, atol=0)
    synced.eval(), ref.eval()
    torch.testing.assert_close(synced(x), ref(x), rtol=1e-14, atol=1e-14)


def test_sync_bn_and_resume_are_refused_where_they_cannot_apply(cli):
    for args, needle in (
        (["--strategy", "pipeline", "--sync-bn"], "--microbatches 1"),
        (["--strategy", "local", "--sync-bn"], "only ddp and mpi-dp"),
        (["--check", "--resume", str(NETS)], "cannot follow --resume"),
    ):
        code, out, err = cli("run", "mlp", "--train", *args, "--no-record")
        assert code == 2 and out == "" and needle in err, err


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_ddp_on_gpus_syncs_batchnorm_with_torch_syncbatchnorm(tmp_path):
    """NCCL ranks: --sync-bn is torch's SyncBatchNorm; without it the check names BatchNorm."""
    gpu = {**RES, "ranks": 2, "strategy": "ddp", "device": "cuda"}
    recs = _launch("torchrun", 2, {"sync": {**gpu, "sync_bn": True}, "per_rank": gpu},
                   tmp_path, code=1)  # fmt: skip
    _passes(recs["sync"])
    _fails_by_batchnorm(recs["per_rank"], "each rank's share")


def test_dropout_off_finds_the_probabilities_a_forward_hands_to_f_dropout():
    """Hugging Face's OPT keeps dropout, activation_dropout and layerdrop as floats and calls
    F.dropout: with nn.Dropout modules only found, two ranks drew different masks and a
    2-stage pipeline's --check failed at relerr 1e-2. After dropout_off a training-mode
    forward repeats itself, and the modules are named."""
    from scalelab.run.train_check import dropout_off

    class Functional(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(6, 6)
            self.dropout, self.layerdrop, self.drop_last = 0.5, 0.3, True
            self.inner = nn.Dropout(0.2)

        def forward(self, x):
            h = nn.functional.dropout(self.lin(x), p=self.dropout, training=self.training)
            if self.training and torch.rand(()) < self.layerdrop:
                return h
            return self.inner(self.lin(h))

    model, x = Functional().train(), torch.randn(4, 6)
    assert not torch.equal(model(x), model(x))
    assert dropout_off(model) == ["Functional", "inner"]
    assert (model.dropout, model.layerdrop, model.drop_last, model.inner.p) == (0.0, 0.0, True, 0.0)
    assert torch.equal(model(x), model(x))


def test_float32_inside_names_the_modules_that_compute_in_float32():
    from programs.user_nets import fp32_norm_mlp, mlp
    from scalelab.run.train_check import float32_inside

    x = torch.randn(2, 3, 4, dtype=torch.float64)
    assert float32_inside(fp32_norm_mlp().double(), x) == ["2"]
    assert float32_inside(mlp().double(), x) == []
