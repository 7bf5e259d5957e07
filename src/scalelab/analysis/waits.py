"""Where communication time went: waiting for the slowest peer, or moving bytes.

From a record's timeline (instrument/trace_events.py), every communication span is matched with the
same operation on the other ranks: same iteration, same phase path (or DDP bucket), same
occurrence within the iteration. Ranks meet there, so for rank r

    wait_r     = min(last arrival - arrival_r, duration_r)   (arrival: the span's start)
    transfer_r = duration_r - wait_r

and the last-arriving rank is the one r waited for. Per run: the straggler is the rank the
others waited for longest in total; a rank's comm/compute overlap is the share of its
communication time during which it also computed (DDP's buckets beside backward).
"""

from __future__ import annotations

from bisect import bisect_left
from collections import defaultdict
from typing import Any

import pandas as pd

from scalelab.instrument.trace_events import is_comm


def _first_iteration(rec: dict[str, Any]) -> int:
    """Inference: the warm-up iterations come first and are not timed; training: all steps."""
    cfg = rec.get("config") or {}
    return int(cfg.get("warmup", 0)) if rec.get("mode") == "infer" else 0


def comm_spans(rec: dict[str, Any]) -> pd.DataFrame:
    """One row per communication span of the timed iterations: rank, iteration, op (phase
    path), key (its occurrence), start_s, dur_s, bytes."""
    first = _first_iteration(rec)
    rows = []
    for rank, spans in enumerate(rec["timeline"]["ranks"]):
        seen: dict[tuple[int, str, str], int] = defaultdict(int)
        for path, start, dur, lane, it, args in spans:
            if it < first or not (is_comm(path) or lane == "comm"):
                continue
            k = args.get("bucket", args.get("mb"))
            if k is None:
                k = seen[(it, path, lane)]
                seen[(it, path, lane)] += 1
            rows.append(
                {
                    "rank": rank,
                    "iteration": it,
                    "op": args.get("op", path),
                    "lane": lane,
                    "key": k,
                    "start_s": start,
                    "dur_s": dur,
                    "bytes": int(args.get("bytes", 0)),
                }
            )
    cols = ["rank", "iteration", "op", "lane", "key", "start_s", "dur_s", "bytes"]
    return pd.DataFrame(rows, columns=cols)


KEYS = ["iteration", "op", "lane", "key"]  # one operation, met by every rank taking part


def attribute(rec: dict[str, Any]) -> pd.DataFrame:
    """comm_spans with wait_s, transfer_s, peers (ranks met) and last_rank (who arrived
    last at that operation)."""
    df = comm_spans(rec)
    if df.empty:
        return df.assign(last_rank=[], peers=[], matched=[], wait_s=[], transfer_s=[])
    group = df.groupby(KEYS)["start_s"]
    last = df.loc[group.idxmax(), [*KEYS, "rank", "start_s"]]
    last = last.rename(columns={"rank": "last_rank", "start_s": "last_start_s"})
    df = df.merge(last, on=KEYS, how="left")
    df["peers"] = df.groupby(KEYS)["rank"].transform("size")
    wait = (df["last_start_s"] - df["start_s"]).clip(lower=0.0)
    # An operation only one rank logged (a point-to-point receive) has no arrival to
    # compare with: neither wait nor transfer is known, it stays unmatched.
    df["matched"] = df["peers"] > 1
    df["wait_s"] = wait.where(wait < df["dur_s"], df["dur_s"]).where(df["matched"], 0.0)
    df["transfer_s"] = (df["dur_s"] - df["wait_s"]).where(df["matched"], 0.0)
    return df.drop(columns="last_start_s")


TABLE = ["rank", "op", "calls", "time_s", "wait_s", "transfer_s", "unmatched_s", "bytes"]


def wait_table(rec: dict[str, Any]) -> pd.DataFrame:
    """Per rank and operation: calls, time, wait, transfer, unmatched (seconds over the timed
    iterations), bytes, and waited_for: the rank it waited for longest."""
    df = attribute(rec)
    if df.empty:
        return pd.DataFrame(columns=[*TABLE, "waited_for"])
    df["unmatched_s"] = df["dur_s"].where(~df["matched"], 0.0)
    out = df.groupby(["rank", "op"], as_index=False).agg(
        calls=("dur_s", "size"),
        time_s=("dur_s", "sum"),
        wait_s=("wait_s", "sum"),
        transfer_s=("transfer_s", "sum"),
        unmatched_s=("unmatched_s", "sum"),
        bytes=("bytes", "sum"),
    )
    owed = df[df["wait_s"] > 0].groupby(["rank", "op", "last_rank"])["wait_s"].sum()
    most = {key[:2]: key[2] for key in owed.sort_values().index}  # the largest one wins
    waited = [most.get((r, o)) for r, o in zip(out["rank"], out["op"])]
    out["waited_for"] = pd.array(waited, dtype="Int64")
    return out


