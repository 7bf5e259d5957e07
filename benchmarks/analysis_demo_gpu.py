"""The demo study and the system roofline on a GPU machine (for the lead to run on the device).

    python benchmarks/analysis_demo_gpu.py [OUT_DIR]      (default: $OUT or ./analysis-gpu)

1. run_demo (full, not quick): ceilings, versions, mlp mpi-dp on 1 and 2 ranks (device cuda;
   one GPU: --oversubscribe-gpus), the AlexNet scaling sweep (mpi-gpu on >= 2 GPUs), the
   per-layer run (CUDA peak memory per layer) and the hidden x batch sweep: the system
   roofline then has gradient staging (d2h/h2d nested in allreduce), so P_pci is measured.
2. Prints the wall time of the demo and the system-roofline estimates, and leaves the report
   (OUT_DIR/demo/report/index.html) and the records beside it.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from scalelab.analysis import load_records
from scalelab.analysis.system_roofline import estimate_peaks, system_points
from scalelab.orchestration.demo import run_demo


def main() -> int:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "analysis-gpu"))
    start = time.perf_counter()
    code = run_demo(out / "demo", quick=False)
    wall = time.perf_counter() - start
    records = load_records(out / "demo" / "runs.jsonl")
    peaks = estimate_peaks(records)
    pts = system_points(records, peaks)
    print(f"\ndemo exit {code}, {wall:.0f} s, {len(records)} records")
    print(
        f"P_flops {peaks.p_flops:.3g} FLOP/s | P_pci {peaks.p_pci} B/s | P_mpi {peaks.p_mpi} B/s"
        f" | PCIe share {peaks.pci_share:.2f}"
    )
    cols = ["hidden", "batch", "ranks", "ai", "measured", "measured_phases", "model", "bound"]
    print(pts[cols].to_string(index=False, float_format="{:.4g}".format))
    return code


if __name__ == "__main__":
    raise SystemExit(main())
