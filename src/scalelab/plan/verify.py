"""`--verify K`: measure the top K candidates and the plain configuration a user would try
first, and report predicted against measured and the regret of the choice.

The host is shared and noisy, so every candidate runs `repeats` times in rounds: each round
runs every candidate once, in an order rotated by the round's number (a burst of load from
elsewhere falls on different candidates in different rounds). A candidate's `measured`
throughput is the median over its runs. The comparison is paired within rounds, since load
from elsewhere drifts over minutes: in each round every candidate's throughput is divided by
the chosen one's (rank 1) in the same round, and `vs_chosen` is the median of that ratio over
the rounds (`vs_chosen_low` its smallest: below 1 when the choice won some round). The best
measured candidate is the one with the largest `vs_chosen`, and the
regret is how far the choice falls short of it: 1 - 1 / max(vs_chosen) (0 when nothing beat
the choice). `error_pct` compares the predicted throughput with the measured median;
`ratio_error_pct` compares the predicted ratio to the choice with `vs_chosen`, which load
from elsewhere that slows every candidate alike does not move.

A prediction rests on one-rank calibration runs made minutes before verification; on a
shared host the load can change in between (calibration at load 8, verification at load 2:
the prediction 56% low with nothing wrong in the model). So the calibration runs the verified
candidates lean on (`anchors`) are measured again in the same rounds, and plan predicts each
candidate once more from them (`predicted_alongside`, `alongside_error_pct`): the model's own
error, with the load of the moment on both sides. The anchors are not candidates: they take no
part in the regret.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from scalelab.config import RunConfig
from scalelab.plan.calibrate import measure, median_run, rate
from scalelab.plan.rank import OK, label

Measure = Callable[[RunConfig], "dict | str"]


@dataclass
class Verification:
    table: pd.DataFrame  # one row per measured candidate
    chosen: str
    best: str
    regret: float  # 0.02: the choice measured 2% below the best measured
    failures: list[str]
    anchors: list[dict | None] = field(default_factory=list)
    """Per anchor: its run of median throughput (a run record), None when every run failed."""

    def alongside(self, predicted: list[float]) -> None:
        """Add the predictions from the calibration measured alongside (one per row)."""
        self.table["predicted_alongside"] = predicted
        ratio = self.table["predicted_alongside"] / self.table["measured"]
        self.table["alongside_error_pct"] = 100 * (ratio - 1)

    def summary(self) -> str:
        row = self.table.set_index("candidate").loc[self.chosen]
        again = ""
        if "predicted_alongside" in row:
            again = (
                f"; from calibration measured alongside {row['predicted_alongside']:.4g}/s, "
                f"{row['alongside_error_pct']:+.1f}%"
            )
        return (
            f"chosen: {self.chosen}; measured {row['measured']:.4g}/s (predicted "
            f"{row['predicted']:.4g}/s, {row['error_pct']:+.1f}%{again}); best measured: "
            f"{self.best}; regret {100 * self.regret:.1f}%"
        )


def picks(ranked: pd.DataFrame, k: int, plain_cfg: RunConfig) -> pd.DataFrame:
    """The top k runnable rows and the plain configuration's row (when it is runnable and
    not among them), with a `role` column."""
    ok = ranked[ranked["status"] == OK]
    top = ok.head(k).assign(role=["chosen"] + ["top"] * (min(k, len(ok)) - 1))
    plain = ok[ok["candidate"] == label(plain_cfg)]
    if len(plain) and plain.index[0] not in top.index:
        top = pd.concat([top, plain.head(1).assign(role="plain")])
    elif len(plain):
        top.loc[plain.index[0], "role"] += " (plain)"
    return top


def verify(
    chosen: pd.DataFrame,
    repeats: int,
    run: Measure,
    echo: Callable[[str], None] = lambda _: None,
    anchors: list[RunConfig] = (),
) -> Verification:
    """Measure every row of `chosen` (picks()) and every anchor `repeats` times, interleaved;
    `echo` gets one progress line per run. An anchor equal to a candidate is measured once."""
    cfgs = list(chosen["cfg"])
    every = measured(cfgs, anchors)
    records: list[list[dict]] = [[] for _ in every]
    rounds = np.full((repeats, len(every)), np.nan)  # throughput of run (round, config)
    failures: list[str] = []
    for r in range(repeats):
        for i in _rotated(len(every), r):
            out = run(every[i])
            if isinstance(out, dict):
                rounds[r, i] = rate(out)
                records[i].append(out)
            else:
                failures.append(f"{label(every[i])}: {out}")
            echo(f"  round {r + 1}/{repeats}: {label(every[i])}: {rounds[r, i]:.4g}/s")
    v = _verdict(_table(chosen, rounds[:, : len(cfgs)]), failures)
    where = {repr(c): i for i, c in enumerate(every)}
    v.anchors = [median_run(records[where[repr(a)]]) for a in anchors]
    return v


def measured(cfgs: list[RunConfig], anchors: list[RunConfig]) -> list[RunConfig]:
    """What verify() runs each round: the candidates, then each anchor no candidate equals."""
    return cfgs + [a for a in anchors if repr(a) not in {repr(c) for c in cfgs}]


def _rotated(n: int, r: int) -> list[int]:
    return [(i + r) % n for i in range(n)]


def _table(chosen: pd.DataFrame, rounds: np.ndarray) -> pd.DataFrame:
    """rounds: (repeats, candidates) throughputs, NaN where a run failed; column 0 is the
    chosen candidate."""
    with warnings.catch_warnings():  # a candidate whose every run failed: NaN, not a warning
        warnings.simplefilter("ignore", RuntimeWarning)
        table = pd.DataFrame({
            "role": list(chosen["role"]),
            "candidate": list(chosen["candidate"]),
            "predicted": list(chosen["throughput"]),
            "measured": np.nanmedian(rounds, axis=0),
            "low": np.nanmin(rounds, axis=0),
            "high": np.nanmax(rounds, axis=0),
            "runs": np.isfinite(rounds).sum(axis=0),
            "vs_chosen": np.nanmedian(rounds / rounds[:, :1], axis=0),
            "vs_chosen_low": np.nanmin(rounds / rounds[:, :1], axis=0),
        })  # fmt: skip
    table["error_pct"] = 100 * (table["predicted"] / table["measured"] - 1)
    # The same comparison relative to the chosen candidate (load from elsewhere that slows
    # every candidate alike cancels): what the ranking rests on.
    predicted_ratio = table["predicted"] / table["predicted"].iloc[0]
    table["ratio_error_pct"] = 100 * (predicted_ratio / table["vs_chosen"] - 1)
    return table


def _verdict(table: pd.DataFrame, failures: list[str]) -> Verification:
    chosen = table["candidate"].iloc[0]
    paired = table["vs_chosen"]
    if not paired.notna().any():
        return Verification(table, chosen, chosen, math.nan, failures)
    best = table["candidate"][paired.idxmax()]
    regret = max(0.0, 1 - 1 / paired.max())
    return Verification(table, chosen, best, float(regret), failures)


def runner(results: Path, timeout: float | None) -> Measure:
    """Measurements through `scalelab run`, records appended to `results`."""
    return lambda cfg: measure(cfg, results, timeout)
