"""The statistics every reported time carries: repetitions, median, quartiles, IQR and the
coefficient of variation (Google Benchmark's aggregates; torch.utils.benchmark's Measurement).

A time is reported as the median of its repetitions; its spread as the IQR (robust to the odd
descheduled repetition) and the CV = stdev / mean (what pyperf and Google Benchmark flag):
a CV over SPREAD_CV sets a warning on the run (instrument/host_checks.py).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

# pyperf calls a benchmark unstable when stdev / mean exceeds 10%.
SPREAD_CV = 0.10


def quartiles(values: Sequence[float]) -> tuple[float, float, float]:
    """(Q1, median, Q3), linear interpolation between order statistics (NumPy's default)."""
    xs = sorted(values)
    n = len(xs)

    def at(q: float) -> float:
        pos = q * (n - 1)
        lo = int(pos)
        hi = min(lo + 1, n - 1)
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

    return at(0.25), at(0.5), at(0.75)


def describe(values: Sequence[float]) -> dict[str, float]:
    """n, median, q1, q3, iqr, mean, stdev (population), cv, min, max of repeated times."""
    if not values:
        return {"n": 0}
    q1, med, q3 = quartiles(values)
    mean = statistics.fmean(values)
    stdev = statistics.pstdev(values) if len(values) > 1 else 0.0
    return {
        "n": len(values),
        "median": med,
        "q1": q1,
        "q3": q3,
        "iqr": q3 - q1,
        "mean": mean,
        "stdev": stdev,
        "cv": stdev / mean if mean > 0 else 0.0,
        "min": min(values),
        "max": max(values),
    }


def spread_text(stats: dict[str, Any], scale: float = 1e3, unit: str = "ms") -> str:
    """'IQR 0.41 ms, CV 3.2%, n 10 (min 11.9, max 13.2)' for a terminal or a table cell."""
    if not stats or stats.get("n", 0) == 0:
        return "no repetitions"
    if stats["n"] == 1:  # no spread to show (a CV of 0.0% would claim a perfect repeat)
        return f"one repetition: no spread ({stats['min'] * scale:.2f} {unit})"
    return (
        f"IQR {stats['iqr'] * scale:.2f} {unit}, CV {stats['cv']:.1%}, n {stats['n']} "
        f"(min {stats['min'] * scale:.2f}, max {stats['max'] * scale:.2f})"
    )
