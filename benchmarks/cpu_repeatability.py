"""How well one CPU configuration repeats on this host: within a process and between processes.

A plan (docs/PLAN.md) compares configurations by runs in fresh processes. On the 16-core
device VM, runs of one AlexNet configuration (batch 32, 99x99, one thread) measured 96 to
154 images/s while each run's own iterations agreed within a few percent: the spread is
between processes, not within them. This finds out which: it starts N fresh processes per
placement, each timing the same forward `--iters` times after `--warmup`, and reports per
process its median, its within-process spread (IQR / median), the CPU it ended on, and the
host's steal time over its run (a VM's vCPU waiting for its physical core).

    python benchmarks/cpu_repeatability.py --out FILE.json [--procs 6] [--cores 0-3]

Placements: `one`: pinned to the first core of --cores; `float`: free over --cores (what
plan's pinned runs get); `pair`: two processes at once, each on its own core, as two ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _steal() -> int:
    """Host-wide steal jiffies so far (/proc/stat's 8th cpu field; 0 where absent)."""
    with open("/proc/stat") as f:
        fields = f.readline().split()
    return int(fields[8]) if len(fields) > 8 else 0


def _cpu_now() -> int:
    with open("/proc/self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[36])  # field 39: last CPU it ran on


def child(args: argparse.Namespace) -> None:
    import torch

    sys.path.insert(0, str(HERE.parent / "src"))
    from scalelab.config import RunConfig
    from scalelab.instrument.concurrency import StepKernel

    torch.set_num_threads(1)
    cfg = RunConfig(workload=args.workload, batch=args.batch, image_size=args.image_size)
    forward = StepKernel(cfg, args.batch).build()  # the model on (batch, *item) inputs
    walls = []
    steal0 = _steal()
    for i in range(args.warmup + args.iters):
        t0 = time.perf_counter()
        forward()
        if i >= args.warmup:
            walls.append(time.perf_counter() - t0)
    out = {"walls_s": walls, "steal_jiffies": _steal() - steal0, "cpu": _cpu_now()}
    print(json.dumps(out), flush=True)


def _start(cores: str, args: argparse.Namespace) -> subprocess.Popen:
    cmd = ["taskset", "-c", cores, sys.executable, __file__, "--child",
           "--workload", args.workload, "--batch", str(args.batch),
           "--image-size", str(args.image_size), "--iters", str(args.iters),
           "--warmup", str(args.warmup)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)


def _summary(run: dict) -> dict:
    w = sorted(run["walls_s"])
    q1, med, q3 = statistics.quantiles(w, n=4)
    return {**run, "median_s": med, "within_iqr_pct": 100 * (q3 - q1) / med}


def measure(args: argparse.Namespace) -> dict:
    lo = args.cores.split("-")[0].split(",")[0]
    second = str(int(lo) + 1)
    placements: dict[str, list[dict]] = {"one": [], "float": [], "pair": []}
    for i in range(args.procs):  # interleaved, so a drift in the host's load hits all alike
        for name in placements:
            procs = [_start(lo if name != "float" else args.cores, args)]
            if name == "pair":
                procs.append(_start(second, args))
            for p in procs:
                out, _ = p.communicate()
                placements[name].append(_summary(json.loads(out.strip().splitlines()[-1])))
            last = placements[name][-1]
            print(f"round {i + 1}/{args.procs} {name}: {last['median_s'] * 1e3:.1f} ms "
                  f"(within {last['within_iqr_pct']:.1f}%, cpu {last['cpu']}, "
                  f"steal {last['steal_jiffies']})", flush=True)  # fmt: skip
    table = {}
    for name, runs in placements.items():
        meds = [r["median_s"] for r in runs]
        table[name] = {
            "between_max_over_min": max(meds) / min(meds),
            "between_cv_pct": 100 * statistics.stdev(meds) / statistics.mean(meds),
            "within_iqr_pct_median": statistics.median(r["within_iqr_pct"] for r in runs),
            "median_ms": 1e3 * statistics.median(meds),
            "runs": runs,
        }
    named = {k: str(v) for k, v in vars(args).items()}
    return {"host": _host(), "args": named, "placements": table}


def _host() -> dict:
    def read(path: str) -> str:
        try:
            return Path(path).read_text().strip()
        except OSError:
            return ""

    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return {
        "lscpu": lscpu,
        "thp": read("/sys/kernel/mm/transparent_hugepage/enabled"),
        "loadavg": read("/proc/loadavg"),
        "cpus": os.cpu_count(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--procs", type=int, default=6)
    ap.add_argument("--cores", default="0-3")
    ap.add_argument("--workload", default="alexnet")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--image-size", type=int, default=99)
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    if args.child:
        return child(args)
    result = measure(args)
    for name, row in result["placements"].items():
        print(f"{name:6s} median {row['median_ms']:.1f} ms; between processes max/min "
              f"{row['between_max_over_min']:.2f}x (cv {row['between_cv_pct']:.1f}%); within "
              f"a process IQR {row['within_iqr_pct_median']:.1f}% of its median")  # fmt: skip
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
