"""FLOP counting never stops a run (workloads/flops.py): grouped-query attention counted as the
same attention over full heads (torch's own count, k/v repeated), also when torch's formula
asserts as torch 2.11's does; any other failing formula leaves its op uncounted with one
warning, and the model's layers and costs still come out."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils import flop_counter

from scalelab.workloads import module_layers as ml
from scalelab.workloads.flops import GuardedCounter, sdpa_forward_flops

B, HQ, HKV, T, D = 2, 4, 2, 6, 8


class Attention(nn.Module):
    """(N, T, HQ * D) -> the same: GQA attention of its input's own heads (no projections, so
    the count is attention's alone). repeat=True gives k/v every query head."""

    def __init__(self, repeat: bool) -> None:
        super().__init__()
        self.repeat = repeat

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, _ = x.shape
        q = x.view(n, t, HQ, D).transpose(1, 2)  # (N, HQ, T, D)
        kv = x[..., : HKV * D].reshape(n, t, HKV, D).transpose(1, 2)  # (N, HKV, T, D)
        if self.repeat:
            kv = kv.repeat_interleave(HQ // HKV, dim=1)
            y = F.scaled_dot_product_attention(q, kv, kv, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)
        return y.transpose(1, 2).reshape(n, t, HQ * D)


def _raise(*args, **kwargs):
    raise AssertionError("sdpa_flop_count: query/key/value shapes are incompatible")


def _forward_flops(repeat: bool) -> int:
    return ml.trace(Attention(repeat), torch.randn(B, T, HQ * D)).flops


def _training_flops(repeat: bool) -> int:
    counter = GuardedCounter()
    x = torch.randn(B, T, HQ * D, requires_grad=True)
    with counter.mode:
        Attention(repeat)(x).sum().backward()
    assert not counter.unknown
    return counter.mode.get_total_flops()


def test_grouped_query_attention_counts_as_the_same_attention_over_full_heads():
    full = _forward_flops(repeat=True)  # torch's own formula, k/v at HQ heads
    assert full == 4 * B * HQ * T * T * D == sdpa_forward_flops((B, HQ, T, D), (B, HKV, T, D),
                                                                (B, HKV, T, D))  # fmt: skip
    assert _forward_flops(repeat=False) == full
    assert _training_flops(repeat=False) == _training_flops(repeat=True) == 3.5 * full


@pytest.mark.parametrize("formula", ["sdpa_flop_count", "sdpa_backward_flop_count"])
def test_torchs_asserting_attention_formula_is_replaced_by_the_closed_form(monkeypatch, formula):
    """torch 2.11's sdpa_flop_count asserts on grouped-query shapes (an HF Llama's probe
    exited 2 there): with torch's formula raising, the count is the closed form."""
    full, trained = _forward_flops(repeat=True), _training_flops(repeat=True)
    monkeypatch.setattr(flop_counter, formula, _raise)
    assert _forward_flops(repeat=False) == full
    assert _training_flops(repeat=False) == trained


def test_a_failing_formula_leaves_its_op_uncounted_with_one_warning(monkeypatch, caplog):
    monkeypatch.setitem(flop_counter.flop_registry, torch.ops.aten.mm, _raise)
    monkeypatch.setitem(flop_counter.flop_registry, torch.ops.aten.addmm, _raise)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    with caplog.at_level(logging.WARNING, logger="scalelab.workloads.flops"):
        call = ml.trace(model, torch.randn(1, 8))
    assert call.flops == 0 and tuple(call.output.shape) == (1, 4)  # the forward ran
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "aten.addmm" in warned[0] and "counted as 0" in warned[0]


def test_a_gqa_model_gets_its_layers_and_costs_when_torch_asserts(monkeypatch):
    """The whole shape probe and cost table of a user model with grouped-query attention,
    with torch's attention formulas raising as on torch 2.11."""
    from scalelab.config import RunConfig
    from scalelab.workloads import WORKLOADS

    monkeypatch.setattr(flop_counter, "sdpa_flop_count", _raise)
    spec = f"{__file__}:gqa_model"
    cfg = RunConfig(workload="model", model=spec, input_shape=f"{T},{HQ * D}", batch=2)
    rows = WORKLOADS.get("model")(cfg).cost_table()
    assert sum(r.flops for r in rows) >= 4 * HQ * T * T * D  # attention counted per item


def gqa_model() -> nn.Module:
    return nn.Sequential(nn.Linear(HQ * D, HQ * D), Attention(repeat=False), nn.Flatten(),
                         nn.Linear(T * HQ * D, 3))  # fmt: skip
