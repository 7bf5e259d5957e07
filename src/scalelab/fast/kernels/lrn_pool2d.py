"""AlexNet's LRN epilogue, one pass: out = maxpool_{KP x KP / SP}( LRN( ReLU(y + bias) ) ).

The same function as epilogue2d with `lrn` set, organised so every input pixel is normalised
about once instead of once per window tap and per neighbour load:

- a program owns one image n, BW output columns and ROWS output rows, and holds *all* C
  channels of a pixel in its tile (CP = next power of two >= C), so the LRN window (channels
  c-2..c+2) is five loads of the same cache lines, shifted, not five separate tiles;
- it walks its output rows top to bottom; an input row is reduced over the KP columns of each
  window ("column max") once, and with KP = SP + 1 (3/2 pooling) the last row of a window is the
  first of the next, so it is carried over: 2 input rows per output row instead of 3;
- the image's base offset is one int64 scalar; the tiles' offsets stay int32 (the previous
  kernel built int64 pointer tiles per tap and spilled: 13.9 ms for epi1 at batch 1024 on H100,
  where the pass is worth ~0.3 ms of HBM traffic).

Shapes: y (N, H, W, C) with unit channel stride (a channels_last (N, C, H, W) tensor's storage),
out (N, Ho, Wo, C) likewise, Ho = (H - KP) // SP + 1 (floor mode, no padding). KP = SP = 1 is
LRN alone. Work per output pixel: (KP - OVERLAP) * KP normalised pixels of 5 loads each.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from scalelab.fast import tuning
from scalelab.fast.kernels import INTERPRET


@triton.jit
def _lrn_pixels(
    base, bias_ptr, row, cols, colmask, c, s_yh, s_yw,
    C: tl.constexpr, SIZE: tl.constexpr, ALPHA: tl.constexpr, BETA: tl.constexpr,
    KCONST: tl.constexpr,
):  # fmt: skip
    """LRN(ReLU(y + bias)) of pixels (row, cols) (BW,) over channels c (CP,): (BW, CP) fp32.

    Columns outside colmask and channels outside [0, C) read as zero (they are ReLU(0 + 0))."""
    pix = row * s_yh + cols * s_yw  # (BW,) int32 offsets within the image
    for d in tl.static_range(SIZE):
        cd = c + (d - SIZE // 2)  # (CP,) shifted channels: the centre's cache lines again
        cm = (cd >= 0) & (cd < C)
        v = tl.load(
            base + pix[:, None] + cd[None, :], mask=colmask[:, None] & cm[None, :], other=0.0
        )
        b = tl.load(bias_ptr + cd, mask=cm, other=0.0)
        a = tl.maximum(v.to(tl.float32) + b[None, :], 0.0)
        if d == 0:
            ssum = a * a
        else:
            ssum += a * a
        if d == SIZE // 2:
            z = a
    return z * tl.exp2(-BETA * tl.log2(KCONST + (ALPHA / SIZE) * ssum))


@triton.jit
def _colmax(
    base, bias_ptr, row, ow, owmask, c, s_yh, s_yw,
    C: tl.constexpr, SIZE: tl.constexpr, ALPHA: tl.constexpr, BETA: tl.constexpr,
    KCONST: tl.constexpr, KP: tl.constexpr, SP: tl.constexpr,
):  # fmt: skip
    """max over dw < KP of the normalised pixels (row, ow * SP + dw): (BW, CP)."""
    acc = _lrn_pixels(
        base, bias_ptr, row, ow * SP, owmask, c, s_yh, s_yw, C, SIZE, ALPHA, BETA, KCONST
    )
    for dw in tl.static_range(1, KP):
        z = _lrn_pixels(
            base, bias_ptr, row, ow * SP + dw, owmask, c, s_yh, s_yw, C, SIZE, ALPHA, BETA, KCONST
        )
        acc = tl.maximum(acc, z)
    return acc


@triton.jit
def _lrn_pool2d_kernel(
    y_ptr, bias_ptr, o_ptr, Ho, Wo, s_yn, s_yh, s_yw, s_on, s_oh, s_ow,
    C: tl.constexpr, CP: tl.constexpr,
    SIZE: tl.constexpr, ALPHA: tl.constexpr, BETA: tl.constexpr, KCONST: tl.constexpr,
    KP: tl.constexpr, SP: tl.constexpr, OVERLAP: tl.constexpr,
    BW: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    n_wb, n_hb = tl.cdiv(Wo, BW), tl.cdiv(Ho, ROWS)
    n = pid // (n_wb * n_hb)
    wb = (pid // n_hb) % n_wb
    hb = pid % n_hb
    base = y_ptr + n.to(tl.int64) * s_yn  # scalar: the image's first element
    obase = o_ptr + n.to(tl.int64) * s_on
    ow = wb * BW + tl.arange(0, BW)  # (BW,) output columns
    owm = ow < Wo
    c = tl.arange(0, CP)
    oh0 = hb * ROWS
    carry = tl.full((BW, CP), float("-inf"), tl.float32)
    if OVERLAP:  # the first window's top row; later ones arrive as the previous bottom row
        carry = _colmax(
            base, bias_ptr, oh0 * SP, ow, owm, c, s_yh, s_yw, C, SIZE, ALPHA, BETA, KCONST, KP, SP
        )
    for i in range(ROWS):
        oh = oh0 + i
        live = owm & (oh < Ho)
        res = carry
        for dh in tl.static_range(OVERLAP, KP):
            r = _colmax(
                base, bias_ptr, oh * SP + dh, ow, live, c, s_yh, s_yw,
                C, SIZE, ALPHA, BETA, KCONST, KP, SP,
            )  # fmt: skip
            res = tl.maximum(res, r)
            if OVERLAP:
                carry = r  # after the last dh: row (oh + 1) * SP, the next window's top
        dst = obase + (oh * s_oh + ow * s_ow)[:, None] + c[None, :]
        tl.store(dst, res.to(o_ptr.dtype.element_ty), mask=live[:, None] & (c < C)[None, :])


# Tile shapes tried once per (C, Ho, Wo) on the GPU: fewer columns or rows per program means
# more programs and fewer live registers per thread; the (BW, CP) fp32 tiles and their
# pointer tiles are what limits occupancy at CP = 256.
TUNING = [
    triton.Config({"BW": bw, "ROWS": rows}, num_warps=warps)
    for bw in (8, 16, 32)
    for rows in (4, 8)
    for warps in (4, 8)
]
# A program's tile is (BW, CP) fp32 values per live tensor. AlexNet's widest (BW 32 x CP 256)
# compiles in seconds; C = 300 (CP 512) at BW 32 unrolls into a kernel ptxas spent minutes on
# (the GPU suite stalled there), so tiles stay at <= 8192 values.
MAX_TILE = 32 * 256


def _fitting(configs: list, named_args: dict, **kwargs) -> list:
    cp = kwargs.get("CP", named_args.get("CP"))
    fit = [cfg for cfg in configs if cfg.kwargs["BW"] * cp <= MAX_TILE]
    return fit or [min(configs, key=lambda cfg: cfg.kwargs["BW"])]


_lrn_pool2d_tuned = triton.autotune(
    TUNING, key=["C", "Ho", "Wo", "KP"], prune_configs_by={"early_config_prune": _fitting}
)(_lrn_pool2d_kernel)


def lrn_pool2d(
    y: torch.Tensor,
    bias: torch.Tensor,
    lrn: tuple[int, float, float, float],
    pool: tuple[int, int] | None,
    out: torch.Tensor | None = None,
    bw: int | None = None,
    rows: int | None = None,
    num_warps: int = 4,
) -> torch.Tensor:
    """y: conv output (N, C, H, W) channels_last, no bias; returns (N, C, Ho, Wo) channels_last.

    bw, rows: output columns and rows per program. Given (always under the interpreter), one
    launch with them; left out on a GPU, the fastest of TUNING for this shape.
    """
    n, c, h, w = y.shape
    assert y.stride(1) == 1, "lrn_pool2d needs a channels_last input"
    kp, sp = pool if pool is not None else (1, 1)
    overlap = kp - sp
    assert overlap in (0, 1), f"pool {pool}: windows may overlap by at most one row"
    ho, wo = (h - kp) // sp + 1, (w - kp) // sp + 1
    if out is None:
        out = torch.empty(
            n, c, ho, wo, device=y.device, dtype=y.dtype, memory_format=torch.channels_last
        )
    assert out.stride(1) == 1
    assert y.numel() < 2**31, "int32 offsets within the batch's images"
    size, alpha, beta, k = lrn
    strides = (*[y.stride(i) for i in (0, 2, 3)], *[out.stride(i) for i in (0, 2, 3)])
    spec = dict(C=c, CP=triton.next_power_of_2(c), SIZE=size, ALPHA=alpha, BETA=beta, KCONST=k)
    spec.update(KP=kp, SP=sp, OVERLAP=overlap)

    def grid(meta: dict) -> tuple[int]:
        return (n * triton.cdiv(wo, meta["BW"]) * triton.cdiv(ho, meta["ROWS"]),)

    tuned = _cached_tile(c, ho, wo, kp) if bw is None and not INTERPRET else None
    if bw is None and not INTERPRET and tuned is None:
        _lrn_pool2d_tuned[grid](y, bias, out, ho, wo, *strides, **spec)
        _store_tile(c, ho, wo, kp, _lrn_pool2d_tuned.best_config)
        return out
    if tuned is not None:  # the tile an earlier process's autotuning chose for this shape
        tile, num_warps = {"BW": tuned["BW"], "ROWS": tuned["ROWS"]}, tuned["num_warps"]
    else:
        widest = max(1, MAX_TILE // spec["CP"])
        tile = dict(BW=bw or min(32, widest, triton.next_power_of_2(wo)), ROWS=min(rows or 8, ho))
    opts = {} if INTERPRET else {"num_warps": num_warps}
    _lrn_pool2d_kernel[grid(tile)](y, bias, out, ho, wo, *strides, **spec, **tile, **opts)
    return out


def _tile_key(c: int, ho: int, wo: int, kp: int) -> str:
    return tuning.entry_key("lrn_pool2d", c, ho, wo, kp, [cfg.all_kwargs() for cfg in TUNING])


def _cached_tile(c: int, ho: int, wo: int, kp: int) -> dict | None:
    hit = tuning.lookup("cuda", _tile_key(c, ho, wo, kp))
    ok = isinstance(hit, dict) and {"BW", "ROWS", "num_warps"} <= set(hit)
    return hit if ok else None


def _store_tile(c: int, ho: int, wo: int, kp: int, best: triton.Config | None) -> None:
    if best is not None:
        tile = {"BW": best.kwargs["BW"], "ROWS": best.kwargs["ROWS"], "num_warps": best.num_warps}
        tuning.store("cuda", _tile_key(c, ho, wo, kp), tile)
