"""The layer-shape probe's disk cache: a hit gives the probe's shapes without running a layer,
and anything the shapes depend on (a module's attributes, its parameters' shapes, the item
shape) changes the key, so a changed model probes again instead of reading stale shapes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from scalelab.workloads import shape_cache
from scalelab.workloads.layers import describe, layer_shapes


class Stride(nn.Module):
    """Keeps every `step`-th feature: the output shape depends on a plain attribute only."""

    calls = 0

    def __init__(self, step: int) -> None:
        super().__init__()
        self.step = step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        Stride.calls += 1
        return x[:, :: self.step]


def layers(step: int, out_features: int = 6):
    with torch.device("meta"):
        lin = nn.Linear(12, out_features)
    return [describe("s", Stride(step), "s"), describe("fc", lin, "fc")]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SCALELAB_SHAPE_CACHE", str(tmp_path))
    return tmp_path


def test_a_hit_gives_the_probe_shapes_without_running_a_layer(cache):
    first = layer_shapes(layers(2), (24,))
    assert first == [((24,), (12,)), ((12,), (6,))]
    assert len(list(cache.glob("*.json"))) == 1
    before = Stride.calls
    assert layer_shapes(layers(2), (24,)) == first
    assert Stride.calls == before


@pytest.mark.parametrize(
    "changed, expect",
    [
        ((3, 6, (36,)), [((36,), (12,)), ((12,), (6,))]),  # an attribute
        ((2, 4, (24,)), [((24,), (12,)), ((12,), (4,))]),  # a parameter's shape
        ((2, 6, (24, 1)), None),  # the item shape: the probe's own error, not a stale hit
    ],
)
def test_what_the_shapes_depend_on_changes_the_key(cache, changed, expect):
    layer_shapes(layers(2), (24,))
    step, out, item = changed
    if expect is None:
        with pytest.raises(RuntimeError):
            layer_shapes(layers(step, out), item)
        return
    before = Stride.calls
    assert layer_shapes(layers(step, out), item) == expect
    assert Stride.calls == before + 1


def test_off_and_unkeyable_layers_probe_every_time(cache, monkeypatch):
    hooked = layers(2)
    hooked[0].module.register_forward_hook(lambda m, i, o: o)
    assert shape_cache.key(["s", "fc"], [x.module for x in hooked], (24,)) is None
    monkeypatch.setenv("SCALELAB_SHAPE_CACHE", "off")
    before = Stride.calls
    layer_shapes(layers(2), (24,))
    layer_shapes(layers(2), (24,))
    assert Stride.calls == before + 2
    assert not list(cache.glob("*.json"))
