"""The epilogue of a 2-D convolution computed without its bias, on channels-last maps:

    out = maxpool_{KP x KP, stride SP}( ReLU(y + bias) )

One pass that reads the conv output once per window tap (from cache) and writes only the
pooled map; KP = SP = 1 is the plain bias + ReLU epilogue. With LRN between ReLU and the pool
(AlexNet's epi1/epi2) see lrn_pool2d.py, which normalises each pixel once.

Shapes: y (N, H, W, C) with unit channel stride (a channels_last (N, C, H, W) tensor's
storage); out (N, Ho, Wo, C) likewise, Ho = (H - KP) // SP + 1 (floor mode, no padding).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from scalelab.fast.kernels import INTERPRET


@triton.jit
def _load_act(y_ptr, bias_ptr, pix, c, mask, C: tl.constexpr):
    """ReLU(y + bias) at pixel offsets pix (BM,) and channels c (BC,); zero outside [0, C)."""
    cm = c < C
    v = tl.load(y_ptr + pix[:, None] + c[None, :], mask=mask[:, None] & cm[None, :], other=0.0)
    b = tl.load(bias_ptr + c, mask=cm, other=0.0)
    return tl.maximum(v.to(tl.float32) + b.to(tl.float32)[None, :], 0.0)


@triton.jit
def _epilogue2d_kernel(
    y_ptr,
    bias_ptr,
    o_ptr,
    M,
    Ho,
    Wo,
    s_yn,
    s_yh,
    s_yw,
    s_on,
    s_oh,
    s_ow,
    C: tl.constexpr,
    KP: tl.constexpr,
    SP: tl.constexpr,
    BM: tl.constexpr,
    BC: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_c = tl.program_id(1)
    m = pid_m * BM + tl.arange(0, BM)  # (BM,) flattened (n, oh, ow)
    mmask = m < M
    n = (m // (Ho * Wo)).to(tl.int64)
    r = m % (Ho * Wo)
    oh = r // Wo
    ow = r % Wo
    c = pid_c * BC + tl.arange(0, BC)
    res = tl.full((BM, BC), float("-inf"), tl.float32)
    for dh in tl.static_range(KP):
        for dw in tl.static_range(KP):
            pix = n * s_yn + (oh * SP + dh) * s_yh + (ow * SP + dw) * s_yw
            z = _load_act(y_ptr, bias_ptr, pix, c, mmask, C)
            res = tl.maximum(res, z)
    dst = o_ptr + (n * s_on + oh * s_oh + ow * s_ow)[:, None] + c[None, :]
    tl.store(dst, res.to(o_ptr.dtype.element_ty), mask=mmask[:, None] & (c < C)[None, :])


def epilogue2d(
    y: torch.Tensor,
    bias: torch.Tensor,
    pool: tuple[int, int] | None,
    out: torch.Tensor | None = None,
    bm: int = 64,
    bc: int = 64,
    num_warps: int = 4,
) -> torch.Tensor:
    """y: conv output (N, C, H, W), channels_last; returns (N, C, Ho, Wo) channels_last."""
    n, c, h, w = y.shape
    assert y.stride(1) == 1, "epilogue2d needs a channels_last input"
    kp, sp = pool if pool is not None else (1, 1)
    ho, wo = (h - kp) // sp + 1, (w - kp) // sp + 1
    if out is None:
        out = torch.empty(
            n, c, ho, wo, device=y.device, dtype=y.dtype, memory_format=torch.channels_last
        )
    assert out.stride(1) == 1
    bc = min(bc, triton.next_power_of_2(c))
    m = n * ho * wo
    opts = {} if INTERPRET else {"num_warps": num_warps}
    _epilogue2d_kernel[(triton.cdiv(m, bm), triton.cdiv(c, bc))](
        y,
        bias,
        out,
        m,
        ho,
        wo,
        y.stride(0),
        y.stride(2),
        y.stride(3),
        out.stride(0),
        out.stride(2),
        out.stride(3),
        C=c,
        KP=kp,
        SP=sp,
        BM=bm,
        BC=bc,
        **opts,
    )
    return out
