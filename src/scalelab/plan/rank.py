"""Every candidate predicted by the calibrated model (scalelab.predict) and ranked.

A candidate is dropped from the ranking, with the reason kept in its row, when `scalelab run`
would refuse it before launching (applies.py: the strategy's or the workload's own line, e.g.
the layer a user's model cannot be cut or split at), when the strategy
model calls it not runnable (more ranks than items, a slab thinner than a halo, ...), when
its estimated bytes per rank exceed --memory-per-device (memory.py), or when the model lacks
a measured figure it needs (the row names the figure and the command that measures it).
The rest are ranked by predicted throughput (items per second over all ranks), calibrated
predictions before uncalibrated roofline bounds (a lower bound on time is not a prediction:
ranked among predictions it would win on optimism). Efficiency is
throughput per core (CPU: ranks x threads) or per GPU, relative to the 1 rank x 1 thread
candidate's.
"""

from __future__ import annotations

import math

import pandas as pd

from scalelab.config import RunConfig
from scalelab.errors import UsageError
from scalelab.plan.applies import refusal
from scalelab.plan.memory import device_bytes
from scalelab.plan.space import PlanSpec
from scalelab.predict.frame import bound, predict_one, tokens_per_s
from scalelab.predict.models import Context
from scalelab.predict.scenario import Prediction, Scenario
from scalelab.strategies import STRATEGIES

# Knobs shown in a candidate's label, in this order (strategy and ranks come first).
KNOBS = ("split", "threads", "batch", "dtype", "amp", "nonblocking", "fast",
         "compile", "bucket_mb", "grad_compress", "engine", "stages", "microbatches",
         "schedule", "virtual_stages", "dp", "tp", "hidden",
         "reshard_after_forward")  # fmt: skip
OK = "ok"


def label(cfg: RunConfig) -> str:
    """`mpi --split spatial --ranks 2 --threads 1`: the `scalelab run` flags of a candidate
    that a plan varies (equal to a default: left out)."""
    default = RunConfig(workload=cfg.workload)
    parts = [cfg.strategy, f"--ranks {cfg.ranks}"]
    for knob in KNOBS:
        value = getattr(cfg, knob)
        if knob == "split" and not STRATEGIES.get(cfg.strategy).takes_split:
            continue
        if knob == "stages" and not STRATEGIES.get(cfg.strategy).pipelined:
            continue
        always = knob == "split" or (knob == "stages" and STRATEGIES.get(cfg.strategy).pipelined)
        if always or (value != getattr(default, knob) and value is not None):
            flag = "--" + knob.replace("_", "-")
            parts.append(flag if value is True else f"{flag} {value}")
    return " ".join(parts)


def scenario(spec: PlanSpec, cfg: RunConfig) -> Scenario:
    return Scenario(cfg, cfg.ranks, spec.per_node)


def predict(ctx: Context, spec: PlanSpec, cfg: RunConfig) -> tuple[Prediction | None, str]:
    """(prediction, status): status "ok", or why the candidate is out."""
    refused = refusal(cfg)
    if refused is not None:
        return None, f"does not apply: {refused}"
    if spec.memory_per_device is not None and device_bytes(cfg) > spec.memory_per_device:
        need, have = device_bytes(cfg) / 2**20, spec.memory_per_device / 2**20
        return None, f"does not fit: {need:.0f} MiB per rank > {have:.0f} MiB"
    try:
        pred = predict_one(ctx, scenario(spec, cfg))
    except UsageError as exc:
        return None, f"not predicted: {exc}"
    if pred.feasible is not None:
        return None, f"not runnable: {pred.feasible}"
    return pred, OK


def basis(pred: Prediction) -> str:
    """Which measurement the prediction's compute leaned on, or that it is a bound."""
    computed = [src for src, what in pred.calibration.items() if what == "compute"]
    if not computed:
        return "bound (uncalibrated roofline)"
    rest = [f"{src} ({what})" for src, what in pred.calibration.items() if what != "compute"]
    return "; ".join([f"calibrated on {computed[0]}", *rest])


def rank(ctx: Context, spec: PlanSpec, cfgs: list[RunConfig]) -> pd.DataFrame:
    """One row per candidate, the runnable ones first (calibrated, then bounds), each group by
    predicted throughput; `rank` is
    1, 2, ... for them and NaN for the rest. `cfg` holds the RunConfig (not written out)."""
    rows = [_row(ctx, spec, cfg) for cfg in cfgs]
    table = pd.DataFrame(rows)
    table["_ok"] = table["status"] == OK
    table["_cal"] = table["basis"].str.startswith("calibrated")
    order = ["_ok", "_cal", "throughput"]
    table = table.sort_values(order, ascending=False, kind="stable")
    table = table.drop(columns=["_ok", "_cal"]).reset_index(drop=True)
    ok = table["status"] == OK
    table.insert(0, "rank", pd.Series(range(1, int(ok.sum()) + 1), dtype="Int64"))
    _efficiency(table)
    return table


def _row(ctx: Context, spec: PlanSpec, cfg: RunConfig) -> dict:
    pred, status = predict(ctx, spec, cfg)
    row = {
        "candidate": label(cfg),
        "strategy": cfg.strategy,
        "ranks": cfg.ranks,
        "threads": cfg.threads,
        "rank_batch": scenario(spec, cfg).rank_batch,
        "ms": math.nan,
        "throughput": math.nan,
        "mem_MiB": device_bytes(cfg) / 2**20,
        "status": status,
        "bottleneck": "",
        "basis": "",
        "cfg": cfg,
    }
    if pred is not None:
        row.update(ms=pred.seconds * 1e3, throughput=pred.throughput)
        tokens = tokens_per_s(cfg, pred.throughput)
        if tokens is not None:
            row["tokens_per_s"] = tokens
        row.update(bottleneck=bound(pred)[1], basis=basis(pred))
    return row


def _efficiency(table: pd.DataFrame) -> None:
    """Throughput per core (or GPU) over the 1 x 1 candidate's, in place."""
    cores = table["ranks"] * table["threads"].fillna(1)
    single = table[(cores == 1) & (table["status"] == OK)]
    per_core = single["throughput"].max() if len(single) else math.nan
    pos = table.columns.get_loc("throughput") + 1
    table.insert(pos, "efficiency", table["throughput"] / (cores * per_core))


def shown(table: pd.DataFrame) -> pd.DataFrame:
    """The table without its RunConfig column (for printing, CSV and JSON)."""
    return table.drop(columns=["cfg"])
