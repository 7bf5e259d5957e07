"""The small transformer tests/test_fsdp.py trains under fsdp as a user's --model
(programs/fsdp_nets.py:tiny_transformer): two pre-norm blocks in a ModuleList, so fsdp shards
one unit per block."""

import torch
from torch import nn


class Block(nn.Module):
    """Pre-norm attention + MLP block, (N, L, D) -> (N, L, D)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, length, dim = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(n, length, 3, self.heads, -1).unbind(2)
        att = nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        )  # (N, H, L, D/H)
        x = x + self.proj(att.transpose(1, 2).reshape(n, length, dim))
        return x + self.mlp(self.ln2(x))


class TinyTransformer(nn.Module):
    """(N, L) int64 token ids -> (N, classes): embedding + positions, blocks, mean pool."""

    def __init__(self, vocab: int, length: int, dim: int, heads: int, depth: int, classes: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(0.02 * torch.randn(length, dim))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(depth))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids) + self.pos
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h).mean(dim=1))


def tiny_transformer(vocab: int = 50, length: int = 8, dim: int = 8, classes: int = 4):
    return TinyTransformer(vocab, length, dim, heads=2, depth=2, classes=classes)
