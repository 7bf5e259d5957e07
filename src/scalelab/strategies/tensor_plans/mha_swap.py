"""nn.MultiheadAttention (packed `in_proj_weight`, as nn.TransformerEncoderLayer holds it) as
an equivalent module whose q, k, v projection is one Linear, so tensor parallelism can shard
it by heads like any fused qkv Linear (strategies/tensor_plan.py). The weights are carried
over: in_proj.weight is in_proj_weight, in_proj.bias in_proj_bias, out_proj the same Linear;
the parameters keep their order (the optimizer's indices stay those of the model)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# state_dict key suffixes: the swapped module's -> nn.MultiheadAttention's
RENAMES = {"in_proj.weight": "in_proj_weight", "in_proj.bias": "in_proj_bias"}


class HeadsAttention(nn.Module):
    """Self-attention as nn.MultiheadAttention computes it, over a packed (3C, C) in_proj
    Linear: (N, T, C) -> (N, T, C) with batch_first (T, N, C without)."""

    in_proj_bias = None  # torch's encoder checks it: None keeps its fused fast path off
    _qkv_same_embed_dim = True

    def __init__(self, mha: nn.MultiheadAttention) -> None:
        super().__init__()
        width = mha.embed_dim
        self.in_proj = nn.Linear(width, 3 * width, bias=mha.in_proj_bias is not None)
        self.in_proj.weight = mha.in_proj_weight
        if mha.in_proj_bias is not None:
            self.in_proj.bias = mha.in_proj_bias
        self.out_proj = mha.out_proj
        self.num_heads, self.batch_first, self.dropout = mha.num_heads, mha.batch_first, mha.dropout

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True,
                attn_mask=None, average_attn_weights=True, is_causal=False):  # fmt: skip
        if key_padding_mask is not None or not (query is key is value):
            raise ValueError("HeadsAttention computes self-attention without a padding mask")
        x = query if self.batch_first else query.transpose(0, 1)
        n, t, _ = x.shape
        q, k, v = (z.view(n, t, self.num_heads, -1).transpose(1, 2)
                   for z in self.in_proj(x).chunk(3, dim=-1))  # (N, H, T, C/H)  # fmt: skip
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            attn_mask = ~attn_mask  # torch's MHA masks True; sdpa keeps True
        drop = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=drop,
                                           is_causal=is_causal and attn_mask is None)  # fmt: skip
        y = self.out_proj(y.transpose(1, 2).reshape(n, t, -1))
        return (y if self.batch_first else y.transpose(0, 1)), None


def swap_attention(model: nn.Module) -> list[str]:
    """Every nn.MultiheadAttention of the model replaced in place by a HeadsAttention holding
    the same parameters; their dotted names."""
    names = [n for n, m in model.named_modules() if type(m) is nn.MultiheadAttention]
    for name in names:
        parent, _, attr = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, attr, HeadsAttention(getattr(owner, attr)))
    return names
