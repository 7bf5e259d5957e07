"""The one layer description per workload (workloads/layers.py) and what derives from it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from scalelab.config import RunConfig
from scalelab.workloads.base import WORKLOADS, Inputs, Workload
from scalelab.workloads.layers import Layer, describe, run_layers

CASES = [
    ("alexnet", {"image_size": 67, "num_classes": 10}),
    ("alexnet", {"image_size": 67, "num_classes": 10, "swap_relu_pool": True}),
    ("charcnn", {}),
    ("mlp", {"hidden": 16}),
    ("resnet18", {"num_classes": 10}),
    ("resnet18-cifar", {"image_size": 8, "num_classes": 10}),
    ("vgg16", {"image_size": 32, "num_classes": 5, "swap_relu_pool": True}),
    ("deepstack", {"image_size": 8, "convs": 2, "fcs": 1, "num_classes": 10}),
]


def _workload(name: str, **kw) -> Workload:
    return WORKLOADS.get(name)(RunConfig(workload=name, **kw))


@pytest.mark.parametrize("name, kw", CASES)
def test_layers_compose_to_the_models_forward_in_fp64(name, kw):
    w = _workload(name, **kw)
    model = w.build_model().double()
    layers = w.layers(model)
    x = w.prepare(w.synthetic_inputs(2, seed=1).x).double()
    with torch.no_grad():
        want = model(x)
        got = run_layers(
            [Layer(**{**vars(lay), "module": lay.module.double()}) for lay in layers], x
        )
    assert torch.equal(got, want)
    params = {id(p) for layer in layers for p in layer.module.parameters()}
    assert params == {id(p) for p in model.parameters()}  # the model's own weights
    for layer in layers:  # a path names the model's own module
        if layer.path is not None:
            assert model.get_submodule(layer.path) is layer.module
    names = [layer.name for layer in layers]
    assert len(set(names)) == len(names)


@pytest.mark.parametrize("name, kw", CASES)
def test_cost_rows_are_named_for_their_layer(name, kw):
    """Every cost row a layer computes carries the layer's name (or, for a block, its name
    as a prefix): predict pairs rows with the pipeline's layers by these names."""
    w = _workload(name, **kw)
    for layer, row in w.layer_costs():
        assert row.name == layer.name or row.name.startswith(layer.name + ".")


def test_alexnet_swap_is_in_the_layer_order():
    plain = _workload("alexnet").layers(_workload("alexnet").meta_model())
    w = _workload("alexnet", swap_relu_pool=True)
    swapped = w.layers(w.meta_model())
    names = [x.name for x in swapped]
    assert names[names.index("c5") :][:3] == ["c5", "pool5", "relu5"]
    assert sorted(names) == sorted(x.name for x in plain)


def test_describe_reads_geometry_off_the_module():
    conv = describe("c", nn.Conv2d(3, 8, 5, stride=2, padding=1))
    assert (conv.kind, conv.reach, conv.kernel, conv.stride, conv.pad) == (
        "conv",
        "window",
        5,
        2,
        1,
    )
    pool = describe("p", nn.MaxPool1d(3))
    assert (pool.kind, pool.reach, pool.kernel, pool.stride, pool.pad) == (
        "maxpool",
        "window",
        3,
        3,
        0,
    )
    assert describe("ln", nn.LayerNorm(4)).reach == "norm"
    assert describe("r", nn.ReLU()).reach == "point"
    assert describe("f", nn.Linear(2, 3)).reach == "global"


