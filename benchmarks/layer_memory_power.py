"""Per-layer memory and power (seed Task 2) and the ReLU / max-pool order (seed Task 3).

    python benchmarks/layer_memory_power.py [OUT_DIR]     (OUT_DIR defaults to $OUT or .)

Task 2: each seed layer alone on its seed input, on cuda:0, called repeatedly for ~2 s while
NVML samples the board (instrument/nvml.py): the allocator's peak above the input, the output,
the median time, and mean power / energy per call over the calls' own time spans.

    ReLU      (256, 3, 224, 224)  nn.ReLU(inplace=True)
    MaxPool2d (256, 3, 224, 224)  nn.MaxPool2d(2, 2)
    Conv2d    (256, 3, 224, 224)  nn.Conv2d(3, 128, 3, padding=1)
    Linear    (256, 25088)        nn.Linear(512 * 7 * 7, 4096)

Task 3: vgg16 at the seed's (128, 3, 224, 224), both orders (--swap-relu-pool):
  `scalelab run --per-layer --nvml` (per-layer time, output, peak, power; hooks synchronise,
  so these times are a study, not a run), the same runs without hooks (whole-run time), the
  allocator peak of one fp32 training step, and the seed's CPU column at batch 8.

Writes OUT_DIR/layer_memory_power.jsonl and, with matplotlib, the figures; prints the tables.
Budget: ~3 minutes on one H200.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

from scalelab.analysis import memory
from scalelab.instrument.nvml import NvmlSampler
from scalelab.record import append_record, new_record, read_records
from scalelab.workloads.vgg import VGG

SEED_LAYERS = [
    ("ReLU", lambda: nn.ReLU(inplace=True), (256, 3, 224, 224)),
    ("MaxPool2d", lambda: nn.MaxPool2d(kernel_size=2, stride=2, padding=0), (256, 3, 224, 224)),
    ("Conv2d", lambda: nn.Conv2d(3, 128, kernel_size=3, padding=1), (256, 3, 224, 224)),
    ("Linear", lambda: nn.Linear(512 * 7 * 7, 4096), (256, 512 * 7 * 7)),
]


def study_layer(kind, make, shape, dev, seconds: float = 2.0) -> dict:
    """One layer type: warm up, then call it for `seconds` under the NVML sampler."""
    layer = make().to(dev)
    x = torch.randn(shape, device=dev)
    with torch.no_grad():
        for _ in range(3):
            out = layer(x.clone() if kind == "ReLU" else x)  # in-place ReLU: fresh input
        torch.cuda.synchronize(dev)
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        spans = []
        with NvmlSampler(dev) as sampler:
            end_by = time.perf_counter() + seconds
            while time.perf_counter() < end_by:
                inp = x.clone() if kind == "ReLU" else x
                torch.cuda.synchronize(dev)
                start = time.perf_counter()
                out = layer(inp)
                torch.cuda.synchronize(dev)
                spans.append((start, time.perf_counter()))
        seen = sampler.over(spans)
    row = {
        "kind": kind,
        "input_shape": list(shape),
        "seconds": statistics.median(e - s for s, e in spans),
        "calls": len(spans),
        "out_bytes": out.numel() * out.element_size(),
        "peak_mem_bytes": torch.cuda.max_memory_allocated(dev) - base + x.numel() * 4,
        "mean_power_w": seen["power_w"],
        "energy_j": seen["energy_j"] / len(spans),
    }
    del layer, x, out
    torch.cuda.empty_cache()
    return row


def train_step_peak(swap: bool, batch: int = 128) -> tuple[float, float]:
    """Allocator peak (bytes) and time of one fp32 VGG-16 training step, either order."""
    dev = torch.device("cuda", 0)
    model = VGG(512 * 7 * 7, 1000, swap_relu_pool=swap).to(dev).train()
    x = torch.randn(batch, 3, 224, 224, device=dev)
    y = torch.randint(0, 1000, (batch,), device=dev)
    times = []
    for _ in range(4):
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        start = time.perf_counter()
        nn.functional.cross_entropy(model(x), y).backward()
        torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    peak = torch.cuda.max_memory_allocated(dev)
    del model, x, y
    torch.cuda.empty_cache()
    return float(peak), statistics.median(times[1:])


def scalelab(args: list[str], out: Path) -> None:
    print("$ scalelab " + " ".join(args), flush=True)
    subprocess.check_call([sys.executable, "-m", "scalelab", *args, "--out", str(out)])


def swap_runs(out: Path) -> list[dict]:
    before = len(read_records(out)) if out.exists() else 0
    gpu = ["vgg16", "--device", "cuda", "--batch", "128", "--iters", "10", "--warmup", "5"]
    cpu = ["vgg16", "--device", "cpu", "--batch", "8", "--iters", "3", "--warmup", "1"]
    for swap in ([], ["--swap-relu-pool"]):
        scalelab(["run", *gpu, "--per-layer", "--nvml", "--quiet", *swap], out)
        scalelab(["run", *gpu, "--quiet", *swap], out)
        scalelab(["run", *cpu, "--per-layer", "--quiet", *swap], out)
        scalelab(["run", *cpu, "--quiet", *swap], out)
    return read_records(out)[before:]


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    out_dir = Path(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "."))
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / "layer_memory_power.jsonl"
    dev = torch.device("cuda", 0)
    rows = [study_layer(kind, make, shape, dev) for kind, make, shape in SEED_LAYERS]
    append_record(
        out,
        new_record(
            kind="layer_study", label=torch.cuda.get_device_name(0), device=str(dev), layers=rows
        ),
    )
    recs = read_records(out)
    types = memory.layer_type_table(recs[-1:])
    print(types.to_string(index=False))
    runs = swap_runs(out)
    per_layer = [r for r in runs if r.get("layers")]
    summary = memory.swap_summary(per_layer)
    print(summary.to_string(index=False))
    walls = {
        (r["config"]["device"], r["config"]["swap_relu_pool"]): r["wall_s"]
        for r in runs
        if not r.get("layers")
    }
    peaks = {swap: train_step_peak(swap) for swap in (False, True)}
    append_record(
        out,
        new_record(
            kind="swap_summary",
            gpu=torch.cuda.get_device_name(0),
            run_wall_s={f"{d} swap={s}": w for (d, s), w in walls.items()},
            train_step={
                f"swap={s}": {"peak_bytes": p, "seconds": t} for s, (p, t) in peaks.items()
            },
        ),
    )
    for (device, swap), wall in sorted(walls.items()):
        print(f"vgg16 {device} swap={swap}: {wall * 1e3:.1f} ms per forward (no hooks)")
    for swap, (peak, secs) in peaks.items():
        gib, ms = peak / 2**30, secs * 1e3
        print(f"vgg16 fp32 train step, batch 128, swap={swap}: peak {gib:.2f} GiB, {ms:.1f} ms")
    try:
        from scalelab.analysis import memory_plots

        memory_plots.layer_types(types, out_dir)
        if not summary.empty:
            memory_plots.swap(summary[summary["device"] == "cuda"], out_dir)
    except Exception as exc:  # plots are optional
        print(f"(no figures: {exc})")
    print(f"records: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
