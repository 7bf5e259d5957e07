"""VGG-16 on 2 GPUs: every torch.distributed.pipelining schedule (`pipeline --engine torch`)
against plain PyTorch on one GPU and scalelab's own 1F1B (`--engine scalelab`, 1.80x on
2 x H200 in docs/PERFORMANCE.md). Needs a host with 2 CUDA GPUs.
Usage: python benchmarks/pipeline_torch_gpu.py [--out DIR] [--steps N]

Each run appends its record (stage times, bubble measured / simulated per schedule, mesh) to
DIR/runs.jsonl; the table printed at the end is throughput relative to the one-GPU run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

SCHEDULES = {
    "gpipe": 1,
    "1f1b": 1,
    "interleaved-1f1b": 2,
    "looped-bfs": 2,
    "zero-bubble": 2,
    "zbv": 1,
    "dualpipev": 1,
}
COMMON = ["vgg16", "--train", "--device", "cuda", "--dtype", "bf16", "--batch", "256",
          "--channels-last", "--quiet"]  # fmt: skip


def run(out: Path, steps: int, *extra: str) -> dict:
    cmd = [sys.executable, "-m", "scalelab", "run", *COMMON, "--steps", str(steps),
           "--out", str(out / "runs.jsonl"), "--json", *extra]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/pipeline_torch"))
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    pipe = ["--strategy", "pipeline", "--stages", "2", "--ranks", "2", "--microbatches", "8"]
    rows = [("local (1 GPU)", run(args.out, args.steps, "--strategy", "local"))]
    rows.append(("scalelab 1f1b", run(args.out, args.steps, *pipe, "--schedule", "1f1b")))
    for name, v in SCHEDULES.items():
        torch_pipe = [*pipe, "--engine", "torch", "--schedule", name, "--virtual-stages", str(v)]
        rows.append((f"torch {name}", run(args.out, args.steps, *torch_pipe)))
    base = rows[0][1]["throughput"]
    for label, rec in rows:
        p = rec.get("pipeline", {})
        print(f"{label:24s} {rec['throughput']:9.1f} img/s  {rec['throughput'] / base:5.2f}x  "
              f"bubble measured {p.get('bubble_measured', float('nan')):.3f} "
              f"simulated {p.get('bubble_simulated', float('nan')):.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
