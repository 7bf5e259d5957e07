"""Compare a run's output with the float64 oracle: relative error and a tolerant digest."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

FNV_OFFSET = 0xCBF29CE484222325
FNV_PRIME = 0x100000001B3
MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class CheckResult:
    relerr: float  # ||out - ref|| / ||ref||
    tolerance: float
    digest: str  # 16 hex digits
    reference_digest: str

    @property
    def passed(self) -> bool:
        return self.relerr <= self.tolerance


def relative_error(out: np.ndarray, ref: np.ndarray) -> float:
    if out.shape != ref.shape:
        raise ValueError(f"output shape {out.shape} != reference shape {ref.shape}")
    out64, ref64 = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    denom = np.linalg.norm(ref64)
    diff = np.linalg.norm(out64 - ref64)
    return float(diff / denom) if denom > 0 else float(diff)


def fnv1a64(data: bytes) -> int:
    h = FNV_OFFSET
    for byte in data:
        h = ((h ^ byte) * FNV_PRIME) & MASK64
    return h


def digest(out: np.ndarray, tolerance: float) -> str:
    """64-bit FNV-1a over a summary of the output that results equal within tolerance share.

    Hashing every rounded element cannot work: with thousands of elements, some value always
    sits within rounding error of a grid boundary. So the digest covers, per item (row), the
    arg-max class and the row's L2 norm in scientific notation with d decimals, d chosen so the
    rounding step (10**-d relative) is about a hundred times the dtype's tolerance: two results
    within tolerance then differ only when a norm lies within ~1% of a step of a boundary, or a
    row's two largest values are within tolerance of each other (relerr stays the verdict).
    """
    rows = np.asarray(out, np.float64).reshape(out.shape[0], -1)
    digits = max(1, int(math.floor(-math.log10(tolerance))) - 2)
    norms = np.linalg.norm(rows, axis=1)
    parts = [f"{int(a)}:{n:.{digits}e}" for a, n in zip(rows.argmax(axis=1), norms)]
    return f"{fnv1a64(';'.join(parts).encode()):016x}"


def check_output(
    out: np.ndarray, ref: np.ndarray, tolerance: float, digest_tolerance: float | None = None
) -> CheckResult:
    """relerr against tolerance; digests on the grid of digest_tolerance (default: tolerance)."""
    grid = tolerance if digest_tolerance is None else digest_tolerance
    return CheckResult(relative_error(out, ref), tolerance, digest(out, grid), digest(ref, grid))
