"""The README's demo under a load generator, then an audit of what it wrote.

A busy host once showed numbers the demo's report printed side by side that contradicted each other
on a busy host (threads, per-layer times above the wall, points above their roof or model,
start-up skew in step times, units, ceilings, predict, attention FLOPs, fit's nan). This
starts two busy processes per CPU core, runs `scalelab demo --data-dir DATA -o OUT` in a
subprocess (PYTHONPATH=src), stops the load for sure (also on Ctrl-C or an exception), and
then checks each numbered contradiction on the demo's records (OUT/runs.jsonl), its ceilings
(OUT/ceilings.json) and its report (OUT/report/index.html) with the project's own analyses:
each is absent, flagged where it appears, or CONTRADICTION UNFLAGGED (exit 1).

    python benchmarks/demo_under_load.py [--data-dir ../shared/data/mnist] [--out-dir DIR]
        [--audit-only DIR] [--json FILE]

--audit-only audits a demo folder already written (no load, no demo run).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(HERE))

from demo_audit import audit  # noqa: E402  (the checks, one function per numbered item)


def _spin() -> None:
    """One busy process: pure Python arithmetic, no I/O, until terminated."""
    x = 0
    while True:
        x = (x * 1103515245 + 12345) & 0x7FFFFFFF


class Load:
    """Two busy processes per core (os.cpu_count()), terminated then killed on exit; the load
    average is sampled every 5 s while it runs (a daemon thread)."""

    def __init__(self, per_core: int = 2) -> None:
        self.count = per_core * (os.cpu_count() or 1)
        self.procs: list[mp.Process] = []
        self.samples: list[float] = []
        self._stop = threading.Event()

    def __enter__(self) -> Load:
        ctx = mp.get_context("spawn")  # no copy of this process's state in each spinner
        for _ in range(self.count):
            p = ctx.Process(target=_spin, daemon=True)
            p.start()
            self.procs.append(p)
        threading.Thread(target=self._sample, daemon=True).start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(5.0):
            self.samples.append(os.getloadavg()[0])

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()


def run_demo(out_dir: Path, data_dir: str) -> tuple[int, float]:
    """`scalelab demo` in its own process with this checkout's src first on the path; its
    output is shown and kept in OUT/demo.log (the audit reads it for 'nan')."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])}  # fmt: skip
    cmd = [sys.executable, "-m", "scalelab", "demo", "--data-dir", data_dir, "-o", str(out_dir)]
    print("$", " ".join(cmd), flush=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(out_dir / "demo.log", "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)  # fmt: skip
        for line in proc.stdout:
            sys.stdout.write(line)
            log.write(line)
        code = proc.wait()
    return code, time.perf_counter() - start


def _git_commit() -> str:
    out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True)  # fmt: skip
    return out.stdout.strip() or "unknown"


def _print_table(rows: list[dict]) -> None:
    width = max(len(r["item"]) for r in rows)
    for r in rows:
        print(f"{r['item']:<{width}}  {r['status']:<24}  {r['evidence']}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", default=str(ROOT.parent / "shared" / "data" / "mnist"))
    ap.add_argument("--out-dir", default=None, help="the demo's folder (default: a temp dir)")
    ap.add_argument("--audit-only", default=None, help="audit this demo folder, run nothing")
    ap.add_argument("--per-core", type=int, default=2, help="busy processes per core")
    ap.add_argument("--json", default=None, help="where the result goes (default: results/)")
    args = ap.parse_args()
    meta: dict = {"host": socket.gethostname(), "cores": os.cpu_count(),
                  "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                  "git_commit": _git_commit()}  # fmt: skip
    if args.audit_only:  # the run's own facts (load, wall) kept beside its records
        out = Path(args.audit_only)
        saved = out / "under_load.json"
        meta.update(json.loads(saved.read_text()) if saved.exists() else {"load": "unknown"})
        meta.update(audited=meta["date"], git_commit_audit=_git_commit())
    else:
        out = Path(args.out_dir or tempfile.mkdtemp(prefix="demo_under_load_"))
        with Load(args.per_core) as load:
            code, wall = run_demo(out, args.data_dir)
            samples = list(load.samples)
        meta.update(demo_dir=str(out), demo_exit=code, demo_wall_s=round(wall, 1),
                    busy_processes=load.count,
                    load_avg_1min={"min": min(samples, default=None),
                                   "max": max(samples, default=None),
                                   "mean": round(sum(samples) / len(samples), 2)
                                   if samples else None})  # fmt: skip
        (out / "under_load.json").write_text(json.dumps(meta, indent=1))
    rows = audit(out)
    print()
    _print_table(rows)
    unflagged = [r["item"] for r in rows if r["status"] == "CONTRADICTION UNFLAGGED"]
    meta.update(items=rows, unflagged=unflagged)
    tag = socket.gethostname().split(".")[0][:24] + f"_{os.cpu_count()}cpu"
    path = Path(args.json or HERE / "results" / f"demo_under_load_{tag}.json")
    path.write_text(json.dumps(meta, indent=1, default=str) + "\n")
    print(f"\n{len(unflagged)} unflagged; written {path}; demo folder {out}")
    return 1 if unflagged else 0


if __name__ == "__main__":
    sys.exit(main())
