"""Two or more torch.profiler chrome traces of the same training step side by side: per step,
the GPU's kernel time and its idle time, the kernels that take it, and the host operators that
take the host (self time: an operator's time less the operators it called).

    PYTHONPATH=src python benchmarks/compare_traces.py --steps 3 A/rank0.json.gz B/peer.json

It reads what torch writes (`export_chrome_trace`): events of category "kernel" on the GPU
streams and "cpu_op" on the host threads. Made to find where scalelab's step and the peer's
(`peer_gpt_train.py --profile`) part when their speeds differ.
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

from scalelab.analysis.waits import union
from scalelab.instrument.kernel_trace import load_trace


def self_times(ops: list[dict]) -> Counter:
    """Each host operator's time less its children's, by name, per thread (ops nest)."""
    out: Counter = Counter()
    by_tid: dict = {}
    for e in ops:
        by_tid.setdefault(e["tid"], []).append(e)
    for evs in by_tid.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[list] = []  # [end, name, children's time, own duration]
        for e in evs:
            while stack and stack[-1][0] <= e["ts"]:
                end, name, child, dur = stack.pop()
                out[name] += dur - child
            if stack:
                stack[-1][2] += e["dur"]
            stack.append([e["ts"] + e["dur"], e["name"], 0.0, e["dur"]])
        for _end, name, child, dur in stack:
            out[name] += dur - child
    return out


def summary(path: Path, steps: int, top: int) -> str:
    events = [e for e in load_trace(path)["traceEvents"] if e.get("ph") == "X"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    ops = [e for e in events if e.get("cat") == "cpu_op"]
    runtime = [e for e in events if e.get("cat") == "cuda_runtime"]
    lines = [f"## {path}"]
    if kernels:
        t0 = min(e["ts"] for e in kernels)
        t1 = max(e["ts"] + e["dur"] for e in kernels)
        # overlapping kernels on two streams count once
        busy = sum(b - a for a, b in union([(e["ts"], e["ts"] + e["dur"]) for e in kernels]))
        span = t1 - t0
        lines.append(
            f"per step: GPU span {span / steps / 1e3:.2f} ms, kernels busy {busy / steps / 1e3:.2f}"
            f" ms, idle {(span - busy) / steps / 1e3:.2f} ms; {len(kernels) / steps:.0f} kernels"
        )
        by_kernel: Counter = Counter()
        for e in kernels:
            by_kernel[e["name"][:90]] += e["dur"]
        lines.append("top kernels, ms per step:")
        lines += [f"  {v / steps / 1e3:8.3f}  {k}" for k, v in by_kernel.most_common(top)]
    host = self_times(ops)
    lines.append(
        f"host: {len(ops) / steps:.0f} operators, {len(runtime) / steps:.0f} runtime calls a step;"
        f" operators' self time {sum(host.values()) / steps / 1e3:.2f} ms a step"
    )
    lines.append("top host operators by self time, ms per step:")
    lines += [f"  {v / steps / 1e3:8.3f}  {k[:90]}" for k, v in host.most_common(top)]
    rt: Counter = Counter()
    for e in runtime:
        rt[e["name"]] += e["dur"]
    lines.append("runtime calls, ms per step: " + ", ".join(
        f"{k} {v / steps / 1e3:.2f}" for k, v in rt.most_common(6)
    ))  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("traces", nargs="+", type=Path)
    p.add_argument("--steps", type=int, default=3, help="steps each trace holds")
    p.add_argument("--top", type=int, default=15)
    a = p.parse_args()
    for path in a.traces:
        print(summary(path, a.steps, a.top), "\n")


if __name__ == "__main__":
    main()
