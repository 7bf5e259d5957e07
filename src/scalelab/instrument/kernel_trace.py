"""A rank's profiler trace (`--trace DIR`, instrument/profiler.py) placed on the record's
timeline: its device work (GPU kernels, memcpys, memsets; NCCL kernels as communication)
becomes spans of two more lanes, `device` and `device-comm`, on the root's clock.

The profiler's clock is not the span log's: kineto stamps events in microseconds from a base
of its own. Both logs hold the same labels, though: every `PhaseTimer.phase` is a
`record_function` of the same path in the trace and a span in the timeline, and the
profiler's `ProfilerStep#k` and the spans' iteration k count the same `notify_step` calls. So
each (phase path, iteration) found in both gives one clock offset (span start - annotation
start), and the median over all of them places the trace: on 2 CPU ranks the offsets of one
trace agree within ~0.1 ms (a phase's host entry costs the difference).

A run without device events (CPU ranks over gloo) is still placed: its host-side
communication (`gloo:`/`nccl:` annotations, `c10d::` operators) becomes `device-comm` spans and
its top-level `aten::` operators `device` spans, so the same analysis runs in CI.

Span rows are the timeline's: [name, start_s, dur_s, lane, iteration, args]; args hold the
kernel's stream and, for a collective whose trace event carries them (torch's
record_param_comms: "Collective name", "In msg nelems", "dtype", "Group size"), its bytes.
"""

from __future__ import annotations

import gzip
import json
import statistics
from bisect import bisect_right
from pathlib import Path
from typing import Any

from scalelab.errors import UsageError

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LANE, COMM_LANE = "device", "device-comm"
DTYPE_BYTES = {"Float": 4, "Half": 2, "BFloat16": 2, "Double": 8, "Int": 4, "Long": 8, "Byte": 1}
STEP = "ProfilerStep#"


def load_trace(path: str | Path) -> dict[str, Any]:
    """A Chrome trace written by torch.profiler (gzipped or not); one line when unreadable."""
    path = Path(path)
    try:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8") as f:
            trace = json.load(f)
    except (OSError, ValueError, EOFError) as exc:
        raise UsageError(f"{path}: not a readable profiler trace ({exc})") from None
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise UsageError(f"{path}: not a profiler trace (no traceEvents list)")
    return trace


def is_nccl(name: str) -> bool:
    return name.lower().startswith("nccl")


def _complete(trace: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in trace["traceEvents"] if e.get("ph") == "X" and "ts" in e and "dur" in e]


def step_windows(events: list[dict[str, Any]]) -> list[tuple[float, int]]:
    """(start_us, k) of every ProfilerStep#k, by start."""
    steps = [(e["ts"], int(e["name"][len(STEP) :])) for e in events if e["name"].startswith(STEP)]
    return sorted(steps)


def _iteration(windows: list[tuple[float, int]], ts: float) -> int:
    i = bisect_right(windows, (ts, float("inf"))) - 1
    return windows[i][1] if i >= 0 else (windows[0][1] if windows else 0)


def clock_offset(events: list[dict[str, Any]], spans: list[list[Any]]) -> float | None:
    """Seconds to add to a trace time (ts / 1e6) to put it on the timeline: the median over
    the (phase path, iteration) pairs both logs hold; None when they share none."""
    windows = step_windows(events)
    starts = {(s[0], s[4]): s[1] for s in spans if s[3] == "main"}
    deltas = []
    for e in events:
        if e.get("cat") != "user_annotation":
            continue
        key = (e["name"], _iteration(windows, e["ts"]))
        if key in starts:
            deltas.append(starts[key] - e["ts"] / 1e6)
    return statistics.median(deltas) if deltas else None


def _bytes(args: dict[str, Any]) -> int | None:
    n, dtype = args.get("In msg nelems"), args.get("dtype")
    if n is None or dtype not in DTYPE_BYTES:
        return None
    return int(n) * DTYPE_BYTES[dtype]


def _collective(args: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if "Collective name" in args:
        out["collective"] = args["Collective name"]
    if (nbytes := _bytes(args)) is not None:
        out["bytes"] = nbytes
    if "Group size" in args:
        out["group"] = int(args["Group size"])
    return out


def device_events(events: list[dict[str, Any]]) -> list[tuple[dict[str, Any], bool]]:
    """(event, is communication) for the device work; without any (a CPU run), the host's
    communication and its top-level aten operators instead."""
    gpu = [(e, is_nccl(e["name"])) for e in events if e.get("cat") in DEVICE_CATS]
    if gpu:
        return gpu
    comm = [
        e for e in events
        if (e.get("cat") == "user_annotation" and e["name"].split(":")[0] in ("gloo", "nccl"))
        or (e.get("cat") == "cpu_op" and e["name"].startswith("c10d::"))
    ]  # fmt: skip
    ops = sorted((e for e in events if e.get("cat") == "cpu_op" and e["name"].startswith("aten::")),
                 key=lambda e: (e["ts"], -e["dur"]))  # fmt: skip
    top, end = [], float("-inf")
    for e in ops:  # outermost operators only: a nested one's time is its parent's
        if e["ts"] >= end:
            top.append(e)
            end = e["ts"] + e["dur"]
    return [(e, True) for e in comm] + [(e, False) for e in top]


def kernel_spans(trace: dict[str, Any], spans: list[list[Any]]) -> list[list[Any]] | None:
    """The trace's device work as timeline span rows, on the timeline's clock (None when the
    trace shares no labelled phase with the spans: it cannot be placed)."""
    events = _complete(trace)
    offset = clock_offset(events, spans)
    if offset is None:
        return None
    windows = step_windows(events)
    rows = []
    for e, comm in device_events(events):
        args = {"stream": e.get("args", {}).get("stream"), "kernel": True}
        if comm:
            args.update(_collective(e.get("args", {})))
        start = e["ts"] / 1e6 + offset
        it = _iteration(windows, e["ts"])
        rows.append(
            [e["name"], round(start, 7), e["dur"] / 1e6, COMM_LANE if comm else LANE, it, args]
        )
    return sorted(rows, key=lambda r: r[1])


def with_kernels(rec: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The record with each rank's traced device work added to its timeline (a copy), and a
    note for each rank whose trace is missing or cannot be placed."""
    files = ((rec.get("trace") or {}).get("files")) or []
    tl = rec.get("timeline")
    if not files or not tl:
        return rec, []
    ranks, notes = [], []
    for rank, spans in enumerate(tl["ranks"]):
        path = files[rank] if rank < len(files) else None
        if not path or not Path(path).exists():
            notes.append(f"rank {rank}: no profiler trace ({path or 'none written'})")
            ranks.append(spans)
            continue
        extra = kernel_spans(load_trace(path), spans)
        if extra is None:
            notes.append(f"rank {rank}: {path} shares no phase label with the timeline")
            extra = []
        ranks.append(sorted(spans + extra, key=lambda s: s[1]))
    return {**rec, "timeline": {**tl, "ranks": ranks}}, notes
