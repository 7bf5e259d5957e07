"""The report's pieces for where the time went across ranks: runs.csv with the phases
flattened, and the section
"Waiting vs working": per run with a timeline, each rank's compute, transfer and wait as a
stacked bar, with the straggler and comm/compute overlap (analysis/waits.py)."""

from __future__ import annotations

from typing import Any

import pandas as pd

from scalelab.analysis import html
from scalelab.analysis.waits import rank_breakdown, run_summary

MAX_RUNS = 6  # the latest runs with a timeline get a bar chart


def with_phases(df: pd.DataFrame, records: list[dict[str, Any]]) -> pd.DataFrame:
    """records_frame's rows plus one `phase.<path>` column per phase (the record's `phases`
    seconds: median iteration, or the whole run for training) and `rank<r>.<path>` for every
    rank's."""
    flat = []
    for rec in records:
        row = {f"phase.{k}": v for k, v in (rec.get("phases") or {}).items()}
        for r, ph in enumerate(rec.get("rank_phases") or []):
            row.update({f"rank{r}.{k}": v for k, v in (ph or {}).items()})
        flat.append(row)
    extra = pd.DataFrame(flat, index=df.index)
    return pd.concat([df, extra[sorted(extra.columns)]], axis=1)


def waits_section(records: list[dict[str, Any]], page: Any) -> tuple[str, str, str]:
    # one rank has nothing to wait for: its bar would be all compute
    runs = [r for r in records if r.get("timeline") and int(r.get("ranks", 1)) > 1][-MAX_RUNS:]
    if not runs:
        note = "No multi-rank run carries a timeline (run with --timeline or --trace)."
        return "waits", "Waiting vs working", html.note(note)
    parts = [
        html.note(
            "Per rank, ms per timed iteration: local phases (compute), and communication split "
            "into transfer and waiting for the last peer to arrive (unmatched: point-to-point "
            "receives with no peer's arrival to compare). `scalelab phases` gives the table."
        )
    ]
    for rec in runs:
        title = f"{rec.get('workload')} {rec.get('strategy')} x{rec.get('ranks')} ({rec.get('id')})"
        summary = run_summary(rec)
        who = summary["straggler"]
        overlap = ", ".join("-" if f is None else f"{f:.0%}" for f in summary["overlap_fraction"])
        parts.append(f"<h3>{html.esc(title)}</h3>")
        parts.append(html.note(
            f"straggler: {'none' if who is None else f'rank {who}'}; comm/compute overlap per "
            f"rank: {overlap}"
        ))  # fmt: skip
        bars = rank_breakdown(rec)
        ms = bars.pivot(index="rank", columns="part", values="seconds") * 1e3
        ms.index = ms.index.map(str)
        parts.append(
            html.table(ms.reset_index(), {c: ".3f" for c in ms.columns}, text_cols={"rank"})
        )
        parts.append(page.figure("wait_bars", "Compute, transfer and wait per rank.",
                                 bars, title))  # fmt: skip
    return "waits", "Waiting vs working", "\n".join(parts)
