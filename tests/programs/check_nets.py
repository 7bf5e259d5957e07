"""Models whose check must fail, and where (tests/test_check_explain.py).

imprecise: an fp32 MLP whose middle Linear rounds its input and weights to bf16 (bad=0: a
plain Linear). rank_imprecise: that Linear rounds only on ranks other than 0, so a split run
is worse than one process in the same dtype (good=1: never rounds). transformer: two
TransformerEncoderLayers; low_attn=1 runs the second layer's attention under bf16 autocast (a
reduced-precision kernel path forced on the CPU).
"""

import os

import torch
from torch import nn

RANK_VARS = ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK")


class Bf16Linear(nn.Linear):
    """A Linear computed in bf16 inside an fp32 model (exact in fp64 runs)."""

    def __init__(self, *args, only_off_root: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.only_off_root = only_off_root

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rank = next((os.environ[v] for v in RANK_VARS if v in os.environ), "0")
        if x.dtype != torch.float32 or (self.only_off_root and rank == "0"):
            return super().forward(x)
        low = nn.functional.linear(x.bfloat16(), self.weight.bfloat16(), self.bias.bfloat16())
        return low.float()


def _mlp(mid: nn.Module) -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), mid, nn.ReLU(), nn.Linear(32, 4))


def imprecise(bad: int = 1) -> nn.Module:
    """(N, 16) -> (N, 4)."""
    return _mlp(Bf16Linear(32, 32) if bad else nn.Linear(32, 32))


def rank_imprecise(good: int = 0) -> nn.Module:
    """(N, 16) -> (N, 4); off rank 0 the middle Linear rounds to bf16 unless good."""
    return _mlp(nn.Linear(32, 32) if good else Bf16Linear(32, 32, only_off_root=True))


class LowAttention(nn.MultiheadAttention):
    """Multi-head attention computed under bf16 autocast (a kernel choice)."""

    def forward(self, *args, **kwargs):
        with torch.autocast(args[0].device.type, dtype=torch.bfloat16):
            return super().forward(*args, **kwargs)


def transformer(low_attn: int = 0) -> nn.Module:
    """(N, 6, 16) -> (N, 3): two post-norm encoder layers, flatten, a Linear."""
    # A callable activation keeps eval mode off torch's fused encoder fast path (which would
    # never call self_attn's forward), so the attention module is what runs.
    layers = [nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, activation=torch.tanh,
                                         batch_first=True) for _ in range(2)]  # fmt: skip
    if low_attn:
        low = LowAttention(16, 2, dropout=0.0, batch_first=True)
        low.load_state_dict(layers[1].self_attn.state_dict())
        layers[1].self_attn = low
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(16 * 6, 3))
