"""AlexNet: shapes from the seed table, torch vs the float64 NumPy oracle, FLOPs vs FlopCounter."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from scalelab.config import RunConfig
from scalelab.errors import UsageError
from scalelab.oracle import ops
from scalelab.oracle.check import relative_error
from scalelab.workloads import WORKLOADS
from scalelab.workloads.alexnet import AlexNet, TrunkLayer
from scalelab.workloads.base import state_dict_float64

# Size 99 is the smallest whose trunk ends in a 2x2 map (not 1x1), so the flatten order
# before fc6 is exercised; 67 is the smallest that leaves any map at all.
SMALL = 99


def make(**kw) -> AlexNet:
    return AlexNet(RunConfig(workload="alexnet", **kw))


@pytest.fixture(scope="module")
def native():
    """The 227x227 network with 1000 classes, built once (about a second)."""
    w = make()
    return w, w.build_model()


@pytest.fixture(scope="module")
def small():
    w = make(image_size=SMALL, num_classes=10)
    model = w.build_model()
    x = w.synthetic_inputs(2, seed=3).x
    ref = w.reference_forward(state_dict_float64(model), x.numpy())
    return w, model, x, ref


def test_registered():
    assert WORKLOADS.get("alexnet") is AlexNet


def test_seed_table_shapes_match_the_real_forward(native):
    """Every trunk row's out_shape in the cost table equals what torch actually produces."""
    w, model = native
    seen = {}
    hooks = [
        getattr(model, name).register_forward_hook(
            lambda mod, inp, out, name=name: seen.__setitem__(name, tuple(out.shape[1:]))
        )
        for name in ("c1", "lrn1", "c2", "lrn2", "c3", "c4", "c5", "fc6", "fc7", "fc8")
    ]
    with torch.no_grad():
        logits = model(w.prepare(w.synthetic_inputs(1, seed=0).x))
    for h in hooks:
        h.remove()
    assert logits.shape == (1, 1000)
    table = {row.name: row.out_shape for row in w.cost_table()}
    assert seen == {name: table[name] for name in seen}
    # The seed table: C1 -> 96x55x55, pools 27 and 13, pool5 -> 256x6x6 = 9216 into FC6.
    assert table["c1"] == (96, 55, 55)
    assert table["pool1"] == (96, 27, 27)
    assert table["pool2"] == (256, 13, 13)
    assert table["pool5"] == (256, 6, 6)
    assert model.fc6.in_features == 9216 == w.fc6_in()


def test_flops_match_flop_counter(native):
    """Each conv/linear row within 1% of torch's FlopCounterMode, keyed '<Class>.<module>'."""
    w, model = native
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(w.prepare(w.synthetic_inputs(1, seed=0).x))
    counts = counter.get_flop_counts()
    prefix = type(model).__name__
    checked = 0
    for row in w.cost_table():
        if row.kind in ("conv", "linear"):
            measured = sum(counts[f"{prefix}.{row.module}"].values())
            assert measured == pytest.approx(row.flops, rel=0.01), row.name
            checked += 1
    assert checked == 8
    mm_flops = sum(r.flops for r in w.cost_table() if r.kind in ("conv", "linear"))
    assert sum(counts["Global"].values()) == pytest.approx(mm_flops, rel=0.01)


def test_total_flops_at_227(native):
    w, _ = native
    rows = w.cost_table()
    total = w.flops_per_item()
    assert total == sum(r.flops for r in rows)
    # Independent of the table: 2 * MACs of the five convs and three FCs, written out.
    macs = (
        96 * 3 * 11 * 11 * 55 * 55
        + 256 * 96 * 5 * 5 * 27 * 27
        + 384 * 256 * 9 * 13 * 13
        + 384 * 384 * 9 * 13 * 13
        + 256 * 384 * 9 * 13 * 13
        + 9216 * 4096
        + 4096 * 4096
        + 4096 * 1000
    )
    assert sum(r.flops for r in rows if r.kind in ("conv", "linear")) == 2 * macs
    assert total == pytest.approx(2.3e9, rel=0.03)
    assert [r.name for r in rows][-7:] == [
        "pool5",
        "fc6",
        "relu6",
        "fc7",
        "relu7",
        "fc8",
        "softmax",
    ]


