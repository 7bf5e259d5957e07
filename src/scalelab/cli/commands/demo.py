"""`scalelab demo`: a small study end to end on whatever this machine has (CPU-only is fine).

Until the analysis layer lands this runs: AlexNet (small images) under every single-process
strategy with the float64 check, then MLP training (real MNIST with --data-dir, else synthetic),
and prints the comparison table and where the records went.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from scalelab.cli.base import COMMANDS, Command
from scalelab.config import RunConfig
from scalelab.runner import execute, format_summary

DEMO_IMAGE_SIZE = 99  # AlexNet trunk still 5 convs + 3 pools; ~9x cheaper than 227


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-o",
        "--out-dir",
        default="scalelab-results",
        help="folder for the records (default: ./scalelab-results)",
    )
    p.add_argument(
        "--data-dir",
        default=None,
        help="folder with the MNIST IDX files (synthetic digits otherwise)",
    )
    p.add_argument("--epochs", type=int, default=3, help="mlp training epochs (default 3)")


def versions_table(results: Path) -> list[dict]:
    """AlexNet under serial and local fp32 on the same inputs, each checked against float64."""
    rows = []
    for strategy in ("serial", "local"):
        cfg = RunConfig(
            workload="alexnet",
            strategy=strategy,
            batch=4,
            iters=3,
            warmup=1,
            image_size=DEMO_IMAGE_SIZE,
            check=True,
            quiet=True,
        )
        rows.append(execute(cfg, results).record)
    return rows


def print_versions(rows: list[dict]) -> None:
    base = rows[0]["wall_s"]
    print(
        f"\nalexnet {DEMO_IMAGE_SIZE}x{DEMO_IMAGE_SIZE}, batch 4: every strategy vs the "
        "float64 oracle"
    )
    print(
        f"  {'strategy':<10}{'dtype':<7}{'wall ms':>10}{'images/s':>11}{'speedup':>9}"
        f"{'relerr':>10}  digest"
    )
    for r in rows:
        print(
            f"  {r['strategy']:<10}{r['precision']:<7}{r['wall_s'] * 1e3:>10.1f}"
            f"{r['throughput']:>11.1f}{base / r['wall_s']:>8.1f}x{r['relerr']:>10.1e}  "
            f"{r['digest']}"
        )


def run(args: argparse.Namespace) -> int:
    results = Path(args.out_dir) / "runs.jsonl"
    rows = versions_table(results)
    print_versions(rows)
    source = f"MNIST from {args.data_dir}" if args.data_dir else "synthetic digits"
    print(f"\nmlp training on {source}, hidden 128, batch 100, lr 0.1:")
    cfg = RunConfig(
        workload="mlp",
        train=True,
        epochs=args.epochs,
        batch=100,
        hidden=128,
        lr=0.1,
        data_dir=args.data_dir,
    )
    train = execute(cfg, results).record
    print(format_summary(train))
    print(f"\nrecords: {results} ({len(rows) + 1} runs appended)")
    failed = [r for r in rows if not r["check_passed"]]
    return 1 if failed else 0


COMMANDS.register("demo", "a small study end to end on this machine (the main job)")(
    Command(add_arguments, run)
)
