"""Strong and weak scaling from a sweep's records.

Runs are grouped into families (same workload, strategy, mode and config apart from ranks and
batch), and a family into series:

- strong scaling: the global batch (items per iteration, all ranks) is the same for every N.
  Speedup S = T_1 / T_N and efficiency E = T_1 / (N * T_N), T = seconds per iteration.
- weak scaling: the batch per rank is the same for every N, so the work grows with N.
  Efficiency E = T_1 / T_N; speedup (in throughput) S = N * T_1 / T_N.

When the smallest N in a series is N0 > 1, "1" above reads N0 and N reads N / N0. The mode is
read off the sweep (which grouping gives series spanning more than one N, covering more runs;
ties go to strong) unless the caller forces it. Repeats of one point count by their median.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any

import pandas as pd

from scalelab.analysis.frame import (
    distinct,
    experiment_key,
    ok_records,
    per_iteration,
    sibling_labels,
)
from scalelab.analysis.phases import phase_breakdown
from scalelab.errors import UsageError

MODES = ("strong", "weak")
# Keys that vary along a scaling series; everything else defines the family.
SERIES_KEYS = frozenset({"ranks", "batch", "global_batch"})
COLUMNS = [
    "family",
    "series",
    "mode",
    "ranks",
    "global_batch",
    "batch_per_rank",
    "runs",
    "seconds",
    "throughput",
    "ideal_throughput",
    "speedup",
    "efficiency",
]


def families(records: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Family label -> its finished records; labels name the config keys (and node layouts)
    that tell them apart, and are distinct: no family is merged into or dropped for another."""
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for rec in ok_records(records):
        key = experiment_key(rec, SERIES_KEYS) + f"|{rec.get('mode')}"
        groups[key].append(rec)
    # Name each family by the keys that differ from its siblings (same workload and strategy).
    firsts = [g[0] for g in groups.values()]
    names = distinct(sibling_labels(firsts, SERIES_KEYS))
    return dict(zip(names, groups.values()))


def _series_key(rec: dict[str, Any], mode: str) -> float:
    items, _ = per_iteration(rec)
    return round(items if mode == "strong" else items / rec.get("ranks", 1), 6)


def _spanning(records: list[dict[str, Any]], mode: str) -> int:
    """Runs that sit in a series with more than one rank count under this mode."""
    by: dict[float, set[int]] = defaultdict(set)
    for rec in records:
        by[_series_key(rec, mode)].add(rec.get("ranks", 1))
    spans = {k for k, ranks in by.items() if len(ranks) > 1}
    return sum(_series_key(r, mode) in spans for r in records)


def detect_mode(records: list[dict[str, Any]]) -> str:
    """strong when a fixed global batch spans more runs than a fixed batch per rank."""
    records = ok_records(records)
    return "weak" if _spanning(records, "weak") > _spanning(records, "strong") else "strong"


def scaling_table(records: list[dict[str, Any]], mode: str | None = None) -> pd.DataFrame:
    """One row per (family, series, N): median seconds per iteration, throughput, speedup and
    efficiency against the series' smallest N, and the ideal (linear) throughput."""
    if mode is not None and mode not in MODES:
        raise UsageError(f"--mode must be strong or weak, got {mode!r}")
    rows: list[dict[str, Any]] = []
    for fam, recs in families(records).items():
        fam_mode = mode or detect_mode(recs)
        series: dict[float, list[dict[str, Any]]] = defaultdict(list)
        for rec in recs:
            series[_series_key(rec, fam_mode)].append(rec)
        for key in sorted(series):
            rows += _series_rows(fam, fam_mode, key, series[key])
    return pd.DataFrame(rows, columns=COLUMNS)


def _series_rows(
    family: str, mode: str, key: float, recs: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    by_n: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for rec in recs:
        by_n[int(rec.get("ranks", 1))].append(rec)
    points = {n: _point(rs) for n, rs in sorted(by_n.items())}
    n0 = min(points)
    items0, t0 = points[n0]
    name = f"global batch {key:g}" if mode == "strong" else f"batch/rank {key:g}"
    rows = []
    for n, (items, t) in points.items():
        ratio = n / n0
        speedup = t0 / t if mode == "strong" else ratio * t0 / t
        rows.append(
            {
                "family": family,
                "series": name,
                "mode": mode,
                "ranks": n,
                "global_batch": items,
                "batch_per_rank": items / n,
                "runs": len(by_n[n]),
                "seconds": t,
                "throughput": items / t,
                "ideal_throughput": items0 / t0 * ratio,
                "speedup": speedup,
                "efficiency": speedup / ratio,
            }
        )
    return rows


def _point(recs: list[dict[str, Any]]) -> tuple[float, float]:
    """(items, median seconds) per iteration over repeats of one point."""
    per = [per_iteration(r) for r in recs]
    return per[0][0], statistics.median(t for _, t in per)


def scaling_phases(records: list[dict[str, Any]], mode: str | None = None) -> pd.DataFrame:
    """phase_breakdown with each run's family and series: data for stacked bars per N."""
    frames = []
    for fam, recs in families(records).items():
        fam_mode = mode or detect_mode(recs)
        part = phase_breakdown(recs)
        if part.empty:
            continue
        keys = {r.get("id"): _series_key(r, fam_mode) for r in recs}
        prefix = "global batch" if fam_mode == "strong" else "batch/rank"
        part["family"] = fam
        part["series"] = [f"{prefix} {keys[i]:g}" for i in part["id"]]
        frames.append(part)
    if not frames:
        return pd.DataFrame(columns=["family", "series", "ranks", "phase", "seconds"])
    long = pd.concat(frames, ignore_index=True)
    # Repeats of one point: mean per phase (their medians are already per-iteration).
    return long.groupby(["family", "series", "ranks", "phase"], as_index=False, sort=False)[
        "seconds"
    ].mean()
