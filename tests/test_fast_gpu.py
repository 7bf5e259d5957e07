"""The fast path on a CUDA GPU (`pytest -m gpu` on the device machine): every Triton kernel
against its torch reference on fresh random inputs and odd shapes, every workload's `--fast`
output against the float64 oracle, the captured training step against float64, and the CLI."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from scalelab.config import RunConfig
from scalelab.oracle.check import relative_error
from scalelab.workloads import WORKLOADS
from scalelab.workloads.base import state_dict_float64

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
CUDA = torch.device("cuda")
BF16 = torch.bfloat16
KERNEL_TOL = 2e-2  # two bf16 roundings of the same math
ORACLE_TOL = 5e-2  # precision.py's bf16 tolerance


@pytest.fixture(scope="module")
def kernels():
    from scalelab.fast.kernels import charcnn_block1, conv1d, epilogue2d, layernorm1d, lrn_pool2d

    return charcnn_block1, conv1d, epilogue2d, layernorm1d, lrn_pool2d


def _poisoned(shape, channels_last=False):
    t = torch.full(shape, float("nan"), device=CUDA, dtype=BF16)
    return t.contiguous(memory_format=torch.channels_last) if channels_last else t


def _check(out, ref):
    assert not torch.isnan(out).any(), "elements left unwritten"
    err = float((out.float() - ref.float()).norm() / ref.float().norm())
    assert err < KERNEL_TOL, f"relerr {err:.2e}"


@pytest.mark.parametrize("n, l_in, v, c", [(3, 31, 13, 64), (5, 1014, 70, 256), (2, 50, 70, 96)])
def test_block1_kernel(kernels, n, l_in, v, c):
    from scalelab.fast import reference as R

    w, b = torch.randn(c, v, 7, device=CUDA) * 0.2, torch.randn(c, device=CUDA) * 0.1
    l_raw = l_in - 6
    g = (1 + 0.1 * torch.randn(l_raw, c, device=CUDA)).to(BF16)
    be = (0.1 * torch.randn(l_raw, c, device=CUDA)).to(BF16)
    idx = torch.randint(0, v + 3, (n, l_in), device=CUDA, dtype=torch.uint8)
    table = R.gather_table(w, BF16)
    for bc, bt in ((32, 64), (64, 32)):
        out = _poisoned((n, l_raw // 3, c))
        if c % bc:  # the kernel tiles channels exactly: a block that does not divide is refused
            with pytest.raises(ValueError, match="must divide"):
                kernels[0].block1(idx, table, b, g, be, 1e-5, 3, out=out, bc=bc, bt=bt)
            continue
        kernels[0].block1(idx, table, b, g, be, 1e-5, 3, out=out, bc=bc, bt=bt)
        _check(out, R.block1(idx, table, b, g, be, 1e-5, 3))


@pytest.mark.parametrize(
    "n, length, ci, co, k, pool, relu",
    [
        (3, 336, 256, 256, 7, 3, True),
        (7, 110, 256, 256, 3, 1, True),
        (2, 37, 128, 256, 3, 1, False),
    ],
)
def test_conv1d_kernel(kernels, n, length, ci, co, k, pool, relu):
    from scalelab.fast import reference as R

    conv = kernels[1]
    x = torch.randn(n, length, ci, device=CUDA).to(BF16)
    w = (torch.randn(k, ci, co, device=CUDA) * 0.05).to(BF16)
    b = torch.randn(co, device=CUDA)
    ref = R.conv1d(x.float(), w.float(), b, pool, relu)
    configs = conv.GPU_CONFIGS if pool > 1 else conv.GPU_CONFIGS_UNPOOLED
    for cfg in configs:
        out = _poisoned((n, (length - k + 1) // pool, co))
        conv.conv1d(x, w, b, pool, relu, cfg, out=out)
        _check(out, ref)


@pytest.mark.parametrize("n, length, c", [(3, 102, 256), (2, 25, 48)])
def test_layernorm_kernel(kernels, n, length, c):
    from scalelab.fast import reference as R

    x = torch.randn(n, length, c, device=CUDA).to(BF16)
    g = (1 + 0.1 * torch.randn(length, c, device=CUDA)).to(BF16)
    b = (0.1 * torch.randn(length, c, device=CUDA)).to(BF16)
    out = _poisoned((n, length // 3, c))
    kernels[3].layernorm_relu_pool(x, g, b, 1e-5, 3, out=out, bc=16 if c % 64 else 64)
    _check(out, R.layernorm_relu_pool(x, g, b, 1e-5, 3))


LRN = (5, 1e-4, 0.75, 2.0)


@pytest.mark.parametrize(
    "n, c, h, lrn, pool",
    [
        (4, 96, 55, LRN, (3, 2)),
        (3, 256, 27, LRN, (3, 2)),
        (2, 384, 13, None, None),
        (3, 256, 13, None, (3, 2)),
        (2, 40, 13, (5, 1.0, 0.75, 2.0), (3, 2)),
        (3, 33, 17, (5, 1.0, 0.75, 2.0), None),
        (2, 300, 14, LRN, (3, 2)),
    ],
)
def test_epilogue2d_kernel(kernels, n, c, h, lrn, pool):
    from scalelab.fast import reference as R

    y = (3 * torch.randn(n, c, h, h, device=CUDA)).to(BF16)
    y = y.contiguous(memory_format=torch.channels_last)
    b = torch.randn(c, device=CUDA)
    kp, sp = pool or (1, 1)
    ho = (h - kp) // sp + 1
    out = _poisoned((n, c, ho, ho), channels_last=True)
    if lrn is None:
        kernels[2].epilogue2d(y, b, pool, out=out)
    else:
        kernels[4].lrn_pool2d(y, b, lrn, pool, out=out)
    _check(out, R.epilogue2d(y, b, lrn, pool))


WORKLOADS_SMALL = {
    "charcnn": {"batch": 16},
    "alexnet": {"batch": 8},
    "resnet18": {"batch": 32},
    "resnet18-cifar": {"batch": 16},
    "mlp": {"batch": 64},
    "vgg16": {"batch": 4, "image_size": 32, "num_classes": 10},
    "deepstack": {"batch": 4, "image_size": 16, "convs": 3, "fcs": 1},
}


@pytest.mark.parametrize("name", sorted(WORKLOADS_SMALL))
def test_fast_forward_matches_float64_oracle(name):
    from scalelab.fast import accelerate

    kw = WORKLOADS_SMALL[name]
    cfg = RunConfig(workload=name, dtype="bf16", quiet=True, **kw)
    workload = WORKLOADS.get(name)(cfg)
    model = workload.build_model().to(CUDA)
    lines = []
    fast = accelerate(workload, model, cfg, CUDA, log=lines.append)
    x = workload.inputs(kw["batch"]).x
    ref = workload.reference_forward(state_dict_float64(model), x.numpy())
    for _ in range(3):  # setup, then graph replays with a fresh copy of the input
        out = fast(x.to(CUDA))
    assert relative_error(out.double().cpu().numpy(), ref) < ORACLE_TOL
    assert fast.parts["graph"] == "captured", lines


def test_local_fast_run_checks_against_oracle(cli):
    code, out, err = cli(
        "run",
        "charcnn",
        "--device",
        "cuda",
        "--dtype",
        "bf16",
        "--fast",
        "--batch",
        "64",
        "--check",
        "--no-record",
    )
    assert code == 0, err
    assert "fast path:" in err and "check: relerr" in out


def test_local_fast_requires_bf16(cli):
    code, _, err = cli("run", "mlp", "--device", "cuda", "--fast", "--no-record")
    assert code == 2 and "--dtype bf16" in err


@pytest.mark.parametrize("name, kw", [("mlp", {"hidden": 64}), ("resnet18", {})])
def test_captured_steps_match_float64_steps(name, kw):
    """Two replays of the captured step (different batches, momentum 0.9) move the weights as
    two float64 steps do, within bf16: warm-up and capture left no trace (weights, batch-norm
    statistics, momentum restored) and each replay reads its new batch."""
    from scalelab.fast.bench import _params, _update_relerr, eager_train_step
    from scalelab.fast.captured_step import GraphStep

    batch = 256
    cfg = RunConfig(
        workload=name,
        dtype="bf16",
        train=True,
        batch=batch,
        train_size=1024,
        heldout_size=16,
        momentum=0.9,
        **kw,
    )
    workload = WORKLOADS.get(name)(cfg)
    model = workload.build_model().to(CUDA).train()
    train, _ = workload.training_data()
    data = (train.x.to(CUDA), train.y.to(CUDA))
    batches = torch.randperm(len(train), device=CUDA)[: 2 * batch].view(2, batch)
    before = _params(model)

    def two_steps(step):
        for idx in batches:
            step(idx)

    m64 = copy.deepcopy(model).double()
    two_steps(eager_train_step(workload, m64, workload.optimizer(m64), data, None, torch.float64))
    after64 = _params(m64)
    ref = {k: after64[k] - before[k] for k in before}
    eager = copy.deepcopy(model)
    two_steps(eager_train_step(workload, eager, workload.optimizer(eager), data, BF16))
    fast = copy.deepcopy(model)
    graph = GraphStep(
        fast, workload.optimizer(fast), workload.prepare, workload.loss, data, batch, BF16
    )
    two_steps(graph.step)
    fast_err, eager_err = _update_relerr(fast, before, ref), _update_relerr(eager, before, ref)
    assert fast_err < max(ORACLE_TOL, 2 * eager_err), (fast_err, eager_err)


def test_fast_training_run_follows_plain_loop(cli):
    """Same batches, loss and optimizer: per-epoch losses agree within bf16, items equal."""
    common = [
        "mlp",
        "--train",
        "--device",
        "cuda",
        "--dtype",
        "bf16",
        "--epochs",
        "3",
        "--batch",
        "100",
        "--train-size",
        "1050",
        "--heldout-size",
        "200",
        "--momentum",
        "0.9",
        "--no-record",
        "--json",
        "--quiet",
    ]
    code, out, err = cli("run", *common, "--fast")
    assert code == 0, err
    fast = json.loads(out.splitlines()[-1])
    plain = json.loads(cli("run", *common)[1].splitlines()[-1])
    assert fast["steps"] == plain["steps"] == 33 and fast["items"] == plain["items"]
    for a, b in zip(fast["loss"], plain["loss"]):
        assert abs(a - b) < 2e-2 * abs(b)


def test_bench_on_gpu(cli, tmp_path):
    code, out, err = cli(
        "bench",
        "mlp",
        "--batch",
        "500",
        "--train-size",
        "5000",
        "--iters",
        "3",
        "--out",
        tmp_path,
        "--quiet",
    )
    assert code == 0, err
    rec = json.loads((tmp_path / "mlp-train.json").read_text())
    assert rec["gpu"] == torch.cuda.get_device_name(0)
    assert rec["fast_parts"]["step"] == "CUDA graph"
    assert rec["relerr"] < ORACLE_TOL
