"""ResNet-18 (both stems) and the CIFAR-10 reader: parameter counts, shapes, FLOPs against
FlopCounterMode, torch fp64 against the NumPy oracle, and the restricted unpickler."""

from __future__ import annotations

import os
import pickle
import struct

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from scalelab.config import RunConfig
from scalelab.data import cifar
from scalelab.errors import UsageError
from scalelab.oracle.check import relative_error
from scalelab.workloads import WORKLOADS
from scalelab.workloads.base import state_dict_float64
from scalelab.workloads.resnet import ResNet18, ResNet18Cifar

TORCHVISION_PARAMS = 11_181_642  # torchvision.models.resnet18(num_classes=10)
CIFAR_VARIANT_PARAMS = 11_173_962  # the same minus 64*3*(7*7 - 3*3) stem weights


def make(name: str = "resnet18", **kw) -> ResNet18:
    return WORKLOADS.get(name)(RunConfig(workload=name, **kw))


def flop_counts(model: nn.Module, x: torch.Tensor) -> dict[str, int]:
    """FlopCounterMode totals per module key '<RootClass>.<dotted path>'."""
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(x)
    return {k: sum(v.values()) for k, v in counter.get_flop_counts().items()}


def randomise_batchnorm(model: nn.Module, seed: int) -> None:
    """Give every BN non-trivial running statistics and affine parameters: with the defaults
    (mean 0, var 1, gamma 1, beta 0) BN is the identity and an oracle could skip it."""
    gen = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            c = m.num_features
            m.running_mean.copy_(torch.randn(c, generator=gen) * 0.1)
            m.running_var.copy_(torch.rand(c, generator=gen) + 0.5)
            with torch.no_grad():
                m.weight.copy_(torch.rand(c, generator=gen) + 0.5)
                m.bias.copy_(torch.randn(c, generator=gen) * 0.1)


@pytest.mark.parametrize(
    "name, cls, params",
    [
        ("resnet18", ResNet18, TORCHVISION_PARAMS),
        ("resnet18-cifar", ResNet18Cifar, CIFAR_VARIANT_PARAMS),
    ],
)
def test_parameter_counts(name, cls, params):
    w = make(name)
    assert isinstance(w, cls)
    model = w.build_model()
    assert sum(p.numel() for p in model.parameters()) == params
    assert sum(r.params for r in w.cost_table()) == params


def test_torchvision_module_names():
    model = make().build_model()
    keys = set(model.state_dict())
    for key in (
        "conv1.weight",
        "bn1.running_var",
        "layer1.0.conv1.weight",
        "layer1.1.bn2.bias",
        "layer2.0.downsample.0.weight",
        "layer2.0.downsample.1.running_mean",
        "layer4.1.conv2.weight",
        "fc.weight",
        "fc.bias",
    ):
        assert key in keys, key
    assert not any(k.startswith("layer1.0.downsample") for k in keys)  # 64 -> 64, stride 1
    assert sum(1 for k in keys if k.endswith("num_batches_tracked")) == 20  # 20 BNs
    assert model.conv1.kernel_size == (7, 7) and isinstance(model.maxpool, nn.MaxPool2d)
    cifar_model = make("resnet18-cifar").build_model()
    assert set(cifar_model.state_dict()) == keys
    assert cifar_model.conv1.kernel_size == (3, 3) and isinstance(cifar_model.maxpool, nn.Identity)


@pytest.mark.parametrize("name, final", [("resnet18", 1), ("resnet18-cifar", 4)])
def test_shapes_match_cost_table(name, final):
    """Every module's output shape equals the cost table's out_shape for its row."""
    w = make(name)
    model = w.build_model()
    seen: dict[str, tuple[int, ...]] = {}
    for path, m in model.named_modules():
        if isinstance(m, (nn.Conv2d, nn.BatchNorm2d, nn.Linear, nn.MaxPool2d)):
            m.register_forward_hook(
                lambda mod, inp, out, path=path: seen.__setitem__(path, tuple(out.shape[1:]))
            )
    with torch.no_grad():
        logits = model(w.prepare(w.synthetic_inputs(2, seed=0).x))
    assert logits.shape == (2, 10)
    table = {r.name: r.out_shape for r in w.cost_table()}
    assert seen == {path: table[path] for path in seen}
    assert table["layer4.1.conv2"] == (512, final, final)


