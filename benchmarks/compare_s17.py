"""Session 17's predictions (made before the measurements, from one-GPU and 1-2 CPU-rank
records) against what the `measure` part then measured: one row per held-out configuration.

    python benchmarks/compare_s17.py [RESULTS_DIR] [--measured JSONL]
        (default benchmarks/results/gpu_s17 and its measure/s17_measured.jsonl)

Reads RESULTS_DIR/predictions/<name>/predict.json (committed before `measure` ran) and
RESULTS_DIR/measure/predictions/ (VGG-16's, made on the device before its steps; where that
failed, RESULTS_DIR/measure/predictions_redone/, made afterwards from the same records), and
RESULTS_DIR/measure/s17_measured.jsonl. A step is a training step (global batch / steady
throughput) or an inference iteration (the record's median wall). Prints a Markdown table and
the median and worst absolute error. --measured: the same predictions against a later
measurement of the same configurations (session 18's, after the pipeline's data path moved
onto the GPU: benchmarks/results/gpu_s18/speed/s18_measured.jsonl); configurations it lacks
read "not measured".
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

# prediction name -> (ranks, which measured record: workload, strategy, engine, schedule);
# VGG-16's pipelines were predicted in NCHW (session 18 also measured NHWC stages)
NCHW = {"channels_last": False}
CASES = {
    "r18-ddp": (2, ("resnet18-cifar", "ddp", None, None)),
    "vgg-pipe-gpipe": (2, ("vgg16", "pipeline", "torch", "gpipe"), NCHW),
    "vgg-pipe-1f1b": (2, ("vgg16", "pipeline", "torch", "1f1b"), NCHW),
    "vgg-pipe-interleaved": (2, ("vgg16", "pipeline", "torch", "interleaved-1f1b"), NCHW),
    "gpt-tensor": (2, ("model", "tensor", None, None)),
    "gpt-pipe": (2, ("model", "pipeline", None, None)),
    "gpt-fsdp": (2, ("model", "fsdp", None, None)),
    "gpt-ddp": (2, ("model", "ddp", None, None)),
    **{f"alex-batch@{n}": (n, ("alexnet", "mpi", None, None)) for n in (8, 16, 32)},
}


def step_ms(rec: dict) -> float:
    if rec.get("mode") == "train":
        return 1e3 * rec["global_batch"] / rec["steady_throughput"]
    return 1e3 * rec["wall_s"]


def matches(rec: dict, ranks: int, key: tuple, fixed: dict | None = None) -> bool:
    workload, strategy, engine, schedule = key
    cfg = rec["config"]
    return (rec["status"] == "ok" and rec["ranks"] == ranks and cfg["workload"] == workload
            and rec["strategy"] == strategy and (engine is None or cfg.get("engine") == engine)
            and (schedule is None or cfg.get("schedule") == schedule)
            and all(cfg.get(k, False) == v for k, v in (fixed or {}).items()))  # fmt: skip


# Where predictions were made: before the call (committed), on the device before the step,
# or here after the call from the same calibration records (the device's failed on a bug).
SOURCES = (("predictions", ""), ("measure/predictions", ""), ("measure/predictions_redone", " *"))


def predicted(root: Path, name: str, ranks: int) -> tuple[float | None, str]:
    for folder, mark in SOURCES:
        f = root / folder / name.split("@")[0] / "predict.json"
        if f.exists():
            rows = json.loads(f.read_text())["rows"]
            return next((r["ms"] for r in rows if int(r["ranks"]) == ranks), None), mark
    return None, ""


def main() -> None:
    args = sys.argv[1:]
    where = None
    if "--measured" in args:
        i = args.index("--measured")
        where = Path(args[i + 1])
        del args[i : i + 2]
    root = Path(args[0] if args else "benchmarks/results/gpu_s17")
    lines = (where or root / "measure" / "s17_measured.jsonl").read_text().splitlines()
    measured = [json.loads(line) for line in lines if line.strip()]
    print("| configuration | ranks | predicted ms | measured ms | error |")
    print("| --- | --- | --- | --- | --- |")
    errors = []
    for name, (ranks, key, *fixed) in CASES.items():
        recs = [r for r in measured if matches(r, ranks, key, *fixed)]
        p, mark = predicted(root, name, ranks)
        m = step_ms(recs[-1]) if recs else None
        err = None if p is None or m is None else 100 * (p / m - 1)
        if err is not None:
            errors.append(abs(err))
        cells = [f"{p:.2f}{mark}" if p else "not predicted", f"{m:.2f}" if m else "not measured",
                 f"{err:+.1f}%" if err is not None else "-"]  # fmt: skip
        print(f"| {name.split('@')[0]} | {ranks} | " + " | ".join(cells) + " |")
    print(
        "\n* made after the measurement from the same one-GPU calibration records (the device's "
        "prediction of it failed on a bug since fixed: planning/partition.balance_auto)"
    )
    if errors:
        print(
            f"\n{len(errors)} predictions: median |error| {statistics.median(errors):.1f}%, "
            f"worst {max(errors):.1f}%"
        )


if __name__ == "__main__":
    main()
