"""Transformers written as a user would (tests/test_transformers.py runs them with --model
tests/programs/transformer_nets.py:FACTORY), beside examples/models/gpt.py, and two the
strategies must refuse to split."""

import torch
import torch.nn.functional as F
from torch import nn


class Encoder(nn.Module):
    """torch's own nn.TransformerEncoder: (N, T, F) features -> (N, K) by mean pooling, a
    learned position table on the root module."""

    def __init__(self, feats: int = 6, seq: int = 5, width: int = 16, heads: int = 4,
                 depth: int = 3, classes: int = 5) -> None:  # fmt: skip
        super().__init__()
        self.embed = nn.Linear(feats, width)
        self.pos = nn.Parameter(torch.randn(1, seq, width) * 0.1)
        layer = nn.TransformerEncoderLayer(width, heads, 2 * width, dropout=0.0, batch_first=True)
        self.body = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(self.embed(x) + self.pos)
        return self.head(self.norm(h).mean(dim=1))


class Attention(nn.Module):
    """Separate q, k, v projections, no bias (a llama-style block)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.n_heads = heads
        self.wq = nn.Linear(width, width, bias=False)
        self.wk = nn.Linear(width, width, bias=False)
        self.wv = nn.Linear(width, width, bias=False)
        self.wo = nn.Linear(width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, _ = x.shape
        q, k, v = (w(x).view(n, t, self.n_heads, -1).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))  # fmt: skip
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(n, t, -1))


class SwiGLU(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(width, hidden, bias=False)  # gate
        self.w3 = nn.Linear(width, hidden, bias=False)  # up
        self.w2 = nn.Linear(hidden, width, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(width)
        self.attention = Attention(width, heads)
        self.ffn_norm = nn.LayerNorm(width)
        self.feed_forward = SwiGLU(width, 3 * width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self, vocab: int = 40, width: int = 16, heads: int = 4, depth: int = 3) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(LlamaBlock(width, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.output = nn.Linear(width, vocab, bias=False)
        self.tied = False

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(ids)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h)[:, -1])


def encoder(**kw) -> nn.Module:
    return Encoder(**kw)


def llama(**kw) -> nn.Module:
    return Llama(**kw)


def tied_llama(**kw) -> nn.Module:
    """The head shares the embedding's weight: no pipeline cut can keep them together."""
    net = Llama(**kw)
    net.output.weight = net.tok_embeddings.weight
    return net
