"""--swap-relu-pool: max-pool before ReLU gives bit-identical outputs (they commute), keeps the
weights interchangeable, and the per-layer records show the ReLU's activations quartered."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from scalelab.analysis import memory
from scalelab.config import RunConfig
from scalelab.run.runner import execute
from scalelab.workloads import WORKLOADS

VGG_POOLS = [4, 9, 16, 23, 30]  # features.N of the pools in the normal order


def _pair(name: str, **kw):
    make = lambda swap: WORKLOADS.get(name)(RunConfig(workload=name, swap_relu_pool=swap, **kw))  # noqa: E731
    return make(False), make(True)


@pytest.mark.parametrize(
    "name, kw",
    [
        ("vgg16", {"image_size": 70, "num_classes": 10}),  # odd maps: floor-mode pools
        ("alexnet", {"image_size": 67, "num_classes": 10}),
        ("alexnet", {"image_size": 131, "num_classes": 10}),
    ],
)
def test_swapped_order_gives_identical_outputs(name, kw):
    normal, swapped = _pair(name, **kw)
    a, b = normal.build_model(), swapped.build_model()
    assert a.state_dict().keys() == b.state_dict().keys()
    b.load_state_dict(a.state_dict())  # weights interchangeable; the seed draws them equal too
    x = normal.prepare(normal.synthetic_inputs(3, seed=5).x)
    with torch.no_grad():
        out_a, out_b = a(x), b(x)
    assert torch.equal(out_a, out_b)  # max(relu(.)) == relu(max(.)) exactly, no rounding
    assert out_a.abs().max() > 0


def test_vgg16_swapped_feature_order():
    normal, swapped = _pair("vgg16", image_size=32)
    with torch.device("meta"):  # the layer order only
        f, g = swapped.build_model().features, normal.build_model().features
    for i in VGG_POOLS:
        assert isinstance(f[i - 1], nn.MaxPool2d) and isinstance(f[i], nn.ReLU)
        assert isinstance(g[i - 1], nn.ReLU) and isinstance(g[i], nn.MaxPool2d)


@pytest.mark.parametrize("name", ["vgg16", "alexnet"])
def test_cost_table_moves_the_relu_behind_the_pool(name):
    normal, swapped = _pair(name, image_size=99)
    rows_a, rows_b = normal.cost_table(), swapped.cost_table()
    assert sorted(r.name for r in rows_a) == sorted(r.name for r in rows_b)
    moved = [
        r for r in rows_b if r.kind == "relu" and r.out_shape != _row(rows_a, r.name).out_shape
    ]
    assert len(moved) == (5 if name == "vgg16" else 1)
    for relu in moved:
        before = rows_b[rows_b.index(relu) - 1]
        assert before.kind == "maxpool" and relu.out_shape == before.out_shape
    # Same FLOP-free pools, fewer ReLU elements: the swapped total is strictly smaller.
    assert sum(r.out_elems for r in rows_b) < sum(r.out_elems for r in rows_a)


def _row(rows, name):
    return next(r for r in rows if r.name == name)


def test_oracle_check_passes_with_the_swap():
    """The float64 oracle computes the paper's order; the swapped model meets it at 1e-12."""
    cfg = RunConfig(
        workload="alexnet", swap_relu_pool=True, dtype="fp64", batch=2, iters=1, warmup=0,
        check=True, quiet=True, num_classes=10, image_size=67,
    )  # fmt: skip
    assert execute(cfg, None).record["relerr"] < 1e-12


def test_per_layer_records_show_the_relu_activations_quartered():
    """Two --per-layer runs through the analysis: each block's last ReLU writes a quarter of
    what it did, the pools the same, so the ReLU total drops by 3/4 of those five maps."""
    recs = []
    for swap in (False, True):
        cfg = RunConfig(
            workload="vgg16", image_size=32, num_classes=10, batch=2, iters=1, warmup=0,
            per_layer=True, swap_relu_pool=swap, quiet=True,
        )  # fmt: skip
        recs.append(execute(cfg, None).record)
    summary = memory.swap_summary(recs).set_index("kind")
    normal, _ = _pair("vgg16", image_size=32, num_classes=10)
    last_relus = [r for r in normal.cost_table() if r.kind == "relu"]
    block_ends = [
        last_relus[i]
        for i in range(len(last_relus))
        if i + 1 == len(last_relus) or last_relus[i].out_shape != last_relus[i + 1].out_shape
    ][:5]
    saved = 0.75 * sum(r.out_elems for r in block_ends) * 4 * 2 / 1e6  # fp32, batch 2
    relu = summary.loc["relu"]
    assert relu["out_MB_normal"] - relu["out_MB_swapped"] == pytest.approx(saved)
    pool = summary.loc["maxpool2d"]
    assert pool["out_MB_normal"] == pool["out_MB_swapped"]
    assert summary.loc["total", "out_change_pct"] < 0
    layers = memory.swap_layers(recs)
    assert list(layers.loc[layers.position == 4, "kind_normal"]) == ["maxpool2d"]
    assert list(layers.loc[layers.position == 3, "kind_swapped"]) == ["maxpool2d"]


def test_layer_type_table_reads_layer_study_records(tmp_path):
    rec = {
        "schema": "scalelab.run/1",
        "kind": "layer_study",
        "label": "h200",
        "device": "cuda:0",
        "layers": [
            {"kind": "ReLU", "input_shape": [256, 3, 224, 224], "seconds": 0.001,
             "out_bytes": 154_140_672, "peak_mem_bytes": 308_281_344, "mean_power_w": 250.0,
             "energy_j": 0.25},
            {"kind": "Linear", "input_shape": [256, 25088], "seconds": 0.002},
        ],
    }  # fmt: skip
    table = memory.layer_type_table([rec, {"schema": "scalelab.run/1", "wall_s": 1.0}])
    assert list(table["kind"]) == ["ReLU", "Linear"]
    assert table.loc[0, "ms"] == pytest.approx(1.0) and table.loc[0, "power_W"] == 250.0
    assert table.loc[1, "power_W"] != table.loc[1, "power_W"]  # NaN: not measured
    from scalelab.analysis import memory_plots

    assert all(p.exists() for p in memory_plots.layer_types(table, tmp_path))
