"""Datasheet peaks of common accelerators, each row citing the vendor document it comes from.

These are what the vendor promises, for comparison with what `scalelab ceilings` measures;
nothing in scalelab computes with them unless a user asks (roofline against datasheet peaks).
Conventions, so rows compare:
- TFLOP/s are dense. NVIDIA datasheets print tensor-core figures "with sparsity" (2:4
  structured) from Ampere on; those are halved here. `fp64` is the best FP64 GEMM rate (the
  FP64 tensor-core / matrix figure where one exists), `fp64_vector` the plain FP64 rate.
  `fp32` is non-tensor FP32 (torch's fp32 matmul with TF32 off); `tf32` the TF32 tensor rate.
- None means the datasheet gives no figure or the format has no hardware path (V100 has no
  BF16/TF32 tensor cores).
- `mem_Bps` is peak device-memory bandwidth (bytes/s). `nvlink_bidir_Bps` and
  `pcie_bidir_Bps` are the datasheets' interconnect figures, both directions together: one
  direction (what h2d/d2h or a one-way send can reach) is half.
- AMD MI250X is one OAM board with two dies (GCDs); torch sees each GCD as one device, so a
  per-device comparison halves the board figures.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

T, G = 1e12, 1e9


@dataclass(frozen=True)
class Peak:
    name: str
    match: str  # regex over torch.cuda.get_device_name()
    fp64: float | None
    fp64_vector: float | None
    fp32: float | None
    tf32: float | None
    bf16: float | None
    fp16: float | None
    mem_Bps: float
    nvlink_bidir_Bps: float | None
    pcie_bidir_Bps: float
    source: str

    def flops(self, dtype: str) -> float | None:
        return getattr(self, dtype)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_H100 = "NVIDIA H100 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/h100/"
_H200 = "NVIDIA H200 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/h200/"
_A100 = (
    "NVIDIA A100 Tensor Core GPU datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4), "
    "https://www.nvidia.com/en-us/data-center/a100/"
)
_V100 = "NVIDIA Tesla V100 GPU datasheet, https://www.nvidia.com/en-us/data-center/v100/"
_L40S = "NVIDIA L40S datasheet, https://www.nvidia.com/en-us/data-center/l40s/"
_MI250X = (
    "AMD Instinct MI250X accelerator specifications, "
    "https://www.amd.com/en/products/accelerators/instinct/mi200/mi250x.html"
)
_MI300X = (
    "AMD Instinct MI300X accelerator data sheet, "
    "https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html"
)

# Order matters: the first row whose pattern matches wins (PCIe/NVL before the SXM default).
PEAKS: tuple[Peak, ...] = (
    Peak("H100 PCIe", r"H100.*PCIe", 51 * T, 26 * T, 51 * T, 378 * T, 756 * T, 756 * T,
         2.0e12, 600 * G, 128 * G, _H100),
    Peak("H100 NVL", r"H100.*NVL", 60 * T, 30 * T, 60 * T, 417.5 * T, 835.5 * T, 835.5 * T,
         3.9e12, 600 * G, 128 * G, _H100),
    Peak("H100 SXM5", r"H100", 67 * T, 34 * T, 67 * T, 494.5 * T, 989.5 * T, 989.5 * T,
         3.35e12, 900 * G, 128 * G, _H100),
    Peak("H200 NVL", r"H200.*NVL", 60 * T, 30 * T, 60 * T, 417.5 * T, 835.5 * T, 835.5 * T,
         4.8e12, 900 * G, 128 * G, _H200),
    Peak("H200 SXM", r"H200", 67 * T, 34 * T, 67 * T, 494.5 * T, 989.5 * T, 989.5 * T,
         4.8e12, 900 * G, 128 * G, _H200),
    Peak("A100 PCIe 80GB", r"A100.*80GB.*PCIe|A100.*PCIe.*80GB", 19.5 * T, 9.7 * T, 19.5 * T,
         156 * T, 312 * T, 312 * T, 1.935e12, 600 * G, 64 * G, _A100),
    Peak("A100 PCIe 40GB", r"A100.*PCIe", 19.5 * T, 9.7 * T, 19.5 * T, 156 * T, 312 * T,
         312 * T, 1.555e12, 600 * G, 64 * G, _A100),
    Peak("A100 SXM4 80GB", r"A100.*80GB", 19.5 * T, 9.7 * T, 19.5 * T, 156 * T, 312 * T,
         312 * T, 2.039e12, 600 * G, 64 * G, _A100),
    Peak("A100 SXM4 40GB", r"A100", 19.5 * T, 9.7 * T, 19.5 * T, 156 * T, 312 * T, 312 * T,
         1.555e12, 600 * G, 64 * G, _A100),
    Peak("V100 PCIe", r"V100.*PCIE", 7 * T, 7 * T, 14 * T, None, None, 112 * T,
         900 * G, None, 32 * G, _V100),
    Peak("V100 SXM2", r"V100", 7.8 * T, 7.8 * T, 15.7 * T, None, None, 125 * T,
         900 * G, 300 * G, 32 * G, _V100),
    Peak("L40S", r"L40S", None, None, 91.6 * T, 183 * T, 362.05 * T, 362.05 * T,
         864 * G, None, 64 * G, _L40S),
    Peak("MI250X (board, 2 GCDs)", r"MI250X", 95.7 * T, 47.9 * T, 47.9 * T, None, 383 * T,
         383 * T, 3.2768e12, 800 * G, 64 * G, _MI250X),
    Peak("MI300X", r"MI300X", 163.4 * T, 81.7 * T, 163.4 * T, 653.7 * T, 1307.4 * T,
         1307.4 * T, 5.3e12, 896 * G, 128 * G, _MI300X),
)  # fmt: skip


def datasheet_peak(gpu_name: str | None) -> Peak | None:
    """The row for a device name as torch reports it ("NVIDIA H100 80GB HBM3"), or None."""
    if not gpu_name:
        return None
    for row in PEAKS:
        if re.search(row.match, gpu_name, flags=re.IGNORECASE):
            return row
    return None


def mfu(
    per_token: float, tokens_per_device: float, dtype: str, measured: tuple[float | None, str],
    gpu_name: str | None,
) -> dict[str, Any]:  # fmt: skip
    """Model FLOPs utilisation against two peaks, each named: `measured` (a GEMM rate this
    host measured, with where it comes from, or None with why there is none) and, where
    gpu_name has a row, the datasheet's. per_token: FLOPs a token (x3 when training)."""
    peak, source = measured
    rate = per_token * tokens_per_device
    out: dict[str, Any] = {"flops_per_token": per_token, "dtype": dtype}
    out["measured"] = rate / peak if peak else None
    out["measured_peak"] = {"flops": peak, "source": source} if peak else {"missing": source}
    sheet = datasheet_peak(gpu_name)
    if sheet is not None and sheet.flops(dtype):
        out["datasheet"] = rate / sheet.flops(dtype)
        named = f"{sheet.name}: {sheet.source}"
        out["datasheet_peak"] = {"flops": sheet.flops(dtype), "source": named}
    return out
