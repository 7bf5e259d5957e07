"""Numeric precisions a run may use, with the tolerance each is checked against.

Relative error is ||out - ref|| / ||ref|| against the float64 NumPy oracle. The tolerances are
chosen from the unit roundoff of each format times the error growth we measured on the deepest
workload (AlexNet, ~10 layers): fp32 (u = 6e-8) lands near 1e-6, so 1e-5 leaves a decade of
margin; tf32 and fp16 keep a 10/11-bit mantissa (u ~ 5e-4), bf16 an 8-bit one (u ~ 4e-3).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from scalelab.errors import UsageError


@dataclass(frozen=True)
class Precision:
    name: str
    storage: torch.dtype  # dtype of weights and activations outside autocast regions
    autocast: torch.dtype | None  # low-precision compute dtype under torch.autocast
    tf32: bool  # allow TF32 tensor cores for fp32 matmul/conv (GPU only)
    tolerance: float  # relerr bound against the float64 oracle
    itemsize: int  # bytes per element moved by compute (for cost tables)


PRECISIONS: dict[str, Precision] = {
    "fp64": Precision("fp64", torch.float64, None, False, 1e-12, 8),
    "fp32": Precision("fp32", torch.float32, None, False, 1e-5, 4),
    "tf32": Precision("tf32", torch.float32, None, True, 1e-2, 4),
    "bf16": Precision("bf16", torch.float32, torch.bfloat16, False, 5e-2, 2),
    "fp16": Precision("fp16", torch.float32, torch.float16, False, 1e-2, 2),
}


def get_precision(name: str) -> Precision:
    try:
        return PRECISIONS[name]
    except KeyError:
        raise UsageError(f"unknown dtype {name!r} (known: {', '.join(PRECISIONS)})") from None


def unit_roundoff(precision: Precision, device: str) -> float:
    """u of the arithmetic a run's kernels are expected to use: the autocast dtype's, TF32's
    10-bit mantissa on a GPU (2**-11), else the storage dtype's (fp32: 2**-24)."""
    if precision.autocast is not None:
        return torch.finfo(precision.autocast).eps / 2
    if precision.tf32 and device == "cuda":
        return 2.0**-11
    return torch.finfo(precision.storage).eps / 2


@contextmanager
def strict_fp32(on: bool) -> Iterator[None]:
    """--strict-fp32: fp32 matmul and convolution in IEEE fp32 (TF32 off for cuBLAS and
    cuDNN) and scaled-dot-product attention on its math backend; everything put back after.
    Only the per-backend flags the strategies set themselves are touched: torch refuses to
    read the generic float32 matmul precision once legacy and per-backend settings mix."""
    if not on:
        yield
        return
    cuda = torch.backends.cuda
    sdp = ("flash", "mem_efficient", "cudnn")
    saved_sdp = {n: getattr(cuda, f"{n}_sdp_enabled")() for n in sdp if _has_sdp(n)}
    saved = (cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, cuda.math_sdp_enabled())
    cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    cuda.enable_math_sdp(True)
    for name in saved_sdp:
        getattr(cuda, f"enable_{name}_sdp")(False)
    try:
        yield
    finally:
        cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[0], saved[1]
        cuda.enable_math_sdp(saved[2])
        for name, was in saved_sdp.items():
            getattr(cuda, f"enable_{name}_sdp")(was)


def _has_sdp(name: str) -> bool:
    cuda = torch.backends.cuda
    return hasattr(cuda, f"{name}_sdp_enabled") and hasattr(cuda, f"enable_{name}_sdp")
