"""Numeric precisions a run may use, with the tolerance each is checked against.

Relative error is ||out - ref|| / ||ref|| against the float64 NumPy oracle. The tolerances are
chosen from the unit roundoff of each format times the error growth we measured on the deepest
workload (AlexNet, ~10 layers): fp32 (u = 6e-8) lands near 1e-6, so 1e-5 leaves a decade of
margin; tf32 and fp16 keep a 10/11-bit mantissa (u ~ 5e-4), bf16 an 8-bit one (u ~ 4e-3).
"""

from __future__ import annotations

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
