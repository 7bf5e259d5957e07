"""Peak memory per GPU of ddp and fsdp training a >= 1e9-parameter model on 2 GPUs, measured
against `scalelab fit`'s estimate (plan/memory.py), with the step times of the same runs.

    python benchmarks/fsdp_memory.py OUT.json [--gpus 2] [--fcs 60] [--batch 64] [--steps 8]
                                              [--device cuda] [--strategies ddp,fsdp,fsdp-off]

The model: deepstack with one 64->64 conv at 32x32 and --fcs linear 4096->4096 layers
(16.8M parameters each; 60 of them + the projection and the 1000-way classifier: 1.03e9
parameters), fp32, SGD with momentum 0.9 (weights, gradients and momentum: 12 bytes a
parameter, ~12.4 GB under ddp, ~6.2 GB a GPU under fsdp on 2). Global batch --batch over the
GPUs, --steps steps (one epoch); step time = global batch / the record's steady throughput.

Runs, all in one torchrun launch (each rank runs them in turn through scalelab's runner, the
CUDA allocator's peak statistics reset before each):
    ddp        DistributedDataParallel (gradients are views of its buckets: no extra copy)
    fsdp       fully_shard per linear layer, resharding after forward (ZeRO-3)
    fsdp-off   --reshard-after-forward off (the gathered weights live from forward to backward)

Measured: torch.cuda.max_memory_allocated per rank (what the allocator handed out; the CUDA
context and the allocator's cached slack are outside it; max_memory_reserved is recorded
too), and on rank 0 the allocator's own trace replayed to the peak (`at_peak`: the blocks
alive there, grouped by the Python stack that allocated them, largest first). Predicted:
plan/memory.device_bytes (parameters, gradients and momentum at the rank's share, DDP's
second set of buckets, fsdp's gathered units, activations from the cost table; fsdp's peak
at the forward's or the backward's end). The bar: predicted within 10% of measured.

Writes OUT.json: {"rows": [one per strategy: measured per GPU, predicted, ratio, step time],
"records": [the runs' scalelab records]}. --device cpu --fcs 2 runs the plumbing on gloo
(no allocator peak there: fsdp's record says the bytes of the shards each rank holds).
Under 3 minutes on 2x H100 at the defaults (most of it building the model on the host).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = {"ddp": {"strategy": "ddp"}, "fsdp": {"strategy": "fsdp"},
        "fsdp-off": {"strategy": "fsdp", "reshard_after_forward": "off"}}  # fmt: skip


def configs(args: argparse.Namespace, out: Path) -> dict[str, dict]:
    common = dict(
        workload="deepstack", train=True, device=args.device, convs=1, fcs=args.fcs,
        image_size=32, batch=args.batch, train_size=args.batch * args.steps,
        heldout_size=args.batch, epochs=1, lr=1e-3, momentum=0.9, quiet=True,
        ranks=args.gpus, warmup=0,
    )  # fmt: skip
    names = args.strategies.split(",")
    return {n: {**common, **RUNS[n], "save_weights": None} for n in names}


def worker(out: Path, runs: dict[str, dict]) -> None:
    """One rank (under torchrun): every run through the runner; this rank's peaks to a file."""
    import torch

    from scalelab.config import RunConfig
    from scalelab.run.runner import execute

    rank = int(os.environ.get("RANK", "0"))
    for name, fields in runs.items():
        gc.collect()
        cuda = torch.cuda.is_available() and fields["device"] == "cuda"
        explain = cuda and rank == 0
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        if explain:  # the allocator's own trace of this run: what was alive at its peak
            torch.cuda.memory._record_memory_history(stacks="python", max_entries=400_000)
        execute(RunConfig(**fields), out / "runs.jsonl")
        peak = {"name": name, "rank": rank}
        if cuda:
            peak["peak_allocated"] = torch.cuda.max_memory_allocated()
            peak["peak_reserved"] = torch.cuda.max_memory_reserved()
        if explain:
            peak["at_peak"] = peak_account(torch.cuda.memory._snapshot())
            torch.cuda.memory._record_memory_history(enabled=None)
        with open(out / f"peaks-rank{rank}.jsonl", "a") as f:
            f.write(json.dumps(peak) + "\n")


