"""Where the test suite's CPU goes: a pytest plugin that writes, per test, its wall seconds,
the test process's CPU seconds and those of the children it waited for (every rank, launcher
and subprocess a test started; Slurm's jobs run under slurmd and are not counted), and a
summary by file and by test. On a 2-core machine CI time is CPU time: this says which tests
to make cheaper.

    PYTHONPATH=benchmarks PYTEST_CPU_OUT=/tmp/cpu.jsonl python -m pytest -m "not gpu" \\
        -n 2 --dist loadfile -p pytest_cpu
    python benchmarks/pytest_cpu.py /tmp/cpu.jsonl
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from collections import defaultdict

import pytest

OUT = os.environ.get("PYTEST_CPU_OUT", "pytest_cpu.jsonl")


def _cpu(who: int) -> float:
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):  # noqa: ANN001, ARG001  (pytest's hook)
    own, kids, t0 = _cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN), time.perf_counter()
    yield
    rec = {"test": item.nodeid, "wall": time.perf_counter() - t0,
           "self_cpu": _cpu(resource.RUSAGE_SELF) - own,
           "child_cpu": _cpu(resource.RUSAGE_CHILDREN) - kids}  # fmt: skip
    with open(OUT, "a") as f:  # one line per test, from every xdist worker
        f.write(json.dumps(rec) + "\n")


def main() -> None:
    with open(sys.argv[1]) as f:
        rows = [json.loads(line) for line in f]
    cpu = lambda r: r["self_cpu"] + r["child_cpu"]  # noqa: E731
    kids = sum(r["child_cpu"] for r in rows)
    print(f"{len(rows)} tests: wall {sum(r['wall'] for r in rows):.0f} s summed, "
          f"CPU {sum(map(cpu, rows)):.0f} s (children {kids:.0f})")  # fmt: skip
    files: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    for r in rows:
        f = files[r["test"].split("::")[0]]
        f[0], f[1], f[2] = f[0] + cpu(r), f[1] + r["wall"], f[2] + 1
    print("\nfiles by CPU seconds:")
    for name, (c, w, n) in sorted(files.items(), key=lambda kv: -kv[1][0])[:25]:
        print(f"  {c:7.1f} CPU s {w:7.1f} wall s {n:4d} tests  {name}")
    print("\ntests by CPU seconds:")
    for r in sorted(rows, key=cpu, reverse=True)[:25]:
        print(f"  {cpu(r):7.1f} CPU s {r['wall']:7.1f} wall s  {r['test']}")


if __name__ == "__main__":
    main()
