"""Shared by the timeline tests: the Chrome trace checked against the Trace Event Format,
and `scalelab` run as a user runs it (a fresh process in the test's folder)."""

from __future__ import annotations

import json
import os
import subprocess
import sys


# --- the trace-event schema, written from the Trace Event Format document ------------------
def check_trace_schema(trace: dict) -> None:
    """JSON object format: traceEvents; complete events ("X") carry name, cat, ts, dur >= 0
    (microseconds), pid, tid and an args object; metadata events ("M") name processes and
    threads. Slices on one thread must nest (Chrome's rule for complete events)."""
    json.dumps(trace)  # serialisable
    assert isinstance(trace["traceEvents"], list)
    assert trace.get("displayTimeUnit") in (None, "ms", "ns")
    threads: dict[tuple[int, int], list[tuple[float, float]]] = {}
    for ev in trace["traceEvents"]:
        assert ev["ph"] in ("X", "M"), ev
        assert isinstance(ev["name"], str) and ev["name"]
        assert isinstance(ev["pid"], int) and isinstance(ev["tid"], int)
        assert isinstance(ev.get("args", {}), dict)
        if ev["ph"] == "M":
            assert ev["name"] in ("process_name", "process_sort_index", "thread_name")
            continue
        assert isinstance(ev["cat"], str)
        assert isinstance(ev["ts"], (int, float)) and isinstance(ev["dur"], (int, float))
        assert ev["dur"] >= 0
        threads.setdefault((ev["pid"], ev["tid"]), []).append((ev["ts"], ev["ts"] + ev["dur"]))
    for (pid, tid), slices in threads.items():
        if tid != 0:  # the comm lane's slices may overlap (buckets in flight together)
            continue
        open_ends: list[float] = []
        for start, end in sorted(slices, key=lambda s: (s[0], -s[1])):
            while open_ends and open_ends[-1] <= start + 1e-3:
                open_ends.pop()
            assert not open_ends or end <= open_ends[-1] + 1e-3, (pid, start, end)
            open_ends.append(end)


def _scalelab(tmp_path, *args, env=None, timeout=600):
    cmd = [sys.executable, "-m", "scalelab", *map(str, args)]
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc
