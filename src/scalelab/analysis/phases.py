"""Per-rank phase tables from records.

Phase names nest with '/': "compute" contains "compute/forward", "compute/backward",
"compute/allreduce". A nested phase is timed inside its parent, so a parent's own ("self")
time is its total minus its direct children; self times of all paths add up to the time spent
inside top-level phases, which is what a stacked bar needs. Time outside every phase (Python
between phases, the barrier before the clock) is booked as "other".
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from scalelab.analysis.frame import label, ok_records, phase_scale

OTHER = "other"
# Phases are timed inside their iteration's wall on the same clock, so they add up to at most
# the wall; this allows for the rounding of a sum of a few perf_counter differences.
PHASE_SLACK_S = 1e-6
ACCOUNTING_COLUMNS = ["rank", "wall_s", "phases_s", "other_s", "covered", "exceeds"]


def self_times(phases: dict[str, float]) -> dict[str, float]:
    """Path -> own seconds (total minus direct children, clipped at 0 against timer noise)."""
    out = {}
    for path, total in phases.items():
        depth = path.count("/") + 1
        children = sum(
            t
            for p, t in phases.items()
            if p.startswith(path + "/") and p.count("/") + 1 == depth + 1
        )
        out[path] = max(total - children, 0.0)
    return out


def rank_phases(rec: dict[str, Any]) -> list[dict[str, float]]:
    """Every rank's phases (falling back to the root's own `phases` when ranks were not kept)."""
    ranks = rec.get("rank_phases")
    if isinstance(ranks, list) and ranks and all(isinstance(p, dict) for p in ranks):
        return ranks
    return [rec.get("phases") or {}]


def rank_walls(rec: dict[str, Any]) -> list[float]:
    """Each rank's wall that its phases lie inside (the record's rank_wall_s; records from
    before it have only rank 0's wall_s, taken for every rank)."""
    n = len(rank_phases(rec))
    walls = rec.get("rank_wall_s")
    if (
        isinstance(walls, list)
        and len(walls) == n
        and all(isinstance(w, (int, float)) for w in walls)
    ):
        return [float(w) for w in walls]
    return [float(rec.get("wall_s") or 0.0)] * n


def top_level(phases: dict[str, float]) -> float:
    return sum(t for p, t in phases.items() if "/" not in p)


def phase_accounting(rec: dict[str, Any]) -> pd.DataFrame:
    """Per rank, per iteration: wall, the top-level phases' sum, other = wall - phases (time
    outside every phase: Python between phases, the barrier), the share the phases cover and
    whether they exceed the wall (by more than PHASE_SLACK_S): an impossible record."""
    scale = phase_scale(rec)
    rows = []
    for rank, (ph, wall) in enumerate(zip(rank_phases(rec), rank_walls(rec))):
        inside = top_level(ph)
        rows.append(
            {
                "rank": rank,
                "wall_s": wall * scale,
                "phases_s": inside * scale,
                "other_s": (wall - inside) * scale,
                "covered": inside / wall if wall > 0 else float("nan"),
                "exceeds": inside > wall + PHASE_SLACK_S,
            }
        )
    return pd.DataFrame(rows, columns=ACCOUNTING_COLUMNS)


def rank_phase_table(rec: dict[str, Any]) -> pd.DataFrame:
    """Rank x phase path, seconds per iteration (per optimizer step when training), then
    OTHER (the rank's wall minus its top-level phases) and "wall".

    Extra rows: "mean", "max" and "imbalance" (max / mean, 1.0 = perfectly balanced), the
    number that says whether one slow rank holds the others at a collective.
    """
    scale = phase_scale(rec)
    rows = [
        {
            **{p: t * scale for p, t in ph.items()},
            OTHER: (w - top_level(ph)) * scale,
            "wall": w * scale,
        }
        for ph, w in zip(rank_phases(rec), rank_walls(rec))
    ]
    table = pd.DataFrame(rows).fillna(0.0)
    table.index = [f"rank {r}" for r in range(len(rows))]
    if table.empty:
        return table
    table = table[sorted(set(table.columns) - {"wall"}, key=phase_order) + ["wall"]]
    if len(rows) > 1:
        mean, peak = table.mean(), table.max()
        table.loc["mean"] = mean
        table.loc["max"] = peak
        table.loc["imbalance"] = (peak / mean.where(mean > 0)).fillna(1.0)
    return table


# Where a phase sits in one iteration, so tables and bars read in execution order.
EXECUTION_ORDER = (
    "h2d",
    "scatter",
    "bcast",
    "halo",
    "compute",
    "forward",
    "backward",
    "allreduce",
    "wait",
    "step",
    "d2h",
    "gather",
    OTHER,
)


def phase_order(path: str) -> tuple:
    """Execution order of the top-level phase, then children right after their parent."""
    parts = path.split("/")
    rank = [EXECUTION_ORDER.index(p) if p in EXECUTION_ORDER else 50 for p in parts]
    return tuple(zip(rank, parts))


def phase_breakdown(records: list[dict[str, Any]]) -> pd.DataFrame:
    """Long form (run, ranks, phase, seconds): self seconds per iteration, mean over ranks.

    One row per phase path per run, plus OTHER = wall - time inside phases, both as means over
    the ranks (each rank against its own wall, rank_wall_s), so a run's bar stacks up to its
    ranks' mean wall and never past it. For the stacked per-phase bars of a scaling study:
    the reader sees which phase grew with N.
    """
    rows = []
    for rec in ok_records(records):
        scale = phase_scale(rec)
        walls = rank_walls(rec)
        iter_s = sum(walls) / len(walls) * scale
        per_rank = [self_times(ph) for ph in rank_phases(rec)]
        paths = sorted({p for ph in per_rank for p in ph}, key=phase_order)
        inside = 0.0
        for path in paths:
            secs = sum(ph.get(path, 0.0) for ph in per_rank) / len(per_rank) * scale
            inside += secs
            rows.append(_row(rec, path, secs))
        rows.append(_row(rec, OTHER, max(iter_s - inside, 0.0)))
    return pd.DataFrame(rows, columns=["id", "run", "ranks", "phase", "seconds"])


def _row(rec: dict[str, Any], phase: str, seconds: float) -> dict[str, Any]:
    return {
        "id": rec.get("id"),
        "run": label(rec),
        "ranks": rec.get("ranks", 1),
        "phase": phase,
        "seconds": seconds,
    }
