"""Where AlexNet's fast-path time goes outside the convolutions, and what could take it back.

The H100 record (benchmarks/results/speed_vs_peers_h100_2026-11-23/alexnet-infer.json) spent
1.92 ms in epi1 (bias + ReLU + LRN + max-pool over (1024, 96, 55, 55) bf16) and 1.57 ms in
epi2 (over (1024, 256, 27, 27)), against ~0.2 and ~0.13 ms of HBM traffic, and 2.83 ms in c1
(uint8 -> space-to-depth bf16, then cuDNN). This probe times, on one GPU, each candidate beside
the production kernel on the same tensors, and checks each against the fp32 reference:

- `triton-loads`: production lrn_pool2d (five channel-shifted loads per normalised pixel);
- `gather-*`: the same pass with one aligned load per pixel, the window's neighbours taken
  from the squares in registers (tl.gather along channels), at several tiles. (The first
  run's `triton-dot*` rows, the window sum as a (CP, CP) band matmul, 10-17x slower, are in
  results/alexnet_probe_h100/probe.json; that variant is gone from here.)
- `lrn-then-pool`: an elementwise LRN kernel (one lane per channel value: its five
  neighbours are consecutive addresses) and torch's channels_last max-pool;
- `compiled`: torch.compile of the fp32 reference (inductor's fused kernels);
- `copy`: y.clone(), the traffic floor of reading y once and writing as much again.
and for c1's input: the current s2d_input against one strided uint8 -> bf16 copy (1/255
folded into the weights, exact: integers <= 256 are bf16 numbers).

Usage (GPU):
    PYTHONPATH=src python benchmarks/epilogue_probe.py [--batch 1024] [--only c1|epi] [--out F]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from scalelab.fast import reference
from scalelab.fast.alexnet import S2D, s2d_input, s2d_weight
from scalelab.fast.kernels.lrn_pool2d import lrn_pool2d
from scalelab.fast.kernels.space_to_depth import space_to_depth
from scalelab.workloads.alexnet import LRN_ALPHA, LRN_BETA, LRN_K, LRN_SIZE

LRN = (LRN_SIZE, LRN_ALPHA, LRN_BETA, LRN_K)
CL = torch.channels_last


@triton.jit
def _lrn_gather_pixels(base, bias_ptr, row, cols, colmask, c, s_yh, s_yw,
                       C: tl.constexpr, CP: tl.constexpr, BW: tl.constexpr, SIZE: tl.constexpr,
                       ALPHA: tl.constexpr, BETA: tl.constexpr, KCONST: tl.constexpr):  # fmt: skip
    """As lrn_pool2d's _lrn_pixels with one aligned load: the window's neighbours come from
    the squares in registers (tl.gather along channels) instead of four shifted loads."""
    pix = row * s_yh + cols * s_yw
    v = tl.load(base + pix[:, None] + c[None, :], mask=colmask[:, None] & (c < C)[None, :],
                other=0.0)  # fmt: skip
    b = tl.load(bias_ptr + c, mask=c < C, other=0.0)
    a = tl.maximum(v.to(tl.float32) + b[None, :], 0.0)
    sq = a * a  # (BW, CP); channels past C are 0
    ssum = sq
    for d in tl.static_range(SIZE):
        if d != SIZE // 2:
            cd = c + (d - SIZE // 2)
            idx = tl.minimum(tl.maximum(cd, 0), CP - 1)
            g = tl.gather(sq, tl.broadcast_to(idx[None, :], (BW, CP)), axis=1)
            ssum += tl.where(((cd >= 0) & (cd < C))[None, :], g, 0.0)
    return a * tl.exp2(-BETA * tl.log2(KCONST + (ALPHA / SIZE) * ssum))


@triton.jit
def _lrn_pool_gather_kernel(y_ptr, bias_ptr, o_ptr, Ho, Wo, s_yn, s_yh, s_yw, s_on, s_oh, s_ow,
                            C: tl.constexpr, CP: tl.constexpr, SIZE: tl.constexpr,
                            ALPHA: tl.constexpr, BETA: tl.constexpr, KCONST: tl.constexpr,
                            KP: tl.constexpr, SP: tl.constexpr, BW: tl.constexpr,
                            ROWS: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    n_wb, n_hb = tl.cdiv(Wo, BW), tl.cdiv(Ho, ROWS)
    n = pid // (n_wb * n_hb)
    wb = (pid // n_hb) % n_wb
    hb = pid % n_hb
    base = y_ptr + n.to(tl.int64) * s_yn
    obase = o_ptr + n.to(tl.int64) * s_on
    ow = wb * BW + tl.arange(0, BW)
    owm = ow < Wo
    c = tl.arange(0, CP)
    oh0 = hb * ROWS
    carry = tl.full((BW, CP), float("-inf"), tl.float32)
    for dw in tl.static_range(KP):  # the first window's top row (KP = SP + 1: rows overlap by 1)
        carry = tl.maximum(carry, _lrn_gather_pixels(base, bias_ptr, oh0 * SP, ow * SP + dw, owm,
                                                     c, s_yh, s_yw, C, CP, BW, SIZE, ALPHA,
                                                     BETA, KCONST))  # fmt: skip
    for i in range(ROWS):
        oh = oh0 + i
        live = owm & (oh < Ho)
        res = carry
        for dh in tl.static_range(1, KP):
            r = tl.full((BW, CP), float("-inf"), tl.float32)
            for dw in tl.static_range(KP):
                r = tl.maximum(r, _lrn_gather_pixels(base, bias_ptr, oh * SP + dh, ow * SP + dw,
                                                     live, c, s_yh, s_yw, C, CP, BW, SIZE,
                                                     ALPHA, BETA, KCONST))  # fmt: skip
            res = tl.maximum(res, r)
            carry = r
        dst = obase + (oh * s_oh + ow * s_ow)[:, None] + c[None, :]
        tl.store(dst, res.to(o_ptr.dtype.element_ty), mask=live[:, None] & (c < C)[None, :])


def lrn_pool_gather(y, bias, pool, bw=16, rows=4, warps=4):
    n, c, h, w = y.shape
    kp, sp = pool
    assert kp == sp + 1
    ho, wo = (h - kp) // sp + 1, (w - kp) // sp + 1
    out = torch.empty(n, c, ho, wo, device=y.device, dtype=y.dtype, memory_format=CL)
    size, alpha, beta, k = LRN
    grid = (n * triton.cdiv(wo, bw) * triton.cdiv(ho, rows),)
    opts = {} if y.device.type == "cpu" else {"num_warps": warps}
    _lrn_pool_gather_kernel[grid](y, bias, out, ho, wo, y.stride(0), y.stride(2), y.stride(3),
                                  out.stride(0), out.stride(2), out.stride(3), C=c,
                                  CP=triton.next_power_of_2(c), SIZE=size, ALPHA=alpha,
                                  BETA=beta, KCONST=k, KP=kp, SP=sp, BW=bw, ROWS=rows,
                                  **opts)  # fmt: skip
    return out


@triton.jit
def _lrn_flat_kernel(y_ptr, bias_ptr, o_ptr, total, C: tl.constexpr, SIZE: tl.constexpr,
                     ALPHA: tl.constexpr, BETA: tl.constexpr, KCONST: tl.constexpr,
                     BLOCK: tl.constexpr):  # fmt: skip
    """LRN(ReLU(y + bias)) over a channels_last tensor viewed flat: element i is channel i % C."""
    off = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = off < total
    ch = (off % C).to(tl.int32)
    for dd in tl.static_range(SIZE):
        cd = ch + (dd - SIZE // 2)
        cm = m & (cd >= 0) & (cd < C)
        v = tl.load(y_ptr + off + (dd - SIZE // 2), mask=cm, other=0.0).to(tl.float32)
        a = tl.maximum(v + tl.load(bias_ptr + cd, mask=cm, other=0.0), 0.0)
        if dd == 0:
            ssum = a * a
        else:
            ssum += a * a
        if dd == SIZE // 2:
            z = a
    out = z * tl.exp2(-BETA * tl.log2(KCONST + (ALPHA / SIZE) * ssum))
    tl.store(o_ptr + off, out.to(o_ptr.dtype.element_ty), mask=m)


def lrn_then_pool(y, bias, pool, block=1024):
    z = torch.empty_like(y)  # channels_last like y
    total = y.numel()
    size, alpha, beta, k = LRN
    _lrn_flat_kernel[(triton.cdiv(total, block),)](y, bias, z, total, C=y.shape[1], SIZE=size,
                                                   ALPHA=alpha, BETA=beta, KCONST=k,
                                                   BLOCK=block)  # fmt: skip
    return F.max_pool2d(z, *pool)


def s2d_input_folded(x: torch.Tensor, out_size: int, rb: int, block: int = S2D) -> torch.Tensor:
    """As s2d_input without the /255 (folded into the weights): one strided uint8 -> bf16 copy."""
    n, c, h, w = x.shape
    hb = out_size + rb - 1
    rows = hb * block
    x = F.pad(x[:, :, :rows, :rows], (0, max(0, rows - w), 0, max(0, rows - h)))
    x6 = x.view(n, c, hb, block, hb, block).permute(0, 2, 4, 3, 5, 1)  # (N, Hb, Hb, dy, dx, C)
    out = torch.empty(n, hb, hb, block, block, c, device=x.device, dtype=torch.bfloat16)
    out.copy_(x6)
    return out.view(n, hb, hb, block * block * c).permute(0, 3, 1, 2)


def time_ms(fn, reps: int = 20) -> dict:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times)}


def relerr(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def probe_epilogue(name: str, n: int, c: int, hw: int, pool=(3, 2)) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    # conv outputs of AlexNet's scale: ~N(0, 30^2) pre-bias, so LRN's alpha term matters
    y = (torch.randn(n, c, hw, hw, device="cuda", generator=g) * 30).to(torch.bfloat16)
    y = y.contiguous(memory_format=CL)
    bias = torch.randn(c, device="cuda", generator=g)
    ref = reference.epilogue2d(y, bias, LRN, pool)
    compiled = torch.compile(functools_partial(reference.epilogue2d, bias=bias, lrn=LRN,
                                               pool=pool))  # fmt: skip
    fns = {
        "triton-loads": lambda: lrn_pool2d(y, bias, LRN, pool),
        "gather-bw8": lambda: lrn_pool_gather(y, bias, pool, bw=8),
        "gather-bw16": lambda: lrn_pool_gather(y, bias, pool, bw=16),
        "gather-bw32": lambda: lrn_pool_gather(y, bias, pool, bw=32),
        "gather-bw16-w8": lambda: lrn_pool_gather(y, bias, pool, bw=16, warps=8),
        "gather-bw8-r8": lambda: lrn_pool_gather(y, bias, pool, bw=8, rows=8),
        "lrn-then-pool": lambda: lrn_then_pool(y, bias, pool),
        "compiled": lambda: compiled(y),
        "copy": lambda: y.clone(),
        "maxpool-only": lambda: F.max_pool2d(y, *pool),
    }
    rows = {}
    for label, fn in fns.items():
        try:
            t = time_ms(fn)
            err = relerr(fn(), ref) if label not in ("copy", "maxpool-only") else None
            rows[label] = {**t, "relerr": err}
        except Exception as e:  # a variant that does not compile is a result, not a stop
            rows[label] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        print(name, label, rows[label], flush=True)
    return rows


def functools_partial(fn, **kw):
    import functools

    return functools.partial(fn, **kw)


def probe_c1(n: int) -> dict:
    x = torch.randint(0, 256, (n, 3, 227, 227), device="cuda", dtype=torch.uint8)
    w = torch.randn(96, 3, 11, 11, device="cuda") * 0.05
    ws = s2d_weight(w).to(torch.bfloat16).contiguous(memory_format=CL)
    ws_folded = (s2d_weight(w) / 255).to(torch.bfloat16).contiguous(memory_format=CL)
    rb = ws.shape[-1]
    ref = F.conv2d(x.double() / 255, w.double(), stride=4)
    fns = {
        "s2d-input-now": lambda: s2d_input(x, 55, rb),
        "s2d-input-folded": lambda: s2d_input_folded(x, 55, rb),
        "c1-now": lambda: F.conv2d(s2d_input(x, 55, rb), ws),
        "c1-folded": lambda: F.conv2d(s2d_input_folded(x, 55, rb), ws_folded),
        "s2d-triton-1024": lambda: space_to_depth(x, 57, S2D),
        "s2d-triton-256": lambda: space_to_depth(x, 57, S2D, tile=256),
        "s2d-triton-4096": lambda: space_to_depth(x, 57, S2D, tile=4096),
        "c1-triton": lambda: F.conv2d(space_to_depth(x, 57, S2D), ws_folded),
        "conv-only": (lambda xs: lambda: F.conv2d(xs, ws))(s2d_input(x, 55, rb)),
    }
    rows = {}
    for label, fn in fns.items():
        t = time_ms(fn)
        err = relerr(fn().double(), ref) if label.startswith("c1") else None
        rows[label] = {**t, "relerr": err}
        print("c1", label, rows[label], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--only", choices=("c1", "epi"), help="probe one part")
    ap.add_argument("--out")
    a = ap.parse_args()
    torch.backends.cudnn.benchmark = True
    result = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "batch": a.batch,
    }
    if a.only in (None, "c1"):
        result["c1"] = probe_c1(a.batch)
    if a.only in (None, "epi"):
        result["epi1"] = probe_epilogue("epi1", a.batch, 96, 55)
        result["epi2"] = probe_epilogue("epi2", a.batch, 256, 27)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
