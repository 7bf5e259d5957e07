"""VGG-16 and the deep synthetic stack: shapes, parameter counts, FLOPs against
FlopCounterMode, and torch fp64 against the NumPy oracle."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from scalelab.config import RunConfig
from scalelab.errors import UsageError
from scalelab.oracle.check import relative_error
from scalelab.workloads import WORKLOADS
from scalelab.workloads.base import Workload, state_dict_float64
from scalelab.workloads.deepstack import DeepStackWorkload
from scalelab.workloads.vgg import VGG16

VGG16_PARAMS = 138_357_544  # torchvision.models.vgg16(), 1000 classes at 224
VGG_CONVS = [0, 2, 5, 7, 10, 12, 14, 17, 19, 21, 24, 26, 28]  # features.N of the 13 convs
SMALL_STACK = {"image_size": 8, "convs": 3, "fcs": 2, "num_classes": 10}


def make(name: str, **kw) -> Workload:
    return WORKLOADS.get(name)(RunConfig(workload=name, **kw))


def flop_counts(model: nn.Module, x: torch.Tensor) -> dict[str, int]:
    """FlopCounterMode totals per module key '<RootClass>.<dotted path>'."""
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(x)
    return {k: sum(v.values()) for k, v in counter.get_flop_counts().items()}


def check_flops(w: Workload, model: nn.Module, x: torch.Tensor) -> int:
    """Each conv/linear row within 1% of FlopCounterMode; every conv/linear module has a row.
    Returns the number of rows checked."""
    counts = flop_counts(model, x)
    prefix = type(model).__name__
    rows = [r for r in w.cost_table() if r.kind in ("conv", "linear")]
    for row in rows:
        assert counts[f"{prefix}.{row.module}"] == pytest.approx(row.flops, rel=0.01), row.name
    layers = {p for p, m in model.named_modules() if isinstance(m, (nn.Conv2d, nn.Linear))}
    assert {r.module for r in rows} == layers
    assert counts["Global"] == pytest.approx(sum(r.flops for r in rows), rel=0.01)
    return len(rows)


def on_meta(w: Workload) -> nn.Module:
    """The model with shapes only: FLOP counting at native sizes without the arithmetic."""
    with torch.device("meta"):
        return w._build()


def fp64_relerr(w: Workload, n: int) -> float:
    model = w.build_model()
    x = w.synthetic_inputs(n, seed=3).x
    ref = w.reference_forward(state_dict_float64(model), x.numpy())
    with torch.no_grad():
        out = model.double()(w.prepare(x)).numpy()
    assert out.shape == ref.shape == (n, w.num_classes)
    return relative_error(out, ref)


# --- VGG-16 --------------------------------------------------------------------------------


def test_vgg16_native_parameters_and_names():
    w = make("vgg16")
    assert isinstance(w, VGG16)
    model = on_meta(w)
    assert sum(p.numel() for p in model.parameters()) == VGG16_PARAMS
    assert sum(r.params for r in w.cost_table()) == VGG16_PARAMS
    # torchvision's state_dict keys exactly (its avgpool and dropouts hold no tensors).
    want = {f"features.{i}.{p}" for i in VGG_CONVS for p in ("weight", "bias")}
    want |= {f"classifier.{i}.{p}" for i in (0, 3, 6) for p in ("weight", "bias")}
    assert set(model.state_dict()) == want
    assert model.classifier[0].in_features == 512 * 7 * 7
    assert all(isinstance(model.features[i], nn.MaxPool2d) for i in (4, 9, 16, 23, 30))


def test_vgg16_cost_table_at_224():
    rows = make("vgg16").cost_table()
    table = {r.name: r for r in rows}
    assert [r.module for r in rows if r.kind == "conv"] == [f"features.{i}" for i in VGG_CONVS]
    assert table["conv1_1"].out_shape == (64, 224, 224)
    assert table["conv5_3"].out_shape == (512, 14, 14)
    assert table["pool5"].out_shape == (512, 7, 7)
    assert [r.name for r in rows[-5:]] == ["fc6", "relu6", "fc7", "relu7", "fc8"]
    assert [r.kind for r in rows].count("maxpool") == 5
    assert [r.kind for r in rows].count("relu") == 15


def test_vgg16_flops_at_224_match_torchvision_docs():
    """torchvision documents vgg16 as 15.47 GFLOPS (multiply-adds) at 224."""
    w = make("vgg16")
    assert check_flops(w, on_meta(w), torch.empty(1, 3, 224, 224, device="meta")) == 16
    mm = sum(r.flops for r in w.cost_table() if r.kind in ("conv", "linear"))
    assert mm / 2 == pytest.approx(15.47e9, rel=0.005)


def test_vgg16_small_image_shapes_and_flops():
    w = make("vgg16", image_size=32, num_classes=10)
    model = w.build_model()
    assert model.classifier[0].in_features == 512  # 512 * 1 * 1
    seen = {}
    for i in VGG_CONVS + [4, 9, 16, 23, 30]:
        model.features[i].register_forward_hook(
            lambda mod, inp, out, i=i: seen.__setitem__(f"features.{i}", tuple(out.shape[1:]))
        )
    x = w.prepare(w.synthetic_inputs(2, seed=0).x)
    with torch.no_grad():
        assert model(x).shape == (2, 10)
    rows = w.cost_table()
    convs = {r.module: r.out_shape for r in rows if r.kind == "conv"}
    pools = [r.out_shape for r in rows if r.kind == "maxpool"]
    assert seen == {**convs, **{f"features.{i}": s for i, s in zip([4, 9, 16, 23, 30], pools)}}
    assert check_flops(w, model, x[:1]) == 16


def test_vgg16_numpy_oracle():
    assert fp64_relerr(make("vgg16", image_size=32, num_classes=10), n=2) < 1e-10


def test_vgg16_numpy_oracle_flattens_channel_major():
    """At 64x64 pool5 is 2x2, so fc6 sees 2048 values whose order matters."""
    assert fp64_relerr(make("vgg16", image_size=64, num_classes=5), n=1) < 1e-10


def test_vgg16_refuses_small_images():
    for size in (31, 16):
        with pytest.raises(UsageError, match="image-size >= 32"):
            make("vgg16", image_size=size)
    with pytest.raises(UsageError, match="--image-size must be >= 1"):  # the config's range
        make("vgg16", image_size=0)
    with pytest.raises(UsageError, match="num-classes"):
        make("vgg16", num_classes=0)
    assert make("vgg16", image_size=63).fc6_in() == 512  # floor-mode pools


def test_vgg16_prepare_uses_imagenet_statistics():
    w = make("vgg16", image_size=32)
    x = torch.full((1, 3, 1, 1), 255, dtype=torch.uint8)
    got = w.prepare(x)[0, :, 0, 0].tolist()
    assert got == pytest.approx([(1 - 0.485) / 0.229, (1 - 0.456) / 0.224, (1 - 0.406) / 0.225])


# --- deepstack -----------------------------------------------------------------------------


def test_deepstack_seed_shapes_and_per_layer_params():
    """Defaults from the seed: 64 channels at 112x112, linear width 4096."""
    w = make("deepstack")
    assert isinstance(w, DeepStackWorkload)
    rows = {r.name: r for r in w.cost_table()}
    assert w.synthetic_inputs(1, seed=0).x.shape == (1, 64, 112, 112)
    assert rows["conv1"].out_shape == (64, 112, 112)
    assert rows["conv1"].params == 64 * 64 * 9 + 64 == 36_928
    assert rows["conv1"].flops == 2 * 64 * 64 * 9 * 112 * 112
    assert rows["fc1"].params == 4096 * 4096 + 4096 == 16_781_312
    assert rows["classifier"].out_shape == (1000,)
    names = [r.name for r in w.cost_table() if r.kind in ("conv", "linear")]
    assert names == [f"conv{i}" for i in range(1, 9)] + ["proj", "fc1", "fc2", "classifier"]


def test_deepstack_cost_rows_are_the_modules_params():
    """Every row's params equal its module's, so a fit estimate can sum them per layer."""
    w = make("deepstack", **SMALL_STACK)
    model = on_meta(w)
    modules = dict(model.named_modules())
    for row in w.cost_table():
        want = sum(p.numel() for p in modules[row.name].parameters())
        assert row.params == want, row.name
    assert sum(r.params for r in w.cost_table()) == sum(p.numel() for p in model.parameters())


def test_deepstack_depth_and_size_follow_the_config():
    w = make("deepstack", image_size=5, convs=4, fcs=3, num_classes=7)
    model = w.build_model()
    assert sum(isinstance(m, nn.Conv2d) for m in model) == 4
    assert sum(isinstance(m, nn.Linear) for m in model) == 3 + 2  # fcs + proj + classifier
    x = w.prepare(w.synthetic_inputs(3, seed=0).x)
    with torch.no_grad():
        out = model(x)
        assert out.shape == (3, 7)
        # The flat Sequential splits anywhere: two halves compose to the whole.
        cut = len(model) // 2
        assert torch.equal(model[cut:](model[:cut](x)), out)
        # The leading cast follows the model's dtype, so an fp64 stack takes float32 input.
        assert model.double()[:cut](x).dtype == torch.float64


def test_deepstack_flops_match_flop_counter():
    w = make("deepstack", **SMALL_STACK)
    model = w.build_model()
    assert check_flops(w, model, w.prepare(w.synthetic_inputs(1, seed=0).x)) == 3 + 2 + 2
    native = make("deepstack")  # 8 convs at 112x112 on the meta device
    assert check_flops(native, on_meta(native), torch.empty(1, 64, 112, 112, device="meta")) == 12


def test_deepstack_numpy_oracle():
    assert fp64_relerr(make("deepstack", **SMALL_STACK), n=2) < 1e-10


def test_deepstack_synthetic_inputs_are_deterministic():
    w = make("deepstack", **SMALL_STACK)
    a, b, c = (w.synthetic_inputs(4, seed=s) for s in (1, 1, 2))
    assert a.x.dtype == torch.uint8 and torch.equal(a.x, b.x) and not torch.equal(a.x, c.x)
    assert int(a.y.max()) < 10
    assert w.prepare(a.x).dtype == torch.float32 and float(w.prepare(a.x).max()) <= 1.0


def test_deepstack_default_training_data_is_quick_and_seeded():
    """The default split (native 112 x 112, 256 + 64 items) is made in seconds, not the
    minutes 8000 + 2000 noise images took; the same seed gives the same bits, the bytes are
    uniform, and --train-size/--heldout-size still override the default."""
    import time

    w = make("deepstack", train=True)
    start = time.perf_counter()
    train, held = w.training_data()
    took = time.perf_counter() - start
    assert took < 10.0, f"{took:.1f} s"  # 0.9 s on a loaded 2-core box
    assert tuple(train.x.shape) == (256, 64, 112, 112) and len(held) == len(held.y) == 64
    again, _ = make("deepstack", train=True).training_data()
    assert torch.equal(train.x, again.x) and torch.equal(train.y, again.y)
    other, _ = make("deepstack", train=True, seed=1).training_data()
    assert not torch.equal(train.x[:1], other.x[:1])
    counts = torch.bincount(train.x.flatten().long(), minlength=256).double()
    assert 0.99 < float(counts.min() / counts.mean()) <= float(counts.max() / counts.mean()) < 1.01
    sized = make("deepstack", train=True, image_size=8, train_size=5, heldout_size=3)
    assert [len(part) for part in sized.training_data()] == [5, 3]


def test_deepstack_refuses_bad_options():
    for kw in ({"image_size": 0}, {"num_classes": 0}, {"convs": 0}, {"fcs": 0}):
        with pytest.raises(UsageError):
            make("deepstack", **kw)
    with pytest.raises(UsageError, match="reads no data set"):
        make("deepstack", data_dir=".").inputs(1)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["vgg16", "deepstack"])
def test_prepare_gives_the_same_bits_on_cuda(name):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    w = make(name, image_size=32)
    x = w.synthetic_inputs(2, seed=0).x
    assert torch.equal(w.prepare(x.cuda()).cpu(), w.prepare(x))
