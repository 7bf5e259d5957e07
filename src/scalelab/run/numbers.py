"""The summary lines that say how far a run's numbers can be trusted: the spread of its
repetitions, which iteration and rank its phases come from (and what they leave as "other"),
training's steady rate and where it starts, and the run's warnings. Kept apart from the rest
of the run summary (runner.format_summary) so each part reads on its own."""

from __future__ import annotations

from typing import Any

from scalelab.instrument.stats import spread_text
from scalelab.instrument.threads import summary_line
from scalelab.train.headline import describe_start


def numbers_lines(rec: dict[str, Any]) -> list[str]:
    lines = []
    spread = rec.get("wall_spread_s") or {}
    if "iqr" in spread:
        what = "per epoch" if rec.get("mode") == "train" else "per iteration"
        lines.append(f"  spread {what}: {spread_text(spread)}")
    lines.append(phases_line(rec))
    if "steady_throughput" in rec:
        unit = rec.get("item_unit", "items")
        lines.append(
            f"  steady {rec['steady_throughput']:.1f} {unit}/s "
            f"({describe_start(rec.get('steady') or {})}) | time to train "
            f"{rec['time_to_train_s']:.3f} s (evaluation excluded)"
        )
    threads = summary_line(rec)  # how many torch threads, and who chose them
    if threads is not None:
        lines.append(threads)
    for warning in rec.get("warnings") or []:
        lines.append(f"  WARNING: {warning}")
    return lines


def phases_line(rec: dict[str, Any]) -> str:
    """What the phases line above is (statistic, rank) and the share they leave as other."""
    top = sum(v for k, v in (rec.get("phases") or {}).items() if "/" not in k)
    walls = rec.get("rank_wall_s") or []
    wall = walls[0] if walls and walls[0] else rec.get("wall_s", 0.0)
    other = wall - top
    share = top / wall if wall else 0.0
    stat = rec.get("phases_statistic", "medians per phase")
    return (
        f"  phases are {stat}: they cover {share:.1%} of rank 0's wall "
        f"{wall * 1e3:.2f} ms, other {other * 1e3:.2f} ms"
    )
