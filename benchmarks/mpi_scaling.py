"""MPI scaling benchmarks, run on the GPU host (16-32 cores, 2 GPUs).

    python benchmarks/mpi_scaling.py [OUT_DIR] [--part cpu|gpu|all] [--smoke]

1. CPU ranks, strong scaling: alexnet --strategy mpi --split spatial, batch 32 at 227x227,
   1/2/4/8 ranks of one thread each. Efficiency = T1 / (n * Tn); target >= 85% at 8 ranks.
   Beside it, the granularity bound: the efficiency a height split can reach at all when
   every layer waits for its fullest slab (13 rows of c3..c5 over 8 ranks: 2 vs 1.625).
2. charcnn, batch 65,536 on GPUs: mpi-gpu on 1 GPU and on 2 (target >= 1.85x), mpi-gpu
   --overlap vs without (overlap must win), nccl vs mpi-gpu's host staging (nccl >= staging).

Every run goes through `scalelab run` (which starts mpiexec/torchrun); records are appended to
OUT_DIR/runs.jsonl, the summary to OUT_DIR/summary.json and the tables are printed (Markdown
with --markdown). OUT_DIR defaults to $OUT, else benchmarks/results/mpi_scaling. About 3-5
minutes on the GPU host; --smoke runs tiny sizes (67x67, 1/2 ranks, 512 texts) in ~1 minute.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from scalelab.cli.commands.versions import launch_run
from scalelab.config import RunConfig
from scalelab.layout.trunk import trunk_for
from scalelab.record import read_records
from scalelab.strategies.halo import plan_trunk
from scalelab.workloads import WORKLOADS

FULL = {"image": 227, "batch": 32, "ranks": (1, 2, 4, 8), "texts": 65_536, "iters": 3}
SMOKE = {"image": 67, "batch": 4, "ranks": (1, 2), "texts": 512, "iters": 2}


def run(cfg: RunConfig, runs: Path, timeout: float = 480) -> dict:
    """One `scalelab run`; its record (or a failed stub)."""
    before = len(read_records(runs)) if runs.exists() else 0
    start = time.perf_counter()
    code, err = launch_run(cfg, runs, timeout)
    recs = read_records(runs) if runs.exists() else []
    label = f"{cfg.workload} {cfg.strategy} x{cfg.ranks}"
    if code != 0 or len(recs) == before:
        tail = err.strip().splitlines()[-1:] if err.strip() else [""]
        print(f"  {label}: FAILED (exit {code}) {tail[0]}", file=sys.stderr, flush=True)
        return {"status": "failed", "error": tail[0], "ranks": cfg.ranks}
    rec = recs[-1]
    print(
        f"  {label} ({time.perf_counter() - start:.0f} s): {rec['throughput']:.1f} "
        f"{rec['item_unit']}/s",
        file=sys.stderr,
        flush=True,
    )
    return rec


def granularity_bound(image: int, ranks: int) -> float:
    """Best efficiency of the height split when each layer waits for its fullest slab:
    sum(flops) / sum(flops_l * n * max_rows_l / rows_l); dense layers split evenly."""
    workload = WORKLOADS.get("alexnet")(RunConfig(workload="alexnet", image_size=image))
    trunk = trunk_for(workload, None)
    plans = dict(zip((s.name for s in trunk.steps), plan_trunk(trunk.geometries(), ranks)))
    ideal = worst = 0.0
    for row in workload.cost_table():
        share = 1 / ranks
        if row.name in plans:
            sizes = [r.out[1] - r.out[0] for r in plans[row.name]]
            share = max(sizes) / sum(sizes)
        ideal += row.flops
        worst += row.flops * ranks * share
    return ideal / worst


def dominant(rec: dict) -> str:
    top = {k: v for k, v in rec.get("phases", {}).items() if "/" not in k}
    return max(top, key=top.get) if top else "-"


def cpu_scaling(sizes: dict, runs: Path, split: str = "spatial") -> list[dict]:
    base = RunConfig(
        workload="alexnet",
        strategy="mpi",
        split=split,
        image_size=sizes["image"],
        batch=sizes["batch"],
        threads=1,
        iters=sizes["iters"],
        warmup=1,
        quiet=True,
    )
    rows, t1 = [], None
    for n in sizes["ranks"]:
        rec = run(replace(base, ranks=n), runs)
        if rec.get("status") != "ok":
            rows.append({"ranks": n, "status": "failed", "error": rec.get("error")})
            continue
        t1 = rec["wall_s"] if n == 1 else t1
        phases = rec["phases"]
        rows.append(
            {
                "ranks": n,
                "wall_ms": rec["wall_s"] * 1e3,
                "images_per_s": rec["throughput"],
                "speedup": t1 / rec["wall_s"] if t1 else None,
                "efficiency": t1 / (n * rec["wall_s"]) if t1 else None,
                "split": split,
                "granularity_bound": granularity_bound(sizes["image"], n)
                if split == "spatial"
                else None,
                "halo_ms": phases.get("halo", 0.0) * 1e3,
                "dominant": dominant(rec),
                "record": rec["id"],
            }
        )
    return rows


def gpu_runs(sizes: dict, runs: Path) -> list[dict]:
    base = RunConfig(
        workload="charcnn",
        strategy="mpi-gpu",
        device="cuda",
        batch=sizes["texts"],
        iters=sizes["iters"],
        warmup=1,
        quiet=True,
    )
    variants = [
        ("mpi-gpu, 1 GPU", replace(base, ranks=1)),
        ("mpi-gpu, 2 GPUs (host staging)", replace(base, ranks=2)),
        ("mpi-gpu --overlap, 2 GPUs", replace(base, ranks=2, overlap=True)),
        ("nccl, 2 GPUs (device buffers)", replace(base, strategy="nccl", ranks=2)),
    ]
    for g in (g for g in sizes.get("gpus", ()) if g > 2):
        variants += [
            (f"mpi-gpu, {g} GPUs (host staging)", replace(base, ranks=g)),
            (f"nccl, {g} GPUs (device buffers)", replace(base, strategy="nccl", ranks=g)),
        ]
    rows = []
    for label, cfg in variants:
        rec = run(cfg, runs)
        row = {"variant": label, "ranks": cfg.ranks, "status": rec.get("status")}
        if rec.get("status") == "ok":
            hidden = [e["overlap"]["hidden_fraction"] for e in rec.get("rank_extra") or []]
            row.update(
                wall_ms=rec["wall_s"] * 1e3,
                texts_per_s=rec["throughput"],
                dominant=dominant(rec),
                transport=rec.get("transport"),
                hidden_fraction=min(hidden) if hidden else None,
                record=rec["id"],
            )
        rows.append(row)
    return rows


def verdicts(cpu: list[dict], gpu: list[dict]) -> dict:
    out = {}
    spatial = [r for r in cpu if r.get("split", "spatial") == "spatial"]
    last = spatial[-1] if spatial else {}
    if last.get("efficiency") is not None:
        out[f"cpu_efficiency_at_{last['ranks']}"] = last["efficiency"]
        out["cpu_target_85pct_met"] = last["efficiency"] >= 0.85
    thr = {r["variant"].split(",")[0] + f" x{r['ranks']}": r.get("texts_per_s") for r in gpu}
    one, two = thr.get("mpi-gpu x1"), thr.get("mpi-gpu x2")
    over, nccl = thr.get("mpi-gpu --overlap x2"), thr.get("nccl x2")
    if one and two:
        out["gpu_2_vs_1"] = two / one
        out["gpu_target_1.85x_met"] = two / one >= 1.85
    if two and over:
        out["overlap_vs_plain"] = over / two
        out["overlap_beats_plain"] = over > two
    if two and nccl:
        out["nccl_vs_staging"] = nccl / two
        out["nccl_at_least_staging"] = nccl >= two
    return out


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def table(headers: list[str], rows: list[list[str]], md: bool) -> str:
    if md:
        lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    return "\n".join(fmt.format(*r) for r in [headers, *rows])


def print_tables(cpu: list[dict], gpu: list[dict], verdict: dict, md: bool) -> None:
    if cpu:
        print("\nalexnet --strategy mpi, 1 thread per rank (CPU ranks)")
        heads = ["split", "ranks", "wall ms", "images/s", "speedup", "efficiency", "bound"]
        heads += ["halo ms"]
        rows = [
            [
                r.get("split", "spatial"),
                str(r["ranks"]),
                _fmt(r.get("wall_ms"), ".1f"),
                _fmt(r.get("images_per_s"), ".2f"),
                _fmt(r.get("speedup"), ".2f"),
                _fmt(r.get("efficiency"), ".1%"),
                _fmt(r.get("granularity_bound"), ".1%"),
                _fmt(r.get("halo_ms"), ".1f"),
            ]
            for r in cpu
        ]
        print(
            table(
                heads + ["top phase"],
                [r + [c.get("dominant", "failed")] for r, c in zip(rows, cpu)],
                md,
            )
        )
    if gpu:
        print("\ncharcnn (GPUs)")
        heads = ["variant", "wall ms", "texts/s", "top phase", "comm hidden"]
        rows = [
            [
                r["variant"],
                _fmt(r.get("wall_ms"), ".1f"),
                _fmt(r.get("texts_per_s"), ",.0f"),
                r.get("dominant", "failed"),
                _fmt(r.get("hidden_fraction"), ".0%"),
            ]
            for r in gpu
        ]
        print(table(heads, rows, md))
    print("\n" + json.dumps(verdict, indent=1))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = os.environ.get("OUT", "benchmarks/results/mpi_scaling")
    p.add_argument("out", nargs="?", default=default, help="results folder")
    p.add_argument("--part", choices=("cpu", "gpu", "all"), default="all")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, to test the script")
    p.add_argument("--markdown", action="store_true", help="tables as Markdown rows")
    p.add_argument("--ranks", help="CPU rank counts of the spatial split (default 1,2,4,8)")
    p.add_argument(
        "--batch-ranks",
        help="CPU rank counts of a batch split at batch 2x (past the spatial split's limit: "
        "227x227 AlexNet's height split stops at 14 ranks, c2's halo needs 2-row slabs)",
    )
    p.add_argument("--gpus", default="1,2", help="GPU counts for charcnn (default 1,2)")
    args = p.parse_args(argv)
    sizes = dict(SMOKE if args.smoke else FULL)
    if args.ranks:
        sizes["ranks"] = tuple(int(n) for n in args.ranks.split(","))
    sizes["gpus"] = tuple(int(n) for n in args.gpus.split(","))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = out / "runs.jsonl"
    cpu = cpu_scaling(sizes, runs) if args.part in ("cpu", "all") else []
    if args.batch_ranks and args.part in ("cpu", "all"):
        wide = {**sizes, "batch": 2 * sizes["batch"]}
        wide["ranks"] = (1, *(int(n) for n in args.batch_ranks.split(",")))
        cpu += cpu_scaling(wide, runs, split="batch")
    gpu = []
    if args.part in ("gpu", "all"):
        if torch.cuda.device_count() >= max(2, *sizes["gpus"]):
            gpu = gpu_runs(sizes, runs)
        else:
            print(f"gpu part skipped: needs {max(2, *sizes['gpus'])} GPUs", file=sys.stderr)
    verdict = verdicts(cpu, gpu)
    summary = {"sizes": sizes, "cpu_scaling": cpu, "gpu": gpu, "verdicts": verdict}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print_tables(cpu, gpu, verdict, args.markdown)
    print(f"\nrecords: {runs}; summary: {out / 'summary.json'}")
    failed = any(r.get("status") == "failed" for r in cpu + gpu)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