# --- a toy workload, registered nowhere ----------------------------------------------------------
class ToyNet(nn.Module):
    """(N, 2, 12, 12) -> conv 3x3 -> ReLU -> pool 2 -> conv 3x3 pad 1 -> flatten -> fc (N, 3)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv_a = nn.Conv2d(2, 4, 3)  # (N, 4, 10, 10)
        self.conv_b = nn.Conv2d(4, 4, 3, padding=1)  # (N, 4, 5, 5)
        self.fc = nn.Linear(100, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.functional.max_pool2d(torch.relu(self.conv_a(x)), 2)
        return self.fc(torch.relu(self.conv_b(x)).flatten(1))


class Toy(Workload):
    name = "toy"
    native_size = 12
    native_classes = 3

    def _build(self) -> nn.Module:
        return ToyNet()

    def synthetic_inputs(self, n: int, seed: int) -> Inputs:
        g = torch.Generator().manual_seed(seed)
        return Inputs(torch.randint(0, 256, (n, 2, 12, 12), generator=g, dtype=torch.uint8))

    def prepare(self, x: torch.Tensor) -> torch.Tensor:
        return x.float() * (1 / 255)

    def layers(self, model: nn.Module) -> list[Layer]:
        return [
            describe("conv_a", model.conv_a, "conv_a"),
            describe("relu_a", nn.ReLU()),
            describe("pool", nn.MaxPool2d(2)),
            describe("conv_b", model.conv_b, "conv_b"),
            describe("relu_b", nn.ReLU()),
            describe("flatten", nn.Flatten()),
            describe("fc", model.fc, "fc"),
        ]


def test_toy_workload_gets_a_cost_table_from_its_layers():
    toy = Toy(RunConfig(workload="toy"))
    rows = {r.name: r for r in toy.cost_table()}
    assert list(rows) == ["conv_a", "relu_a", "pool", "conv_b", "relu_b", "fc"]
    assert rows["conv_a"].flops == 2 * 4 * 2 * 9 * 10 * 10 and rows["conv_a"].out_shape == (
        4,
        10,
        10,
    )
    assert rows["pool"].flops == 3 * 4 * 5 * 5  # 2x2 window: 3 comparisons per output
    assert rows["conv_b"].params == 4 * 4 * 9 + 4
    assert rows["fc"].flops == 2 * 100 * 3
    model = toy.build_model()
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        model(toy.prepare(toy.synthetic_inputs(1, 0).x))
    assert counter.get_total_flops() == sum(
        r.flops for r in rows.values() if r.kind in ("conv", "linear")
    )


def test_toy_workload_gets_a_pipeline_cut():
    """The pipeline's planning runs on the toy's layers: measured, cut in two, the stages
    compose to the forward."""
    from contextlib import nullcontext

    from scalelab.layout.partition import balance_auto, bounds, memory_model
    from scalelab.layout.profiling import profile_layers

    toy = Toy(RunConfig(workload="toy"))
    model = toy.build_model().double()
    layers = toy.layers(model)
    x = toy.prepare(toy.synthetic_inputs(3, 0).x).double()
    prof = profile_layers(layers, x, torch.device("cpu"), torch.float64, False, nullcontext, 1)
    counts = balance_auto(prof, 2, memory_model(None, 2, 1, False, "gpipe"))
    assert len(counts) == 2 and sum(counts) == len(layers) and min(counts) >= 1
    h = x
    with torch.no_grad():
        for a, b in bounds(counts):
            h = nn.Sequential(*[lay.module for lay in layers[a:b]])(h)
        assert torch.equal(h, model(x))


def test_toy_workload_gets_a_spatial_trunk():
    """trunk_for: conv_a, relu_a, pool, conv_b, relu_b on the rows, fc the dense head; the
    steps with full-height edge padding and the head reproduce the forward; two ranks plan."""
    from scalelab.layout.halo import plan_trunk
    from scalelab.layout.trunk import trunk_for
    from scalelab.strategies.halo import edge_pad

    toy = Toy(RunConfig(workload="toy"))
    model = toy.build_model().double()
    trunk = trunk_for(toy, model)
    assert [(s.name, s.kind) for s in trunk.steps] == [
        ("conv_a", "window"), ("relu_a", "point"), ("pool", "window"),
        ("conv_b", "window"), ("relu_b", "point"),
    ]  # fmt: skip
    assert (trunk.in_size, trunk.in_axis, trunk.in_trailing) == (12, 2, (12,))
    assert [g.out_size for g in trunk.geometries()] == [10, 10, 5, 5, 5]
    assert [(lin is model.fc, relu) for lin, relu in trunk.head] == [(True, False)]
    x = toy.prepare(toy.synthetic_inputs(2, 0).x).double()
    h = x
    with torch.no_grad():
        for s in trunk.steps:
            if s.kind == "window":
                h = edge_pad(h, 2, s.pad, s.pad, s.pad_value)
            h = s.apply(h)
        got = model.fc(h.flatten(1))
        assert torch.equal(got, model(x))
    plans = plan_trunk(trunk.geometries(), 2)
    assert [r.out for r in plans[0]] == [(0, 5), (5, 10)]


@pytest.mark.mpi
def test_a_non_dense_tail_runs_after_a_gather_under_mpiexec(tmp_path):
    """deepstack's trunk (conv, ReLU) ends in a global pool: the split gathers the final slabs
    on the root and runs pool, proj, fc there; the logits match the float64 oracle."""
    import subprocess
    import sys

    from scalelab.record import read_records

    out = tmp_path / "runs.jsonl"
    args = ["deepstack", "--batch", "3", "--image-size", "12", "--convs", "2", "--fcs", "1"]
    cmd = [sys.executable, "-m", "scalelab", "run", *args, "--check", "--strategy", "mpi"]
    cmd += [
        "--split",
        "spatial",
        "--ranks",
        "2",
        "--iters",
        "1",
        "--warmup",
        "0",
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (rec,) = read_records(out)
    assert rec["split"] == "spatial" and rec["check_passed"], rec
    assert [row["layer"] for row in rec["halo_plan"]] == ["conv1", "conv2"]
