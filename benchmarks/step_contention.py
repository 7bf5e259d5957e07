"""The host's cpu_concurrency curve timed on a workload's own step, one curve per rank batch,
each merged into a copy of a ceilings file for `scalelab predict --ceilings`:

    python benchmarks/step_contention.py CEILINGS OUT_DIR --batch 8:8 --batch 4:16 --batch 2:32 \
        [--workload alexnet] [--repeats 3] [--cores N]

--batch B[:K]: a curve of processes each running one forward at B items, measured up to K
processes (default: the cores), so a prediction at K ranks of batch B reads its own load (each
level costs a few seconds: an AlexNet forward at 8 items takes ~0.4 s on one thread).

writes OUT_DIR/concurrency_b<B>.json (the curve, as `scalelab plan` measures it) and
OUT_DIR/ceilings_b<B>.json (CEILINGS with that curve as its cpu_concurrency).

Why: `mpi --split batch` over k ranks runs the whole model on batch/k items per rank, and how
much k ranks slow each other depends on what each runs. Predictions of AlexNet at
8, 16 and 32 CPU ranks on a 32-core host used the ceilings' convolution curve and missed by
-8%, -30% and -44%: the convolution read 0.79-1.2x at 8-32 processes where the runs implied
1.09, 1.50 and 2.17. So a prediction at k ranks reads the curve of k processes each running
one forward at its own batch/k (plan.calibrate.host_contention, with the workload's step as
the kernel).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from scalelab.config import RunConfig
from scalelab.instrument.ceilings import read_ceilings
from scalelab.instrument.concurrency import StepKernel
from scalelab.plan.calibrate import host_contention
from scalelab.predict.figures import Figures


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("ceilings")
    p.add_argument("out_dir", type=Path)
    p.add_argument("--batch", action="append", required=True, help="B[:K]")
    p.add_argument("--workload", default="alexnet")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cores", type=int, default=os.cpu_count())
    args = p.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    base = Figures(read_ceilings(args.ceilings), args.ceilings)
    for spec in args.batch:
        b, _, k = spec.partition(":")
        b, cores = int(b), int(k or args.cores)
        kernel = StepKernel(RunConfig(workload=args.workload, threads=1), b)
        print(f"step_contention: {kernel.describe()}, up to {cores} processes", flush=True)
        curve = args.out_dir / f"concurrency_b{b}.json"
        figures = host_contention(base, cores, curve, args.repeats, kernel)
        c = figures.data["cpu_concurrency"]
        print(f"  ranks {c['ranks']}\n  slowdown_max {[round(x, 3) for x in c['slowdown_max']]}")
        print(f"  slowdown_lockstep {[round(x, 3) for x in c['slowdown_lockstep']]}")
        (args.out_dir / f"ceilings_b{b}.json").write_text(json.dumps(figures.data, indent=1))


if __name__ == "__main__":
    main()
