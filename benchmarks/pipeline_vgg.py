"""Pipeline parallelism: VGG-16 training on K GPUs against one GPU, the
bubble against (K-1)/(M+K-1), and deepstack stacks that do not fit one GPU.

    python benchmarks/pipeline_vgg.py [OUT_DIR] [--stages 2,4] [--no-deepstack] [--full]
    (OUT_DIR defaults to $OUT or .)

1. Plain PyTorch, one GPU: VGG-16 (scalelab's module, torchvision's layers) training steps,
   bf16 autocast, channels_last, SGD, at batch 32 (a micro-batch of 256 / 8), 64 and 256;
   median step time -> img/s.
2. `scalelab run vgg16 --strategy pipeline` on K GPUs (K from --stages), global batch 256:
   K=1: M = 1 and 8 (no bubble: the strategy's and micro-batching's own costs); K=2: M = 8
   GPipe and 1F1B; K=4: M = 8 (GPipe), 16 (1F1B); each eager and, where PIPE_RUNS says,
   with --compile (every stage torch.compiled; then plain torch.compile of the whole model
   at batch 256 is timed too, as the compiled runs' second reference). Cuts: --balance auto
   then --rebalance 2. Steady img/s (median step after the first), speedup over (1) at
   batch 256, bubble measured / simulated / formula.
3. `scalelab fit deepstack` under a 10.91 GiB allocator cap (the seed's GTX 1080 Ti): the
   seed's (convs, fcs) table; then a (90, 90) stack that does not fit, its proposed stage
   count, and its pipeline training on 2 capped GPUs (skipped with --no-deepstack).
4. With --full: a 2000-conv stack that does not fit a whole H200, trained on two.

Writes OUT_DIR/pipeline_vgg.jsonl (scalelab records of every run plus one summary record)
and prints a table. Budget: ~5 minutes on 2 H200 (--full adds ~1.5, K=4 ~2).
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

import torch

from scalelab.record import append_record, new_record, read_records
from scalelab.workloads.vgg import VGG

BATCHES = (32, 64, 256)
PIPE_STEPS = 14  # the first (allocation, cuDNN autotuning) is left out of the median
PIPE_RUNS = {  # stages -> (schedule, micro-batches, compiled) runs
    # One stage: the strategy's own cost (M=1) and micro-batching's (M=8) without any bubble,
    # so a K-stage speedup can be read as (K-stage / one-stage) x (one-stage / plain).
    1: [("gpipe", 1, False), ("gpipe", 8, False), ("gpipe", 8, True)],
    2: [("gpipe", 8, False), ("1f1b", 8, False), ("gpipe", 8, True), ("1f1b", 8, True)],
    4: [("gpipe", 8, False), ("1f1b", 16, False), ("1f1b", 16, True)],
}
REBALANCE = "2"  # rounds of re-cutting from measured stage times (strategy default: 1)


def plain_vgg_step_time(
    batch: int, steps: int = 20, warmup: int = 5, compiled: bool = False
) -> float:
    """Median seconds of one training step of plain PyTorch on cuda:0 (data on the GPU);
    compiled: the same loop around torch.compile(model) (the first warm-up step compiles)."""
    torch.manual_seed(0)
    torch.backends.cudnn.benchmark = True
    dev = torch.device("cuda", 0)
    model = VGG(512 * 7 * 7, 1000).to(dev, memory_format=torch.channels_last).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    if compiled:
        model = torch.compile(model, dynamic=False)
    x = torch.randn(batch, 3, 224, 224, device=dev).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (batch,), device=dev)
    times = []
    for i in range(warmup + steps):
        torch.cuda.synchronize(dev)
        start = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize(dev)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    del model, opt, x, y
    torch.cuda.empty_cache()
    return statistics.median(times)


def scalelab(args: list[str], out: Path, env: dict | None = None) -> int:
    cmd = [sys.executable, "-m", "scalelab", *args, "--out", str(out)]
    print("$ scalelab " + " ".join(args), flush=True)
    start = time.perf_counter()
    code = subprocess.call(cmd, env={**os.environ, **(env or {})})
    print(f"  ({time.perf_counter() - start:.0f} s, exit {code})", flush=True)
    return code


def pipeline_run(
    stages: int, schedule: str, micro: int, compiled: bool, out: Path, cut: str = "auto"
) -> dict | None:
    before = len(read_records(out)) if out.exists() else 0
    args = ["run", "vgg16", "--strategy", "pipeline", "--ranks", str(stages)]
    args += ["--stages", str(stages), "--balance", cut, "--rebalance", REBALANCE]
    args += ["--compile"] if compiled else []
    args += ["--device", "cuda", "--dtype", "bf16", "--channels-last", "--train"]
    args += ["--batch", "256", "--microbatches", str(micro), "--schedule", schedule]
    args += ["--steps", str(PIPE_STEPS), "--train-size", str(256 * PIPE_STEPS)]
    args += ["--heldout-size", "256", "--quiet"]
    if scalelab(args, out) != 0:
        return None
    recs = read_records(out)[before:]
    return recs[-1] if recs else None


def deepstack_demos(out: Path, full: bool) -> list[dict]:
    """The seed's fit table under the 1080 Ti's 10.91 GiB, then stacks trained on two GPUs."""
    common = ["--device", "cuda", "--dtype", "fp32", "--batch", "16", "--quiet"]
    cap = ["--mem-limit", "10.91GiB"]
    scalelab(["fit", "deepstack", *common, *cap, "--iters", "3", "--warmup", "2"], out)
    stack = ["--convs", "90", "--fcs", "90", "--microbatches", "4", "--steps", "3"]
    scalelab(["fit", "deepstack", "--find", "stages", *common, *cap, *stack, "--run"], out)
    if full:
        big = ["--convs", "2000", "--fcs", "4", "--batch", "32", "--microbatches", "4"]
        big += ["--dtype", "tf32", "--steps", "3", "--device", "cuda", "--quiet"]
        scalelab(["fit", "deepstack", "--find", "stages", *big, "--run"], out)
    return [r for r in read_records(out) if r.get("workload") == "deepstack"]


def _parse_run(spec: str) -> tuple[int, str, int, bool, str]:
    """K:schedule:M[:compiled][:a/b/...]: the last field, when given, pins the cut."""
    k, schedule, micro, *rest = spec.split(":")
    cut = next((f.replace("/", ",") for f in rest if "/" in f), "auto")
    return int(k), schedule, int(micro), "compiled" in rest, cut


def table(rows: list[tuple]) -> str:
    head = ("run", "img/s", "x one GPU", "bubble meas.", "sim.", "formula", "balance")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join(str(c) for c in r) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", default=os.environ.get("OUT", "."))
    parser.add_argument("--full", action="store_true", help="also a stack too big for an H200")
    parser.add_argument("--stages", default="1,2", help="comma list of stage counts (1,2,4)")
    parser.add_argument("--no-deepstack", action="store_true", help="skip the fit demos")
    parser.add_argument(
        "--no-compile-reference", action="store_true", help="skip torch.compile on one GPU"
    )
    parser.add_argument(
        "--runs", help="K:schedule:M[:compiled][:a/b],... instead of the default runs (a/b: cut)"
    )
    args = parser.parse_args()
    stage_counts = [int(k) for k in args.stages.split(",")]
    if args.runs:
        stage_counts = sorted({_parse_run(spec)[0] for spec in args.runs.split(",")})
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / "pipeline_vgg.jsonl"
    full = args.full
    if torch.cuda.device_count() < max(stage_counts):
        print(f"needs {max(stage_counts)} CUDA GPUs")
        return 2
    plain = {b: b / plain_vgg_step_time(b) for b in BATCHES}
    rows = [
        (f"plain PyTorch 1 GPU, batch {b}", f"{v:.0f}", "-", "-", "-", "-", "-")
        for b, v in plain.items()
    ]
    summary: dict = {"plain_img_s": plain, "pipeline": []}
    runs = [(k, *run, "auto") for k in stage_counts for run in PIPE_RUNS[k]]
    if args.runs:  # K:schedule:M[:compiled], comma-separated, instead of PIPE_RUNS
        runs = [_parse_run(spec) for spec in args.runs.split(",")]
    if any(compiled for *_, compiled, _ in runs) and not args.no_compile_reference:
        # The compiled runs' second reference: torch.compile of the whole model on one GPU.
        summary["plain_compiled_img_s_256"] = 256 / plain_vgg_step_time(256, compiled=True)
        v = summary["plain_compiled_img_s_256"]
        rows.append(("torch.compile 1 GPU, batch 256", f"{v:.0f}", f"{v / plain[256]:.2f}",
                     *["-"] * 4))  # fmt: skip
    for stages, schedule, micro, compiled, cut in runs:
        name = f"pipeline {stages} GPUs {schedule} M={micro}" + (" compiled" if compiled else "")
        name += "" if cut == "auto" else f" cut {cut}"
        rec = pipeline_run(stages, schedule, micro, compiled, out, cut)
        if rec is None:
            rows.append((name, "FAILED", *["-"] * 5))
            continue
        p = rec["pipeline"]
        speed = p["steady_throughput"]
        for st in p["stage"]:  # where each stage's step went, ms
            ms = {k: f"{st[k + '_s'] * 1e3:.2f}" for k in ("forward", "backward", "recv", "span")}
            print(f"  stage {st['rank']}: {ms}", flush=True)
        for r in p.get("balance_rounds") or []:
            print(f"  cut {r['balance']}: stage ms/micro-batch "
                  f"{[round(t * 1e3, 3) for t in r['stage_s']]}", flush=True)  # fmt: skip
        rows.append(
            (
                name,
                f"{speed:.0f}",
                f"{speed / plain[256]:.2f}",
                f"{p['bubble_measured']:.3f}",
                f"{p['bubble_simulated']:.3f}",
                f"{p['bubble_formula']:.3f}",
                ",".join(map(str, p["balance"])),
            )
        )
        summary["pipeline"].append(
            {"stages": stages, "schedule": schedule, "microbatches": micro,
             "compiled": compiled, "cut": cut, "img_s": speed, "speedup": speed / plain[256],
             "bubble": {k: p[k] for k in
             ("bubble_measured", "bubble_simulated", "bubble_formula")},
             "balance": p["balance"], "balance_rounds": p.get("balance_rounds"),
             "stage": p["stage"], "record": rec["id"]}
        )  # fmt: skip
    print(table(rows))
    fits = [] if args.no_deepstack else deepstack_demos(out, full)
    summary["deepstack"] = [r.get("answer") for r in fits if r.get("schema") == "scalelab.fit/1"]
    append_record(
        out, new_record(kind="pipeline_vgg_summary", gpu=torch.cuda.get_device_name(0), **summary)
    )
    print(json.dumps(summary["deepstack"], indent=1, default=str))
    print(f"records: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
