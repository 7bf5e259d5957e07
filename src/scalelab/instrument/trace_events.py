"""Records' span timelines -> one Chrome trace-event file (Perfetto, chrome://tracing, HTA).

A record's `timeline` (written with --timeline or --trace, instrument/spans.py) holds every
rank's spans on the root's clock:

    {"origin_s": root perf_counter at 0, "offsets_s": [per rank], "rtt_s": [per rank],
     "dropped": [per rank], "ranks": [[[name, start_s, dur_s, lane, iteration, args], ...]]}

The trace has one process per rank (per run when several records are merged) and one thread
per lane: `phases` (the phase stack, nested slices), `comm` (work beside it: DDP's bucket
all-reduces) and, for a run traced with --trace, the device's kernels and its communication
kernels (instrument/kernel_trace.py places them on the same clock). Communication slices
carry bytes, peers and the collective in `args`; pipeline micro-batch slices are named
F<m>/B<m>. Format: the Trace Event Format's complete events
("ph": "X", ts/dur in microseconds) and metadata events ("ph": "M") naming processes/threads.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from scalelab.errors import UsageError

# Phase names that move data between ranks (leaf of a phase path); the rest is local work.
COMM_PHASES = frozenset(
    {
        "halo",
        "allreduce",
        "scatter",
        "gather",
        "bcast",
        "send",
        "recv",
        "mpi",
        "wait",
        "all_gather",
        "reduce_scatter",
        "alltoall",
        "broadcast",
    }  # fmt: skip
)
# main: the phase stack; comm: work beside it (DDP's buckets); device and device-comm: the
# profiler trace's kernels (instrument/kernel_trace.py), communication kernels apart.
LANES = ("main", "comm", "device", "device-comm")
LANE_NAMES = {
    "main": "phases",
    "comm": "comm (beside the phases)",
    "device": "device: kernels, copies",
    "device-comm": "device: communication kernels",
}
RANKS_PER_RUN = 1000  # pid = run index * RANKS_PER_RUN + rank


def make_timeline(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """The record field from every rank's `{offset_s, rtt_s, dropped, spans}` (absolute
    root-clock starts): starts shifted to the earliest span of the run."""
    starts = [s[1] for r in ranks for s in r["spans"]]
    origin = min(starts) if starts else 0.0
    return {
        "origin_s": origin,
        "offsets_s": [r["offset_s"] for r in ranks],
        "rtt_s": [r["rtt_s"] for r in ranks],
        "dropped": [r["dropped"] for r in ranks],
        "ranks": [
            [[n, round(s - origin, 7), d, lane, it, args] for n, s, d, lane, it, args in r["spans"]]
            for r in ranks
        ],
    }


def leaf(path: str) -> str:
    return path.rsplit("/", 1)[-1]


def is_comm(path: str) -> bool:
    return leaf(path) in COMM_PHASES


def slice_name(path: str, args: dict[str, Any]) -> str:
    """What the slice shows: the phase's own name; a pipeline micro-batch as F<m>/B<m>."""
    name = leaf(path)
    if "mb" in args and name in ("forward", "backward"):
        return f"{name[0].upper()}{args['mb']}"
    return name


def timeline_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records that carry a timeline; one line when none does."""
    out = [r for r in records if r.get("timeline")]
    if not out:
        raise UsageError(
            "no record carries a timeline: run with --timeline (or --trace DIR) to record one"
        )
    return out


def trace_events(records: list[dict[str, Any]]) -> dict[str, Any]:
    """One Chrome trace (JSON object format) for the records' timelines, merged."""
    events: list[dict[str, Any]] = []
    for i, rec in enumerate(timeline_records(records)):
        tl = rec["timeline"]
        for rank, spans in enumerate(tl["ranks"]):
            pid = i * RANKS_PER_RUN + rank
            events += _metadata(rec, pid, rank, tl)
            events += [_slice(span, pid, rank) for span in spans]
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "generator": "scalelab timeline",
            "runs": [_run_label(r) for r in timeline_records(records)],
        },
    }


def _run_label(rec: dict[str, Any]) -> str:
    parts = [rec.get("workload"), rec.get("strategy"), rec.get("id")]
    return " ".join(str(p) for p in parts if p)


def _metadata(rec: dict[str, Any], pid: int, rank: int, tl: dict[str, Any]) -> list[dict]:
    label = f"rank {rank} | {_run_label(rec)}"
    meta = [
        {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": label}},
        {
            "name": "process_sort_index",
            "ph": "M",
            "pid": pid,
            "tid": 0,
            "args": {"sort_index": pid},
        },
    ]
    for tid, lane in enumerate(LANES):
        meta.append(
            {
                "name": "thread_name",
                "ph": "M",
                "pid": pid,
                "tid": tid,
                "args": {"name": LANE_NAMES[lane]},
            }  # fmt: skip
        )
    return meta


def _slice(span: list[Any], pid: int, rank: int) -> dict[str, Any]:
    path, start, dur, lane, iteration, args = span
    comm = is_comm(path) or lane in ("comm", "device-comm")
    return {
        "name": slice_name(path, args),
        "cat": "comm" if comm else "compute",
        "ph": "X",
        "ts": round(start * 1e6, 3),  # microseconds
        "dur": round(dur * 1e6, 3),
        "pid": pid,
        "tid": LANES.index(lane) if lane in LANES else len(LANES),
        "args": {"path": path, "iteration": iteration, "rank": rank, **args},
    }


def write_trace(records: list[dict[str, Any]], path: str | Path) -> Path:
    trace = trace_events(records)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(trace))
    return path