@pytest.mark.parametrize("name", ["resnet18", "resnet18-cifar"])
def test_flops_match_flop_counter(name):
    w = make(name, image_size=16)
    model = w.build_model()
    counts = flop_counts(model, w.prepare(w.synthetic_inputs(1, seed=0).x))
    rows = [r for r in w.cost_table() if r.kind in ("conv", "linear")]
    for row in rows:
        assert counts[f"ResNet.{row.module}"] == pytest.approx(row.flops, rel=0.01), row.name
    # Complete: every conv and linear module of the model has its row.
    layers = {p for p, m in model.named_modules() if isinstance(m, (nn.Conv2d, nn.Linear))}
    assert {r.module for r in rows} == layers and len(layers) == 21
    assert counts["Global"] == pytest.approx(sum(r.flops for r in rows), rel=0.01)


def test_flops_at_224_match_torchvision_docs():
    """At 224x224 with 1000 classes torchvision documents resnet18 as 1.81 GFLOPS (its
    'FLOPS' are multiply-adds); checked on the meta device, so no arithmetic runs."""
    w = make(image_size=224, num_classes=1000)
    with torch.device("meta"):
        model = w._build()
    counts = flop_counts(model, torch.empty(1, 3, 224, 224, device="meta"))
    mm = sum(r.flops for r in w.cost_table() if r.kind in ("conv", "linear"))
    assert counts["Global"] == pytest.approx(mm, rel=0.01)
    assert mm / 2 == pytest.approx(1.81e9, rel=0.01)


def test_cost_table_is_complete():
    rows = make().cost_table()
    kinds = [r.kind for r in rows]
    assert kinds[:4] == ["conv", "batchnorm", "relu", "maxpool"]
    assert kinds[-2:] == ["avgpool", "linear"]
    assert kinds.count("conv") == 20 and kinds.count("batchnorm") == 20
    assert kinds.count("add") == 8 and kinds.count("relu") == 17
    assert "maxpool" not in [r.kind for r in make("resnet18-cifar").cost_table()]
    assert all(r.flops > 0 for r in rows)


@pytest.mark.parametrize("name, size", [("resnet18", 32), ("resnet18-cifar", 12)])
def test_fp64_torch_matches_numpy_oracle(name, size):
    w = make(name, image_size=size)
    model = w.build_model()
    randomise_batchnorm(model, seed=1)
    x = w.synthetic_inputs(2, seed=3).x
    ref = w.reference_forward(state_dict_float64(model), x.numpy())
    with torch.no_grad():
        out = model.double()(w.prepare(x)).numpy()
    assert out.shape == ref.shape == (2, 10)
    assert relative_error(out, ref) < 1e-10


def test_prepare_normalises_with_cifar_statistics():
    w = make()
    x = torch.tensor([0, 255, 128], dtype=torch.uint8).view(1, 3, 1, 1).expand(1, 3, 2, 2)
    got = w.prepare(x)
    assert got.dtype == torch.float32 and got.device == x.device
    want = [
        (v / 255 - m) / s for v, m, s in zip((0, 255, 128), cifar.CIFAR10_MEAN, cifar.CIFAR10_STD)
    ]
    assert got[0, :, 0, 0].tolist() == pytest.approx(want, rel=1e-6)


def test_pixel_table_is_the_float64_formula_rounded_once():
    table = cifar.pixel_table(cifar.CIFAR10_MEAN, cifar.CIFAR10_STD)
    assert table.shape == (3, 256) and table.dtype == np.float32
    for c, (m, s) in enumerate(zip(cifar.CIFAR10_MEAN, cifar.CIFAR10_STD)):
        want = np.float32([(v / 255 - m) / s for v in range(256)])
        assert np.array_equal(table[c], want)
    x = make().synthetic_inputs(3, seed=4).x
    got = make().prepare(x)
    assert np.array_equal(got.numpy().astype(np.float64), cifar.lookup_pixels_np(table, x.numpy()))
    assert got[1, 2, 5, 7] == table[2, x[1, 2, 5, 7]]  # channel 2 uses channel 2's row


