"""Transformers as their authors write them, not as scalelab would like them: the zoo that
tests/test_zoo*.py runs under every strategy (`--model tests/programs/zoo.py:FACTORY`).

- `nanogpt`: karpathy/nanoGPT's model.py, trimmed (dropout kept at 0): `transformer.wte/wpe/h/
  ln_f`, a fused `c_attn` split with `.split(self.n_embd, dim=2)`, `view(B, T, n_head,
  C // n_head)`, the head tied to the token embedding (`tied=False` unties it).
- `hf_llama`: Hugging Face's own `LlamaForCausalLM` at a small random config with grouped-query
  attention (4 query heads, 2 key/value heads); `hf_gpt2`: `GPT2LMHeadModel` (transformers'
  `Conv1D`, the head tied by default). Both need `transformers` (the `hf` extra).
- `encoder`: torch's `nn.TransformerEncoder` (tests/programs/transformer_nets.py).
- `tuple_blocks`: a decoder whose blocks return `(hidden, attention)` tuples, as older HF layers
  do, and whose forward unpacks them.

Each returns the last position's logits, (N, vocab) (the wrappers are the few lines a user
writes); `lm=True` returns every position's logits, (N, T, vocab), as a language model does.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


# --- nanoGPT (model.py, as written there) -------------------------------------------------
class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, bias: bool = True) -> None:
        super().__init__()
        assert n_embd % n_head == 0
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)  # key, query, value, all heads
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.n_head = n_head
        self.n_embd = n_embd

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()  # batch, sequence length, embedding dimensionality (n_embd)
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble all head outputs
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, n_embd: int, bias: bool = True) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


class NanoBlock(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    def __init__(self, vocab_size: int, block_size: int, n_layer: int, n_head: int,
                 n_embd: int, tied: bool = True, lm: bool = False) -> None:  # fmt: skip
        super().__init__()
        self.lm = lm
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd),
            wpe=nn.Embedding(block_size, n_embd),
            h=nn.ModuleList([NanoBlock(n_embd, n_head) for _ in range(n_layer)]),
            ln_f=nn.LayerNorm(n_embd),
        ))  # fmt: skip
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        if tied:  # https://paperswithcode.com/method/weight-tying
            self.transformer.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)  # shape (t)
        tok_emb = self.transformer.wte(idx)  # token embeddings of shape (b, t, n_embd)
        pos_emb = self.transformer.wpe(pos)  # position embeddings of shape (t, n_embd)
        x = tok_emb + pos_emb
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if self.lm:
            return self.lm_head(x)  # (b, t, vocab)
        return self.lm_head(x[:, [-1], :])[:, 0]  # the last position: (b, vocab)


def nanogpt(vocab: int = 40, seq: int = 8, depth: int = 2, heads: int = 4, width: int = 16,
            tied: bool = True, lm: bool = False) -> nn.Module:  # fmt: skip
    return NanoGPT(vocab, seq, depth, heads, width, tied=tied, lm=lm)


# --- Hugging Face's own models, wrapped to return logits ----------------------------------
class LastLogits(nn.Module):
    """The few lines a user writes around an HF causal LM: (N, T) ids -> (N, vocab) logits of
    the last position, or every position's (N, T, vocab) with `lm=True`."""

    def __init__(self, model: nn.Module, lm: bool = False) -> None:
        super().__init__()
        self.model = model
        self.lm = lm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self.model(input_ids=ids, use_cache=False).logits  # (N, T, V)
        return logits if self.lm else logits[:, -1]


def hf_llama(vocab: int = 40, width: int = 16, heads: int = 4, kv_heads: int = 2,
             depth: int = 2, seq: int = 16, tied: bool = False,
             lm: bool = False) -> nn.Module:  # fmt: skip
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=width, intermediate_size=3 * width,
                      num_hidden_layers=depth, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, max_position_embeddings=seq,
                      tie_word_embeddings=tied, attn_implementation="sdpa")  # fmt: skip
    return LastLogits(LlamaForCausalLM(cfg), lm)


def hf_gpt2(vocab: int = 40, width: int = 16, heads: int = 4, depth: int = 2, seq: int = 16,
            tied: bool = True, lm: bool = False) -> nn.Module:  # fmt: skip
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=vocab, n_embd=width, n_head=heads, n_layer=depth,
                     n_positions=seq, bos_token_id=0, eos_token_id=0, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=tied,
                     attn_implementation="sdpa")  # fmt: skip
    return LastLogits(GPT2LMHeadModel(cfg), lm)


def encoder(**kw) -> nn.Module:
    from programs.transformer_nets import Encoder

    return Encoder(**kw)


# --- blocks that return tuples -------------------------------------------------------------
class TupleBlock(nn.Module):
    """A pre-norm block returning (hidden, attention weights), as older HF layers do."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.num_heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.q_proj = nn.Linear(width, width)
        self.k_proj = nn.Linear(width, width)
        self.v_proj = nn.Linear(width, width)
        self.out_proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n, t, c = x.shape
        h = self.norm1(x)
        q, k, v = (
            p(h).reshape(n, t, self.num_heads, -1).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )  # (N, H, T, D)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])  # (N, H, T, T)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(n, t, -1)
        x = x + self.out_proj(y)
        x = x + self.fc2(F.gelu(self.fc1(self.norm2(x))))
        return x, att


class TupleDecoder(nn.Module):
    def __init__(self, vocab: int, width: int, heads: int, depth: int, lm: bool) -> None:
        super().__init__()
        self.lm = lm
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(TupleBlock(width, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x, _ = layer(x)
        logits = self.head(self.norm(x))
        return logits if self.lm else logits[:, -1]


def tuple_blocks(vocab: int = 40, width: int = 16, heads: int = 4, depth: int = 2,
                 lm: bool = False) -> nn.Module:  # fmt: skip
    return TupleDecoder(vocab, width, heads, depth, lm)
