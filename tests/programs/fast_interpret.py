"""Check every Triton kernel of scalelab.fast through Triton's interpreter, on CPU tensors.

Run by tests/test_fast_cpu.py in a subprocess with TRITON_INTERPRET=1 (which must be set
before triton is imported, so never in the pytest process itself). Small odd shapes (lengths
and channel counts that do not divide the tiles, more than one item, padding indices past the
alphabet); every output buffer is poisoned with NaN first, so an element a kernel fails to
write shows up as a NaN relerr. fp32 cases compare tightly with the torch reference (same
math, no rounding to hide behind); bf16 cases within two bf16 roundings.

Prints one JSON object: {"seed": int, "cases": [{"name", "relerr", "tol", "unwritten"}],
"pipelines": {workload: {"relerr", "parts"}}}.
"""

from __future__ import annotations

import json
import os
import random
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402

from scalelab.fast import reference as R  # noqa: E402
from scalelab.fast.kernels import (  # noqa: E402
    charcnn_block1,
    conv1d,
    epilogue2d,
    layernorm1d,
    lrn_pool2d,
    space_to_depth,
)

CASES: list[dict] = []
TIGHT, LOOSE = 1e-5, 2e-2


def record(name: str, out: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    unwritten = int(torch.isnan(out).sum())
    err = float((out.float() - ref.float()).norm() / ref.float().norm())
    CASES.append({"name": name, "relerr": err, "tol": tol, "unwritten": unwritten})


def poisoned(shape, dtype, channels_last: bool = False) -> torch.Tensor:
    t = torch.full(shape, float("nan"), dtype=dtype)
    return t.contiguous(memory_format=torch.channels_last) if channels_last else t


def check_block1() -> None:
    # (N, L_IN, V, C, bc): L_RAW = L_IN - 6 is not a multiple of 3 (a position in the
    # statistics but in no pool window); C / bc = 3 blocks is not a power of two.
    for n, l_in, v, c, bc in ((3, 31, 13, 64, 32), (2, 24, 9, 96, 32)):
        w, b = torch.randn(c, v, 7) * 0.2, torch.randn(c) * 0.1
        l_raw = l_in - 6
        g, be = 1 + 0.1 * torch.randn(l_raw, c), 0.1 * torch.randn(l_raw, c)
        idx = torch.randint(0, v + 3, (n, l_in), dtype=torch.uint8)  # some past the alphabet
        for dtype, tol in ((torch.float32, TIGHT), (torch.bfloat16, LOOSE)):
            table = R.gather_table(w, dtype)
            gd, bd = g.to(dtype), be.to(dtype)
            out = poisoned((n, l_raw // 3, c), dtype)
            charcnn_block1.block1(idx, table, b, gd, bd, 1e-5, 3, out=out, bc=bc, bt=16, bp=4)
            ref = R.block1(idx, table, b, gd, bd, 1e-5, 3)
            record(f"block1 N{n} L{l_in} V{v} C{c} {dtype}", out, ref.float(), tol)
            # Independently of the gather formulation: one-hot conv, as the model computes it.
            onehot = (idx.long().unsqueeze(1) == torch.arange(v).view(1, v, 1)).float()
            y = torch.nn.functional.conv1d(onehot, table[:, :v].float().permute(2, 1, 0), b)
            y = torch.nn.functional.layer_norm(y, (c, l_raw), gd.float().t(), bd.float().t())
            y = torch.nn.functional.max_pool1d(torch.relu(y), 3).transpose(1, 2)
            record(f"block1-vs-onehot N{n} C{c} {dtype}", out, y, tol)


def check_conv1d() -> None:
    # (N, L, Ci, Co, K, pool, relu): M = N * L_out not a multiple of the 16-row tile.
    shapes = (
        (3, 31, 32, 48, 5, 3, True),
        (2, 19, 64, 32, 3, 1, False),
        (3, 20, 16, 16, 7, 1, True),
    )
    for n, length, ci, co, k, pool, relu in shapes:
        x, w, b = torch.randn(n, length, ci), torch.randn(k, ci, co) * 0.1, torch.randn(co)
        cfg = conv1d.ConvConfig(16, 16, 16, 4, 1)
        for dtype, tol in ((torch.float32, TIGHT), (torch.bfloat16, LOOSE)):
            out = poisoned((n, (length - k + 1) // pool, co), dtype)
            conv1d.conv1d(x.to(dtype), w.to(dtype), b, pool, relu, cfg, out=out)
            ref = R.conv1d(x.to(dtype).float(), w.to(dtype).float(), b, pool, relu)
            record(
                f"conv1d N{n} L{length} {ci}->{co} k{k} pool{pool} relu{relu} {dtype}",
                out,
                ref,
                tol,
            )


def check_layernorm() -> None:
    n, length, c = 2, 25, 48  # 48 / 16 = 3 channel blocks; 25 = 3 * 8 + 1
    x, g, b = (
        torch.randn(n, length, c),
        1 + 0.1 * torch.randn(length, c),
        0.1 * torch.randn(length, c),
    )
    for dtype, tol in ((torch.float32, TIGHT), (torch.bfloat16, LOOSE)):
        out = poisoned((n, length // 3, c), dtype)
        layernorm1d.layernorm_relu_pool(x.to(dtype), g, b, 1e-5, 3, out=out, bc=16, bt=8, bp=4)
        ref = R.layernorm_relu_pool(x.to(dtype).float(), g, b, 1e-5, 3)
        record(f"layernorm N{n} L{length} C{c} {dtype}", out, ref, tol)


def check_epilogue2d() -> None:
    strong = (5, 1.0, 0.75, 2.0)  # alpha 1: the normalisation changes values a lot
    # The interpreter runs each program instance in Python (~1 s per 100 of lrn_pool2d's):
    # the LRN cases are small, one of them with several column blocks and row chunks (6x6
    # outputs in 4-wide blocks of 2 rows), one with two images.
    cases = (
        ((1, 40, 13), (5, 1e-4, 0.75, 2.0), (3, 2)),
        ((2, 40, 13), None, (3, 2)),
        ((3, 24, 9), None, None),
        ((2, 20, 7), strong, (3, 2)),
        ((1, 7, 8), strong, None),
        ((1, 96, 15), (5, 1e-4, 0.75, 2.0), (3, 2)),  # AlexNet's 96 channels
    )
    for (n, c, h), lrn, pool in cases:
        y, b = 3 * torch.randn(n, c, h, h), torch.randn(c)
        kp, sp = pool or (1, 1)
        ho = (h - kp) // sp + 1
        for dtype, tol in ((torch.float32, TIGHT), (torch.bfloat16, LOOSE)):
            yd = y.to(dtype).contiguous(memory_format=torch.channels_last)
            out = poisoned((n, c, ho, ho), dtype, channels_last=True)
            if lrn is None:
                epilogue2d.epilogue2d(yd, b, pool, out=out, bm=64, bc=16)
            else:  # small tiles: several column blocks and row chunks per image
                lrn_pool2d.lrn_pool2d(yd, b, lrn, pool, out=out, bw=4, rows=2)
            ref = R.epilogue2d(yd.float(), b, lrn, pool)
            kernel = "epilogue2d" if lrn is None else "lrn_pool2d"
            record(f"{kernel} N{n} C{c} H{h} pool{pool} {dtype}", out, ref, tol)


def check_space_to_depth() -> None:
    """Against the torch copy (alexnet.s2d_input): images cropped (rows past 4 Hb unread) and
    padded (blocks past the image read as 0); values 0..255 are exact in bf16, so equal."""
    from scalelab.fast.alexnet import s2d_input

    for (n, c, h), out_size, rb in (((2, 3, 23), 5, 3), ((1, 2, 30), 6, 2), ((3, 3, 17), 3, 3)):
        x = torch.randint(0, 256, (n, c, h, h), dtype=torch.uint8)
        out = space_to_depth.space_to_depth(x, out_size + rb - 1, 4, tile=64)
        ref = s2d_input(x, out_size, rb)
        assert out.shape == ref.shape and out.stride() == ref.stride()
        record(f"space_to_depth N{n} C{c} H{h} out{out_size}", out, ref, 0.0)


def check_pipeline(workload_name: str, **kw) -> dict:
    """The whole fast forward with its Triton kernels, against the float64 oracle."""
    from scalelab.config import RunConfig
    from scalelab.fast import accelerate
    from scalelab.oracle.check import relative_error
    from scalelab.workloads import WORKLOADS
    from scalelab.workloads.base import state_dict_float64

    cfg = RunConfig(workload=workload_name, dtype="bf16", batch=2, quiet=True, **kw)
    workload = WORKLOADS.get(workload_name)(cfg)
    model = workload.build_model()
    x = workload.inputs(2).x
    fast = accelerate(workload, model, cfg, torch.device("cpu"), log=lambda line: None)
    out = fast(x).double().numpy()
    ref = workload.reference_forward(state_dict_float64(model), x.numpy())
    return {"relerr": relative_error(out, ref), "parts": fast.parts}


def main() -> None:
    seed = int(sys.argv[1]) if len(sys.argv) > 1 else random.randrange(2**31)
    torch.manual_seed(seed)
    check_block1()
    check_conv1d()
    check_layernorm()
    check_epilogue2d()
    check_space_to_depth()
    pipelines = {"alexnet": check_pipeline("alexnet", image_size=67)}
    if "--charcnn" in sys.argv:
        pipelines["charcnn"] = check_pipeline("charcnn")
    print(json.dumps({"seed": seed, "cases": CASES, "pipelines": pipelines}))


if __name__ == "__main__":
    main()
