"""Triton kernels for the fast path, imported only when Triton can run them.

Triton runs on a CUDA GPU, or on CPU tensors through its interpreter (`TRITON_INTERPRET=1`,
which must be set before triton is imported: the `@triton.jit` decorator reads it). The
interpreter is how CI checks the kernels' logic on every change.

Two interpreter quirks shape the kernels (Triton 3.6 with NumPy >= 2.4):
- a loop bound that is a runtime integer argument fails (`range(0, n, BLOCK)` calls
  `int()` on a 1-element array), so loop bounds and lengths are `tl.constexpr`;
- `tl.dot` on bf16 operands returns garbage, so kernels take `UPCAST: tl.constexpr`, True
  only when interpreting, and lift the operands to fp32 before the dot;
- fp32 -> bf16 stores truncate (the GPU rounds to nearest even), so interpreted bf16 outputs
  carry about 1.5x the rounding error of torch's; the tests' bf16 bounds allow for it.
"""

from __future__ import annotations

import importlib.util
import os

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# SCALELAB_FAST_DISABLE=all or a comma list of kernel names (block1, conv1d, layernorm, epilogue2d)
# switches kernels off without touching code, e.g. to route around a kernel that fails on a GPU.
DISABLED = {s.strip() for s in os.environ.get("SCALELAB_FAST_DISABLE", "").split(",") if s.strip()}


def triton_unavailable(device_type: str) -> str | None:
    """Why Triton kernels cannot run on this device, or None when they can."""
    if "all" in DISABLED:
        return "Triton kernels disabled by SCALELAB_FAST_DISABLE=all"
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if device_type == "cuda":
        return None
    if INTERPRET:
        return None  # CPU tensors through the interpreter (tests)
    return f"Triton kernels need a CUDA GPU (device {device_type})"


def kernel_enabled(name: str) -> bool:
    return name not in DISABLED
