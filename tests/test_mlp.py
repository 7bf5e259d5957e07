"""The MNIST MLP: IDX reader, NumPy float64 forward and SGD oracle, cost table, real training."""

from __future__ import annotations

import gzip
import json
import struct
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from scalelab.config import RunConfig
from scalelab.data import mnist
from scalelab.errors import UsageError
from scalelab.workloads import WORKLOADS
from scalelab.workloads.base import state_dict_float64
from scalelab.workloads.mlp import (
    C,
    D,
    MnistMLP,
    reference_loss_and_grads,
    reference_sgd_step,
    scale_pixels,
)


def make(**kw) -> MnistMLP:
    return WORKLOADS.get("mlp")(RunConfig(workload="mlp", **kw))


def relerr(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def write_idx(path: Path, magic: int, dims: tuple[int, ...], payload: bytes, gz: bool = False):
    data = struct.pack(f">I{len(dims)}I", magic, *dims) + payload
    path.write_bytes(gzip.compress(data) if gz else data)


def write_split(folder: Path, split: str, images: np.ndarray, labels: np.ndarray, gz=True):
    """A small valid IDX split: images (N, 28, 28) uint8, labels (N,) uint8."""
    ext = ".gz" if gz else ""
    write_idx(folder / f"{split}-images-idx3-ubyte{ext}", 2051, images.shape, images.tobytes(), gz)
    write_idx(folder / f"{split}-labels-idx1-ubyte{ext}", 2049, labels.shape, labels.tobytes(), gz)


def fake_split(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
    return images, rng.integers(0, 10, n, dtype=np.uint8)


# --- the float64 oracle ------------------------------------------------------------------
def test_numpy_forward_matches_torch_fp64():
    wl = make(hidden=64)
    model = wl.build_model().double()
    x = wl.synthetic_inputs(16, seed=3).x
    with torch.no_grad():
        out = model(wl.prepare(x)).numpy()
    ref = wl.reference_forward(state_dict_float64(model), x.numpy())
    assert out.shape == ref.shape == (16, C)
    assert relerr(out, ref) < 1e-10


def test_hand_gradients_match_finite_differences():
    """Backprop by hand against central differences of the oracle's own loss (no torch)."""
    wl = make(hidden=8)
    params = state_dict_float64(wl.build_model())
    data = wl.synthetic_inputs(5, seed=4)
    x, y, l2 = scale_pixels(data.x.numpy()), data.y.numpy(), 0.05
    _, grads = reference_loss_and_grads(params, x, y, l2)
    rng, h = np.random.default_rng(0), 1e-6
    for key in params:
        for idx in [tuple(rng.integers(0, s) for s in params[key].shape) for _ in range(4)]:
            plus = {k: v.copy() for k, v in params.items()}
            minus = {k: v.copy() for k, v in params.items()}
            plus[key][idx] += h
            minus[key][idx] -= h
            numeric = (
                reference_loss_and_grads(plus, x, y, l2)[0]
                - reference_loss_and_grads(minus, x, y, l2)[0]
            ) / (2 * h)
            assert grads[key][idx] == pytest.approx(numeric, rel=1e-5, abs=1e-9), (key, idx)


def test_numpy_sgd_matches_torch_fp64_training():
    """Three SGD steps: torch autograd + optim.SGD with the workload's loss vs the oracle
    (reference_train_step, the serial strategy's entry, on transport-form uint8 batches)."""
    wl = make(hidden=32, lr=0.5, l2=0.01)
    model = wl.build_model().double().train()
    # Copies: for a float64 model, state_dict_float64 returns views of the live parameters.
    params = {k: v.copy() for k, v in state_dict_float64(model).items()}
    start = {k: v.copy() for k, v in params.items()}
    opt = wl.optimizer(model)
    data = wl.synthetic_inputs(60, seed=5)
    for step in range(3):
        batch = data.slice(20 * step, 20 * (step + 1))
        loss = wl.loss(model, model(wl.prepare(batch.x)), batch.y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        ref_loss = wl.reference_train_step(params, batch.x.numpy(), batch.y.numpy())
        assert loss.item() == pytest.approx(ref_loss, rel=1e-12)
    trained = state_dict_float64(model)
    for key, ref in params.items():
        assert relerr(trained[key], ref) < 1e-10, key
        assert relerr(start[key], ref) > 1e-4, key  # the steps really moved every tensor


def test_reference_sgd_step_is_plain_sgd_on_the_hand_gradients():
    wl = make(hidden=8, momentum=0.9)
    params = state_dict_float64(wl.build_model())
    data = wl.synthetic_inputs(6, seed=6)
    x, y = scale_pixels(data.x.numpy()), data.y.numpy()
    new, loss = reference_sgd_step(params, x, y, lr=0.3, l2=0.02)
    ref_loss, grads = reference_loss_and_grads(params, x, y, 0.02)
    assert loss == ref_loss
    for key in params:
        np.testing.assert_array_equal(new[key], params[key] - 0.3 * grads[key])
    with pytest.raises(UsageError, match="momentum"):
        wl.reference_train_step(params, data.x.numpy(), y)


def test_loss_regularises_weights_not_biases():
    wl = make(hidden=16, l2=0.3)
    model = wl.build_model().double()
    logits, y = torch.zeros(4, C, dtype=torch.float64), torch.tensor([0, 1, 2, 3])
    w2 = sum(float((p.detach() ** 2).sum()) for p in (model.fc1.weight, model.fc2.weight))
    expected = np.log(C) + 0.3 / 2 * w2  # uniform logits: cross-entropy = log C
    assert wl.loss(model, logits, y).item() == pytest.approx(expected, rel=1e-12)


# --- inputs ------------------------------------------------------------------------------
def test_synthetic_inputs_are_deterministic_and_learnable():
    wl = make()
    a, b, c = (wl.synthetic_inputs(400, seed=s) for s in (7, 7, 8))
    assert a.x.dtype == torch.uint8 and a.x.shape == (400, D)
    assert a.y.dtype == torch.int64 and set(a.y.tolist()) == set(range(C))
    assert torch.equal(a.x, b.x) and torch.equal(a.y, b.y)
    assert not torch.equal(a.x, c.x)
    # Labels follow the pixels: class means from the first half classify the second half.
    x, y = a.x.double(), a.y
    means = torch.stack([x[:200][y[:200] == k].mean(0) for k in range(C)])
    pred = torch.cdist(x[200:], means).argmin(1)
    assert (pred == y[200:]).double().mean() > 0.95


def test_prepare_scales_on_device_and_oracle_sees_the_same_values():
    wl = make()
    x = torch.arange(256, dtype=torch.uint8).reshape(1, 256)
    out = wl.prepare(x)
    assert out.dtype == torch.float32 and out.device == x.device
    assert out[0, 0] == 0 and out[0, 255] == 1 and out[0, 51] == pytest.approx(0.2)
    # Bit for bit: the oracle starts from prepare()'s float32 values, not the exact k/255.
    np.testing.assert_array_equal(scale_pixels(x.numpy()), out.double().numpy())


def test_options_the_mlp_cannot_honour():
    with pytest.raises(UsageError, match="28x28"):
        make(image_size=32)
    with pytest.raises(UsageError, match="10 classes"):
        make(num_classes=5)
    with pytest.raises(UsageError, match="l2"):
        make(l2=-1.0)


# --- the IDX reader ----------------------------------------------------------------------
def test_reader_on_real_mnist_test_set(mnist_dir):
    data = mnist.load_split(mnist_dir, "t10k")
    assert data.images.shape == (10_000, 784) and data.images.dtype == np.uint8
    assert data.labels.dtype == np.int64 and data.labels[0] == 7
    hist = np.bincount(data.labels, minlength=10)
    assert hist.sum() == 10_000 and len(hist) == 10 and hist.min() > 800
    assert mnist.available_splits(mnist_dir) == ["t10k"]
    wl = make(data_dir=str(mnist_dir))
    first = wl.real_inputs(5)
    assert first.x.dtype == torch.uint8 and first.y.tolist()[0] == 7
    assert torch.equal(first.x, torch.from_numpy(data.images[:5].copy()))


def test_gzip_detected_by_magic_bytes_not_name(tmp_path, mnist_dir):
    raw = gzip.decompress((mnist_dir / "t10k-labels-idx1-ubyte.gz").read_bytes())
    (tmp_path / "plain").write_bytes(raw)
    (tmp_path / "misnamed.gz").write_bytes(raw)
    expected = mnist.read_labels(mnist_dir / "t10k-labels-idx1-ubyte.gz")
    np.testing.assert_array_equal(mnist.read_labels(tmp_path / "plain"), expected)
    np.testing.assert_array_equal(mnist.read_labels(tmp_path / "misnamed.gz"), expected)


def test_reader_roundtrip_raw_and_gzip(tmp_path):
    images, labels = fake_split(6, seed=0)
    write_split(tmp_path, "t10k", images, labels, gz=False)
    data = mnist.load_split(tmp_path, "t10k")
    np.testing.assert_array_equal(data.images, images.reshape(6, 784))
    np.testing.assert_array_equal(data.labels, labels)


@pytest.mark.parametrize(
    "corruption, match",
    [
        ("wrong_magic", "magic number 2049, expected 2051"),
        ("truncated", "truncated"),
        ("padded", "truncated or padded"),
        ("not_28x28", "27x28"),
        ("label_range", "outside 0..9"),
        ("count_mismatch", "5 images but .* 4 labels"),
        ("bad_gzip", "corrupt gzip"),
        ("tiny", "shorter than an IDX header"),
    ],
)
def test_corrupt_files_are_usage_errors(tmp_path, corruption, match):
    images, labels = fake_split(5, seed=1)
    write_split(tmp_path, "t10k", images, labels)
    img_path = tmp_path / "t10k-images-idx3-ubyte.gz"
    lab_path = tmp_path / "t10k-labels-idx1-ubyte.gz"
    if corruption == "wrong_magic":  # a label header on the image file
        write_idx(img_path, 2049, images.shape, images.tobytes(), gz=True)
    elif corruption == "truncated":
        write_idx(img_path, 2051, images.shape, images.tobytes()[:-100], gz=True)
    elif corruption == "padded":
        write_idx(img_path, 2051, images.shape, images.tobytes() + b"\0", gz=True)
    elif corruption == "not_28x28":
        write_idx(img_path, 2051, (5, 27, 28), images[:, :27].tobytes(), gz=True)
    elif corruption == "label_range":
        write_idx(lab_path, 2049, (5,), bytes([1, 2, 10, 3, 4]), gz=True)
    elif corruption == "count_mismatch":
        write_idx(lab_path, 2049, (4,), labels[:4].tobytes(), gz=True)
    elif corruption == "bad_gzip":
        img_path.write_bytes(img_path.read_bytes()[:200])
    elif corruption == "tiny":
        lab_path.write_bytes(b"\0\0\x08")
    with pytest.raises(UsageError, match=match):
        mnist.load_split(tmp_path, "t10k")
    with pytest.raises(UsageError, match=match):
        make(data_dir=str(tmp_path)).real_inputs(2)


def test_missing_files_name_what_is_expected(tmp_path):
    with pytest.raises(UsageError, match="train-images-idx3-ubyte.*t10k-labels-idx1-ubyte"):
        make(data_dir=str(tmp_path))  # validate() fails before anything runs
    images, labels = fake_split(3, seed=2)
    write_split(tmp_path, "train", images, labels)
    (tmp_path / "train-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(UsageError, match="no train-labels-idx1-ubyte"):
        make(data_dir=str(tmp_path))


def test_official_train_split_is_used_with_t10k_held_out(tmp_path):
    train_img, train_lab = fake_split(30, seed=3)
    test_img, test_lab = fake_split(12, seed=4)
    write_split(tmp_path, "train", train_img, train_lab, gz=False)
    write_split(tmp_path, "t10k", test_img, test_lab)
    wl = make(data_dir=str(tmp_path), train_size=8, heldout_size=2)
    train, held = wl.training_data()
    assert torch.equal(train.x, torch.from_numpy(train_img.reshape(30, 784)))
    assert torch.equal(held.y, torch.from_numpy(test_lab).long())
    assert torch.equal(wl.real_inputs(4).y, torch.from_numpy(train_lab[:4]).long())
    with pytest.raises(UsageError, match="asked for 31 MNIST images but the data has 30"):
        wl.real_inputs(31)


def test_t10k_alone_is_split_seeded_and_disjoint(mnist_dir):
    wl = make(data_dir=str(mnist_dir))
    train, held = wl.training_data()
    assert len(train) == 8000 and len(held) == 2000
    seen = {row.tobytes() for row in train.x.numpy()}
    assert sum(row.tobytes() in seen for row in held.x.numpy()) < 5  # MNIST has a few dupes


# --- cost model --------------------------------------------------------------------------
def test_cost_table_matches_flop_counter_and_seed_formula():
    h, batch = 96, 7
    wl = make(hidden=h)
    table = wl.cost_table()
    assert [row.name for row in table] == ["fc1", "sigmoid", "fc2", "softmax"]
    model = wl.build_model()
    assert sum(row.params for row in table) == sum(p.numel() for p in model.parameters())
    with FlopCounterMode(display=False) as counter:
        model(wl.prepare(wl.synthetic_inputs(batch, seed=0).x))
    counts = counter.get_flop_counts()
    for row in (r for r in table if r.module):
        measured = sum(counts[f"MLP.{row.module}"].values())
        assert measured == pytest.approx(batch * row.flops, rel=0.01), row.name
    matmuls = batch * sum(r.flops for r in table if r.kind == "linear")
    assert matmuls == 2 * batch * h * (D + C)  # the seed's 2*B*H*(D + C)
    assert sum(counts["Global"].values()) == matmuls


# --- real training -----------------------------------------------------------------------
def train_and_score(wl: MnistMLP, epochs: int, batch: int = 100) -> tuple[float, float]:
    """Plain fp32 SGD over shuffled mini-batches; (held-out accuracy, seconds training)."""
    train, held = wl.training_data()
    model = wl.build_model().train()
    opt = wl.optimizer(model)
    x, g = wl.prepare(train.x), torch.Generator().manual_seed(0)
    start = time.perf_counter()
    for _ in range(epochs):
        for idx in torch.randperm(len(x), generator=g).split(batch):
            loss = wl.loss(model, model(x[idx]), train.y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    elapsed = time.perf_counter() - start
    with torch.no_grad():
        accuracy = (model(wl.prepare(held.x)).argmax(1) == held.y).double().mean().item()
    print(
        f"hidden {wl.cfg.hidden} lr {wl.cfg.lr} {epochs} epochs: held-out accuracy "
        f"{accuracy:.4f}, {elapsed:.2f} s"
    )
    return accuracy, elapsed


def test_sgd_on_real_mnist_split_learns(mnist_dir):
    """fp32 SGD, hidden 128, batch 100, 3 epochs on the seeded 8,000-image t10k split.

    lr 0.5, not 0.1: with sigmoid units and mean cross-entropy, lr 0.1 reaches only ~0.77
    held-out accuracy in 3 epochs (240 steps); lr 0.5 reaches 0.89-0.91 over seeds 0-3.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small GEMMs: a second spinning thread only hurts on a busy host
    try:
        accuracy, _ = train_and_score(make(data_dir=str(mnist_dir), hidden=128, lr=0.5), 3)
    finally:
        torch.set_num_threads(threads)
    assert accuracy >= 0.85


@pytest.mark.slow
def test_seed_setting_reaches_90_percent(cli, mnist_dir, tmp_path):
    """The reference MNIST training command, through the CLI: hidden 512, lr 0.1, batch 100,
    20 epochs on the real MNIST images reaches >= 0.90 held-out accuracy.

    Measured 0.9095 (seed 0), 0.9030 (1), 0.9020 (2): a thin margin; lr 0.5 gives 0.9245.
    """
    code, out, err = cli(
        "run",
        "mlp",
        "--train",
        "--epochs",
        "20",
        "--batch",
        "100",
        "--lr",
        "0.1",
        "--hidden",
        "512",
        "--data-dir",
        mnist_dir,
        "--json",
        "--quiet",
        "--out",
        tmp_path / "runs.jsonl",
    )
    assert code == 0, err
    record = json.loads(out.strip().splitlines()[-1])
    assert len(record["accuracy"]) == 20 and record["accuracy"][-1] >= 0.90
