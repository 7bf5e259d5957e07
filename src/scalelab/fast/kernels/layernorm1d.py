"""LayerNorm over a whole (L, C) map per item, fused with ReLU and max-pool (charcnn block 6).

Kernel 1 writes per-(item, channel block) partial sums of x and x^2; kernel 2 reduces an
item's partials to its mean and variance, normalises with gamma/beta, takes the max over
each pool window and applies ReLU. x is read twice and the normalised map never written.

Shapes: x (N, L, C) with unit channel stride; gamma_t, beta_t (L, C) contiguous (the module's
(C, L) parameters transposed); out (N, L // POOL, C) with unit channel stride.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from scalelab.fast.kernels import INTERPRET


@triton.jit
def _ln_stats_kernel(
    x_ptr,
    part_ptr,
    s_xn,
    s_xl,
    L: tl.constexpr,
    C: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
):
    n = tl.program_id(0)
    cb = tl.program_id(1)
    c = cb * BC + tl.arange(0, BC)
    base = x_ptr + n.to(tl.int64) * s_xn
    s1 = tl.zeros((BT, BC), tl.float32)
    s2 = tl.zeros((BT, BC), tl.float32)
    for t0 in range(0, L, BT):
        t = t0 + tl.arange(0, BT)
        x = tl.load(base + t[:, None] * s_xl + c[None, :], mask=(t < L)[:, None], other=0.0)
        x = x.to(tl.float32)
        s1 += x
        s2 += x * x
    out = part_ptr + (n * (C // BC) + cb) * 2
    tl.store(out, tl.sum(tl.sum(s1, axis=1), axis=0))
    tl.store(out + 1, tl.sum(tl.sum(s2, axis=1), axis=0))


@triton.jit
def _ln_apply_kernel(
    x_ptr,
    gamma_ptr,
    beta_ptr,
    part_ptr,
    out_ptr,
    s_xn,
    s_xl,
    s_on,
    s_ol,
    eps,
    L: tl.constexpr,
    L_POOL: tl.constexpr,
    C: tl.constexpr,
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
    mean = tl.sum(tl.load(parts, mask=cbs < NCB, other=0.0), axis=0) / (L * C)
    var = tl.sum(tl.load(parts + 1, mask=cbs < NCB, other=0.0), axis=0) / (L * C) - mean * mean
    rstd = 1.0 / tl.sqrt(tl.maximum(var, 0.0) + eps)
    c = cb * BC + tl.arange(0, BC)
    p = pb * BP + tl.arange(0, BP)
    pmask = p < L_POOL
    base = x_ptr + n.to(tl.int64) * s_xn
    res = tl.full((BP, BC), float("-inf"), tl.float32)
    for j in tl.static_range(POOL):
        t = p * POOL + j
        x = tl.load(base + t[:, None] * s_xl + c[None, :], mask=pmask[:, None], other=0.0)
        at = t[:, None] * C + c[None, :]
        g = tl.load(gamma_ptr + at, mask=pmask[:, None], other=0.0).to(tl.float32)
        b = tl.load(beta_ptr + at, mask=pmask[:, None], other=0.0).to(tl.float32)
        res = tl.maximum(res, (x.to(tl.float32) - mean) * rstd * g + b)
    res = tl.maximum(res, 0.0)
    dst = out_ptr + n.to(tl.int64) * s_on + p[:, None] * s_ol + c[None, :]
    tl.store(dst, res.to(out_ptr.dtype.element_ty), mask=pmask[:, None])


def layernorm_relu_pool(
    x: torch.Tensor,
    gamma_t: torch.Tensor,
    beta_t: torch.Tensor,
    eps: float,
    pool: int,
    out: torch.Tensor | None = None,
    bc: int = 64,
    bt: int = 32,
    bp: int = 16,
    num_warps: int = 4,
) -> torch.Tensor:
    n, length, c = x.shape
    bc = min(bc, c)
    if c % bc:
        raise ValueError(f"channel block {bc} must divide {c}")
    assert x.stride(2) == 1 and gamma_t.is_contiguous() and beta_t.is_contiguous()
    l_pool = length // pool
    if out is None:
        out = torch.empty(n, l_pool, c, device=x.device, dtype=x.dtype)
    assert out.stride(2) == 1
    parts = torch.empty(n, c // bc, 2, device=x.device, dtype=torch.float32)
    opts = {} if INTERPRET else {"num_warps": num_warps}
    _ln_stats_kernel[(n, c // bc)](
        x, parts, x.stride(0), x.stride(1), L=length, C=c, BT=bt, BC=bc, **opts
    )
    _ln_apply_kernel[(n, c // bc, triton.cdiv(l_pool, bp))](
        x,
        gamma_t,
        beta_t,
        parts,
        out,
        x.stride(0),
        x.stride(1),
        out.stride(0),
        out.stride(1),
        eps,
        L=length,
        L_POOL=l_pool,
        C=c,
        POOL=pool,
        BP=bp,
        BC=bc,
        NCBP=triton.next_power_of_2(c // bc),
        **opts,
    )
    return out
