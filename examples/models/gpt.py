"""A small GPT-style decoder, written as a user would: `scalelab run --model
examples/models/gpt.py:gpt --input-shape 16 --input-dtype int64 --vocab 64 --check`.

Token embedding plus a learned position table (a parameter of the model itself), a stack of
pre-norm blocks (causal self-attention with one fused qkv Linear, a GELU MLP, residual adds),
a final LayerNorm and an untied head. It returns the next-token logits of the last position,
(N, vocab): the (N, K) output scalelab reads. With `--model-arg lm=True` it returns every
position's logits, (N, T, vocab): a language model, trained on the next token of every position
(docs/LANGUAGE_MODELS.md).

Its forward is not a chain of its children (the position add, the residuals), so scalelab
sees it through its block stack `blocks.0..depth-1`: `pipeline --engine torch` cuts between
blocks, `tensor --engine torch` shards each block's attention by heads and its MLP.
"""

import torch
import torch.nn.functional as F
from torch import nn


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)  # q, k, v side by side: (N, T, 3C)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, _ = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)  # (N, T, C) each
        q, k, v = (z.view(n, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (N, H, T, C/H)
        return self.proj(y.transpose(1, 2).reshape(n, t, -1))


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(
        self, vocab: int, seq: int, width: int, heads: int, depth: int, lm: bool = False
    ) -> None:
        super().__init__()
        self.lm = lm
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.randn(1, seq, width) * 0.02)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos[:, : ids.shape[1]]  # (N, T, C)
        for block in self.blocks:
            x = block(x)
        if self.lm:
            return self.head(self.ln_f(x))  # every position's logits: (N, T, vocab)
        return self.head(self.ln_f(x)[:, -1])  # the last position's logits: (N, vocab)


def gpt(
    vocab: int = 64, seq: int = 16, width: int = 32, heads: int = 4, depth: int = 4,
    lm: bool = False,
) -> GPT:  # fmt: skip
    return GPT(vocab, seq, width, heads, depth, lm)


def tp_plan(model: GPT) -> dict:
    """Your own tensor-parallel plan (`--tp-plan examples/models/gpt.py:tp_plan`), the one
    scalelab derives: module-name patterns to torch's ParallelStyles."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "blocks.*.attn.qkv": ColwiseParallel(),  # by heads: q, k, v of each rank's heads
        "blocks.*.attn.proj": RowwiseParallel(),
        "blocks.*.mlp.0": ColwiseParallel(),
        "blocks.*.mlp.2": RowwiseParallel(),
    }