def blame(rec: dict[str, Any]) -> dict[int, float]:
    """Seconds the other ranks spent waiting for each rank (as the last to arrive)."""
    df = attribute(rec)
    ranks = range(len(rec["timeline"]["ranks"]))
    if df.empty:
        return {r: 0.0 for r in ranks}
    got = df.groupby("last_rank")["wait_s"].sum()
    return {r: float(got.get(r, 0.0)) for r in ranks}


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def intersection(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of the overlap of two unions of disjoint sorted intervals."""
    total, ends = 0.0, [e for _, e in b]
    for s, e in a:
        i = bisect_left(ends, s)
        while i < len(b) and b[i][0] < e:
            total += max(0.0, min(e, b[i][1]) - max(s, b[i][0]))
            i += 1
    return total


def _computing(s: float, e: float, beside: list[float]) -> tuple[float, float]:
    """A compute phase's computing part. Work handed to the comm lane inside it (DDP's
    buckets) is handed over as the computation produces it, so the phase computes until its
    last hand-over and then waits for the lane (DDP's backward waits for its all-reduces)."""
    handed = [t for t in beside if s <= t < e]
    return (s, max(handed)) if handed else (s, e)


def overlap(spans: list[list[Any]], first: int = 0) -> tuple[float, float]:
    """(communication seconds, of which overlapped by compute) for one rank's spans.
    Compute: non-communication phases that do not themselves contain communication on the
    phase lane, each cut at its last hand-over to the comm lane (_computing)."""
    timed = [sp for sp in spans if sp[4] >= first]
    comm = union([(s, s + d) for p, s, d, lane, *_ in timed if is_comm(p) or lane == "comm"])
    main_comm = union([(s, s + d) for p, s, d, lane, *_ in timed if lane == "main" and is_comm(p)])
    beside = [s for _, s, _, lane, *_ in timed if lane == "comm"]
    compute = [
        _computing(s, s + d, beside)
        for p, s, d, lane, *_ in timed
        if lane == "main" and not is_comm(p) and intersection([(s, s + d)], main_comm) == 0.0
    ]
    busy = sum(e - s for s, e in comm)
    return busy, intersection(comm, union(compute))


def run_summary(rec: dict[str, Any]) -> dict[str, Any]:
    """The straggler (None when nobody waited), the blame per rank and each rank's
    comm/compute overlap fraction (None without communication)."""
    owed = blame(rec)
    first = _first_iteration(rec)
    fractions = []
    for spans in rec["timeline"]["ranks"]:
        busy, hidden = overlap(spans, first)
        fractions.append(hidden / busy if busy > 0 else None)
    straggler = max(owed, key=owed.get) if any(v > 0 for v in owed.values()) else None
    return {"straggler": straggler, "blame_s": owed, "overlap_fraction": fractions}


PARTS = ("compute", "transfer", "wait", "unmatched")


def rank_breakdown(rec: dict[str, Any]) -> pd.DataFrame:
    """Seconds per timed iteration of each rank's top-level phases, split into compute (local
    phases), transfer, wait and unmatched (communication phases): rows (rank, part, seconds).
    The comm lane (DDP's buckets, beside backward) is not stacked: it overlaps compute."""
    first = _first_iteration(rec)
    df = attribute(rec)
    top = df[(df["lane"] == "main") & ~df["op"].str.contains("/")] if not df.empty else df
    rows = []
    for rank, spans in enumerate(rec["timeline"]["ranks"]):
        timed = [sp for sp in spans if sp[4] >= first and sp[3] == "main" and "/" not in sp[0]]
        iters = max(len({sp[4] for sp in timed}), 1)
        mine = top[top["rank"] == rank] if not top.empty else top
        unmatched = float(mine["dur_s"].where(~mine["matched"], 0.0).sum()) if len(mine) else 0.0
        parts = {
            "compute": sum(sp[2] for sp in timed if not is_comm(sp[0])),
            "transfer": float(mine["transfer_s"].sum()) if len(mine) else 0.0,
            "wait": float(mine["wait_s"].sum()) if len(mine) else 0.0,
            "unmatched": unmatched,
        }
        rows += [{"rank": rank, "part": p, "seconds": parts[p] / iters} for p in PARTS]
    return pd.DataFrame(rows, columns=["rank", "part", "seconds"])