def peak_account(snapshot: dict, top: int = 12) -> dict:
    """Replays the allocator's trace (alloc / free_completed) to the moment the most bytes were
    allocated; returns that moment's bytes and its live blocks grouped by where they were
    allocated (the innermost frames), largest first: which copy made the peak."""
    live: dict[int, tuple[int, str]] = {}
    now = most = 0
    at_most: dict[int, tuple[int, str]] = {}
    for trace in snapshot.get("device_traces", []):
        for ev in trace:
            if ev["action"] == "alloc":
                frames = [f"{Path(f['filename']).name}:{f['line']}:{f['name']}"
                          for f in ev.get("frames", [])
                          if not f["filename"].startswith("??")][:8]  # fmt: skip
                live[ev["addr"]] = (ev["size"], " < ".join(frames))
                now += ev["size"]
                if now > most:
                    most, at_most = now, dict(live)
            elif ev["action"] == "free_completed" and ev["addr"] in live:
                now -= live.pop(ev["addr"])[0]
    sites: dict[str, list[int]] = {}
    for size, where in at_most.values():
        sites.setdefault(where, []).append(size)
    ranked = sorted(sites.items(), key=lambda kv: -sum(kv[1]))[:top]
    return {
        "traced_peak_bytes": most,
        "blocks_at_peak": len(at_most),
        "sites": [{"bytes": sum(v), "blocks": len(v), "where": k} for k, v in ranked],
    }


def predicted(fields: dict) -> dict:
    from scalelab.config import RunConfig
    from scalelab.plan import memory
    from scalelab.workloads import WORKLOADS

    cfg = RunConfig(**{k: v for k, v in fields.items() if k != "save_weights"})
    params = sum(r.params for r in WORKLOADS.get(cfg.workload)(cfg).cost_table())
    return {"n_params": params, "bytes": memory.device_bytes(cfg), **memory.breakdown(cfg)}


def rows(out: Path, runs: dict[str, dict], gpus: int) -> tuple[list[dict], list[dict]]:
    from scalelab.record import read_records

    records = [r for r in read_records(out / "runs.jsonl")]
    peaks: dict[str, list] = {n: [None] * gpus for n in runs}
    for r in range(gpus):
        for line in (out / f"peaks-rank{r}.jsonl").read_text().splitlines():
            p = json.loads(line)
            peaks[p["name"]][p["rank"]] = p
    table = []
    for (name, fields), rec in zip(runs.items(), records):
        pred = predicted(fields)
        measured = [p.get("peak_allocated") if p else None for p in peaks[name]]
        step_s = rec["global_batch"] / rec["steady_throughput"]
        top = max((m for m in measured if m is not None), default=None)
        table.append({
            "run": name, "strategy": fields["strategy"], "gpus": gpus, "status": rec["status"],
            "params": pred["n_params"], "measured_peak_allocated": measured,
            "measured_peak_reserved": [p.get("peak_reserved") if p else None
                                       for p in peaks[name]],
            "held_shards": rec.get("memory_per_rank"),
            "predicted_bytes": pred["bytes"], "predicted": pred,
            "measured_over_predicted": None if top is None else top / pred["bytes"],
            "step_s": step_s, "steady_throughput": rec["steady_throughput"],
            "at_peak_rank0": (peaks[name][0] or {}).get("at_peak"),
        })  # fmt: skip
    return table, records


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="JSON file to write")
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--fcs", type=int, default=60, help="4096x4096 linear layers (16.8M each)")
    p.add_argument("--batch", type=int, default=64, help="global batch")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--device", default="cuda")
    p.add_argument("--strategies", default="ddp,fsdp,fsdp-off")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker is not None:  # a rank under torchrun
        worker(Path(args.worker), json.loads(args.out))
        return 0
    out = Path(args.out).with_suffix(".runs")
    out.mkdir(parents=True, exist_ok=True)
    for old in (*out.glob("*.jsonl"),):
        old.unlink()
    runs = configs(args, out)
    path = os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={args.gpus}", __file__, json.dumps(runs),
           "--worker", str(out)]  # fmt: skip
    subprocess.run(cmd, check=True, env={**os.environ, "PYTHONPATH": path})
    table, records = rows(out, runs, args.gpus)
    Path(args.out).write_text(json.dumps({"rows": table, "records": records}, indent=1))
    for row in table:
        peak = [f"{m / 2**30:.2f}" if m else "-" for m in row["measured_peak_allocated"]]
        ratio = row["measured_over_predicted"]
        print(
            f"{row['run']:<9} peak GiB/GPU {','.join(peak):<12} predicted "
            f"{row['predicted_bytes'] / 2**30:.2f} GiB  ratio "
            f"{'-' if ratio is None else f'{ratio:.3f}'}  step {row['step_s'] * 1e3:.1f} ms"
        )
        for site in (row["at_peak_rank0"] or {}).get("sites", [])[:6]:
            gib, where = site["bytes"] / 2**30, site["where"][:300]
            print(f"    {gib:7.3f} GiB in {site['blocks']:4d} blocks: {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
