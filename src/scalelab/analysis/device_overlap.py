"""Per step and rank, where the device's time went: computing, communicating, both at once,
or communication nobody hid, from the device spans a traced record's timeline holds
(instrument/kernel_trace.py: GPU kernels, NCCL kernels as communication).

Times are interval unions on the rank's timeline, never sums over streams: two kernels on
two streams at once count once.

    compute_s   |U compute kernels|            comm_s   |U communication kernels|
    overlap_s   |U compute  ∩  U comm|         exposed_comm_s = comm_s - overlap_s
    busy_s      |U compute  ∪  U comm|         idle_s = step_s - busy_s

step_s is the step's device window (first kernel start to last kernel end). Each collective is
matched across ranks by its occurrence within the step (the n-th communication kernel of
iteration k on every rank); a rank's wait_s is how long after its start the last rank's
started (bounded by the kernel's duration): the time it waited for the slowest. busbw
follows nccl-tests (instrument/collective_bench.BUS_FACTOR) over the kernel's time less its
wait, where the trace gives the collective's bytes.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from scalelab.analysis.waits import intersection, union
from scalelab.instrument.collective_bench import BUS_FACTOR
from scalelab.instrument.kernel_trace import COMM_LANE, LANE

STEP_COLS = ["rank", "iteration", "step_s", "compute_s", "comm_s", "overlap_s",
             "exposed_comm_s", "idle_s", "wait_s", "kernels", "comm_kernels"]  # fmt: skip
NAMES = {"allreduce": "all_reduce", "all_reduce": "all_reduce", "allgather": "all_gather",
         "all_gather": "all_gather", "_allgather_base": "all_gather",
         "reduce_scatter": "reduce_scatter", "_reduce_scatter_base": "reduce_scatter",
         "reducescatter": "reduce_scatter", "broadcast": "broadcast", "all_to_all": "alltoall",
         "alltoall": "alltoall"}  # fmt: skip


def comm_kernels(rec: dict[str, Any]) -> pd.DataFrame:
    """One row per communication kernel: rank, iteration, key (its occurrence in the step),
    name, start_s, dur_s, bytes, collective, group; with wait_s and last_rank matched."""
    rows = []
    for rank, spans in enumerate(rec["timeline"]["ranks"]):
        seen: dict[int, int] = {}
        for name, start, dur, lane, it, args in spans:
            if lane != COMM_LANE:
                continue
            key = seen.get(it, 0)
            seen[it] = key + 1
            rows.append({"rank": rank, "iteration": it, "key": key, "name": name,
                         "start_s": start, "dur_s": dur, "bytes": args.get("bytes"),
                         "collective": args.get("collective"),
                         "group": args.get("group")})  # fmt: skip
    df = pd.DataFrame(rows, columns=["rank", "iteration", "key", "name", "start_s", "dur_s",
                                     "bytes", "collective", "group"])  # fmt: skip
    if df.empty:
        return df.assign(wait_s=[], last_rank=[])
    last = df.groupby(["iteration", "key"])["start_s"].transform("max")
    df["wait_s"] = (last - df["start_s"]).clip(lower=0.0).combine(df["dur_s"], min)
    idx = df.groupby(["iteration", "key"])["start_s"].idxmax()
    lasts = df.loc[idx, ["iteration", "key", "rank"]].rename(columns={"rank": "last_rank"})
    return df.merge(lasts, on=["iteration", "key"], how="left")


def _step_row(rank: int, it: int, spans: list[list[Any]], wait: float) -> dict[str, Any]:
    compute = union([(s, s + d) for _, s, d, lane, *_ in spans if lane == LANE])
    comm = union([(s, s + d) for _, s, d, lane, *_ in spans if lane == COMM_LANE])
    both = union(compute + comm)
    busy = sum(e - s for s, e in both)
    comm_s = sum(e - s for s, e in comm)
    overlap = intersection(compute, comm)
    step = both[-1][1] - both[0][0] if both else 0.0
    return {"rank": rank, "iteration": it, "step_s": step,
            "compute_s": sum(e - s for s, e in compute), "comm_s": comm_s, "overlap_s": overlap,
            "exposed_comm_s": comm_s - overlap, "idle_s": step - busy, "wait_s": wait,
            "kernels": sum(1 for *_, lane, _, _ in spans if lane == LANE),
            "comm_kernels": sum(1 for *_, lane, _, _ in spans if lane == COMM_LANE)}  # fmt: skip


def step_breakdown(rec: dict[str, Any]) -> pd.DataFrame:
    """Per rank and traced step: STEP_COLS (seconds). Empty without device spans."""
    waits = comm_kernels(rec)
    waited = waits.groupby(["rank", "iteration"])["wait_s"].sum() if not waits.empty else {}
    rows = []
    for rank, spans in enumerate(rec["timeline"]["ranks"]):
        device = [s for s in spans if s[3] in (LANE, COMM_LANE)]
        for it in sorted({s[4] for s in device}):
            mine = [s for s in device if s[4] == it]
            rows.append(_step_row(rank, it, mine, float(waited.get((rank, it), 0.0))))
    return pd.DataFrame(rows, columns=STEP_COLS)


def collective_bandwidth(rec: dict[str, Any]) -> pd.DataFrame:
    """Per rank and collective kernel with known bytes: algbw and busbw (bytes/s) over its
    transfer time (duration less the wait for the last rank)."""
    df = comm_kernels(rec)
    cols = ["rank", "iteration", "key", "collective", "bytes", "transfer_s", "algbw_Bps",
            "busbw_Bps"]  # fmt: skip
    if df.empty or df["bytes"].isna().all():
        return pd.DataFrame(columns=cols)
    df = df.dropna(subset=["bytes"]).copy()
    df["transfer_s"] = df["dur_s"] - df["wait_s"]
    df = df[df["transfer_s"] > 0]
    ranks = len(rec["timeline"]["ranks"])
    name = df["collective"].map(lambda c: NAMES.get(str(c).lower().lstrip("_")))
    factor = [BUS_FACTOR[n](int(g) if g == g and g else ranks) if n else float("nan")
              for n, g in zip(name, df["group"])]  # fmt: skip
    df["algbw_Bps"] = df["bytes"] / df["transfer_s"]
    df["busbw_Bps"] = df["algbw_Bps"] * factor
    return df[cols].reset_index(drop=True)


def summary(rec: dict[str, Any]) -> pd.DataFrame:
    """Per rank: the traced steps' medians of STEP_COLS' seconds, and the overlap's share of
    the communication."""
    steps = step_breakdown(rec)
    if steps.empty:
        return steps
    out = steps.groupby("rank", as_index=False).median(numeric_only=True).drop(columns="iteration")
    out["hidden_share"] = (out["overlap_s"] / out["comm_s"]).where(out["comm_s"] > 0)
    return out
