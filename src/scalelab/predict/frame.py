"""Predictions over a list of rank counts as a DataFrame: time per phase, throughput, speedup,
efficiency, and the bottleneck named at each N.

Efficiency follows analysis/scaling.py: strong scaling (fixed global batch) E = T_1 / (N T_N),
weak scaling (fixed batch per rank) E = T_1 / T_N, T_1 the model's own one-rank time.
"""

from __future__ import annotations

import math

import pandas as pd

from scalelab.config import RunConfig
from scalelab.predict.models import Context, model_for
from scalelab.predict.scenario import Prediction, Scenario, build_workload

LABELS = {
    "launch": "per-step fixed cost (kernel launches, host work)",
    "compute": "compute",
    "overhead": "host overhead",
    "ddp_host": "DDP host overhead",
    "dtensor_host": "DTensor host overhead",
    "allreduce": "all-reduce",
    "halo": "halo exchange",
    "scatter": "scatter",
    "gather": "gather",
    "bcast": "broadcast",
    "bubble": "pipeline bubble",
    "p2p": "stage-to-stage sends",
}
HOST = frozenset({"overhead", "ddp_host", "dtensor_host"})
ORDER = list(LABELS)


def bound(pred: Prediction) -> tuple[str, str]:
    """(kind of bound, sentence) from the largest phase: "network-bound: halo exchange 41%"."""
    phase, seconds = max(pred.phases.items(), key=lambda kv: kv[1])
    share = 100 * seconds / pred.seconds if pred.seconds > 0 else 0.0
    if phase in pred.comm_phases:
        kind = "network-bound" if pred.scenario.nodes > 1 else "communication-bound"
    elif phase in HOST:
        kind = "host-bound"
    elif phase == "bubble":
        kind = "bubble-bound"
    elif phase == "launch":
        kind = "launch-bound"
    else:
        kind = "compute-bound"
    where = f" ({pred.where[phase]})" if phase in pred.where else ""
    return kind, f"{kind}: {LABELS.get(phase, phase)} {share:.0f}%{where}"


def predict_one(ctx: Context, scenario: Scenario) -> Prediction:
    model = model_for(scenario.cfg.strategy)
    reason = model.infeasible(scenario)
    if reason is not None:
        return Prediction(scenario, {}, feasible=reason)
    return model.predict(ctx, scenario)


def prediction_table(
    ctx: Context, template: Scenario, ranks: list[int]
) -> tuple[pd.DataFrame, list[str]]:
    """One row per rank count, and the notes (calibration, assumptions) of the predictions."""
    base = predict_one(ctx, template.at(1))
    rows, notes = [], list(base.notes)
    for n in ranks:
        pred = predict_one(ctx, template.at(n))
        rows.append(_row(pred, base))
        notes += [x for x in pred.notes if x not in notes]
    table = pd.DataFrame(rows)
    phases = sorted((c for c in table if c.endswith("_ms") and c != "ms"), key=_phase_rank)
    table[phases] = table[phases].fillna(0.0).where(table["ms"].notna())
    head = ["ranks", "nodes", "rank_batch", "global_batch", "ms", *phases]
    return table[head + [c for c in table if c not in head]], notes


def _phase_rank(col: str) -> int:
    phase = col.removesuffix("_ms")
    return ORDER.index(phase) if phase in ORDER else len(ORDER)


def tokens_per_s(cfg: RunConfig, throughput: float) -> float | None:
    """A token model's tokens per second at `throughput` items per second (None otherwise)."""
    per_item = build_workload(cfg).tokens_per_item
    return throughput * per_item if per_item else None


def _row(pred: Prediction, base: Prediction) -> dict:
    s = pred.scenario
    row = {
        "ranks": s.ranks,
        "nodes": s.nodes,
        "rank_batch": int(s.rank_batch) if float(s.rank_batch).is_integer() else s.rank_batch,
        "global_batch": s.global_batch,
    }
    if pred.feasible is not None:
        return {**row, "ms": math.nan, "bottleneck": f"not runnable: {pred.feasible}"}
    row["ms"] = pred.seconds * 1e3
    row.update({f"{k}_ms": v * 1e3 for k, v in pred.phases.items()})
    row["throughput"] = pred.throughput
    tokens = tokens_per_s(s.cfg, pred.throughput)
    if tokens is not None:
        row["tokens_per_s"] = tokens
    row["speedup"] = pred.throughput / base.throughput if base.feasible is None else math.nan
    t1, tn = base.seconds, pred.seconds
    eff = t1 / (s.ranks * tn) if s.strong else t1 / tn
    row["efficiency"] = eff if base.feasible is None else math.nan  # no one-rank step to scale
    row.update(pred.extra)
    row["bottleneck"] = bound(pred)[1]
    return row


def bottleneck_summary(table: pd.DataFrame) -> str:
    """How the bound changes with N, e.g. "compute-bound up to 32 ranks; network-bound past
    32 ranks: halo exchange 41%" (the share at the largest N of each stretch)."""
    ok = table[~table["bottleneck"].str.startswith("not runnable")]
    if ok.empty:
        return "no runnable rank count"
    sentences, ranks = ok["bottleneck"].tolist(), ok["ranks"].tolist()
    kinds = [b.split(":")[0] for b in sentences]
    starts = [0] + [i for i in range(1, len(kinds)) if kinds[i] != kinds[i - 1]]
    ends = [*starts[1:], len(kinds)]
    if len(starts) == 1:
        return f"{kinds[0]} at every rank count ({sentences[-1]} at {ranks[-1]})"
    parts = [f"{kinds[0]} up to {ranks[ends[0] - 1]} ranks"]
    for a, b in zip(starts[1:], ends[1:]):
        parts.append(sentences[b - 1].replace(":", f" past {ranks[a - 1]} ranks:", 1))
    return "; ".join(parts)