@pytest.mark.gpu
def test_prepare_gives_the_same_bits_on_cuda():
    """CUDA computes x / 255 as x * (1/255); the table lookup must not."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    w = make()
    x = w.synthetic_inputs(4, seed=0).x
    assert torch.equal(w.prepare(x.cuda()).cpu(), w.prepare(x))


def test_synthetic_inputs_are_deterministic_uint8():
    w = make(num_classes=10)
    a, b, c = (w.synthetic_inputs(16, seed=s) for s in (5, 5, 6))
    assert a.x.dtype == torch.uint8 and a.x.shape == (16, 3, 32, 32)
    assert a.y.dtype == torch.int64 and int(a.y.min()) >= 0 and int(a.y.max()) <= 9
    assert torch.equal(a.x, b.x) and torch.equal(a.y, b.y)
    assert not torch.equal(a.x, c.x)


def test_bad_options_are_refused():
    for kw in ({"image_size": 0}, {"num_classes": 0}):
        with pytest.raises(UsageError):
            make(**kw)
    with torch.no_grad():  # the smallest image still computes (every map stays >= 1x1)
        w = make(image_size=1)
        assert w.build_model()(w.prepare(w.synthetic_inputs(2, seed=0).x)).shape == (2, 10)


def test_a_few_sgd_steps_fit_a_small_batch():
    """Training mode (batch statistics) runs and learns: the loss on 8 images falls."""
    w = make(lr=0.05, momentum=0.9)
    model = w.build_model().train()
    data = w.synthetic_inputs(8, seed=0)
    opt = w.optimizer(model)
    losses = []
    for _ in range(6):
        loss = w.loss(model, model(w.prepare(data.x)), data.y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


# --- CIFAR-10 reader ---------------------------------------------------------------------


def _py2_string(b: bytes) -> bytes:
    """SHORT_BINSTRING / BINSTRING: how Python 2 pickled its byte strings."""
    if len(b) < 256:
        return b"U" + bytes([len(b)]) + b
    return b"T" + struct.pack("<i", len(b)) + b


def _int(v: int) -> bytes:
    return b"J" + struct.pack("<i", v)  # BININT


# fmt: off
def py2_batch(data: np.ndarray, labels: list[int]) -> bytes:
    """A protocol-2 pickle laid out as Python 2 + NumPy 1 wrote the real CIFAR batches: byte
    string keys, the array as numpy.core.multiarray._reconstruct + ndarray.__setstate__.
    Opcodes: c GLOBAL, ( MARK, \x85/\x86/\x87 TUPLE1/2/3, t TUPLE, R REDUCE, b BUILD,
    N None, \x89 False, ] empty list, e APPENDS, } empty dict, u SETITEMS, . STOP."""
    rows, cols = data.shape
    dtype = b"".join([
        b"cnumpy\ndtype\n", _py2_string(b"u1"), _int(0), _int(1), b"\x87R",  # dtype("u1", 0, 1)
        b"(", _int(3), _py2_string(b"|"), b"NNN", _int(-1), _int(-1), _int(0), b"tb",  # state
    ])
    array = b"".join([
        b"cnumpy.core.multiarray\n_reconstruct\n",
        b"cnumpy\nndarray\n", _int(0), b"\x85", _py2_string(b"b"), b"\x87R",  # empty array
        b"(", _int(1), _int(rows), _int(cols), b"\x86", dtype,  # version, shape, dtype
        b"\x89", _py2_string(data.tobytes()), b"tb",  # not Fortran-ordered, the raw bytes
    ])
    label_list = b"](" + b"".join(_int(v) for v in labels) + b"e"
    return b"".join([
        b"\x80\x02}(", _py2_string(b"data"), array, _py2_string(b"labels"), label_list, b"u.",
    ])
# fmt: on


def fake_batch(n: int, seed: int) -> tuple[np.ndarray, list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (n, 3072), dtype=np.uint8), rng.integers(0, 10, n).tolist()


def test_reads_a_python2_batch(tmp_path):
    data, labels = fake_batch(6, seed=0)
    path = tmp_path / "test_batch"
    path.write_bytes(py2_batch(data, labels))
    x, y = cifar.read_batch(path)
    assert x.shape == (6, 3, 32, 32) and x.dtype == np.uint8
    assert np.array_equal(x[2, 1].ravel(), data[2, 1024:2048])  # green plane of image 2
    assert y.tolist() == labels


@pytest.mark.parametrize("protocol", [2, 5])
def test_reads_python3_pickles(tmp_path, protocol):
    data, labels = fake_batch(4, seed=1)
    path = tmp_path / "data_batch_1"
    path.write_bytes(
        pickle.dumps({b"data": data, b"labels": labels, b"batch_label": b"x"}, protocol=protocol)
    )
    x, y = cifar.read_batch(path)
    assert np.array_equal(x.reshape(4, -1), data) and y.tolist() == labels


def test_load_takes_the_first_n_in_batch_order(tmp_path):
    """data_batch_1, data_batch_2 (in cifar-10-batches-py/) then test_batch, n spanning two."""
    root = tmp_path / "cifar-10-batches-py"
    root.mkdir()
    batches = {
        name: fake_batch(5, seed=i)
        for i, name in enumerate(["data_batch_2", "test_batch", "data_batch_1"])
    }
    for name, (data, labels) in batches.items():
        (root / name).write_bytes(py2_batch(data, labels))
    x, y = cifar.load_cifar10(tmp_path, 7)
    want = np.concatenate([batches["data_batch_1"][0], batches["data_batch_2"][0][:2]])
    assert x.dtype == torch.uint8 and np.array_equal(x.numpy().reshape(7, -1), want)
    assert y.tolist() == batches["data_batch_1"][1] + batches["data_batch_2"][1][:2]
    with pytest.raises(UsageError, match="asked for 16 CIFAR-10 images, the batches hold 15"):
        cifar.load_cifar10(tmp_path, 16)


def test_workload_reads_real_inputs(tmp_path):
    data, labels = fake_batch(5, seed=2)
    (tmp_path / "data_batch_1").write_bytes(py2_batch(data, labels))
    w = make("resnet18-cifar", data_dir=str(tmp_path))
    inputs = w.inputs(4)
    assert inputs.x.shape == (4, 3, 32, 32) and inputs.y.tolist() == labels[:4]
    with pytest.raises(UsageError, match="32x32"):
        make(data_dir=str(tmp_path), image_size=64).inputs(4)


@pytest.mark.parametrize(
    "batch, message",
    [
        ({b"data": np.zeros((3, 1000), np.uint8), b"labels": [0, 1, 2]}, "must be"),
        ({b"data": np.zeros((3, 3072), np.float32), b"labels": [0, 1, 2]}, "must be"),
        ({b"data": np.zeros((3, 3072), np.uint8), b"labels": [0, 1]}, "labels of shape"),
        ({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 10]}, r"0\.\.9"),
        ({b"labels": [0]}, "no 'data' entry"),
        ([1, 2, 3], "is a dict"),
    ],
)
def test_malformed_batches_are_refused(tmp_path, batch, message):
    path = tmp_path / "data_batch_1"
    path.write_bytes(pickle.dumps(batch, protocol=2))
    with pytest.raises(UsageError, match=message):
        cifar.read_batch(path)


def test_truncated_and_missing_files(tmp_path):
    with pytest.raises(UsageError, match="no CIFAR-10 batches"):
        cifar.find_batches(tmp_path)
    data, labels = fake_batch(2, seed=0)
    (tmp_path / "test_batch").write_bytes(py2_batch(data, labels)[:-100])
    with pytest.raises(UsageError, match="not a readable CIFAR-10 batch"):
        cifar.load_cifar10(tmp_path, 1)


class _Evil:
    def __init__(self, func, arg):
        self.func, self.arg = func, arg

    def __reduce__(self):
        return self.func, (self.arg,)


# Protocol 2 writes Python 3's builtins under Python 2's name, __builtin__.
@pytest.mark.parametrize(
    "func, shown", [(os.system, rf"{os.system.__module__}\.system"), (eval, r"__builtin__\.eval")]
)
def test_malicious_pickle_is_refused_before_it_runs(tmp_path, func, shown):
    marker = tmp_path / "pwned"
    payload = f"touch {marker}" if func is os.system else f"open({str(marker)!r}, 'w')"
    path = tmp_path / "data_batch_1"
    path.write_bytes(pickle.dumps({b"data": _Evil(func, payload), b"labels": [0]}, protocol=2))
    with pytest.raises(UsageError, match=f"refuses to load {shown}"):
        cifar.read_batch(path)
    assert not marker.exists()


# --- against torchvision (device machine) ------------------------------------------------


@pytest.mark.gpu
def test_matches_torchvision_resnet18():
    """Same parameter count as torchvision's resnet18, and its state_dict loads (strictly)
    into ours and gives the same logits in fp64, on CUDA where present."""
    tv = pytest.importorskip("torchvision")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        theirs = tv.models.resnet18(num_classes=10)
    randomise_batchnorm(theirs, seed=2)
    w = make()
    ours = w.build_model()
    assert (
        sum(p.numel() for p in ours.parameters())
        == sum(p.numel() for p in theirs.parameters())
        == TORCHVISION_PARAMS
    )
    ours.load_state_dict(theirs.state_dict(), strict=True)
    ours, theirs = ours.double().to(device).eval(), theirs.double().to(device).eval()
    x = w.prepare(w.synthetic_inputs(4, seed=1).x.to(device))
    with torch.no_grad():
        got, want = ours(x), theirs(x.double())
    assert got.shape == want.shape == (4, 10)
    assert relative_error(got.cpu().numpy(), want.cpu().numpy()) < 1e-12
