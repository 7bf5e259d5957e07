"""`predict --calibrate RESULTS`: which measured runs a prediction leaned on, and the
prediction against any measurement of the very configuration it predicts in RESULTS.

Why: `predict --calibrate` once gave 203.7 ms for a 2-rank configuration whose own
measurement in the same file was 12.12 ms, having calibrated on a local run warned at CV 87%,
and said neither. Now the runs it used are named (with their warnings), and a predicted row
whose configuration was measured shows that measurement and, beyond AGREE, a flag.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pandas as pd

from scalelab.predict.calibration import unwarned
from scalelab.predict.frame import predict_one
from scalelab.predict.models import Context
from scalelab.predict.points import Measured
from scalelab.predict.scenario import Scenario

AGREE = 0.10  # a prediction within 10% of a measurement of its own configuration agrees
# Settings beyond the calibration family that make two runs the same configuration.
SAME = ("strategy", "split", "overlap", "nonblocking", "bucket_mb", "grad_compress",
        "engine", "stages", "microbatches", "schedule", "virtual_stages", "dp", "tp",
        "placement")  # fmt: skip


def same_config(a: Scenario, b: Scenario) -> bool:
    return (
        a.family() == b.family()
        and a.ranks == b.ranks
        and a.global_batch == b.global_batch
        and all(getattr(a.cfg, k, None) == getattr(b.cfg, k, None) for k in SAME)
    )


def calibrated_on(ctx: Context, template: Scenario, ranks: Sequence[int]) -> dict[str, str]:
    """Measured run -> what it set, over every rank count's prediction."""
    used: dict[str, str] = {}
    for n in [1, *ranks]:
        pred = predict_one(ctx, template.at(n))
        for source, role in pred.calibration.items():
            used.setdefault(source, role)
    return used


def calibration_notes(used: dict[str, str], warned: dict[str, tuple[str, ...]]) -> list[str]:
    """One note naming every run calibrated on, a warned one with its warning."""
    if not used:
        return ["calibrated on no measured run (compute from the ceilings: a lower bound)"]
    parts = []
    for source, role in sorted(used.items()):
        why = warned.get(source)
        parts.append(f"{source} ({role}" + (f"; WARNED: {why[0]})" if why else ")"))
    return ["calibrated on: " + ", ".join(parts)]


def against_measured(
    table: pd.DataFrame, template: Scenario, points: Sequence[Measured]
) -> tuple[pd.DataFrame, list[str]]:
    """table with `measured_ms` and `flag` columns where RESULTS measured a row's
    configuration (the median of its measurements, unwarned ones where there are any), and a
    note per disagreeing row."""
    measured, flags, notes = [], [], []
    for n, ms in zip(table["ranks"], table["ms"]):
        same = unwarned([p for p in points if same_config(p.scenario, template.at(int(n)))])
        if not same or ms is None or not math.isfinite(ms):
            measured.append(math.nan)
            flags.append("")
            continue
        seconds = sorted(p.seconds for p in same)[len(same) // 2]
        off = ms / (seconds * 1e3) - 1
        measured.append(seconds * 1e3)
        flag = "" if abs(off) <= AGREE else f"disagrees with measured ({off:+.0%})"
        flags.append(flag)
        if flag:
            where = ", ".join(p.source for p in same[:3])
            why = "the model misses what this configuration does; trust the measurement"
            if same[0].warnings:  # every measurement of it warned (unwarned() kept them all)
                why = f"the measurement is itself warned ({same[0].warnings[0]})"
            notes.append(
                f"{n} ranks: predicted {ms:.4g} ms, measured {seconds * 1e3:.4g} ms in {where} "
                f"({off:+.0%}, beyond {AGREE:.0%}): {why}"
            )
    if any(math.isfinite(m) for m in measured):
        table = table.assign(measured_ms=measured, flag=flags)
    return table, notes
