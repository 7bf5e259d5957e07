"""Channels-last conv1d as an implicit GEMM with a fused bias, max-pool and ReLU epilogue.

out[n, p, co] = relu(max_{j < POOL} sum_{k, ci} x[n, p*POOL + j + k, ci] * W[k, ci, co] + b[co])

The GEMM's M rows are (text, pooled position) pairs, N its output channels, and its reduction
runs over K taps x C_IN channels: for tap k the A tile is rows p*POOL + j + k of x (each row
C_IN contiguous values, channels last) and the B tile is W[k] (C_IN, C_OUT). Each of the POOL
window positions j is its own accumulation; the tile keeps their running max, so the
un-pooled (N, L, C_OUT) map is never written. Bias and ReLU commute with the max.

Shapes: x (N, L_IN, C_IN) with unit channel stride; w_t (K, C_IN, C_OUT) contiguous; bias
(C_OUT,) fp32; out (N, L_POOL, C_OUT) with unit channel stride. bf16 operands, fp32
accumulation. C_IN must be a multiple of BK and C_OUT of BN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from scalelab.fast.kernels import INTERPRET


@triton.jit
def _conv_taps(
    x_ptr,
    w_ptr,
    row0,
    p,
    mmask,
    co,
    ci,
    j,
    s_xl,
    C_IN: tl.constexpr,
    C_OUT: tl.constexpr,
    K: tl.constexpr,
    POOL: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """(BM, BN) fp32 sum over taps k and channels of x[p*POOL + j + k, :] @ W[k]."""
    CSTEPS: tl.constexpr = C_IN // BK
    acc = tl.zeros((BM, BN), tl.float32)
    for r in range(K * CSTEPS):  # one flat loop, so Triton pipelines the loads across taps
        k = r // CSTEPS
        c0 = (r % CSTEPS) * BK
        rows = p * POOL + j + k
        a = tl.load(
            row0[:, None] + rows[:, None] * s_xl + (c0 + ci)[None, :],
            mask=mmask[:, None],
            other=0.0,
        )
        b = tl.load(w_ptr + (k * C_IN + c0 + ci)[:, None] * C_OUT + co[None, :])
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _conv1d_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    o_ptr,
    M,
    s_xn,
    s_xl,
    s_on,
    s_ol,
    L_POOL,  # runtime: conv3..conv6 differ only in length and share one compiled kernel
    C_IN: tl.constexpr,
    C_OUT: tl.constexpr,
    K: tl.constexpr,
    POOL: tl.constexpr,
    RELU: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    m = pid_m * BM + tl.arange(0, BM)  # (BM,) flattened (text, pooled position)
    mmask = m < M
    n = (m // L_POOL).to(tl.int64)
    p = m % L_POOL
    co = pid_n * BN + tl.arange(0, BN)
    ci = tl.arange(0, BK)
    row0 = x_ptr + n * s_xn  # (BM,) start of each row's text
    if POOL == 1:  # no running max: one accumulator tile, not two, in registers
        res = _conv_taps(
            x_ptr, w_ptr, row0, p, mmask, co, ci, 0, s_xl, C_IN, C_OUT, K, POOL, BM, BN, BK, UPCAST
        )
    else:
        res = tl.full((BM, BN), float("-inf"), tl.float32)
        for j in tl.static_range(POOL):
            acc = _conv_taps(
                x_ptr,
                w_ptr,
                row0,
                p,
                mmask,
                co,
                ci,
                j,
                s_xl,
                C_IN,
                C_OUT,
                K,
                POOL,
                BM,
                BN,
                BK,
                UPCAST,
            )
            res = tl.maximum(res, acc)
    res += tl.load(b_ptr + co).to(tl.float32)[None, :]
    if RELU:
        res = tl.maximum(res, 0.0)
    dst = o_ptr + n[:, None] * s_on + p[:, None] * s_ol + co[None, :]
    tl.store(dst, res.to(o_ptr.dtype.element_ty), mask=mmask[:, None])


@dataclass(frozen=True)
class ConvConfig:
    bm: int = 128
    bn: int = 128
    bk: int = 64
    num_warps: int = 8
    num_stages: int = 3

    def fits(self, c_in: int, c_out: int) -> bool:
        return c_in % self.bk == 0 and c_out % self.bn == 0

    def clipped(self, c_in: int, c_out: int) -> ConvConfig:
        """The same tile with BK, BN no larger than the channel counts (small test layers)."""
        return ConvConfig(
            self.bm, min(self.bn, c_out), min(self.bk, c_in), self.num_warps, self.num_stages
        )

    @property
    def label(self) -> str:
        return f"{self.bm}x{self.bn}x{self.bk}w{self.num_warps}s{self.num_stages}"


# Tile shapes tried on the GPU (the fast path times them on the real shapes and keeps the
# fastest); the interpreter gets one big tile, since it pays per program, not per register.
# 128x256 is the usual Hopper bf16 GEMM tile; with a pool window two such fp32 tiles (sum and
# running max) would not fit in registers, so pooled layers try 128x128 and 64x128.
GPU_CONFIGS = (ConvConfig(128, 128, 64, 8, 3), ConvConfig(64, 128, 64, 4, 4))
GPU_CONFIGS_UNPOOLED = (ConvConfig(128, 256, 64, 8, 3), ConvConfig(128, 128, 64, 8, 3))
INTERPRET_CONFIG = ConvConfig(128, 256, 256, 4, 1)


def conv1d(
    x: torch.Tensor,
    w_t: torch.Tensor,
    bias: torch.Tensor,
    pool: int,
    relu: bool,
    cfg: ConvConfig,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch the kernel; returns out (N, (L_IN - K + 1) // pool, C_OUT)."""
    n, l_in, c_in = x.shape
    k, c_in_w, c_out = w_t.shape
    assert c_in == c_in_w and x.stride(2) == 1 and w_t.is_contiguous()
    if not cfg.fits(c_in, c_out):
        raise ValueError(f"tile {cfg.label} does not divide C_IN={c_in}, C_OUT={c_out}")
    l_pool = (l_in - k + 1) // pool
    if out is None:
        out = torch.empty(n, l_pool, c_out, device=x.device, dtype=x.dtype)
    assert out.stride(2) == 1
    m = n * l_pool
    grid = (triton.cdiv(m, cfg.bm), c_out // cfg.bn)
    opts = {} if INTERPRET else {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    _conv1d_kernel[grid](
        x,
        w_t,
        bias,
        out,
        m,
        x.stride(0),
        x.stride(1),
        out.stride(0),
        out.stride(1),
        l_pool,
        C_IN=c_in,
        C_OUT=c_out,
        K=k,
        POOL=pool,
        RELU=relu,
        BM=cfg.bm,
        BN=cfg.bn,
        BK=cfg.bk,
        UPCAST=INTERPRET,
        **opts,
    )
    return out
