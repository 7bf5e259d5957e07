"""charcnn conv block 1 from character indices: conv1 as a gather, + bias, LayerNorm, ReLU, pool.

conv1 on a one-hot input multiplies nothing: output (c, t) is bias[c] plus, for k in 0..6, the
weight column W[c, idx[t + k], k]. With the table T[k, v, :] = W[:, v, k] (a zero row for the
padding index 70) that is 7 gathered rows of C contiguous values per position.

LayerNorm normalises over the whole (C, L_RAW) map of a text, so it needs the map's mean and
variance before any output: kernel 1 recomputes the gather sums to get per-(text, channel block)
partial sums of x and x^2; kernel 2 recomputes the gather (cheaper than storing the 1008-long
map), normalises with gamma/beta, takes the max over each pool window and applies ReLU (which
commutes with max). Nothing of size (N, C, 1008) is ever written.

Shapes: idx (N, L_IN) uint8; table (K, V1, C) bf16; bias (C,) fp32; gamma_t, beta_t
(L_RAW, C) bf16 (transposed so a row of channels is contiguous); out (N, L_POOL, C),
channels last, L_RAW = L_IN - K + 1, L_POOL = L_RAW // POOL.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from scalelab.fast.kernels import INTERPRET


@triton.jit
def _gather_conv(
    idx_row,
    table_ptr,
    bias,
    t,
    tmask,
    c,
    K: tl.constexpr,
    V1: tl.constexpr,
    C: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
):
    """(BT, BC) fp32 conv1 outputs at positions t, channels c: bias + sum_k T[k, idx[t+k], c]."""
    x = tl.zeros((BT, BC), tl.float32) + bias[None, :]
    for k in tl.static_range(K):
        v = tl.load(idx_row + t + k, mask=tmask, other=V1 - 1).to(tl.int32)
        v = tl.minimum(v, V1 - 1)  # any index past the alphabet is padding: the zero row
        rows = (k * V1 + v) * C
        x += tl.load(table_ptr + rows[:, None] + c[None, :]).to(tl.float32)
    return x


@triton.jit
def _block1_stats_kernel(
    idx_ptr,
    table_ptr,
    bias_ptr,
    part_ptr,
    s_idx,
    L_RAW: tl.constexpr,
    C: tl.constexpr,
    V1: tl.constexpr,
    K: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
):
    n = tl.program_id(0)
    cb = tl.program_id(1)
    c = cb * BC + tl.arange(0, BC)
    bias = tl.load(bias_ptr + c).to(tl.float32)
    idx_row = idx_ptr + n.to(tl.int64) * s_idx
    s1 = tl.zeros((BT, BC), tl.float32)
    s2 = tl.zeros((BT, BC), tl.float32)
    for t0 in range(0, L_RAW, BT):
        t = t0 + tl.arange(0, BT)
        tmask = t < L_RAW
        x = _gather_conv(idx_row, table_ptr, bias, t, tmask, c, K, V1, C, BT, BC)
        x = tl.where(tmask[:, None], x, 0.0)
        s1 += x
        s2 += x * x
    out = part_ptr + (n * (C // BC) + cb) * 2
    tl.store(out, tl.sum(tl.sum(s1, axis=1), axis=0))
    tl.store(out + 1, tl.sum(tl.sum(s2, axis=1), axis=0))


@triton.jit
def _block1_apply_kernel(
    idx_ptr,
    table_ptr,
    bias_ptr,
    gamma_ptr,
    beta_ptr,
    part_ptr,
    out_ptr,
    s_idx,
    s_on,
    s_ol,
    eps,
    L_RAW: tl.constexpr,
    L_POOL: tl.constexpr,
    C: tl.constexpr,
    V1: tl.constexpr,
    K: tl.constexpr,
    POOL: tl.constexpr,
    BP: tl.constexpr,
    BC: tl.constexpr,
    NCBP: tl.constexpr,
):
    n = tl.program_id(0)
    cb = tl.program_id(1)
    pb = tl.program_id(2)
    NCB: tl.constexpr = C // BC
    cbs = tl.arange(0, NCBP)  # NCBP: NCB rounded up to a power of two (arange's rule)
    parts = part_ptr + (n * NCB + cbs) * 2
    count = L_RAW * C
    mean = tl.sum(tl.load(parts, mask=cbs < NCB, other=0.0), axis=0) / count
    var = tl.sum(tl.load(parts + 1, mask=cbs < NCB, other=0.0), axis=0) / count - mean * mean
    rstd = 1.0 / tl.sqrt(tl.maximum(var, 0.0) + eps)
    c = cb * BC + tl.arange(0, BC)
    bias = tl.load(bias_ptr + c).to(tl.float32)
    idx_row = idx_ptr + n.to(tl.int64) * s_idx
    p = pb * BP + tl.arange(0, BP)
    pmask = p < L_POOL
    res = tl.full((BP, BC), float("-inf"), tl.float32)
    for j in tl.static_range(POOL):
        t = p * POOL + j  # raw positions of window element j
        x = _gather_conv(idx_row, table_ptr, bias, t, pmask, c, K, V1, C, BP, BC)
        at = t[:, None] * C + c[None, :]
        g = tl.load(gamma_ptr + at, mask=pmask[:, None], other=0.0).to(tl.float32)
        b = tl.load(beta_ptr + at, mask=pmask[:, None], other=0.0).to(tl.float32)
        res = tl.maximum(res, (x - mean) * rstd * g + b)
    res = tl.maximum(res, 0.0)
    dst = out_ptr + n.to(tl.int64) * s_on + p[:, None] * s_ol + c[None, :]
    tl.store(dst, res.to(out_ptr.dtype.element_ty), mask=pmask[:, None])


def block1(
    idx: torch.Tensor,
    table: torch.Tensor,
    bias: torch.Tensor,
    gamma_t: torch.Tensor,
    beta_t: torch.Tensor,
    eps: float,
    pool: int,
    out: torch.Tensor | None = None,
    bc: int = 32,
    bt: int = 64,
    bp: int = 32,
    num_warps: int = 4,
) -> torch.Tensor:
    """Launch both kernels; returns out (N, L_RAW // pool, C) channels last."""
    n, l_in = idx.shape
    k, v1, c = table.shape
    l_raw = l_in - k + 1
    l_pool = l_raw // pool
    if c % bc:
        raise ValueError(f"channel block {bc} must divide {c}")
    assert idx.stride(1) == 1 and table.is_contiguous() and gamma_t.is_contiguous()
    if out is None:
        out = torch.empty(n, l_pool, c, device=idx.device, dtype=table.dtype)
    assert out.stride(2) == 1
    parts = torch.empty(n, c // bc, 2, device=idx.device, dtype=torch.float32)
    opts = {} if INTERPRET else {"num_warps": num_warps}
    _block1_stats_kernel[(n, c // bc)](
        idx, table, bias, parts, idx.stride(0), L_RAW=l_raw, C=c, V1=v1, K=k, BT=bt, BC=bc, **opts
    )
    _block1_apply_kernel[(n, c // bc, triton.cdiv(l_pool, bp))](
        idx,
        table,
        bias,
        gamma_t,
        beta_t,
        parts,
        out,
        idx.stride(0),
        out.stride(0),
        out.stride(1),
        eps,
        L_RAW=l_raw,
        L_POOL=l_pool,
        C=c,
        V1=v1,
        K=k,
        POOL=pool,
        BP=bp,
        BC=bc,
        NCBP=triton.next_power_of_2(c // bc),
        **opts,
    )
    return out