def test_parameter_count_matches_model(native):
    w, model = native
    assert sum(r.params for r in w.cost_table()) == sum(p.numel() for p in model.parameters())


def test_fp64_torch_matches_numpy_oracle(small):
    w, model, x, ref = small
    with torch.no_grad():
        out = model.double()(w.prepare(x)).numpy()
    model.float()
    assert out.shape == ref.shape == (2, 10)
    assert relative_error(out, ref) < 1e-10


def test_fp32_torch_matches_numpy_oracle(small):
    w, model, x, ref = small
    with torch.no_grad():
        out = model.float()(w.prepare(x))
    assert out.dtype == torch.float32
    assert relative_error(out.numpy(), ref) < 1e-5


def test_bf16_autocast_runs_close(small):
    w, model, x, ref = small
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = model.float()(w.prepare(x))
    assert relative_error(out.float().numpy(), ref) < 5e-2


def test_smallest_image_works_and_one_less_is_refused():
    w = make(image_size=67, num_classes=7)
    model = w.build_model()
    assert model.fc6.in_features == 256  # 1x1 final map
    with torch.no_grad():
        assert model(w.prepare(w.synthetic_inputs(2, seed=0).x)).shape == (2, 7)
    for too_small in (66, 10):
        with pytest.raises(UsageError, match="image-size >= 67"):
            make(image_size=too_small)
    with pytest.raises(UsageError, match="--image-size must be >= 1"):  # the config's range
        make(image_size=0)


def test_num_classes_must_be_positive():
    with pytest.raises(UsageError, match="num-classes"):
        make(num_classes=0)


def test_lrn_oracle_matches_torch():
    """ops.lrn against torch.nn.LocalResponseNorm, at AlexNet's constants and at alpha=1
    (where the channel window dominates the denominator, so a misplaced window shows)."""
    rng = np.random.default_rng(0)
    x = rng.normal(scale=20.0, size=(2, 11, 4, 5))
    for size, alpha, beta, k in [(5, 1e-4, 0.75, 2.0), (5, 1.0, 0.75, 2.0), (4, 0.5, 0.5, 1.0)]:
        want = torch.nn.LocalResponseNorm(size, alpha, beta, k)(torch.from_numpy(x)).numpy()
        got = ops.lrn(x, size, alpha, beta, k)
        assert relative_error(got, want) < 1e-13
        assert relative_error(got, x) > 1e-3  # the normalisation really acts


def test_trunk_layers_describe_the_model(native):
    w, model = native
    layers = w.trunk_layers()
    assert all(isinstance(layer, TrunkLayer) for layer in layers)
    assert [layer.name for layer in layers if layer.kind == "conv"] == [
        "c1",
        "c2",
        "c3",
        "c4",
        "c5",
    ]
    assert [layer.kind for layer in layers].count("maxpool") == 3
    for layer in layers:
        if layer.kind == "conv":
            conv = getattr(model, layer.name)
            assert conv.kernel_size == (layer.kernel, layer.kernel)
            assert conv.stride == (layer.stride, layer.stride)
            assert conv.padding == (layer.pad, layer.pad)
            assert conv.out_channels == layer.out_channels
    assert (layers[0].kernel, layers[0].stride, layers[0].pad) == (11, 4, 0)
    assert layers[0].out_size(227) == 55


def test_synthetic_inputs_and_prepare():
    w = make(image_size=SMALL)
    a, b = w.synthetic_inputs(3, seed=5), w.synthetic_inputs(3, seed=5)
    assert a.x.dtype == torch.uint8 and a.x.shape == (3, 3, SMALL, SMALL) and a.y is None
    assert torch.equal(a.x, b.x)
    assert not torch.equal(a.x, w.synthetic_inputs(3, seed=6).x)
    p = w.prepare(a.x)
    assert p.dtype == torch.float32 and p.device == a.x.device
    assert torch.equal(p, a.x.float() * (1 / 255)) and float(p.max()) <= 1.0
    assert float(p.max()) <= 1.0 and float(p.min()) >= 0.0


def test_no_real_data_set():
    with pytest.raises(UsageError):
        make(image_size=SMALL).real_inputs(1)
