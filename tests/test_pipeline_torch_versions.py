"""What the torch engine does about the pipelining runtime's version differences (checked on
CPU ranks with torch 2.11, the GPU image's, beside this machine's 2.13): a stage's output is
handed on contiguous (2.11's stage compares its output's strides with the traced ones), and a
model the tracer cannot split is one line naming torch's version."""

import re

import pytest
import torch
from torch import nn

from scalelab.errors import UsageError
from scalelab.strategies.pipeline import torch_trace
from scalelab.strategies.pipeline.torch_stages import OwnedOutput


class LastPosition(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, T, V) -> (N, V), a strided view
        return x[:, -1]


def test_a_strided_stage_output_is_handed_on_contiguous_with_its_values():
    x = torch.randn(4, 8, 5)
    out = OwnedOutput(LastPosition(), own=False)(x)
    assert out.is_contiguous() and out.stride() == (5, 1)
    assert torch.equal(out, x[:, -1])
    same = torch.randn(3, 2)
    assert OwnedOutput(nn.Identity(), own=False)(same) is same  # no copy where none is needed
    view = OwnedOutput(nn.Flatten(), own=True)(torch.randn(2, 3, 1, 1))
    assert not view._is_view()  # the split backward's own output


def test_a_model_the_tracer_cannot_split_is_one_line_naming_torch(monkeypatch):
    def asserting(*a, **k):
        raise AssertionError("unexpected placeholder node at index 3")

    monkeypatch.setattr(torch_trace, "pipeline", asserting)
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(
        UsageError, match=re.escape(f"torch {torch.__version__}'s tracer cannot split")
    ):
        torch_trace.trace_pieces(model, torch.randn(2, 2), ["1"], [0], torch.device("cpu"))


def test_a_stage_receiving_a_non_floating_tensor_is_refused_on_torch_before_2_13(monkeypatch):
    """Torch 2.11's stages ask what they receive to require grad: GPT-2's bool causal mask
    crossing the cut is refused before any rank runs; torch 2.13 takes it."""
    graph = torch.fx.Graph()
    mask = graph.placeholder("expand_1")
    mask.meta["val"] = torch.zeros(2, 1, 8, 8, dtype=torch.bool)
    graph.output(mask)
    stage = torch.fx.GraphModule(nn.Module(), graph)

    class Pipe:
        num_stages = 2

        def get_stage_module(self, i: int) -> torch.fx.GraphModule:
            return stage

    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    with pytest.raises(UsageError, match="stage 1 receives expand_1, a bool"):
        torch_trace._received_are_floating(Pipe())
    monkeypatch.setattr(torch, "__version__", "2.13.0")
    torch_trace._received_are_floating(Pipe())  # nothing refused
